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
    resolve_path,
)

__all__ = [
    "GROUP_KEYS",
    "KNOWN_GROUPS",
    "OFFICIAL_NON_PACKER_KEYS",
    "DATA_PATH_KEYS",
    "PACKER_BUDGET_KEYS",
    "DEFAULT_PARTITIONS",
    "ORDERS",
    "PREFETCH_STARTS",
    "REMOVED_ORDERS",
    "STRATEGIES",
    "BagelDataConfig",
    "BalanceConfig",
    "ValidDataConfig",
    "ConfigError",
    "CostConfig",
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
#: Values ``PackerConfig.strategy`` accepts: the official greedy loop (default, bit-exact) or the cost-balanced
#: loop (``packing.balance``).
STRATEGIES: tuple[str, ...] = ("official", "balanced")
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
#: The packer *budgets*: the ``data.packer.*`` knobs that only decide how the samples read are packed (how many
#: tokens a pack aims at / may hold, which sample is too long, how many samples wait in the overflow buffer or the
#: balanced pool), never which samples are read nor in which order. With ``data.resume_budget_change: true`` they
#: may change across a resume under ``data.order: elastic`` (docs/resume.md): the packer's waiting samples go back
#: to the readers. Everything else (dropout probabilities, image geometry, ``lossless``, ``strategy``, ``use_flex``
#: ...) changes the samples or the loop and stays part of the resume fingerprint.
PACKER_BUDGET_KEYS: tuple[str, ...] = ("expected_num_tokens", "max_num_tokens", "max_num_tokens_per_sample",
                                       "prefer_buffer_before", "max_buffer_size", "balance.target_tokens",
                                       "balance.lookahead", "balance.max_wait")
#: Keys of the official ``PackedDataset(data_config, **packed_dataset_args)`` call that are not packer knobs
#: (the dataset's place in the world and its resume status): pass as ``PackerConfig.from_mapping(ignore=...)``
#: when reading an official config.
OFFICIAL_NON_PACKER_KEYS: tuple[str, ...] = ("grouped_datasets", "data_status", "local_rank", "num_workers",
                                             "world_size")
#: ``BagelDataConfig`` keys that hold file paths: in a config file, relative to that file's directory (dotted:
#: the validation split's ``valid.groups`` / ``valid.dataset_info`` resolve exactly as training's do).
DATA_PATH_KEYS: tuple[str, ...] = ("groups", "dataset_info", "valid.groups", "valid.dataset_info")
#: Registry fields each group's readers need besides ``data_dir``.
_REQUIRED_INFO = {"vlm_sft": ("jsonl_path",), "unified_edit": ("parquet_info_path",)}


# --------------------------------------------------------------------------------------------------
# Packer

#: The risky packer budgets already warned about in this process (``PackerConfig.validate``).
_WARNED: set[tuple[int, int, int]] = set()


@dataclass
class CostConfig:
    """The model whose compute one pack costs (``packing.cost.CostModel``; ``data.packer.cost.*``).

    Defaults: BAGEL-7B, i.e. Qwen2-7B (hidden 3584, 28 layers, 28 heads, 4 KV heads, FFN 18944) with
    SigLIP-so400m/14 cut to 26 layers as BAGEL runs it (hidden 1152, FFN 4304). The FLOPs these give are
    derived in ``packing/cost.py``. ``vae_flops_per_token``: FLOPs of the (frozen, forward-only) VAE encoder per
    latent token, 0 = not counted (not derived here: measure it for your VAE and image sizes).
    """

    hidden_size: int = 3584
    num_layers: int = 28
    num_attention_heads: int = 28
    num_query_groups: int = 4
    ffn_hidden_size: int = 18944
    vit_hidden_size: int = 1152
    vit_num_layers: int = 26
    vit_ffn_hidden_size: int = 4304
    vae_flops_per_token: float = 0.0


@dataclass
class BalanceConfig:
    """Knobs of ``packer.strategy: balanced`` (``packing.balance``; ``data.packer.balance.*``).

    ``target_tokens``: the mean real tokens a balanced pack aims at; every pack's cost target is this many
    tokens at the stream's mean cost per token (None = ``(expected_num_tokens + max_num_tokens) / 2``).
    ``lookahead``: packs' worth of cost the look-ahead buffer is refilled to before each pack (at most
    ``max_buffer_size`` samples). ``max_wait``: packs after which a waiting sample is packed whenever the token cap
    allows, even past the cost target.
    """

    target_tokens: int | None = None
    lookahead: float = 3.0
    max_wait: int = 8


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
    #: Not an official knob: ``official`` (the official loop, default) or ``balanced`` (every pack close to one
    #: common compute target, so no data-parallel rank waits for another; ``packing.balance``, docs/packing.md).
    strategy: str = "official"
    #: ``strategy: balanced`` only: its target and waiting bound.
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    #: The model's dimensions for the compute estimate of a pack (the balanced strategy, the job's straggler
    #: telemetry and ``bagel-data stats``; ``packing.cost``). Never changes an official pack.
    cost: CostConfig = field(default_factory=CostConfig)

    def stream_identity(self) -> dict[str, Any]:
        """The knobs that decide the batch stream, for resume fingerprints: the official knobs, and under
        ``strategy: balanced`` also ``strategy: {name, balance, cost}`` (so a fingerprint difference names the
        strategy in every line). Under ``official`` the three keys only feed telemetry and are left out, so states
        saved before they existed still resume."""
        out = dataclasses.asdict(self)
        balance, cost = out.pop("balance"), out.pop("cost")
        del out["strategy"]
        if self.strategy != "official":
            out["strategy"] = {"name": self.strategy, "balance": balance, "cost": cost}
        return out

    @property
    def balanced_target_tokens(self) -> int:
        """``balance.target_tokens``, or ``(expected_num_tokens + max_num_tokens) // 2`` when it is null."""
        t = self.balance.target_tokens
        return int(t) if t is not None else (self.expected_num_tokens + self.max_num_tokens) // 2

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
        risky = (self.prefer_buffer_before, self.max_num_tokens_per_sample, self.max_num_tokens)
        if self.prefer_buffer_before + self.max_num_tokens_per_sample > self.max_num_tokens and risky not in _WARNED:
            _WARNED.add(risky)  # once per process (every validation pass and stage would repeat it)
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
        kw = {k: v for k, v in values.items() if k in names}
        for sub, sub_cls in (("balance", BalanceConfig), ("cost", CostConfig)):
            if isinstance(kw.get(sub), Mapping):
                sub_names = {f.name for f in dataclasses.fields(sub_cls)}
                bad = sorted(str(k) for k in kw[sub] if k not in sub_names)
                if bad:
                    raise ConfigError(f"{where}.{sub}: unknown key(s) {bad} (known: {sorted(sub_names)})")
                kw[sub] = sub_cls(**kw[sub])
        cfg = cls(**kw)
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


def load_dataset_info(path_or_dict: str | os.PathLike | Mapping, *, source: str = "<dict>",
                      base_dir: str | os.PathLike | None = None) -> dict[str, dict[str, DatasetInfoEntry]]:
    """Parse the registry ``{group: {name: {data_dir, ...}}}`` from YAML/JSON or a mapping (not mutated).

    A relative ``energon_path`` (ours) is resolved against ``base_dir``, by default the registry file's
    directory (a mapping: kept as written, i.e. relative to the working directory). The official raw paths
    (``data_dir``, ``jsonl_path``, ``parquet_info_path``) are kept as written: the official code, and
    ``bagel-data convert config --source-root``, resolve them.
    """
    if base_dir is None and not isinstance(path_or_dict, Mapping):
        base_dir = os.path.dirname(os.path.abspath(path_or_dict))
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
                entry = _parse_info_entry(group, str(name), raw, src)
                entry.energon_path = resolve_path(entry.energon_path, base_dir)
                out[group][str(name)] = entry
            except ConfigError as exc:
                problems.extend(exc.problems)
    if problems:
        raise ConfigError.of(problems, header=f"{src}: {len(problems)} registry entries are invalid")
    return out


def resolve_registry_paths(registry: dict, base_dir: str | os.PathLike) -> dict:
    """Resolve (in place) every relative ``energon_path`` of a registry mapping against ``base_dir``."""
    for entries in registry.values():
        for entry in (entries.values() if isinstance(entries, dict) else ()):
            if isinstance(entry, dict) and "energon_path" in entry:
                entry["energon_path"] = resolve_path(entry["energon_path"], base_dir)
    return registry


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
class ValidDataConfig:
    """The validation split (``data.valid``): its own grouped-datasets YAML and registry, in training's vocabulary.

    ``groups``: the official grouped YAML (a path or the mapping), required. ``dataset_info``: the registry (a path
    or the mapping); null = training's ``data.dataset_info`` (validation groups usually name held-out datasets of
    the same registry). Every other knob (packer, seed, order, partitions, workers, tokenizer) is training's: the
    validation stream is the training builder's stream over these groups, rebuilt from ``data.seed`` at every
    evaluation (``pipeline.valid.BagelValidLoader``). Validated by the same pass as training
    (``validate.validate_data``).
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
    truncated_images: str = "keep"      # keep (trained on as the official reader does, counted) | drop
                                        # (a mismatch: dropped as checksum_mismatch; a damaged shard stops the job)
    valid: ValidDataConfig | None = None  # the validation split {groups, dataset_info}; null = no validation

    def problems(self) -> list[str]:
        """Every invalid key of this config and its ``packer`` (one message per key; empty when valid)."""
        out = self.packer.problems("packer")
        for key in ("groups", "dataset_info", "valid.groups", "valid.dataset_info"):
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
        if not isinstance(self.verify_checksums, bool):
            out.append(f"verify_checksums: must be true or false, got {self.verify_checksums!r}")
        if not isinstance(self.fresh_stream, bool):
            out.append(f"fresh_stream: must be a bool (true/false), got {self.fresh_stream!r}")
        if not isinstance(self.resume_budget_change, bool):
            out.append(f"resume_budget_change: must be a bool (true/false), got {self.resume_budget_change!r}")
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
    def groups_source(self) -> str:
        """How messages name ``groups``: its path, or ``data.groups (mapping)``."""
        return "data.groups (mapping)" if isinstance(self.groups, Mapping) else str(self.groups)

    @property
    def dataset_info_source(self) -> str:
        """How messages name ``dataset_info``: its path, or ``data.dataset_info (mapping)``."""
        return "data.dataset_info (mapping)" if isinstance(self.dataset_info, Mapping) else str(self.dataset_info)

    @property
    def valid_groups_source(self) -> str:
        """How messages name ``valid.groups``: its path, or ``data.valid.groups (mapping)`` (``data.valid (not set)``
        without ``valid``)."""
        if self.valid is None:
            return "data.valid (not set)"
        groups = self.valid.groups
        return "data.valid.groups (mapping)" if isinstance(groups, Mapping) else str(groups)

    @property
    def valid_dataset_info_source(self) -> str:
        """How messages name the validation registry: ``valid.dataset_info``'s path or ``data.valid.dataset_info
        (mapping)``; training's (``dataset_info_source``) when it is null."""
        info = None if self.valid is None else self.valid.dataset_info
        if info is None:
            return self.dataset_info_source
        return "data.valid.dataset_info (mapping)" if isinstance(info, Mapping) else str(info)

    def valid_config(self) -> "BagelDataConfig":
        """The data config of the validation stream: this config with ``valid.groups`` / ``valid.dataset_info``
        (training's registry when null) as its groups and registry, no prefetch process (an evaluation reads a
        few batches and then stops), never ``fresh_stream``, no ``valid`` of its own. ``ValueError`` without
        ``valid``."""
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
        return _to_config([cfg], source)


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


def config_parts(path: str | os.PathLike | None, overrides: Sequence[str], path_keys: Sequence[str],
                 read: Any = None) -> tuple[list[Any], list[str]]:
    """The OmegaConf parts of a config file plus ``key=value`` overrides, and one name per part.

    ``path_keys`` (dotted) are resolved against the file's directory when relative (``resolve_path``);
    overrides are kept as typed (relative to the working directory). Each override is its own part, so an
    error names the one override at fault. ``read(path) -> dict`` reads the file (default ``read_mapping``).
    """
    from omegaconf import OmegaConf

    parts: list[Any] = []
    names: list[str] = []
    if path is not None:
        data = read(path) if read is not None else read_mapping(path, str(path))[0]
        base = os.path.dirname(os.path.abspath(path))
        for dotted in path_keys:
            *outer, last = dotted.split(".")
            node = data
            for k in outer:
                node = node.get(k) if isinstance(node, dict) else None
            if isinstance(node, dict) and last in node:
                node[last] = resolve_path(node[last], base)
                if last == "dataset_info" and isinstance(node[last], dict):  # an inline registry
                    resolve_registry_paths(node[last], base)
        parts.append(OmegaConf.create(data))
        names.append(str(path))
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"overrides: expected key=value, got {bad}")
    for o in overrides:
        parts.append(OmegaConf.from_dotlist([o]))
        names.append(f"override {o!r}")
    return parts, names


def _to_config(parts: list[Any], source: str | Sequence[str]) -> BagelDataConfig:
    obj = structured_merge(BagelDataConfig, parts, source)
    assert isinstance(obj, BagelDataConfig)
    problems = obj.problems()
    if problems:
        raise ConfigError.of(problems, header=f"{len(problems)} invalid data config keys")
    return obj


def load_config(yaml_path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> BagelDataConfig:
    """Load a ``BagelDataConfig`` from a YAML file merged with ``key=value`` dotlist overrides.

    Relative ``groups`` / ``dataset_info`` paths in the file are relative to the file's directory; in an
    override, to the working directory. Raises ``ConfigError`` naming the file or override and the key.
    """
    parts, names = config_parts(yaml_path, overrides, DATA_PATH_KEYS)
    return _to_config(parts, names or "<defaults>")
