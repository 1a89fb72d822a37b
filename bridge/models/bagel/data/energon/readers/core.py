"""``GroupReader``: the one reader core every order uses — one BAGEL group's samples on one DP rank.

What every group reader does lives here: the group's converted datasets (paths checked, sample counts, manifests
read once, random access: ``access.DatasetAccess``), cooking (``cooking.cook_with`` with the group's core and
context), drop and unused counters by reason, the liveness rule (a source that can never yield raises
``DataStallError``), the data watch (``watchdog.ReadWatch``: a warning after ``data.stall_warn_s``, a
``DataTimeoutError`` after ``data.timeout_s``), read-ahead in the rank's worker pool (``pool.ReadPool``), ``close``,
``stats`` and ``restore_sample`` by key; with ``data.verify_checksums`` every crude sample is checked against its
dataset's recorded checksums before it is cooked (``layout.checksums.ChecksumTable``; a mismatch is a
``checksum_mismatch`` drop) and :class:`ChecksumGuard` stops the reader on a damaged shard.

*Which* sample comes next is the order's: a small **plan** object (the reader's ``source``) deciding which
(dataset, sample index) each read is, how its random choices are drawn and what its state is. The plans:
``elastic.ElasticPlan`` (``data.order: elastic``, the default: resumable on any DP size) and
``official.OfficialPlan`` (``data.order: official``, the parity order). A plan offers:

* ``next_item()`` — the next read (a small tuple), advancing the plan (StopIteration at the end of a finite plan);
  an item ``("skip", row_id, reason, detail)`` is a unit with nothing to read (diagnostics only);
* ``copy()`` (plans with ``prefetch = True``: their reads are pure functions of the item and may run ahead in the
  worker pool) — a copy the look-ahead advances;
* ``coordinate(item)`` -> ``(dataset, sample index)``, ``draws(item)`` -> ``cooking.Draws``, ``finish(sample,
  item)`` (the read's key and ``data_indexes``), ``item_of(restore_key)``, ``is_handover(item)``, ``row_id(item)``;
* ``stall_limit(dataset)`` / ``stall_source(dataset)`` — the liveness rule's limit and what it counts over;
* ``state_dict`` / ``load_state_dict`` / ``identity`` / ``stats`` / ``resize_state(olds, ctx, handover)``.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import time
import weakref
from collections.abc import Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from ...errors import CorruptShardError, DataReadError, DataStallError, DataTimeoutError
from ...state import ResizeContext, Stage, StateError
from ...stats import DropCounter, StallWatch, merge_counts
from ...watchdog import DEFAULT_STALL_WARN_S, DEFAULT_TIMEOUT_S, ReadWatch, describe_frame
from ..cooking import CORES, BagelSample, CookContext, cook_with
from ..layout import MANIFEST_NAME, ManifestIndex, damage, load_manifest_index, remote
from ..layout.checksums import CHECKSUM_MISMATCH, ChecksumTable
from .access import DatasetAccess
from .pool import ReadPool
from .selection import manifest_runs

__all__ = ["MAX_BAD_FRACTION", "ChecksumGuard", "DataReadError", "GroupDatasets", "GroupReader",
           "dataset_num_samples", "read_error"]

logger = logging.getLogger(__name__)

_STALL_HINT = ("Fix or remove the dataset's unusable rows (see the reason), or drop the dataset from the group.")
#: Skipped rows kept for diagnostics (``GroupReader.skipped``), however long the run.
_MAX_SKIPPED = 1000
#: Reads in flight per worker of the pool, per reader (torch's DataLoader ``prefetch_factor``).
_AHEAD_PER_WORKER = 2
#: ``ChecksumGuard``'s threshold: more than this fraction of one shard's samples failing their checksums on one
#: reader means the shard itself is damaged (a bad copy), not a flipped bit here and there.
MAX_BAD_FRACTION = 0.01

_WORKER_ERROR = re.compile(r"Caught (\w+) in DataLoader worker process (\d+)\.")
#: Exception kinds a damaged file raises while Energon reads it (a cooking error names its row already).
_READ_KINDS = {"ValueError", "ReadError", "EOFError", "OSError", "error", "KeyError", "IndexError",
               "UnicodeDecodeError", "HeaderError", "StreamError", "AssertionError", "DatabaseError"}


def read_error(exc: BaseException, group: str, rank: str, workers: str, paths: Sequence[str]) -> DataReadError:
    """One line for a failed read: the damaged file (diagnosed) with its remedy, or the reader, cause and where.

    ``rank`` reads ``"DP rank r/s"``. A worker process's traceback (the read pool's ``_RemoteTraceback``, or a torch
    DataLoader worker's flattened one) goes to the debug log; its text is searched for the shard.
    """
    who = f"reader {group!r} ({rank}"
    text = str(exc)
    kind, where = type(exc).__name__, ""
    m = _WORKER_ERROR.search(text)
    if m:
        logger.debug("%s: traceback in worker %s:\n%s", who, m.group(2), text)
        kind, where = m.group(1), f", worker {m.group(2)}"
        last = [x for x in text.strip().splitlines() if x.strip()][-1].strip()
        text = last.split(": ", 1)[1] if last.startswith(f"{kind}:") or ": " in last[:60] else last
    remote = str(exc.__cause__) if type(exc.__cause__).__name__ == "_RemoteTraceback" else ""
    if remote:
        logger.debug("%s: traceback in a read worker:%s", who, remote)
        where = ", in a read worker"
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    shard = describe_frame(tb.tb_frame)["shard"] if tb is not None and not remote else None
    if kind in _READ_KINDS:
        found = damage.diagnose(paths, f"{text} {shard or ''} {remote}")
        if found is not None:
            return DataReadError(f"{found} (group {group!r}, {rank}{where})", brief=found[:200])
    at = f" while reading shard {shard}" if shard else ""
    message = f"{who}, {workers}, datasets {list(paths)}){where}: {kind}: {' '.join(text.split())}{at}"
    return DataReadError(message, brief=f"{who}){where}: {kind}: {' '.join(text.split())[:120]}")


def dataset_num_samples(path: str) -> tuple[str, int]:
    """``(group, sample count)`` of a converted dataset, from its manifest (or ``.nv-meta/.info.json``)."""
    if remote.isfile(remote.join(path, MANIFEST_NAME)):
        index = load_manifest_index(path)
        return index.group, index.num_samples
    import json

    info = remote.join(path, ".nv-meta", ".info.json")
    if not remote.isfile(info):
        raise ValueError(f"{path}: not a converted BAGEL dataset (no {MANIFEST_NAME} and no .nv-meta/.info.json)")
    counts = json.loads(remote.read_bytes(info)).get("shard_counts", {})
    return "", int(sum(counts.values()))


class GroupDatasets:
    """The converted datasets of one group: absolute ``paths``, the ``group`` name, each dataset's sample count
    (``counts``) and manifest index (``manifests``, read once; None without a converter manifest), their recorded
    checksums (``checksums``: a memory-mapped ``layout.checksums.ChecksumTable``, None for a dataset without them),
    and their random access (``access``, opened on first use).

    Raises ValueError (one line) for an empty dataset or datasets of different groups; ``layout.damage`` names a
    damaged ``.nv-meta`` first (Energon would only say "Invalid dataset at <dir>"); ManifestError for a damaged
    manifest or checksums file.
    """

    def __init__(self, paths: str | Sequence[str], group: str | None = None, *, patched: bool | None = None) -> None:
        self.paths = [remote.absolute(p) for p in ([paths] if isinstance(paths, (str, os.PathLike))
                                                               else paths)]
        if not self.paths:
            raise ValueError("a group reader needs at least one dataset path")
        for p in self.paths:
            damage.check_prepared(p)
        groups: set[str | None] = set()
        self.counts: list[int] = []
        self.manifests: list[ManifestIndex | None] = []
        self.checksums: list[ChecksumTable | None] = []
        for p in self.paths:  # the manifests' O(1) view (format 3: no per-file Python object)
            man = load_manifest_index(p) if remote.isfile(remote.join(p, MANIFEST_NAME)) else None
            self.manifests.append(man)
            self.checksums.append(ChecksumTable.open(p) if man is not None else None)
            g, n = (man.group, man.num_samples) if man is not None else dataset_num_samples(p)
            if n == 0:
                raise ValueError(f"{p}: no samples; a dataset of a group must hold data")
            groups.add(g or group)
            self.counts.append(n)
        groups.discard(None)
        if group is not None:
            groups.add(group)
        if len(groups) != 1:
            raise ValueError(f"datasets {self.paths} are not all of one group: {sorted(map(str, groups))}")
        self.group: str = groups.pop()  # type: ignore[assignment]
        self._patched = patched
        self._access: list[DatasetAccess | None] = [None] * len(self.paths)

    def name(self, d: int) -> str:
        """Dataset ``d``'s directory name."""
        return os.path.basename(self.paths[d])

    def access(self, d: int) -> DatasetAccess:
        """Dataset ``d``'s random access (opened on first use)."""
        if self._access[d] is None:
            self._access[d] = DatasetAccess(self.paths[d], patched=self._patched)
        return self._access[d]  # type: ignore[return-value]

    def accesses(self) -> list[DatasetAccess]:
        return [self.access(d) for d in range(len(self.paths))]

    def selection(self, num_used_data: Sequence[int] | None, shuffle_lines: bool, shuffle_seed: int
                  ) -> list[list[tuple[int, int, int]]]:
        """Per dataset, the official selection as ``(start, end, repetitions)`` sample-index runs
        (``selection.manifest_runs``). Raises ValueError when the selection needs a manifest it has not."""
        if num_used_data is not None and len(num_used_data) != len(self.paths):
            raise ValueError(f"num_used_data has {len(num_used_data)} entries for {len(self.paths)} datasets")
        runs = []
        for i, (p, n) in enumerate(zip(self.paths, self.counts)):
            used = None if num_used_data is None else int(num_used_data[i])
            if used is None and not (shuffle_lines and self.group == "vlm_sft"):
                runs.append([(0, n, 1)] if n else [])
                continue
            man = self.manifests[i]
            if man is None:
                raise ValueError(f"{p}: num_used_data / shuffle_lines need the converter's {MANIFEST_NAME}")
            runs.append(manifest_runs(man, used, shuffle_lines=shuffle_lines, shuffle_seed=shuffle_seed))
        return runs

    def unverified(self) -> list[str]:
        """The datasets that record no checksums (their samples are read unverified)."""
        return [p for p, t in zip(self.paths, self.checksums) if t is None]

    def close_files(self) -> None:
        for a in self._access:
            if a is not None:
                a.close_files()


class ChecksumGuard:
    """The per-shard threshold of ``checksum_mismatch`` drops on one reader (one DP rank).

    ``count(d, index)`` is called by the reader for every ``checksum_mismatch`` drop of sample ``index`` of dataset
    ``d``. When more than ``max_fraction`` of that sample's shard (at least one sample) has failed on this reader,
    it raises ``CorruptShardError``: one line naming the shard, its dataset, the rank and the remedy (the job agrees
    on it across ranks like any data error). Distinct samples count (a damaged sample read again in a later epoch
    counts once), so a few flipped bits never stop a long run; the memory is that of the damaged samples. The counts
    are diagnostics, not stream state: they restart at zero after a restore.
    """

    def __init__(self, datasets: GroupDatasets, where: str, max_fraction: float = MAX_BAD_FRACTION) -> None:
        self.datasets, self.where, self.max_fraction = datasets, where, max_fraction
        self._bad: dict[tuple[int, int], set[int]] = {}

    def count(self, d: int, index: int) -> None:
        """One more ``checksum_mismatch`` drop of sample ``index`` of dataset ``d``; raises past the limit."""
        table = self.datasets.checksums[d]
        if table is None or not 0 <= index < len(table.sums):
            return
        shard = table.shard_of(index)
        bad = self._bad.setdefault((d, shard), set())
        bad.add(index)
        n, size = len(bad), table.shard_count(shard)
        limit = max(1, int(self.max_fraction * size))
        if n > limit:
            path = table.shard_path(shard)
            raise CorruptShardError(
                f"damaged shard {path} (dataset {table.name!r}): {n} of its {size} samples failed their checksums on "
                f"{self.where} (limit {limit}: {self.max_fraction:.0%} of the shard), the last sample "
                f"{index:08d}: {table.remedy}",
                brief=f"damaged shard {path}: {n} of its {size} samples failed their checksums")


class GroupReader(Stage):
    """Endless iterator over the cooked, non-dropped samples of one BAGEL group on one DP rank, in the order of its
    plan (``source``; module docstring).

    ``datasets``: the group's ``GroupDatasets``; ``plan``: the order; ``ctx``: the group's cooking context
    (``cooking.make_cook_context``); ``dp_rank`` / ``dp_size`` and ``worker_id`` (the emulated official worker, in
    ``data_indexes``) name this reader in messages; ``pool``: the rank's ``ReadPool`` (None: reads in this process;
    plans whose reads draw from the global RNG always read in this process). ``stall_warn_s`` / ``timeout_s``: the
    data watch.

    State (``_savable_fields``): ``source`` (the plan's), the ledger counters ``taken`` (reads of the plan, drops
    included) and ``handed_in`` (handed-over samples read again), and ``drops`` / ``unused`` (by reason). Restore only
    before iterating. ``skipped`` lists the first dropped or skipped rows (diagnostics, not state).
    """

    _savable_fields = ("source", "taken", "handed_in", "drops", "unused")

    def __init__(self, datasets: GroupDatasets, plan: Any, ctx: CookContext, *, dp_rank: int = 0, dp_size: int = 1,
                 worker_id: int = 0, pool: ReadPool | None = None, stall_warn_s: float = DEFAULT_STALL_WARN_S,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.datasets, self.source, self.ctx = datasets, plan, ctx
        self.group = datasets.group
        self.dp_rank, self.dp_size, self.worker_id = int(dp_rank), int(dp_size), int(worker_id)
        self._core = CORES[self.group]
        self._pool = pool if pool is not None and plan.prefetch and pool.num_workers > 0 else None
        self._pool_id = self._pool.register(self) if self._pool is not None else -1
        self._window = _AHEAD_PER_WORKER * self._pool.num_workers if self._pool is not None else 0
        self.where = f"DP rank {self.dp_rank}/{self.dp_size}" + (f", worker {worker_id}" if worker_id else "")
        self.drops = DropCounter(f"reader {self.group} ({self.where})", logger)
        self.unused = DropCounter(f"reader {self.group} ({self.where})", logger,
                                  what="ignored part of a record (the sample is kept, as officially)")
        self._stall = StallWatch(f"reader {self.group!r}", _STALL_HINT)
        workers = f"{self._pool.num_workers} read workers" if self._pool is not None else "no read workers"
        self._watch = ReadWatch(f"reader {self.group!r} ({self.where}, {workers})", self.group, datasets.paths,
                                stall_warn_s=stall_warn_s, timeout_s=timeout_s,
                                worker_pids=self._pool.pids if self._pool is not None else None)
        self._guard = ChecksumGuard(datasets, f"{self.where}, reader {self.group!r}")
        self.skipped: list[dict[str, Any]] = []
        self._ahead: collections.deque = collections.deque()
        self._look: Any = None  # the look-ahead copy of the plan, made at the first read
        self._started = self._closed = False
        self._released = weakref.finalize(self, _release, self._pool, self._pool_id)
        self.reset_state()

    # -- state ---------------------------------------------------------------------------------------
    def reset_state(self) -> None:
        self.taken = 0
        self.handed_in = 0
        self.drops.reset_state()
        self.unused.reset_state()

    def identity(self) -> dict[str, Any]:
        """What a saved state must match besides the plan's own: group, datasets, transforms (no paths)."""
        ctx = self.ctx
        return {"group": self.group,
                "datasets": [{"name": self.datasets.name(d), "num_samples": n} for d, n in
                             enumerate(self.datasets.counts)],
                "transforms": [repr(ctx.transform), repr(ctx.vit_transform)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._started:
            raise StateError(f"reader {self.group}: a state can only be restored before iterating (build a fresh "
                             "reader to restore)")
        super().load_state_dict(state)

    def resize_state(self, olds: list[dict[str, Any]], ctx: ResizeContext,
                     handover: Sequence[Any] = ()) -> dict[str, Any]:
        """This reader's state on new DP rank ``ctx.dp_rank`` from every old rank's: the plan's resize (with the
        handed-over restore keys), and the counters carried by new rank 0 (their world sum is unchanged), or by every
        rank in a budget change (``ctx.same_world``: its own)."""
        first = ctx.carries_counters

        def counts(field: str) -> dict[str, Any]:
            return {"stage": "DropCounter", "state": {"counts": merge_counts(o[field]["state"]["counts"]
                                                                            for o in olds) if first else {}}}

        return {"source": ctx.resize(self.source, [o["source"] for o in olds], handover=handover),
                "taken": sum(int(o["taken"]) for o in olds) if first else 0,
                "handed_in": sum(int(o["handed_in"]) for o in olds) if first else 0,
                "drops": counts("drops"), "unused": counts("unused")}

    # -- reading -------------------------------------------------------------------------------------
    def read_item(self, item: tuple) -> BagelSample:
        """The cooked sample of one planned read (a tombstone when the data is unusable); in a pool worker or here."""
        d, i = self.source.coordinate(item)
        crude = self.datasets.access(d).crude(i)
        sample = cook_with(self._core, crude, self.ctx, self.source.draws(item), self.worker_id, index=i,
                           checksums=self.datasets.checksums[d] if self.ctx.verify_checksums else None)
        self.source.finish(sample, item)
        return sample

    def _read_here(self, item: tuple) -> BagelSample:
        sample = self.read_item(item)
        if self._pool is not None:
            self.datasets.close_files()  # the pool's workers may fork later: they must not share these offsets
        return sample

    def _fetch(self, item: tuple) -> BagelSample:
        """The sample of ``item``: read here (under the watch), or taken from the look-ahead in the pool."""
        if self._pool is None:
            return self._watch.call(self._read_here, item)
        if self._look is None:  # the first read: the plan has just produced ``item``, a copy goes on from there
            self._look = iter(self.source.copy())
            self._ahead.append((item, self._pool.submit(self._pool_id, item)))
        while len(self._ahead) < self._window:
            nxt = next(self._look)
            self._ahead.append((nxt, self._pool.submit(self._pool_id, nxt)))
        planned, future = self._ahead.popleft()
        if planned != item:
            raise RuntimeError(f"reader {self.group}: read {planned!r}, planned {item!r} (internal error)")
        return self._watch.call(future.result)

    def __next__(self) -> BagelSample:
        if self._closed:
            raise RuntimeError(f"reader {self.group} is closed")
        while True:
            item = self.source.next_item()
            if item[0] == "skip":
                self._skip(item)
                continue
            self._started = True
            try:
                sample = self._fetch(item)
            except (StopIteration, DataStallError, DataTimeoutError, DataReadError):
                raise
            except BrokenProcessPool as exc:
                raise DataReadError(f"reader {self.group!r} ({self.where}): a read worker process died (killed? out "
                                    f"of memory?) while reading datasets {self.datasets.paths}",
                                    brief=f"reader {self.group!r}: a read worker process died") from exc
            except Exception as exc:  # name the damaged file, else the group, datasets and rank
                raise read_error(exc, self.group, self.where, "read workers" if self._pool else "no read workers",
                                 self.datasets.paths) from exc
            if self.source.is_handover(item):
                self.handed_in += 1
            else:
                self.taken += 1
            d, index = self.source.coordinate(item)
            dataset = self.datasets.name(d)
            stall_key = self.source.stall_source(d) or dataset
            if sample.drop_reason is None:
                self._stall.ok(stall_key)
                for reason, n in (sample.unused or {}).items():
                    self.unused.drop(reason, f"{dataset} sample {sample.__key__} {sample.source}", n)
                return sample
            self.drops.drop(sample.drop_reason, sample.drop_detail)
            if sample.drop_reason == CHECKSUM_MISMATCH:
                self._guard.count(d, index)  # a damaged shard stops the reader
            if len(self.skipped) < _MAX_SKIPPED:
                self.skipped.append({"row_id": self.source.row_id(item), "reason": sample.drop_reason,
                                     "detail": sample.drop_detail})
            self._stall.drop(stall_key, sample.drop_reason, sample.drop_detail, limit=self.source.stall_limit(d),
                             where=f"dataset {dataset!r} on {self.where}")

    def _skip(self, item: tuple) -> None:
        _, row_id, reason, detail = item
        logger.warning("%s: %s is declared in parquet_info but absent; unit skipped like official", self.group, detail)
        if len(self.skipped) < _MAX_SKIPPED:
            self.skipped.append({"row_id": row_id, "reason": reason, "detail": detail})

    def restore_sample(self, restore_key: Any) -> BagelSample:
        """Rebuild a sample from its ``restore_key`` (the read's key and its recorded choices), drawing no RNG.
        Raises ``StateError`` for a key this reader's order does not know, or one naming a dropped sample."""
        item = self.source.item_of(restore_key)
        sample = self._read_here(item)
        if sample.drop_reason is not None:
            raise StateError(f"reader {self.group}: restore key {restore_key!r:.120} names a dropped sample "
                             f"({sample.drop_reason}: {sample.drop_detail})")
        return sample

    def stats(self) -> dict[str, Any]:
        """``drops`` and ``unused`` by reason, the ledger counters ``taken`` / ``handed_in``, and the plan's own
        (the elastic order: ``epoch``, open / queued blocks, ``pending``)."""
        return {"drops": dict(self.drops.counts), "unused": dict(self.unused.counts), "taken": self.taken,
                "handed_in": self.handed_in, **self.source.stats()}

    def close(self) -> None:
        """Stop reading: cancel the look-ahead and release the rank's read pool (the last reader stops its workers;
        after a data time-out the stuck ones are SIGKILLed first). A state cannot be restored after this."""
        if self._closed:
            return
        self._closed = True
        watch = self._watch
        killed = watch.kill_stuck() if watch.busy else False
        for _, future in self._ahead:
            future.cancel()
        self._ahead.clear()
        if self._pool is not None:
            if killed or watch.busy:
                self._pool.shutdown(wait=False)
            self._released()
        stopped = watch.stop(wait_s=15.0 if killed else 0.0)
        if stopped:
            # a read still stuck in this process holds its file's lock: closing the file would block on it (the
            # process's exit releases the file instead)
            self.datasets.close_files()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _release(pool: ReadPool | None, reader_id: int) -> None:
    if pool is not None:
        pool.release(reader_id)
