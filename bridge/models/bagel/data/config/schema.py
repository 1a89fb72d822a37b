"""The config schema: packer knobs, the dataset registry and the top data config (re-exported by ``config``).

The grouped YAML (``configs/example.yaml``) is parsed in ``grouped_yaml``. It and the dataset-info registry keep the official BAGEL formats (spec ``bagel_packer.md`` §3), but are parsed
without mutating the input and with errors that name the file, group and key. ``BagelDataConfig`` is an
OmegaConf-structured dataclass, so YAML files and ``key=value`` overrides are type-checked and unknown keys
are rejected.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..watchdog.watch import DEFAULT_STALL_WARN_S, DEFAULT_TIMEOUT_S
from .grouped_yaml import (
    GROUP_KEYS,
    KNOWN_GROUPS,
    ConfigError,
    GroupConfig,
    is_int,
    is_number,
    read_mapping,
    load_grouped_yaml,
)

__all__ = [
    "GROUP_KEYS",
    "KNOWN_GROUPS",
    "OFFICIAL_NON_PACKER_KEYS",
    "DEFAULT_PARTITIONS",
    "ORDERS",
    "PREFETCH_STARTS",
    "REMOVED_ORDERS",
    "BagelDataConfig",
    "ConfigError",
    "DatasetInfoEntry",
    "GroupConfig",
    "PackerConfig",
    "ResolvedGroup",
    "load_config",
    "load_dataset_info",
    "load_grouped_yaml",
    "resolve_groups",
]

logger = logging.getLogger(__name__)

#: Values ``BagelDataConfig.prefetch_start`` accepts (``prefetch.START_METHODS``; kept here, prefetch is downstream).
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
#: Keys of the official ``PackedDataset(data_config, **packed_dataset_args)`` call that are not packer knobs
#: (the dataset's place in the world and its resume status): pass as ``PackerConfig.from_mapping(ignore=...)``
#: when reading an official config.
OFFICIAL_NON_PACKER_KEYS: tuple[str, ...] = ("grouped_datasets", "data_status", "local_rank", "num_workers",
                                             "world_size")
#: Registry fields each group's readers need besides ``data_dir``.
_REQUIRED_INFO = {"vlm_sft": ("jsonl_path",), "unified_edit": ("parquet_info_path",)}


# --------------------------------------------------------------------------------------------------
# Packer


@dataclass
class PackerConfig:
    """Every BagelPacker knob with the official defaults (``DataConfig`` + ``PackedDataset``).

    The one place these knobs and their defaults live: ``BagelPacker`` and its ``PackLayout`` take this object.
    """

    expected_num_tokens: int = 32768
    max_num_tokens_per_sample: int = 16384
    max_num_tokens: int = 36864
    prefer_buffer_before: int = 16384
    max_buffer_size: int = 50
    interpolate_pos: bool = False
    use_flex: bool = False
    text_cond_dropout_prob: float = 0.1
    vit_cond_dropout_prob: float = 0.4
    vae_cond_dropout_prob: float = 0.1
    vae_image_downsample: int = 16
    max_latent_size: int = 32
    vit_patch_size: int = 14
    max_num_patch_per_side: int = 70
    #: Not an official knob: a group whose samples are dropped as over-length this many times in a row, with
    #: none packed, raises ``DataStallError`` (the official loop would spin forever).
    max_consecutive_drops: int = 100
    #: Not an official knob (default off = the official loop): keep the sample an official flush discards
    #: (``flush_drop`` / ``flush_drop_buffered``) for the next pack, and never let mandatory samples overflow
    #: ``max_num_tokens`` (``packing.step``; docs/packing_ledger.md).
    lossless: bool = False

    def problems(self, where: str = "packer") -> list[str]:
        """Every value the packer cannot work with, one message per key (empty when valid)."""
        out: list[str] = []
        for name in ("expected_num_tokens", "max_num_tokens_per_sample", "max_num_tokens", "prefer_buffer_before",
                     "vae_image_downsample", "max_latent_size", "vit_patch_size", "max_num_patch_per_side",
                     "max_consecutive_drops"):
            v = getattr(self, name)
            if not is_int(v) or v <= 0:
                out.append(f"{where}.{name}: must be a positive integer, got {v!r}")
        if not is_int(self.max_buffer_size) or self.max_buffer_size < 0:
            out.append(f"{where}.max_buffer_size: must be a non-negative integer, got {self.max_buffer_size!r}")
        for name in ("interpolate_pos", "use_flex", "lossless"):
            if not isinstance(getattr(self, name), bool):
                out.append(f"{where}.{name}: must be a bool, got {getattr(self, name)!r}")
        for name in ("text_cond_dropout_prob", "vit_cond_dropout_prob", "vae_cond_dropout_prob"):
            v = getattr(self, name)
            if not is_number(v) or not 0.0 <= v <= 1.0:
                out.append(f"{where}.{name}: must be a probability in [0, 1], got {v!r}")
        if out:  # the cross-checks below need valid numbers
            return out
        if self.prefer_buffer_before >= self.max_num_tokens:
            out.append(f"{where}.prefer_buffer_before ({self.prefer_buffer_before}) must be smaller than "
                       f"max_num_tokens ({self.max_num_tokens})")
        if self.expected_num_tokens > self.max_num_tokens:
            out.append(f"{where}.expected_num_tokens ({self.expected_num_tokens}) exceeds max_num_tokens "
                       f"({self.max_num_tokens}): packs could never reach the target")
        if self.max_num_tokens_per_sample > self.max_num_tokens:
            out.append(f"{where}.max_num_tokens_per_sample ({self.max_num_tokens_per_sample}) exceeds "
                       f"max_num_tokens ({self.max_num_tokens}): such samples could never be packed")
        return out

    def validate(self, where: str = "packer") -> None:
        """Raise one ConfigError naming every invalid key (``problems``); warn about a risky combination."""
        problems = self.problems(where)
        if problems:
            raise ConfigError.of(problems, header=f"{where}: {len(problems)} invalid packer knobs")
        if self.prefer_buffer_before + self.max_num_tokens_per_sample > self.max_num_tokens:
            logger.warning("%s: prefer_buffer_before + max_num_tokens_per_sample > max_num_tokens: a buffered "
                           "sample can overflow a pack and is then discarded by the official flush", where)

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every packer knob name (the keys ``from_mapping`` accepts)."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, ignore: Sequence[str] = (),
                     where: str = "packer") -> "PackerConfig":
        """The knobs in ``values``, defaults for the rest; validated.

        A key that is neither a knob (``keys()``) nor named in ``ignore`` is a ``ConfigError`` (a misspelt
        knob would otherwise silently keep its default). Pass the official ``DataConfig`` /
        ``PackedDataset`` keys that are not packer knobs in ``ignore`` when reading an official config.
        """
        names = set(cls.keys())
        unknown = sorted(str(k) for k in values if k not in names and k not in ignore)
        if unknown:
            raise ConfigError(f"{where}: unknown packer key(s) {unknown} (known: {sorted(names)})")
        cfg = cls(**{k: v for k, v in values.items() if k in names})
        cfg.validate(where)
        return cfg


# --------------------------------------------------------------------------------------------------
# Dataset registry (official DATASET_INFO)


@dataclass
class DatasetInfoEntry:
    """One sub-dataset of the registry; ``energon_path`` is our converted Energon dataset directory."""

    data_dir: str
    jsonl_path: str | None = None
    parquet_info_path: str | None = None
    json_dir: str | None = None
    num_files: int | None = None
    num_total_samples: int | None = None
    energon_path: str | None = None


_INFO_FIELDS = {f.name: f for f in dataclasses.fields(DatasetInfoEntry)}


def _parse_info_entry(group: str, name: str, raw: Any, src: str) -> DatasetInfoEntry:
    where = f"{src}: {group}.{name}"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a mapping, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_INFO_FIELDS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown} (known: {sorted(_INFO_FIELDS)})")
    for key in ("data_dir", *_REQUIRED_INFO.get(group, ())):
        if not raw.get(key):
            raise ConfigError(f"{where}: missing required key {key!r}")
    for key, value in raw.items():
        if value is None:
            continue
        if key in ("num_files", "num_total_samples"):
            if not is_int(value) or value < 0:
                raise ConfigError(f"{where}: key {key!r} must be a non-negative integer, got {value!r}")
        elif not isinstance(value, str):
            raise ConfigError(f"{where}: key {key!r} must be a path string, got {value!r}")
    return DatasetInfoEntry(**raw)


def load_dataset_info(path_or_dict: str | os.PathLike | Mapping, *, source: str = "<dict>"
                      ) -> dict[str, dict[str, DatasetInfoEntry]]:
    """Parse the registry ``{group: {name: {data_dir, ...}}}`` from YAML/JSON or a mapping (not mutated).

    Paths are kept as written (the official code resolves them against the working directory).
    """
    data, src = read_mapping(path_or_dict, source)
    out: dict[str, dict[str, DatasetInfoEntry]] = {}
    problems: list[str] = []
    for group, entries in data.items():
        if group not in KNOWN_GROUPS:
            problems.append(f"{src}: unknown group {group!r} (known groups: {', '.join(KNOWN_GROUPS)})")
            continue
        if not isinstance(entries, dict):
            problems.append(f"{src}: group {group!r} must map dataset names to entries")
            continue
        out[group] = {}
        for name, raw in entries.items():
            try:
                out[group][str(name)] = _parse_info_entry(group, str(name), raw, src)
            except ConfigError as exc:
                problems.extend(exc.problems)
    if problems:
        raise ConfigError.of(problems, header=f"{src}: {len(problems)} registry entries are invalid")
    return out


@dataclass
class ResolvedGroup:
    """A group with its registry entries, in ``dataset_names`` order."""

    group: GroupConfig
    datasets: list[DatasetInfoEntry]


def resolve_groups(groups: Sequence[GroupConfig], dataset_info: Mapping[str, Mapping[str, DatasetInfoEntry]],
                   *, source: str = "dataset_info") -> list[ResolvedGroup]:
    """Look up every ``dataset_names`` entry in the registry; a missing group or name is a clear error."""
    out, problems = [], []
    for g in groups:
        if g.name not in dataset_info:
            problems.append(f"{source}: no entries for group {g.name!r} (groups present: {sorted(dataset_info)})")
            continue
        known = dataset_info[g.name]
        missing = [n for n in g.dataset_names if n not in known]
        if missing:
            problems.append(f"{source}: group {g.name!r}: dataset name(s) {missing} not registered "
                            f"(registered: {sorted(known)})")
            continue
        out.append(ResolvedGroup(group=g, datasets=[known[n] for n in g.dataset_names]))
    if problems:
        raise ConfigError.of(problems, header=f"{source}: {len(problems)} groups are not registered")
    return out


# --------------------------------------------------------------------------------------------------
# Top-level data config (OmegaConf)


@dataclass
class BagelDataConfig:
    """Everything the data pipeline needs: file paths, packer knobs, data seed, workers, tokenizer."""

    groups: str = "???"                 # grouped-datasets YAML (official example.yaml format)
    dataset_info: str = "???"           # registry YAML/JSON {group: {name: DatasetInfoEntry}}
    packer: PackerConfig = field(default_factory=PackerConfig)
    seed: int = 42                      # data seed: packer RNG streams (rank seed) and, unless data_seed is set,
                                        # the unit / sample order
    data_seed: int | None = None        # official set_epoch(data_seed) (the order of units / samples); None = seed
    order: str = "elastic"              # "elastic" (resumable on any DP size / num_workers; energon/readers/elastic.py)
                                        # or "official" (the official loader's stream, the parity order)
    partitions: int = DEFAULT_PARTITIONS  # elastic order: canonical partitions per group, fixed for the life of a run
                                        # (a group uses min(partitions, its selected samples); any DP size works)
    num_workers: int = 0                # Energon workers ("energon") / emulated DataLoader workers ("official", >= 1)
    prefetch: int = 0                   # packed batches produced ahead in a background process (0 = synchronous)
    prefetch_start: str = "fork"        # how that process starts: "fork" (fast start, torch single-threaded) or
                                        # "forkserver" (clean process, rebuilds the pipeline, torch uses threads)
    tokenizer: str | None = None        # None / "qwen2-offline" or a local tokenizer directory
    tokenizer_cache_dir: str | None = None
    stall_warn_s: float = DEFAULT_STALL_WARN_S  # data watchdog: one warning line per rank after this long without a
    timeout_s: float = DEFAULT_TIMEOUT_S        # read, and DataTimeoutError after this long (0 disables; watchdog/)

    def problems(self) -> list[str]:
        """Every invalid key of this config and its ``packer`` (one message per key; empty when valid)."""
        out = self.packer.problems("packer")
        if not is_int(self.seed) or self.seed < 0:
            out.append(f"seed: must be a non-negative integer, got {self.seed!r}")
        if not is_int(self.num_workers) or self.num_workers < 0:
            out.append(f"num_workers: must be a non-negative integer, got {self.num_workers!r}")
        if not is_int(self.partitions) or self.partitions < 1:
            out.append(f"partitions: must be a positive integer, got {self.partitions!r}")
        if self.data_seed is not None and (not is_int(self.data_seed) or self.data_seed < 0):
            out.append(f"data_seed: must be a non-negative integer or null, got {self.data_seed!r}")
        if self.order in REMOVED_ORDERS:
            out.append(f"order: {self.order!r} is not an order any more: {REMOVED_ORDERS[self.order]}")
        elif self.order not in ORDERS:
            out.append(f"order: must be one of {list(ORDERS)}, got {self.order!r}")
        elif self.order == "official" and is_int(self.num_workers) and self.num_workers < 1:
            out.append("num_workers: order 'official' needs num_workers >= 1 (the official DataLoader workers "
                       "it emulates; with 0 the official loader draws from the training process's own RNG, "
                       "which cannot be reproduced)")
        if not is_int(self.prefetch) or self.prefetch < 0:
            out.append(f"prefetch: must be a non-negative integer, got {self.prefetch!r}")
        if self.prefetch_start not in PREFETCH_STARTS:
            out.append(f"prefetch_start: must be one of {list(PREFETCH_STARTS)}, got {self.prefetch_start!r}")
        for key in ("stall_warn_s", "timeout_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                out.append(f"{key}: must be a number of seconds >= 0 (0 disables), got {value!r}")
        return out

    def validate(self) -> None:
        """Raise one ConfigError naming every invalid key of this config (its files: ``validate.validate_data``)."""
        problems = self.problems()
        if problems:
            raise ConfigError.of(problems, header=f"{len(problems)} invalid data config keys")
        self.packer.validate("packer")  # the warning for a risky combination

    @property
    def effective_data_seed(self) -> int:
        """``data_seed``, or ``seed`` when it is not set."""
        return self.seed if self.data_seed is None else self.data_seed

    @classmethod
    def from_omegaconf(cls, cfg: Any, *, source: str = "<config>") -> "BagelDataConfig":
        """Build from a DictConfig or plain mapping, checked against this schema."""
        return _to_config([cfg], source)


def structured_merge(schema: type, parts: Sequence[Any], source: str) -> Any:
    """Merge OmegaConf-compatible ``parts`` onto the dataclass ``schema``; errors name the source and key."""
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), *parts)
        return OmegaConf.to_object(merged)
    except MissingMandatoryValue as exc:
        raise ConfigError(f"{source}: required key {exc.full_key!r} is not set") from exc
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
        msg = getattr(exc, "msg", None) or str(exc)
        raise ConfigError(f"{source}: key {key!r}: {msg.splitlines()[0]}") from exc


def _to_config(parts: list[Any], source: str) -> BagelDataConfig:
    obj = structured_merge(BagelDataConfig, parts, source)
    assert isinstance(obj, BagelDataConfig)
    problems = obj.problems()
    if problems:
        raise ConfigError.of([f"{source}: {p}" for p in problems], header=f"{source}: {len(problems)} invalid keys")
    return obj


def load_config(yaml_path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> BagelDataConfig:
    """Load a ``BagelDataConfig`` from a YAML file merged with ``key=value`` dotlist overrides."""
    from omegaconf import OmegaConf

    parts: list[Any] = []
    sources = []
    if yaml_path is not None:
        data, src = read_mapping(yaml_path, str(yaml_path))
        parts.append(OmegaConf.create(data))
        sources.append(src)
    if overrides:
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"overrides: expected key=value, got {bad}")
        parts.append(OmegaConf.from_dotlist(list(overrides)))
        sources.append(f"overrides {list(overrides)}")
    return _to_config(parts, " + ".join(sources) or "<defaults>")
