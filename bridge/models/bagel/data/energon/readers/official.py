"""``data.order: official``: the plan of a group reader in the OFFICIAL BAGEL iteration order (spec
bagel_packer.md §4.1–§4.5), the parity order.

The official source datasets build a list of sharding units (t2i: parquet files; edit: (file, row group) of the
files in parquet_info; vlm: (raw line, image dir)), sort it, shuffle it with ``random.Random(seed)``, keep the rank's
contiguous ``len // world_size`` slice and, inside a DataLoader worker, the worker's ``per_rank // num_workers``
slice *reversed*. Rows are then read unit by unit and cooked with the global ``random`` module, and
``data_indexes`` are positions in that unit list.

:class:`OfficialPlan` does the same from the converter's manifest (file listing order: ``selection``), so the
reader's output can be compared sample by sample with the official classes (the golden tests); it is also each
emulated worker's per-group plan under ``data.order: official`` (``pipeline.official_mode``). Its draws come from the
global ``random`` at the moment the row is read, so it never reads ahead. State: ``cursor`` = [unit position, row
position in the unit] of the next row.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ...state import Savable, StateError
from ..layout import META_PART, T2I, VLM
from .plan import Read, Skip
from .selection import select_files, shuffled_range, vlm_lines

__all__ = ["OfficialPlan", "Rows", "Unit", "official_units", "select_files", "shard_units"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rows(Sequence):
    """The rows of one unit as ``(row id suffix, dataset, key index)``, computed on access (no per-row object).

    ``first`` is the sample index of row 0; rows are ``first .. first + count - 1``. The suffix of row ``r``: ``()``
    for a vlm line, ``(r,)`` in edit row group ``row_group``, ``(g, r in g)`` in a t2i file whose ``row_groups``
    (rows per group) are given.
    """

    ds: int
    first: int
    count: int
    row_group: int | None = None
    row_groups: tuple[int, ...] = ()

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, r: int) -> tuple[tuple, int, int]:  # type: ignore[override]
        if isinstance(r, slice):
            return tuple(self[i] for i in range(*r.indices(self.count)))  # type: ignore[return-value]
        r = range(self.count)[r]  # negative indices count from the end; IndexError outside
        suffix: tuple = () if self.row_group is None else (r,)
        if self.row_groups:  # t2i: (row group, row in it)
            g, k = 0, r
            while k >= self.row_groups[g]:
                k -= self.row_groups[g]
                g += 1
            suffix = (g, k)
        return suffix, self.ds, self.first + r


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
            units.append(Unit(path, Rows(ds, first, sum(rgs), row_groups=tuple(rgs)), path))
            continue
        for g in range(f.get("declared_row_groups") or 0):  # None: not in parquet_info, never opened officially
            rows = None if g >= len(rgs) else Rows(ds, first + sum(rgs[:g]), rgs[g], row_group=g)
            units.append(Unit((path, g), rows, f"{path} row group {g}"))
    return units


def _vlm_lines(manifests: Sequence[Mapping[str, Any]], readers: Sequence[Any], num_used_data: Sequence[int],
               shuffle_lines: bool, shuffle_seed: int) -> tuple[list[tuple[str, str]], np.ndarray, np.ndarray]:
    """The group's selected vlm lines (per dataset, the first ``n`` after the optional shuffle) in selection order:
    their official sort keys ``(raw line, image dir)`` (one indexed read of each line's meta.json ``raw_line``, only
    those lines), their datasets and their sample indices (= line numbers), int64."""
    sels = [vlm_lines(m, n, True, shuffle_seed) if shuffle_lines else
            np.arange(min(max(n, 0), int(m["num_lines"])), dtype=np.int64) for m, n in zip(manifests, num_used_data)]
    keys: list[tuple[str, str]] = []
    for m, r, sel in zip(manifests, readers, sels):
        keys += [(json.loads(r.crude(i)[META_PART])["raw_line"], m.get("image_dir", "")) for i in sel.tolist()]
    ds_of = np.concatenate([np.full(len(s), d, dtype=np.int64) for d, s in enumerate(sels)])
    return keys, ds_of, np.concatenate(sels).astype(np.int64, copy=False)


def _vlm_unit(manifests: Sequence[Mapping[str, Any]], keys: list, ds_of: np.ndarray, idx_of: np.ndarray,
              p: int) -> Unit:
    """The unit of selected line ``p`` (a :func:`_vlm_lines` position)."""
    d, i = int(ds_of[p]), int(idx_of[p])
    return Unit(keys[p], Rows(d, i, 1), f"{manifests[d]['files'][0]['file']} line {i}")


def _mine(keys: Sequence[Any], *, seed: int, rank: int, world_size: int, num_workers: int,
          worker_id: int) -> list[int]:
    """Positions (into ``keys``, the units' sort keys) of this worker's units, in reading order: stable sort,
    ``Random(seed).shuffle``, rank slice, worker slice reversed (exact, see :func:`shuffled_range`)."""
    order = sorted(range(len(keys)), key=keys.__getitem__)  # stable: equal units keep their (equivalent) order
    perm, per_rank = shuffled_range(len(keys), seed), len(keys) // world_size
    mine = perm[rank * per_rank:(rank + 1) * per_rank]
    if num_workers > 0:
        per_worker = per_rank // num_workers
        mine = mine[worker_id * per_worker:(worker_id + 1) * per_worker][::-1]
    return [order[i] for i in mine.tolist()]


def shard_units(units: list[Unit], *, seed: int, rank: int, world_size: int, num_workers: int,
                worker_id: int) -> list[Unit]:
    """``set_epoch`` + the per-worker split: sort, ``Random(seed).shuffle``, rank slice, worker slice reversed."""
    return [units[i] for i in _mine([u.sort_key for u in units], seed=seed, rank=rank, world_size=world_size,
                                    num_workers=num_workers, worker_id=worker_id)]


def official_units(group: str, manifests: Sequence[Mapping[str, Any]], readers: Sequence[Any],
                   num_used_data: Sequence[int], *, shuffle_lines: bool = False, shuffle_seed: int = 0) -> list[Unit]:
    """All units of a group over its converted datasets, before sorting/shuffling."""
    _check_group(group, manifests, num_used_data)
    if group == VLM:
        lines = _vlm_lines(manifests, readers, num_used_data, shuffle_lines, shuffle_seed)
        return [_vlm_unit(manifests, *lines, p) for p in range(len(lines[0]))]
    return [u for ds, (man, n) in enumerate(zip(manifests, num_used_data)) for u in _file_units(ds, man, n, group)]


def _check_group(group: str, manifests: Sequence[Mapping[str, Any]], num_used_data: Sequence[int]) -> None:
    if len(num_used_data) != len(manifests):
        raise ValueError(f"{group}: num_used_data has {len(num_used_data)} entries for {len(manifests)} datasets")
    for man in manifests:
        if man["group"] != group:
            raise ValueError(f"dataset {man.get('dataset_name')!r} is group {man['group']!r}, expected {group!r}")


class OfficialPlan(Savable):
    """The official order of one group for rank ``rank`` of ``world_size``, emulated DataLoader worker ``worker_id`` of
    ``num_workers`` (0: no workers). ``manifests`` and ``accesses`` are the group's converted datasets' (the vlm
    units' sort key is each selected line's raw text, read once here). Iterating gives one pass (``repeat``:
    endless, the same order each pass, as official). Raises ValueError when this worker's unit slice is empty (the
    official reader would hang).

    A read's key is ``(unit position, row in the unit)``; a unit declared in parquet_info but absent from its file is a
    ``Skip`` (the official reader skips it; nothing is read).
    """

    prefetch: ClassVar[bool] = False  # draws from the global RNG at the moment of the read
    _savable_fields = ("cursor",)

    def __init__(self, group: str, manifests: Sequence[Mapping[str, Any]], accesses: Sequence[Any],
                 num_used_data: Sequence[int], *, seed: int = 42, rank: int = 0, world_size: int = 1,
                 num_workers: int = 0, worker_id: int = 0, shuffle_lines: bool = False, shuffle_seed: int = 0,
                 repeat: bool = False) -> None:
        self.group, self.repeat, self.worker_id = group, bool(repeat), worker_id if num_workers > 0 else 0
        split = dict(seed=seed, rank=rank, world_size=world_size, num_workers=num_workers, worker_id=worker_id)
        if group == VLM:  # ``Unit`` objects only for this worker's units (the lines' texts: ranked, then dropped)
            _check_group(group, manifests, num_used_data)
            lines = _vlm_lines(manifests, accesses, num_used_data, shuffle_lines, shuffle_seed)
            keys, unit = lines[0], lambda p: _vlm_unit(manifests, *lines, p)
        else:
            units = official_units(group, manifests, accesses, num_used_data)
            keys, unit = [u.sort_key for u in units], units.__getitem__
        self.units, total = [unit(p) for p in _mine(keys, **split)], len(keys)
        if not self.units:
            raise ValueError(f"{group}: no units for rank {rank}/{world_size} worker {worker_id}/{num_workers} "
                             f"({total} units in {[m.get('dataset_name') for m in manifests]}); the official reader "
                             "would hang here")
        self._rows_per_pass = sum(len(u.rows) for u in self.units if u.rows is not None)
        self._identity = {"seed": seed, "rank": rank, "world_size": world_size, "num_workers": num_workers,
                          "worker_id": self.worker_id, "num_used_data": list(num_used_data),
                          "shuffle_lines": shuffle_lines, "shuffle_seed": shuffle_seed if shuffle_lines else None,
                          "num_units": len(self.units)}
        self.reset_state()

    def reset_state(self) -> None:
        self.cursor = [0, 0]  # [unit position, row position in that unit] of the next row

    def identity(self) -> dict[str, Any]:
        """Unit selection and sharding: what a saved cursor must match."""
        return dict(self._identity)

    def check_compatible(self, state: dict[str, Any]) -> None:
        value = state["cursor"]
        if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value)
                and 0 <= value[0] <= len(self.units) and value[1] >= 0):
            raise StateError(f"OfficialPlan {self.group}: bad cursor {value!r} for {len(self.units)} units")

    def next_read(self) -> Read | Skip:
        """The next row of this worker's units in the official order (wraps when ``repeat``, else StopIteration);
        a unit declared in parquet_info but absent from its file is a ``Skip``."""
        while True:
            pos, row = self.cursor
            if pos >= len(self.units):
                if not self.repeat:
                    raise StopIteration
                logger.info("%s repeat in worker %d", self.group, self.worker_id)
                self.cursor = [0, 0]
                continue
            unit = self.units[pos]
            if unit.rows is None:
                self.cursor = [pos + 1, 0]
                return Skip(self._row_key(pos, ()), "missing_row_group", unit.label)
            if row >= len(unit.rows):
                self.cursor = [pos + 1, 0]
                continue
            self.cursor = [pos, row + 1]
            return self._read(pos, row)

    def _read(self, pos: int, row: int, replay: tuple | None = None) -> Read:
        """Row ``row`` of unit ``pos``: key ``(pos, row)``, the official ``data_indexes`` (the unit position, vlm, or
        ``[position, *row suffix]``)."""
        suffix, ds, idx = self.units[pos].rows[row]  # type: ignore[index]
        row_id = self._row_key(pos, suffix)
        return Read(ds, idx, (pos, row), row_id, {"data_indexes": row_id}, replay)

    def _row_key(self, pos: int, suffix: tuple) -> Any:
        return pos if self.group == VLM else [pos, *suffix]

    def rng(self, read: Read) -> Any:
        """The global ``random`` module itself (as the official classes draw)."""
        return random

    def read_of(self, restore_key: Any) -> Read:
        """The read that rebuilds ``restore_key`` (``((position, row), rng choices)``) with its choices replayed."""
        try:
            (pos, row), choices = restore_key
            return self._read(pos, row, tuple(choices))
        except (TypeError, ValueError, IndexError):
            raise StateError(f"OfficialPlan {self.group}: bad restore key {restore_key!r:.120}") from None

    def stall_limit(self, dataset: int) -> int:
        """A whole pass over this worker's units without a usable row never ends (the official reader would spin):
        drops in a row beyond the rows of one pass."""
        return self._rows_per_pass

    def stall_source(self, dataset: int) -> str:
        """Drops are counted over the whole pass (the official reader's rule), not per dataset."""
        return f"its {len(self.units)} units"

    def stats(self) -> dict[str, Any]:
        return {"cursor": list(self.cursor)}
