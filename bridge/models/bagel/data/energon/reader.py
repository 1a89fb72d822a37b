"""The per-group sample reader the packer consumes: Energon loader + BAGEL cookers, exact save/restore.

One :class:`BagelGroupReader` per group and DP rank. It reads the group's converted datasets through
Energon's ``get_train_dataset`` pipeline (unbatched, no shuffle buffer, endless; opened by
``compact.open_train_dataset`` without Python work per shard) and a savable loader, cooks every crude sample
into a :class:`BagelSample`, counts tombstones by reason and yields the rest.

The group's official selection (``num_used_data`` per dataset: t2i / edit files repeated or subset, vlm
first-n lines after ``shuffle_lines``; see ``selection``) is expressed as an Energon ``MetadatasetV2``
``blend_epochized`` over sample-index ranges of the converted datasets with ``repetitions``, so one
Energon epoch of the DP rank set reads exactly the rows the official loader selects (each as often). A
single dataset read whole and once is opened directly.
Sharding is by DP rank only (``WorkerConfig(rank=dp_rank, world_size=dp_size)``): TP/CP peers that
pass the same DP rank read identical data.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import megatron.energon as energon
from megatron.energon import WorkerConfig, get_savable_loader, reraise_exception

from ..state import Savable, StateError, energon_rank_state
from ..stats import DataStallError, DropCounter, StallWatch
from ..watchdog import DEFAULT_STALL_WARN_S, DEFAULT_TIMEOUT_S, DataTimeoutError, ReadWatch, describe_frame
from . import compact, compact_state, damage
from .checksums import ChecksumGuard
from .cook_common import replaying
from .cookers import BagelTaskEncoder
from .identity import loader_identity
from .layout import MANIFEST_NAME, ManifestIndex, load_manifest_index
from .sample import BagelSample
from .selection import manifest_runs
from .workers import close_tar_files, killed_workers_expected, shutdown_workers

__all__ = ["BagelGroupReader", "DataReadError", "GroupSelection", "dataset_num_samples", "read_error"]

logger = logging.getLogger(__name__)

_PIN_MEMORY_WARNING = ".*pin_memory.*"


_STALL_HINT = ("Fix or remove the dataset's unusable rows (see the reason), or give every DP rank usable data "
               "(fewer DP ranks / workers, or more data in that dataset), or drop the dataset from the group.")


class DataReadError(RuntimeError):
    """Reading a converted dataset failed: one line naming the damaged file and the remedy when one is found
    (``damage.diagnose``), else the group, datasets, rank and the cause (shard/key if known). ``brief``: a short
    form for the other ranks' line."""

    def __init__(self, message: str, brief: str = "") -> None:
        super().__init__(message)
        self.brief = brief or message[:160]

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.brief))


_WORKER_ERROR = re.compile(r"Caught (\w+) in DataLoader worker process (\d+)\.")
#: Exception kinds a damaged file raises while Energon reads it (a cooking error names its row already).
_READ_KINDS = {"ValueError", "ReadError", "EOFError", "OSError", "error", "KeyError", "IndexError",
               "UnicodeDecodeError", "HeaderError", "StreamError", "AssertionError", "DatabaseError"}


def read_error(exc: BaseException, group: str, rank: str, workers: str, paths: Sequence[str]) -> DataReadError:
    """One line for a failed read: the damaged file (diagnosed) with its remedy, or the reader, cause and where.

    ``rank`` reads ``"DP rank r/s"``; a torch worker's flattened traceback goes to the debug log and is replaced
    by its last line (the original exception) and the worker's number.
    """
    who = f"reader {group!r} ({rank}"
    text = str(exc)
    kind, where = type(exc).__name__, ""
    m = _WORKER_ERROR.search(text)
    if m:
        logger.debug("%s: traceback in Energon worker %s:\n%s", who, m.group(2), text)
        kind, where = m.group(1), f", Energon worker {m.group(2)}"
        last = [x for x in text.strip().splitlines() if x.strip()][-1].strip()
        text = last.split(": ", 1)[1] if last.startswith(f"{kind}:") or ": " in last[:60] else last
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    shard = describe_frame(tb.tb_frame)["shard"] if tb is not None else None
    if kind in _READ_KINDS:
        found = damage.diagnose(paths, f"{text} {shard or ''}")
        if found is not None:
            return DataReadError(f"{found} (group {group!r}, {rank}{where})", brief=found[:200])
    at = f" while reading shard {shard}" if shard else ""
    message = f"{who}, {workers}, datasets {list(paths)}){where}: {kind}: {' '.join(text.split())}{at}"
    return DataReadError(message, brief=f"{who}){where}: {kind}: {' '.join(text.split())[:120]}")


def _dataset_of(sample: Any, default: str) -> str:
    """Name (directory basename) of the Energon dataset a sample came from (``__sources__``), else ``default``'s."""
    sources = getattr(sample, "__sources__", None) or ()
    for info in sources:
        path = getattr(info, "dataset_path", None)
        if path is not None:
            return os.path.basename(str(path).rstrip("/"))
    return os.path.basename(default)


def dataset_num_samples(path: str) -> tuple[str, int]:
    """``(group, sample count)`` of a converted dataset, from its manifest (or ``.nv-meta/.info.json``)."""
    if os.path.isfile(os.path.join(path, MANIFEST_NAME)):
        index = load_manifest_index(path)
        return index.group, index.num_samples
    info = os.path.join(path, ".nv-meta", ".info.json")
    if not os.path.isfile(info):
        raise ValueError(f"{path}: not a converted BAGEL dataset (no {MANIFEST_NAME} and no .nv-meta/.info.json)")
    with open(info, encoding="utf-8") as f:
        counts = json.load(f).get("shard_counts", {})
    return "", int(sum(counts.values()))


def _clocks() -> tuple[float, float]:
    """(wall clock, this process's CPU time) in seconds."""
    return time.perf_counter(), time.process_time()


class GroupSelection:
    """What both group readers (``BagelGroupReader``, ``ElasticGroupReader``) compute from ``self.paths`` alone: the
    group name, each dataset's sample count and the official selection runs, each manifest read once."""

    paths: list[str]
    group_name: str

    def _check_sizes(self, group: str | None, min_samples: int) -> str:
        """The group name and each dataset's sample count; an empty dataset is refused (the selected total is
        checked against the global worker count in ``_selection``: the official reader hangs on an empty slice)."""
        groups = set()
        self._counts = []
        self._min_samples = min_samples
        self._manifests: list[ManifestIndex | None] | None = []  # each read once, also for ``_selection``
        for p in self.paths:  # the manifests' O(1) view (format 3: no per-file Python object)
            man = load_manifest_index(p) if os.path.isfile(os.path.join(p, MANIFEST_NAME)) else None
            self._manifests.append(man)
            g, n = (man.group, man.num_samples) if man is not None else dataset_num_samples(p)
            if n == 0:
                raise ValueError(f"{p}: no samples; a dataset of a group must hold data")
            groups.add(g or group)
            self._counts.append(n)
        groups.discard(None)
        if group is not None:
            groups.add(group)
        if len(groups) != 1:
            raise ValueError(f"datasets {self.paths} are not all of one group: {sorted(map(str, groups))}")
        return groups.pop()

    def _selection(self, num_used_data: Sequence[int] | None, shuffle_lines: bool, shuffle_seed: int
                   ) -> list[list[tuple[int, int, int]]]:
        """Per dataset, the official selection as ``(start, end, repetitions)`` sample-index runs."""
        runs = []
        for i, (p, n) in enumerate(zip(self.paths, self._counts)):
            used = None if num_used_data is None else int(num_used_data[i])
            if used is None and not (shuffle_lines and self.group_name == "vlm_sft"):
                runs.append([(0, n, 1)] if n else [])
                continue
            man = self._manifests[i] if self._manifests is not None else None
            if man is None:
                raise ValueError(f"{p}: num_used_data / shuffle_lines need the converter's {MANIFEST_NAME}")
            runs.append(manifest_runs(man, used, shuffle_lines=shuffle_lines, shuffle_seed=shuffle_seed))
        total = sum((e - s) * r for ds in runs for s, e, r in ds)
        if total < self._min_samples:
            raise ValueError(f"{', '.join(self.paths)}: {total} samples, fewer than dp_size x max(num_workers, 1) = "
                             f"{self._min_samples} (after the num_used_data selection); some data-parallel workers "
                             "would get no data. Use fewer ranks/workers or more data.")
        return runs


class BagelGroupReader(GroupSelection, Savable):
    """Endless iterator over the cooked, non-dropped samples of one BAGEL group on one DP rank.

    State (``state_dict()`` / ``load_state_dict()``): the Energon loader position (``energon``) and the drop
    counts (``drops``); restore only into a fresh reader, before iterating. ``restore_sample(key)`` rebuilds
    a sample from ``sample.restore_key`` bit-exactly by replaying its recorded choices (no RNG is drawn).
    ``identity()`` (group, datasets, sample counts, transforms, Energon loader config) is what a saved
    state must match; the loader checks it through its fingerprint.
    """

    _savable_fields = ("energon", "drops", "unused")

    def __init__(self, paths: str | Sequence[str], *, tokenizer: Any, image_transform_args: Mapping[str, Any],
                 vit_image_transform_args: Mapping[str, Any] | None = None, dp_rank: int = 0, dp_size: int = 1,
                 num_workers: int = 0, seed: int = 0, max_samples_per_sequence: int | None = 100,
                 checkpoint_every_sec: float = 60, group: str | None = None,
                 num_used_data: Sequence[int] | None = None, shuffle_lines: bool = False,
                 shuffle_seed: int = 0, stall_warn_s: float = DEFAULT_STALL_WARN_S,
                 timeout_s: float = DEFAULT_TIMEOUT_S, verify_checksums: bool = True) -> None:
        self.paths = [os.path.abspath(os.fspath(p)) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
        if not self.paths:
            raise ValueError("BagelGroupReader needs at least one dataset path")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        if num_used_data is not None and len(num_used_data) != len(self.paths):
            raise ValueError(f"num_used_data has {len(num_used_data)} entries for {len(self.paths)} datasets")
        clock = _clocks()
        for p in self.paths:
            damage.check_prepared(p)  # Energon would only say "Invalid dataset at <dir>"
        self.group_name = self._check_sizes(group, dp_size * max(num_workers, 1))
        self.runs = self._selection(num_used_data, shuffle_lines, shuffle_seed)
        self._manifests = None  # read once for sizes + selection; not kept (O(files) per dataset)
        self.transform_args = {"image_transform_args": dict(image_transform_args),
                               "vit_image_transform_args": None if vit_image_transform_args is None
                               else dict(vit_image_transform_args)}
        self.seed, self.dp_rank, self.dp_size, self.num_workers = seed, dp_rank, dp_size, num_workers
        self.task_encoder = BagelTaskEncoder(tokenizer, {self.group_name: self.transform_args},
                                             verify_checksums=verify_checksums)
        t_selection = _clocks()
        wc = WorkerConfig(rank=dp_rank, world_size=dp_size, num_workers=num_workers, seed_offset=seed,
                          global_error_handler=reraise_exception)
        whole = len(self.paths) == 1 and self.runs == [[(0, self._counts[0], 1)]]
        ds = compact.open_train_dataset([(self.paths[0], None)] if whole else list(zip(self.paths, self.runs)),
                                        worker_config=wc, max_samples_per_sequence=max_samples_per_sequence,
                                        task_encoder=self.task_encoder, name=self.group_name)
        self.loader = get_savable_loader(ds, gc_collect_every_n_steps=0, watchdog_timeout_seconds=None,
                                         checkpoint_every_sec=checkpoint_every_sec)
        # stops the workers when the reader is closed or collected; holding the loader keeps its queues out of
        # a cyclic collection of the reader, so the workers still get their stop message (workers.py)
        self._stop_workers = weakref.finalize(self, shutdown_workers, self.loader)
        t_energon = _clocks()
        self.drops = DropCounter(f"reader {self.group_name} (dp rank {dp_rank})", logger)
        self.unused = DropCounter(f"reader {self.group_name} (dp rank {dp_rank})", logger,
                                  what="ignored part of a record (the sample is kept, as officially)")
        self._stall = StallWatch(f"reader {self.group_name!r}", _STALL_HINT)
        self._checksums = ChecksumGuard(f"DP rank {dp_rank}/{dp_size}, reader {self.group_name!r}")
        self._stall_limits = {os.path.basename(p): 2 * (-(-n // dp_size)) + 2 * max(num_workers, 1) + 2
                              for p, n in zip(self.paths, self._counts)}
        self._it: Iterator[BagelSample] | None = None
        self._closed = False
        self._watch = ReadWatch(f"reader {self.group_name!r} (DP rank {dp_rank}/{dp_size}, {num_workers} Energon "
                                "workers)", self.group_name, self.paths, stall_warn_s=stall_warn_s,
                                timeout_s=timeout_s, workers=num_workers > 0)
        t_identity = _clocks()
        #: The resume fingerprint, made on the first ``identity()`` (the first save or restore), not here: it digests
        #: Energon's ``config()``, O(this rank's slices) (10^5 at DP 1 over 10^7 samples); ``identity_seconds``: its
        #: cost.
        self._identity: dict[str, Any] | None = None
        self.identity_seconds = 0.0
        t_end = _clocks()
        #: Seconds spent opening this reader: ``selection`` (index checks, manifests, official selection: ours),
        #: ``energon`` (``get_train_dataset`` + ``get_savable_loader``: Energon's pipeline, opened by
        #: ``compact``), ``identity`` (0: the fingerprint is made lazily, see ``identity_seconds``), ``other`` (the
        #: rest of ``__init__``); wall clock, and the same as CPU seconds of this process in ``open_cpu_seconds``
        #: (robust on a shared machine). Logged at DEBUG; ``scripts/bench_scale.py`` reports them per corpus and DP
        #: size.
        self.open_seconds, self.open_cpu_seconds = (
            {"selection": t_selection[i] - clock[i], "energon": t_energon[i] - t_selection[i],
             "identity": t_end[i] - t_identity[i], "other": t_identity[i] - t_energon[i]} for i in (0, 1))
        logger.debug("reader %s (DP rank %d/%d): opened in %.3f s (%s)", self.group_name, dp_rank, dp_size,
                     t_end[0] - clock[0], ", ".join(f"{k} {v:.3f} s" for k, v in self.open_seconds.items()))

    # -- construction helpers -------------------------------------------------------------------
    def _compute_identity(self) -> dict:
        return {
            "group": self.group_name,
            "energon_version": energon.__version__,
            "seed": self.seed,
            "transform_args": self.transform_args,
            "datasets": [{"name": os.path.basename(p), "num_samples": n} for p, n in zip(self.paths, self._counts)],
            "selection": [[list(r) for r in runs] for runs in self.runs],
            "loader": loader_identity(self.loader.config()),
        }

    # -- iteration ---------------------------------------------------------------------------
    def __iter__(self) -> BagelGroupReader:
        return self

    def __next__(self) -> BagelSample:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_PIN_MEMORY_WARNING, category=UserWarning)
            if self._it is None:
                if self._closed:
                    raise RuntimeError(f"reader {self.group_name} is closed")
                self._it = iter(self.loader)
            while True:
                try:
                    sample = self._watch.call(next, self._it)  # on the reader thread, under the watchdog
                except (StopIteration, DataStallError, DataTimeoutError):
                    raise
                except Exception as exc:  # name the damaged file, else the group, datasets and rank
                    raise read_error(exc, self.group_name, f"DP rank {self.dp_rank}/{self.dp_size}",
                                     f"{self.num_workers} Energon workers", self.paths) from exc
                dataset = _dataset_of(sample, self.paths[0])
                if sample.drop_reason is None:
                    self._stall.ok(dataset)
                    for reason, n in (sample.unused or {}).items():
                        self.unused.drop(reason, f"{dataset} sample {sample.__key__} {sample.source}", n)
                    return sample
                self.drops.drop(sample.drop_reason, sample.drop_detail)
                self._checksums.drop(sample)  # a damaged shard stops the reader (CorruptShardError)
                self._stall.drop(dataset, sample.drop_reason, sample.drop_detail,
                                 limit=self._stall_limits.get(dataset, 2 * sum(self._counts) + 2),
                                 where=f"dataset {dataset!r} on DP rank {self.dp_rank}/{self.dp_size} (Energon "
                                       f"worker {sample.data_indexes.get('worker_id', 0)} of "
                                       f"{max(self.num_workers, 1)})")

    # -- state -------------------------------------------------------------------------------
    def reset_state(self) -> None:
        """Drop and unused counts back to zero (the Energon position is reset by building a fresh reader)."""
        self.drops.reset_state()
        self.unused.reset_state()

    def identity(self) -> dict[str, Any]:
        """Everything that must match for a saved state to resume this reader (JSON-able, no absolute paths)."""
        if self._identity is None:
            t0 = time.perf_counter()
            self._identity = self._compute_identity()
            self.identity_seconds = time.perf_counter() - t0
        return self._identity

    @property
    def energon(self) -> Any:
        """The Energon savable loader's rank state (its own state classes, allowed by Bridge's unpickler),
        compacted losslessly (``compact_state``: seeded RNGs as ``None``, worker generators compressed).
        StateError after ``close()`` (its workers are stopped: save before closing)."""
        if self._closed:
            raise StateError(f"reader {self.group_name} is closed: save its state before closing it")
        return compact_state.compact(energon_rank_state(self.loader),
                                     compact_state.worker_seeds(self.loader.worker_config))

    @energon.setter
    def energon(self, state: Any) -> None:
        if self._it is not None:
            raise StateError(f"reader {self.group_name}: a state can only be restored before iterating "
                             "(build a fresh reader to restore)")
        self.loader.restore_state_rank(compact_state.expand(state))

    def stats(self) -> dict[str, Any]:
        """``{"drops": {reason: count}, "unused": {reason: count}}`` of this reader's samples so far.

        ``unused`` counts parts of kept records that the official reader also ignores (e.g. images without an
        ``<image>`` placeholder), so nothing is discarded silently.
        """
        return {"drops": dict(self.drops.counts), "unused": dict(self.unused.counts)}

    def restore_sample(self, restore_key: tuple) -> BagelSample:
        """Rebuild a sample from ``sample.restore_key`` (energon key + recorded choices), drawing no RNG."""
        try:
            key, choices = restore_key
        except (TypeError, ValueError):
            raise ValueError(f"reader {self.group_name}: bad restore key {restore_key!r} "
                             "(expected (energon restore key, rng choices))") from None
        with replaying(choices), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_PIN_MEMORY_WARNING, category=UserWarning)
            sample = self.loader.restore_sample(key)
        close_tar_files(self.loader)  # workers forked later must not share these file offsets (workers.py)
        if sample.drop_reason is not None:
            raise ValueError(f"reader {self.group_name}: restore key {restore_key!r} names a dropped sample "
                             f"({sample.drop_reason}: {sample.drop_detail})")
        return sample

    def close(self) -> None:
        """Stop iterating.

        Closes the loader's generator and stops its (persistent) worker processes at once
        (``workers.shutdown_workers``); left to the cyclic garbage collector, torch waits 5 s per worker
        before terminating them. A state cannot be saved after this.
        """
        self._closed = True
        it, self._it = getattr(self, "_it", None), None
        watch = getattr(self, "_watch", None)
        killed = False
        if watch is not None and watch.busy:  # timed out: end the stuck workers, then the loader can close
            killed = watch.kill_stuck()
            with killed_workers_expected(killed):
                watch.stop(wait_s=15.0 if killed else 0.0)  # torch notices a dead worker within 5 s
        if not (watch is not None and watch.busy):
            if it is not None:
                with killed_workers_expected(killed):
                    it.close()
            if getattr(self, "_stop_workers", None) is not None:
                with killed_workers_expected(killed):
                    self._stop_workers()  # now, not in a later garbage collection (5 s per worker there); once
        if watch is not None:
            with killed_workers_expected(killed):
                watch.stop()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
