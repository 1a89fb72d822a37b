"""``PrefetchStage``: pack ahead in a background process, keeping exact resume and the trainer's RNG untouched.

A stage of the chain like the others (``source`` in, batches out). It forks one producer process that owns
its source (the RNG-isolated packer and, through it, the readers) and keeps up to ``depth`` packed batches
ready in a queue. Each batch travels with a snapshot of the source's state and counters taken *right
after* it was produced, so this stage's state and ``stats()`` always describe the trainer's side: the state
yields the next batch the trainer will receive (batches produced but not consumed are simply produced again
after a restore, never lost or repeated), and the counters match the batches handed out.

A process (not a thread) because the packer must draw from process-global ``random`` / NumPy RNG like the
official code: in a thread that would race with the model's RNG use, in a process the globals are private.
The producer is started lazily on the first ``next()``, so Energon worker processes (``num_workers > 0``)
start inside it. Start methods (``start_method``): ``"fork"`` (default) hands the live source to a forked
child, which must run torch single-threaded (the parent's OpenMP pool does not survive a fork: using it
deadlocks); ``"forkserver"`` starts the producer from a clean server process and rebuilds the source there
from ``rebuild`` (a picklable recipe, e.g. the builder with the config and tokenizer), so its torch may use
threads (``threads``, default: this process's CPUs over ``LOCAL_WORLD_SIZE``) at the price of a slower start
(imports, tokenizer, readers: seconds, once per start). Errors in the producer reach the trainer's ``next()``
as the original exception, with the producer's traceback attached; ``close()`` stops and reaps the producer
(also at interpreter exit, and the producer exits by itself when the trainer process dies).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import ctypes
import gc
import itertools
import logging
import multiprocessing as mp
import multiprocessing.reduction
import os
import pickle
import queue
import signal
import time
import traceback
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.multiprocessing as torch_mp

from . import shm
from .. import watchdog
from ..packing import memory
from ..state import Stage, StateError, fingerprint_of, load_nested, save_nested, tag_of

__all__ = ["PRODUCER_NAME", "PrefetchError", "PrefetchStage", "RemoteTraceback", "live_producers"]

logger = logging.getLogger(__name__)

PRODUCER_NAME = "bagel-prefetch"
#: Modules the forkserver imports once, so each producer it starts has them already.
_FORKSERVER_PRELOAD = ["torch", "numpy", "PIL.Image", "megatron.energon", "bridge.models.bagel.data.build"]
_POLL_S = 0.5
_JOIN_S = 10.0
_INLINE_BYTES = 8 << 10  # a tensor below this is sent inline (``_Inline``)
#: Offset alignment (bytes) of the tensors gathered into one shared block (``_gather_shared``).
_GATHER_ALIGN = 64


class RemoteTraceback(Exception):
    """Carries the producer process's formatted traceback (set as ``__cause__`` of the re-raised error)."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f"\n\nTraceback in the prefetch producer process:\n{self.tb}"


class PrefetchError(RuntimeError):
    """The producer process failed in a way that could not be forwarded as its own exception."""


class _Inline(NamedTuple):
    """A tiny tensor sent inline (pickled bytes) instead of as a shared-memory segment of its own."""

    array: Any


def _map(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """``obj`` with ``fn`` applied to every value that is not a dict, list or tuple (containers rebuilt, in order)."""
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_map(v, fn) for v in obj)
    return fn(obj)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj`` (dicts, lists, tuples), in order, without rebuilding the containers."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict) or type(obj) in (list, tuple):
        for v in obj.values() if isinstance(obj, dict) else obj:
            yield from _tensors(v)


def _gather_shared(obj: Any) -> dict[int, torch.Tensor]:
    """Copy the batch's mid-size tensors (``_INLINE_BYTES`` or more, not yet in shared memory: position ids, token
    indexes, timesteps, ... seven of 20-300 KB each at default budgets) into one pooled shared-memory block
    (``memory.empty``); returns ``id(tensor) -> its copy`` (same dtype, shape and values, contiguous, 64-byte
    aligned), for ``_to_wire`` to send instead.

    Sent as they are, torch moves each one into a segment of its own, and every new segment is a round trip to
    torch's shared-memory manager: ~33 ms per batch for the seven on the 2-core development VM, in the producer,
    against ~0.3 ms for the copies; the block itself is reused once the trainer drops the batch. Only tensors
    that own their whole storage are gathered (aliasing between tensors stays as it was); fewer than two: none.
    """
    fit = [t for t in _tensors(obj) if t.nbytes >= _INLINE_BYTES and t.device.type == "cpu" and not t.is_shared()
           and not t.requires_grad and t.is_contiguous() and t.storage_offset() == 0
           and t.untyped_storage().nbytes() == t.nbytes]
    owners = Counter(t.untyped_storage().data_ptr() for t in fit)  # storage address -> tensors on it
    found = {id(t): t for t in fit if owners[t.untyped_storage().data_ptr()] == 1}
    if len(found) < 2:
        return {}
    offsets = [0, *itertools.accumulate(-(-t.nbytes // _GATHER_ALIGN) * _GATHER_ALIGN for t in found.values())]
    block = memory.empty((offsets[-1],), torch.uint8)
    return {key: block[off : off + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
            for (key, t), off in zip(found.items(), offsets)}


def _to_wire(obj: Any, gathered: dict[int, torch.Tensor] | None = None) -> Any:
    """``obj`` as sent to the trainer: tiny tensors inline, the ``gathered`` ones (``_gather_shared``) as their
    shared copies, the rest as they are (torch shares them)."""
    def leaf(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        if gathered and id(v) in gathered:
            return gathered[id(v)]
        inline = v.nbytes < _INLINE_BYTES and not v.is_shared() and v.dtype != torch.bfloat16
        return _Inline(v.numpy()) if inline else v

    return _map(obj, leaf)


def _from_wire(obj: Any) -> Any:
    return _map(obj, lambda v: torch.from_numpy(v.array) if isinstance(v, _Inline) else v)


class _PassedFd:
    """A file descriptor handed to the producer: inherited as is by a fork, duplicated into a forkserver child
    while its arguments are pickled (``multiprocessing.reduction.DupFd``)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        return (_PassedFd, (-1,)) if self.fd < 0 else (_PassedFd._rebuild, (multiprocessing.reduction.DupFd(self.fd),))

    @staticmethod
    def _rebuild(dup: Any) -> "_PassedFd":
        return _PassedFd(dup.detach())


def _default_threads() -> int:
    """This process's CPUs shared among the node's ranks (``LOCAL_WORLD_SIZE``, as torchrun sets it)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)))


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies (best effort)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _produce(*args: Any) -> None:
    """Producer process entry: the loop, then its pooled shared memory released (see ``memory.release_shared``)."""
    try:
        _produce_loop(*args)
    finally:
        memory.release_shared()


def _produce_loop(source: Any, rebuild: bool, restore: dict[str, Any] | None, out: Any, stop: Any, release: Any,
                  shm_fd: _PassedFd, shm_path: str, trainer_pid: int, threads: int) -> None:
    """Producer loop (runs in the child process): batch, then the source's state and stats after it.

    ``source`` is the source stage itself (fork) or, with ``rebuild``, a recipe called here to build it. ``restore``
    (a tagged source state) is applied first, here, so the trainer process never opens the datasets. Tensors
    travel as shared-memory handles that the trainer can only open while this process lives, so after stopping
    (or failing) it waits for ``release`` — set once the trainer drained the queue.
    """
    _die_with_parent()
    parent = mp.parent_process()  # the trainer (also for a forkserver child, whose OS parent is the server)
    # Everything inherited from the trainer stays as it is here: garbage the trainer had not collected yet (a
    # dropped loader with Energon workers, say) would otherwise be collected in this process and its finalizers
    # would act on the trainer's children ("can only test a child process"). Also spares copy-on-write pages.
    gc.freeze()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the trainer, which closes us
    # As in torch DataLoader workers: the parent's OpenMP pool does not survive fork (using it deadlocks). A
    # forkserver child starts clean and may use threads.
    torch.set_num_threads(threads if rebuild else 1)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Big batch tensors are born in shared memory, so the hand-over copies nothing. Named shared memory (torch's
    # "file_system" strategy, cleaned up by torch_shm_manager) lets the trainer map a tensor without a round trip
    # to this busy, GIL-holding process's fd-sharing thread: next() drops from ~20 ms to ~3 ms.
    torch_mp.set_sharing_strategy("file_system")
    memory.use_shared_memory(True)
    if rebuild:
        shm.adopt(shm_path, shm_fd.fd, trainer_pid)
    shm.register_process()  # segments named torch_<this pid>_* belong to the job
    out.cancel_join_thread()  # never block at exit on data the trainer will not read
    upstream = None
    try:
        upstream = source() if rebuild else source
        if restore is not None:
            load_nested(upstream, restore, "PrefetchStage.source")
        while not stop.is_set():
            batch = watchdog.batch_call(next, upstream)  # the producer's reads: one hand-over per batch
            stats = upstream.stats() if callable(getattr(upstream, "stats", None)) else {}
            item = ("batch", _to_wire(batch, _gather_shared(batch)), _to_wire(save_nested(upstream)), stats)
            while not stop.is_set():
                if not parent.is_alive():
                    return
                with contextlib.suppress(queue.Full):
                    out.put(item, timeout=_POLL_S)
                    break
    except BaseException as exc:  # forwarded to the trainer's next()
        tb = traceback.format_exc()
        try:
            out.put(("error", exc, tb, None))
        except Exception:  # the exception itself does not pickle
            out.put(("error", PrefetchError(f"{type(exc).__name__}: {exc}"), tb, None))
    finally:
        # The upstream's own close: after a data time-out it kills the stuck read workers of this process (the
        # interpreter's exit would otherwise wait on them and the trainer's close() would have to terminate us).
        if upstream is not None:
            with contextlib.suppress(Exception):
                upstream.close()
    while not release.wait(_POLL_S):
        if not parent.is_alive():
            return


def _shutdown(proc: Any, stop: Any, release: Any, out: Any, shm_job: Any = None) -> None:
    stop.set()
    if proc is None:
        return
    with contextlib.suppress(queue.Empty, OSError, ValueError, EOFError):
        while proc.is_alive():  # drain while the producer lives: frees its shared memory, unblocks put()
            out.get(timeout=0.05)
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
        shm_job.release()  # producer reaped: nothing of the job left to reclaim


class PrefetchStage(Stage):
    """Iterator over packed batches that ``source`` produces ``depth`` ahead in a producer process (module docstring).

    The stage does not change the stream, so its saved form *is* its source's (``state_tag()``, ``state_dict()`` and
    ``fingerprint()`` answer with the source's) and ``data.prefetch`` may change between a save and a restore.
    Restore only before the first ``next()``; the restored state is applied inside the producer.
    """

    _savable_fields = ("source",)
    watchdog_scope = False  # waits with its own deadline; its producer batches its own reads (watchdog.batch_call)

    def __init__(self, upstream: Iterator[Any], *, depth: int, start_method: str = "fork",
                 rebuild: Callable[[], Iterator[Any]] | None = None, threads: int | None = None,
                 timeout_s: float = 0.0) -> None:
        if start_method == "forkserver" and rebuild is None:
            raise ValueError("PrefetchStage: start_method 'forkserver' needs rebuild (a picklable callable that "
                             "builds the source in the producer)")
        self.source = upstream
        self.depth = int(depth)
        self.start_method = start_method
        self.rebuild = rebuild
        self.threads = _default_threads() if threads is None else max(1, int(threads))
        # The producer's readers time out by themselves (data.timeout_s); this later deadline catches a producer
        # stuck anywhere else, so the trainer never waits forever either (0 = never).
        self.timeout_s = float(timeout_s or 0)
        self._deadline_s = self.timeout_s + max(30.0, 0.5 * self.timeout_s) if self.timeout_s > 0 else 0.0
        self._snapshot: dict[str, Any] | None = None  # tagged source state for the trainer's next batch
        self._restore: dict[str, Any] | None = None
        self._stats: dict[str, Any] | None = None
        self._ctx = torch_mp.get_context(start_method)
        self._proc: Any = None
        self._out: Any = None
        self._stop = self._ctx.Event()
        self._release = self._ctx.Event()
        self._failed: BaseException | None = None
        self._finalizer: Any = None

    # -- state: the snapshot, not the (idle) source object of this process ---------------------------------
    def state_tag(self) -> str:
        """The source's tag: a state saved with prefetch restores without it, and back."""
        return tag_of(self.source)

    def fingerprint(self) -> dict[str, Any]:
        """The source's fingerprint (this stage does not change the stream)."""
        return fingerprint_of(self.source)

    def state_dict(self) -> dict[str, Any]:
        """The source's state as of the last batch handed to the trainer (its initial state before the first)."""
        if self._snapshot is None:  # nothing produced yet: the source here is still at its initial state
            self._snapshot = save_nested(self.source)
        return copy.deepcopy(self._snapshot["state"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep the source's state for the producer, which applies it before producing (restore before the first
        ``next()``; ``StateError`` once the producer runs)."""
        if self._proc is not None:
            raise StateError("PrefetchStage: the producer is already running; restore into a freshly built "
                             "loader before the first next()")
        self._restore = self._snapshot = {"stage": tag_of(self.source), "state": copy.deepcopy(state)}
        self._stats = None

    def resize_state(self, olds: list[dict[str, Any]], ctx: Any, **kw: Any) -> dict[str, Any]:
        """The source's resize (this stage's saved form is the source's)."""
        return self.source.resize_state(olds, ctx, **kw)

    def stats(self) -> dict[str, Any]:
        """The source's counters as of the last batch handed to the trainer; before the first batch, the source's
        initial counters (after a restore, ``{}``: the restored state's are known only once the first batch arrives).
        """
        if self._stats is not None:
            return copy.deepcopy(self._stats)
        return {} if self._restore is not None else super().stats()

    # -- the producer ------------------------------------------------------------------------------------
    def _start(self) -> None:
        if self._snapshot is None:
            self._snapshot = save_nested(self.source)
        shm.reclaim_stale()  # segments of killed jobs (owner dead) go before ours are made
        if self.timeout_s > 0:
            watchdog.enable_agents()  # the producer and its workers can say what they wait on
        shm_job = shm.register_job()  # locked owner file, inherited by the producer
        clean = self.start_method != "fork"
        if clean:
            self._ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)  # no effect once the server runs
        self._out = self._ctx.Queue(maxsize=self.depth)
        self._proc = self._ctx.Process(
            target=_produce, args=(self.rebuild if clean else self.source, clean, self._restore, self._out,
                                   self._stop, self._release, _PassedFd(shm_job.fd), shm_job.path, os.getpid(),
                                   self.threads),
            name=PRODUCER_NAME, daemon=False)  # not a daemon: Energon workers are its children
        try:
            self._proc.start()
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            if not clean:
                raise
            self._stop.set()
            shm_job.release()
            self._proc = None
            self._failed = PrefetchError(
                f"data.prefetch_start 'forkserver' rebuilds the pipeline in a clean process, so its recipe (the "
                f"config and the tokenizer) must be picklable: {type(exc).__name__}: {exc}. Use prefetch_start "
                "'fork' for this tokenizer.")
            raise self._failed from exc
        self._finalizer = weakref.finalize(self, _shutdown, self._proc, self._stop, self._release, self._out, shm_job)
        atexit.register(self._finalizer)
        logger.info("prefetch producer started (pid %d, depth %d, %s%s)", self._proc.pid, self.depth,
                    self.start_method, f", {self.threads} torch threads" if clean else "")

    def __next__(self) -> Any:
        if self._failed is not None:
            raise RuntimeError("the prefetch producer failed earlier; rebuild the loader") from self._failed
        if self._stop.is_set():
            raise RuntimeError("PrefetchStage: next() after close()")
        if self._proc is None:
            self._start()
        t0 = time.monotonic()
        while True:
            try:
                kind, payload, extra, stats = self._out.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if self._deadline_s and time.monotonic() - t0 >= self._deadline_s:
                    self._failed = self._time_out(time.monotonic() - t0)
                    raise self._failed
                if not self._proc.is_alive():
                    self._failed = PrefetchError(
                        f"the prefetch producer (pid {self._proc.pid}) died with exit code {self._proc.exitcode} "
                        "without reporting an error (killed? out of memory?)")
                    raise self._failed
        if kind == "error":
            self._failed = payload
            self.close()
            raise payload from RemoteTraceback(extra)
        self._snapshot = _from_wire(extra)
        self._stats = stats
        return _from_wire(payload)

    def _time_out(self, waited: float) -> watchdog.DataTimeoutError:
        reports = watchdog.collect_reports()
        for rep in reports:
            logger.debug("data watchdog: stack of %s:\n%s", rep.get("role"), rep.get("stack"))
        s = watchdog.summarize(reports, None, [])
        where = (f"group {s['group']!r}, dataset {s['dataset']!r}, shard file {s['shard']}, in {s['process']}"
                 if s["shard"] else f"{s['process']}" if reports else f"the producer (pid {self._proc.pid})")
        return watchdog.DataTimeoutError(
            f"data time-out: the prefetch producer handed no batch for {waited:.0f}s (data.timeout_s="
            f"{self.timeout_s:g} plus a margin for its own readers' time-out) waiting on {where}\nSee the debug log "
            "for its stack. Check the storage of the datasets, or raise data.timeout_s",
            brief=f"data time-out in the prefetch producer, waiting on {where}")

    def close(self) -> None:
        """Stop the producer and reap it, then close the source in this process (idempotent)."""
        self._stop.set()
        if self._finalizer is not None:
            self._finalizer()
            atexit.unregister(self._finalizer)
        super().close()


def live_producers() -> list[Any]:
    """Live prefetch producer processes started by this process (for leak checks)."""
    return [p for p in mp.active_children() if p.name == PRODUCER_NAME]
