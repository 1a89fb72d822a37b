"""The data config: ``BagelDataConfig`` (``data.*``), its validation split ``ValidDataConfig``, the orders and
their defaults (re-exported by ``config``).

``BagelDataConfig`` is an OmegaConf-structured dataclass, so YAML files and ``key=value`` overrides (merged by
``structured_merge``) are type-checked and unknown keys are rejected. The packer's names the stages import are
re-exported here.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..watchdog.watch import DEFAULT_STALL_WARN_S, DEFAULT_TIMEOUT_S
from .grouped_yaml import ConfigError, FieldRule, field_problems, is_int, is_number
from .packer import (OFFICIAL_NON_PACKER_KEYS, PACKER_BUDGET_KEYS, STRATEGIES, BalanceConfig, CostConfig,
                     PackerConfig)

__all__ = ["DATA_PATH_KEYS", "DEFAULT_PARTITIONS", "ORDERS", "PREFETCH_STARTS", "REMOVED_ORDERS", "BagelDataConfig",
           "ValidDataConfig", "structured_merge", "to_config",
           # the packer's (``packer``), imported from here by the stages
           "OFFICIAL_NON_PACKER_KEYS", "PACKER_BUDGET_KEYS", "STRATEGIES", "BalanceConfig", "CostConfig",
           "PackerConfig"]

#: Values ``BagelDataConfig.prefetch_start`` accepts (``PrefetchStage(start_method=...)``).
PREFETCH_STARTS: tuple[str, ...] = ("fork", "forkserver")
#: Values ``BagelDataConfig.order`` accepts, the default first.
ORDERS: tuple[str, ...] = ("elastic", "official")
#: Orders earlier versions had, with what replaces them (refused in one line).
REMOVED_ORDERS: dict[str, str] = {
    "energon": "the DP-dependent 'energon' order was removed: 'elastic' (the default) reads as fast, resumes on any "
               "DP size, and trains small groups on large worlds (docs/elastic.md)",
}
#: Canonical partitions per group of the elastic order unless ``data.partitions`` says otherwise: one per rank of a
#: large group up to DP 8192 (a group uses ``min(partitions, its selected samples)``; any DP size works).
DEFAULT_PARTITIONS = 8192
#: ``BagelDataConfig`` keys that hold file paths: in a config file, relative to that file's directory (dotted:
#: the validation split's ``valid.groups`` / ``valid.dataset_info`` resolve exactly as training's do).
DATA_PATH_KEYS: tuple[str, ...] = ("groups", "dataset_info", "valid.groups", "valid.dataset_info")

_NON_NEGATIVE_INT = ("a non-negative integer", lambda v: is_int(v) and v >= 0)
_BOOL = ("a bool (true/false)", lambda v: isinstance(v, bool))
#: What ``BagelDataConfig.problems`` checks key by key (``grouped_yaml.field_problems``).
_DATA_RULES: tuple[FieldRule, ...] = (
    (("seed", "num_workers"), *_NON_NEGATIVE_INT),
    (("partitions",), "a positive integer", lambda v: is_int(v) and v >= 1),
    (("data_seed",), "a non-negative integer or null", lambda v: v is None or (is_int(v) and v >= 0)),
    (("order",), f"one of {list(ORDERS)}", lambda v: v in ORDERS or v in REMOVED_ORDERS),
    (("prefetch",), *_NON_NEGATIVE_INT),
    (("prefetch_start",), f"one of {list(PREFETCH_STARTS)}", lambda v: v in PREFETCH_STARTS),
    (("verify_checksums",), "true or false", lambda v: isinstance(v, bool)),
    (("fresh_stream", "resume_budget_change"), *_BOOL),
    (("stall_warn_s", "timeout_s"), "a number of seconds >= 0 (0 disables)", lambda v: is_number(v) and not v < 0),
    (("truncated_images",), "'keep' or 'drop'", lambda v: v in ("keep", "drop")),
)


@dataclass
class ValidDataConfig:
    """The validation split (``data.valid``): its own grouped-datasets YAML and registry, in training's vocabulary.

    ``groups``: the official grouped YAML (a path or the mapping), required. ``dataset_info``: the registry (a path or
    the mapping); null = training's ``data.dataset_info`` (validation groups usually name held-out datasets of the same
    registry). Every other knob (packer, seed, order, partitions, workers, tokenizer) is training's: the validation
    stream is the training builder's stream over these groups, rebuilt from ``data.seed`` at every evaluation
    (``pipeline.valid.BagelValidLoader``). Validated by the same pass as training (``validate.validate_data``).
    """

    groups: Any = "???"
    dataset_info: Any = None


@dataclass
class BagelDataConfig:
    """Everything the data pipeline needs: the groups and the registry, packer knobs, data seed, workers, tokenizer.

    ``groups`` and ``dataset_info`` are each a path (``str`` / ``os.PathLike``) to a YAML/JSON file or the
    mapping itself, so a training script can build the loader from its own config without writing files::

        BagelDataConfig(groups={"t2i_pretrain": {"dataset_names": ["laion"], "weight": 1.0, ...}},
                        dataset_info={"t2i_pretrain": {"laion": {"data_dir": "...", "energon_path": "..."}}})

    A relative ``energon_path`` in a registry mapping is relative to the working directory (in a file: to the
    file's directory).
    """

    # The grouped datasets (official example.yaml format) and the registry {group: {name: DatasetInfoEntry}}:
    # each a path to a YAML/JSON file or the mapping itself (typed Any for OmegaConf, which has no str | dict).
    groups: Any = "???"
    dataset_info: Any = "???"
    packer: PackerConfig = field(default_factory=PackerConfig)
    seed: int = 42                      # data seed: packer RNG streams (rank seed) and, unless data_seed is set,
                                        # the unit / sample order
    data_seed: int | None = None        # official set_epoch(data_seed) (the order of units / samples); None = seed
    order: str = "elastic"              # "elastic" (resumable on any DP size / num_workers; energon/readers/elastic.py)
                                        # or "official" (the official loader's stream, the parity order)
    partitions: int = DEFAULT_PARTITIONS  # elastic order: canonical partitions per group, fixed for the life of a run
                                        # (a group uses min(partitions, its selected samples); any DP size works)
    num_workers: int = 0                # read workers per rank; "official": emulated DataLoader workers (>= 1)
    prefetch: int = 0                   # packed batches produced ahead in a background process (0 = synchronous)
    prefetch_start: str = "fork"        # how that process starts: "fork" (fast start, torch single-threaded) or
                                        # "forkserver" (clean process, rebuilds the pipeline, torch uses threads)
    tokenizer: str | None = None        # None / "qwen2-offline" or a local tokenizer directory
    tokenizer_cache_dir: str | None = None
    fresh_stream: bool = False          # with a checkpoint to resume (train.load / Bridge's checkpoint.load): do not
                                        # restore the saved loader state, start the data stream fresh from data.seed
                                        # while the model resumes (a deliberate data change; one log line says so)
    resume_budget_change: bool = False  # elastic order: on a resume, accept changed packer budgets
                                        # (PACKER_BUDGET_KEYS): the packer's waiting samples go back to the readers,
                                        # whose cursors are kept, and the epoch goes on exactly once (docs/resume.md)
    stall_warn_s: float = DEFAULT_STALL_WARN_S  # data watchdog: one warning line per rank after this long without a
    timeout_s: float = DEFAULT_TIMEOUT_S        # read, and DataTimeoutError after this long (0 disables; watchdog/)
    verify_checksums: bool = True       # check every sample's bytes against the checksums recorded at conversion
                                        # (a mismatch: dropped as checksum_mismatch; a damaged shard stops the job)
    truncated_images: str = "keep"      # keep (trained on as the official reader does, counted) | drop
    valid: ValidDataConfig | None = None  # the validation split {groups, dataset_info}; null = no validation

    def problems(self) -> list[str]:
        """Every invalid key of this config and its ``packer`` (one message per key; empty when valid)."""
        out = self.packer.problems("packer")
        for key in DATA_PATH_KEYS:
            owner, _, name = key.rpartition(".")
            holder = self.valid if owner else self
            if holder is None:
                continue
            value = getattr(holder, name)
            if key == "valid.dataset_info" and value is None:  # training's registry
                continue
            if not isinstance(value, (str, os.PathLike, Mapping)) or (isinstance(value, str) and not value):
                out.append(f"{key}: must be a path to a YAML/JSON file or a mapping, got {type(value).__name__} "
                           f"{value!r:.80}")
        if self.valid is not None and not isinstance(self.valid, ValidDataConfig):
            out.append(f"valid: must be null or a mapping {{groups, dataset_info}}, got {self.valid!r:.80}")
        if self.order in REMOVED_ORDERS:
            out.append(f"order: {self.order!r} is not an order any more: {REMOVED_ORDERS[self.order]}")
        elif self.order == "official" and is_int(self.num_workers) and self.num_workers < 1:
            out.append("num_workers: order 'official' needs num_workers >= 1 (the official DataLoader workers "
                       "it emulates; with 0 the official loader draws from the training process's own RNG, "
                       "which cannot be reproduced)")
        return out + field_problems(self, _DATA_RULES)

    def validate(self) -> None:
        """Raise one ConfigError naming every invalid key of this config (its files: ``validate.validate_data``)."""
        problems = self.problems()
        if problems:
            raise ConfigError.of(problems, header=f"{len(problems)} invalid data config keys")
        self.packer.validate("packer")  # the warning for a risky combination

    @property
    def groups_source(self) -> str:
        """How messages name ``groups``: its path, or ``data.groups (mapping)``."""
        return _source(self.groups, "groups")

    @property
    def dataset_info_source(self) -> str:
        """How messages name ``dataset_info``: its path, or ``data.dataset_info (mapping)``."""
        return _source(self.dataset_info, "dataset_info")

    def valid_config(self) -> "BagelDataConfig":
        """The data config of the validation stream: this config with ``valid.groups`` / ``valid.dataset_info``
        (training's registry when null) as its groups and registry, no prefetch process (an evaluation reads a few
        batches and then stops), never ``fresh_stream``, no ``valid`` of its own. ``ValueError`` without ``valid``."""
        if self.valid is None:
            raise ValueError("valid_config: data.valid is not set")
        info = self.valid.dataset_info if self.valid.dataset_info is not None else self.dataset_info
        return dataclasses.replace(self, groups=self.valid.groups, dataset_info=info, prefetch=0, fresh_stream=False,
                                   valid=None)

    @property
    def effective_data_seed(self) -> int:
        """``data_seed``, or ``seed`` when it is not set."""
        return self.seed if self.data_seed is None else self.data_seed

    @classmethod
    def from_omegaconf(cls, cfg: Any, *, source: str = "<config>") -> "BagelDataConfig":
        """Build from a DictConfig or plain mapping, checked against this schema."""
        return to_config([cfg], source)


def _source(value: Any, key: str) -> str:
    """How messages name the file key ``data.<key>``: its path, or ``data.<key> (mapping)``."""
    return f"data.{key} (mapping)" if isinstance(value, Mapping) else str(value)


def structured_merge(schema: type, parts: Sequence[Any], source: str | Sequence[str]) -> Any:
    """Merge OmegaConf-compatible ``parts`` onto the dataclass ``schema``; errors name the part and key.

    ``source``: one name for all parts, or one name per part (a file path, ``override 'k=v'``): a key the
    schema refuses is reported with the name of the part that holds it, not with every part's name.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    names = [source] * len(parts) if isinstance(source, str) else list(source)
    base = OmegaConf.structured(schema)
    try:
        return OmegaConf.to_object(OmegaConf.merge(base, *parts))
    except MissingMandatoryValue as exc:
        where = " + ".join(dict.fromkeys(n for n in names if not n.startswith("override "))) or "the config"
        raise ConfigError(f"required key {exc.full_key!r} is not set (in {where} or a key=value override)") from exc
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
        msg = getattr(exc, "msg", None) or str(exc)
        culprit = names[-1] if names else "<defaults>"
        merged = base
        for name, part in zip(names, parts):  # the first part the schema refuses is the one to name
            try:
                merged = OmegaConf.merge(merged, part)
            except OmegaConfBaseException:
                culprit = name
                break
        raise ConfigError(f"{culprit}: key {key!r}: {msg.splitlines()[0]}") from exc


def to_config(parts: list[Any], source: str | Sequence[str]) -> BagelDataConfig:
    """The ``BagelDataConfig`` of OmegaConf ``parts`` (``structured_merge``), every invalid key in one
    ``ConfigError``."""
    obj = structured_merge(BagelDataConfig, parts, source)
    assert isinstance(obj, BagelDataConfig)
    problems = obj.problems()
    if problems:
        raise ConfigError.of(problems, header=f"{len(problems)} invalid data config keys")
    return obj
