"""Worker-process lifecycle: stop a loader's worker processes now, not whenever garbage collection gets to them;
never let forked workers share the parent's open shard files.

torch's ``DataLoader`` with ``persistent_workers=True`` (what Energon's ``SavableDataLoader`` uses whenever
``num_workers > 0``) keeps its multi-process iterator on the loader (``DataLoader._iterator``) after the epoch
generator is closed; the workers are stopped only by that iterator's ``__del__``. When the loader is freed by
the *cyclic* garbage collector (a reader holding it sits in a reference cycle), the collector first runs the
weakref finalizers of the iterator's index queues, which stop their feeder threads, and only then the
iterator's ``__del__``: the ``None`` it sends each worker is never written, and torch waits its 5 s
``MP_STATUS_CHECK_INTERVAL`` per worker before terminating them (measured: 40-60 s stalls inside an unrelated
later call when a few 2-worker readers were collected together). Shutting the iterator down explicitly, while
its queues are alive, takes milliseconds.

Energon's tar readers (``ITarReader``) keep the shard (and ``.tar.idx``) files they open cached on the dataset
object; workers forked after a read in the parent (``restore_sample``) would share one file offset per file and read
each other's positions (``docs/upstream.md``). :func:`close_tar_files` closes them after every such read in the
parent; each worker then opens its own.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

__all__ = ["close_tar_files", "killed_workers_expected", "shutdown_workers"]

logger = logging.getLogger(__name__)


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


@contextlib.contextmanager
def killed_workers_expected(expected: bool) -> Iterator[None]:
    """A close step after a data time-out: the reader SIGKILLs its stuck worker processes itself
    (``ReadWatch.kill_stuck``), and torch's SIGCHLD handler then raises ``RuntimeError: DataLoader worker (pid N) is
    killed by signal: Killed`` wherever the main thread happens to be (seen under load inside the join of
    ``_shutdown_workers``, whose ``finally`` still ends the rest). When ``expected``, that error is logged at DEBUG
    and the close goes on; any other error, or that one when no worker was killed, propagates."""
    try:
        yield
    except RuntimeError as e:
        if not (expected and "killed by signal" in str(e)):
            raise
        logger.debug("%s (a worker this reader ended after its data time-out)", e)


def _file_holders(node: Any, seen: set[int], depth: int = 0) -> Iterator[Any]:
    """Energon's ``ITarReader`` objects (open shards) and their ``CachedItarOffsetReader`` (open ``.tar.idx``
    files) under ``node``, found along the dataset chain only: ``dataset`` / ``datasets`` links (loader, wrappers,
    blends) down to each ``WebdatasetSampleLoaderDataset``'s ``join_readers``. O(datasets), never O(shards): a
    walk of every attribute visited each ``ShardInfo`` and path (1.5 s per call at 10^4 shards)."""
    if node is None or id(node) in seen or depth > 32:
        return
    seen.add(id(node))
    readers = getattr(node, "join_readers", None)
    if readers is not None:  # a WebdatasetSampleLoaderDataset: the readers of its joined datasets
        for reader in readers:
            yield reader
            offsets = getattr(reader, "cached_offset_reader", None)
            if offsets is not None:
                yield offsets
        return
    children = getattr(node, "datasets", None)  # wrappers and blends (checked first: ``dataset`` asserts one)
    for child in (children if children is not None else [getattr(node, "dataset", None)]):
        yield from _file_holders(child, seen, depth + 1)


def close_tar_files(*loaders: Any) -> None:
    """Close the shard (``.tar``) and index (``.tar.idx``) files Energon's readers under ``loaders`` hold open;
    they reopen on the next read. Call it after reading in the parent process of workers that fork later.
    ``tests/test_reader.py`` checks ``/proc/self/fd`` afterwards, so an Energon that caches files elsewhere
    fails that test rather than the workers' reads."""
    seen: set[int] = set()
    for loader in loaders:
        for holder in _file_holders(loader, seen):
            if hasattr(holder, "tar_index_reader_cache"):  # CachedItarOffsetReader: no close() of its own
                entries = list(holder.tar_index_reader_cache.values())
                holder.tar_index_reader_cache.clear()
                for entry in entries:
                    entry.tar_index_reader.close()
            else:
                holder.close()
