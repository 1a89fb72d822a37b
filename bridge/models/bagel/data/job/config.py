"""The main job's configuration: the data config plus the Megatron-style training knobs.

One YAML file (``configs/demo.yaml`` by default) merged with Hydra/OmegaConf-style ``key=value``
overrides, checked against these dataclasses so an unknown or mistyped key is one clear error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..config import BagelDataConfig, ConfigError, structured_merge

__all__ = ["JobConfig", "TrainConfig", "load_job_config"]


@dataclass
class TrainConfig:
    """Megatron ``TrainingConfig`` / ``CheckpointConfig`` subset the CPU job honours."""

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

    def validate(self) -> None:
        for key in ("train_iters", "global_batch_size", "micro_batch_size", "log_interval"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"train.{key}: must be a positive integer, got {value!r}")
        if not isinstance(self.save_interval, int) or self.save_interval < 0:
            raise ConfigError(f"train.save_interval: must be an integer >= 0, got {self.save_interval!r}")


@dataclass
class JobConfig:
    """``data`` (the pipeline), ``train`` (steps, batch sizes, checkpoints) and the demo-data switch."""

    data: BagelDataConfig = field(default_factory=BagelDataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
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
        parts.append(OmegaConf.load(path))
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
