"""The on-disk layout contract of converted BAGEL datasets (shared by the converter and the readers/cookers).

One Energon crude WebDataset per group and sub-dataset: ``<out>/<group>/<dataset_name>/`` holding
``shards/shard-000000.tar`` ..., a prepared ``.nv-meta/`` (crude ``dataset.yaml`` with subflavor
``bagel_group: <group>``), ``manifest.json`` and its sidecar ``manifest.columns.npy``. Sample keys are ``%08d``
of the sample index; every sample has a ``meta.json`` part (group, official source coordinate, group fields)
and image parts ``img0``, ``img1``, ... holding the original encoded bytes.

The manifest is O(files + shards + row groups), never O(rows): a sample's official coordinate is arithmetic on
the ``files`` entries (``first_sample`` / ``num_samples`` per file; :func:`sample_of`). vlm_sft: sample index ==
line number. ``skipped`` is aggregated per (file, row group, reason). Its in-memory form is the format-2 dict
(``files`` / ``shards`` lists of dicts), whatever the file format: :func:`load_manifest` returns it,
:func:`write_manifest` takes it.

Format 3 (``MANIFEST_FORMAT``): ``manifest.json`` is a small header (the dict's scalar keys, ``num_files``,
``num_shards``) and the tables are numpy columns in the sidecar (layout: :mod:`.columns`), so a reader needs O(1)
Python objects (:func:`load_manifest_index`). Format 2 (the whole dict as JSON) is still read, at O(files); format 1
(one ``samples`` coordinate per row) is upgraded in memory (:func:`upgrade_manifest_v1`), at O(rows), with a warning.

Checksums (optional in format 3; every dataset the converter writes has them): the ``shards`` table holds each
shard's ``bytes`` and ``sha256`` (of the whole file), and :data:`CHECKSUMS_NAME` one ``<u8`` :func:`sample_checksum`
per sample in sample-index order (:func:`encode_checksums`, :func:`open_checksums`). A dataset without them
(converted before checksums) loads as before, unverified; readers of an older release load a dataset with them
unchanged (one more header key, two more shard columns).
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import logging
import operator
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from .. import remote
from .columns import (COLUMNS_NAME, ColumnsError, dumps_canonical, join_manifest, read_file_ranges, reading,
                      split_manifest)

__all__ = [
    "GROUPS", "T2I", "EDIT", "VLM", "MANIFEST_FORMAT", "MANIFEST_NAME", "SHARDS_DIR", "META_PART",
    "SUBFLAVOR_KEY", "DEFAULT_SAMPLES_PER_SHARD", "SKIP_NOT_IN_PARQUET_INFO", "SKIP_ROW_GROUP_BEYOND_INFO",
    "VIDEO_ERROR_KEY", "NUM_VIDEO_LINES", "NUM_VIDEO_FILES", "TRUNCATED_IMAGE", "image_truncation",
    "sample_key", "image_part", "image_index", "shard_name", "shard_relpath", "dataset_dir", "load_manifest",
    "crude_dataset_yaml", "ManifestError", "upgrade_manifest_v1", "check_manifest", "stored_row_groups",
    "sample_of", "file_ranges", "READ_FORMATS", "COLUMNS_NAME",
    "ManifestIndex", "load_manifest_index", "encode_manifest", "write_manifest",
    "CHECKSUMS_NAME", "CHECKSUMS_KEY", "CHECKSUM_ALGORITHM", "sample_checksum", "encode_checksums",
    "checksums_entry", "open_checksums", "manifest_header", "manifest_error", "write_atomic",
]

logger = logging.getLogger(__name__)

T2I = "t2i_pretrain"
EDIT = "unified_edit"
VLM = "vlm_sft"
#: The three official groups, in the order of the official example.yaml.
GROUPS: tuple[str, ...] = (T2I, EDIT, VLM)

#: Version of manifest.json that :func:`write_manifest` writes (bumped on incompatible layout changes).
MANIFEST_FORMAT = 3
#: Formats :func:`load_manifest` reads (1 is upgraded in memory; 3 is the header + ``COLUMNS_NAME``).
READ_FORMATS = (1, 2, 3)
MANIFEST_NAME = "manifest.json"
SHARDS_DIR = "shards"
#: Tar member suffix of the per-sample metadata (the crude sample dict key).
META_PART = "meta.json"
#: Key of ``__subflavors__`` that names the group (set by ``.nv-meta/dataset.yaml``).
SUBFLAVOR_KEY = "bagel_group"
DEFAULT_SAMPLES_PER_SHARD = 1000

#: Skip reasons recorded in ``manifest["skipped"]`` (unified_edit rows the official reader never reads).
SKIP_NOT_IN_PARQUET_INFO = "file not in parquet_info"
SKIP_ROW_GROUP_BEYOND_INFO = "row group beyond parquet_info"

#: vlm_sft: ``meta["image_errors"]`` key of a ``video`` record's conversion error (missing / empty / not a path).
VIDEO_ERROR_KEY = "video"
#: vlm_sft manifest header keys: how many lines are video records, and how many of them name a video file (decoded
#: with decord; the others are frame folders) (absent in datasets converted before video was stored).
NUM_VIDEO_LINES = "num_video_lines"
NUM_VIDEO_FILES = "num_video_files"

_IMG_PREFIX = "img"

#: File name of the per-sample checksums, next to ``manifest.json`` (one ``<u8`` per sample, one ``np.save`` array).
CHECKSUMS_NAME = "manifest.checksums.npy"
#: Header key describing it: ``{"algorithm", "file", "bytes", "sha256", "samples"}`` (:func:`encode_checksums`).
CHECKSUMS_KEY = "checksums"
#: What :func:`sample_checksum` computes; a reader verifies only an algorithm it knows.
CHECKSUM_ALGORITHM = "xxh3_64-members-v1"
_SUM_DTYPE = np.dtype("<u8")


def write_atomic(path: str, data: bytes, tmp: str = ".tmp") -> None:
    """``data`` into ``path`` through ``path + tmp`` and ``os.replace`` (never half-written). Raises OSError."""
    with open(path + tmp, "wb") as f:
        f.write(data)
    os.replace(path + tmp, path)


def sample_key(index: int) -> str:
    """Tar key of the sample with the given dataset-wide index (ascending in write order)."""
    return f"{index:08d}"


def image_part(i: int) -> str:
    """Part name (tar suffix, crude dict key) of image ``i`` of a sample."""
    return f"{_IMG_PREFIX}{i}"


def image_index(part: str) -> int | None:
    """Inverse of :func:`image_part`; None when ``part`` is not an image part."""
    digits = part[len(_IMG_PREFIX):]
    return int(digits) if part.startswith(_IMG_PREFIX) and digits.isdigit() else None


#: The reason a truncated image is counted under (converter summary and manifest, reader telemetry and stats).
TRUNCATED_IMAGE = "truncated_image"


def image_truncation(data: bytes | memoryview) -> str | None:
    """Why the encoded image ``data`` is cut short, or None: a JPEG without its end-of-image marker ``FF D9``, or a
    PNG without its final ``IEND`` chunk, after any trailing NUL / whitespace padding. Other formats: None.

    Such bytes open and decode under the official ``ImageFile.LOAD_TRUNCATED_IMAGES = True``: PIL fills the missing
    rows (grey), silently. Bytes only (O(1), no pixel decode): the converter checks every stored image with it, the
    readers every image they cook. ``data``: ``bytes`` or a ``memoryview`` of unsigned bytes.
    """
    tail = bytes(data[-4096:]).rstrip(b"\0 \t\r\n")  # the end is all that is read: no copy of the image
    if data[:3] == b"\xff\xd8\xff":
        return None if tail.endswith(b"\xff\xd9") else f"JPEG of {len(data)} bytes without its end marker FF D9"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return None if tail[-8:-4] == b"IEND" else f"PNG of {len(data)} bytes without its IEND chunk"
    return None


def shard_name(i: int) -> str:
    return f"shard-{i:06d}.tar"


def shard_relpath(i: int) -> str:
    """Shard path relative to the dataset root (as given to Energon's prepare and stored in the manifest)."""
    return f"{SHARDS_DIR}/{shard_name(i)}"


def dataset_dir(out_root: str | os.PathLike, group: str, dataset_name: str) -> str:
    """``<out>/<group>/<dataset_name>``: the root of one converted dataset."""
    return os.path.join(os.fspath(out_root), group, dataset_name)


class ManifestError(ValueError):
    """A converted dataset's ``manifest.json`` is missing, damaged or of an unreadable format.

    The message is one line: the manifest path, the dataset, the cause and the remedy (convert again);
    ``cause`` is the cause alone.
    """

    cause: str = ""


_CONVERT_CMD = {T2I: "t2i", EDIT: "edit", VLM: "vlm"}
_REQUIRED = ("format", "group", "dataset_name", "num_samples", "shards", "files")


def manifest_error(path: str, cause: str, group: str | None = None) -> ManifestError:
    """The one-line :class:`ManifestError` of the manifest at ``path``: the file, the dataset, ``cause`` and the
    remedy (convert again, or finish a staged conversion)."""
    root = os.path.dirname(path)
    name, group = os.path.basename(root), group or os.path.basename(os.path.dirname(root))
    cause = " ".join(str(cause).split())
    if len(cause) > 80:
        cause = cause[:77] + "..."
    if os.path.isdir(root.rstrip(os.sep) + ".partial"):  # staged, not published: resume or merge, not redo
        out = os.path.dirname(os.path.dirname(root.rstrip(os.sep)))
        remedy = (f"its conversion is staged in {root.rstrip(os.sep)}.partial, not published yet: rerun the "
                  f"conversion to resume it (a --part conversion: run every part, then `bagel-data convert merge "
                  f"--out {out}`)")
    else:
        remedy = f"convert it again: `bagel-data convert {_CONVERT_CMD.get(group, 'config')} ... --overwrite`"
    err = ManifestError(f"{path}: dataset {group}/{name}: unusable manifest ({cause}); {remedy}")
    err.cause = cause
    return err


def stored_row_groups(group: str, entry: Mapping[str, Any]) -> int:
    """How many leading row groups of a t2i/edit ``files`` entry the converter stores (t2i: all; edit:
    ``min(declared, present)``, none when the file is not in parquet_info)."""
    rgs = entry["row_groups"]
    if group == EDIT:
        declared = entry.get("declared_row_groups")
        return 0 if declared is None else min(int(declared), len(rgs))
    return len(rgs)


def file_ranges(files: Sequence[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """``(first_sample, num_samples)`` of format-2 ``files`` entries as int64 ``[len(files)]`` arrays (C loops,
    ~0.2 µs per file). Raises KeyError / TypeError / ValueError / OverflowError for an entry without int values."""
    return (np.array([f["first_sample"] for f in files], dtype=np.int64),
            np.array([f["num_samples"] for f in files], dtype=np.int64))


def sample_of(entry: Mapping[str, Any], row_group: int, row: int) -> int:
    """Sample index of (row group, row) of a stored t2i/edit file: ``first_sample + sum(row_groups[:g]) + r``."""
    return int(entry["first_sample"]) + sum(entry["row_groups"][:row_group]) + row


def upgrade_manifest_v1(man: Mapping[str, Any], path: str = MANIFEST_NAME) -> dict[str, Any]:
    """A format-1 manifest as format 2: ``samples`` checked against the per-file arithmetic and dropped,
    ``first_sample`` / ``num_samples`` added per file, the per-row ``skipped`` (``{"coordinate": [fi, g, r],
    "reason"}``) aggregated as ``{"file_index", "row_group", "rows", "reason"}``, one per (file, row group, reason),
    in first-seen order (a file-level entry ``[fi, None, None]`` of an unreadable file counts 0 rows). O(rows).

    Raises ManifestError when the samples do not follow the stored-rows order of format 2 (then only
    converting again helps).
    """
    out = {k: v for k, v in man.items() if k != "samples"}
    group, samples = man["group"], man["samples"]
    if group == VLM:
        if any(len(c) != 1 or c[0] != i for i, c in enumerate(samples)):
            raise manifest_error(path, "format 1 samples are not every line once in order", group)
        out["files"] = [dict(f, first_sample=0, num_samples=len(samples)) if i == 0 else dict(f)
                        for i, f in enumerate(man["files"])]
    else:
        files, pos = [], 0
        for f in man["files"]:  # a file's samples: consecutive, its leading (row group, row) pairs in order
            fi, rgs, n = f["file_index"], f["row_groups"], 0
            while pos + n < len(samples) and samples[pos + n][0] == fi:
                n += 1
            want = ([fi, g, r] for g in range(len(rgs)) for r in range(rgs[g]))
            if any(list(c) != w for c, w in zip(samples[pos:pos + n], want)) or n > sum(rgs):
                raise manifest_error(path, f"format 1 samples of file {f['file']!r} are not its rows in order", group)
            files.append(dict(f, first_sample=pos, num_samples=n))
            pos += n
        if pos != len(samples):
            raise manifest_error(path, f"format 1 holds {len(samples)} samples, its files {pos}", group)
        out["files"] = files
    skipped: dict[tuple, dict[str, Any]] = {}
    for x in man.get("skipped", []):
        fi, g, why = x["coordinate"][0], x["coordinate"][1], x["reason"]
        e = skipped.setdefault((fi, g, why), {"file_index": fi, "row_group": g, "rows": 0, "reason": why})
        e["rows"] += 0 if g is None else 1
    out.update(skipped=list(skipped.values()), format=MANIFEST_FORMAT)
    return out


def _files_consistent(group: str, man: Mapping[str, Any]) -> bool:
    """True when a t2i/edit manifest's ``files`` ranges are consecutive from 0, each its stored rows, summing to
    ``num_samples`` (all plain ints). Comprehensions and list compares at C speed; False (also on any malformed
    entry) sends :func:`check_manifest` to its per-file loop, which names what is wrong."""
    try:
        files = man["files"]
        firsts, nums = [f["first_sample"] for f in files], [f["num_samples"] for f in files]
        stored = [sum(f["row_groups"][:stored_row_groups(group, f)]) for f in files]
        total = man["num_samples"]
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
        return False
    if not set(map(type, firsts)) | set(map(type, nums)) | set(map(type, stored)) | {type(total)} <= {int}:
        return False
    ends = list(itertools.accumulate(nums, initial=0))  # file i's range is consecutive when it starts at ends[i]
    return firsts == ends[:-1] and nums == stored and ends[-1] == total and min(nums, default=0) >= 0


def check_manifest(man: Any, path: str = MANIFEST_NAME) -> dict[str, Any]:
    """Validate a format-2 manifest in O(files): required keys, per-file ranges consecutive from 0 and
    summing to ``num_samples`` (vlm: ``num_samples == num_lines``). Raises ManifestError (one line)."""
    if not isinstance(man, dict):
        raise manifest_error(path, f"a JSON {type(man).__name__}, not an object")
    missing = [k for k in _REQUIRED if k not in man]
    if missing:
        raise manifest_error(path, f"missing key{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}",
                             man.get("group"))
    group = man["group"]
    if group not in GROUPS:
        raise manifest_error(path, f"unknown group {group!r}")
    if group != VLM and _files_consistent(group, man):
        return man
    try:  # the slow path names the first inconsistent entry (or finds none: then the manifest is fine)
        files, pos = man["files"] if group != VLM else man["files"][:1], 0
        for f in files:
            if group != VLM and sum(f["row_groups"][:stored_row_groups(group, f)]) != int(f["num_samples"]):
                raise ValueError(f"file {f.get('file')!r}: num_samples {f['num_samples']} is not its stored rows")
            first, end = int(f["first_sample"]), int(f["first_sample"]) + int(f["num_samples"])
            if first != pos or end < first:
                raise ValueError(f"file {f.get('file')!r}: first_sample {first}, expected {pos}")
            pos = end
        if pos != int(man["num_samples"]) or (group == VLM and int(man.get("num_lines", pos)) != pos):
            raise ValueError(f"files hold {pos} samples, num_samples is {man['num_samples']}")
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise manifest_error(path, f"missing key {e}" if isinstance(e, KeyError) else str(e), group) from None
    return man


def _read_header(ds_root: str | os.PathLike) -> tuple[str, Any]:
    """``(path, parsed JSON)`` of ``ds_root``'s ``manifest.json`` (any format), or ManifestError (missing, not JSON,
    other format)."""
    path = remote.join(ds_root, MANIFEST_NAME)
    try:
        man = json.loads(remote.read_bytes(path).decode("utf-8"))
    except FileNotFoundError:
        raise manifest_error(path, "no such file") from None
    except json.JSONDecodeError as e:
        raise manifest_error(path, f"invalid JSON: {e}") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise manifest_error(path, f"{type(e).__name__}: {e}") from None
    if isinstance(man, dict) and "format" in man and man["format"] not in READ_FORMATS:
        raise manifest_error(path, f"unsupported format {man['format']!r}, this version reads {READ_FORMATS}",
                             man.get("group"))
    return path, man


def manifest_header(ds_root: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``manifest.json`` of a converted dataset as it is on disk (format 3: the small header, its
    tables in the sidecar), unchecked beyond being a JSON object of a format this version reads. Raises
    ManifestError (one line)."""
    path, head = _read_header(ds_root)
    if not isinstance(head, dict):
        raise manifest_error(path, f"a JSON {type(head).__name__}, not an object")
    return head


def load_manifest(ds_root: str | os.PathLike) -> dict[str, Any]:
    """Read and check the manifest of a converted dataset; always returns the format-2 dict.

    The dict has ``files`` / ``shards`` lists of dicts (Python ints / strs / None) and the same keys, values and
    key order whichever format is on disk; ``format`` says which it was (1 is upgraded: ``MANIFEST_FORMAT``).
    Cost O(files + shards + row groups) for formats 2 and 3 (3: the sidecar's size and sha256 are checked).
    Format 1 is upgraded in memory (O(rows), logged as a warning). Raises ManifestError (a ValueError; one line
    naming the file, the dataset, the cause and ``bagel-data convert ...`` as remedy) when the file or its
    sidecar is missing or damaged, lacks keys or has another format.
    """
    return _manifest_of(*_read_header(ds_root))


def _manifest_of(path: str, man: Any) -> dict[str, Any]:
    """:func:`load_manifest` of the parsed ``manifest.json`` at ``path`` (its checksums file checked too)."""
    fmt = man.get("format") if isinstance(man, dict) else None
    if fmt == 1:
        if "samples" not in man or "group" not in man or "files" not in man:
            raise manifest_error(path, "format 1 without 'samples'/'group'/'files'", man.get("group"))
        logger.warning("%s: format 1 manifest (one entry per sample) upgraded in memory at O(rows) cost; convert "
                       "the dataset again (bagel-data convert) to get format %d", path, MANIFEST_FORMAT)
        man = upgrade_manifest_v1(man, path)
    elif fmt == 3:
        try:
            man = join_manifest(man, os.path.dirname(path))
        except ColumnsError as e:
            raise manifest_error(path, str(e), man.get("group")) from None
    _check_checksums_file(path, check_manifest(man, path))
    return man


def encode_manifest(man: dict[str, Any], ds_root: str | os.PathLike = "") -> tuple[bytes, bytes]:
    """``(manifest.json bytes, manifest.columns.npy bytes)`` of a format-2-shaped manifest, as format
    ``MANIFEST_FORMAT``: the same dict always gives the same bytes. Raises ManifestError (naming ``ds_root``) when
    ``man`` does not pass :func:`check_manifest`, ValueError when it cannot be stored
    (:func:`.columns.split_manifest`)."""
    check_manifest(man, os.path.join(os.fspath(ds_root), MANIFEST_NAME))
    header, columns = split_manifest(man, MANIFEST_FORMAT)
    return dumps_canonical(header) + b"\n", columns


def write_manifest(ds_root: str | os.PathLike, man: dict[str, Any],
                   encoded: tuple[bytes, bytes] | None = None, checksums: bytes | None = None) -> bytes:
    """Write ``man`` (a format-2-shaped dict) as the format-3 manifest of ``ds_root``: the sidecar first, then
    ``manifest.json``, each to a temporary name and renamed (a reader never sees a header without its sidecar).
    ``encoded``: what :func:`encode_manifest` returned for ``man`` (when the caller needed the bytes first).
    ``checksums``: the :data:`CHECKSUMS_NAME` bytes ``man``'s ``checksums`` entry describes (written first).
    Returns the ``manifest.json`` bytes. Raises OSError (writing), ManifestError / ValueError (see
    :func:`encode_manifest`)."""
    header, columns = encoded if encoded is not None else encode_manifest(man, ds_root)
    root = os.fspath(ds_root)
    files = ((CHECKSUMS_NAME, checksums),) if checksums is not None else ()
    for name, data in (*files, (COLUMNS_NAME, columns), (MANIFEST_NAME, header)):
        write_atomic(os.path.join(root, name), data)
    return header


@dataclass(frozen=True, eq=False)
class ManifestIndex:
    """What a reader needs of a converted dataset's manifest, without its O(files) tables as Python objects.

    ``file_first_sample`` / ``file_num_samples``: int64 ``[num_files]``, read-only; file ``i`` holds samples
    ``first[i] .. first[i] + num[i] - 1``, consecutive from 0, summing to ``num_samples``. ``num_lines`` equals
    ``num_samples`` except for vlm_sft (its line count, equal too for a converted dataset).
    """

    root: str
    group: str
    num_samples: int
    num_lines: int
    file_first_sample: np.ndarray
    file_num_samples: np.ndarray

    @property
    def num_files(self) -> int:
        return len(self.file_first_sample)


def load_manifest_index(ds_root: str | os.PathLike) -> ManifestIndex:
    """The :class:`ManifestIndex` of a converted dataset.

    Format 3: the header and the sidecar's two ``files`` range columns, O(1) Python objects; checked with numpy
    (lengths ``num_files``, ranges consecutive from 0 summing to ``num_samples``, vlm ``num_lines`` equal), not
    the other columns nor the sidecar's hash (:func:`load_manifest` checks everything). Formats 1 / 2 (and a
    format-3 header with inline tables): through :func:`load_manifest`, O(files). Raises ManifestError (one
    line naming the file, the dataset, the cause and the remedy): the manifest or its sidecar missing, cut
    short, of another dtype or inconsistent, or its checksums file (when it records one) missing or of another
    size.
    """
    root = remote.absolute(ds_root) if remote.is_remote(ds_root) else os.fspath(ds_root)
    path, head = _read_header(root)
    if not (isinstance(head, dict) and head.get("format") == 3 and "columns" in head and "files" not in head):
        man = _manifest_of(path, head)
        try:
            first, num = file_ranges(man["files"])
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise manifest_error(path, f"files: {type(e).__name__}: {e}", man["group"]) from None
        first.flags.writeable = num.flags.writeable = False
        total = int(man["num_samples"])  # == num_lines of a vlm manifest (check_manifest)
        return ManifestIndex(root, man["group"], total, total, first, num)
    group, total = head.get("group"), head.get("num_samples")
    if group not in GROUPS:
        raise manifest_error(path, f"unknown group {group!r}" if "group" in head else "missing key 'group'")
    lines = head.get("num_lines", total) if group == VLM else total
    if not all(type(v) is int and v >= 0 for v in (total, lines, head.get("num_files"))):
        raise manifest_error(path, f"num_samples {total!r}, num_lines {lines!r}, num_files {head.get('num_files')!r}"
                             " are not counts", group)
    try:
        first, num = read_file_ranges(head, root)
    except ColumnsError as e:
        raise manifest_error(path, str(e), group) from None
    ends = first + num  # (no other int64 temporary: peak 3 x 8 bytes per file)
    bad = num < 0
    bad[1:] |= first[1:] != ends[:-1]
    bad[:1] |= first[:1] != 0
    if bad.any():
        i = int(np.argmax(bad))
        raise manifest_error(path, f"file #{i}: first_sample {int(first[i])}, num_samples {int(num[i])}, expected "
                             f"first_sample {int(ends[i - 1]) if i else 0}", group)
    held = int(ends[-1]) if len(ends) else 0
    if held != total or lines != total:
        raise manifest_error(path, f"files hold {held} samples, num_samples is {total}, num_lines {lines}", group)
    _check_checksums_file(path, head)
    return ManifestIndex(root, group, total, lines, first, num)


def sample_checksum(parts: Iterable[tuple[str, bytes]]) -> int:
    """The checksum of one sample (:data:`CHECKSUM_ALGORITHM`): the 64-bit XXH3 (``xxhash.xxh3_64``) of its tar
    members in part-name order, each as ``<part name, UTF-8> NUL <size, decimal> NUL <the member's bytes>``.

    ``parts``: ``(part name, bytes)`` pairs, the part name being the member name after the sample key and its
    dot (``meta.json``, ``img0``, ...: the crude sample's keys). Covers exactly the bytes a reader gets (member
    data, names, count), not the rest of the tar headers nor the padding. Returns an int in ``[0, 2**64)``.
    ~20 GB/s on one core (5 µs for a 100 KB sample: ``scripts/bench_convert.py``).
    """
    h = xxhash.xxh3_64()
    for name, data in sorted(parts, key=operator.itemgetter(0)):
        h.update(b"%s\0%d\0" % (name.encode("utf-8"), len(data)))
        h.update(data)
    return h.intdigest()


def encode_checksums(sums: Sequence[int] | np.ndarray) -> tuple[bytes, dict[str, Any]]:
    """``(file bytes, header entry)`` of the per-sample checksums ``sums`` (sample-index order): the bytes of
    :data:`CHECKSUMS_NAME` (``np.save`` of a ``<u8 [n]`` array, deterministic) and the ``checksums`` entry of the
    manifest header that describes them."""
    buf = io.BytesIO()
    np.save(buf, np.asarray(sums, dtype=_SUM_DTYPE), allow_pickle=False)
    data = buf.getvalue()
    return data, {"algorithm": CHECKSUM_ALGORITHM, "file": CHECKSUMS_NAME, "bytes": len(data),
                  "sha256": hashlib.sha256(data).hexdigest(), "samples": len(sums)}


def checksums_entry(man: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``checksums`` entry of a manifest (header or format-2 dict), or None when the dataset has none.

    Raises ColumnsError (a short cause) when the entry is there but malformed."""
    entry = man.get(CHECKSUMS_KEY)
    if entry is not None and not (
            isinstance(entry, dict) and entry.get("file") == CHECKSUMS_NAME and isinstance(entry.get("algorithm"), str)
            and all(type(entry.get(k)) is int and entry[k] >= 0 for k in ("bytes", "samples"))
            and isinstance(entry.get("sha256"), str)):
        raise ColumnsError(f"header {CHECKSUMS_KEY!r} is not a {CHECKSUMS_NAME} description")
    return entry


def _check_checksums_file(path: str, man: Mapping[str, Any]) -> dict[str, Any] | None:
    """The checksums entry of the manifest at ``path`` (None: it has none); ManifestError when its file is missing
    or of another size (one ``stat``; the content is checked by ``bagel-data verify``)."""
    try:
        entry = checksums_entry(man)
        if entry is None:
            return None
        with reading(CHECKSUMS_NAME):
            size = remote.size(remote.join(os.path.dirname(path), CHECKSUMS_NAME))
        if size != entry["bytes"]:
            raise ColumnsError(f"{CHECKSUMS_NAME}: {size} bytes, the header says {entry['bytes']}")
        if entry["samples"] != man.get("num_samples"):
            raise ColumnsError(f"{CHECKSUMS_NAME}: {entry['samples']} samples, the manifest has "
                               f"{man.get('num_samples')}")
    except ColumnsError as e:
        raise manifest_error(path, str(e), man.get("group")) from None
    return entry


def open_checksums(ds_root: str | os.PathLike, man: Mapping[str, Any] | None = None, *, mmap: bool = True
                   ) -> np.ndarray | None:
    """The per-sample checksums of a converted dataset: a read-only ``<u8 [num_samples]`` array (memory-mapped
    unless ``mmap`` is False), or None when its manifest records none. ``man``: its manifest header or dict
    (read from ``ds_root`` when None). Raises ManifestError (file missing, of another size, shape or dtype)."""
    root = os.fspath(ds_root)
    path = remote.join(root, MANIFEST_NAME)
    if man is None:
        man = _read_header(root)[1]
        if not isinstance(man, dict):
            return None
    entry = _check_checksums_file(path, man)
    if entry is None:
        return None
    try:
        a = remote.load_npy(remote.join(root, CHECKSUMS_NAME), mmap=mmap)
    except (ValueError, OSError, EOFError) as e:
        raise manifest_error(path, f"{CHECKSUMS_NAME}: {type(e).__name__}: {e}", man.get("group")) from None
    if a.dtype != _SUM_DTYPE or a.shape != (entry["samples"],):
        raise manifest_error(path, f"{CHECKSUMS_NAME}: {a.dtype.str} {list(a.shape)}, expected {_SUM_DTYPE.str} "
                             f"[{entry['samples']}]", man.get("group"))
    a.flags.writeable = False
    return a


def crude_dataset_yaml(group: str) -> str:
    """Text of ``.nv-meta/dataset.yaml``: a crude dataset whose samples carry the group as subflavor."""
    return f"__module__: megatron.energon\n__class__: CrudeWebdataset\nsubflavors:\n  {SUBFLAVOR_KEY}: {group}\n"
