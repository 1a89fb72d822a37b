"""Converter from the official BAGEL raw formats to Energon crude WebDatasets (layout: see ``layout.py``).

Every row the official reader can read becomes exactly one sample, keyed ``%08d`` by its index, with the
original image bytes and a ``meta.json`` holding the official coordinate; the manifest maps coordinates to
sample indices so a reader can reproduce the official unit order. Output is deterministic byte for byte
(shards and manifest); ``.nv-meta`` is written by Energon's own ``prepare_dataset``.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import sys
import tarfile
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from .formats import ConvertError, EditReader, RawSample, ScanLog, T2IReader, VlmReader, record_problem
from ..energon.layout import (
    DEFAULT_SAMPLES_PER_SHARD, EDIT, GROUPS, MANIFEST_FORMAT, MANIFEST_NAME, META_PART, SHARDS_DIR, T2I, VLM,
    crude_dataset_yaml, dataset_dir, image_part, sample_key, shard_relpath, upgrade_manifest_v1,
)

logger = logging.getLogger(__name__)

__all__ = ["ConvertError", "ConvertSummary", "convert_group", "convert_t2i", "convert_edit", "convert_vlm",
           "convert_from_config", "dumps_json"]


@dataclass
class ConvertSummary:
    """Result of converting one sub-dataset."""

    group: str
    dataset_name: str
    path: str
    samples: int = 0
    shards: int = 0
    bytes: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def dumps_json(obj: Any) -> bytes:
    """Canonical JSON bytes (sorted keys, no whitespace, UTF-8): the same object always gives the same bytes."""
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = size, 0, 0o644, 0, 0, "", ""
    return ti


class _ShardWriter:
    """Writes samples into ``shards/shard-NNNNNN.tar`` with at most ``per_shard`` samples each."""

    def __init__(self, root: str, per_shard: int) -> None:
        self.root, self.per_shard = root, per_shard
        self.shards: list[dict[str, Any]] = []
        self.bytes = 0
        self._tar: tarfile.TarFile | None = None
        os.makedirs(os.path.join(root, SHARDS_DIR))

    def add(self, key: str, parts: Iterable[tuple[str, bytes]]) -> None:
        if self._tar is None or self.shards[-1]["count"] >= self.per_shard:
            self._close_current()
            rel = shard_relpath(len(self.shards))
            self._tar = tarfile.open(os.path.join(self.root, rel), "w", format=tarfile.GNU_FORMAT)
            self.shards.append({"path": rel, "count": 0})
        for name, data in parts:
            self._tar.addfile(_tarinfo(f"{key}.{name}", len(data)), io.BytesIO(data))
        self.shards[-1]["count"] += 1

    def _close_current(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self.bytes += os.path.getsize(os.path.join(self.root, self.shards[-1]["path"]))
            self._tar = None

    def close(self) -> None:
        self._close_current()


def _prepare_output(ds_dir: str, overwrite: bool) -> str:
    """Check the target is absent or empty (unless ``overwrite``); return a fresh sibling staging directory."""
    if os.path.exists(ds_dir) and (not os.path.isdir(ds_dir) or os.listdir(ds_dir)) and not overwrite:
        raise ConvertError(f"{ds_dir}: output directory is not empty (pass overwrite=True / --overwrite to replace it)")
    staging = ds_dir.rstrip(os.sep) + ".partial"
    if os.path.exists(staging):
        shutil.rmtree(staging)
    os.makedirs(staging)
    return staging


def _energon_prepare(root: str, shard_paths: list[str], group: str) -> None:
    """Index the shards with Energon (train split = everything, tar order kept) and write a crude dataset.yaml."""
    from megatron.energon.flavors import BaseWebdatasetFactory

    chatter = io.StringIO()  # energon prints progress lines; keep stdout clean for the CLI table
    with contextlib.redirect_stdout(chatter):
        BaseWebdatasetFactory.prepare_dataset(root, shard_paths, split_parts_ratio=[("train", 1.0)],
                                              shuffle_seed=None, workers=1)
    logger.debug("energon prepare %s: %s", root, chatter.getvalue().strip())
    with open(os.path.join(root, ".nv-meta", "dataset.yaml"), "w", encoding="utf-8") as f:
        f.write(crude_dataset_yaml(group))


def _check_usable(group: str, dataset_name: str, n: int, problems: Counter, example: dict[str, str],
                  log: ScanLog) -> None:
    """Refuse a dataset none of whose records can be used; warn (with counts) when some cannot."""
    if not problems:
        return
    what = "; ".join(f"{k}: {v} (e.g. {example[k]})" for k, v in problems.most_common())
    if sum(problems.values()) >= n:
        raise ConvertError(f"{group}/{dataset_name}: none of the {n} records can become a training sample — {what}. "
                           + ("The official vlm_sft reader needs one JSON object per line with a `conversations` list "
                              "of {\"from\": \"human\"|\"gpt\", \"value\": ...} turns." if group == VLM else
                              "Check the source data."))
    log.warn(f"{group}/{dataset_name}: {sum(problems.values())} of {n} records can never become a training sample "
             f"and will be dropped (counted) when read — {what}")


def _write_dataset(group: str, dataset_name: str, out_dir: str, reader: Iterable[RawSample], total: int,
                   log: ScanLog, source_root: str, samples_per_shard: int, progress: bool,
                   overwrite: bool) -> ConvertSummary:
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    ds_dir = dataset_dir(out_dir, group, dataset_name)
    staging = _prepare_output(ds_dir, overwrite)
    coords: list[list[int]] = []
    try:
        writer = _ShardWriter(staging, samples_per_shard)
        show = progress and sys.stderr.isatty()
        problems: Counter = Counter()
        example: dict[str, str] = {}
        with tqdm(total=total, disable=not show, desc=f"{group}/{dataset_name}", unit="row") as bar:
            for s in reader:
                parts = [(META_PART, dumps_json(s.meta))] + [(image_part(i), b) for i, b in s.images]
                writer.add(sample_key(len(coords)), parts)
                coords.append(s.coord)
                problem = record_problem(s.meta)
                if problem is not None:
                    problems[problem.split(" (")[0]] += 1
                    example.setdefault(problem.split(" (")[0], f"{s.meta.get('source')}: {problem}")
                bar.update(1)
        writer.close()
        if not coords:
            raise ConvertError(f"{group}/{dataset_name}: no convertible rows (skipped: "
                               f"{dict(Counter(x['reason'] for x in log.skipped))})")
        _check_usable(group, dataset_name, len(coords), problems, example, log)
        _energon_prepare(staging, [sh["path"] for sh in writer.shards], group)
        manifest = {"format": 1, "group": group, "dataset_name": dataset_name,
                    "source_root": source_root, "num_samples": len(coords), "samples_per_shard": samples_per_shard,
                    "shards": writer.shards, "samples": coords, "skipped": log.skipped, **log.manifest}
        manifest = upgrade_manifest_v1(manifest, os.path.join(ds_dir, MANIFEST_NAME))  # format MANIFEST_FORMAT
        with open(os.path.join(staging, MANIFEST_NAME), "wb") as f:
            f.write(dumps_json(manifest) + b"\n")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if os.path.exists(ds_dir):
        shutil.rmtree(ds_dir)
    os.replace(staging, ds_dir)
    summary = ConvertSummary(group, dataset_name, ds_dir, samples=len(coords), shards=len(writer.shards),
                             bytes=writer.bytes, skipped=dict(sorted(Counter(x["reason"] for x in log.skipped).items())),
                             warnings=list(log.warnings))
    logger.info("converted %s/%s: %d samples in %d shards (%d bytes), skipped %s, %d warnings -> %s",
                group, dataset_name, summary.samples, summary.shards, summary.bytes, summary.skipped,
                len(summary.warnings), ds_dir)
    return summary


def _load_parquet_info(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError) as e:
        raise ConvertError(f"{path}: cannot read parquet_info JSON ({type(e).__name__}: {e})") from e
    if not isinstance(info, dict):
        raise ConvertError(f"{path}: parquet_info must be a JSON object mapping parquet path -> {{num_row_groups}}")
    return info


def convert_group(group: str, out_dir: str | os.PathLike, *, data_dir: str | None = None,
                  parquet_info_path: str | None = None, parquet_info: Mapping[str, Any] | None = None,
                  parquet_info_root: str | None = None, jsonl_path: str | None = None, image_dir: str | None = None,
                  dataset_name: str | None = None, source_root: str | None = None,
                  samples_per_shard: int = DEFAULT_SAMPLES_PER_SHARD, progress: bool = True,
                  overwrite: bool = False) -> ConvertSummary:
    """Convert one official sub-dataset of ``group`` into ``<out_dir>/<group>/<dataset_name>/``.

    Inputs per group: t2i_pretrain ``data_dir``; unified_edit ``data_dir`` + ``parquet_info_path`` (or an
    already merged ``parquet_info`` dict) whose keys are the paths as the official reader joins them,
    ``os.path.join(data_dir, file)``; relative keys may also be given relative to ``parquet_info_root`` (or
    to ``source_root`` / the working directory); vlm_sft ``jsonl_path`` + ``image_dir``.
    ``source_root`` is what stored paths are relative to; default: the parent of ``data_dir`` (t2i/edit) or
    the parent of the common directory of the jsonl and ``image_dir`` (vlm). ``dataset_name`` defaults to the
    basename of ``data_dir`` (t2i/edit) or the jsonl stem (vlm).
    """
    out_dir = os.fspath(out_dir)
    log = ScanLog()
    if group in (T2I, EDIT):
        if not data_dir:
            raise ConvertError(f"{group}: data_dir is required")
        data_dir = os.fspath(data_dir)
        root = source_root or os.path.dirname(os.path.abspath(data_dir))
        name = dataset_name or os.path.basename(os.path.normpath(os.path.abspath(data_dir)))
        if group == T2I:
            reader: T2IReader | EditReader | VlmReader = T2IReader(data_dir, root, log)
        else:
            if parquet_info is None:
                if not parquet_info_path:
                    raise ConvertError(f"{group}: parquet_info_path (or parquet_info) is required")
                parquet_info = _load_parquet_info(parquet_info_path)
            info_file = parquet_info_path or "<parquet_info>"
            roots = [r for r in (parquet_info_root, root) if r]
            reader = EditReader(data_dir, parquet_info, info_file, roots, root, log)
    elif group == VLM:
        if not jsonl_path or not image_dir:
            raise ConvertError(f"{group}: jsonl_path and image_dir are required")
        jsonl_path, image_dir = os.fspath(jsonl_path), os.fspath(image_dir)
        common = os.path.commonpath([os.path.dirname(os.path.abspath(jsonl_path)), os.path.abspath(image_dir)])
        root = source_root or os.path.dirname(common)
        name = dataset_name or os.path.splitext(os.path.basename(jsonl_path))[0]
        reader = VlmReader(jsonl_path, image_dir, root, log)
    else:
        raise ConvertError(f"unknown group {group!r} (expected one of {GROUPS})")
    return _write_dataset(group, name, out_dir, reader, reader.total, log, root, samples_per_shard, progress,
                          overwrite)


def convert_t2i(data_dir: str, out_dir: str | os.PathLike, **kw: Any) -> ConvertSummary:
    """t2i_pretrain parquet folder → ``<out_dir>/t2i_pretrain/<name>/`` (see :func:`convert_group`)."""
    return convert_group(T2I, out_dir, data_dir=data_dir, **kw)


def convert_edit(data_dir: str, parquet_info_path: str, out_dir: str | os.PathLike, **kw: Any) -> ConvertSummary:
    """unified_edit parquet folder + parquet_info JSON → ``<out_dir>/unified_edit/<name>/``."""
    return convert_group(EDIT, out_dir, data_dir=data_dir, parquet_info_path=parquet_info_path, **kw)


def convert_vlm(jsonl_path: str, image_dir: str, out_dir: str | os.PathLike, **kw: Any) -> ConvertSummary:
    """vlm_sft jsonl + image root → ``<out_dir>/vlm_sft/<name>/``."""
    return convert_group(VLM, out_dir, jsonl_path=jsonl_path, image_dir=image_dir, **kw)


def _load_mapping(path: str, what: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)  # YAML is a superset of JSON: both formats are accepted
    except (OSError, yaml.YAMLError) as e:
        raise ConvertError(f"{path}: cannot read {what} ({type(e).__name__}: {e})") from e
    if not isinstance(data, dict):
        raise ConvertError(f"{path}: {what} must be a mapping")
    return data


def convert_from_config(dataset_info_path: str, grouped_yaml_path: str, out_dir: str | os.PathLike, *,
                        source_root: str | None = None, samples_per_shard: int = DEFAULT_SAMPLES_PER_SHARD,
                        progress: bool = True, overwrite: bool = False) -> list[ConvertSummary]:
    """Convert every sub-dataset the grouped YAML names, reading paths from an official dataset_info file.

    ``dataset_info_path``: YAML/JSON ``{group: {name: {data_dir, jsonl_path?, parquet_info_path?, ...}}}``
    (the official ``DATASET_INFO`` layout). Relative paths are resolved against ``source_root`` (default:
    the working directory, as in the official training script) and stored relative to it. The parquet_info
    files of all edit datasets of the grouped YAML are merged, as the official ``build_datasets`` does.
    Writes ``<out_dir>/dataset_info.json``: the input with ``energon_path`` (absolute) on every converted entry.
    """
    # Parsed here with pyyaml: no shared config module existed when this was written.
    info = _load_mapping(dataset_info_path, "dataset_info")
    groups = _load_mapping(grouped_yaml_path, "grouped dataset YAML")
    root = os.path.abspath(source_root or os.getcwd())
    out_dir = os.fspath(out_dir)

    def resolve(p: str) -> str:
        return os.path.join(root, p)

    summaries: list[ConvertSummary] = []
    result = json.loads(json.dumps(info))
    for group, gcfg in groups.items():
        if group not in GROUPS:
            raise ConvertError(f"{grouped_yaml_path}: unknown group {group!r} (expected one of {GROUPS})")
        names = (gcfg or {}).get("dataset_names")
        if not isinstance(names, list) or not names:
            raise ConvertError(f"{grouped_yaml_path}: group {group!r} needs a non-empty dataset_names list")
        entries = {}
        for name in names:
            entry = (info.get(group) or {}).get(name)
            if not isinstance(entry, dict) or "data_dir" not in entry:
                raise ConvertError(f"{dataset_info_path}: no entry {group}.{name} with a data_dir")
            entries[name] = entry
        merged_info: dict[str, Any] = {}
        if group == EDIT:
            for name, entry in entries.items():
                if not entry.get("parquet_info_path"):
                    raise ConvertError(f"{dataset_info_path}: {group}.{name} needs parquet_info_path")
                merged_info.update(_load_parquet_info(resolve(entry["parquet_info_path"])))
        for name, entry in entries.items():
            kw: dict[str, Any] = dict(dataset_name=name, source_root=root, samples_per_shard=samples_per_shard,
                                      progress=progress, overwrite=overwrite)
            if group == VLM:
                if not entry.get("jsonl_path"):
                    raise ConvertError(f"{dataset_info_path}: {group}.{name} needs jsonl_path")
                s = convert_group(group, out_dir, jsonl_path=resolve(entry["jsonl_path"]),
                                  image_dir=resolve(entry["data_dir"]), **kw)
            elif group == EDIT:
                s = convert_group(group, out_dir, data_dir=resolve(entry["data_dir"]), parquet_info=merged_info,
                                  parquet_info_path=resolve(entry["parquet_info_path"]), parquet_info_root=root, **kw)
            else:
                s = convert_group(group, out_dir, data_dir=resolve(entry["data_dir"]), **kw)
            result[group][name]["energon_path"] = os.path.abspath(s.path)
            summaries.append(s)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "dataset_info.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, sort_keys=True, ensure_ascii=False)
        f.write("\n")
    return summaries
