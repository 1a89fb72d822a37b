"""One work unit of a conversion: its samples into tar shards, their Energon ``.tar.idx``, an index fragment.

A unit (``formats.SourceUnit``) owns a fixed, precomputed range of sample indices and shard numbers, so it can run
in any process, in any order, on any machine, and always writes the same bytes. Everything is written under
temporary names in the staging directory and published with ``os.replace``; the unit's record
``.convert/unit-NNNNNN.json`` is published last, so "the record exists" == "the unit is done".

Tar members are written directly (a 512-byte GNU header built from a template, the bytes, the padding): the bytes
``tarfile`` writes (checked by the tests) without its per-member overhead. The offsets known while writing give
Energon's ``.tar.idx`` and the ``samples`` rows of its ``index.sqlite``; the checksums are taken from the bytes as
they are written: each sample's :func:`~..energon.layout.sample_checksum` (the unit's ``unit-NNNNNN.sums.npy``
fragment, concatenated in unit order by the merge) and each shard's sha256 (in the unit record).
"""

from __future__ import annotations

import contextlib
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

from ..energon.layout import (META_PART, SHARDS_DIR, TRUNCATED_IMAGE, image_part, image_truncation, sample_checksum,
                              sample_key, shard_relpath)
from .formats import SourceUnit, dumps_json, iter_unit, record_problem

__all__ = ["UnitJob", "UnitWriteError", "run_unit", "tar_header", "image_problem", "unit_record_path",
           "unit_index_path", "unit_checksums_path", "WORK_DIR", "IMAGE_EMPTY", "IMAGE_UNREADABLE", "IMAGE_OVER_LIMIT",
           "TAR_RECORD"]

#: Staging sub-directory holding the plan, the unit records and the index fragments (removed at publish).
WORK_DIR = ".convert"
#: Image check reasons (counted in the summary; the sample and its bytes are kept unchanged).
IMAGE_EMPTY = "empty image (0 bytes)"
IMAGE_UNREADABLE = "unreadable image header"
IMAGE_OVER_LIMIT = "image above the pixel limit"

TAR_BLOCK, TAR_RECORD = tarfile.BLOCKSIZE, tarfile.RECORDSIZE
_ZEROS = bytes(TAR_RECORD)
_MAX_WARNINGS = 20  # warning texts a unit record keeps (all are counted)
#: Bytes of tar members gathered into one ``os.writev`` of a shard: no joined copy, and the pieces still in the CPU
#: cache from their hashing (docs/performance.md); at most ``_GATHER_PIECES`` pieces (below every ``IOV_MAX``).
_GATHER = 256 << 10
_GATHER_PIECES = 512


def _gnu_header(name: str, size: int) -> bytes:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = size, 0, 0o644, 0, 0, "", ""
    return ti.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")


_T = _gnu_header("x", 0)
_MODE_IDS, _MTIME_ETC, _TAIL = _T[100:124], _T[136:148], _T[156:]
_CHK_BASE = sum(_MODE_IDS) + sum(_MTIME_ETC) + sum(_TAIL) + 8 * 0x20  # checksum field counts as 8 spaces


def tar_header(name: str, size: int) -> bytes:
    """The GNU tar header ``tarfile`` writes for a regular member (mode 0644, uid/gid 0, mtime 0, no owner names).

    Short ASCII names (< 100 bytes) and sizes < 8 GiB are built from a template; anything else is delegated
    to ``tarfile`` (long names need extra GNU blocks). Returns 512 bytes (or a multiple).
    """
    raw = name.encode("utf-8")
    if len(raw) >= 100 or size >= 8 ** 11 or not raw.isascii():
        return _gnu_header(name, size)
    size_field = b"%011o\0" % size
    chk = _CHK_BASE + sum(raw) + sum(size_field)
    return raw + _ZEROS[:100 - len(raw)] + _MODE_IDS + size_field + _MTIME_ETC + b"%06o\0 " % chk + _TAIL


#: JPEG markers whose segment PIL's ``JpegImagePlugin`` reads as a frame header (``SOF``: SOF0-15 but DHT, JPG,
#: DAC; DHP), only skips (DHT, DAC, DNL, DRI, EXP, COM) or stores (APP0-15).
_JPEG_SOF = frozenset((0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF, 0xDE))
_JPEG_SKIP = frozenset((0xC4, 0xCC, 0xDC, 0xDD, 0xDF, 0xFE, *range(0xE0, 0xF0)))


def _jpeg_size(data: bytes | memoryview) -> tuple[int, int] | None:
    """``(width, height)`` of a plain JPEG whose header ``PIL.Image.open`` reads without complaint, else None.

    Walks the marker segments up to the start of scan as PIL's ``JpegImageFile._open`` does and applies the same
    checks (segment lengths, DQT table sizes, 8-bit samples, 1/3/4 components, a frame header before the scan).
    Anything PIL would treat in a way of its own (fill bytes, junk between segments, markers without a length, a
    truncated segment, Exif (PIL reads its DPI), MPO, Photoshop or short Adobe/JFIF/ICC segments, a failed check)
    gives None: the caller then asks PIL, so the verdict and its message are always PIL's. ~20x cheaper than
    ``Image.open`` on the JPEGs PIL / libjpeg write.
    """
    if data[:3] != b"\xff\xd8\xff":
        return None
    pos, end, size, icc_short = 2, len(data), None, False
    while pos + 4 <= end and data[pos] == 0xFF:
        marker, length = data[pos + 1], (data[pos + 2] << 8) | data[pos + 3]
        body_at, pos = pos + 4, pos + 2 + length
        if length < 2 or pos > end:
            return None
        if marker == 0xDA:  # start of scan: PIL stops here
            return size if size is not None and size[0] > 0 and size[1] > 0 and not icc_short else None
        if marker in _JPEG_SOF:
            body = data[body_at:pos]
            if len(body) < 6 or (len(body) - 6) % 3 or body[0] != 8 or body[5] not in (1, 3, 4):
                return None
            size = ((body[3] << 8) | body[4], (body[1] << 8) | body[2])
        elif marker == 0xDB:  # DQT: one or more tables of 1 + 64 x precision bytes
            q = body_at
            while q < pos:
                q += 65 if data[q] < 16 else 129
            if q != pos:
                return None
        elif marker in _JPEG_SKIP:
            head = bytes(data[body_at:body_at + 14])
            if ((marker == 0xE0 and head.startswith(b"JFIF") and length - 2 < 7)
                    or (marker == 0xEE and head.startswith(b"Adobe") and length - 2 < 7)
                    or (marker == 0xE1 and head.startswith(b"Exif\0\0"))
                    or (marker == 0xE2 and head.startswith(b"MPF\0"))
                    or (marker == 0xED and head.startswith(b"Photoshop 3.0\x00"))):
                return None
            if marker == 0xE2 and head.startswith(b"ICC_PROFILE\0") and length - 2 < 14:
                icc_short = True
        else:
            return None
    return None


def image_problem(data: bytes | memoryview, max_pixels: int) -> tuple[str, str] | None:
    """``(reason, detail)`` when an encoded image is empty, has no readable header, exceeds ``max_pixels`` or is cut
    short (``TRUNCATED_IMAGE``: ``layout.image_truncation``, the format's end marker).

    Only the header is parsed (``PIL.Image.open`` does not decode pixels; a plain JPEG's header is read by
    :func:`_jpeg_size` with PIL's checks, PIL itself for anything else). None when the image looks fine.
    """
    if not data:
        return IMAGE_EMPTY, "0 bytes"
    from PIL import Image

    size = _jpeg_size(data)
    limit = Image.MAX_IMAGE_PIXELS
    if size is not None and (limit is None or size[0] * size[1] <= limit):
        w, h = size
    else:
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
    cut = image_truncation(data)
    return (TRUNCATED_IMAGE, cut) if cut else None


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
    """A file written under ``<final>.tmp`` (unbuffered), the bytes written so far and, with ``hashed``, their sha256.
    :meth:`write` writes at once; :meth:`gather` hashes pieces as they come and writes them with one ``os.writev``
    per ``_GATHER`` bytes (:meth:`flush` writes the rest)."""

    def __init__(self, final: str, hashed: bool = False) -> None:
        self.final, self.tmp, self.written = final, final + ".tmp", 0
        self.f = open(self.tmp, "wb", buffering=0)
        self.sha256 = hashlib.sha256() if hashed else None
        self.pending: list[bytes | memoryview] = []
        self.pending_bytes = 0

    def write(self, b: bytes) -> None:
        self.gather((b,))
        self.flush()

    def gather(self, pieces: Iterable[bytes | memoryview]) -> None:
        sha = self.sha256
        for piece in pieces:
            if sha is not None:
                sha.update(piece)
            self.pending.append(piece)
            self.pending_bytes += len(piece)
        if self.pending_bytes >= _GATHER or len(self.pending) >= _GATHER_PIECES:
            self.flush()

    def flush(self) -> None:
        """Write every gathered piece (``os.writev``, continued after a short write). Raises ``OSError``."""
        pieces, fd = self.pending, self.f.fileno()
        while pieces:
            batch = pieces[:_GATHER_PIECES]
            n = os.writev(fd, batch)
            self.written += n
            done = 0
            while done < len(batch) and n >= len(batch[done]):
                n -= len(batch[done])
                done += 1
            del pieces[:done]
            if n:  # a short write ended inside a piece: its rest goes first in the next call
                pieces[0] = memoryview(pieces[0])[n:]
        self.pending_bytes = 0

    def close(self) -> None:
        self.flush()
        self.f.close()


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

    def _write_file(self, final: str, data: bytes) -> None:
        """``data`` into ``<final>.tmp`` (published with the rest)."""
        out = self._open(final)
        out.write(data)
        out.close()

    def write_samples(self, samples: Iterable[Any], on_sample: Callable[[Any], None]) -> None:
        job = self.job
        n = job.first_sample
        it = iter(samples)
        for s_i, count in enumerate(job.shard_counts):
            shard = job.first_shard + s_i
            rel = shard_relpath(shard)
            out = self._open(os.path.join(job.staging, rel), hashed=True)
            starts: list[int] = []
            pos = 0  # shard offset after the last member
            for j in range(count):
                s = next(it)
                on_sample(s)
                key, start = sample_key(n), pos
                starts.append(start)
                parts = [(META_PART, s.meta_json)] + [(image_part(i), b) for i, b in s.images]
                self.sums.append(sample_checksum(parts))
                pieces: list[bytes | memoryview] = []  # the members' headers, bytes and padding
                for name, data in parts:
                    size = len(data)
                    head = tar_header(f"{key}.{name}", size)
                    pad = -size % TAR_BLOCK
                    pieces += (head, data, _ZEROS[:pad]) if pad else (head, data)
                    pos += len(head) + size + pad
                out.gather(pieces)  # hashed now (the bytes are in the cache from the sample checksum)
                self.rows.append((shard, key, j, start, pos - start))
                n += 1
            end = pos
            pos += 2 * TAR_BLOCK  # end-of-archive blocks, then padding to a whole tar record
            out.gather((_ZEROS[:2 * TAR_BLOCK], _ZEROS[:-pos % TAR_RECORD]))
            out.close()
            self.shards.append({"path": rel, "count": count, "bytes": out.written, "sha256": out.sha256.hexdigest()})
            # Energon's itar index: sample starts + end
            self._write_file(os.path.join(job.staging, rel + ".idx"), struct.pack(f"{len(starts) + 1}Q", *starts, end))
        if next(it, None) is not None:
            raise RuntimeError(f"{job.unit.rel}: more rows than its metadata declares ({job.unit.num_samples})")
        self.current = None

    def write_checksums(self) -> None:
        buf = io.BytesIO()
        np.save(buf, np.array(self.sums, dtype="<u8"), allow_pickle=False)
        self._write_file(unit_checksums_path(self.job.staging, self.job.index), buf.getvalue())

    def write_index(self) -> None:
        self.current = None
        path = unit_index_path(self.job.staging, self.job.index)
        self.tmps.append((path + ".tmp", path))
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")
        with contextlib.closing(sqlite3.connect(path + ".tmp")) as db:
            db.execute("PRAGMA synchronous = OFF")  # no fsync: the fragment is published by os.replace like the shards
            db.execute("CREATE TABLE samples (tar_file_id INTEGER, sample_key TEXT, sample_index INTEGER, "
                       "byte_offset INTEGER, byte_size INTEGER)")
            db.executemany("INSERT INTO samples VALUES (?, ?, ?, ?, ?)", self.rows)
            db.commit()

    def publish(self, record: dict[str, Any]) -> None:
        for tmp, final in self.tmps:
            os.replace(tmp, final)
        final = unit_record_path(self.job.staging, self.job.index)
        self._write_file(final, json.dumps(record, sort_keys=True).encode())
        os.replace(final + ".tmp", final)

    def discard(self) -> None:
        if self.current is not None:
            with contextlib.suppress(OSError):  # flushing may fail again (disk still full)
                self.current.f.close()
        for tmp, _ in self.tmps:
            with contextlib.suppress(OSError):
                os.remove(tmp)


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
                src = s.meta["source"]
                at = f"line {src['line'] + 1}" if "line" in src else f"row group {src['row_group']} row {src['row']}"
                examples.setdefault(bad[0], f"{src['file']} {at} image {i}: {bad[1]}")
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
