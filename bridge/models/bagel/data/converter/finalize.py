"""Merge the finished units of a conversion: Energon's ``.nv-meta`` index, ``manifest.json``, atomic publish.

Costs O(units + shards) in Python: the ``samples`` rows of ``index.sqlite`` are copied from the units'
fragments by SQLite itself (``ATTACH`` + ``INSERT ... SELECT``), in unit order, so the index bytes do not depend
on how many processes or machines converted the units.

What Energon's ``prepare_dataset`` would write, and why it is not called (on a tested Energon): see
``energon.patches.index``, which writes ``index.sqlite``, ``.info.json`` and ``split.yaml``. Here:
``shards/*.tar.idx`` are written by the units (the same bytes as Energon's), ``dataset.yaml`` and ``index.uuid``
derived from the content (it changes exactly when the index does).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import uuid
from collections import Counter
from typing import Any

import numpy as np

from ..energon.layout import (CHECKSUMS_KEY, EDIT, MANIFEST_FORMAT, MANIFEST_NAME, T2I, ManifestError,
                              crude_dataset_yaml, encode_checksums, load_manifest, write_atomic)
from ..energon.patches.index import write_index
from .units import WORK_DIR, unit_checksums_path, unit_index_path, unit_record_path

__all__ = ["write_energon_index", "build_manifest", "merge_checksums"]

_NV = ".nv-meta"


def write_energon_index(staging: str, shards: list[dict[str, Any]], n_units: int, group: str) -> None:
    """Write ``.nv-meta/{index.sqlite,.info.json,split.yaml,dataset.yaml}`` of the staged dataset: Energon's index from
    the units' fragments (``energon.patches.index``), and the dataset's ``dataset.yaml``."""
    write_index(staging, shards, [unit_index_path(staging, k) for k in range(n_units)])
    write_atomic(os.path.join(staging, _NV, "dataset.yaml"), crude_dataset_yaml(group).encode())


def write_index_uuid(staging: str, manifest_bytes: bytes) -> None:
    """``.nv-meta/index.uuid``: a UUID derived from the manifest and ``.info.json`` (same content, same UUID).
    ``manifest_bytes``: the ``manifest.json`` bytes (format 3: the header, which holds its sidecar's sha256)."""
    nv = os.path.join(staging, _NV)
    with open(os.path.join(nv, ".info.json"), "rb") as f:
        digest = hashlib.sha256(manifest_bytes + f.read()).digest()
    write_atomic(os.path.join(nv, "index.uuid"), str(uuid.UUID(bytes=digest[:16], version=4)).encode())


def build_manifest(plan: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest (the format-2-shaped dict ``layout.write_manifest`` stores as format 3, see
    docs/converting.md) from the plan and the unit records."""
    base = plan["manifest"]
    files = [dict(f) for f in base["files"]]
    if plan["group"] in (T2I, EDIT):
        per_file = {u["file_index"]: u for u in plan["units"]}
        n = 0
        for f in files:
            u = per_file.get(f["file_index"])
            f["first_sample"], f["num_samples"] = n, (u["num_samples"] if u else 0)
            n += f["num_samples"]
    else:
        files[0]["first_sample"], files[0]["num_samples"] = 0, files[0]["num_lines"]
    shards = [{"path": sh["path"], "count": sh["count"], "bytes": sh["bytes"], "sha256": sh["sha256"]}
              for r in records for sh in r["shards"]]
    images = sum((Counter(r["image_problems"]) for r in records), Counter())
    return {**base, "format": MANIFEST_FORMAT, "group": plan["group"], "dataset_name": plan["dataset_name"],
            "source_root": plan["source_root"], "num_samples": sum(r["num_samples"] for r in records),
            "samples_per_shard": plan["samples_per_shard"], "files": files, "shards": shards,
            "image_checks": {"max_image_pixels": plan["max_image_pixels"], "problems": dict(sorted(images.items()))}}


def merge_checksums(man: dict[str, Any], staging: str, n_units: int) -> bytes:
    """The units' per-sample checksum fragments joined in unit order: the ``manifest.checksums.npy`` bytes; sets
    ``man["checksums"]`` (the header entry describing them). O(samples) numpy, O(units) Python. Raises OSError /
    ValueError for a missing or unreadable fragment, ManifestError when they do not hold ``num_samples``."""
    parts = [np.load(unit_checksums_path(staging, k), allow_pickle=False) for k in range(n_units)]
    sums = np.concatenate(parts) if parts else np.zeros(0, dtype="<u8")
    if len(sums) != man["num_samples"]:
        raise ManifestError(f"{staging}: the units' checksum fragments hold {len(sums)} samples, the manifest "
                            f"{man['num_samples']}: convert again with --overwrite")
    data, man[CHECKSUMS_KEY] = encode_checksums(sums)
    return data


def load_records(staging: str, n_units: int) -> tuple[list[dict[str, Any]], list[int]]:
    """The unit records present (in unit order) and the indices of the units without one."""
    records, missing = [], []
    for k in range(n_units):
        try:
            with open(unit_record_path(staging, k), encoding="utf-8") as f:
                records.append(json.load(f))
        except FileNotFoundError:
            missing.append(k)
    return records, missing


def publish(staging: str, ds_dir: str) -> None:
    """Drop the work files and move the staged dataset to its final path (replacing an old one).

    The work dir is first renamed away in one step, so a run killed while it is being deleted finds a merged
    staging dir (manifest, no work dir) and only publishes.
    """
    work, done = os.path.join(staging, WORK_DIR), os.path.join(staging, WORK_DIR + ".done")
    if os.path.exists(work):
        shutil.rmtree(done, ignore_errors=True)
        os.replace(work, done)
    shutil.rmtree(done, ignore_errors=True)
    if os.path.exists(ds_dir):
        old = ds_dir.rstrip(os.sep) + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(ds_dir, old)
        os.replace(staging, ds_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, ds_dir)


#: In a published dataset: the sha256 of the plan it was converted from (its sources' names, sizes and mtimes,
#: and every option that changes bytes), so a rerun of the same conversion knows it is done.
PLAN_DIGEST_NAME = ".plan.sha256"


def write_plan_digest(staging: str, plan_bytes: bytes) -> None:
    """Record the plan's sha256 in the staged dataset (published with it)."""
    write_atomic(os.path.join(staging, PLAN_DIGEST_NAME), hashlib.sha256(plan_bytes).hexdigest().encode() + b"\n")


def from_plan(ds_dir: str, plan_bytes: bytes) -> bool:
    """Whether ``ds_dir`` (published or merged in staging) records exactly this plan (same sources and options)."""
    try:
        with open(os.path.join(ds_dir, PLAN_DIGEST_NAME), encoding="ascii") as f:
            recorded = f.read().strip()
    except OSError:
        return False
    return recorded == hashlib.sha256(plan_bytes).hexdigest()


def published_problem(ds_dir: str) -> str | None:
    """What is missing or cut short in a published dataset (manifest or its sidecar, a shard, its ``.tar.idx``, a shard
    shorter than its index says), or None: the cheap O(files + shards) check a rerun makes before calling it done."""
    try:
        shards = load_manifest(ds_dir)["shards"]
    except ManifestError as e:
        return f"{MANIFEST_NAME}: {e.cause}"
    for sh in shards:
        tar = os.path.join(ds_dir, sh["path"])
        try:
            size = os.path.getsize(tar)
            with open(tar + ".idx", "rb") as f:
                f.seek(-8, os.SEEK_END)
                (end,) = struct.unpack("<Q", f.read(8))
        except (OSError, struct.error) as e:
            return f"{sh['path']}: {getattr(e, 'strerror', None) or e}"
        if size < end:
            return f"{sh['path']} is {size} bytes, shorter than its index ({end})"
    return None


def has_files(ds_dir: str) -> bool:
    """Whether ``ds_dir`` exists as anything but an empty directory (a published dataset, or something else)."""
    return os.path.exists(ds_dir) and (not os.path.isdir(ds_dir) or bool(os.listdir(ds_dir)))
