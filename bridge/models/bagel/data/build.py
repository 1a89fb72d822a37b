"""Config-driven assembly: per-group Energon readers → BagelPacker → BagelRNGIterator → [PrefetchStage] →
BagelExternalLoader, each stage owning the one before it.

``data.order: official`` replaces the reader/packer/RNG part by ``OfficialWorkers`` over ``num_workers``
emulated official DataLoader workers, each a ``BagelRNGIterator(BagelPacker([OfficialOrderReader per group]))``
chain (see ``official_mode``).

``build_bagel_train_loader`` builds one rank's loader for any number of groups from the grouped YAML, after
the one validation pass (``validate.validate_data``; pass its ``ValidatedData`` to skip a second pass).
``providers.BagelDatasetProvider`` wraps it for Bridge's standard ``pretrain()`` path.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from importlib import metadata
from collections.abc import Callable
from typing import Any

from .pipeline import shm
from .parity import warn_once_if_unproven
from .config import BagelDataConfig, ConfigError, ResolvedGroup, ValidatedData, validate_data
from .energon.elastic_reader import ElasticGroupReader
from .energon.reader import BagelGroupReader
from .energon.layout import ManifestError
from .pipeline.elastic import ELASTIC_TOPOLOGY_KEYS
from .pipeline.loader import BagelExternalLoader
from .pipeline.official_mode import OfficialWorkers
from .packing import BagelPacker
from .pipeline.prefetch import PrefetchStage
from .pipeline.rng import BagelRNGIterator, elastic_rank_seed
from .tokenizer import add_special_tokens

__all__ = ["build_bagel_train_loader", "build_upstream", "dp_rank_size", "package_version", "rank_seed"]

logger = logging.getLogger(__name__)

PACKAGE_NAME = "bagel-megatron-data"


def package_version() -> str:
    """Installed version of this package ("unknown" when run from an uninstalled tree)."""
    try:
        return metadata.version(PACKAGE_NAME)
    except metadata.PackageNotFoundError:
        return "unknown"


def dp_rank_size(context_or_dp: Any) -> tuple[int, int]:
    """(DP rank, DP size) from a ``(rank, size)`` pair or a build context (``context.pg_collection.dp``).

    A context without ``pg_collection`` (Bridge's MIMO path) means every data rank reads the same global
    stream: (0, 1).
    """
    if isinstance(context_or_dp, (tuple, list)):
        rank, size = (int(v) for v in context_or_dp)
    else:
        pgs = getattr(context_or_dp, "pg_collection", None)
        dp = getattr(pgs, "dp", None) if pgs is not None else None
        if dp is None:
            logger.info("build context has no pg_collection.dp: reading the single global stream (DP rank 0 of 1)")
            return 0, 1
        rank, size = int(dp.rank()), int(dp.size())
    if not 0 <= rank < size:
        raise ValueError(f"data-parallel rank {rank} out of range for size {size}")
    return rank, size


def rank_seed(seed: int, dp_rank: int, dp_size: int) -> int:
    """Seed of one DP rank's data RNG (official ``global_seed * world_size + rank``, over DP ranks)."""
    return int(seed) * int(dp_size) + int(dp_rank)


def _paths(group: ResolvedGroup) -> list[str]:
    """The converted Energon directories of one group (present: ``validate_data`` checked them)."""
    return [str(entry.energon_path) for entry in group.datasets]


def _reader(group: ResolvedGroup, tokenizer: Any, config: BagelDataConfig, dp_rank: int, dp_size: int
            ) -> BagelGroupReader | ElasticGroupReader:
    g = group.group
    paths = _paths(group)
    elastic = {"partitions": config.partitions} if config.order == "elastic" else {}
    cls = ElasticGroupReader if elastic else BagelGroupReader
    try:
        return cls(paths, tokenizer=tokenizer, image_transform_args=g.image_transform_args,
                                vit_image_transform_args=g.vit_image_transform_args, dp_rank=dp_rank,
                                dp_size=dp_size, num_workers=config.num_workers, seed=config.effective_data_seed,
                                group=g.name, num_used_data=g.num_used_data, shuffle_lines=g.shuffle_lines,
                                shuffle_seed=g.shuffle_seed, stall_warn_s=config.stall_warn_s,
                                timeout_s=config.timeout_s, **elastic)
    except ManifestError:  # names the manifest and the remedy itself: the groups YAML is not at fault
        raise
    except ValueError as exc:
        raise ConfigError(f"{config.groups}: group {g.name!r}: {exc}") from exc


def _packer(groups: list[ResolvedGroup], special: dict[str, int], config: BagelDataConfig,
            make_reader: Callable[[ResolvedGroup], Any]) -> BagelPacker:
    """One reader per group (``make_reader``) owned by a ``BagelPacker``; readers opened so far are closed when
    building fails."""
    readers: list[Any] = []
    try:
        for g in groups:
            readers.append(make_reader(g))
        return BagelPacker(readers, [g.group.weight for g in groups], [g.group.is_mandatory for g in groups],
                           special, config.packer, group_names=[g.group.name for g in groups])
    except BaseException:
        for reader in readers:
            reader.close()
        raise


def _official_chain(groups: list[ResolvedGroup], tokenizer: Any, special: dict[str, int], config: BagelDataConfig,
                    dp_rank: int, dp_size: int, worker: int) -> BagelRNGIterator:
    """Emulated official DataLoader worker ``worker``: its readers, its packer, its RNG streams."""
    from .energon.cookers import make_cook_context
    from .energon.official_order import OfficialOrderReader

    def official_reader(r: ResolvedGroup) -> OfficialOrderReader:
        g = r.group
        paths = _paths(r)
        try:
            ctx = make_cook_context(g.name, tokenizer, g.image_transform_args, g.vit_image_transform_args)
            return OfficialOrderReader(
                paths, ctx, g.num_used_data, seed=config.effective_data_seed, rank=dp_rank,
                world_size=dp_size, num_workers=config.num_workers, worker_id=worker, shuffle_lines=g.shuffle_lines,
                shuffle_seed=g.shuffle_seed, repeat=True, stall_warn_s=config.stall_warn_s,
                timeout_s=config.timeout_s)
        except ManifestError:
            raise
        except ValueError as exc:
            raise ConfigError(f"{config.groups}: group {g.name!r}: {exc}") from exc

    packer = _packer(groups, special, config, official_reader)
    return BagelRNGIterator(packer, rank_seed(config.seed, dp_rank, dp_size), worker_id=worker)


def _fingerprint(config: BagelDataConfig, groups: list[ResolvedGroup], special: dict[str, int], dp_rank: int,
                 dp_size: int) -> dict[str, Any]:
    """What changes the stream besides the stages' own identities (frame_sampler_args does not: no videos)."""
    return {
        "package_version": package_version(),
        "order": config.order,
        "seed": config.seed,
        "data_seed": config.effective_data_seed,
        "dp_rank": dp_rank,
        "dp_size": dp_size,
        "num_workers": config.num_workers,
        "packer": dataclasses.asdict(config.packer),
        "special_tokens": dict(special),
        "groups": [{"name": r.group.name, "dataset_names": list(r.group.dataset_names), "weight": r.group.weight,
                    "is_mandatory": r.group.is_mandatory, "num_used_data": r.group.num_used_data,
                    "shuffle_lines": r.group.shuffle_lines,
                    "shuffle_seed": r.group.shuffle_seed if r.group.shuffle_lines else None,
                    "image_transform_args": r.group.image_transform_args,
                    "vit_image_transform_args": r.group.vit_image_transform_args} for r in groups],
        **({"partitions": config.partitions} if config.order == "elastic" else {}),
    }


def _upstream(config: BagelDataConfig, groups: list, tokenizer: Any, special: dict[str, int], dp_rank: int,
              dp_size: int, seed: int) -> Any:
    """The chain under the loader (and under a prefetch stage): readers -> packer -> RNG iterator, per order."""
    if config.order == "official":
        chains: list[BagelRNGIterator] = []
        try:
            for w in range(config.num_workers):
                chains.append(_official_chain(groups, tokenizer, special, config, dp_rank, dp_size, w))
        except BaseException:
            for c in chains:
                c.close()
            raise
        return OfficialWorkers(chains)
    packer = _packer(groups, special, config, lambda g: _reader(g, tokenizer, config, dp_rank, dp_size))
    return BagelRNGIterator(packer, seed)


def _rank_seed(config: BagelDataConfig, dp_rank: int, dp_size: int) -> int:
    """The rank's packer RNG seed: official ``seed * W + rank``; the elastic order's does not depend on W."""
    if config.order == "elastic":
        return elastic_rank_seed(config.seed, dp_rank)
    return rank_seed(config.seed, dp_rank, dp_size)


def build_upstream(data: ValidatedData, tokenizer: Any, dp_rank: int, dp_size: int) -> Any:
    """The same upstream chain ``build_bagel_train_loader`` builds, from the same validated config: the recipe
    a ``forkserver`` prefetch producer calls to rebuild it in its own process (picklable with
    ``functools.partial``; the producer neither re-reads the files nor re-warns)."""
    config = data.config
    tokenizer, special, _ = add_special_tokens(tokenizer)
    return _upstream(config, data.groups, tokenizer, special, dp_rank, dp_size, _rank_seed(config, dp_rank, dp_size))


def build_bagel_train_loader(config: BagelDataConfig | ValidatedData, tokenizer: Any, context_or_dp: Any = (0, 1),
                             *, length: int | None = None) -> BagelExternalLoader:
    """One rank's external loader from ``config`` (groups YAML + registry + packer knobs + seed + workers).

    ``config``: a ``BagelDataConfig`` (validated here, once: ``validate.validate_data``) or the
    ``ValidatedData`` an entry point already holds. ``context_or_dp`` is ``(dp_rank, dp_size)`` or a Bridge
    ``DatasetBuildContext``; ``length`` (a hint for Megatron) defaults to the context's ``train_samples``, or 1.
    Raises ``ConfigError`` listing every configuration problem.
    """
    data = config if isinstance(config, ValidatedData) else validate_data(config)
    config, groups = data.config, data.groups
    warn_once_if_unproven()  # one WARNING per process outside the versions bit parity was proven on
    shm.reclaim_stale()  # shared memory of killed prefetch jobs on this machine, prefetch on or off
    dp_rank, dp_size = dp_rank_size(context_or_dp)
    if config.order == "elastic" and config.partitions < dp_size:  # every group, before any reader is built
        raise ConfigError(f"data.partitions {config.partitions} is fewer than DP size {dp_size}: DP rank "
                          f"{config.partitions} and above would read nothing in every group; set data.partitions to "
                          "at least the largest DP size the run will use (it is fixed for the life of a run)")
    if length is None:
        length = max(int(getattr(context_or_dp, "train_samples", 0) or 0), 1)
    tokenizer, special, _ = add_special_tokens(tokenizer)
    seed = _rank_seed(config, dp_rank, dp_size)
    logger.info("BAGEL loader: order %s, DP rank %d/%d, groups %s, rank seed %d, data seed %d, %d workers, "
                "prefetch %d", config.order, dp_rank, dp_size, [g.group.name for g in groups], seed,
                config.effective_data_seed, config.num_workers, config.prefetch)
    upstream = _upstream(config, groups, tokenizer, special, dp_rank, dp_size, seed)
    if config.prefetch:
        rebuild = (functools.partial(build_upstream, data, tokenizer, dp_rank, dp_size)
                   if config.prefetch_start != "fork" else None)
        upstream = PrefetchStage(upstream, depth=config.prefetch, start_method=config.prefetch_start, rebuild=rebuild,
                                 timeout_s=config.timeout_s)
    return BagelExternalLoader(upstream, length=length,
                               fingerprint=_fingerprint(config, groups, special, dp_rank, dp_size),
                               topology_keys=ELASTIC_TOPOLOGY_KEYS if config.order == "elastic" else ())
