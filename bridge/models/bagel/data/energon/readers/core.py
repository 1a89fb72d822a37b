"""``GroupReader``: the one reader core every order uses — one BAGEL group's samples on one DP rank.

What every group reader does lives here: cooking (``cooking.cook_with``), drop and unused counters by reason, the
liveness rule (``DataStallError``), the data watch (``watchdog.ReadWatch``: a warning after ``data.stall_warn_s``, a
``DataTimeoutError`` after ``data.timeout_s``), read-ahead in the rank's ``pool.ReadPool``, ``close``, ``stats``,
``restore_sample``; with ``data.verify_checksums`` every crude sample is checked against its dataset's recorded
checksums before it is cooked (a mismatch is a ``checksum_mismatch`` drop; :class:`ChecksumGuard` stops the reader
on a damaged shard). *Which* sample comes next is the order's: a **plan** (the reader's ``source``,
:class:`plan.Plan`: ``elastic.ElasticPlan``, the default, or ``official.OfficialPlan``, the parity order).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import re
import traceback
import weakref
from collections.abc import Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from ...errors import CorruptShardError, DataReadError, DataStallError, DataTimeoutError
from ...state import ResizeContext, Stage, StateError
from ...stats import DropCounter, StallWatch, merge_counts
from ...watchdog import DEFAULT_STALL_WARN_S, DEFAULT_TIMEOUT_S, ReadWatch, describe_frame
from ..cooking import CORES, BagelSample, CookContext, Draws, cook_with
from ..layout import damage
from ..layout.checksums import CHECKSUM_MISMATCH
from .datasets import GroupDatasets
from .plan import Plan, Read, Skip
from .pool import ReadPool

__all__ = ["MAX_BAD_FRACTION", "ChecksumGuard", "DataReadError", "GroupReader", "read_error"]

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
    who, text = f"reader {group!r} ({rank}", str(exc)
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
    frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]  # the innermost last
    shard = describe_frame(frames[-1])["shard"] if frames and not remote else None
    if kind in _READ_KINDS:
        found = damage.diagnose(paths, f"{text} {shard or ''} {remote}")
        if found is not None:
            return DataReadError(f"{found} (group {group!r}, {rank}{where})", brief=found[:200])
    at = f" while reading shard {shard}" if shard else ""
    message = f"{who}, {workers}, datasets {list(paths)}){where}: {kind}: {' '.join(text.split())}{at}"
    return DataReadError(message, brief=f"{who}){where}: {kind}: {' '.join(text.split())[:120]}")


class ChecksumGuard:
    """The per-shard threshold of ``checksum_mismatch`` drops on one reader (one DP rank): when more than
    ``max_fraction`` of a shard's samples (at least one) failed on this reader, :meth:`count` raises
    ``CorruptShardError``, one line naming the shard, its dataset, the rank and the remedy. Distinct samples count (a
    damaged sample read again in a later epoch counts once), so a few flipped bits never stop a long run; the memory
    is that of the damaged samples. The counts are diagnostics, not stream state: they restart at zero after a restore.
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

    def __init__(self, datasets: GroupDatasets, plan: Plan, ctx: CookContext, *, dp_rank: int = 0, dp_size: int = 1,
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
        self._look: Plan | None = None  # the look-ahead copy of the plan, made at the first read
        self._started = self._closed = False
        self._released = weakref.finalize(self, self._pool.release, self._pool_id) if self._pool is not None else None
        self.reset_state()

    # -- state ---------------------------------------------------------------------------------------
    def reset_state(self) -> None:
        self.taken = self.handed_in = 0
        self.drops.reset_state()
        self.unused.reset_state()

    def identity(self) -> dict[str, Any]:
        """What a saved state must match besides the plan's own: group, datasets, transforms (no paths)."""
        return {"group": self.group, "datasets": [{"name": self.datasets.name(d), "num_samples": n}
                                                  for d, n in enumerate(self.datasets.counts)],
                "transforms": [repr(self.ctx.transform), repr(self.ctx.vit_transform)]}

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
    def read_item(self, read: Read) -> BagelSample:
        """The cooked sample of one planned read (a tombstone when the data is unusable), stamped with the read's key
        and ``data_indexes``; in a pool worker or here."""
        crude = self.datasets.access(read.dataset).crude(read.index)
        draws = Draws(replay=read.replay) if read.replay is not None else Draws(rng=self.source.rng(read))
        sample = cook_with(self._core, crude, self.ctx, draws, self.worker_id, index=read.index,
                           checksums=self.datasets.checksums[read.dataset] if self.ctx.verify_checksums else None)
        sample.__restore_key__ = read.key
        sample.data_indexes = {**sample.data_indexes, **read.data_indexes}
        return sample

    def _read_here(self, read: Read) -> BagelSample:
        sample = self.read_item(read)
        if self._pool is not None:
            self.datasets.close_files()  # the pool's workers may fork later: they must not share these offsets
        return sample

    def _fetch(self, read: Read) -> BagelSample:
        """The sample of ``read``: read here (under the watch), or taken from the look-ahead in the pool."""
        if self._pool is None:
            return self._watch.call(self._read_here, read)
        if self._look is None:  # the first read: the plan has just produced ``read``, a copy goes on from there
            self._look = self.source.copy()
            self._ahead.append((read, self._pool.submit(self._pool_id, read)))
        while len(self._ahead) < self._window:
            nxt = self._look.next_read()
            self._ahead.append((nxt, self._pool.submit(self._pool_id, nxt)))
        planned, future = self._ahead.popleft()
        if planned != read:
            raise RuntimeError(f"reader {self.group}: read {planned!r}, planned {read!r} (internal error)")
        return self._watch.call(future.result)

    def __next__(self) -> BagelSample:
        if self._closed:
            raise RuntimeError(f"reader {self.group} is closed")
        while True:
            read = self.source.next_read()
            if isinstance(read, Skip):
                logger.warning("%s: %s is declared in parquet_info but absent; unit skipped like official", self.group,
                               read.detail)
                if len(self.skipped) < _MAX_SKIPPED:
                    self.skipped.append(read._asdict())
                continue
            self._started = True
            try:
                sample = self._fetch(read)
            except (StopIteration, DataStallError, DataTimeoutError, DataReadError):
                raise
            except BrokenProcessPool as exc:
                raise DataReadError(f"reader {self.group!r} ({self.where}): a read worker process died (killed? out "
                                    f"of memory?) while reading datasets {self.datasets.paths}",
                                    brief=f"reader {self.group!r}: a read worker process died") from exc
            except Exception as exc:  # name the damaged file, else the group, datasets and rank
                raise read_error(exc, self.group, self.where, "read workers" if self._pool else "no read workers",
                                 self.datasets.paths) from exc
            if read.handover:
                self.handed_in += 1
            else:
                self.taken += 1
            dataset = self.datasets.name(read.dataset)
            stall_key = self.source.stall_source(read.dataset) or dataset
            if sample.drop_reason is None:
                self._stall.ok(stall_key)
                for reason, n in (sample.unused or {}).items():
                    self.unused.drop(reason, f"{dataset} sample {sample.__key__} {sample.source}", n)
                return sample
            self.drops.drop(sample.drop_reason, sample.drop_detail)
            if sample.drop_reason == CHECKSUM_MISMATCH:
                self._guard.count(read.dataset, read.index)  # a damaged shard stops the reader
            if len(self.skipped) < _MAX_SKIPPED:
                self.skipped.append({"row_id": read.row_id, "reason": sample.drop_reason, "detail": sample.drop_detail})
            self._stall.drop(stall_key, sample.drop_reason, sample.drop_detail,
                             limit=self.source.stall_limit(read.dataset), where=f"dataset {dataset!r} on {self.where}")

    def restore_sample(self, restore_key: Any) -> BagelSample:
        """Rebuild a sample from its ``restore_key`` (the read's key and its recorded choices), drawing no RNG.
        Raises ``StateError`` for a key this reader's order does not know, or one naming a dropped sample."""
        sample = self._read_here(self.source.read_of(restore_key))
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
        if watch.stop(wait_s=15.0 if killed else 0.0):
            # a read still stuck in this process holds its file's lock: closing the file would block on it (the
            # process's exit releases the file instead)
            self.datasets.close_files()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()
