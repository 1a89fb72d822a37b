"""What a stuck thread or process is doing, for the data watchdog (``watchdog.watch``).

``describe_frame`` finds the group, dataset and shard file from a thread's frames; worker processes answer through
the *agents* of the package docstring (``enable_agents``, ``collect_reports``); ``summarize`` picks the one thing
the chain waits on. The report files live in one ``bagel-watch-*`` directory per owner process in the
temp dir, removed when the owner exits or, after a crash, by the next owner's start (``_Agents``).
"""

from __future__ import annotations

import atexit
import fcntl
import json
import logging
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

from ..energon.patches import shard_in_frame

logger = logging.getLogger(__name__)

__all__ = ["collect_reports", "describe_frame", "enable_agents", "process_role", "set_process_role", "summarize",
           "wait_line"]

_REPORT_WAIT_S = 1.0
_AGENT_POLL_S = 0.25
_REPORTS_PREFIX = "bagel-watch-"
_OWNER_LOCK = "owner.lock"
_role: str | None = None  # set in a process that has a role of its own (``set_process_role``)
_agents: _Agents | None = None
_hook_installed = False


def describe_frame(frame: Any) -> dict[str, Any]:
    """``{"dataset", "shard", "group", "stack"}`` of a (stuck) thread from its innermost ``frame``: the shard an
    Energon tar reader is opening or reading (``energon.patches.shard_in_frame``: Energon's internals), the group of a
    BAGEL reader frame. Missing parts are None."""
    out: dict[str, Any] = {"dataset": None, "shard": None, "group": None,
                           "stack": "".join(traceback.format_stack(frame))}
    f = frame
    while f is not None:
        try:
            loc = f.f_locals
        except Exception:  # noqa: BLE001 - a frame being torn down
            loc = {}
        obj = loc.get("self")
        found = shard_in_frame(loc) if out["shard"] is None else None
        if found is not None:
            out["shard"], out["dataset"] = found
        if out["group"] is None and type(obj).__name__ == "GroupReader" and isinstance(getattr(obj, "group", 0), str):
            out["group"] = obj.group
        f = f.f_back
    return out


def set_process_role(role: str) -> None:
    """Name this process in the watch's reports (e.g. ``"read worker"`` in a rank's read pool); the pid is added."""
    global _role
    _role = role


def process_role() -> str:
    """Which process this is, in words: a read worker of the rank's pool, an Energon worker, the prefetch producer,
    or a reader thread (with pid)."""
    if _role is not None:
        return f"{_role} (pid {os.getpid()})"
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
    reports = [{**describe_frame(frame), "thread": ident} for ident, frame in sys._current_frames().items()
               if ident not in skip]
    reports.sort(key=lambda r: (r["shard"] is None, r["group"] is None))
    return reports


class _Agents:
    """The report directory (one ``<pid>.json`` per reporting process) and the request counter of one owner.

    The owner removes the directory when it exits (``atexit``; a forked process that exits through the interpreter
    leaves it alone). An owner that exits without that (``os._exit``, a SIGKILL, a preemption) held an exclusive
    ``flock`` on ``owner.lock`` inside it, which the kernel drops when the owner and every process forked from it
    are gone: the next owner's start removes such directories (``_reclaim_reports``), never one whose lock is held.
    """

    def __init__(self) -> None:
        _reclaim_reports()
        self.dir = tempfile.mkdtemp(prefix=_REPORTS_PREFIX)
        # locked before it gets its name, so no other process can take the directory for a dead owner's
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".lock-")
        fcntl.flock(fd, fcntl.LOCK_EX)  # ``fd`` stays open for the process's life; forked children share it
        os.rename(tmp, os.path.join(self.dir, _OWNER_LOCK))
        # A lock-free shared counter (no multiprocessing lock a killed process could leave held): the watchdog
        # bumps it, each agent notices within _AGENT_POLL_S and reports once per bump.
        self.request = mp.get_context("fork").RawValue("q", 0)
        self.owner = os.getpid()
        atexit.register(_remove_reports, self.dir, self.owner)


def _remove_reports(path: str, owner: int) -> None:
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


def _reclaim_reports() -> int:
    """Remove the report directories of owners that are gone (their ``owner.lock`` free); how many were removed.
    A directory without ``owner.lock`` (being created, or left by a version before the lock) is left alone."""
    removed, root = 0, tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(root) if n.startswith(_REPORTS_PREFIX)]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(root, name)
        try:
            fd = os.open(os.path.join(path, _OWNER_LOCK), os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
        except OSError:
            pass  # a live owner (or one of its forked processes) holds the lock
        finally:
            os.close(fd)
    if removed:
        logger.info("removed %d report directories of data watchdogs whose processes are gone (%s/%s*)",
                    removed, root, _REPORTS_PREFIX)
    return removed


def _agent_loop(agents: _Agents, seen: int) -> None:
    """Report once per bump of ``agents.request`` after ``seen`` (its value when this process was forked)."""
    me = threading.get_ident()
    while True:
        time.sleep(_AGENT_POLL_S)
        if agents.request.value == seen:
            continue
        seen = agents.request.value
        try:
            reps = _thread_reports({me})
            best = reps[0] if reps else {"dataset": None, "shard": None, "group": None, "stack": ""}
            rep = {**best, "pid": os.getpid(), "role": process_role(), "time": time.time()}
            path = os.path.join(agents.dir, f"{os.getpid()}.json")
            with open(path + ".tmp", "w", encoding="utf-8") as fh:
                json.dump(rep, fh)
            os.replace(path + ".tmp", path)
        except Exception:  # noqa: BLE001 - a report is best effort; never disturb the process
            pass


def _start_agent() -> None:
    if _agents is not None and os.getpid() != _agents.owner:
        # the counter is read here, in the fork hook, not when the thread first runs: a request made between
        # the fork and the thread's first turn (a loaded machine) is then still answered
        threading.Thread(target=_agent_loop, args=(_agents, _agents.request.value), name="bagel-watch-agent",
                         daemon=True).start()


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
    try:
        names = os.listdir(agents.dir)
    except OSError:  # the owner exited (and removed it) while a forked process, e.g. the producer, still runs
        return []
    for name in (n for n in names if n.endswith(".json")):
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
            "dataset_path": dataset, "shard": best.get("shard"), "process": best.get("role") or process_role()}


def wait_line(s: dict[str, Any], datasets: list[str]) -> str:
    """``summarize``'s result as the words of the warning / error line: group, dataset, shard file, process."""
    ds = repr(s["dataset"]) if s["dataset"] else f"one of {[os.path.basename(d) for d in datasets]}"
    shard = f", shard file {s['shard']}" if s["shard"] else ", shard not known"
    return f"group {s['group']!r}, dataset {ds}{shard}, in {s['process']}"
