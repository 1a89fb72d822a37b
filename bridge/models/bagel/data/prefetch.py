"""Pack ahead in a background process, keeping exact resume and the trainer's RNG untouched.

``PrefetchedPipeline`` forks one producer process that owns the (already built, possibly restored) readers
and the RNG-isolated packer, and keeps up to ``depth`` packed batches ready in a queue. Each batch travels
with a snapshot of the pipeline state taken *right after* it was produced, so the trainer side always knows
the state that yields the next batch it will receive: batches produced but not yet consumed are simply
produced again after a restore, never lost or repeated.

A process (not a thread) because the packer must draw from process-global ``random`` / NumPy RNG like the
official code: in a thread that would race with the model's RNG use, in a process the globals are private.
The producer is forked lazily on the first ``next()``, so Energon worker processes (``num_workers > 0``)
start inside it. Errors in the producer reach the trainer's ``next()`` as the original exception, with the
producer's traceback attached; ``close()`` stops and reaps the producer (also at interpreter exit, and the
producer exits by itself when the trainer process dies).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import multiprocessing as mp
import os
import queue
import signal
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.multiprocessing as torch_mp

from . import shm
from .packing.memory import use_shared_memory

__all__ = ["PrefetchError", "PrefetchedPipeline", "RemoteTraceback"]

logger = logging.getLogger(__name__)

_POLL_S = 0.5
_JOIN_S = 10.0


class RemoteTraceback(Exception):
    """Carries the producer process's formatted traceback (set as ``__cause__`` of the re-raised error)."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f"\n\nTraceback in the prefetch producer process:\n{self.tb}"


class PrefetchError(RuntimeError):
    """The producer process failed in a way that could not be forwarded as its own exception."""


_INLINE_BYTES = 8 << 10


class _Inline:
    """A tiny tensor sent inline (pickled bytes) instead of as a shared-memory segment of its own."""

    __slots__ = ("array",)

    def __init__(self, array: Any) -> None:
        self.array = array


def _to_wire(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.nbytes < _INLINE_BYTES and not obj.is_shared() and obj.dtype not in (torch.bfloat16,):
            return _Inline(obj.numpy())
        return obj
    if isinstance(obj, dict):
        return {k: _to_wire(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_to_wire(v) for v in obj)
    return obj


def _from_wire(obj: Any) -> Any:
    if isinstance(obj, _Inline):
        return torch.from_numpy(obj.array)
    if isinstance(obj, dict):
        return {k: _from_wire(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_from_wire(v) for v in obj)
    return obj


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies (best effort)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _produce(batches: Iterator[Any], snapshot: Callable[[], dict[str, Any]], on_start: Callable[[], None] | None,
             out: Any, stop: Any, release: Any, parent_pid: int) -> None:
    """Producer loop (runs in the forked process): batch, then the state after it, until stopped.

    Tensors travel as shared-memory handles that the trainer can only open while this process lives, so
    after stopping (or failing) it waits for ``release`` — set once the trainer has drained the queue.
    """
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the trainer, which closes us
    # As in torch DataLoader workers: the parent's OpenMP pool does not survive fork (using it deadlocks).
    torch.set_num_threads(1)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Big batch tensors are born in shared memory, so the hand-over copies nothing. Named shared memory (torch's
    # "file_system" strategy, cleaned up by torch_shm_manager) lets the trainer map a tensor without a round trip
    # to this busy, GIL-holding process's fd-sharing thread: next() drops from ~20 ms to ~3 ms.
    torch_mp.set_sharing_strategy("file_system")
    use_shared_memory(True)
    shm.register_process()  # [shm hook] segments named torch_<this pid>_* belong to the job
    out.cancel_join_thread()  # never block at exit on data the trainer will not read
    try:
        if on_start is not None:
            on_start()
        while not stop.is_set():
            item = ("batch", _to_wire(next(batches)), _to_wire(snapshot()))
            while not stop.is_set():
                if os.getppid() != parent_pid:
                    return
                try:
                    out.put(item, timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
    except BaseException as exc:  # forwarded to the trainer's next()
        tb = traceback.format_exc()
        try:
            out.put(("error", exc, tb))
        except Exception:  # the exception itself does not pickle
            out.put(("error", PrefetchError(f"{type(exc).__name__}: {exc}"), tb))
    while not release.wait(_POLL_S):
        if os.getppid() != parent_pid:
            return


def _shutdown(proc: Any, stop: Any, release: Any, out: Any, shm_job: Any = None) -> None:
    stop.set()
    if proc is None:
        return
    try:
        while proc.is_alive():  # drain while the producer lives: frees its shared memory, unblocks put()
            out.get(timeout=0.05)
    except (queue.Empty, OSError, ValueError, EOFError):
        pass
    release.set()
    proc.join(_JOIN_S)
    if proc.is_alive():
        logger.warning("prefetch producer (pid %d) did not stop in %.0fs; terminating it", proc.pid, _JOIN_S)
        proc.terminate()
        proc.join(_JOIN_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if shm_job is not None:
        shm_job.release()  # [shm hook] producer reaped: nothing of the job left to reclaim


class PrefetchedPipeline:
    """Iterator over packed batches produced ``depth`` ahead in a forked process.

    ``batches`` is the RNG-isolated packer (``BagelRNGIterator``) and ``snapshot()`` returns the pipeline
    state (``{"packer": …, "loaders": […]}``) of the objects as they are *in the calling process*; both are
    used inside the producer after the fork. ``initial_state`` is the state before the first batch and
    ``on_start`` (e.g. applying a restored state) runs in the producer before it produces anything.
    """

    def __init__(self, batches: Iterator[Any], snapshot: Callable[[], dict[str, Any]], *, depth: int,
                 initial_state: dict[str, Any], on_start: Callable[[], None] | None = None) -> None:
        if depth < 1:
            raise ValueError(f"PrefetchedPipeline: depth must be >= 1, got {depth}")
        self._batches = batches
        self._snapshot = snapshot
        self._on_start = on_start
        self.depth = depth
        self.state = initial_state  # state that produces the next batch the trainer will receive
        self._ctx = mp.get_context("fork")
        self._proc: Any = None
        self._out: Any = None
        self._stop = self._ctx.Event()
        self._release = self._ctx.Event()
        self._failed: BaseException | None = None
        self._finalizer: Any = None

    def _start(self) -> None:
        shm.reclaim_stale()  # [shm hook] segments of killed jobs (owner dead) go before ours are made
        shm_job = shm.register_job()  # [shm hook] locked owner file, inherited by the producer
        self._out = torch_mp.get_context("fork").Queue(maxsize=self.depth)
        self._proc = self._ctx.Process(
            target=_produce,
            args=(self._batches, self._snapshot, self._on_start, self._out, self._stop, self._release, os.getpid()),
            name="bagel-prefetch", daemon=False)  # not a daemon: Energon workers are its children
        self._proc.start()
        self._finalizer = weakref.finalize(self, _shutdown, self._proc, self._stop, self._release, self._out,
                                           shm_job)
        atexit.register(self._finalizer)
        logger.info("prefetch producer started (pid %d, depth %d)", self._proc.pid, self.depth)

    def __iter__(self) -> "PrefetchedPipeline":
        return self

    def __next__(self) -> Any:
        if self._failed is not None:
            raise RuntimeError("the prefetch producer failed earlier; rebuild the loader") from self._failed
        if self._stop.is_set():
            raise RuntimeError("PrefetchedPipeline: next() after close()")
        if self._proc is None:
            self._start()
        while True:
            try:
                kind, payload, extra = self._out.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._proc.is_alive():
                    self._failed = PrefetchError(
                        f"the prefetch producer (pid {self._proc.pid}) died with exit code {self._proc.exitcode} "
                        "without reporting an error (killed? out of memory?)")
                    raise self._failed
        if kind == "error":
            self._failed = payload
            self.close()
            raise payload from RemoteTraceback(extra)
        self.state = _from_wire(extra)
        return _from_wire(payload)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def close(self) -> None:
        """Stop the producer and reap it (idempotent)."""
        self._stop.set()
        if self._finalizer is not None:
            self._finalizer()
            atexit.unregister(self._finalizer)

    @staticmethod
    def live_children(names: Sequence[str] = ("bagel-prefetch",)) -> list[Any]:
        """Live child processes started by this module (for leak checks)."""
        return [p for p in mp.active_children() if p.name in names]
