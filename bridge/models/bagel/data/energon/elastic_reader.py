"""``data.order: elastic``: the per-group reader whose stream survives a change of DP size or ``num_workers``.

One :class:`ElasticGroupReader` per group and DP rank. What it reads is :mod:`elastic_order`'s: the group's
official selection cut into canonical partitions, partition ``p`` owned by DP rank ``p mod W``, owned partitions
read round robin, each through its own cursor. Energon does the reading: every sample is fetched by index
with the savable loader's ``restore_sample`` (random access through the shard's ``.tar.idx``) and cooked by the
same task encoder as the default reader, drawing its random choices from a generator seeded by (group, data seed,
selection position, epoch) (``cook_common.drawing``), so a sample is the same whichever rank or worker cooks it.
``num_workers`` worker processes (a torch ``DataLoader`` over the planned reads, in order) only make it faster:
the stream does not depend on them.

State (``_savable_fields``): ``world`` (DP rank/size and resize generation, checked), ``cursors`` (epoch and
cursor of every owned partition, zlib-packed int64: ~0 bytes per partition in the usual lock-step),
``turn`` (round-robin position), ``pending`` (restore keys handed over by a resize, read first), the ledger
counters ``taken`` / ``handed_in`` and the drop counters. :meth:`resize_state` turns the states of all old ranks
into one new rank's (pure data; see ``pipeline.elastic``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import warnings
import weakref
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import megatron.energon as energon
import numpy as np
from megatron.energon import WorkerConfig, get_savable_loader, reraise_exception

from ..state import StateError, Savable, register_resizable
from ..stats import DataStallError, DropCounter, StallWatch, merge_counts
from ..watchdog import DEFAULT_STALL_WARN_S, DEFAULT_TIMEOUT_S, DataTimeoutError, ReadWatch
from . import compact, damage
from .checksums import ChecksumGuard
from .cook_common import drawing, replaying
from .cookers import BagelTaskEncoder
from .elastic_order import DEFAULT_CHUNK, GroupLayout, PartitionOrder, owned_partitions
from .reader import GroupSelection, read_error
from .sample import BagelSample
from .workers import close_tar_files, killed_workers_expected, shutdown_workers

__all__ = ["ElasticGroupReader", "KEY_TAG"]

logger = logging.getLogger(__name__)

#: First element of an elastic sample's Energon-level restore key: ``(KEY_TAG, dataset, index, position, epoch,
#: partition)``; the sample's ``restore_key`` pairs it with the recorded random choices.
KEY_TAG = "Elastic"
_PIN_MEMORY_WARNING = ".*pin_memory.*"
_STALL_HINT = ("Fix or remove the dataset's unusable rows (see the reason), or drop the dataset from the group.")


def _identity_collate(sample: Any) -> Any:
    return sample


def _cook_rng(group: str, seed: int, position: int, epoch: int) -> random.Random:
    key = f"bagel-elastic-cook|{group}|{seed}|{position}|{epoch}".encode()
    return random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))


def _energon_key(loader: Any, index: int) -> tuple:
    """The savable loader's restore key of sample ``index`` of its (single, unblended) dataset.

    Derived from the loader's wrapper chain (Energon ≥ 7: ``SimpleSavableDatasetWrapper`` → (worker, sample),
    ``MapDataset`` → (sample[, local]), ``WebdatasetSampleLoaderDataset`` → ("Webdataset", index)); the reader
    checks every restored sample's own key against it, so a changed Energon layout fails loudly, never silently.
    """
    prefix: list[Any] = []
    node = loader.dataset
    while node is not None:
        name = type(node).__name__
        if name == "SimpleSavableDatasetWrapper":
            prefix += [name, 0, 0]
        elif name == "MapDataset":
            import inspect

            prefix += [name, 0, 0] if inspect.isgeneratorfunction(node.map_fn) else [name, 0]
        elif name == "WebdatasetSampleLoaderDataset":
            return (*prefix, "Webdataset", int(index))
        node = getattr(node, "dataset", None)
    raise RuntimeError(f"Energon {energon.__version__}: no WebdatasetSampleLoaderDataset under the loader; the "
                       "elastic reader needs a webdataset-format Energon dataset")


class _Reads:
    """What one planned read returns: the cooked sample at an item of the plan (picklable into workers)."""

    def __init__(self, loaders: Sequence[Any], group: str, seed: int) -> None:
        self.loaders, self.group, self.seed = list(loaders), group, seed

    def __getitem__(self, item: tuple) -> BagelSample:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_PIN_MEMORY_WARNING, category=UserWarning)
            if item[0] == "read":
                _, d, i, j, e, p = item
                with drawing(_cook_rng(self.group, self.seed, j, e)):
                    sample = self._restore(d, i)
            else:
                (_, d, i, j, e, p), choices = item[1]
                with replaying(choices):
                    sample = self._restore(d, i)
        sample.__restore_key__ = (KEY_TAG, d, i, j, e, p)
        sample.data_indexes = {**sample.data_indexes, "position": j, "epoch": e, "partition": p}
        return sample

    def _restore(self, d: int, i: int) -> BagelSample:
        key = _energon_key(self.loaders[d], i)
        sample = self.loaders[d].restore_sample(key)
        if tuple(sample.__restore_key__) != key:
            raise RuntimeError(f"Energon {energon.__version__} restored sample {i} of dataset {d} under key "
                               f"{sample.__restore_key__!r}, expected {key!r}: the elastic reader does not know this "
                               "Energon version's restore keys")
        return sample


class _Plan:
    """The deterministic sequence of reads of one rank: handed-over keys first, then owned partitions round robin."""

    def __init__(self, order: PartitionOrder, layout: GroupLayout, cursors: dict[int, list[int]], turn: int,
                 pending: list) -> None:
        self.order, self.layout = order, layout
        self.owned = sorted(cursors)
        self.cursors = {p: list(v) for p, v in cursors.items()}
        self.turn, self.pending = turn, list(pending)

    def copy(self) -> "_Plan":
        return _Plan(self.order, self.layout, self.cursors, self.turn, self.pending)

    def next_item(self) -> tuple:
        if self.pending:
            return ("handover", self.pending.pop(0))
        p = self.owned[self.turn]
        epoch, cursor = self.cursors[p]
        j = self.order.position(p, epoch, cursor)
        d, i = self.layout.coordinate(j)
        cursor += 1
        if cursor == self.order.size(p):
            epoch, cursor = epoch + 1, 0
        self.cursors[p] = [epoch, cursor]
        self.turn = (self.turn + 1) % len(self.owned)
        return ("read", d, i, j, epoch if cursor else epoch - 1, p)

    def __iter__(self) -> Iterator[tuple]:
        while True:
            yield self.next_item()


def _pack_cursors(cursors: Mapping[int, Sequence[int]]) -> bytes:
    rows = np.asarray([[p, *cursors[p]] for p in sorted(cursors)], dtype=np.int64).reshape(-1, 3)
    rows[1:] -= rows[:-1].copy()  # deltas: lock-step partitions compress to almost nothing
    return zlib.compress(rows.tobytes(), 6)


def _unpack_cursors(blob: Any, where: str) -> dict[int, list[int]]:
    try:
        rows = np.frombuffer(zlib.decompress(blob), dtype=np.int64).reshape(-1, 3).cumsum(axis=0)
    except (TypeError, ValueError, zlib.error) as exc:
        raise StateError(f"{where}: unreadable partition cursors ({exc})") from None
    return {int(p): [int(e), int(c)] for p, e, c in rows}


def _partition_of(key: Any) -> int:
    return int(key[0][5])


class ElasticGroupReader(GroupSelection, Savable):
    """Endless iterator over the cooked, non-dropped samples of one group on one DP rank, in the elastic order.

    Same construction arguments as ``BagelGroupReader`` plus ``partitions`` (the run's fixed partition count, ``data.partitions``);
    raises ValueError when the selection is empty or has fewer partitions than DP ranks (a rank would own none).
    Samples' ``data_indexes`` gain ``position`` / ``epoch`` / ``partition`` (the ledger's identity of a read).
    """

    _savable_fields = ("world", "cursors", "turn", "pending", "taken", "handed_in", "drops", "unused")

    def __init__(self, paths: str | Sequence[str], *, tokenizer: Any, image_transform_args: Mapping[str, Any],
                 vit_image_transform_args: Mapping[str, Any] | None = None, dp_rank: int = 0, dp_size: int = 1,
                 num_workers: int = 0, seed: int = 0, partitions: int, group: str | None = None,
                 num_used_data: Sequence[int] | None = None, shuffle_lines: bool = False, shuffle_seed: int = 0,
                 stall_warn_s: float = DEFAULT_STALL_WARN_S, timeout_s: float = DEFAULT_TIMEOUT_S,
                 verify_checksums: bool = True) -> None:
        self.paths = [os.path.abspath(os.fspath(p)) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
        if not self.paths:
            raise ValueError("ElasticGroupReader needs at least one dataset path")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        if num_used_data is not None and len(num_used_data) != len(self.paths):
            raise ValueError(f"num_used_data has {len(num_used_data)} entries for {len(self.paths)} datasets")
        for p in self.paths:
            damage.check_prepared(p)
        self.group_name = self._check_sizes(group, 1)
        self.runs = self._selection(num_used_data, shuffle_lines, shuffle_seed)
        self._manifests = None  # read once for sizes + selection; not kept
        self.layout = GroupLayout(self.runs)
        self.order = PartitionOrder(self.layout.num_positions, partitions, seed, self.group_name, DEFAULT_CHUNK)
        if self.order.num_partitions < dp_size:
            remedy = (f"set data.partitions to at least {dp_size}" if self.order.num_partitions == int(partitions)
                      else "select more samples for this group (num_used_data, or more data) or use fewer DP ranks")
            raise ValueError(  # the builder prefixes the groups YAML and the group's name
                f"{self.layout.num_positions} selected samples make {self.order.num_partitions} elastic partitions "
                f"(data.partitions {partitions}), fewer than DP size {dp_size}: DP rank {self.order.num_partitions} "
                f"and above would read nothing: {remedy}")
        self.seed, self.dp_rank, self.dp_size, self.num_workers = int(seed), dp_rank, dp_size, num_workers
        self.partitions = int(partitions)
        self.transform_args = {"image_transform_args": dict(image_transform_args),
                               "vit_image_transform_args": None if vit_image_transform_args is None
                               else dict(vit_image_transform_args)}
        task_encoder = BagelTaskEncoder(tokenizer, {self.group_name: self.transform_args},
                                        verify_checksums=verify_checksums)
        wc = WorkerConfig(rank=0, world_size=1, num_workers=0, global_error_handler=reraise_exception)
        loaders = [get_savable_loader(compact.open_train_dataset([(p, None)], worker_config=wc, repeat=False,
                                                                 max_samples_per_sequence=None,
                                                                 task_encoder=task_encoder),
                                      gc_collect_every_n_steps=0, watchdog_timeout_seconds=None) for p in self.paths]
        self._reads = _Reads(loaders, self.group_name, self.seed)
        self.drops = DropCounter(f"reader {self.group_name} (dp rank {dp_rank}, elastic)", logger)
        self.unused = DropCounter(f"reader {self.group_name} (dp rank {dp_rank}, elastic)", logger,
                                  what="ignored part of a record (the sample is kept, as officially)")
        self._stall = StallWatch(f"reader {self.group_name!r}", _STALL_HINT)
        self._checksums = ChecksumGuard(f"DP rank {dp_rank}/{dp_size}, reader {self.group_name!r} (elastic order)")
        self._watch = ReadWatch(f"reader {self.group_name!r} (DP rank {dp_rank}/{dp_size}, elastic order, "
                                f"{num_workers} workers)", self.group_name, self.paths, stall_warn_s=stall_warn_s,
                                timeout_s=timeout_s, workers=num_workers > 0)
        self._it: Iterator[BagelSample] | None = None
        self._closed = False
        self.generation = 0
        self.reset_state()

    # -- declared state --------------------------------------------------------------------------
    def reset_state(self) -> None:
        owned = owned_partitions(self.order.num_partitions, self.dp_rank, self.dp_size)
        self._plan = _Plan(self.order, self.layout, {p: [0, 0] for p in owned}, 0, [])
        self.taken = 0
        self.handed_in = 0
        self.drops.reset_state()
        self.unused.reset_state()

    def identity(self) -> dict[str, Any]:
        """What a saved state must match: group, datasets, selection, transforms, seed, partitions (no topology)."""
        selection = hashlib.sha256(json.dumps(self.runs).encode()).hexdigest()
        return {"group": self.group_name, "energon_version": energon.__version__, "seed": self.seed,
                "transform_args": self.transform_args, "partitions": self.order.num_partitions,
                "chunk": self.order.chunk, "num_positions": self.order.num_positions, "selection_sha256": selection,
                "datasets": [{"name": os.path.basename(p), "num_samples": n} for p, n in zip(self.paths, self._counts)]}

    def _before_iterating(self, what: str) -> None:
        if self._it is not None:
            raise StateError(f"reader {self.group_name}: {what} can only be restored before iterating")

    @property
    def world(self) -> dict[str, int]:
        return {"dp_rank": self.dp_rank, "dp_size": self.dp_size, "generation": self.generation}

    @world.setter
    def world(self, saved: Any) -> None:
        self._before_iterating("a state")
        if not isinstance(saved, dict) or {"dp_rank", "dp_size", "generation"} - set(saved):
            raise StateError(f"reader {self.group_name}: bad world {saved!r}")
        if (saved["dp_rank"], saved["dp_size"]) != (self.dp_rank, self.dp_size):
            raise StateError(
                f"reader {self.group_name!r}: this loader state was saved by DP rank {saved['dp_rank']} of "
                f"{saved['dp_size']}, this is DP rank {self.dp_rank} of {self.dp_size}: a resume on another DP size "
                "must read every old rank's state (the job does; with Bridge's pretrain() run `bagel-data "
                "resize-state` on the checkpoint first)")
        self.generation = int(saved["generation"])

    @property
    def cursors(self) -> bytes:
        return _pack_cursors(self._plan.cursors)

    @cursors.setter
    def cursors(self, blob: Any) -> None:
        cursors = _unpack_cursors(blob, f"reader {self.group_name}")
        if sorted(cursors) != self._plan.owned:
            raise StateError(f"reader {self.group_name}: the state holds partitions {sorted(cursors)[:8]}…, this "
                             f"rank owns {self._plan.owned[:8]}…")
        self._plan = _Plan(self.order, self.layout, cursors, self._plan.turn, self._plan.pending)

    @property
    def turn(self) -> int:
        return self._plan.turn

    @turn.setter
    def turn(self, value: Any) -> None:
        self._plan.turn = int(value) % len(self._plan.owned)

    @property
    def pending(self) -> list:
        return [list(k) for k in self._plan.pending]

    @pending.setter
    def pending(self, keys: Any) -> None:
        self._plan.pending = [tuple(k) for k in keys]

    # -- iteration -------------------------------------------------------------------------------
    def __iter__(self) -> "ElasticGroupReader":
        return self

    def _items(self) -> Iterator[BagelSample]:
        plan = self._plan.copy()
        if self.num_workers == 0:
            return (self._reads[item] for item in plan)
        from torch.utils.data import DataLoader

        loader = DataLoader(self._reads, batch_size=None, sampler=plan, num_workers=self.num_workers,
                            collate_fn=_identity_collate, multiprocessing_context="fork")
        return iter(loader)

    def __next__(self) -> BagelSample:
        if self._it is None:
            if self._closed:
                raise RuntimeError(f"reader {self.group_name} is closed")
            self._it = self._items()
            # stops the workers on close() or when the reader is collected, while their queues are alive
            self._stop_workers = weakref.finalize(self, shutdown_workers, self._it)
        while True:
            item = self._plan.next_item()
            try:
                sample = self._watch.call(next, self._it)
            except (StopIteration, DataStallError, DataTimeoutError):
                raise
            except Exception as exc:
                raise read_error(exc, self.group_name, f"DP rank {self.dp_rank}/{self.dp_size}",
                                 f"{self.num_workers} workers (elastic order)", self.paths) from exc
            key = sample.__restore_key__
            expected = item[1][0] if item[0] == "handover" else (KEY_TAG, *item[1:])
            if tuple(key) != tuple(expected):
                raise RuntimeError(f"reader {self.group_name}: read {key!r}, planned {expected!r} (internal error)")
            if item[0] == "handover":
                self.handed_in += 1
            else:
                self.taken += 1
            dataset = os.path.basename(self.paths[key[1]])
            if sample.drop_reason is None:
                self._stall.ok(dataset)
                for reason, n in (sample.unused or {}).items():
                    self.unused.drop(reason, f"{dataset} sample {sample.__key__} {sample.source}", n)
                return sample
            self.drops.drop(sample.drop_reason, sample.drop_detail)
            self._checksums.drop(sample)  # a damaged shard stops the reader (CorruptShardError)
            self._stall.drop(dataset, sample.drop_reason, sample.drop_detail,
                             limit=2 * sum(self.order.size(p) for p in self._plan.owned) + 2,
                             where=f"dataset {dataset!r} on DP rank {self.dp_rank}/{self.dp_size} (elastic order)")

    def restore_sample(self, restore_key: Any) -> BagelSample:
        """Rebuild a sample from its ``restore_key`` (replaying its recorded choices; no RNG drawn)."""
        try:
            (tag, d, i, j, e, p), _choices = restore_key
            assert tag == KEY_TAG
        except (TypeError, ValueError, AssertionError):
            raise ValueError(f"reader {self.group_name}: bad elastic restore key {restore_key!r}") from None
        sample = self._reads[("handover", restore_key)]
        close_tar_files(*self._reads.loaders)  # workers forked later must not share these file offsets (workers.py)
        if sample.drop_reason is not None:
            raise ValueError(f"reader {self.group_name}: restore key {restore_key!r} names a dropped sample")
        return sample

    def stats(self) -> dict[str, Any]:
        """Drops and unused parts by reason, and the ledger: ``taken`` (partition reads, drops included),
        ``handed_in`` (handed-over samples read again), ``pending``, and ``partitions`` ({p: [epoch, cursor]})."""
        return {"drops": dict(self.drops.counts), "unused": dict(self.unused.counts), "taken": self.taken,
                "handed_in": self.handed_in, "pending": len(self._plan.pending),
                "partitions": {p: list(v) for p, v in self._plan.cursors.items()}}

    def close(self) -> None:
        self._closed = True
        it, self._it = self._it, None
        watch, killed = self._watch, False
        if watch.busy:
            killed = watch.kill_stuck()
            with killed_workers_expected(killed):
                watch.stop(wait_s=15.0 if killed else 0.0)
        elif it is not None:
            self._stop_workers()  # once; workers.py says why not leave it to the garbage collector
        with killed_workers_expected(killed):
            watch.stop()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # -- resize (pure data) ------------------------------------------------------------------------
    @classmethod
    def resize_state(cls, olds: Sequence[Mapping[str, Any]], ctx: Any, handover: Sequence[Any] = ()) -> dict:
        """The state of new DP rank ``ctx.dp_rank`` of ``ctx.dp_size`` from the states of ALL old ranks.

        Partitions (with their cursors) go to their new owners; handed-over keys (old packer buffers, and old
        pending keys) go to the owner of their partition; counters are carried by new rank 0 (their world sum is
        unchanged). Raises ``StateError`` when the old states do not cover every partition exactly once.
        """
        cursors: dict[int, list[int]] = {}
        for k, old in enumerate(olds):
            part = _unpack_cursors(old["cursors"], f"old rank {k}")
            clash = set(part) & set(cursors)
            if clash:
                raise StateError(f"elastic resize: partition {min(clash)} is in two old ranks' states (the state "
                                 "files are from different checkpoints)")
            cursors.update(part)
        if sorted(cursors) != list(range(len(cursors))):
            raise StateError(f"elastic resize: the {len(olds)} old states do not cover every partition (missing "
                             f"{sorted(set(range(max(cursors) + 1)) - set(cursors))[:8]}); give every old rank's file")
        owned = set(owned_partitions(len(cursors), ctx.dp_rank, ctx.dp_size))
        if not owned:
            raise StateError(f"elastic resize: {len(cursors)} partitions, fewer than DP size {ctx.dp_size}")
        keys = [k for old in olds for k in old["pending"]] + [list(k) for k in handover]
        first = ctx.dp_rank == 0
        drops = {"stage": "DropCounter", "state": {"counts": merge_counts(o["drops"]["state"]["counts"] for o in olds)
                                                   if first else {}}}
        unused = {"stage": "DropCounter", "state": {"counts": merge_counts(o["unused"]["state"]["counts"]
                                                                           for o in olds) if first else {}}}
        return {"world": {"dp_rank": ctx.dp_rank, "dp_size": ctx.dp_size, "generation": ctx.generation},
                "cursors": _pack_cursors({p: cursors[p] for p in owned}), "turn": 0,
                "pending": [k for k in keys if _partition_of(k) in owned],
                "taken": sum(int(o["taken"]) for o in olds) if first else 0,
                "handed_in": sum(int(o["handed_in"]) for o in olds) if first else 0,
                "drops": drops, "unused": unused}


register_resizable(ElasticGroupReader)
