"""The plan of a conversion (units with fixed sample/shard ranges), its parts, its staging dir, its process pool.

The plan is computed from the inputs' metadata alone (parquet footers, the jsonl line count) by every part of a
conversion, identically, and stored in ``<dataset>.partial/.convert/plan.json``; a staging dir whose plan
differs (other sources, sizes, mtimes or options) is started over, one whose plan matches is resumed.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import signal
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

from tqdm import tqdm

from ..energon.layout import CHECKSUM_ALGORITHM, MANIFEST_FORMAT, MANIFEST_NAME, write_atomic
from .finalize import from_plan, has_files
from .formats import ConvertError, EditReader, ScanLog, SourceUnit, T2IReader, VlmReader, dumps_json, relpath
from .units import WORK_DIR, UnitJob, run_unit

__all__ = ["make_plan", "plan_jobs", "part_units", "open_staging", "run_jobs", "older_plans"]

logger = logging.getLogger(__name__)

#: Bumped when the staged work files change meaning (a staging dir of another version is started over).
#: 2: units also write their per-sample checksums (``unit-NNNNNN.sums.npy``) and shard sha256s.
_PLAN_FORMAT = 2
#: Plan keys computed from the others (sources, options): named in a plan diff only when nothing else differs.
_DERIVED = ("units", "manifest", "warnings")


def make_plan(group: str, name: str, reader: T2IReader | EditReader | VlmReader, log: ScanLog, root: str,
          samples_per_shard: int, max_image_pixels: int, fingerprints: list[str]) -> dict[str, Any]:
    """The deterministic layout of the conversion: units with their sample and shard ranges (JSON-able)."""
    units, n, sh = [], 0, 0
    for u in reader.units:
        q, rem = divmod(u.num_samples, samples_per_shard)
        counts = [samples_per_shard] * q + ([rem] if rem else [])
        units.append({"path": u.path, "rel": u.rel, "file_index": u.file_index, "row_groups": list(u.row_groups),
                      "start": u.start, "num_samples": u.num_samples, "first_sample": n, "first_shard": sh,
                      "shard_counts": counts})
        n, sh = n + u.num_samples, sh + len(counts)
    sources = [[relpath(p, root), (st := os.stat(p)).st_size, st.st_mtime_ns] for p in fingerprints]
    vlm = isinstance(reader, VlmReader)
    return {"plan_format": _PLAN_FORMAT, "manifest_format": MANIFEST_FORMAT, "checksums": CHECKSUM_ALGORITHM,
            "group": group, "dataset_name": name, "source_root": root,
            "samples_per_shard": samples_per_shard, "max_image_pixels": max_image_pixels, "sources": sources,
            "image_dir": os.path.abspath(reader.image_dir) if vlm else "",
            "rel_image_dir": reader.rel_image_dir if vlm else "", "units": units,
            "manifest": {**log.manifest, "skipped": log.skipped}, "warnings": log.warnings}


def older_plans(plan: dict[str, Any]) -> list[tuple[bytes, str]]:
    """The same conversion as earlier releases planned it (their ``.plan.sha256`` was of these bytes), each with
    what a dataset they published lacks: plan format 1 wrote no checksums; before it, manifest format 2."""
    before = {k: v for k, v in plan.items() if k != "checksums"}
    before["plan_format"] = 1
    return [(dumps_json(before), "without checksums"),
            (dumps_json({**before, "manifest_format": 2}), "with manifest format 2 and without checksums")]


def plan_jobs(plan: dict[str, Any], staging: str) -> list[UnitJob]:
    return [UnitJob(plan["group"], staging, k, SourceUnit(u["path"], u["rel"], u["file_index"], tuple(u["row_groups"]),
                                                          u["start"], u["num_samples"]),
                    u["first_sample"], u["first_shard"], tuple(u["shard_counts"]), plan["max_image_pixels"],
                    plan["image_dir"], plan["rel_image_dir"]) for k, u in enumerate(plan["units"])]


def part_units(plan: dict[str, Any], part: int, num_parts: int) -> list[int]:
    """Unit indices of part ``part`` of ``num_parts``: contiguous, disjoint, balanced by sample count."""
    if num_parts < 1 or not 0 <= part < num_parts:
        raise ConvertError(f"--part {part} --num-parts {num_parts}: need num_parts >= 1 and 0 <= part < num_parts")
    units = plan["units"]
    total = sum(u["num_samples"] for u in units)
    return [k for k, u in enumerate(units)
            if (u["first_sample"] * num_parts // total if total else k * num_parts // len(units)) == part]


def _plan_changes(old: bytes, new: dict[str, Any]) -> str:
    """The top-level plan keys that differ (e.g. ``sources``, ``source_root``, ``samples_per_shard``)."""
    try:
        before = json.loads(old)
    except ValueError:
        return "unreadable staged plan"
    if not isinstance(before, dict):
        return "unreadable staged plan"
    keys = sorted(k for k in set(before) | set(new) if before.get(k) != json.loads(dumps_json(new.get(k))))
    inputs = [k for k in keys if k not in _DERIVED]  # name the cause, not what follows from it
    return ", ".join(inputs or keys) or "plan format"


def open_staging(ds_dir: str, plan: dict[str, Any], overwrite: bool, num_parts: int = 1) -> tuple[str, bool]:
    """The staging dir of ``ds_dir`` holding ``plan`` (resumed when it matches, else started over).

    Returns ``(staging, merged)``; ``merged``: a previous run finished the merge and only the publish is left.
    Staged units of a different plan are discarded, except by a part run (``num_parts > 1``) without
    ``overwrite``: another part may own them, so it raises ConvertError naming the plan keys that differ.
    """
    if has_files(ds_dir) and not overwrite:
        raise ConvertError(f"{ds_dir}: output directory is not empty and holds another conversion (other sources "
                           f"or options, or one converted before plans were recorded): pass --overwrite to replace it")
    staging = ds_dir.rstrip(os.sep) + ".partial"
    work = os.path.join(staging, WORK_DIR)
    plan_bytes = dumps_json(plan)
    plan_path = os.path.join(work, "plan.json")
    if os.path.isdir(staging):
        merged = os.path.exists(os.path.join(staging, MANIFEST_NAME)) and not os.path.exists(work)
        if merged and from_plan(staging, plan_bytes):
            return staging, True  # merged by a run that was stopped before the publish: only that is left
        staged = None
        if not merged:
            try:
                with open(plan_path, "rb") as f:
                    staged = f.read()
            except FileNotFoundError:
                if num_parts > 1:  # another part may be about to write it (parts start together): keep its dir
                    staged = plan_bytes
        if staged != plan_bytes:
            changed = (_plan_changes(staged, plan) if staged is not None
                       else "a merged dataset of another plan" if merged else "no staged plan")
            if num_parts > 1 and staged is not None and not overwrite:
                raise ConvertError(
                    f"{staging}: staged work of a different conversion (differs in: {changed}); every --part must "
                    f"use the same sources and options (and, for `convert config`, the same --source-root or "
                    f"working directory): rerun with those of the other parts, or pass --overwrite to discard the "
                    f"staged work")
            logger.warning("%s: staged work of a different conversion (differs in: %s); starting over",
                           staging, changed)
            shutil.rmtree(staging)
        else:
            logger.info("%s: resuming a previous conversion", staging)
    os.makedirs(work, exist_ok=True)
    if not os.path.exists(plan_path):
        write_atomic(plan_path, plan_bytes, tmp=f".tmp{os.getpid()}")
    return staging, False


def run_jobs(jobs: list[UnitJob], workers: int, bar: tqdm) -> None:
    """Convert ``jobs`` in this process (``workers <= 1``) or in a pool of forked processes."""
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            run_unit(job, on_rows=bar.update)
        return
    ctx = multiprocessing.get_context("fork")  # workers inherit the parsed inputs (vlm lines) for free
    # Ctrl-C reaches the whole process group: only this process handles it, not every worker with a traceback of
    # its own; it stops the workers at once (a unit in progress leaves only *.tmp files: a rerun redoes it).
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=ctx,
                             initializer=signal.signal, initargs=(signal.SIGINT, signal.SIG_IGN)) as ex:
        futures = [ex.submit(run_unit, job) for job in jobs]
        try:
            for fut in as_completed(futures):
                bar.update(fut.result()["num_samples"])
        except BaseException as exc:
            for fut in futures:
                fut.cancel()
            if isinstance(exc, KeyboardInterrupt):
                _stop_pool(ex)
            raise


def _stop_pool(ex: ProcessPoolExecutor) -> None:
    """Terminate the pool's workers now instead of letting the executor wait for the units already handed out
    (minutes on big files, and a second Ctrl-C then deadlocks multiprocessing's exit joins)."""
    table = getattr(ex, "_processes", None)  # the executor's worker table (CPython 3.9-3.13: pid -> Process)
    procs = list(table.values()) if isinstance(table, dict) else []
    logger.warning("interrupted: stopping %d converter worker processes", len(procs))
    ex.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        p.terminate()
    for p in procs:
        p.join(10)
