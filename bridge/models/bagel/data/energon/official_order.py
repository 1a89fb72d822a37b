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

import logging
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megatron.energon.epathlib import EPath
from megatron.energon.flavors.webdataset.itar_reader import SqliteITarEntryReader

from ..state import Savable, StateError
from ..stats import DataStallError, DropCounter
from ..watchdog import DEFAULT_STALL_WARN_S, DEFAULT_TIMEOUT_S, ReadWatch
from .cook_common import CookContext, Draws, cook_with, global_random
from .cookers import CORES
from .layout import SUBFLAVOR_KEY, T2I, VLM, load_manifest, sample_key
from .sample import BagelSample
from .selection import select_files

__all__ = ["OfficialOrderReader", "Unit", "official_units", "select_files", "shard_units"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Unit:
    """One official sharding unit: its sort key and the rows it holds as ``(row id suffix, dataset, key index)``.

    ``sort_key`` is what the official ``sort`` compares (t2i: the file path; edit: (path, row group);
    vlm: (raw line, image dir)). ``rows`` is None for a unit the official reader fails to read (a
    row group declared in parquet_info but absent from the file).
    """

    sort_key: Any
    rows: tuple[tuple[tuple, int, int], ...] | None
    label: str


def _coord_index(manifest: Mapping[str, Any]) -> dict[tuple, int]:
    return {tuple(c): i for i, c in enumerate(manifest["samples"])}


def _file_units(ds: int, manifest: Mapping[str, Any], n: int, group: str) -> list[Unit]:
    """t2i / edit units of one converted dataset (``n`` = the group's ``num_used_data`` entry)."""
    where = _coord_index(manifest)
    units: list[Unit] = []
    for f in select_files(manifest["files"], n):
        fi, path, rgs = f["file_index"], f["file"], f["row_groups"]
        if group == T2I:
            rows = tuple(((g, r), ds, where[(fi, g, r)]) for g in range(len(rgs)) for r in range(rgs[g]))
            units.append(Unit(path, rows, path))
            continue
        declared = f.get("declared_row_groups")
        if declared is None:  # not in parquet_info: the official reader never opens it
            continue
        for g in range(declared):
            rows = None if g >= len(rgs) else tuple(((r,), ds, where[(fi, g, r)]) for r in range(rgs[g]))
            units.append(Unit((path, g), rows, f"{path} row group {g}"))
    return units


def _vlm_units(ds: int, manifest: Mapping[str, Any], reader: SqliteITarEntryReader, n: int,
               shuffle_lines: bool, shuffle_seed: int) -> list[Unit]:
    """vlm units: every line (raw text from meta.json), optionally shuffled, first ``n`` kept."""
    import json

    image_dir = manifest.get("image_dir", "")
    lines = []
    for idx, (line_no,) in enumerate(manifest["samples"]):
        meta = json.loads(reader[sample_key(idx)]["meta.json"])
        lines.append((meta["raw_line"], line_no, idx))
    lines.sort(key=lambda x: x[1])
    if shuffle_lines:
        random.Random(shuffle_seed).shuffle(lines)
    return [Unit((raw, image_dir), (((), ds, idx),), f"{manifest['files'][0]['file']} line {no}")
            for raw, no, idx in lines[:n]]


def shard_units(units: list[Unit], *, seed: int, rank: int, world_size: int, num_workers: int,
                worker_id: int) -> list[Unit]:
    """``set_epoch`` + the per-worker split: sort, ``Random(seed).shuffle``, rank slice, worker slice reversed."""
    units = sorted(units, key=lambda u: u.sort_key)  # stable: equal units keep their (equivalent) order
    random.Random(seed).shuffle(units)
    per_rank = len(units) // world_size
    mine = units[rank * per_rank:(rank + 1) * per_rank]
    if num_workers > 0:
        per_worker = per_rank // num_workers
        mine = mine[worker_id * per_worker:(worker_id + 1) * per_worker][::-1]
    return mine


def official_units(group: str, manifests: Sequence[Mapping[str, Any]], readers: Sequence[SqliteITarEntryReader],
                   num_used_data: Sequence[int], *, shuffle_lines: bool = False, shuffle_seed: int = 0) -> list[Unit]:
    """All units of a group over its converted datasets, before sorting/shuffling."""
    if len(num_used_data) != len(manifests):
        raise ValueError(f"{group}: num_used_data has {len(num_used_data)} entries for {len(manifests)} datasets")
    units: list[Unit] = []
    for ds, (man, n) in enumerate(zip(manifests, num_used_data)):
        if man["group"] != group:
            raise ValueError(f"dataset {man.get('dataset_name')!r} is group {man['group']!r}, expected {group!r}")
        if group == VLM:
            units += _vlm_units(ds, man, readers[ds], n, shuffle_lines, shuffle_seed)
        else:
            units += _file_units(ds, man, n, group)
    return units


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
        units = official_units(self.group, manifests, self.readers, num_used_data,
                               shuffle_lines=shuffle_lines, shuffle_seed=shuffle_seed)
        self.units = shard_units(units, seed=seed, rank=rank, world_size=world_size, num_workers=num_workers,
                                 worker_id=worker_id)
        if not self.units:
            raise ValueError(f"{self.group}: no units for rank {rank}/{world_size} worker {worker_id}/{num_workers} "
                             f"({len(units)} units in {self.paths}); the official reader would hang here")
        self._identity = {"group": self.group, "seed": seed, "rank": rank, "world_size": world_size,
                          "num_workers": num_workers, "worker_id": self.worker_id, "num_used_data": list(num_used_data),
                          "shuffle_lines": shuffle_lines, "shuffle_seed": shuffle_seed if shuffle_lines else None,
                          "num_units": len(self.units), "datasets": [m.get("dataset_name") for m in manifests],
                          "num_samples": [m.get("num_samples") for m in manifests]}
        self.drops = DropCounter(f"official-order reader {self.group} worker {self.worker_id}", logger)
        self.unused = DropCounter(f"official-order reader {self.group} worker {self.worker_id}", logger,
                                  what="ignored part of a record (the sample is kept, as officially)")
        self.skipped: list[dict[str, Any]] = []
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
                if len(self.skipped) < _MAX_SKIPPED:  # diagnostics only: bounded however long the run
                    self.skipped.append({"row_id": self._row_id(pos, suffix), "reason": sample.drop_reason,
                                         "detail": sample.drop_detail})
                continue
            self._yielded_in_pass = True
            for reason, n in (sample.unused or {}).items():
                self.unused.drop(reason, f"{self.group} row {self._row_id(pos, suffix)}", n)
            return self._finish(sample, pos, row, suffix)
