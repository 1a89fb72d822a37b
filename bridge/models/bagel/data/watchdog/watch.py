"""Watched reads: ``ReadWatch.call`` (per read) and ``batch_call`` (per batch), the time-out error and the
defaults; see the package docstring (``bridge.models.bagel.data.watchdog``) for how the two ways to wait work.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ..errors import DataTimeoutError
from .stacks import collect_reports, describe_frame, enable_agents, process_role, summarize, wait_line

__all__ = ["DEFAULT_STALL_WARN_S", "DEFAULT_TIMEOUT_S", "DataTimeoutError", "ReadWatch", "batch_call"]

logger = logging.getLogger(__name__)

#: Defaults (config ``data.stall_warn_s`` / ``data.timeout_s``): far above any healthy read, first one included
#: (opening a blend of many ranges, forking workers), and the time-out below torch.distributed's default
#: collective time-out (10 min for NCCL), so a stuck rank ends as one line on every rank instead of a time-out.
DEFAULT_STALL_WARN_S = 120.0
DEFAULT_TIMEOUT_S = 480.0
_LOOK_S = 0.5  # a batch waiter looks at the read in progress at least this often


_local = threading.local()  # .batch: the _BatchThread this thread runs for (set on a batch thread); .own: its own
_live: weakref.WeakSet = weakref.WeakSet()  # the enabled, not stopped ReadWatches of this process


class ReadWatch:
    """Waits for blocking reads with ``stall_warn_s`` / ``timeout_s``: per batch or on a reader thread.

    ``what`` names the reader in messages ("reader 't2i' (DP rank 0/2, 2 read workers)"), ``group`` and
    ``datasets`` what it reads; ``worker_pids``: reads wait on other processes, these (their agents are asked
    what they do; after a time-out only these are killed, never another live process that runs an agent, such as
    an unrelated ``DataLoader`` worker forked from the same parent). Once a read timed out the watch is ``stuck``:
    later calls raise the same ``DataTimeoutError`` at once.
    """

    def __init__(self, what: str, group: str | None, datasets: list[str], *, stall_warn_s: float,
                 timeout_s: float, worker_pids: Callable[[], list[int]] | None = None) -> None:
        self.what, self.group, self.datasets = what, group, list(datasets)
        self.stall_warn_s, self.timeout_s = float(stall_warn_s or 0), float(timeout_s or 0)
        self.worker_pids = worker_pids
        self.enabled = self.stall_warn_s > 0 or self.timeout_s > 0
        self.stuck: DataTimeoutError | None = None
        self.stuck_pids: list[int] = []
        self._thread: _BatchThread | None = None  # this watch's reader thread
        self._stuck_thread: threading.Thread | None = None  # the thread left in the read that timed out
        self._owner = os.getpid()
        if self.enabled:
            _live.add(self)
            if worker_pids is not None:
                enable_agents()

    @property
    def busy(self) -> bool:
        """A read is still running on the reader or batch thread (a stuck one after a time-out)."""
        return self.stuck is not None and self._stuck_thread is not None and self._stuck_thread.is_alive()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` under the watchdog; raises what it raises, or the time-out.

        Disabled: called directly. On a batch thread (``batch_call``): called inline, the read stamped for the
        batch's waiter. Else on this watch's reader thread, stamped the same way and waited for here.
        """
        if not self.enabled:
            return fn(*args)
        if self.stuck is not None:
            raise self.stuck
        batch = getattr(_local, "batch", None)
        if batch is not None and batch.owner == os.getpid():
            return batch.read(self, fn, args)
        reader = self._thread
        if reader is None or self._owner != os.getpid() or not reader.thread.is_alive():
            self._owner = os.getpid()
            reader = self._thread = _BatchThread("bagel-data-read")
            _live.add(self)
        return reader.run(reader.read, (self, fn, args))

    def _look(self, thread: threading.Thread | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        frame = sys._current_frames().get(thread.ident) if thread is not None and thread.ident else None
        local = [{**describe_frame(frame), "role": process_role(), "pid": os.getpid()}] if frame is not None else []
        reports = local + (collect_reports() if self.worker_pids is not None else [])
        reports.sort(key=lambda r: (r.get("shard") is None, r.get("group") is None))
        return summarize(reports, self.group, self.datasets), reports

    def _warn(self, waited: float, thread: threading.Thread | None) -> None:
        s, reports = self._look(thread)
        logger.warning("data watchdog: %s has waited %.0fs for a read (data.stall_warn_s=%g): %s; time-out at "
                       "data.timeout_s=%g", self.what, waited, self.stall_warn_s, wait_line(s, self.datasets),
                       self.timeout_s)
        for rep in reports:
            logger.debug("data watchdog: stack of %s:\n%s", rep.get("role"), rep.get("stack"))

    def _time_out(self, waited: float, thread: threading.Thread | None) -> None:
        s, reports = self._look(thread)
        for rep in reports:
            logger.debug("data watchdog: stack of %s at the time-out:\n%s", rep.get("role"), rep.get("stack"))
        own = set(self.worker_pids()) if self.worker_pids is not None else set()
        self.stuck_pids = sorted({int(r["pid"]) for r in reports if r.get("pid") in own})
        self._stuck_thread = thread
        where = wait_line(s, self.datasets)
        self.stuck = DataTimeoutError(
            f"data time-out: {self.what} got nothing for {waited:.0f}s (data.timeout_s={self.timeout_s:g}) waiting "
            f"on {where}.\nThe storage under it does not answer (a hung mount?): check it (ls -l / cat the shard "
            "file), fix or remove the dataset, or raise data.timeout_s if reads there are merely slow",
            brief=f"data time-out in {where}")
        raise self.stuck

    def kill_stuck(self) -> bool:
        """After a time-out: SIGKILL the worker processes that were stuck (so none is left behind). True if there
        were any (then torch reports their deaths: see ``energon.workers.killed_workers_expected``)."""
        killed = bool(self.stuck_pids)
        for pid in self.stuck_pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self.stuck_pids = []
        return killed

    def stop(self, wait_s: float = 0.0) -> bool:
        """End the reader thread (idle: at once; stuck: waits up to ``wait_s``, else it is left behind as a daemon
        thread, package docstring). True if it ended."""
        _live.discard(self)
        t, stuck = self._thread, self._stuck_thread
        if self._owner != os.getpid():
            return True
        if t is not None:
            t.jobs.put(None)
        for thread in {x for x in (t and t.thread, stuck) if x is not None}:
            thread.join(wait_s if self.stuck is not None else None)
            if thread.is_alive():
                logger.debug("%s: a thread is still stuck in a read; left as a daemon thread", self.what)
                return False
        self._thread = None
        return True


class _BatchThread:
    """The thread that builds whole batches for one calling thread (or runs a ``ReadWatch``'s reads: its reader
    thread); the reads in it stamp ``reading``, which the waiting thread looks at."""

    def __init__(self, name: str = "bagel-data-batch") -> None:
        self.owner = os.getpid()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.reading: list[list[Any]] = []  # [watch, started (monotonic), warned] of each read in progress
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        """Run each ``(fn, args)`` job, handing ``(True, result)`` or ``(False, exception)`` to the waiting thread;
        ``None`` ends it."""
        _local.batch = self
        while (job := self.jobs.get()) is not None:
            fn, args = job
            try:
                self.done.put((True, fn(*args)))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                self.done.put((False, exc))
            del job, fn, args

    def read(self, watch: ReadWatch, fn: Callable[..., Any], args: tuple) -> Any:
        """A read on this thread: inline, stamped for the waiter (nested reads stack)."""
        entry = [watch, time.monotonic(), False]
        self.reading.append(entry)
        try:
            return fn(*args)
        finally:
            self.reading.pop()
            if entry[2]:
                logger.warning("%s: the read returned after %.1fs", watch.what, time.monotonic() - entry[1])

    def _due(self) -> float:
        """Seconds until the read in progress has a limit due (at most ``_LOOK_S``)."""
        try:
            watch, t0, warned = self.reading[-1]
        except IndexError:
            return _LOOK_S
        limits = [x for x in ((watch.stall_warn_s if not warned else 0), watch.timeout_s) if x > 0]
        return min([_LOOK_S, *(t0 + x - time.monotonic() for x in limits)]) if limits else _LOOK_S

    def _look(self) -> None:
        try:
            entry = self.reading[-1]
        except IndexError:
            return
        watch, t0, warned = entry
        waited = time.monotonic() - t0
        if watch.stall_warn_s > 0 and not warned and waited >= watch.stall_warn_s:
            entry[2] = True
            watch._warn(waited, self.thread)
        if watch.timeout_s > 0 and waited >= watch.timeout_s:
            self.jobs.put(None)  # the thread ends if the read ever returns; this caller gets a fresh one
            if getattr(_local, "own", None) is self:
                _local.own = None
            watch._time_out(waited, self.thread)

    def run(self, fn: Callable[..., Any], args: tuple) -> Any:
        self.jobs.put((fn, args))
        while True:
            try:
                ok, value = self.done.get(timeout=max(0.001, self._due()))
            except queue.Empty:
                self._look()
                continue
            if ok:
                return value
            raise value


def batch_call(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` (a whole batch: ``next(upstream)``) on this thread's batch thread, under the watchdog, its reads
    inline (package docstring). Called directly when no enabled ``ReadWatch`` lives in this process (the watchdog is
    off), when already on a batch thread, or when ``args[0]`` watches itself (``watchdog_scope = False``: the prefetch
    stage, whose producer process batches its own reads). Raises what ``fn`` raises, or ``DataTimeoutError``."""
    on = getattr(_local, "batch", None)
    if not _live or (on is not None and on.owner == os.getpid()) or \
            (args and getattr(args[0], "watchdog_scope", True) is False):
        return fn(*args)
    own = getattr(_local, "own", None)
    if own is None or own.owner != os.getpid() or not own.thread.is_alive():
        own = _local.own = _BatchThread()
    return own.run(fn, args)
