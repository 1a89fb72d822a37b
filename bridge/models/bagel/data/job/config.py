"""The main job's configuration: the data config plus the Megatron-style training knobs.

One YAML file (``configs/demo.yaml`` by default) merged with Hydra/OmegaConf-style ``key=value``
overrides, checked against these dataclasses so an unknown or mistyped key is one clear error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import yaml

from ..config import BagelDataConfig, ConfigError, structured_merge
from ..yaml_errors import yaml_problem

__all__ = ["JobConfig", "TrainConfig", "load_job_config"]


@dataclass
class TrainConfig:
    """Megatron ``TrainingConfig`` / ``CheckpointConfig`` / model-parallel subset the CPU job honours.

    Parallel layout (Megatron-Core ``initialize_model_parallel``): world size = TP × CP × DP × PP, so
    ``DP = world_size / (tensor_model_parallel_size × pipeline_model_parallel_size × context_parallel_size)``;
    the job never uses DP = world size, it reads DP rank/size from Megatron's own ``dp`` group.
    """

    train_iters: int = 8
    global_batch_size: int = 2          # BAGEL: GBS = DP with MBS 1 -> one packed batch per rank per step
    micro_batch_size: int = 1
    save: str | None = None             # checkpoint root; loader state goes to {save}/energon/iter_NNNNNNN/
    load: str | None = None             # resume from this checkpoint root
    save_interval: int = 0              # 0 = only at the end
    log_interval: int = 1
    tensorboard_dir: str | None = None
    digest_log: str | None = None       # JSONL: one sha256 per batch per rank (resume verification)
    exit_after_step: int | None = None  # hard-exit after this step without the final save (simulated crash)
    progress: bool = True
    tensor_model_parallel_size: int = 1     # TP peers of a DP replica read identical streams (no broadcast)
    pipeline_model_parallel_size: int = 1   # every PP stage of a replica reads the replica's stream
    context_parallel_size: int = 1          # CP peers read identical streams; DP excludes CP
    virtual_pipeline_model_parallel_size: int | None = None  # interleaved PP: needs PP >= 2; one shared iterator

    _PARALLEL = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")

    def validate(self) -> None:
        """Check every knob on its own (``ConfigError`` naming the key); the layout needs ``parallel_layout``."""
        for key in ("train_iters", "global_batch_size", "micro_batch_size", "log_interval", *self._PARALLEL):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"train.{key}: must be a positive integer, got {value!r}")
        if self.micro_batch_size != 1:  # the provider refuses collation: a micro-batch is one packed sequence
            raise ConfigError(f"train.micro_batch_size: must be 1 for BAGEL (each micro-batch is one packed sequence "
                              f"of up to data.packer.max_num_tokens tokens), got {self.micro_batch_size}; for more "
                              "tokens per step raise data.packer.expected_num_tokens/max_num_tokens or "
                              "train.global_batch_size")
        if not isinstance(self.save_interval, int) or self.save_interval < 0:
            raise ConfigError(f"train.save_interval: must be an integer >= 0, got {self.save_interval!r}")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None:
            if not isinstance(vpp, int) or vpp < 2:
                raise ConfigError(f"train.virtual_pipeline_model_parallel_size: must be null or an integer >= 2, "
                                  f"got {vpp!r}")
            if self.pipeline_model_parallel_size < 2:
                raise ConfigError("train.virtual_pipeline_model_parallel_size: the interleaved pipeline schedule "
                                  f"needs train.pipeline_model_parallel_size >= 2, got "
                                  f"{self.pipeline_model_parallel_size}")

    def parallel_layout(self, world_size: int) -> dict[str, int]:
        """The Megatron layout for ``world_size`` ranks: ``{"tp", "pp", "cp", "dp", "num_microbatches"}``.

        ``dp = world_size / (tp × pp × cp)``; ``num_microbatches = global_batch_size / (micro_batch_size × dp)``
        packed micro-batches pulled per rank per step. Raises ``ConfigError`` (one line naming the keys) when
        the world size is not a multiple of ``tp × pp × cp``, the global batch is not a multiple of
        ``micro_batch_size × dp``, or an interleaved schedule gets fewer micro-batches than PP stages
        (Megatron-Core refuses ``microbatch_group_size_per_vp_stage`` (= PP) > ``num_microbatches``).
        """
        self.validate()
        tp, pp, cp = (getattr(self, k) for k in self._PARALLEL)
        model_parallel = tp * pp * cp
        if world_size % model_parallel:
            raise ConfigError(f"train: world size {world_size} is not divisible by tensor_model_parallel_size {tp} "
                              f"x pipeline_model_parallel_size {pp} x context_parallel_size {cp} = {model_parallel}")
        dp = world_size // model_parallel
        if self.global_batch_size % (self.micro_batch_size * dp):
            raise ConfigError(f"train.global_batch_size {self.global_batch_size} is not divisible by micro_batch_size "
                              f"{self.micro_batch_size} x data-parallel size {dp} (world {world_size} = TP {tp} x "
                              f"PP {pp} x CP {cp} x DP {dp})")
        num_micro = self.global_batch_size // (self.micro_batch_size * dp)
        if self.virtual_pipeline_model_parallel_size is not None and num_micro < pp:
            raise ConfigError(f"train.virtual_pipeline_model_parallel_size: the interleaved schedule needs at least "
                              f"pipeline_model_parallel_size={pp} micro-batches per step, got {num_micro} "
                              f"(global_batch_size {self.global_batch_size} / (micro_batch_size "
                              f"{self.micro_batch_size} x DP {dp}))")
        return {"tp": tp, "pp": pp, "cp": cp, "dp": dp, "num_microbatches": num_micro}


@dataclass
class JobConfig:
    """``data`` (the pipeline), ``train`` (steps, batch sizes, checkpoints), ``model`` and the demo-data switch.

    ``model`` is read by the launcher (``bridge.models.bagel.launch``), which checks it against the model
    package's schema (``model.config.BagelModelConfig``): this data package never imports a model. Empty or
    ``model.name: null`` = a data-only job.
    """

    data: BagelDataConfig = field(default_factory=BagelDataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    model: dict[str, Any] = field(default_factory=dict)
    demo_data: str | None = None        # generate the embedded demo dataset here first if it is missing
    demo_seed: int = 0


def load_job_config(path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> JobConfig:
    """Merge a YAML file and ``key=value`` overrides into a validated ``JobConfig`` (errors name the key)."""
    from omegaconf import OmegaConf

    source = " + ".join(([str(path)] if path else []) + ([f"overrides {list(overrides)}"] if overrides else []))
    parts: list[Any] = []
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path} does not exist")
        try:
            parts.append(OmegaConf.load(path))
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {yaml_problem(exc)}") from exc
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"overrides: expected key=value, got {bad}")
    if overrides:
        parts.append(OmegaConf.from_dotlist(list(overrides)))
    cfg = structured_merge(JobConfig, parts, source or "<defaults>")
    assert isinstance(cfg, JobConfig)
    try:
        cfg.data.validate()
        cfg.train.validate()
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from exc
    return cfg
