"""The recorded checksums of one converted dataset, as a reader checks a sample against them.

The converter records one :func:`~.contract.sample_checksum` per sample (``manifest.checksums.npy``:
``contract.encode_checksums``) and each shard's size and sha256 (the manifest's ``shards`` table).
:class:`ChecksumTable` is a reader's view of them (O(1) Python objects per dataset, shared by forked read workers);
``check(index, crude)`` is what ``cooking.cook_with`` calls on every crude sample before decoding anything.

A dataset without checksums (converted before them, or an Energon dataset not converted by ``bagel-data``) has no
table (``ChecksumTable.open`` returns None): it is read unverified, and the builder says so once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import remote
from .columns import ColumnsError, read_columns
from .contract import (CHECKSUM_ALGORITHM, MANIFEST_NAME, ManifestError, checksums_entry, manifest_error,
                       manifest_header, open_checksums, sample_checksum, sample_key)

__all__ = ["CHECKSUM_MISMATCH", "REMEDY", "ChecksumTable"]

logger = logging.getLogger(__name__)

#: The drop reason of a sample whose bytes do not match its recorded checksum (``cooking.DROP_REASONS``).
CHECKSUM_MISMATCH = "checksum_mismatch"
#: What to do about a damaged shard (``{root}``: the dataset directory).
REMEDY = ("re-copy the shard from a good copy, or convert the dataset again (`bagel-data convert ... --overwrite`); "
          "`bagel-data verify {root}` lists every damaged shard and sample")


class ChecksumTable:
    """The recorded checksums of the converted dataset at ``root`` (``name``: its dataset name in messages); build it
    with :meth:`open`. ``sums``: read-only ``<u8 [num_samples]`` (memory-mapped; in memory for a remote dataset),
    sample ``i``'s ``sample_checksum``. The shard layout (``shard_of``, ``shard_count``, ``shard_path``) comes from the
    manifest's ``shards`` table on first use.
    """

    def __init__(self, root: str, name: str, sums: np.ndarray, head: Mapping[str, Any]) -> None:
        self.root, self.name, self.sums, self._head = root, name, sums, head
        #: int64 ``ends`` (shard s holds samples ends[s-1] .. ends[s] - 1), ``counts`` ``[num_shards]`` and paths
        self._layout: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    @classmethod
    def open(cls, root: str) -> ChecksumTable | None:
        """The table of the converted dataset at ``root``, or None when it records no checksums (or ones of an
        algorithm this version does not know: one warning). Raises ManifestError (one line: the manifest or its
        checksums file missing, of another size, dtype or shape)."""
        if not remote.isfile(remote.join(root, MANIFEST_NAME)):
            return None  # an Energon dataset not converted by bagel-data (the readers take it by its .nv-meta)
        head = manifest_header(root)
        try:
            entry = checksums_entry(head)
        except ColumnsError as e:
            raise manifest_error(remote.join(root, MANIFEST_NAME), str(e), head.get("group")) from None
        if entry is None:
            return None
        if entry["algorithm"] != CHECKSUM_ALGORITHM:
            logger.warning("%s: checksums of algorithm %r, this version verifies %r: its samples are not verified",
                           remote.join(root, MANIFEST_NAME), entry["algorithm"], CHECKSUM_ALGORITHM)
            return None
        sums = open_checksums(root, head)
        assert sums is not None
        return cls(root, str(head.get("dataset_name") or os.path.basename(root)), sums, head)

    # -- the shard layout (read on first use: only a failing sample needs it) --------------------------------------
    def _shards(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._layout is None:
            head, path = self._head, remote.join(self.root, MANIFEST_NAME)
            try:
                if isinstance(head.get("shards"), list):  # a table held inline in the header (format 2)
                    counts = np.array([int(sh["count"]) for sh in head["shards"]], dtype=np.int64)
                    paths = np.array([str(sh["path"]) for sh in head["shards"]] or [""], dtype=str)[:len(counts)]
                else:
                    counts, paths = read_columns(head, self.root, "shards", [("count", "int"), ("path", "str")])
            except (ColumnsError, KeyError, TypeError, ValueError) as e:
                raise manifest_error(path, str(e), head.get("group")) from None
            ends = np.cumsum(counts, dtype=np.int64)
            if int(ends[-1] if len(ends) else 0) != len(self.sums):
                raise ManifestError(f"{path}: dataset {self.name}: its shards hold {int(ends[-1]) if len(ends) else 0}"
                                    f" samples, its checksums {len(self.sums)}; convert it again: "
                                    "`bagel-data convert ... --overwrite`")
            self._layout = (ends, counts, paths)
        return self._layout

    def shard_of(self, index: int) -> int:
        """The shard number holding sample ``index`` (``0 <= index < len(sums)``)."""
        return int(np.searchsorted(self._shards()[0], index, side="right"))

    def shard_count(self, shard: int) -> int:
        """How many samples shard ``shard`` holds."""
        return int(self._shards()[1][shard])

    def shard_path(self, shard: int) -> str:
        """Shard ``shard``'s file (absolute)."""
        return remote.join(self.root, str(self._shards()[2][shard]))

    @property
    def remedy(self) -> str:
        return REMEDY.format(root=self.root)

    def _where(self, index: int) -> str:
        shard = self.shard_path(self.shard_of(index)) if index >= 0 else "?"
        return f"dataset {self.name!r}, shard file {shard}"

    # -- the check ----------------------------------------------------------------------------------------------
    def check(self, index: int, crude: Mapping[str, Any]) -> str | None:
        """None when the crude sample read at sample ``index`` has the recorded key and checksum, else one line:
        dataset, shard file, the two checksums and the remedy (``cook_with`` prefixes the group and sample key).

        The parts must be the bytes read from the tar (Energon's ``decoder = None``): the checksum covers the
        member bytes on disk, not the tar headers or padding. Raises TypeError when a part is not bytes (a decoder
        ran before the cooker: there is nothing to verify against)."""
        key = crude.get("__key__")
        known = 0 <= index < len(self.sums)
        if not known or key != sample_key(index):
            return (f"{self._where(index if known else -1)}: sample {key!r} read as sample {index} "
                    f"({sample_key(index)!r}; a damaged tar header or index), damaged after conversion: {self.remedy}")
        parts = [(k, v) for k, v in crude.items() if not k.startswith("__")]  # not __key__, __sources__, ...
        for name, data in parts:
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise TypeError(f"{self._where(index)}, sample {key}: part {name!r} is a {type(data).__name__}, "
                                "not the bytes read from the tar (a decoder ran before the cooker): checksums cover "
                                "the bytes on disk")
        got, want = sample_checksum(parts), int(self.sums[index])
        return None if got == want else (
            f"{self._where(index)}: its bytes differ from the checksum recorded at conversion (xxh3 {got:016x}, "
            f"recorded {want:016x}; parts {sorted(name for name, _ in parts)}), damaged after conversion: "
            f"{self.remedy}")
