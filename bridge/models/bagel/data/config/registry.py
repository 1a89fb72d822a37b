"""The official dataset registry (``DATASET_INFO``: ``{group: {name: {data_dir, ...}}}``) with our ``energon_path``,
and the groups of a grouped YAML resolved against it (``ResolvedGroup``).

Parsed without mutating the input; errors name the file, group, dataset and key.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .grouped_yaml import KNOWN_GROUPS, ConfigError, GroupConfig, is_int, read_mapping, resolve_path

__all__ = ["DatasetInfoEntry", "ResolvedGroup", "load_dataset_info", "resolve_groups", "resolve_registry_paths"]

#: Registry fields each group's readers need besides ``data_dir``.
_REQUIRED_INFO = {"vlm_sft": ("jsonl_path",), "unified_edit": ("parquet_info_path",)}


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


def resolve_registry_paths(registry: dict, base_dir: str | os.PathLike) -> None:
    """Resolve (in place) every relative ``energon_path`` of a registry mapping against ``base_dir``."""
    for entries in registry.values():
        for entry in (entries.values() if isinstance(entries, dict) else ()):
            if isinstance(entry, dict) and "energon_path" in entry:
                entry["energon_path"] = resolve_path(entry["energon_path"], base_dir)


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
