"""No shared-memory segment of a job's worker processes outlives the job, whatever kills it.

The prefetch producer allocates batch tensors with torch's ``file_system`` sharing strategy: named files
``/dev/shm/torch_<creator pid>_<random>_<counter>``. Normally they are unlinked when the last user frees them,
and torch_shm_manager (its own session) unlinks what is left when its clients die. But a kill that takes the
whole job including the manager (scancel / preemption / OOM kill of the job's cgroup, container stop) leaves
every segment that was queued or in use in /dev/shm for good: hundreds of MB per kill.

So every producer is registered under an *owner file* ``/dev/shm/bagel-prefetch-<trainer pid>-<token>.owner``:

- ``register_job()`` (trainer, right before forking the producer) creates it with an exclusive ``flock`` held
  by an inherited file descriptor. The lock lives exactly as long as any process of the job lives (trainer,
  producer, Energon workers forked by the producer); the kernel drops it when the last one dies, however it
  dies. No pid guessing: a reused pid cannot make a dead job look alive, or the reverse.
- ``register_process()`` (producer, and through an at-fork hook every process it forks) appends its pid: these
  are the pids in the names of the segments the job creates.
- ``reclaim_stale()`` (trainer, at producer start) takes the lock of every owner file it can get; a lock it
  gets belongs to a dead job, whose ``torch_<pid>_*`` segments are unlinked with the owner file. A live job's
  lock cannot be taken, so a concurrently running job keeps its segments. Segments of a recorded pid that is
  alive again (pid reuse) are left alone, as are owner files written in another pid namespace.
- ``JobRecord.release()`` (normal close / exit) removes the owner file.
- ``register_workers()`` (trainer, before its read pool forks ``data.num_workers`` read processes without a
  prefetch producer): the same owner file for the trainer's own forked children, recorded by an at-fork hook; a
  worker's ``torch_<pid>_*`` segments (its tensors on their way to the trainer) are reclaimed like a producer's.

Tensors still travel by name (no round trip to the producer); the bookkeeping is one small file per producer and a
scan of /dev/shm per start.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import glob
import json
import logging
import os
import secrets
import time
from typing import Any

__all__ = ["JobRecord", "SHM_DIR", "adopt", "owner_files", "reclaim_stale", "register_job", "register_process",
           "register_workers", "segments_of"]

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"           # where torch's file_system strategy creates its segments (shm_open)
_PREFIX = "bagel-prefetch-"
_SUFFIX = ".owner"
_PARTIAL_GRACE_S = 60.0        # an owner file still being written (no header yet) is left alone this long

_current: "JobRecord | None" = None   # this process's job (inherited by fork: the producer writes to it)
_at_fork_installed = False


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def segments_of(pid: int, shm_dir: str = SHM_DIR) -> list[str]:
    """Paths of torch file_system segments created by process ``pid`` (``torch_<pid>_*``)."""
    return sorted(glob.glob(os.path.join(shm_dir, f"torch_{int(pid)}_*")))


def owner_files(shm_dir: str = SHM_DIR) -> list[str]:
    """Owner files of prefetch jobs (live or dead) in ``shm_dir``."""
    return sorted(glob.glob(os.path.join(shm_dir, f"{_PREFIX}*{_SUFFIX}")))


class JobRecord:
    """One producer's owner file, locked for as long as any process of the job holds the inherited fd."""

    def __init__(self, path: str, fd: int, owner_pid: int | None = None) -> None:
        self.path = path
        self.fd = fd
        self._owner_pid = os.getpid() if owner_pid is None else owner_pid

    def release(self) -> None:
        """Remove the owner file (normal close / exit of the trainer that created it; idempotent)."""
        global _current
        if self.fd < 0 or os.getpid() != self._owner_pid:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = -1
        atexit.unregister(self.release)
        if _current is self:
            _current = None


def register_job(shm_dir: str = SHM_DIR) -> JobRecord:
    """Trainer, right before forking a producer: create and lock this producer's owner file."""
    global _current
    token = secrets.token_hex(4)
    final = os.path.join(shm_dir, f"{_PREFIX}{os.getpid()}-{token}{_SUFFIX}")
    partial = final + ".partial"
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)  # O_CLOEXEC by default
        fcntl.flock(fd, fcntl.LOCK_EX)
        header = {"trainer": os.getpid(), "pidns": _pid_namespace(), "created": time.time()}
        os.write(fd, (json.dumps(header) + "\n").encode())
        os.rename(partial, final)  # same inode (and lock); reclaimers only reclaim complete owner files
    except OSError as exc:  # no /dev/shm, read-only, ...: run unprotected rather than not at all
        logger.warning("shm: could not register the prefetch job in %s (%s); segments of this job will not be "
                       "reclaimed if it is killed", shm_dir, exc)
        _current = None
        return JobRecord("", -1)
    record = JobRecord(final, fd)
    atexit.register(record.release)  # runs after the producer's own atexit shutdown (registered later)
    _current = record
    return record


def register_workers(shm_dir: str = SHM_DIR) -> JobRecord:
    """Trainer, before it forks read workers itself: this process's owner file (the current one when this
    process already holds one) and an at-fork hook that records every process it forks from now on, so that the
    workers' segments are reclaimed by the next start if the job is killed. Idempotent per process."""
    global _at_fork_installed
    record = _current
    if record is None or record.fd < 0 or record._owner_pid != os.getpid():
        record = register_job(shm_dir)
    if not _at_fork_installed:
        os.register_at_fork(after_in_child=register_process)  # inherited by the children: grandchildren too
        _at_fork_installed = True
    return record


def adopt(path: str, fd: int, trainer_pid: int) -> None:
    """A producer that did not fork from the trainer (forkserver start): hold the job's owner file through
    ``fd`` (passed to it, same open file and lock) so that ``register_process`` records it there."""
    global _current
    _current = JobRecord(path, fd, owner_pid=trainer_pid) if fd >= 0 else None


def register_process() -> None:
    """Producer (and, via an at-fork hook, every process it forks): record this pid in the job's owner file."""
    global _at_fork_installed
    if _current is None or _current.fd < 0:
        return
    os.write(_current.fd, f"pid {os.getpid()}\n".encode())  # O_APPEND: one atomic line per process
    if not _at_fork_installed and os.getpid() != _current._owner_pid:  # producer side only, never the trainer
        os.register_at_fork(after_in_child=register_process)
        _at_fork_installed = True


def _read_owner(fd: int) -> tuple[dict[str, Any] | None, list[int]]:
    lines = os.pread(fd, os.fstat(fd).st_size, 0).decode("utf-8").splitlines()
    try:
        header = json.loads(lines[0]) if lines else None
    except ValueError:
        header = None
    pids = [int(x.split()[1]) for x in lines[1:] if x.startswith("pid ") and x.split()[1].isdigit()]
    return header, pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reclaim_one(path: str, pidns: str, shm_dir: str) -> tuple[int, int]:
    """Reclaim one owner file if its job is dead; returns (segments, bytes) unlinked."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return 0, 0
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0, 0  # a live job (or another rank reclaiming it right now)
        if not os.path.exists(path):
            return 0, 0  # reclaimed by someone else between open and lock
        header, pids = _read_owner(fd)
        if header is None:
            if time.time() - os.fstat(fd).st_mtime < _PARTIAL_GRACE_S:
                return 0, 0  # being created (open -> lock window)
            os.unlink(path)
            return 0, 0
        if header.get("pidns", "") != pidns:
            logger.debug("shm: %s was written in another pid namespace; left alone", path)
            return 0, 0
        count = size = 0
        for pid in sorted(set(pids)):
            if _alive(pid):  # the pid was reused by a live process: its torch_<pid>_* may not be ours
                logger.warning("shm: dead job %s recorded pid %d, which is alive again; its segments are left",
                               path, pid)
                continue
            for seg in segments_of(pid, shm_dir):
                with contextlib.suppress(FileNotFoundError):
                    nbytes = os.stat(seg).st_size
                    os.unlink(seg)
                    count, size = count + 1, size + nbytes
        os.unlink(path)
        if count:
            logger.info("shm: reclaimed %d shared-memory segments (%.1f MB) in %s left by an earlier job on this "
                        "machine that ended without cleaning up (trainer pid %s); nothing of a running job is "
                        "touched", count, size / 2**20, shm_dir, header.get("trainer"))
            logger.debug("shm: the earlier job's processes: %s", sorted(set(pids)))
        return count, size
    finally:
        os.close(fd)


def reclaim_stale(shm_dir: str = SHM_DIR) -> tuple[int, int]:
    """Unlink the segments of prefetch jobs that died without cleaning up (owner dead); returns (segments, bytes).
    Never raises: a failure to reclaim is logged and the job goes on."""
    segments = size = 0
    pidns = _pid_namespace()
    for path in owner_files(shm_dir) + glob.glob(os.path.join(shm_dir, f"{_PREFIX}*{_SUFFIX}.partial")):
        try:
            n, b = _reclaim_one(path, pidns, shm_dir)
        except OSError as exc:
            logger.warning("shm: could not reclaim %s: %s", path, exc)
            continue
        segments, size = segments + n, size + b
    return segments, size
