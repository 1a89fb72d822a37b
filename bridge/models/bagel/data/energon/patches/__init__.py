"""Code that re-implements or patches Energon internals: one place, used only on the Energon versions it is tested on.

Energon opens a webdataset with O(shards) Python work on every rank (one ``ShardInfo`` + ``EPath`` per shard, a
sharder looping over shards and workers): 0.3 s per dataset and rank at 10^4 shards, whatever the rank reads. The
readers open each converted dataset once per rank to read it by index, so on large corpora that start-up dominates.
What avoids it, written against Energon's own classes: ``compact`` (``open_dataset``: Energon's ``CrudeWebdataset``
pipeline for one dataset read whole, its shard list as arrays), ``sharding`` (Energon's sharder in numpy),
:func:`restore_key_prefix` (O(1), no sample read) and ``index`` (``write_index``: the ``.nv-meta`` index from the
converter's own records). :func:`energon_rank_state` (a race of Energon's workers corrected) and
:func:`shard_in_frame` (for the data watchdog) are duck-typed: they run on every Energon (7.3 and 7.4 tested).

They are tested against Energon itself (``tests/test_compact_open.py``) on the versions in ``TESTED_ENERGON``. On any
other Energon version :func:`active` is False and the readers step aside for Energon's public path
(``readers.access``): ``get_train_dataset`` on the dataset, and the restore key taken from a sample the loader
yields. ``BAGEL_ENERGON_PATCHES=0`` forces the public path (and ``=1`` the patches, on a version not tested).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

__all__ = ["ENV", "TESTED_ENERGON", "active", "energon_rank_state", "forced", "restore_key_prefix", "shard_in_frame",
           "supported"]

logger = logging.getLogger(__name__)

#: Energon versions (``major.minor`` prefixes) this package's patches are tested against.
TESTED_ENERGON: tuple[str, ...] = ("7.4",)
#: Environment switch: ``0`` forces Energon's public path, ``1`` the patches (also on an untested version).
ENV = "BAGEL_ENERGON_PATCHES"

_forced: bool | None = None
_said: set[str] = set()


def supported(version: str) -> bool:
    """True when Energon ``version`` (e.g. ``"7.4.1"``) is one the patches are tested against."""
    return any(version == t or version.startswith(t + ".") for t in TESTED_ENERGON)


@contextlib.contextmanager
def forced(value: bool | None) -> Iterator[None]:
    """Within this block :func:`active` answers ``value`` (None: as configured): a test switch."""
    global _forced
    saved, _forced = _forced, value
    try:
        yield
    finally:
        _forced = saved


def active() -> bool:
    """Whether the readers use the patches: the switch of :func:`forced`, else ``BAGEL_ENERGON_PATCHES``, else whether
    the installed Energon is a tested version (said once per process at INFO when it is not)."""
    if _forced is not None:
        return _forced
    env = os.environ.get(ENV, "").strip()
    if env in ("0", "1"):
        return env == "1"
    import megatron.energon as energon

    version = str(getattr(energon, "__version__", "unknown"))
    if supported(version):
        return True
    if version not in _said:
        _said.add(version)
        logger.info("Energon %s: the readers use Energon's public path (its get_train_dataset, O(shards) per rank and "
                    "dataset); the faster patched open is tested on Energon %s only", version,
                    ", ".join(f"{t}.x" for t in TESTED_ENERGON))
    return False


def restore_key_prefix(loader: Any) -> tuple | None:
    """Everything but the sample index of the restore key Energon's savable ``loader`` (over one dataset read whole,
    no workers) gives its samples: ``prefix + (index,)`` restores sample ``index``. Derived from the wrapper chain as
    Energon 7.4 builds it (``SimpleSavableDatasetWrapper`` -> (worker, sample), ``MapDataset`` -> (sample[, local]),
    ``WebdatasetSampleLoaderDataset`` -> ("Webdataset", index)); None for a chain it does not know. The reader checks
    every restored sample's own key against it, so a changed layout fails loudly, never silently."""
    import inspect

    prefix: list[Any] = []
    node = getattr(loader, "dataset", None)
    while node is not None:
        name = type(node).__name__
        if name == "SimpleSavableDatasetWrapper":
            prefix += [name, 0, 0]
        elif name == "MapDataset":
            prefix += [name, 0, 0] if inspect.isgeneratorfunction(node.map_fn) else [name, 0]
        elif name == "WebdatasetSampleLoaderDataset":
            return (*prefix, "Webdataset")
        elif name not in ("WatchdogDataset",):
            return None
        node = getattr(node, "dataset", None)
    return None


def energon_rank_state(loader: Any) -> Any:
    """``loader.save_state_rank()`` of an Energon ``SavableDataLoader``, with a race of its workers corrected
    (``docs/upstream.md``: Energon 7.x's ``savable_loader.SavableDatasetWrapper``). A worker that has not stored its
    first checkpoint yet can answer from its construction-time sentinel ``(state=None, sample_index=-1)``: one
    sample more than it emitted. That answer (no started worker answers ``state=None``) is replaced by the worker's
    initial checkpoint (``dataset.get_initial_checkpoint()``, or ``state=None, offset=0`` on a fresh start); other
    answers, and loaders without workers, are returned unchanged. Duck-typed (a state or dataset of another shape:
    Energon's answer as it is) and read-only on Energon's objects, so it applies on every Energon (also where
    :func:`active` is False: 7.3's loader has the same race).
    """
    state = loader.save_state_rank()
    workers, dataset = getattr(state, "worker_states", None), getattr(loader, "dataset", None)
    if not workers or not getattr(loader, "num_workers", 0) or not hasattr(dataset, "get_initial_checkpoint"):
        return state
    stale = [i for i, ws in enumerate(workers) if hasattr(ws, "offset") and ws.state is None and ws.offset != 0]
    if stale:
        from megatron.energon.savable_loader import SavableDatasetCheckpoint

        initial = dataset.get_initial_checkpoint()
        for i in stale:
            workers[i] = initial[i] if initial is not None else SavableDatasetCheckpoint(state=None, offset=0)
        logger.debug("Energon loader state: worker(s) %s had not started iterating; their initial checkpoint "
                     "is saved instead of Energon's off-by-one answer", stale)
    return state


def shard_in_frame(local: dict[str, Any]) -> tuple[str, str | None] | None:
    """``(shard file, dataset path or None)`` an Energon tar reader (``ITarReader``: ``tar_filepaths`` and a
    ``tar_file_id`` or sample pointer, as Energon 7.4 names them) is opening or reading in a frame with locals
    ``local``; None when the frame is no such reader's. Read-only and checked name by name (an Energon whose reader
    names these differently yields None, never a wrong shard), so it runs on every Energon, untested ones too: the
    data watch names the shard there as well."""
    obj = local.get("self")
    if obj is None or not hasattr(obj, "tar_filepaths"):
        return None
    tid = local.get("tar_file_id")
    for name in ("sample_pointer", "raw_sample_pointer"):
        if tid is None and local.get(name) is not None:
            tid = getattr(local[name], "tar_file_id", None)
    if isinstance(tid, int) and 0 <= tid < len(obj.tar_filepaths):
        return str(obj.tar_filepaths[tid]), str(getattr(obj, "base_path", "") or "") or None
    return None
