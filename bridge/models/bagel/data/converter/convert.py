"""Converter from the official BAGEL raw formats to Energon crude WebDatasets (layout: ``energon/layout/contract.py``).

Every row the official reader can read becomes exactly one sample, keyed ``%08d`` by its index, with the
original image bytes and a ``meta.json`` holding the official coordinate; the manifest maps coordinates to
sample indices so a reader can reproduce the official unit order. Output is deterministic byte for byte
(shards and manifest); ``.nv-meta`` is written by Energon's own ``prepare_dataset``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import sqlite3
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from .finalize import (build_manifest, from_plan, has_files, load_records, merge_checksums, publish, published_problem,
                       write_energon_index, write_index_uuid, write_plan_digest)
from .formats import ConvertError, EditReader, ScanLog, T2IReader, VlmReader, dumps_json
from .plan import make_plan, older_plans, open_staging, part_units, plan_jobs, run_jobs
from .units import WORK_DIR, UnitWriteError, unit_record_path
from ..energon.layout import (DEFAULT_SAMPLES_PER_SHARD, EDIT, GROUPS, MANIFEST_FORMAT, MANIFEST_NAME, T2I, VLM,
                              dataset_dir, encode_manifest, load_manifest, write_atomic, write_manifest)
from ..yaml_errors import yaml_problem

logger = logging.getLogger(__name__)

__all__ = ["ConvertError", "ConvertWriteError", "ConvertSummary", "convert_group", "convert_t2i", "convert_edit",
           "convert_vlm", "convert_from_config", "merge_dataset", "merge_all", "part_units", "dumps_json",
           "DEFAULT_MAX_IMAGE_PIXELS"]


#: Image check: images with more pixels than this are counted (PIL's own ``Image.MAX_IMAGE_PIXELS`` default,
#: above which PIL warns about a decompression bomb; the official reader's PIL decodes them all the same).
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485


@dataclass
class ConvertSummary:
    """Result of converting one sub-dataset (or, with ``num_parts > 1``, this part of it)."""

    group: str
    dataset_name: str
    path: str                   # the dataset directory
    samples: int = 0
    shards: int = 0
    bytes: int = 0              # of the shards
    #: Rows the official reader never reads, by reason.
    skipped: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    num_warnings: int = 0
    #: Stored images that are empty, have no readable header or exceed the pixel limit, by reason (kept unchanged
    #: in the dataset).
    bad_images: dict[str, int] = field(default_factory=dict)
    #: "published", or what is left before ``bagel-data convert merge`` can publish a part.
    status: str = "published"


class ConvertWriteError(ConvertError):
    """Writing the output failed (disk full, quota, I/O error): nothing half-written is published."""


def _check_usable(group: str, dataset_name: str, n: int, problems: Counter, example: dict[str, str],
                  warnings: list[str]) -> None:
    """Refuse a dataset none of whose records can be used; warn (with counts) when some cannot."""
    if not problems:
        return
    what = "; ".join(f"{k}: {v} (e.g. {example[k]})" for k, v in problems.most_common())
    if sum(problems.values()) >= n:
        raise ConvertError(f"{group}/{dataset_name}: none of the {n} records can become a training sample — {what}. "
                           + ("The official vlm_sft reader needs one JSON object per line with a `conversations` list "
                              "of {\"from\": \"human\"|\"gpt\", \"value\": ...} turns." if group == VLM else
                              "Check the source data."))
    msg = (f"{group}/{dataset_name}: {sum(problems.values())} of {n} records can never become a training sample "
           f"and will be dropped (counted) when read — {what}")
    logger.warning("%s", msg)
    warnings.append(msg)


def _skip_counts(skipped: list[dict[str, Any]]) -> dict[str, int]:
    out: Counter = Counter()
    for e in skipped:  # an unreadable file not in parquet_info (row_group None) counts once
        out[e["reason"]] += e["rows"] if e["row_group"] is not None else 1
    return dict(sorted(out.items()))


def _write_error(e: BaseException, what: str, done: str = "") -> ConvertWriteError:
    """One line: the path being written, the error, how much was written, what to do."""
    where = (str(e) if isinstance(e, UnitWriteError)
             else f"{getattr(e, 'filename', None) or what}: {getattr(e, 'strerror', None) or e}")
    return ConvertWriteError(f"cannot write the conversion output — {where}; {done + '; ' if done else ''}nothing "
                             f"half-written was published: free space (or fix the error) and rerun the same command "
                             f"to resume")


def _convert_planned(plan: dict[str, Any], ds_dir: str, *, workers: int, part: int, num_parts: int, progress: bool,
                     overwrite: bool) -> ConvertSummary:
    group, name = plan["group"], plan["dataset_name"]
    mine = part_units(plan, part, num_parts)
    # a rerun (requeued job, resumed config); or the same conversion published by an earlier release (no checksums,
    # or also manifest format 2)
    current = not overwrite and from_plan(ds_dir, dumps_json(plan))
    older = None if overwrite or current else next(
        (lacks for old, lacks in older_plans(plan) if from_plan(ds_dir, old)), None)
    if current or older is not None:
        problem = published_problem(ds_dir)
        if problem is not None:
            raise ConvertError(f"{ds_dir}: the published dataset of this conversion is damaged ({problem}): pass "
                               "--overwrite to convert it again")
        man = load_manifest(ds_dir)
        if older is not None:
            logger.warning("%s: already converted from the same sources and options by an earlier release, %s: it "
                           "is read as it is, but its samples are not verified on read%s; pass --overwrite to convert "
                           "it again with checksums (as format %d)", ds_dir, older,
                           ", and every rank parses its whole manifest at start-up (O(files))"
                           if "format 2" in older else "", MANIFEST_FORMAT)
        else:
            logger.info("%s: already converted from the same sources and options; nothing to do", ds_dir)
        return dataclasses.replace(_summary(man, ds_dir), status="already converted")
    try:
        staging, merged = open_staging(ds_dir, plan, overwrite, num_parts)
        if not merged:
            jobs = plan_jobs(plan, staging)
            todo = [jobs[k] for k in mine if not os.path.exists(unit_record_path(staging, k))]
            rows = sum(jobs[k].unit.num_samples for k in mine)
            with tqdm(total=rows, initial=rows - sum(j.unit.num_samples for j in todo),
                      disable=not (progress and sys.stderr.isatty()),
                      desc=f"{group}/{name}" + (f" part {part}/{num_parts}" if num_parts > 1 else ""),
                      unit="row") as bar:
                run_jobs(todo, workers, bar)
    except (OSError, UnitWriteError) as e:
        staged = ds_dir.rstrip(os.sep) + ".partial"
        records, _ = load_records(staged, len(plan["units"])) if os.path.isdir(staged) else ([], [])
        done = (f"{len(records)} of {len(plan['units'])} work units "
                f"({sum(sh['bytes'] for r in records for sh in r['shards'])} bytes of shards) are done")
        raise _write_error(e, ds_dir, done) from e
    if num_parts > 1 and not merged:
        records, missing = load_records(staging, len(plan["units"]))
        mine_set = set(mine)
        ours = [r for r in records if r["unit"] in mine_set]
        left = (f"{len(missing)} of {len(plan['units'])} units left" if missing else "all parts done, run merge"
                + (" --overwrite (replaces the published dataset)" if has_files(ds_dir) else ""))
        return ConvertSummary(group, name, ds_dir, samples=sum(r["num_samples"] for r in ours),
                              shards=sum(len(r["shards"]) for r in ours),
                              bytes=sum(sh["bytes"] for r in ours for sh in r["shards"]),
                              skipped=_skip_counts(plan["manifest"]["skipped"]),
                              status=f"part {part}/{num_parts} done; {left}")
    return merge_dataset(ds_dir, overwrite=True)


def merge_dataset(ds_dir: str, *, overwrite: bool = False) -> ConvertSummary:
    """Join the converted units of ``<ds_dir>.partial`` (all parts) into the final dataset and publish it.

    Raises ConvertError when units are missing (naming them and the part to rerun) or the data is unusable,
    ConvertWriteError when writing fails (rerun to resume).
    """
    staging = ds_dir.rstrip(os.sep) + ".partial"
    if has_files(ds_dir) and not overwrite:
        raise ConvertError(f"{ds_dir}: output directory is not empty: pass --overwrite to replace the published "
                           f"dataset with the merged parts")
    try:
        with open(os.path.join(staging, WORK_DIR, "plan.json"), "rb") as f:
            plan_bytes = f.read()
        plan = json.loads(plan_bytes)
    except FileNotFoundError:
        if os.path.exists(os.path.join(staging, MANIFEST_NAME)):  # merged before; only the publish was left
            man = load_manifest(staging)
            publish(staging, ds_dir)
            return _summary(man, ds_dir)
        raise ConvertError(f"{staging}: no staged conversion to merge (run `bagel-data convert ...` first)") from None
    group, name, n_units = plan["group"], plan["dataset_name"], len(plan["units"])
    records, missing = load_records(staging, n_units)
    if missing:
        u = plan["units"][missing[0]]
        raise ConvertError(f"{staging}: {len(missing)} of {n_units} work units are not converted yet (e.g. unit "
                           f"{missing[0]}: {u['rel']}); run every --part of the conversion (a rerun resumes), then "
                           f"merge again")
    problems: Counter = Counter()
    examples: dict[str, str] = {}
    warnings_ = list(plan["warnings"])
    for r in records:
        problems.update(r["problems"])
        for k, v in r["examples"].items():
            examples.setdefault(k, v)
        for w in r["warnings"]:
            if len(warnings_) < 10:
                logger.warning("%s", w)
            warnings_.append(w)
    n = sum(r["num_samples"] for r in records)
    try:
        if n == 0:
            raise ConvertError(f"{group}/{name}: no convertible rows (skipped: "
                               f"{_skip_counts(plan['manifest']['skipped'])})")
        _check_usable(group, name, n, problems, examples, warnings_)
    except ConvertError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    man = build_manifest(plan, records)
    try:
        checksums = merge_checksums(man, staging, n_units)  # the per-sample checksums + their header entry
        write_energon_index(staging, man["shards"], n_units, group)
        encoded = encode_manifest(man, staging)  # manifest.json (the format-3 header) + its columns sidecar
        write_index_uuid(staging, encoded[0])  # the header holds the sidecars' sha256
        write_plan_digest(staging, plan_bytes)  # before the manifest: a merged staging dir always has it
        write_manifest(staging, man, encoded, checksums)  # sidecars, then manifest.json: its presence means "merged"
        publish(staging, ds_dir)
    except (OSError, sqlite3.Error) as e:
        raise _write_error(e, staging) from e
    for reason, count in man["image_checks"]["problems"].items():
        logger.warning("%s/%s: %d stored images: %s (e.g. %s); kept as they are, the reader decides", group, name,
                       count, reason, examples.get(reason))
    bad = sum(r["num_warnings"] for r in records) - sum(len(r["warnings"]) for r in records)
    summary = _summary(man, ds_dir, warnings_, extra_warnings=bad)
    logger.info("converted %s/%s: %d samples in %d shards (%d bytes), skipped %s, bad images %s, %d warnings -> %s",
                group, name, summary.samples, summary.shards, summary.bytes, summary.skipped, summary.bad_images,
                summary.num_warnings, ds_dir)
    return summary


def _summary(man: dict[str, Any], ds_dir: str, warnings_: list[str] | None = None,
             extra_warnings: int = 0) -> ConvertSummary:
    warnings_ = warnings_ or []
    return ConvertSummary(man["group"], man["dataset_name"], ds_dir, samples=man["num_samples"],
                          shards=len(man["shards"]),
                          bytes=sum(os.path.getsize(os.path.join(ds_dir, sh["path"])) for sh in man["shards"]),
                          skipped=_skip_counts(man["skipped"]), warnings=warnings_,
                          num_warnings=len(warnings_) + extra_warnings,
                          bad_images=dict(man.get("image_checks", {}).get("problems", {})))


def _load_parquet_info(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError) as e:
        raise ConvertError(f"{path}: cannot read parquet_info JSON ({type(e).__name__}: {e})") from e
    if not isinstance(info, dict):
        raise ConvertError(f"{path}: parquet_info must be a JSON object mapping parquet path -> {{num_row_groups}}")
    return info


def _checked_name(group: str, name: str, out_dir: str) -> str:
    """``name`` as the dataset's folder under ``out_dir/group``: a plain name, never a path out of it."""
    if not name or name in (".", "..") or "/" in name or os.sep in name:
        raise ConvertError(f"{group}: dataset name {name!r} is not a folder name (it would write outside "
                           f"{os.path.join(out_dir, group)}): pass --name with a plain name")
    return name


def convert_group(group: str, out_dir: str | os.PathLike, *, data_dir: str | None = None,
                  parquet_info_path: str | None = None, parquet_info: Mapping[str, Any] | None = None,
                  parquet_info_root: str | None = None, jsonl_path: str | None = None, image_dir: str | None = None,
                  dataset_name: str | None = None, source_root: str | None = None,
                  samples_per_shard: int = DEFAULT_SAMPLES_PER_SHARD, progress: bool = True,
                  overwrite: bool = False, workers: int = 1, part: int = 0, num_parts: int = 1,
                  max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> ConvertSummary:
    """Convert one official sub-dataset of ``group`` into ``<out_dir>/<group>/<dataset_name>/``.

    Inputs per group: t2i_pretrain ``data_dir``; unified_edit ``data_dir`` + ``parquet_info_path`` (or an already merged
    ``parquet_info`` dict) whose keys are the paths as the official reader joins them, ``os.path.join(data_dir, file)``;
    relative keys may also be given relative to ``parquet_info_root`` (or to ``source_root`` / the working directory);
    vlm_sft ``jsonl_path`` + ``image_dir``. ``source_root`` is what stored paths are relative to; default: the parent of
    ``data_dir`` (t2i/edit) or the parent of the common directory of the jsonl and ``image_dir`` (vlm). ``dataset_name``
    defaults to the basename of ``data_dir`` (t2i/edit) or the jsonl stem (vlm).

    ``workers``: processes converting work units (one parquet file / ``samples_per_shard`` jsonl lines each).
    ``part``/``num_parts``: convert only this deterministic, disjoint part of the units (staged in
    ``<dataset>.partial``); :func:`merge_dataset` publishes once every part is done. Any workers/parts give the
    same bytes; an interrupted conversion resumes where it stopped. ``max_image_pixels``: images above are
    counted in ``bad_images`` (header-only check; the bytes are stored unchanged).
    Raises ConvertError (bad input), ConvertWriteError (writing failed; rerun to resume).
    """
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    out_dir = os.fspath(out_dir)
    log = ScanLog()
    if group in (T2I, EDIT):
        if not data_dir:
            raise ConvertError(f"{group}: data_dir is required")
        data_dir = os.fspath(data_dir)
        root = source_root or os.path.dirname(os.path.abspath(data_dir))
        name = _checked_name(group, dataset_name or os.path.basename(os.path.normpath(os.path.abspath(data_dir))),
                             out_dir)
        if group == T2I:
            reader: T2IReader | EditReader | VlmReader = T2IReader(data_dir, root, log)
        else:
            if parquet_info is None:
                if not parquet_info_path:
                    raise ConvertError(f"{group}: parquet_info_path (or parquet_info) is required")
                parquet_info = _load_parquet_info(parquet_info_path)
            reader = EditReader(data_dir, parquet_info, parquet_info_path or "<parquet_info>",
                                [r for r in (parquet_info_root, root) if r], root, log)
        fingerprints = [os.path.join(data_dir, f["file"].rsplit("/", 1)[-1]) for f in log.manifest["files"]]
    elif group == VLM:
        if not jsonl_path or not image_dir:
            raise ConvertError(f"{group}: jsonl_path and image_dir are required")
        jsonl_path, image_dir = os.fspath(jsonl_path), os.fspath(image_dir)
        common = os.path.commonpath([os.path.dirname(os.path.abspath(jsonl_path)), os.path.abspath(image_dir)])
        root = source_root or os.path.dirname(common)
        name = _checked_name(group, dataset_name or os.path.splitext(os.path.basename(jsonl_path))[0], out_dir)
        reader = VlmReader(jsonl_path, image_dir, root, log, samples_per_shard)
        # the image folder's own size/mtime: images added, removed or renamed (not rewritten in place)
        fingerprints = [jsonl_path] + ([image_dir] if os.path.isdir(image_dir) else [])
    else:
        raise ConvertError(f"unknown group {group!r} (expected one of {GROUPS})")
    plan = make_plan(group, name, reader, log, root, samples_per_shard, max_image_pixels, fingerprints)
    return _convert_planned(plan, dataset_dir(out_dir, group, name), workers=workers, part=part, num_parts=num_parts,
                            progress=progress, overwrite=overwrite)


def merge_all(out_dir: str | os.PathLike, *, overwrite: bool = False) -> list[ConvertSummary]:
    """Merge every staged conversion under ``<out_dir>/<group>/*.partial`` (see :func:`merge_dataset`)."""
    out_dir = os.fspath(out_dir)
    listed = [(g, n) for g in GROUPS if os.path.isdir(os.path.join(out_dir, g))
              for n in sorted(os.listdir(os.path.join(out_dir, g)))]
    found = [os.path.join(out_dir, g, n[: -len(".partial")]) for g, n in listed if n.endswith(".partial")]
    if not found:
        published = [os.path.join(g, n) for g, n in listed
                     if os.path.exists(os.path.join(out_dir, g, n, MANIFEST_NAME))]
        if published:  # a requeued merge job after its merge succeeded
            logger.info("%s: nothing to merge: no staged conversion, %d published datasets (%s)", out_dir,
                        len(published), ", ".join(published[:5]))
            return []
        raise ConvertError(f"{out_dir}: no staged conversion (<group>/<name>.partial) to merge")
    return [merge_dataset(ds, overwrite=overwrite) for ds in found]


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
    except OSError as e:
        raise ConvertError(f"{path}: cannot read {what} ({type(e).__name__}: {e})") from e
    except yaml.YAMLError as e:  # one line with line/column, not PyYAML's multi-line snippet
        raise ConvertError(f"{path}: {what} is not valid YAML: {yaml_problem(e)}") from e
    if not isinstance(data, dict):
        raise ConvertError(f"{path}: {what} must be a mapping")
    return data


#: The ``dataset_info`` key each group's entries need besides ``data_dir``.
_ENTRY_NEEDS = {EDIT: "parquet_info_path", VLM: "jsonl_path"}


def convert_from_config(dataset_info_path: str, grouped_yaml_path: str, out_dir: str | os.PathLike, *,
                        source_root: str | None = None, samples_per_shard: int = DEFAULT_SAMPLES_PER_SHARD,
                        progress: bool = True, overwrite: bool = False, **kw: Any) -> list[ConvertSummary]:
    """Convert every sub-dataset the grouped YAML names, reading paths from an official dataset_info file.

    ``dataset_info_path``: YAML/JSON ``{group: {name: {data_dir, jsonl_path?, parquet_info_path?, ...}}}``
    (the official ``DATASET_INFO`` layout). Relative paths are resolved against ``source_root`` (default:
    the working directory, as in the official training script) and stored relative to it. The parquet_info
    files of all edit datasets of the grouped YAML are merged, as the official ``build_datasets`` does.
    Writes ``<out_dir>/dataset_info.json``: the input with ``energon_path`` (absolute) on every converted entry.
    ``kw``: ``workers``, ``part``, ``num_parts``, ``max_image_pixels`` as for :func:`convert_group`.
    """
    info = _load_mapping(dataset_info_path, "dataset_info")
    groups = _load_mapping(grouped_yaml_path, "grouped dataset YAML")
    root = os.path.abspath(source_root or os.getcwd())
    out_dir = os.fspath(out_dir)
    resolve = functools.partial(os.path.join, root)
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
            if group in _ENTRY_NEEDS and not entry.get(_ENTRY_NEEDS[group]):
                raise ConvertError(f"{dataset_info_path}: {group}.{name} needs {_ENTRY_NEEDS[group]}")
            entries[name] = entry
        merged_info: dict[str, Any] = {}  # the parquet_info files of all edit datasets, merged
        if group == EDIT:
            for entry in entries.values():
                merged_info.update(_load_parquet_info(resolve(entry["parquet_info_path"])))
        for name, entry in entries.items():
            paths = ({"jsonl_path": resolve(entry["jsonl_path"]), "image_dir": resolve(entry["data_dir"])}
                     if group == VLM else {"data_dir": resolve(entry["data_dir"])})
            if group == EDIT:
                paths.update(parquet_info=merged_info, parquet_info_path=resolve(entry["parquet_info_path"]),
                             parquet_info_root=root)
            s = convert_group(group, out_dir, dataset_name=name, source_root=root, samples_per_shard=samples_per_shard,
                              progress=progress, overwrite=overwrite, **paths, **kw)
            result[group][name]["energon_path"] = os.path.abspath(s.path)
            summaries.append(s)
    os.makedirs(out_dir, exist_ok=True)
    text = json.dumps(result, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
    # parts may write it at the same time
    write_atomic(os.path.join(out_dir, "dataset_info.json"), text.encode("utf-8"), tmp=f".tmp{os.getpid()}")
    return summaries
