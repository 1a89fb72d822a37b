"""Open a converted dataset in Energon without Python work per shard: Energon's ``CrudeWebdataset`` pipeline, the same
samples, order, state and ``config()``, with its shard list held as arrays and its slices cut in numpy.

Energon 7.4.1 (pinned) opens a webdataset with O(shards) Python on every rank, whatever the rank reads:
``WebdatasetMeta.from_config`` makes one ``ShardInfo`` with an ``EPath`` per shard (``pathlib`` parsing, ~30 µs
each: 0.29 s at 10^4 shards), the sharder loops over shards and global workers (``sharding``), and
``ShardInfosITarReader`` loops over shards again. Here instead: :class:`ShardTable` (the shards as arrays, read from
the same ``.nv-meta`` files with Energon's rules by :func:`read_shard_table`), :class:`CompactCrudeWebdataset`
(Energon's factory on it, its slices from :func:`sharding.shard_workers`), :class:`TableITarReader`, and
:func:`open_dataset`, Energon's ``get_train_dataset`` for what the readers open.

``tests/test_compact_open.py`` checks, against Energon's own objects on real converted datasets: the factory's
attributes and ``config()``, the slice offsets, every sample and restore key of the pipeline.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from megatron.energon import CrudeWebdataset
from megatron.energon.epathlib import EPath
from megatron.energon.eyaml import load_yaml
from megatron.energon.flavors.base_dataset import SavableDataset
from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory
from megatron.energon.flavors.webdataset.itar import CachedItarOffsetReader, ITarSamplePointer
from megatron.energon.flavors.webdataset.itar_reader import ITarReader
from megatron.energon.flavors.webdataset.sample_loader import WebdatasetSampleLoaderDataset
from megatron.energon.flavors.webdataset.structs import DatasetSubset, ShardInfo
from megatron.energon.metadataset.loader_interface import DatasetBlendMode, LoadedDataset
from megatron.energon.worker import WorkerConfig
from megatron.energon.wrappers.map_dataset import MapDataset

from .. import remote
from . import sharding

__all__ = ["CompactCrudeWebdataset", "ShardTable", "TableITarReader", "expand_braces", "open_dataset",
           "read_shard_table"]

logger = logging.getLogger(__name__)

_META = ".nv-meta"
_SIMPLE_RANGE = re.compile(r"^([^{}\\,]*)\{(\d+)\.\.(\d+)\}([^{}\\,]*)$")


def expand_braces(pattern: str) -> list[str]:
    """``list(braceexpand.braceexpand(pattern))``; a single ascending or descending integer range
    ``prefix{A..B}suffix`` (what ``bracecollapse`` writes for numbered shards) without the generator. Raises what
    ``braceexpand`` raises on a malformed pattern."""
    m = _SIMPLE_RANGE.match(pattern)
    if m is None:
        import braceexpand

        return list(braceexpand.braceexpand(pattern))
    prefix, a, b, suffix = m.groups()
    pad = max(len(a), len(b)) if any(s.startswith("0") for s in (a, b) if s != "0") else 0
    fmt = prefix.replace("%", "%%") + f"%0{pad}d" + suffix.replace("%", "%%")
    lo, hi = int(a), int(b)
    return [fmt % i for i in (range(lo, hi + 1) if lo <= hi else range(lo, hi - 1, -1))]


class _Lazy(Sequence):
    """A sequence whose item ``i`` is ``make(i)``, made on first access and kept (slices give lists)."""

    def __init__(self, n: int, make: Callable[[int], Any]) -> None:
        self._n, self._make = n, make
        self._items: dict[int, Any] = {}

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        i = range(self._n)[i]
        item = self._items.get(i)
        if item is None:
            item = self._items[i] = self._make(i)
        return item


class ShardTable(_Lazy):
    """A split's shards as arrays: ``names`` (list of str, relative to ``base``), ``counts`` (int64 ``[n]``, samples
    per shard) and ``cumsum`` (int64 ``[n + 1]``: 0, then the running total). As a ``Sequence[ShardInfo]`` it is
    what Energon's ``WebdatasetMeta.shards`` list holds, each ``ShardInfo`` made on first access; ``paths``: shard
    ``i``'s ``EPath`` (``base / names[i]``, ITarReader's ``tar_filepaths``), made when first asked for."""

    def __init__(self, base: EPath, names: list[str], counts: np.ndarray) -> None:
        super().__init__(len(names), lambda i: ShardInfo(name=names[i], path=self.paths[i], count=int(self.counts[i])))
        self.base, self.names = base, names
        self.counts = np.asarray(counts, dtype=np.int64)
        self.cumsum = np.concatenate(([0], np.cumsum(self.counts))).astype(np.int64)
        self.paths = _Lazy(len(names), self._path)

    def _path(self, i: int) -> EPath:
        return self.base / self.names[i]

    @property
    def num_samples(self) -> int:
        return int(self.cumsum[-1])

    def shard_of(self, index: int) -> tuple[int, int]:
        """``(shard, index within it)`` of global sample ``index``; IndexError outside ``[0, num_samples)``."""
        shard = int(np.searchsorted(self.cumsum, index, side="right")) - 1
        if not 0 <= shard < len(self.names) or index < 0:
            raise IndexError(f"Index out of bounds: {index}")
        return shard, int(index - self.cumsum[shard])


def _strings(items: Any) -> bool:
    return isinstance(items, list) and set(map(type, items)) <= {str}


def _typed_like_energon(info: Any, splits: Any) -> bool:
    """What Energon's ``JsonParser(strict=True)`` accepts as ``WebdatasetInfo`` / ``WebdatasetSplits`` (no other
    keys; shard counts ints, split parts and excludes lists of strings), checked in C loops."""
    if not (isinstance(info, dict) and isinstance(splits, dict)):
        return False
    counts, parts = info.get("shard_counts"), splits.get("split_parts")
    return (set(info) <= {"energon_version", "shard_counts"}
            and isinstance(info.get("energon_version"), (str, type(None)))
            and isinstance(counts, dict) and set(map(type, counts.values())) <= {int}
            and set(splits) <= {"split_parts", "exclude"} and isinstance(parts, dict)
            and all(map(_strings, parts.values())) and _strings(splits.get("exclude", [])))


def _plain_names(names: list[str]) -> bool:
    """Every name relative, without ``.`` / ``..`` segments, ``//``, a trailing ``/``, backslashes or newlines, not
    empty: then ``path + "/" + name`` is what ``EPath(path) / name`` normalises to. A few substring searches over the
    joined names (C speed: ~1 ms at 10^4 names; a regex took 12 ms)."""
    text = "\n" + "\n".join(names) + "\n"
    if text.count("\n") != len(names) + 1 or "\\" in text:
        return False
    seps = text.replace("\n", "/")  # every name between two '/': empty or absolute names and trailing '/' make '//'
    return "//" not in seps and ("/." not in seps or ("/./" not in seps and "/../" not in seps))


def read_shard_table(path: str | EPath, split_part: str = "train", split_config: str = "split.yaml"
                     ) -> tuple[ShardTable, set[str], list[str], list[str]] | None:
    """``(shards, sample_excludes, split_part_files, info_shard_files)`` of a prepared webdataset, as Energon's
    ``WebdatasetMeta.from_config`` computes them (same files, brace expansion and excludes), or None when this
    module does not read it the same way (a split file other than YAML, anything Energon's strict parser would
    refuse, a shard listed twice, a name that is not plain, ...): the caller then lets Energon open the dataset (and
    report what is wrong). Never raises for a bad dataset."""
    root = os.fspath(str(path))
    try:
        info = json.loads(remote.read_bytes(remote.join(root, _META, ".info.json")))
        splits = load_yaml(remote.read_bytes(remote.join(root, _META, split_config))) \
            if split_config.endswith(".yaml") else None
        if not _typed_like_energon(info, splits) or split_part not in splits["split_parts"]:
            return None
        counts_by_name = info["shard_counts"]
        excludes = {x for e in splits.get("exclude", []) for x in expand_braces(e)}
        all_files = [name for entry in splits["split_parts"][split_part] for name in expand_braces(entry)]
        files = [n for n in all_files if n not in excludes] if excludes else all_files
        if not files or not _plain_names(files) or len(set(files)) != len(files):  # twice: Energon shares a tar id
            return None
        counts = np.fromiter(map(counts_by_name.__getitem__, files), dtype=np.int64, count=len(files))
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return None
    table = ShardTable(path if isinstance(path, EPath) else EPath(root), files, counts)
    return table, {x for x in excludes if "/" in x}, all_files, list(counts_by_name)


class _TableFactory(BaseWebdatasetFactory):
    """Energon's ``BaseWebdatasetFactory`` over a :class:`ShardTable`: the same attributes, ``build()``, ``config()``
    and ``__len__`` (``base_webdataset.py``), without ``WebdatasetMeta.from_config``'s per-shard objects. Cooperative
    ``__init__``: Energon's ``CrudeWebdataset`` / decoder / generic factory constructors run unchanged."""

    def __init__(self, path: EPath, *, split_part: str, training: bool, worker_config: WorkerConfig,
                 shuffle_over_epochs: int | None = 1, parallel_shard_iters: int | None = None,
                 max_samples_per_sequence: int | None = None, subset: DatasetSubset | None = None,
                 split_config: str | None = None, part_filter: Callable[[str], bool] | None = None,
                 shard_table: tuple[ShardTable, set[str], list[str], list[str]]) -> None:
        """``BaseWebdatasetFactory.__init__``'s arguments, plus ``shard_table`` (:func:`read_shard_table`'s result)
        in place of what ``WebdatasetMeta.from_config`` would read; ``split_part`` / ``split_config`` are taken for
        the signature (the table was read for them)."""
        assert self.__sample_type__ is not None, f"Class {type(self)} must define __sample_type__"
        self.shards, self.sample_excludes, self.split_part_files, _ = shard_table
        self.path, self.paths, self.name = path, [path], path.display_name
        self.training, self.worker_config = training, worker_config
        self.shuffle_over_epochs, self.parallel_shard_iters = shuffle_over_epochs, parallel_shard_iters
        self.max_samples_per_sequence, self.subset, self.part_filter = max_samples_per_sequence, subset, part_filter

    def __len__(self) -> int:
        """Samples in the whole split (not the subset), as Energon's ``sum(shard.count ...)``."""
        return self.shards.num_samples

    def build(self, worker_rotation_offset: int = 0) -> SavableDataset:
        """Energon's ``BaseWebdatasetFactory.build``: this rank's worker slices (:func:`sharding.shard_workers`), a
        :class:`TableITarReader`, ``WebdatasetSampleLoaderDataset`` and ``MapDataset`` of ``_load_sample_raw``."""
        parallel = self.parallel_shard_iters
        parallel = (16 if self.training else 1) if parallel is None else parallel  # Energon's defaults
        offsets = sharding.shard_workers(self.shards.cumsum, self.worker_config, rotation_offset=worker_rotation_offset,
                                         max_samples_per_sequence=self.max_samples_per_sequence, subset=self.subset)
        reader = TableITarReader(self.path, self.shards, part_filter=self.part_filter,
                                 sample_filter=self.sample_filter, itar_cache_size=parallel)
        dataset = WebdatasetSampleLoaderDataset(
            join_readers=[reader], workers_sample_slice_offsets=offsets, worker_config=self.worker_config,
            shuffle_over_epochs=self.shuffle_over_epochs if self.training else None, parallel_slice_iters=parallel)
        return MapDataset(dataset, self._load_sample_raw, stateless_map_fn=True, map_fn_config=self.config,
                          worker_config=self.worker_config)

    def config(self) -> dict[str, Any]:
        """Energon's ``BaseWebdatasetFactory.config()``, equal key for key (``_path`` strings included); ``type`` is
        Energon's class name (``CrudeWebdataset``), so fingerprints and states match."""
        base = str(self.path).rstrip("/") + "/"  # == str(path / name) for the plain names read_shard_table takes
        return dict(
            type=CrudeWebdataset.__qualname__, training=self.training, _path=str(self.path),
            shards=[{"name": n, "count": c, "_path": base + n}
                    for n, c in zip(self.shards.names, self.shards.counts.tolist())],
            sample_excludes=list(self.sample_excludes), shuffle_over_epochs=self.shuffle_over_epochs,
            parallel_shard_iters=self.parallel_shard_iters, max_samples_per_sequence=self.max_samples_per_sequence,
            subset=self.subset.config() if self.subset is not None else None)


class CompactCrudeWebdataset(CrudeWebdataset, _TableFactory):
    """Energon's ``CrudeWebdataset`` on a :class:`ShardTable` (pass ``shard_table=read_shard_table(path)``), its
    ``config()`` Energon's key for key."""


class TableITarReader(ITarReader):
    """Energon's ``ShardInfosITarReader`` over a :class:`ShardTable`: global sample index -> (shard, index in it)
    by binary search on the cumulative counts; shard paths and ``ShardInfo`` made on first use."""

    def __init__(self, base_path: EPath, table: ShardTable, part_filter: Callable[[str], bool] | None = None,
                 itar_cache_size: int = 5, sample_filter: Callable[[str], bool] | None = None) -> None:
        self.shard_table, self._remote = table, remote.is_remote(str(base_path))
        self.cached_offset_reader = CachedItarOffsetReader(cache_size=itar_cache_size)
        super().__init__(base_path=base_path, tar_filenames=table.names, tar_filepaths=table.paths,
                         part_filter=part_filter, itar_cache_size=itar_cache_size, sample_filter=sample_filter)

    def __getitem__(self, idx: Any) -> Any:
        """Energon's ``ITarReader.__getitem__``; over an ``msc://`` dataset, an error of the store (refused,
        timed out after MSC's retries, the shard's object gone) is one ``remote.RemoteStorageError`` line naming the
        shard's URL and the remedy (a damaged shard's tar errors pass as they are: ``layout.damage`` names them)."""
        try:
            return super().__getitem__(idx)
        except Exception as exc:
            if not (self._remote and isinstance(idx, int) and 0 <= idx < self.shard_table.num_samples
                    and _store_error(exc)):
                raise
            line = remote.describe(exc, str(self.shard_table.paths[self.shard_table.shard_of(idx)[0]]))
            raise remote.RemoteStorageError(line, brief=line[:200]) from exc

    def _get_itar_sample_pointer(self, idx: int) -> ITarSamplePointer:
        """Shard and byte range of global sample ``idx`` (its shard's ``.tar.idx``); IndexError outside."""
        shard, in_shard = self.shard_table.shard_of(idx)
        byte_offset, byte_size = self.cached_offset_reader.get_itar_byte_offset(self.shard_table[shard].path, in_shard)
        return ITarSamplePointer(tar_file_id=shard, byte_offset=byte_offset, byte_size=byte_size)

    def __len__(self) -> int:
        return self.shard_table.num_samples

    def __str__(self) -> str:
        first = self.tar_filenames[0] if len(self.tar_filenames) else "N/A"
        return (f"ShardInfosITarReader(len={len(self)}, base_path={self.base_path}, "
                f"len(shards)={len(self.tar_filenames)}, shards=[{first}, ...])")


def _store_error(exc: BaseException) -> bool:
    """Whether ``exc`` came from the object store's client (MSC, boto3) rather than from a shard's bytes."""
    top = type(exc).__module__.split(".")[0]
    return (isinstance(exc, OSError) or top in ("multistorageclient", "botocore", "boto3", "urllib3", "s3transfer")
            or (type(exc) is RuntimeError and "object(s) at" in str(exc)))


def _crude_yaml(root: str) -> dict[str, Any] | None:
    """The ``dataset.yaml`` keys of a plain Energon ``CrudeWebdataset`` (only ``subflavors`` besides the class), else
    None."""
    try:
        data = load_yaml(remote.read_bytes(remote.join(root, _META, "dataset.yaml")))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("__module__") != "megatron.energon" \
            or data.get("__class__") != "CrudeWebdataset" or not set(data) <= {"__module__", "__class__", "subflavors"}:
        return None
    subflavors = data.get("subflavors")
    return {"subflavors": subflavors} if subflavors is None or isinstance(subflavors, dict) else None


def open_dataset(root: str, *, worker_config: WorkerConfig, task_encoder: Any) -> SavableDataset | None:
    """Energon's ``get_train_dataset(root, batch_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None,
    repeat=False, ...)`` for one converted dataset read whole (Energon's ``DatasetLoader``, training split ``train``,
    ``shuffle_over_epochs=1``), over its shard table. Returns Energon's ``SavableDataset`` (for
    ``get_savable_loader``), or None when ``root`` is not a dataset this module opens as Energon does (the caller then
    uses Energon's own ``get_train_dataset``)."""
    yaml_kwargs = _crude_yaml(root)
    table = read_shard_table(root) if yaml_kwargs is not None else None
    if table is None:
        logger.info("%s: not a plain converted crude webdataset (dataset.yaml / .info.json / split.yaml); opened by "
                    "Energon itself, at O(shards) Python per rank", root)
        return None
    factory = CompactCrudeWebdataset(EPath(root), split_config="split.yaml", split_part="train", training=True,
                                     worker_config=worker_config, shuffle_over_epochs=1, subset=None,
                                     max_samples_per_sequence=None, decoder=task_encoder.decoder, shard_table=table,
                                     **yaml_kwargs)
    return task_encoder.build_train_datasets(
        datasets=[LoadedDataset(dataset=factory, weight=None, repetitions=None)], worker_config=worker_config,
        batch_size=None, batch_drop_last=False, packing_buffer_size=None, virtual_epoch_length=0,
        shuffle_buffer_size=None, blend_mode=DatasetBlendMode.NONE, repeat=False)
