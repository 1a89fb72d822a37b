"""Reproduce the OFFICIAL BAGEL iteration order over converted datasets (spec bagel_packer.md §4.1–§4.5).

The official source datasets build a list of sharding units (t2i: parquet files; edit: (file, row
group) of the files in parquet_info; vlm: (raw line, image dir)), sort it, shuffle it with
``random.Random(seed)``, keep the rank's contiguous ``len // world_size`` slice and, inside a DataLoader
worker, the worker's ``per_rank // num_workers`` slice *reversed*. Rows are then read unit by unit and
cooked with the global ``random`` module, and ``data_indexes`` are positions in that unit list.

:class:`OfficialOrderReader` does the same from the converter's manifest, fetching crude samples by
key through Energon's sqlite index, so its output can be compared sample by sample with the official
classes (the golden tests), and it is the per-group source of the production ``data.order: official``
mode (``official_mode``). Listing order: the official reader selects ``num_used_data`` files in
``os.listdir`` order (file-system dependent); here the manifest's (sorted) file order is used.

State (``Savable``): ``cursor`` = [unit position, row position in the unit] of the next row, and the
drop counts; a buffered sample is rebuilt by ``restore_sample((position, row), rng choices)`` by
replaying its recorded draws (no RNG is touched).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron.energon.epathlib import EPath
from megatron.energon.flavors.webdataset.itar_reader import SqliteITarEntryReader

from ..state import Savable, StateError
from ..stats import DataStallError, DropCounter
from ..watchdog import DEFAULT_STALL_WARN_S, DEFAULT_TIMEOUT_S, ReadWatch
from .checksums import ChecksumGuard
from .cook_common import CookContext, Draws, cook_with, global_random
from .cookers import CORES
from .layout import META_PART, SUBFLAVOR_KEY, T2I, VLM, load_manifest, sample_key
from .sample import BagelSample
from .selection import select_files, shuffled_range, vlm_lines

__all__ = ["OfficialOrderReader", "Rows", "Unit", "official_units", "select_files", "shard_units"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rows(Sequence):
    """The rows of one unit as ``(row id suffix, dataset, key index)``, computed on access (no per-row object).

    ``first`` is the sample index of row 0; rows are ``first .. first + count - 1``. ``row_group`` None: a vlm
    line (suffix ``()``); else the suffix is ``(row_group, r)`` (t2i, ``with_group``) or ``(r,)`` (edit).
    """

    ds: int
    first: int
    count: int
    row_group: int | None = None
    with_group: bool = False

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, r: int) -> tuple[tuple, int, int]:  # type: ignore[override]
        if isinstance(r, slice):
            return tuple(self[i] for i in range(*r.indices(self.count)))  # type: ignore[return-value]
        if r < 0:
            r += self.count
        if not 0 <= r < self.count:
            raise IndexError(r)
        return self._row(r)

    def _row(self, r: int) -> tuple[tuple, int, int]:
        """Row ``r`` (``0 <= r < count``): ``(coordinate suffix, dataset, sample index)``."""
        suffix = () if self.row_group is None else ((self.row_group, r) if self.with_group else (r,))
        return suffix, self.ds, self.first + r


@dataclass(frozen=True)
class _T2IRows(Rows):
    """A t2i file: rows over several row groups, suffix ``(row_group, row)``; ``row_groups`` = rows per group."""

    row_groups: tuple[int, ...] = ()

    def _row(self, k: int) -> tuple[tuple, int, int]:
        g, r = 0, k
        while r >= self.row_groups[g]:
            r -= self.row_groups[g]
            g += 1
        return (g, r), self.ds, self.first + k


@dataclass(frozen=True)
class Unit:
    """One official sharding unit: its sort key and the rows it holds as ``(row id suffix, dataset, key index)``.

    ``sort_key`` is what the official ``sort`` compares (t2i: the file path; edit: (path, row group);
    vlm: (raw line, image dir)). ``rows`` (a :class:`Rows` sequence) is None for a unit the official reader
    fails to read (a row group declared in parquet_info but absent from the file).
    """

    sort_key: Any
    rows: Rows | None
    label: str


def _file_units(ds: int, manifest: Mapping[str, Any], n: int, group: str) -> list[Unit]:
    """t2i / edit units of one converted dataset (``n`` = the group's ``num_used_data`` entry); O(selected
    files x row groups), sample indices by the format-2 arithmetic (``first_sample + sum(row_groups[:g]) + r``)."""
    units: list[Unit] = []
    for f in select_files(manifest["files"], n):
        path, rgs, first = f["file"], f["row_groups"], int(f["first_sample"])
        if group == T2I:
            units.append(Unit(path, _T2IRows(ds, first, sum(rgs), row_groups=tuple(rgs)), path))
            continue
        declared = f.get("declared_row_groups")
        if declared is None:  # not in parquet_info: the official reader never opens it
            continue
        for g in range(declared):
            rows = None if g >= len(rgs) else Rows(ds, first + sum(rgs[:g]), rgs[g], row_group=g)
            units.append(Unit((path, g), rows, f"{path} row group {g}"))
    return units


def _vlm_selected(manifest: Mapping[str, Any], n: int, shuffle_lines: bool, shuffle_seed: int) -> np.ndarray:
    """Line numbers (= sample indices) of the official ``lines[:n]`` after the optional shuffle, in that order."""
    lines = vlm_lines(manifest, n, shuffle_lines, shuffle_seed)
    if lines is None:
        return np.arange(min(max(n, 0), int(manifest["num_lines"])), dtype=np.int64)
    return lines


def _raw_lines(reader: SqliteITarEntryReader, idx: np.ndarray) -> list[str]:
    """The raw jsonl text of the given samples (their meta.json ``raw_line``): one key lookup each."""
    return [json.loads(reader[sample_key(int(i))][META_PART])["raw_line"] for i in idx.tolist()]


def _vlm_units(ds: int, manifest: Mapping[str, Any], reader: SqliteITarEntryReader, n: int,
               shuffle_lines: bool, shuffle_seed: int) -> list[Unit]:
    """vlm units: the first ``n`` lines after the optional shuffle (only those lines' meta.json are read)."""
    image_dir = manifest.get("image_dir", "")
    sel = _vlm_selected(manifest, n, shuffle_lines, shuffle_seed)
    name = manifest["files"][0]["file"]
    return [Unit((raw, image_dir), Rows(ds, idx, 1), f"{name} line {idx}")
            for raw, idx in zip(_raw_lines(reader, sel), sel.tolist())]


def _slice(n: int, *, seed: int, rank: int, world_size: int, num_workers: int, worker_id: int) -> np.ndarray:
    """Positions (into the sorted unit list of length ``n``) of this worker's units, in reading order:
    ``Random(seed).shuffle``, rank slice, worker slice reversed (exact, see :func:`shuffled_range`)."""
    perm = shuffled_range(n, seed)
    per_rank = n // world_size
    mine = perm[rank * per_rank:(rank + 1) * per_rank]
    if num_workers > 0:
        per_worker = per_rank // num_workers
        mine = mine[worker_id * per_worker:(worker_id + 1) * per_worker][::-1]
    return mine


def shard_units(units: list[Unit], *, seed: int, rank: int, world_size: int, num_workers: int,
                worker_id: int) -> list[Unit]:
    """``set_epoch`` + the per-worker split: sort, ``Random(seed).shuffle``, rank slice, worker slice reversed."""
    units = sorted(units, key=lambda u: u.sort_key)  # stable: equal units keep their (equivalent) order
    return [units[i] for i in _slice(len(units), seed=seed, rank=rank, world_size=world_size,
                                     num_workers=num_workers, worker_id=worker_id).tolist()]


def _vlm_shard(manifests: Sequence[Mapping[str, Any]], readers: Sequence[SqliteITarEntryReader],
               num_used_data: Sequence[int], *, seed: int, rank: int, world_size: int, num_workers: int,
               worker_id: int, shuffle_lines: bool, shuffle_seed: int) -> tuple[list[Unit], int]:
    """``shard_units(official_units(vlm ...))`` with ``Unit`` objects only for this worker's units: the selected
    lines' texts (the official sort key) are read and sorted stably once, kept as a numpy order, and only the
    worker's slice becomes ``Unit``s. Returns ``(units, total units of the group)``."""
    sels = [_vlm_selected(m, n, shuffle_lines, shuffle_seed) for m, n in zip(manifests, num_used_data)]
    keys: list[tuple[str, str]] = []
    for m, r, sel in zip(manifests, readers, sels):  # texts are transient: ranked, then dropped
        image_dir = m.get("image_dir", "")
        keys += [(raw, image_dir) for raw in _raw_lines(r, sel)]
    order = np.asarray(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)  # stable, as official
    ds_of = np.concatenate([np.full(len(s), d, dtype=np.int64) for d, s in enumerate(sels)])
    idx_of = np.concatenate(sels).astype(np.int64, copy=False)
    mine = order[_slice(len(keys), seed=seed, rank=rank, world_size=world_size, num_workers=num_workers,
                        worker_id=worker_id)]
    units = [Unit(keys[p], Rows(int(ds_of[p]), int(idx_of[p]), 1),
                  f"{manifests[int(ds_of[p])]['files'][0]['file']} line {int(idx_of[p])}") for p in mine.tolist()]
    return units, len(keys)


def official_units(group: str, manifests: Sequence[Mapping[str, Any]], readers: Sequence[SqliteITarEntryReader],
                   num_used_data: Sequence[int], *, shuffle_lines: bool = False, shuffle_seed: int = 0) -> list[Unit]:
    """All units of a group over its converted datasets, before sorting/shuffling."""
    _check_group(group, manifests, num_used_data)
    units: list[Unit] = []
    for ds, (man, n) in enumerate(zip(manifests, num_used_data)):
        if group == VLM:
            units += _vlm_units(ds, man, readers[ds], n, shuffle_lines, shuffle_seed)
        else:
            units += _file_units(ds, man, n, group)
    return units


def _check_group(group: str, manifests: Sequence[Mapping[str, Any]], num_used_data: Sequence[int]) -> None:
    if len(num_used_data) != len(manifests):
        raise ValueError(f"{group}: num_used_data has {len(num_used_data)} entries for {len(manifests)} datasets")
    for man in manifests:
        if man["group"] != group:
            raise ValueError(f"dataset {man.get('dataset_name')!r} is group {man['group']!r}, expected {group!r}")


_MAX_SKIPPED = 1000


def _read(reader: SqliteITarEntryReader, key: str) -> dict[str, Any]:
    return dict(reader[key])


class OfficialOrderReader(Savable):
    """Cooked samples of converted datasets in the official order, with the official ``data_indexes``.

    Draws from the global ``random`` module like the official classes (seed it as the official run
    does, or run it under ``BagelRNGIterator``). Iterating gives one pass (``repeat=True``: endless, the
    same order each pass, as official). Dropped rows are counted in ``drops`` and listed in ``skipped``
    as ``{row_id, reason, detail}`` (diagnostics, not state; the first ``_MAX_SKIPPED``). A whole pass without
    a usable row raises ``DataStallError`` (the official reader would spin forever). Raises ValueError when this worker's unit
    slice is empty (the official reader would hang).
    """

    _savable_fields = ("cursor", "drops", "unused")

    def __init__(self, paths: Sequence[str], ctx: CookContext, num_used_data: Sequence[int], *, seed: int = 42,
                 rank: int = 0, world_size: int = 1, num_workers: int = 0, worker_id: int = 0,
                 shuffle_lines: bool = False, shuffle_seed: int = 0, repeat: bool = False,
                 stall_warn_s: float = DEFAULT_STALL_WARN_S, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if isinstance(paths, str):
            paths = [paths]
        self.ctx = ctx
        self.group = ctx.group
        self.core = CORES[ctx.group]
        self.repeat = repeat
        self.worker_id = worker_id if num_workers > 0 else 0
        self.paths = [str(p) for p in paths]
        self.readers = [SqliteITarEntryReader(EPath(p)) for p in self.paths]
        manifests = [load_manifest(p) for p in self.paths]
        split = dict(seed=seed, rank=rank, world_size=world_size, num_workers=num_workers, worker_id=worker_id)
        if self.group == VLM:
            _check_group(self.group, manifests, num_used_data)
            self.units, total = _vlm_shard(manifests, self.readers, num_used_data, shuffle_lines=shuffle_lines,
                                           shuffle_seed=shuffle_seed, **split)
        else:
            units = official_units(self.group, manifests, self.readers, num_used_data)
            self.units, total = shard_units(units, **split), len(units)
        if not self.units:
            raise ValueError(f"{self.group}: no units for rank {rank}/{world_size} worker {worker_id}/{num_workers} "
                             f"({total} units in {self.paths}); the official reader would hang here")
        self._identity = {"group": self.group, "seed": seed, "rank": rank, "world_size": world_size,
                          "num_workers": num_workers, "worker_id": self.worker_id, "num_used_data": list(num_used_data),
                          "shuffle_lines": shuffle_lines, "shuffle_seed": shuffle_seed if shuffle_lines else None,
                          "num_units": len(self.units), "datasets": [m.get("dataset_name") for m in manifests],
                          "num_samples": [m.get("num_samples") for m in manifests]}
        self.drops = DropCounter(f"official-order reader {self.group} worker {self.worker_id}", logger)
        self.unused = DropCounter(f"official-order reader {self.group} worker {self.worker_id}", logger,
                                  what="ignored part of a record (the sample is kept, as officially)")
        self.skipped: list[dict[str, Any]] = []
        self._checksums = ChecksumGuard(f"rank {rank}/{world_size}, official-order reader {self.group!r} worker "
                                        f"{self.worker_id}")
        self._watch = ReadWatch(f"official-order reader {self.group!r} (rank {rank}/{world_size}, worker "
                                f"{self.worker_id})", self.group, self.paths, stall_warn_s=stall_warn_s,
                                timeout_s=timeout_s)
        self.reset_state()

    # -- state -------------------------------------------------------------------------------
    def reset_state(self) -> None:
        self._pos, self._row = 0, 0
        self._yielded_in_pass = False
        self.drops.reset_state()
        self.unused.reset_state()

    def identity(self) -> dict[str, Any]:
        """Group, unit selection and sharding: what a saved cursor must match (no paths)."""
        return self._identity

    @property
    def cursor(self) -> list[int]:
        """``[unit position, row position in that unit]`` of the next row to read."""
        return [self._pos, self._row]

    @cursor.setter
    def cursor(self, value: Any) -> None:
        if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value)
                and 0 <= value[0] <= len(self.units) and value[1] >= 0):
            raise StateError(f"OfficialOrderReader {self.group}: bad cursor {value!r} for {len(self.units)} units")
        self._pos, self._row = int(value[0]), int(value[1])

    def stats(self) -> dict[str, Any]:
        """``{"drops": {reason: count}, "unused": {reason: count}}`` of this reader's rows so far."""
        return {"drops": dict(self.drops.counts), "unused": dict(self.unused.counts)}

    def close(self) -> None:
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.stop(wait_s=1.0)
        if watch is None or not watch.busy:  # a reader stuck in a read keeps its files
            for r in self.readers:
                r.close()

    # -- reading -----------------------------------------------------------------------------
    def _row_id(self, pos: int, suffix: tuple) -> Any:
        return pos if self.group == VLM else [pos, *suffix]

    def _cook(self, ds: int, idx: int, draws: Draws) -> BagelSample:
        crude = self._watch.call(_read, self.readers[ds], sample_key(idx))  # reader thread, under the watchdog
        crude["__subflavors__"] = {SUBFLAVOR_KEY: self.group}
        return cook_with(self.core, crude, self.ctx, draws, self.worker_id)

    def _finish(self, sample: BagelSample, pos: int, row: int, suffix: tuple) -> BagelSample:
        sample.data_indexes = {"data_indexes": self._row_id(pos, suffix), "worker_id": self.worker_id,
                               "dataset_name": self.group}
        sample.__restore_key__ = (pos, row)
        return sample

    def restore_sample(self, restore_key: Any) -> BagelSample:
        """Rebuild a sample from its ``restore_key`` (``((position, row), rng choices)``), drawing no RNG."""
        try:
            (pos, row), choices = restore_key
            suffix, ds, idx = self.units[pos].rows[row]
        except (TypeError, ValueError, IndexError):
            raise StateError(f"OfficialOrderReader {self.group}: bad restore key {restore_key!r}") from None
        sample = self._cook(ds, idx, Draws(replay=choices))
        if sample.drop_reason is not None:
            raise StateError(f"OfficialOrderReader {self.group}: restore key {restore_key!r} names a dropped row")
        return self._finish(sample, pos, row, suffix)

    def __iter__(self) -> OfficialOrderReader:
        return self

    def __next__(self) -> BagelSample:
        """The next non-dropped row of this worker's units (official order; wraps when ``repeat``)."""
        while True:
            if self._pos >= len(self.units):
                if not self.repeat:
                    raise StopIteration
                if not self._yielded_in_pass:  # liveness: a whole pass without one usable row never ends
                    raise DataStallError(
                        f"official-order reader {self.group!r} ({self._identity['datasets']}, rank "
                        f"{self._identity['rank']}/{self._identity['world_size']}, worker {self.worker_id}): a whole "
                        f"pass over its {len(self.units)} units yielded no usable sample; drops so far "
                        f"{dict(self.drops.counts)}, e.g. {self.skipped[0]['detail'] if self.skipped else 'none'}. "
                        "Fix the rows, or use fewer ranks / workers so this worker's slice holds usable data.")
                logger.info("%s repeat in worker %d", self.group, self.worker_id)
                self._pos, self._row, self._yielded_in_pass = 0, 0, False
            pos, unit = self._pos, self.units[self._pos]
            if unit.rows is None or self._row >= len(unit.rows):
                if unit.rows is None:
                    logger.warning("%s: %s is declared in parquet_info but absent; unit skipped like official",
                                   self.group, unit.label)
                    if len(self.skipped) < _MAX_SKIPPED:
                        self.skipped.append({"row_id": self._row_id(pos, ()), "reason": "missing_row_group",
                                             "detail": unit.label})
                self._pos, self._row = pos + 1, 0
                continue
            row = self._row
            suffix, ds, idx = unit.rows[row]
            self._row += 1
            sample = self._cook(ds, idx, Draws(rng=global_random()))
            if sample.drop_reason is not None:
                self.drops.drop(sample.drop_reason, sample.drop_detail)
                self._checksums.drop(sample)  # a damaged shard stops the reader (CorruptShardError)
                if len(self.skipped) < _MAX_SKIPPED:  # diagnostics only: bounded however long the run
                    self.skipped.append({"row_id": self._row_id(pos, suffix), "reason": sample.drop_reason,
                                         "detail": sample.drop_detail})
                continue
            self._yielded_in_pass = True
            for reason, n in (sample.unused or {}).items():
                self.unused.drop(reason, f"{self.group} row {self._row_id(pos, suffix)}", n)
            return self._finish(sample, pos, row, suffix)
