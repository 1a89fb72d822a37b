"""One work unit of a conversion: its samples into tar shards, their Energon ``.tar.idx``, an index fragment.

A unit (one parquet file, or one range of jsonl lines, see ``formats.SourceUnit``) owns a fixed, precomputed
range of sample indices and shard numbers, so it can run in any process, in any order, on any machine, and
always writes the same bytes. Everything is written under temporary names in the staging directory and
published with ``os.replace``; the unit's record ``.convert/unit-NNNNNN.json`` is published last, so
"the record exists" == "the unit is done" (a killed run redoes only the units without a record).

Tar members are written directly (a 512-byte GNU header built from a template, then the bytes, then the
padding): the same bytes ``tarfile`` writes for these members (checked by the tests), without its
per-member overhead. The offsets known while writing give Energon's ``.tar.idx`` and the ``samples`` rows of
Energon's ``index.sqlite`` without reading the shards again. The checksums are taken from the bytes as they are
written: each sample's :func:`~..energon.layout.sample_checksum` (into the unit's ``unit-NNNNNN.sums.npy``
fragment, concatenated in unit order by the merge) and each shard's sha256 (in the unit record).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sqlite3
import struct
import tarfile
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..energon.layout import META_PART, SHARDS_DIR, image_part, sample_checksum, sample_key, shard_relpath
from .formats import SourceUnit, dumps_json, iter_unit, record_problem

__all__ = ["UnitJob", "UnitWriteError", "run_unit", "tar_header", "image_problem", "unit_record_path",
           "unit_index_path", "unit_checksums_path", "WORK_DIR", "IMAGE_EMPTY", "IMAGE_UNREADABLE", "IMAGE_OVER_LIMIT", "TAR_RECORD"]

#: Staging sub-directory holding the plan, the unit records and the index fragments (removed at publish).
WORK_DIR = ".convert"
#: Image check reasons (counted in the summary; the sample and its bytes are kept unchanged).
IMAGE_EMPTY = "empty image (0 bytes)"
IMAGE_UNREADABLE = "unreadable image header"
IMAGE_OVER_LIMIT = "image above the pixel limit"

TAR_BLOCK, TAR_RECORD = tarfile.BLOCKSIZE, tarfile.RECORDSIZE
_ZEROS = bytes(TAR_RECORD)
_MAX_WARNINGS = 20  # warning texts a unit record keeps (all are counted)


def _template() -> bytes:
    ti = tarfile.TarInfo("x")
    ti.size, ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = 0, 0, 0o644, 0, 0, "", ""
    return ti.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")


_T = _template()
_MODE_IDS, _MTIME_ETC, _TAIL = _T[100:124], _T[136:148], _T[156:]
_CHK_BASE = sum(_MODE_IDS) + sum(_MTIME_ETC) + sum(_TAIL) + 8 * 0x20  # checksum field counts as 8 spaces


def tar_header(name: str, size: int) -> bytes:
    """The GNU tar header ``tarfile`` writes for a regular member (mode 0644, uid/gid 0, mtime 0, no owner names).

    Short ASCII names (< 100 bytes) and sizes < 8 GiB are built from a template; anything else is delegated
    to ``tarfile`` (long names need extra GNU blocks). Returns 512 bytes (or a multiple).
    """
    raw = name.encode("utf-8")
    if len(raw) >= 100 or size >= 8 ** 11 or not raw.isascii():
        ti = tarfile.TarInfo(name)
        ti.size, ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = size, 0, 0o644, 0, 0, "", ""
        return ti.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")
    size_field = b"%011o\0" % size
    chk = _CHK_BASE + sum(raw) + sum(size_field)
    return raw + _ZEROS[:100 - len(raw)] + _MODE_IDS + size_field + _MTIME_ETC + b"%06o\0 " % chk + _TAIL


def image_problem(data: bytes, max_pixels: int) -> tuple[str, str] | None:
    """``(reason, detail)`` when an encoded image is empty, has no readable header or exceeds ``max_pixels``.

    Only the header is parsed (``PIL.Image.open`` does not decode pixels). None when the image looks fine.
    """
    if not data:
        return IMAGE_EMPTY, "0 bytes"
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as im:
                w, h = im.size
    except Image.DecompressionBombError as e:  # PIL refuses > 2x its own MAX_IMAGE_PIXELS at open
        return IMAGE_OVER_LIMIT, str(e).split(" could be")[0]
    except Exception as e:  # PIL raises UnidentifiedImageError, SyntaxError, OSError, ... on bad headers
        return IMAGE_UNREADABLE, f"{type(e).__name__}: {str(e).split(' <')[0]}"
    if w * h > max_pixels:
        return IMAGE_OVER_LIMIT, f"{w}x{h} = {w * h} pixels > {max_pixels}"
    return None


class UnitWriteError(Exception):
    """Writing a unit's output failed (e.g. ENOSPC): the path, errno, message and bytes of that file written."""

    def __init__(self, path: str, errno: int | None, strerror: str, written: int) -> None:
        super().__init__(path, errno, strerror, written)
        self.path, self.errno, self.strerror, self.written = path, errno, strerror, written

    def __str__(self) -> str:
        return f"{self.path}: {self.strerror} (errno {self.errno}) after {self.written} bytes of that file"


@dataclass(frozen=True)
class UnitJob:
    """Everything a (possibly forked) worker needs to convert one unit; picklable."""

    group: str
    staging: str
    index: int
    unit: SourceUnit
    first_sample: int
    first_shard: int
    shard_counts: tuple[int, ...]
    max_image_pixels: int
    image_dir: str = ""
    rel_image_dir: str = ""


def unit_record_path(staging: str, index: int) -> str:
    return os.path.join(staging, WORK_DIR, f"unit-{index:06d}.json")


def unit_index_path(staging: str, index: int) -> str:
    return os.path.join(staging, WORK_DIR, f"unit-{index:06d}.sqlite")


def unit_checksums_path(staging: str, index: int) -> str:
    """The unit's per-sample checksums: ``np.save`` of a ``<u8 [num_samples]`` array, in sample order."""
    return os.path.join(staging, WORK_DIR, f"unit-{index:06d}.sums.npy")


class _Out:
    """A file written under ``<final>.tmp``; tracks the path being written, the bytes written so far and, with
    ``hashed``, their sha256."""

    def __init__(self, final: str, hashed: bool = False) -> None:
        self.final, self.tmp, self.written = final, final + ".tmp", 0
        self.f = open(self.tmp, "wb", buffering=1 << 20)
        self.sha256 = hashlib.sha256() if hashed else None

    def write(self, b: bytes) -> None:
        self.f.write(b)
        self.written += len(b)
        if self.sha256 is not None:
            self.sha256.update(b)


class _UnitWriter:
    def __init__(self, job: UnitJob) -> None:
        self.job = job
        self.tmps: list[tuple[str, str]] = []  # (tmp, final) in publish order
        self.current: _Out | None = None
        self.shards: list[dict[str, Any]] = []
        self.rows: list[tuple[int, str, int, int, int]] = []  # Energon `samples` rows
        self.sums: list[int] = []  # per-sample checksums, in sample order

    def _open(self, final: str, hashed: bool = False) -> _Out:
        self.current = _Out(final, hashed)
        self.tmps.append((self.current.tmp, final))
        return self.current

    def write_samples(self, samples: Iterable[Any], on_sample: Callable[[Any], None]) -> None:
        job = self.job
        n = job.first_sample
        it = iter(samples)
        for s_i, count in enumerate(job.shard_counts):
            shard = job.first_shard + s_i
            rel = shard_relpath(shard)
            out = self._open(os.path.join(job.staging, rel), hashed=True)
            starts: list[int] = []
            for j in range(count):
                s = next(it)
                on_sample(s)
                key, start = sample_key(n), out.written
                starts.append(start)
                parts = [(META_PART, s.meta_json)] + [(image_part(i), b) for i, b in s.images]
                self.sums.append(sample_checksum(parts))
                for name, data in parts:
                    size = len(data)
                    out.write(tar_header(f"{key}.{name}", size))
                    out.write(data)
                    if size % TAR_BLOCK:
                        out.write(_ZEROS[:TAR_BLOCK - size % TAR_BLOCK])
                self.rows.append((shard, key, j, start, out.written - start))
                n += 1
            end = out.written
            out.write(_ZEROS[:2 * TAR_BLOCK])
            if out.written % TAR_RECORD:
                out.write(_ZEROS[:TAR_RECORD - out.written % TAR_RECORD])
            out.f.close()
            self.shards.append({"path": rel, "count": count, "bytes": out.written, "sha256": out.sha256.hexdigest()})
            idx = self._open(os.path.join(job.staging, rel + ".idx"))  # Energon's itar index: sample starts + end
            idx.write(struct.pack(f"{len(starts) + 1}Q", *starts, end))
            idx.f.close()
        if next(it, None) is not None:
            raise RuntimeError(f"{job.unit.rel}: more rows than its metadata declares ({job.unit.num_samples})")
        self.current = None

    def write_checksums(self) -> None:
        out = self._open(unit_checksums_path(self.job.staging, self.job.index))
        buf = io.BytesIO()
        np.save(buf, np.array(self.sums, dtype="<u8"), allow_pickle=False)
        out.write(buf.getvalue())
        out.f.close()
        self.current = None

    def write_index(self) -> None:
        path = unit_index_path(self.job.staging, self.job.index)
        self.tmps.append((path + ".tmp", path))
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")
        self.current = None
        db = sqlite3.connect(path + ".tmp")
        try:
            db.execute("PRAGMA synchronous = OFF")  # no fsync: the fragment is published by os.replace like the shards
            db.execute("CREATE TABLE samples (tar_file_id INTEGER, sample_key TEXT, sample_index INTEGER, "
                       "byte_offset INTEGER, byte_size INTEGER)")
            db.executemany("INSERT INTO samples VALUES (?, ?, ?, ?, ?)", self.rows)
            db.commit()
        finally:
            db.close()

    def publish(self, record: dict[str, Any]) -> None:
        for tmp, final in self.tmps:
            os.replace(tmp, final)
        final = unit_record_path(self.job.staging, self.job.index)
        out = self._open(final)
        out.write(json.dumps(record, sort_keys=True).encode())
        out.f.close()
        os.replace(out.tmp, final)

    def discard(self) -> None:
        if self.current is not None:
            try:
                self.current.f.close()  # flushing may fail again (disk still full)
            except OSError:
                pass
        for tmp, _ in self.tmps:
            try:
                os.remove(tmp)
            except OSError:
                pass


def run_unit(job: UnitJob, on_rows: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Convert one unit into the staging directory and publish it; return its record (see module doc).

    Raises ``ConvertError`` for unreadable input and :class:`UnitWriteError` when writing fails (nothing of
    the unit stays published then).
    """
    problems: Counter = Counter()
    images: Counter = Counter()
    examples: dict[str, str] = {}
    warns: list[str] = []
    n_warn = 0

    def warn(msg: str) -> None:
        nonlocal n_warn
        n_warn += 1
        if len(warns) < _MAX_WARNINGS:
            warns.append(msg)

    def where(s: Any) -> str:
        src = s.meta["source"]
        return f"{src['file']} line {src['line']}" if "line" in src else \
            f"{src['file']} row group {src['row_group']} row {src['row']}"

    pending = 0

    def on_sample(s: Any) -> None:
        nonlocal pending
        s.meta_json = dumps_json(s.meta)
        problem = record_problem(s.meta)
        if problem is not None:
            reason = problem.split(" (")[0]
            problems[reason] += 1
            examples.setdefault(reason, f"{s.meta.get('source')}: {problem}")
        video = s.meta.get("video")
        for i, b in s.images:
            if isinstance(video, dict) and not video.get("folder"):
                continue  # a video file's bytes, not an image (decoded by the reader: cooking.video)
            bad = image_problem(b, job.max_image_pixels)
            if bad is not None:
                images[bad[0]] += 1
                examples.setdefault(bad[0], f"{where(s)} image {i}: {bad[1]}")
        if on_rows is not None:
            pending += 1
            if pending >= 256:
                on_rows(pending)
                pending = 0

    os.makedirs(os.path.join(job.staging, SHARDS_DIR), exist_ok=True)
    os.makedirs(os.path.join(job.staging, WORK_DIR), exist_ok=True)
    w = _UnitWriter(job)
    try:
        try:
            w.write_samples(iter_unit(job.group, job.unit, image_dir=job.image_dir, rel_image_dir=job.rel_image_dir,
                                      warn=warn), on_sample)
            w.write_checksums()
            w.write_index()
            record = {"unit": job.index, "file": job.unit.rel, "first_sample": job.first_sample,
                      "num_samples": job.unit.num_samples, "shards": w.shards, "problems": dict(problems),
                      "image_problems": dict(images), "examples": examples, "warnings": warns,
                      "num_warnings": n_warn}
            w.publish(record)
        except (OSError, sqlite3.Error) as e:
            path = w.current.tmp if w.current is not None else unit_index_path(job.staging, job.index)
            try:  # what reached the file (the buffered rest did not)
                written = os.path.getsize(path)
            except OSError:
                written = 0
            raise UnitWriteError(path, getattr(e, "errno", None), getattr(e, "strerror", None) or str(e),
                                 written) from e
    except BaseException:
        w.discard()
        raise
    if on_rows is not None and pending:
        on_rows(pending)
    return record
