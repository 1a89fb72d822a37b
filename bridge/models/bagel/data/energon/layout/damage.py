"""Name the damaged file behind a read error: ``.nv-meta``, a shard's ``.tar.idx``, a shard cut short.

Energon's own errors name the wrong thing or nothing (``Invalid dataset at <dir>`` for a missing ``.nv-meta``,
``Inconsistent sample base name`` for a stale index, tarfile's ``ReadError: unexpected end of data`` for a cut
shard; through worker processes a flattened worker traceback). Here :func:`check_prepared` (at reader build) and
:func:`diagnose` (only after a read failed: the tar headers against each ``.tar.idx``, no member data read; for an
``msc://`` dataset only whether each shard and index object exists) say it in one line: what, which file, what to do.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import tarfile
import time
from collections.abc import Sequence

from .. import remote

__all__ = ["check_prepared", "check_shard", "diagnose", "shard_files"]

logger = logging.getLogger(__name__)

_NV_META = ".nv-meta"
_NEEDED = ("dataset.yaml", ".info.json")
_SPLIT_NAME = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # Energon's base-name / extension split
_DIAGNOSE_BUDGET_S = 60.0
_CONVERT = "convert it again with --overwrite or restore the file"


def check_prepared(path: str) -> None:
    """Raise ValueError (one line) if ``path`` has no usable ``.nv-meta`` (Energon: ``Invalid dataset at``); for an
    ``msc://`` dataset, reads its ``.nv-meta`` files (a store that refuses: ``remote.RemoteStorageError``)."""
    if remote.is_remote(path):
        return _check_prepared_remote(path)
    meta = os.path.join(path, _NV_META)
    if not os.path.isdir(path):
        raise ValueError(f"dataset directory {path} does not exist: fix energon_path in the dataset_info registry")
    missing = [n for n in _NEEDED if not os.path.isfile(os.path.join(meta, n))]
    if missing:
        what = f"no {_NV_META}/" if not os.path.isdir(meta) else f"{_NV_META}/ lacks {', '.join(missing)}"
        raise ValueError(f"damaged dataset {path}: {what} (its index): convert it again with --overwrite "
                         "or `energon prepare` it")
    try:
        counts = json.loads(remote.read_bytes(os.path.join(meta, ".info.json")).decode("utf-8"))["shard_counts"]
        assert isinstance(counts, dict)
    except (OSError, ValueError, KeyError, AssertionError) as exc:
        raise ValueError(f"damaged dataset {path}: its {_NV_META}/.info.json is unreadable ({type(exc).__name__}): "
                         "re-index it (`energon prepare <that dir>`) or convert it again") from None


def _check_prepared_remote(path: str) -> None:
    """:func:`check_prepared` of an ``msc://`` dataset: its ``.nv-meta`` files read (two requests, no listing)."""
    for name in _NEEDED:
        url = remote.join(path, _NV_META, name)
        try:
            data = remote.read_bytes(url)
        except FileNotFoundError:
            raise ValueError(f"dataset {path}: {url} does not exist: fix energon_path in the dataset_info registry, "
                             "or upload the whole converted dataset directory there") from None
        if name == ".info.json":
            try:
                counts = json.loads(data.decode("utf-8"))["shard_counts"]
                assert isinstance(counts, dict)
            except (ValueError, KeyError, AssertionError) as exc:
                raise ValueError(f"damaged dataset {path}: {url} is unreadable ({type(exc).__name__}): upload it "
                                 "again from a good copy, or convert the dataset again") from None


def shard_files(path: str) -> list[str]:
    """The shard paths a prepared dataset lists in ``.nv-meta/.info.json``."""
    info = json.loads(remote.read_bytes(remote.join(path, _NV_META, ".info.json")).decode("utf-8"))
    return [remote.join(path, name) for name in info["shard_counts"]]


def _scan(tar: str, size: int) -> tuple[list[int], int, str | None]:
    """Sample start offsets and the end of the last sample from the tar headers; a cut/corruption found, or None."""
    starts: list[int] = []
    pos = end = 0
    last_base, last_name = None, "(none: the first header)"
    pending = None  # offset of a pax / long-name header that belongs to the next member
    with open(tar, "rb") as fh:
        while pos < size:  # the end without end-of-archive blocks: Energon reads such a shard fine
            fh.seek(pos)
            buf = fh.read(512)
            if len(buf) < 512:
                return starts, end, f"cut at byte {size} in the tar header after {last_name}"
            if buf == b"\0" * 512:
                break
            try:
                info = tarfile.TarInfo.frombuf(buf, "utf-8", "surrogateescape")
            except tarfile.HeaderError as exc:
                return starts, end, f"corrupt tar header at byte {pos} after member {last_name} ({exc})"
            padded = pos + 512 + -(-info.size // 512) * 512
            if pos + 512 + info.size > size:
                return starts, end, f"cut at byte {size} inside member {info.name} (sample {_base(info.name)})"
            if padded > size:
                return starts, end, f"cut at byte {size} in the padding after member {info.name}"
            if info.type in (tarfile.XHDTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.XGLTYPE):
                pending = pos if pending is None else pending
            elif info.isfile():
                base = _base(info.name)
                if base != last_base:
                    starts.append(pos if pending is None else pending)
                    last_base = base
                last_name, pending, end = info.name, None, padded
            pos = padded
    return starts, end, None


def _base(name: str) -> str:
    m = _SPLIT_NAME.match(name)
    return m.group(1) if m else name


def _check_shard(dataset: str, tar: str) -> str | None:
    if remote.is_remote(tar):  # its object and .tar.idx exist (no header scan over the network: `bagel-data verify`)
        for url, what in ((tar, "shard"), (tar + ".idx", "shard index")):
            if not remote.isfile(url):
                return (f"{what} {url} of dataset {dataset} is missing: upload it again from the converted copy "
                        "(every file of the dataset directory), or convert the dataset again")
        return None
    if not os.path.isfile(tar):
        return f"shard {tar} of dataset {dataset} is missing: {_CONVERT}"
    size, idx_path = os.path.getsize(tar), tar + ".idx"
    starts, end, problem = _scan(tar, size)
    if problem is not None:
        return f"damaged shard {tar}: {problem}: {_CONVERT}"
    remedy = "re-index (`energon prepare` the dataset) or convert again"
    if not os.path.isfile(idx_path):
        return f"shard index {idx_path} is missing: {remedy}"
    raw = open(idx_path, "rb").read()
    if len(raw) % 8:
        return f"damaged shard index {idx_path}: {len(raw)} bytes, not a list of 8-byte offsets: {remedy}"
    if not raw:
        return f"damaged shard index {idx_path}: empty: {remedy}"
    idx = list(struct.unpack(f"<{len(raw) // 8}Q", raw))
    inside = [x for x in idx if x <= size]
    if idx[-1] > size and inside and inside == starts[: len(inside)] and idx == sorted(idx):
        # cut at a tar block boundary: the headers read fine up to there, and the (sound) index goes on past it
        return (f"damaged shard {tar}: cut short at byte {size}, its index {os.path.basename(idx_path)} has samples "
                f"up to byte {idx[-1]}: {_CONVERT}")
    expected = starts + [end]
    if idx != expected:
        k = next((i for i, (a, b) in enumerate(zip(idx, expected)) if a != b), min(len(idx), len(expected)))
        got, want = (x[k] if k < len(x) else "nothing" for x in (idx, expected))
        return f"damaged shard index {idx_path}: entry {k} is {got}, the shard has {want}: {remedy}"
    return None


def check_shard(dataset: str, tar: str) -> str | None:
    """One line naming what is wrong with shard ``tar`` of ``dataset`` (missing, cut short, a corrupt header, its
    ``.tar.idx`` missing or stale, unreadable), or None. Reads the tar headers and the index, no member data."""
    try:
        return _check_shard(dataset, tar)
    except OSError as exc:
        return f"shard {tar} cannot be read ({type(exc).__name__}: {exc}): check its storage"


def diagnose(paths: Sequence[str], hint: str = "") -> str | None:
    """The first damaged file among the datasets ``paths`` (one line with the remedy), or None.

    ``hint`` (the error text) puts a shard it names first. Stops after ~60 s of scanning (huge datasets).
    """
    t0 = time.monotonic()
    for dataset in paths:
        try:
            check_prepared(dataset)
            shards = shard_files(dataset)
        except ValueError as exc:
            return str(exc)
        shards.sort(key=lambda s: s[len(dataset):].lstrip("/") not in hint)
        for tar in shards:
            if time.monotonic() - t0 > _DIAGNOSE_BUDGET_S:
                logger.warning("diagnosis of the read error stopped after %.0fs of scanning shards", _DIAGNOSE_BUDGET_S)
                return None
            if (problem := check_shard(dataset, tar)) is not None:
                return problem
    return None
