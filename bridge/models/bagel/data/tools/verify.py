"""``bagel-data verify DATASET_OR_CONFIG``: every shard and sample of converted datasets checked against their
manifests, in parallel, with a summary by dataset and an exit code a cluster script can act on.

What is checked, per dataset: its Energon index (``.nv-meta``) and manifest load (``manifest.columns.npy`` and
``manifest.checksums.npy`` whole, by their sha256); per shard (one task each, any process): what the damage checks
find (``energon.layout.damage.check_shard``: a missing shard, one cut short, a corrupt tar header, a missing or stale
``.tar.idx``), its size and sha256 against the manifest, and, when the sha256 differs, every sample's
``layout.sample_checksum`` against ``manifest.checksums.npy`` (the samples read as Energon reads them: the tar's
regular members grouped by key, their bytes as stored). A shard whose sha256 differs while every sample matches
differs only outside the samples' bytes (tar padding, unused header fields): harmless, listed as a note. A dataset
may be an ``msc://`` URL (object storage, ``energon.remote``): its files are read through MSC, each shard
once, whole, into memory; the damage checks there only see whether each shard and index object exists.

Exit codes: 0 every checked shard and sample matches; 1 damage found (the report names each damaged file and
sample and the remedy); 2 the command could not run (no such dataset, an unreadable config); 3 nothing damaged
was found but some datasets record no checksums (converted by an earlier release: only the damage checks ran).
``--workers N`` processes, ``--part i --num-parts K`` (contiguous parts of all the shards, balanced by bytes, the
same in every process) split the work like the converter's.
"""

from __future__ import annotations

import functools
import hashlib
import io
import itertools
import multiprocessing
import os
import tarfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..energon import remote
from ..energon.layout import damage
from ..energon.layout.shards import shard_samples
from ..energon.layout import (CHECKSUMS_NAME, COLUMNS_NAME, GROUPS, MANIFEST_NAME, ManifestError, checksums_entry,
                              load_manifest, open_checksums, sample_checksum, sample_key)
from . import text_table

__all__ = ["DatasetReport", "ShardResult", "VerifyError", "VerifyReport", "format_report", "resolve_datasets", "verify"]

#: Bad samples a shard's result lists (all are counted).
_MAX_LISTED = 20

EXIT_OK, EXIT_DAMAGED, EXIT_ERROR, EXIT_UNVERIFIED = 0, 1, 2, 3


class VerifyError(ValueError):
    """The target cannot be verified at all (no such dataset, an unreadable config): one line."""


@dataclass(frozen=True)
class _Task:
    """One shard to check (picklable): dataset number, root, path relative to it, its samples, what the manifest
    records (``bytes`` / ``sha256`` None for datasets converted before checksums)."""

    dataset: int
    root: str
    path: str
    first_sample: int
    count: int
    bytes: int | None
    sha256: str | None
    verified: bool


@dataclass
class ShardResult:
    """What one shard check found: ``problems`` (one line each: damage with its remedy), ``bad_samples``
    (``(key, what)``, the first ``_MAX_LISTED``), ``num_bad`` (all of them), ``harmless`` (the sha256 differs, every
    sample matches), ``bytes_read``."""

    dataset: int
    path: str
    problems: list[str] = field(default_factory=list)
    bad_samples: list[tuple[str, str]] = field(default_factory=list)
    num_bad: int = 0
    harmless: bool = False
    bytes_read: int = 0

    @property
    def damaged(self) -> bool:
        return bool(self.problems or self.num_bad)


@dataclass
class DatasetReport:
    """One dataset's results: ``name`` (``group/name``), ``verified`` (it records checksums), ``problems`` (its
    manifest / index / checksums file), and the results of the shards this part checked."""

    root: str
    name: str
    verified: bool = False
    samples: int = 0
    problems: list[str] = field(default_factory=list)
    shards: list[ShardResult] = field(default_factory=list)

    @property
    def damaged(self) -> bool:
        return bool(self.problems) or any(s.damaged for s in self.shards)


@dataclass
class VerifyReport:
    """The whole run: per dataset reports, which part of how many, and the exit code it calls for."""

    datasets: list[DatasetReport]
    part: int = 0
    num_parts: int = 1

    @property
    def exit_code(self) -> int:
        if any(d.damaged for d in self.datasets):
            return EXIT_DAMAGED
        return EXIT_UNVERIFIED if any(not d.verified for d in self.datasets) else EXIT_OK


def _is_dataset(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST_NAME)) or os.path.isdir(os.path.join(path, ".nv-meta"))


def resolve_datasets(target: str) -> list[str]:
    """The converted dataset directories ``target`` names: a dataset directory; a directory holding converted
    datasets (``<out>/<group>/<name>/``, e.g. the converter's ``--out``, searched 3 levels deep, staged
    ``*.partial`` conversions skipped); a ``dataset_info`` registry (YAML/JSON with ``energon_path`` entries, as
    ``bagel-data convert config`` writes); or a job config (YAML with ``data.groups`` / ``data.dataset_info``: the
    datasets its groups name); an ``msc://`` URL of one converted dataset in object storage. Raises VerifyError
    (one line)."""
    if remote.is_remote(target):
        return [remote.absolute(target)]
    if os.path.isdir(target):
        if _is_dataset(target):
            return [os.path.abspath(target)]
        found = []
        base = target.rstrip(os.sep).count(os.sep)
        for dirpath, dirnames, _ in os.walk(target):
            dirnames[:] = sorted(d for d in dirnames if not d.endswith(".partial") and not d.startswith("."))
            if dirpath != target and _is_dataset(dirpath):
                found.append(os.path.abspath(dirpath))
                dirnames[:] = []
            elif dirpath.count(os.sep) - base >= 3:
                dirnames[:] = []
        if not found:
            raise VerifyError(f"{target}: neither a converted dataset (no {MANIFEST_NAME}, no .nv-meta/) nor a "
                              "directory holding converted datasets (<group>/<name>/)")
        return found
    if not os.path.isfile(target):
        raise VerifyError(f"{target}: no such dataset directory or config file")
    return _datasets_of_config(target)


def _datasets_of_config(path: str) -> list[str]:
    from ..config import ConfigError, load_dataset_info, load_grouped_yaml, resolve_groups
    from ..config.grouped_yaml import read_mapping

    try:
        data, src = read_mapping(path, path)
        if data and set(data) <= set(GROUPS):  # a dataset_info registry
            registry = load_dataset_info(path, source=src)
            entries = [e for group in registry.values() for e in group.values()]
        else:  # a job config: the datasets of its groups
            from ..job.config import load_job_config

            cfg = load_job_config(path).data
            groups = load_grouped_yaml(cfg.groups, source=str(cfg.groups))
            registry = load_dataset_info(cfg.dataset_info, source=str(cfg.dataset_info))
            entries = [e for g in resolve_groups(groups, registry, source=str(cfg.dataset_info)) for e in g.datasets]
    except ConfigError as exc:
        raise VerifyError(" ".join(str(exc).split())) from None
    missing = [e for e in entries if not e.energon_path]
    if missing:
        raise VerifyError(f"{path}: {len(missing)} datasets have no energon_path (not converted yet; e.g. data_dir "
                          f"{missing[0].data_dir})")
    out = list(dict.fromkeys(remote.absolute(str(e.energon_path)) for e in entries))  # as the readers name them
    for p in out:
        if not remote.is_remote(p) and not os.path.isdir(p):
            raise VerifyError(f"{path}: dataset directory {p} does not exist")
    return out


def _file_sha256(path: str) -> str | None:
    """The sha256 of a file (a shard, the checksums file), or None when it cannot be read."""
    try:
        with remote.open_binary(path) as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None


def _dataset_checks(k: int, root: str) -> tuple[DatasetReport, list[_Task]]:
    """The dataset-level checks and the dataset's shard tasks (none when its manifest cannot be read)."""
    group = os.path.basename(os.path.dirname(root))
    rep = DatasetReport(root, f"{group}/{os.path.basename(root)}")
    try:
        damage.check_prepared(root)
    except ValueError as exc:
        rep.problems.append(str(exc))
    if not remote.isfile(remote.join(root, MANIFEST_NAME)) and not rep.problems:
        return rep, []  # an Energon dataset not converted by bagel-data: nothing recorded to verify against
    try:
        man = load_manifest(root)  # also checks the columns sidecar's sha256 and the checksums file's size
    except ManifestError as exc:
        rep.problems.append(str(exc))
        return rep, []
    rep.name, rep.samples = f"{man['group']}/{man['dataset_name']}", int(man["num_samples"])
    entry = checksums_entry(man)
    rep.verified = entry is not None
    if entry is not None:
        if _file_sha256(remote.join(root, CHECKSUMS_NAME)) != entry["sha256"]:
            rep.problems.append(f"{remote.join(root, CHECKSUMS_NAME)}: its sha256 differs from the one in "
                                f"{MANIFEST_NAME}: the checksums themselves are damaged; copy the dataset again with "
                                f"all its manifest files ({MANIFEST_NAME}, {COLUMNS_NAME}, {CHECKSUMS_NAME}), or "
                                "convert it again (--overwrite)")
            rep.verified = False
    firsts = itertools.accumulate((int(sh["count"]) for sh in man["shards"]), initial=0)
    return rep, [_Task(k, root, sh["path"], first, int(sh["count"]), sh.get("bytes"), sh.get("sha256"), rep.verified)
                 for sh, first in zip(man["shards"], firsts)]


#: The dataset's recorded per-sample checksums (memory-mapped, cached per process).
_expected = functools.cache(open_checksums)


def _check_shard(task: _Task) -> ShardResult:
    """Check one shard (see the module docstring); never raises for damage, it reports it."""
    tar = remote.join(task.root, task.path)
    res = ShardResult(task.dataset, task.path)
    problem = damage.check_shard(task.root, tar)
    if problem is not None:
        res.problems.append(problem)
        if not remote.isfile(tar):
            return res
    res.bytes_read = size = remote.size(tar)
    if task.bytes is not None and size != task.bytes and problem is None:
        res.problems.append(f"shard {tar} is {size} bytes, the manifest says {task.bytes}: re-copy it from a good "
                            "copy, or convert the dataset again (--overwrite)")
    if not task.verified or task.sha256 is None:
        return res
    data = io.BytesIO(remote.read_bytes(tar)) if remote.is_remote(tar) else None  # one read of the whole object
    if (_file_sha256(tar) if data is None else hashlib.sha256(data.getbuffer()).hexdigest()) == task.sha256:
        return res
    expected = _expected(task.root)
    assert expected is not None
    seen: set[str] = set()

    def bad(key: str, what: str) -> None:
        res.num_bad += 1
        if len(res.bad_samples) < _MAX_LISTED:
            res.bad_samples.append((key, what))

    try:
        for key, parts in shard_samples(tar if data is None else data):
            index = int(key) if key.isdigit() else -1
            if not (task.first_sample <= index < task.first_sample + task.count and key == sample_key(index)):
                bad(key, "a key that is no sample of this shard (a damaged tar header)")
                continue
            seen.add(key)
            got, want = sample_checksum(parts), int(expected[index])
            if got != want:
                bad(key, f"its bytes differ from the checksum recorded at conversion (xxh3 {got:016x}, recorded "
                         f"{want:016x}; parts {sorted(p for p, _ in parts)})")
    except (tarfile.TarError, OSError, EOFError) as exc:
        if problem is None:
            res.problems.append(f"damaged shard {tar}: unreadable ({type(exc).__name__}: {exc}): re-copy it or "
                                "convert the dataset again (--overwrite)")
    if not res.problems:  # read to its end: every sample it should hold is there
        for key in map(sample_key, range(task.first_sample, task.first_sample + task.count)):
            if key not in seen:
                bad(key, "missing from the shard")
    res.harmless = not res.damaged
    return res


def _part_tasks(tasks: list[_Task], part: int, num_parts: int) -> list[_Task]:
    """Part ``part`` of ``num_parts``: contiguous, disjoint, balanced by shard bytes (the count when unknown)."""
    if num_parts < 1 or not 0 <= part < num_parts:
        raise VerifyError(f"--part {part} --num-parts {num_parts}: need num_parts >= 1 and 0 <= part < num_parts")
    weights = [t.bytes if t.bytes is not None else t.count for t in tasks]
    total, before, out = sum(weights), 0, []
    for k, (t, w) in enumerate(zip(tasks, weights)):
        if (before * num_parts // total if total else k * num_parts // len(tasks)) == part:
            out.append(t)
        before += w
    return out


def verify(targets: Sequence[str], *, workers: int = 1, part: int = 0, num_parts: int = 1,
           progress: Callable[[int, int], Any] | None = None) -> VerifyReport:
    """Verify the converted datasets ``targets`` name (:func:`resolve_datasets`); ``progress(total_bytes,
    done_bytes)`` is called as shards finish. Raises VerifyError when a target names no dataset."""
    roots = dict.fromkeys(r for t in targets for r in resolve_datasets(t))  # each once, in order
    checks = [_dataset_checks(k, root) for k, root in enumerate(roots)]
    reports, tasks = [rep for rep, _ in checks], [t for _, ts in checks for t in ts]
    mine = _part_tasks(tasks, part, num_parts) if tasks else []
    progress = progress or (lambda total, done: None)
    total = sum(t.bytes or 0 for t in mine)
    progress(total, 0)
    pool = multiprocessing.get_context("fork").Pool(min(workers, len(mine))) if workers > 1 and len(mine) > 1 else None
    results = map(_check_shard, mine) if pool is None else pool.imap_unordered(_check_shard, mine)
    try:
        done = 0
        for res in results:
            reports[res.dataset].shards.append(res)
            done += res.bytes_read
            progress(total, done)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    for rep in reports:
        rep.shards.sort(key=lambda s: s.path)
    return VerifyReport(reports, part, num_parts)


def format_report(report: VerifyReport) -> str:
    """The summary table by dataset, then one line per problem, damaged sample and harmless difference, then the
    verdict and a machine-readable last line (``verify: key=value ...``)."""
    head = ("dataset", "shards", "samples", "checksums", "damaged shards", "bad samples", "harmless")
    rows = [(d.name, str(len(d.shards)), str(d.samples), "yes" if d.verified else "NO",
             str(sum(s.damaged for s in d.shards)), str(sum(s.num_bad for s in d.shards)),
             str(sum(s.harmless for s in d.shards))) for d in report.datasets]
    lines = text_table(head, rows)
    if report.num_parts > 1:
        lines.append(f"(part {report.part} of {report.num_parts}: the shards of the other parts are not counted here)")
    for d in report.datasets:
        lines += [f"DAMAGED {d.name}: {p}" for p in d.problems]
        if not d.verified and not d.problems:
            lines.append(f"NOT VERIFIED {d.name} ({d.root}): " + (
                "it records no checksums (converted by an earlier release); only missing / short shards and stale "
                "indexes were checked: convert it again (--overwrite) to get them" if d.shards else
                f"no {MANIFEST_NAME} (an Energon dataset not converted by bagel-data): nothing to verify against"))
        for s in d.shards:
            lines += [f"DAMAGED {d.name}: {p}" for p in s.problems]
            shard = os.path.join(d.root, s.path)
            lines += [f"DAMAGED {d.name}: shard {shard}: sample {key}: {what}" for key, what in s.bad_samples]
            if s.num_bad > len(s.bad_samples):
                lines.append(f"DAMAGED {d.name}: shard {shard}: {s.num_bad - len(s.bad_samples)} more damaged samples")
            if s.num_bad:
                lines.append(f"  remedy: re-copy {shard} from a good copy, or convert {d.name} again (`bagel-data "
                             "convert ... --overwrite`)")
            if s.harmless:
                lines.append(f"note {d.name}: shard {shard} differs from its recorded sha256 only outside its samples' "
                             "bytes (tar padding or unused header fields): harmless, every sample matches")
    code = report.exit_code
    verdict = {EXIT_OK: "ok: every checked shard and sample matches its manifest",
               EXIT_DAMAGED: "DAMAGED: see the lines above (exit 1)",
               EXIT_UNVERIFIED: "no damage found, but some datasets record no checksums (exit 3)"}[code]
    ds = report.datasets
    shards = [s for d in ds for s in d.shards]
    lines += [verdict, f"verify: datasets={len(ds)} shards={len(shards)} damaged_datasets={sum(d.damaged for d in ds)} "
              f"damaged_shards={sum(s.damaged for s in shards)} bad_samples={sum(s.num_bad for s in shards)} "
              f"harmless_shards={sum(s.harmless for s in shards)} unverified_datasets="
              f"{sum(not d.verified for d in ds)} part={report.part}/{report.num_parts} exit={code}"]
    return "\n".join(lines)
