"""The data watchdog: a read that never returns (a mount that stopped answering) becomes one clear error.

Every read that can block the trainer's ``next()`` goes through ``ReadWatch.call``: inline Energon reads
(``BagelGroupReader``, also the waits on Energon worker processes) and official-order reads
(``OfficialOrderReader``), in the trainer or in the prefetch producer; the trainer's side of the prefetch queue
is watched by ``PrefetchStage`` itself with a later deadline (a safety net for a producer stuck elsewhere).

Two ways to wait, one behaviour (bit-identical stream with the watchdog on or off):

* **Per batch** (the loader's ``next()`` and the prefetch producer's loop, through ``batch_call``): the whole
  batch is built on one *batch thread* per calling thread, which the caller waits on with a timed get: ONE
  hand-over per batch. Reads inside it run inline and only stamp a slot ("this watch, reading since t"); the
  waiting caller looks at that slot when a limit of the read in progress comes due (at least every 0.5 s).
* **Per read** (any other caller: tests, tools, a reader driven by hand): ``call`` runs each read on a reader
  thread of its own and waits for it the same way.

After ``stall_warn_s`` (config ``data.stall_warn_s``) without the read returning it logs ONE warning line
naming what the chain waits on (group, dataset, the shard file being read when known, which process, for how
long) and the stuck stacks at DEBUG; after ``timeout_s`` (``data.timeout_s``) it raises ``DataTimeoutError``
with that content. 0 disables either. Which shard is found from the stuck thread's frames (the Energon tar
reader's ``tar_file_id`` / sample pointer), so a healthy read costs nothing but the stamp (per batch) or the
thread hand-over (per read).

A thread blocked in the kernel (``open``/``read`` on a dead mount) cannot be cancelled from Python: after a
time-out it stays behind as a daemon thread, the caller gets the error, and the job exits (daemon threads do
not hold up the interpreter's exit; stuck Energon workers are killed, ``ReadWatch.kill_stuck``).

Energon worker processes are asked through *agents*: every process forked after ``enable_agents()`` (the
Energon workers, the prefetch producer and its workers) gets a daemon thread that polls a shared counter (4 times a second,
lock-free) and, when the watchdog bumps it, writes what its threads are doing to a report file (``collect_reports``).
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["DEFAULT_STALL_WARN_S", "DEFAULT_TIMEOUT_S", "DataTimeoutError", "ReadWatch", "batch_call",
           "collect_reports", "describe_frame", "enable_agents", "summarize"]

logger = logging.getLogger(__name__)

#: Defaults (config ``data.stall_warn_s`` / ``data.timeout_s``): far above any healthy read, first one included
#: (opening a blend of many ranges, forking workers), and the time-out below torch.distributed's default
#: collective time-out (10 min for NCCL), so a stuck rank ends as one line on every rank instead of a time-out.
DEFAULT_STALL_WARN_S = 120.0
DEFAULT_TIMEOUT_S = 480.0
_REPORT_WAIT_S = 1.0
_AGENT_POLL_S = 0.25
_LOOK_S = 0.5  # a batch waiter looks at the read in progress at least this often


class DataTimeoutError(RuntimeError):
    """A data read did not return within ``data.timeout_s``; names group, dataset, shard file and process.

    ``brief`` is a short form for the other ranks' line (``job.topology.agree``).
    """

    def __init__(self, message: str, brief: str = "") -> None:
        super().__init__(message)
        self.brief = brief or message[:160]

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.brief))


# -- what a stuck thread is doing ---------------------------------------------------------------------
def describe_frame(frame: Any) -> dict[str, Any]:
    """``{"dataset", "shard", "group", "stack"}`` of a (stuck) thread from its innermost ``frame``.

    The shard is the file an Energon tar reader (``ITarReader``: ``tar_filepaths`` + ``tar_file_id`` or a
    sample pointer) is opening or reading; the group that of a BAGEL reader frame. Missing parts are None.
    """
    out: dict[str, Any] = {"dataset": None, "shard": None, "group": None,
                           "stack": "".join(traceback.format_stack(frame))}
    f = frame
    while f is not None:
        try:
            loc = f.f_locals
        except Exception:  # noqa: BLE001 - a frame being torn down
            loc = {}
        obj = loc.get("self")
        if out["shard"] is None and obj is not None and hasattr(obj, "tar_filepaths"):
            tid = loc.get("tar_file_id")
            for name in ("sample_pointer", "raw_sample_pointer"):
                if tid is None and loc.get(name) is not None:
                    tid = getattr(loc[name], "tar_file_id", None)
            if isinstance(tid, int) and 0 <= tid < len(obj.tar_filepaths):
                out["shard"] = str(obj.tar_filepaths[tid])
                out["dataset"] = str(getattr(obj, "base_path", "") or "") or None
        if out["group"] is None and obj is not None:
            group = getattr(obj, "group_name", None) if type(obj).__name__ == "BagelGroupReader" else \
                getattr(obj, "group", None) if type(obj).__name__ == "OfficialOrderReader" else None
            if isinstance(group, str):
                out["group"] = group
        f = f.f_back
    return out


def _role() -> str:
    try:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
    except Exception:  # noqa: BLE001 - torch not importable here
        info = None
    if info is not None:
        return f"Energon worker {info.id} (pid {os.getpid()})"
    if mp.current_process().name == "bagel-prefetch":
        return f"prefetch producer (pid {os.getpid()})"
    return f"the reader thread of process {os.getpid()}"


def _thread_reports(skip: set[int]) -> list[dict[str, Any]]:
    reports = []
    for ident, frame in sys._current_frames().items():
        if ident in skip:
            continue
        rep = describe_frame(frame)
        rep["thread"] = ident
        reports.append(rep)
    reports.sort(key=lambda r: (r["shard"] is None, r["group"] is None))
    return reports


# -- agents in forked processes -----------------------------------------------------------------------
class _Agents:
    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="bagel-watch-")
        # A lock-free shared counter (no multiprocessing lock a killed process could leave held): the watchdog
        # bumps it, each agent notices within _AGENT_POLL_S and reports once per bump.
        self.request = mp.get_context("fork").RawValue("q", 0)
        self.owner = os.getpid()


_agents: _Agents | None = None
_hook_installed = False


def _agent_loop(agents: _Agents) -> None:
    me = threading.get_ident()
    seen = agents.request.value
    while True:
        time.sleep(_AGENT_POLL_S)
        if agents.request.value == seen:
            continue
        seen = agents.request.value
        try:
            reps = _thread_reports({me})
            best = reps[0] if reps else {"dataset": None, "shard": None, "group": None, "stack": ""}
            rep = {**best, "pid": os.getpid(), "role": _role(), "time": time.time()}
            path = os.path.join(agents.dir, f"{os.getpid()}.json")
            with open(path + ".tmp", "w", encoding="utf-8") as fh:
                json.dump(rep, fh)
            os.replace(path + ".tmp", path)
        except Exception:  # noqa: BLE001 - a report is best effort; never disturb the process
            pass


def _start_agent() -> None:
    if _agents is not None and os.getpid() != _agents.owner:
        threading.Thread(target=_agent_loop, args=(_agents,), name="bagel-watch-agent", daemon=True).start()


def enable_agents() -> None:
    """Give every process forked from now on (Energon workers, the prefetch producer) a report agent."""
    global _agents, _hook_installed
    if _agents is None or _agents.owner != os.getpid() and not os.path.isdir(_agents.dir):
        _agents = _Agents()
    if not _hook_installed:
        os.register_at_fork(after_in_child=_start_agent)
        _hook_installed = True


def collect_reports(wait_s: float = _REPORT_WAIT_S) -> list[dict[str, Any]]:
    """Ask every live agent what its process is doing; their reports (shard first), within ``wait_s``."""
    agents = _agents
    if agents is None:
        return []
    t0 = time.time()
    agents.request.value += 1
    time.sleep(wait_s)
    reports = []
    for name in os.listdir(agents.dir):
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(agents.dir, name), encoding="utf-8") as fh:
                rep = json.load(fh)
        except (OSError, ValueError):
            continue
        if rep.get("time", 0) >= t0 - 0.5 and rep.get("pid") != os.getpid():
            reports.append(rep)
    reports.sort(key=lambda r: (r.get("shard") is None, r.get("group") is None))
    return reports


def summarize(reports: list[dict[str, Any]], group: str | None, datasets: list[str]) -> dict[str, Any]:
    """The one thing the chain waits on: group, dataset, shard, process (from the most specific report)."""
    best = next((r for r in reports if r.get("shard")), reports[0] if reports else {})
    group = group or next((r["group"] for r in reports if r.get("group")), None)
    dataset = best.get("dataset") or (datasets[0] if len(datasets) == 1 else None)
    return {"group": group, "dataset": os.path.basename(dataset.rstrip("/")) if dataset else None,
            "dataset_path": dataset, "shard": best.get("shard"), "process": best.get("role") or _role()}


def _what(s: dict[str, Any], datasets: list[str]) -> str:
    ds = repr(s["dataset"]) if s["dataset"] else f"one of {[os.path.basename(d) for d in datasets]}"
    shard = f", shard file {s['shard']}" if s["shard"] else ", shard not known"
    return f"group {s['group']!r}, dataset {ds}{shard}, in {s['process']}"


# -- the watched call ---------------------------------------------------------------------------------
_local = threading.local()  # .batch: the _BatchThread this thread runs for (set on a batch thread); .own: its own
_live: weakref.WeakSet = weakref.WeakSet()  # the enabled, not stopped ReadWatches of this process


class ReadWatch:
    """Waits for blocking reads with ``stall_warn_s`` / ``timeout_s``: per batch or on a reader thread.

    ``what`` names the reader in messages ("reader 't2i' (DP rank 0/2, 2 Energon workers)"), ``group`` and
    ``datasets`` what it reads; ``workers``: reads wait on other processes (ask their agents). Once a read
    timed out the watch is ``stuck``: later calls raise the same ``DataTimeoutError`` at once.
    """

    def __init__(self, what: str, group: str | None, datasets: list[str], *, stall_warn_s: float,
                 timeout_s: float, workers: bool = False) -> None:
        self.what, self.group, self.datasets = what, group, list(datasets)
        self.stall_warn_s, self.timeout_s = float(stall_warn_s or 0), float(timeout_s or 0)
        self.workers = workers
        self.enabled = self.stall_warn_s > 0 or self.timeout_s > 0
        self.stuck: DataTimeoutError | None = None
        self.stuck_pids: list[int] = []
        self._thread: threading.Thread | None = None
        self._stuck_thread: threading.Thread | None = None  # the thread left in the read that timed out
        self._owner = os.getpid()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        if self.enabled:
            _live.add(self)
            if workers:
                enable_agents()

    @property
    def busy(self) -> bool:
        """A read is still running on the reader or batch thread (a stuck one after a time-out)."""
        return self.stuck is not None and self._stuck_thread is not None and self._stuck_thread.is_alive()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args = job
            try:
                self._done.put((True, fn(*args)))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                self._done.put((False, exc))
            del job, fn, args

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` under the watchdog; raises what it raises, or the time-out.

        Disabled: called directly. On a batch thread (``batch_call``): called inline, the read stamped for the
        batch's waiter. Else on this watch's reader thread, waited for here.
        """
        if not self.enabled:
            return fn(*args)
        if self.stuck is not None:
            raise self.stuck
        batch = getattr(_local, "batch", None)
        if batch is not None and batch.owner == os.getpid():
            return batch.read(self, fn, args)
        if self._thread is None or self._owner != os.getpid() or not self._thread.is_alive():
            self._owner = os.getpid()
            self._jobs, self._done = queue.SimpleQueue(), queue.SimpleQueue()
            self._thread = threading.Thread(target=self._loop, name="bagel-data-read", daemon=True)
            self._thread.start()
            _live.add(self)
        self._jobs.put((fn, args))
        t0 = time.monotonic()
        warned = False
        while True:
            waited = time.monotonic() - t0
            limits = [x for x in ((self.stall_warn_s if not warned else 0), self.timeout_s) if x > 0]
            try:
                ok, value = self._done.get(timeout=max(0.0, min(limits) - waited) if limits else None)
            except queue.Empty:
                waited = time.monotonic() - t0
                if self.stall_warn_s > 0 and not warned and waited >= self.stall_warn_s:
                    warned = True
                    self._warn(waited, self._thread)
                if self.timeout_s > 0 and waited >= self.timeout_s:
                    self._time_out(waited, self._thread)
                continue
            if warned:
                logger.warning("%s: the read returned after %.1fs", self.what, time.monotonic() - t0)
            if ok:
                return value
            raise value

    def _look(self, thread: threading.Thread | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        frame = sys._current_frames().get(thread.ident) if thread is not None and thread.ident else None
        local = describe_frame(frame) if frame is not None else {}
        if local:
            local.update(role=_role(), pid=os.getpid())
        reports = ([local] if local else []) + (collect_reports() if self.workers else [])
        reports.sort(key=lambda r: (r.get("shard") is None, r.get("group") is None))
        return summarize(reports, self.group, self.datasets), reports

    def _warn(self, waited: float, thread: threading.Thread | None) -> None:
        s, reports = self._look(thread)
        logger.warning("data watchdog: %s has waited %.0fs for a read (data.stall_warn_s=%g): %s; time-out at "
                       "data.timeout_s=%g", self.what, waited, self.stall_warn_s, _what(s, self.datasets),
                       self.timeout_s)
        for rep in reports:
            logger.debug("data watchdog: stack of %s:\n%s", rep.get("role"), rep.get("stack"))

    def _time_out(self, waited: float, thread: threading.Thread | None) -> None:
        s, reports = self._look(thread)
        for rep in reports:
            logger.debug("data watchdog: stack of %s at the time-out:\n%s", rep.get("role"), rep.get("stack"))
        self.stuck_pids = [int(r["pid"]) for r in reports if r.get("pid") not in (None, os.getpid())]
        self._stuck_thread = thread
        where = _what(s, self.datasets)
        self.stuck = DataTimeoutError(
            f"data time-out: {self.what} got nothing for {waited:.0f}s (data.timeout_s={self.timeout_s:g}) waiting "
            f"on {where}. The storage under it does not answer (a hung mount?): check it (ls -l / cat the shard "
            "file), fix or remove the dataset, or raise data.timeout_s if reads there are merely slow",
            brief=f"data time-out in {where}")
        raise self.stuck

    def kill_stuck(self) -> None:
        """After a time-out: SIGKILL the worker processes that were stuck (so none is left behind)."""
        for pid in self.stuck_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.stuck_pids = []

    def stop(self, wait_s: float = 0.0) -> bool:
        """End the reader thread (idle: at once; stuck: waits up to ``wait_s``). True if it ended.

        A thread blocked in the kernel cannot be cancelled from Python: if it does not end within ``wait_s`` it
        is left behind as a daemon thread (it does not keep the process from exiting).
        """
        _live.discard(self)
        t, stuck = self._thread, self._stuck_thread
        if self._owner != os.getpid():
            return True
        if t is not None:
            self._jobs.put(None)
        for thread in {x for x in (t, stuck) if x is not None}:
            thread.join(wait_s if self.stuck is not None else None)
            if thread.is_alive():
                logger.debug("%s: a thread is still stuck in a read; left as a daemon thread", self.what)
                return False
        self._thread = None
        return True


class _BatchThread:
    """The thread that builds whole batches for one calling thread; the reads in it stamp ``reading``."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.reading: list[list[Any]] = []  # [watch, started (monotonic), warned] of each read in progress
        self.thread = threading.Thread(target=self._loop, name="bagel-data-batch", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        _local.batch = self
        while True:
            job = self.jobs.get()
            if job is None:
                return
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
    """``fn(*args)`` (a whole batch: ``next(upstream)``) on this thread's batch thread, under the watchdog.

    The reads inside run inline (``ReadWatch.call``), so a batch costs one hand-over instead of one per
    sample. Called directly when no enabled ``ReadWatch`` lives in this process (the watchdog is off), when
    already on a batch thread, or when ``args[0]`` watches itself (``watchdog_scope = False``: the prefetch
    stage, whose producer process batches its own reads). Raises what ``fn`` raises, or ``DataTimeoutError``.
    """
    on = getattr(_local, "batch", None)
    if not _live or (on is not None and on.owner == os.getpid()) or \
            (args and getattr(args[0], "watchdog_scope", True) is False):
        return fn(*args)
    own = getattr(_local, "own", None)
    if own is None or own.owner != os.getpid() or not own.thread.is_alive():
        own = _local.own = _BatchThread()
    return own.run(fn, args)
