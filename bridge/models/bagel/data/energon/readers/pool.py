"""One pool of read worker processes per rank, serving every group reader of the rank.

A reader whose order is a pure function of its plan (the elastic order: each read's random choices are seeded by its
selection position and epoch) may read ahead: it submits its next planned reads to the pool and takes the results in
plan order, so the stream does not depend on how many workers there are or which one read what. One pool serves all
of a rank's group readers (not ``num_workers`` processes per group, each holding its own copy of the process's memory).

The pool is the standard library's ``ProcessPoolExecutor`` with forked workers, started on the first read (so with
``data.prefetch`` the workers are children of the prefetch producer, as Energon's were). A worker holds the rank's
registered readers as they were when it was forked (their datasets open, their cooking contexts) and reads an item
with ``reader.read_item(item)``; tensors travel back through torch's shared-memory reductions. Workers ignore Ctrl-C
(the trainer handles it), run torch single-threaded (as torch's DataLoader workers do) and exit when the process
that started them is gone.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import warnings
import weakref
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

__all__ = ["ReadPool"]

_worker_readers: list[Any] = []  # the registered readers, in a worker process (set by _init_worker)
_forking: list[Any] = []  # the readers of the pool whose workers are being forked right now (parent, one call)
_PARENT_POLL_S = 1.0


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_PARENT_POLL_S)
    os._exit(0)  # the process that started this pool is gone: nobody reads our results


def _init_worker(parent: int) -> None:
    """Worker start-up: the readers are this forked process's copies of the ones being forked (never pickled; the
    parent does not pass them as arguments, which the executor would keep alive for as long as its workers run)."""
    import torch

    from ...watchdog.stacks import set_process_role

    global _worker_readers
    _worker_readers = list(_forking)
    set_process_role("read worker")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)  # the parent's OpenMP pool does not survive a fork (as in torch's DataLoader workers)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    threading.Thread(target=_watch_parent, args=(parent,), name="bagel-read-parent", daemon=True).start()


def _read(reader_id: int, item: Any) -> Any:
    """Run in a worker: the cooked sample of ``item`` by registered reader ``reader_id``."""
    return _worker_readers[reader_id].read_item(item)


class ReadPool:
    """``num_workers`` forked read processes for every reader registered before the first read (``register``),
    started lazily on the first ``submit``, shut down when the last registered reader is released or on ``shutdown``.
    """

    def __init__(self, num_workers: int) -> None:
        self.num_workers = int(num_workers)
        self._readers: list[weakref.ref] = []  # weak: a reader's finalizer releases it (this pool must not keep it)
        self._released: set[int] = set()
        self._executor: ProcessPoolExecutor | None = None
        self._owner = os.getpid()

    def register(self, reader: Any) -> int:
        """Add ``reader`` (it needs ``read_item(item)``); returns its id for ``submit``. RuntimeError once the workers
        are started (they would not know it)."""
        if self._executor is not None:
            raise RuntimeError("ReadPool: a reader was registered after the read workers started; build every group "
                               "reader of the rank before the first read")
        self._readers.append(weakref.ref(reader))
        return len(self._readers) - 1

    def submit(self, reader_id: int, item: Any) -> Future:
        """A ``Future`` of ``self._readers[reader_id].read_item(item)`` computed in a worker."""
        if self._executor is None or self._owner != os.getpid():
            self._owner = os.getpid()
            self._executor = ProcessPoolExecutor(self.num_workers, mp_context=mp.get_context("fork"),
                                                 initializer=_init_worker, initargs=(os.getpid(),))
            # With "fork" every worker is forked inside this first submit (the executor does not spawn later ones),
            # so the readers are handed over through a module global for the duration of the call only.
            _forking[:] = [ref() for ref in self._readers]
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="This process .* is multi-threaded",
                                            category=DeprecationWarning)
                    return self._executor.submit(_read, reader_id, item)
            finally:
                _forking.clear()
        return self._executor.submit(_read, reader_id, item)

    def pids(self) -> list[int]:
        """The worker processes' pids (empty before the first read)."""
        return sorted(getattr(self._executor, "_processes", None) or {})

    def release(self, reader_id: int) -> None:
        """Reader ``reader_id`` is done (closed); the last one shuts the workers down."""
        self._released.add(reader_id)
        if len(self._released) >= len(self._readers):
            self.shutdown()

    def shutdown(self, wait: bool = True) -> None:
        """Stop the workers (pending reads are cancelled); ``wait=False`` after a data time-out, whose stuck worker
        may never return (it was SIGKILLed). Idempotent."""
        executor, self._executor = self._executor, None
        if executor is not None and self._owner == os.getpid():
            executor.shutdown(wait=wait, cancel_futures=True)
