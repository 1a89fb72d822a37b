"""Worker-process lifecycle: stop a loader's worker processes now, not whenever garbage collection gets to them.

torch's ``DataLoader`` with ``persistent_workers=True`` (what Energon's ``SavableDataLoader`` uses whenever
``num_workers > 0``) keeps its multi-process iterator on the loader (``DataLoader._iterator``) after the epoch
generator is closed; the workers are stopped only by that iterator's ``__del__``. When the loader is freed by
the *cyclic* garbage collector (a reader holding it sits in a reference cycle), the collector first runs the
weakref finalizers of the iterator's index queues, which stop their feeder threads, and only then the
iterator's ``__del__``: the ``None`` it sends each worker is never written, and torch waits its 5 s
``MP_STATUS_CHECK_INTERVAL`` per worker before terminating them (measured: 40-60 s stalls inside an unrelated
later call when a few 2-worker readers were collected together). Shutting the iterator down explicitly, while
its queues are alive, takes milliseconds.
"""

from __future__ import annotations

from typing import Any

__all__ = ["shutdown_workers"]


def shutdown_workers(obj: Any) -> None:
    """Stop the worker processes of ``obj`` now: a torch ``DataLoader`` (its persistent iterator, if started)
    or a torch multi-process iterator itself. Idempotent; a loader without started workers is left as it is.
    Mirrors what ``_MultiProcessingDataLoaderIter.__del__`` does (``_shutdown_workers``), deterministically."""
    from torch.utils.data import DataLoader

    it = obj
    if isinstance(obj, DataLoader):  # its persistent worker iterator, if any (other objects are left alone)
        it, obj._iterator = obj._iterator, None
    shutdown = getattr(it, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()
