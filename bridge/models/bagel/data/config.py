"""Configuration: packer knobs, the official grouped-dataset YAML, the dataset registry and the top config.

The grouped YAML (``configs/example.yaml``; parsed in ``grouped_yaml``, re-exported here) and the
dataset-info registry keep the official BAGEL formats (spec ``bagel_packer.md`` §3), but are parsed
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

from .grouped_yaml import (
    GROUP_KEYS,
    KNOWN_GROUPS,
    ConfigError,
    GroupConfig,
    _is_int,
    _is_number,
    _read_mapping,
    load_grouped_yaml,
)

__all__ = [
    "GROUP_KEYS",
    "KNOWN_GROUPS",
    "ORDERS",
    "PREFETCH_STARTS",
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
#: Values ``BagelDataConfig.order`` accepts.
ORDERS: tuple[str, ...] = ("energon", "official")
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

    def validate(self, where: str = "packer") -> None:
        """Raise ConfigError for values the packer cannot work with (names the key)."""
        for name in ("expected_num_tokens", "max_num_tokens_per_sample", "max_num_tokens", "prefer_buffer_before",
                     "vae_image_downsample", "max_latent_size", "vit_patch_size", "max_num_patch_per_side",
                     "max_consecutive_drops"):
            v = getattr(self, name)
            if not _is_int(v) or v <= 0:
                raise ConfigError(f"{where}.{name}: must be a positive integer, got {v!r}")
        if not _is_int(self.max_buffer_size) or self.max_buffer_size < 0:
            raise ConfigError(f"{where}.max_buffer_size: must be a non-negative integer, got {self.max_buffer_size!r}")
        for name in ("interpolate_pos", "use_flex"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{where}.{name}: must be a bool, got {getattr(self, name)!r}")
        for name in ("text_cond_dropout_prob", "vit_cond_dropout_prob", "vae_cond_dropout_prob"):
            v = getattr(self, name)
            if not _is_number(v) or not 0.0 <= v <= 1.0:
                raise ConfigError(f"{where}.{name}: must be a probability in [0, 1], got {v!r}")
        if self.prefer_buffer_before >= self.max_num_tokens:
            raise ConfigError(f"{where}.prefer_buffer_before ({self.prefer_buffer_before}) must be smaller than "
                              f"max_num_tokens ({self.max_num_tokens})")
        if self.expected_num_tokens > self.max_num_tokens:
            raise ConfigError(f"{where}.expected_num_tokens ({self.expected_num_tokens}) exceeds max_num_tokens "
                              f"({self.max_num_tokens}): packs could never reach the target")
        if self.max_num_tokens_per_sample > self.max_num_tokens:
            raise ConfigError(f"{where}.max_num_tokens_per_sample ({self.max_num_tokens_per_sample}) exceeds "
                              f"max_num_tokens ({self.max_num_tokens}): such samples could never be packed")
        if self.prefer_buffer_before + self.max_num_tokens_per_sample > self.max_num_tokens:
            logger.warning("%s: prefer_buffer_before + max_num_tokens_per_sample > max_num_tokens: a buffered "
                           "sample can overflow a pack and is then discarded by the official flush", where)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "PackerConfig":
        """The knobs present in ``values`` (other keys ignored), defaults for the rest; validated."""
        names = {f.name for f in dataclasses.fields(cls)}
        cfg = cls(**{k: v for k, v in values.items() if k in names})
        cfg.validate()
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
            if not _is_int(value) or value < 0:
                raise ConfigError(f"{where}: key {key!r} must be a non-negative integer, got {value!r}")
        elif not isinstance(value, str):
            raise ConfigError(f"{where}: key {key!r} must be a path string, got {value!r}")
    return DatasetInfoEntry(**raw)


def load_dataset_info(path_or_dict: str | os.PathLike | Mapping, *, source: str = "<dict>"
                      ) -> dict[str, dict[str, DatasetInfoEntry]]:
    """Parse the registry ``{group: {name: {data_dir, ...}}}`` from YAML/JSON or a mapping (not mutated).

    Paths are kept as written (the official code resolves them against the working directory).
    """
    data, src = _read_mapping(path_or_dict, source)
    out: dict[str, dict[str, DatasetInfoEntry]] = {}
    for group, entries in data.items():
        if group not in KNOWN_GROUPS:
            raise ConfigError(f"{src}: unknown group {group!r} (known groups: {', '.join(KNOWN_GROUPS)})")
        if not isinstance(entries, dict):
            raise ConfigError(f"{src}: group {group!r} must map dataset names to entries")
        out[group] = {str(name): _parse_info_entry(group, str(name), raw, src) for name, raw in entries.items()}
    return out


@dataclass
class ResolvedGroup:
    """A group with its registry entries, in ``dataset_names`` order."""

    group: GroupConfig
    datasets: list[DatasetInfoEntry]


def resolve_groups(groups: Sequence[GroupConfig], dataset_info: Mapping[str, Mapping[str, DatasetInfoEntry]],
                   *, source: str = "dataset_info") -> list[ResolvedGroup]:
    """Look up every ``dataset_names`` entry in the registry; a missing group or name is a clear error."""
    out = []
    for g in groups:
        if g.name not in dataset_info:
            raise ConfigError(f"{source}: no entries for group {g.name!r} (groups present: {sorted(dataset_info)})")
        known = dataset_info[g.name]
        missing = [n for n in g.dataset_names if n not in known]
        if missing:
            raise ConfigError(f"{source}: group {g.name!r}: dataset name(s) {missing} not registered "
                              f"(registered: {sorted(known)})")
        out.append(ResolvedGroup(group=g, datasets=[known[n] for n in g.dataset_names]))
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
    data_seed: int | None = None        # official set_epoch(data_seed) (unit order; Energon seed_offset); None = seed
    order: str = "energon"              # "energon" (Energon reader order) or "official" (the official loader's stream)
    num_workers: int = 0                # Energon workers ("energon") / emulated DataLoader workers ("official", >= 1)
    prefetch: int = 0                   # packed batches produced ahead in a background process (0 = synchronous)
    prefetch_start: str = "fork"        # how that process starts: "fork" (fast start, torch single-threaded) or
                                        # "forkserver" (clean process, rebuilds the pipeline, torch uses threads)
    tokenizer: str | None = None        # None / "qwen2-offline" or a local tokenizer directory
    tokenizer_cache_dir: str | None = None
    stall_warn_s: float = 120.0         # data watchdog: one warning line per rank after this long without a read
    timeout_s: float = 480.0            # ... and DataTimeoutError after this long (0 disables; see watchdog.py)

    def validate(self) -> None:
        """Raise ConfigError for invalid values (names the key)."""
        self.packer.validate("packer")
        if not _is_int(self.seed) or self.seed < 0:
            raise ConfigError(f"seed: must be a non-negative integer, got {self.seed!r}")
        if not _is_int(self.num_workers) or self.num_workers < 0:
            raise ConfigError(f"num_workers: must be a non-negative integer, got {self.num_workers!r}")
        if self.data_seed is not None and (not _is_int(self.data_seed) or self.data_seed < 0):
            raise ConfigError(f"data_seed: must be a non-negative integer or null, got {self.data_seed!r}")
        if self.order not in ORDERS:
            raise ConfigError(f"order: must be one of {list(ORDERS)}, got {self.order!r}")
        if self.order == "official" and self.num_workers < 1:
            raise ConfigError("num_workers: order 'official' needs num_workers >= 1 (the official DataLoader workers "
                              "it emulates; with 0 the official loader draws from the training process's own RNG, "
                              "which cannot be reproduced)")
        if not _is_int(self.prefetch) or self.prefetch < 0:
            raise ConfigError(f"prefetch: must be a non-negative integer, got {self.prefetch!r}")
        if self.prefetch_start not in PREFETCH_STARTS:
            raise ConfigError(f"prefetch_start: must be one of {list(PREFETCH_STARTS)}, got {self.prefetch_start!r}")
        for key in ("stall_warn_s", "timeout_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{key}: must be a number of seconds >= 0 (0 disables), got {value!r}")

    @property
    def effective_data_seed(self) -> int:
        """``data_seed``, or ``seed`` when it is not set."""
        return self.seed if self.data_seed is None else self.data_seed

    def load_groups(self) -> list[ResolvedGroup]:
        """Load and cross-check the grouped YAML and the registry named by this config.

        Also checks the packer budgets against the groups' transforms (``budgets.check_budgets``): raises
        ConfigError where they cannot work, logs a warning where they may drop much.
        """
        from .budgets import check_budgets

        groups = load_grouped_yaml(self.groups)
        resolved = resolve_groups(groups, load_dataset_info(self.dataset_info), source=str(self.dataset_info))
        check_budgets(self.packer, groups, source=str(self.groups), official=self.order == "official")
        return resolved

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
    try:
        obj.validate()
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from exc
    return obj


def load_config(yaml_path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> BagelDataConfig:
    """Load a ``BagelDataConfig`` from a YAML file merged with ``key=value`` dotlist overrides."""
    from omegaconf import OmegaConf

    parts: list[Any] = []
    sources = []
    if yaml_path is not None:
        data, src = _read_mapping(yaml_path, str(yaml_path))
        parts.append(OmegaConf.create(data))
        sources.append(src)
    if overrides:
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"overrides: expected key=value, got {bad}")
        parts.append(OmegaConf.from_dotlist(list(overrides)))
        sources.append(f"overrides {list(overrides)}")
    return _to_config(parts, " + ".join(sources) or "<defaults>")
