"""Verification on read: a crude sample whose bytes do not match the converter's checksum is dropped, and a shard
with too many such samples stops the job.

Three small pieces, so that every reader goes through them without knowing how:

- :class:`ChecksumTable`: the expected checksums of one converted dataset (``manifest.checksums.npy``, memory-mapped)
  and its shard layout (the manifest's ``shards.count`` / ``shards.path`` columns): O(1) Python objects per
  dataset, opened lazily by :func:`table_for` on the first sample of that dataset in each process (Energon workers
  included) and cached for the life of the process.
- :func:`mismatch`: called by ``cook_common.cook_with`` on every crude sample before it is cooked; a detail line
  naming dataset, shard file and sample key when the sample's bytes (``layout.sample_checksum`` of its parts, i.e.
  exactly the member bytes Energon read from the tar, ``decoder = None``) differ from the table, else None. The
  cooker turns that into a ``checksum_mismatch`` tombstone, counted by the reader like every drop (and, being a
  drop, in the elastic ledger's drops).
- :class:`ChecksumGuard`: the per-shard threshold the reader calls when it counts a drop; past ``max_fraction``
  (default 1 %) of a shard's samples failing on this rank it raises :class:`CorruptShardError`, one line naming the
  shard and the remedy (the job agrees on it across ranks like any data error).

A dataset without checksums (converted before them, or not by our converter) is read unverified:
:func:`describe_datasets` says so once at build.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .layout import (CHECKSUM_ALGORITHM, MANIFEST_NAME, ManifestError, checksums_entry, load_manifest_index,
                     manifest_error, manifest_header, open_checksums, sample_checksum, sample_key)
from .manifest_columns import ColumnsError, read_columns

__all__ = ["CHECKSUM_MISMATCH", "MAX_BAD_FRACTION", "ChecksumGuard", "ChecksumTable", "CorruptShardError",
           "describe_datasets", "mismatch", "table_for"]

logger = logging.getLogger(__name__)

#: The drop reason of a sample whose bytes do not match its checksum (``cook_common.DROP_REASONS``).
CHECKSUM_MISMATCH = "checksum_mismatch"
#: Default threshold of :class:`ChecksumGuard`: more than this fraction of one shard's samples failing on one rank
#: means the shard itself is damaged (a bad copy), not a flipped bit here and there.
MAX_BAD_FRACTION = 0.01
_REMEDY = ("re-copy the shard from a good copy, or convert the dataset again (`bagel-data convert ... --overwrite`); "
           "`bagel-data verify {root}` lists every damaged shard and sample")


class ChecksumTable:
    """The expected per-sample checksums and the shard layout of one converted dataset (read-only numpy arrays).

    ``sums``: ``<u8 [num_samples]`` (memory-mapped), sample ``i``'s :func:`~.layout.sample_checksum`;
    ``shard_ends``: int64 ``[num_shards]``, shard ``s`` holds samples ``shard_ends[s-1] .. shard_ends[s] - 1``;
    ``shard_paths``: ``<U [num_shards]``, each shard's path relative to ``root``.
    """

    def __init__(self, root: str, name: str, sums: np.ndarray, shard_counts: np.ndarray,
                 shard_paths: np.ndarray) -> None:
        self.root, self.name, self.sums, self.shard_paths = root, name, sums, shard_paths
        self.shard_ends = np.cumsum(shard_counts, dtype=np.int64)
        self.shard_counts = shard_counts
        if int(self.shard_ends[-1] if len(self.shard_ends) else 0) != len(sums):
            raise ManifestError(f"{os.path.join(root, MANIFEST_NAME)}: dataset {name}: its shards hold "
                                f"{int(self.shard_ends[-1]) if len(self.shard_ends) else 0} samples, its checksums "
                                f"{len(sums)}; convert it again: `bagel-data convert ... --overwrite`")

    @classmethod
    def open(cls, root: str) -> ChecksumTable | None:
        """The table of the converted dataset at ``root``, or None when it records no checksums (or ones of an
        algorithm this version does not know: logged). Raises ManifestError (one line: the manifest or a sidecar
        missing or damaged)."""
        path = os.path.join(root, MANIFEST_NAME)
        if not os.path.isfile(path):
            return None  # an Energon dataset not converted by bagel-data (the readers take it by its .nv-meta)
        load_manifest_index(root)  # the manifest's own one-line error first (O(1) for format 3)
        head = manifest_header(root)
        try:
            entry = checksums_entry(head)
            if entry is None:
                return None
            if entry["algorithm"] != CHECKSUM_ALGORITHM:
                logger.warning("%s: checksums of algorithm %r, this version verifies %r: its samples are not "
                               "verified", path, entry["algorithm"], CHECKSUM_ALGORITHM)
                return None
            if isinstance(head.get("shards"), list):  # a table held inline in the header
                counts = np.array([int(sh["count"]) for sh in head["shards"]], dtype=np.int64)
                paths = np.array([str(sh["path"]) for sh in head["shards"]] or [""], dtype=str)[:len(counts)]
            else:
                counts, paths = read_columns(head, root, "shards", [("count", "int"), ("path", "str")])
        except (ColumnsError, KeyError, TypeError, ValueError) as e:
            raise manifest_error(path, str(e), head.get("group")) from None
        sums = open_checksums(root, head)
        assert sums is not None
        return cls(root, str(head.get("dataset_name") or os.path.basename(root)), sums, counts, paths)

    def shard_of(self, index: int) -> int:
        """The shard number holding sample ``index`` (``0 <= index < len(sums)``)."""
        return int(np.searchsorted(self.shard_ends, index, side="right"))

    def check(self, key: Any, parts: Sequence[tuple[str, Any]], shard_name: str | None = None) -> str | None:
        """None when the sample ``key`` with these ``(part name, bytes)`` matches its recorded checksum, else what
        differs: dataset, shard file, the two checksums and the remedy (the caller names the sample key).
        ``shard_name``: the shard's path relative to ``root`` as Energon read it (else from the manifest).
        Raises TypeError when a part is not bytes (decoded before the cooker: nothing to verify against)."""
        index = int(key) if isinstance(key, str) and key.isdigit() else -1
        known = 0 <= index < len(self.sums) and key == sample_key(index)
        shard = shard_name if shard_name is not None or not known else str(self.shard_paths[self.shard_of(index)])
        where = f"dataset {self.name!r}, shard file {os.path.join(self.root, shard or '?')}"
        if not known:
            return f"{where}: key {key!r} is no sample of this dataset (a damaged tar header): " + self.remedy
        for name, data in parts:
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise TypeError(f"{where}, sample {key}: part {name!r} is a {type(data).__name__}, not the bytes read "
                                "from the tar (a decoder ran before the cooker): checksums cover the bytes on disk")
        got, want = sample_checksum(parts), int(self.sums[index])
        if got == want:
            return None
        return (f"{where}: its bytes differ from the checksum recorded at conversion (xxh3 {got:016x}, recorded "
                f"{want:016x}; parts {sorted(name for name, _ in parts)}), damaged after conversion: " + self.remedy)

    @property
    def remedy(self) -> str:
        return _REMEDY.format(root=self.root)


_TABLES: dict[str, ChecksumTable | None] = {}
_LOCK = threading.Lock()


def table_for(root: str) -> ChecksumTable | None:
    """The (cached, per process) :class:`ChecksumTable` of the dataset at ``root``; None without checksums."""
    try:
        return _TABLES[root]
    except KeyError:
        pass
    with _LOCK:
        if root not in _TABLES:
            _TABLES[root] = ChecksumTable.open(root)
        return _TABLES[root]


def _source(sample: Any) -> tuple[str | None, str | None]:
    """``(dataset root, shard name)`` of a crude or cooked sample from its Energon ``__sources__``."""
    sources = (sample.get("__sources__") if isinstance(sample, Mapping) else getattr(sample, "__sources__", None)) or ()
    for info in sources:
        path = getattr(info, "dataset_path", None)
        if path is not None:
            return str(path), getattr(info, "shard_name", None)
    return None, None


def mismatch(crude: Mapping[str, Any]) -> str | None:
    """The detail of a crude sample whose bytes differ from its dataset's recorded checksum, else None (it matches,
    or its dataset records no checksums, or the sample has no Energon source to look it up by)."""
    root, shard = _source(crude)
    if root is None:
        return None
    table = table_for(root)
    if table is None:
        return None
    parts = [(k, v) for k, v in crude.items() if not k.startswith("__")]
    return table.check(crude.get("__key__"), parts, shard)


class CorruptShardError(RuntimeError):
    """Too many samples of one shard failed their checksums on this rank: the shard is damaged. One line naming
    the shard, the dataset and the remedy; ``brief``: the other ranks' short form."""

    def __init__(self, message: str, brief: str = "") -> None:
        super().__init__(message)
        self.brief = brief or message[:160]

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.brief))


class ChecksumGuard:
    """The per-shard threshold of ``checksum_mismatch`` drops on one reader (one DP rank).

    ``drop(sample)`` is called by the reader for every tombstone it counts (any reason; others are ignored). When
    more than ``max_fraction`` of a shard's samples (at least one) have failed on this reader, it raises
    :class:`CorruptShardError`. Distinct samples count (a damaged sample read again in a later epoch counts
    once), so a few flipped bits never stop a long run, and the memory is that of the damaged keys. The counts are
    diagnostics, not stream state: they restart at zero after a restore. ``where``: the reader and rank.
    """

    def __init__(self, where: str, max_fraction: float = MAX_BAD_FRACTION) -> None:
        self.where, self.max_fraction = where, max_fraction
        self._bad: dict[tuple[str, int], set[str]] = {}

    def drop(self, sample: Any) -> None:
        """Count ``sample`` if it is a ``checksum_mismatch`` tombstone; raise CorruptShardError past the limit."""
        if getattr(sample, "drop_reason", None) != CHECKSUM_MISMATCH:
            return
        root, _ = _source(sample)
        table = table_for(root) if root is not None else None
        key = getattr(sample, "__key__", "")
        if table is None or not (isinstance(key, str) and key.isdigit() and int(key) < len(table.sums)):
            return  # a damaged key: counted as a drop, not attributable to a shard
        shard = table.shard_of(int(key))
        bad = self._bad.setdefault((root, shard), set())
        bad.add(key)
        n = len(bad)
        count = int(table.shard_counts[shard])
        limit = max(1, int(self.max_fraction * count))
        if n > limit:
            path = os.path.join(table.root, str(table.shard_paths[shard]))
            raise CorruptShardError(
                f"damaged shard {path} (dataset {table.name!r}): {n} of its {count} samples failed their checksums on "
                f"{self.where} (limit {limit}: {self.max_fraction:.0%} of the shard), the last sample {key}: "
                + table.remedy,
                brief=f"damaged shard {path}: {n} of its {count} samples failed their checksums")


def describe_datasets(paths: Sequence[str], enabled: bool) -> list[str]:
    """Which datasets will be verified, said once at build: returns the datasets without checksums (logged at
    INFO when ``enabled`` is off, else one WARNING naming them). Raises ManifestError when a dataset's checksums
    file is missing or of another size (``load_manifest_index`` checks it)."""
    unverified = []
    for p in paths:
        try:
            table = table_for(os.path.abspath(p))
        except ManifestError:
            raise
        if table is None:
            unverified.append(p)
    if not enabled:
        logger.warning("data.verify_checksums is false: the samples of %d datasets are not verified on read",
                       len(paths))
    elif unverified:
        logger.warning("%d of %d datasets record no checksums (converted before they existed, or not by bagel-data "
                       "convert): their samples are not verified on read; convert them again (--overwrite) to verify "
                       "them: %s", len(unverified), len(paths), ", ".join(unverified[:5])
                       + (f" (+{len(unverified) - 5} more)" if len(unverified) > 5 else ""))
    return unverified
