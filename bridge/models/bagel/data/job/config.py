"""The main job's configuration: the data config plus the Megatron-style training knobs.

One YAML file (``configs/demo.yaml`` by default) merged with Hydra/OmegaConf-style ``key=value``
overrides, checked against these dataclasses so an unknown or mistyped key is one clear error.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import yaml

from ..config import (DATA_PATH_KEYS, BagelDataConfig, ConfigError, ValidatedData, config_parts, structured_merge,
                      validate_data)
from ..config.grouped_yaml import field_problems, is_int
from ..config.validate import key_origin, path_problems, unknown_key_problems
from ..yaml_errors import yaml_problem

__all__ = ["JOB_PATH_KEYS", "JobConfig", "TrainConfig", "load_job_config", "resolve_load", "validate_job"]

logger = logging.getLogger(__name__)


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
    eval_interval: int = 0              # evaluate on data.valid every this many steps (0 = never; Megatron's name)
    eval_iters: int = 1                 # steps per evaluation: eval_iters x micro-batches per step batches per rank
    exit_after_step: int | None = None  # hard-exit after this step without the final save (simulated crash)
    progress: bool = True
    stop_at_epoch: int | None = None    # elastic order: end the run (checkpoint as at train_iters) after the first
                                        # step at which a group has completed this many epochs over the DP world
    tensor_model_parallel_size: int = 1     # TP peers of a DP replica read identical streams (no broadcast)
    pipeline_model_parallel_size: int = 1   # every PP stage of a replica reads the replica's stream
    context_parallel_size: int = 1          # CP peers read identical streams; DP excludes CP
    virtual_pipeline_model_parallel_size: int | None = None  # interleaved PP: needs PP >= 2; one shared iterator

    _PARALLEL = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
    _RULES = (  # FieldRule: (keys, what, ok)
        (("train_iters", "global_batch_size", "micro_batch_size", "log_interval", *_PARALLEL),
         "a positive integer", lambda v: is_int(v) and v > 0),
        (("stop_at_epoch",), "null or a positive integer (completed epochs)",
         lambda v: v is None or is_int(v) and v > 0),
        (("save_interval", "eval_interval", "eval_iters"), "an integer >= 0", lambda v: is_int(v) and v >= 0),
        (("virtual_pipeline_model_parallel_size",), "null or an integer >= 2",
         lambda v: v is None or isinstance(v, int) and v >= 2),
    )

    def problems(self) -> list[str]:
        """Every invalid ``train`` knob, one message per key (empty when valid); the layout needs
        ``parallel_layout``."""
        out = field_problems(self, self._RULES[:1], "train.")
        if self.micro_batch_size != 1 and is_int(self.micro_batch_size) and self.micro_batch_size > 0:
            # the provider refuses collation: a micro-batch is one packed sequence
            out.append(f"train.micro_batch_size: must be 1 for BAGEL (each micro-batch is one packed sequence of up "
                       f"to data.packer.max_num_tokens tokens), got {self.micro_batch_size}; for more tokens per step "
                       "raise data.packer.expected_num_tokens/max_num_tokens or train.global_batch_size")
        out += field_problems(self, self._RULES[1:], "train.")
        vpp, pp = self.virtual_pipeline_model_parallel_size, self.pipeline_model_parallel_size
        if isinstance(vpp, int) and vpp >= 2 and isinstance(pp, int) and pp < 2:
            out.append("train.virtual_pipeline_model_parallel_size: the interleaved pipeline schedule needs "
                       f"train.pipeline_model_parallel_size >= 2, got {pp}")
        return out

    def validate(self) -> None:
        """Raise one ``ConfigError`` naming every invalid knob (``problems``)."""
        problems = self.problems()
        if problems:
            raise ConfigError.of(problems, header=f"train: {len(problems)} invalid keys")

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


#: ``JobConfig`` keys that hold file paths read by the data pipeline: in a config file, relative to that file's
#: directory. ``train.save`` / ``load`` / ``tensorboard_dir`` / ``digest_log`` stay relative to the working
#: directory, as Megatron's own paths are.
JOB_PATH_KEYS: tuple[str, ...] = (*(f"data.{k}" for k in DATA_PATH_KEYS), "demo_data")


def _read_yaml(path: str | os.PathLike) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} does not exist")
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {yaml_problem(exc)}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


#: The config keys naming the files ``validate_job`` reads (checked first, each named with where it was set).
_FILE_KEYS = ("data.groups", "data.dataset_info", "data.valid.groups", "data.valid.dataset_info")


def load_job_config(path: str | os.PathLike | None, overrides: Sequence[str] = (), *,
                    defer_key_problems: bool = False) -> JobConfig:
    """Merge a YAML file and ``key=value`` overrides into a ``JobConfig`` (errors name the file or override and
    the key).

    Relative ``data.groups``, ``data.dataset_info`` and ``demo_data`` in the file resolve against the file's
    directory (``JOB_PATH_KEYS``); typed in an override, against the working directory. Only the schema (known
    keys, types) is checked here: every value and file goes through ``validate_job``, one pass, every problem
    in one ``ConfigError``. ``defer_key_problems`` (the launcher): unknown keys are left out of the merge and
    reported by ``validate_job`` with every other problem of the launch, instead of raised here.
    """
    parts, names = config_parts(path, overrides, JOB_PATH_KEYS, read=_read_yaml)
    key_problems: list[str] = []
    if defer_key_problems:
        for i, (part, name) in enumerate(zip(parts, names)):
            found, parts[i] = unknown_key_problems(JobConfig, part, name)
            key_problems += found
    cfg = structured_merge(JobConfig, parts, names or "<defaults>")
    assert isinstance(cfg, JobConfig)
    # Not dataclass fields (the schema stays the documented keys): what validate_job reports with the rest.
    cfg.__dict__["_key_problems"] = key_problems
    cfg.__dict__["_origins"] = {key: key_origin(parts, names, key) for key in _FILE_KEYS}
    return cfg


def launch_problems(cfg: JobConfig, world_size: int | None) -> tuple[list[str], set[str]]:
    """What ``validate_job`` reports before the data checks: the unknown keys ``load_job_config`` deferred, the
    config's files that do not exist (each once, named by its key and the config file or override that set it)
    and, with ``world_size`` (the launcher: ``WORLD_SIZE``), the parallel layout (``TrainConfig.parallel_layout``:
    the world size against TP x PP x CP, the global batch size against micro-batch x DP). Returns the messages and
    the missing paths."""
    problems = list(cfg.__dict__.get("_key_problems", ()))
    origins = cfg.__dict__.get("_origins", {})
    data, valid = cfg.data, cfg.data.valid
    paths = {"data.groups": data.groups, "data.dataset_info": data.dataset_info,
             "data.valid.groups": None if valid is None else valid.groups,
             "data.valid.dataset_info": None if valid is None else valid.dataset_info}
    found, missing = path_problems({k: (v, origins.get(k)) for k, v in paths.items()})
    problems += found
    if world_size is not None and not cfg.train.problems():
        try:
            cfg.train.parallel_layout(world_size)
        except ConfigError as exc:
            problems.append(f"{exc} (WORLD_SIZE {world_size})")
    return problems, missing


def validate_job(cfg: JobConfig, *, budgets: str = "error", readers: bool = True,
                 world_size: int | None = None) -> ValidatedData:
    """The job's one validation pass: the ``train`` knobs and ``validate_data`` (the data knobs, the grouped
    YAML, the registry, the datasets, the budgets), every problem in one ``ConfigError``.

    ``budgets`` / ``readers``: as for ``validate_data`` (``bagel-data stats`` reports budgets instead of
    refusing them). ``train.eval_interval`` and ``train.eval_iters`` > 0 without ``data.valid`` is a problem too
    (nothing to evaluate on).
    ``launch_problems`` come first: unknown keys (``load_job_config(defer_key_problems=True)``), missing files named
    by their key (the data checks' own "cannot read" lines for them are left out: said once), and with
    ``world_size`` the parallel layout. Returns the ``ValidatedData`` to build the loader from.
    """
    first, missing = launch_problems(cfg, world_size)
    problems = first + cfg.train.problems()
    if cfg.train.stop_at_epoch is not None and cfg.data.order == "official":
        problems.append("train.stop_at_epoch: needs data.order 'elastic' (the official order reads every worker's "
                        "files round and round: it has no epoch of the whole DP world to stop at)")
    interval, iters = cfg.train.eval_interval, cfg.train.eval_iters
    if isinstance(interval, int) and interval > 0 and isinstance(iters, int) and iters > 0 and cfg.data.valid is None:
        problems.append(f"train.eval_interval: {interval} asks for an evaluation every {interval} steps but data.valid "
                        "is not set: set data.valid.groups (the validation split) or train.eval_interval=0")
    problems += resolve_load(cfg.train)
    try:
        return validate_data(cfg.data, budgets=budgets, readers=readers, prior_problems=problems)
    except ConfigError as exc:
        said = set(exc.problems)
        kept = [p for p in exc.problems if not any(f"{path}: cannot read" in p for path in missing)
                and not (p.startswith("data.valid: ") and p[len("data.valid: "):] in said)]  # training's, again
        if kept == exc.problems and not first:
            raise
        # named by the config file the job was loaded from (the first part holding a file key)
        origins = [o for o in cfg.__dict__.get("_origins", {}).values() if o and not o.startswith("override ")]
        name = origins[0] if origins else "the job config"
        raise ConfigError.of(kept, header=f"{name}: {len(kept)} problem(s) in this launch") from None


def resolve_load(train: TrainConfig) -> list[str]:
    """``train.load`` on a root without a checkpoint starts the job from scratch, as Megatron's ``--load`` does:
    ``train.load`` is set to None and one INFO line (rank 0, ``RANK`` of the environment) says why
    (``checkpoint.fresh_start_reason``), so ``train.save=X train.load=X`` both starts and resumes a job (requeue
    scripts, ``torchrun --max-restarts``). Returns the problem (one message, for the validation pass) when the root
    holds something that is not a checkpoint; empty otherwise."""
    from .checkpoint import fresh_start_reason

    if not train.load:
        return []
    try:
        reason = fresh_start_reason(train.load)
    except ConfigError as exc:
        return [str(exc)]
    if reason is not None:
        if os.environ.get("RANK", "0") == "0":
            logger.info("train.load: no checkpoint to resume (%s): starting from scratch", reason)
        train.load = None
    return []
