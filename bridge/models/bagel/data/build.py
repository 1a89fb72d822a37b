"""Config-driven assembly: per-group readers → BagelPacker → BagelRNGIterator → [PrefetchStage] →
BagelExternalLoader, each stage owning the one before it.

``data.order: elastic`` (the default): one ``GroupReader`` per group with an ``ElasticPlan``, all reading ahead in one
pool of ``data.num_workers`` worker processes per rank (``energon.readers.pool``). ``data.order: official``
replaces the reader/packer/RNG part by ``OfficialWorkers`` over ``num_workers`` emulated official DataLoader
workers, each a ``BagelRNGIterator(BagelPacker([GroupReader with an OfficialPlan per group]))`` chain (see
``pipeline.official_mode``).

``build_bagel_train_loader`` builds one rank's loader for any number of groups from the grouped YAML;
``build_bagel_valid_loader`` the validation stream over ``data.valid``'s groups with the same builder
(``pipeline.valid.BagelValidLoader``: rebuilt from ``data.seed`` at every evaluation). Both run after the one
validation pass (``config.validate_data``; pass its ``ValidatedData`` to skip a second pass); the stages trust the
validated configuration. ``providers.BagelDatasetProvider`` wraps it for Bridge's standard ``pretrain()``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from .config import BagelDataConfig, ConfigError, ResolvedGroup, ValidatedData, validate_data
from .energon.cooking import make_cook_context
from .energon.cooking.video import require_decord, video_lines_of
from .energon.layout import ManifestError
from .energon.readers import GroupDatasets, ReadPool, open_group_reader
from .packing import BagelPacker, BalancedPacker
from .parity import warn_once_if_unproven
from .pipeline import shm
from .pipeline.loader import BagelExternalLoader
from .pipeline.official_mode import OfficialWorkers
from .pipeline.prefetch import PrefetchStage
from .pipeline.rng import BagelRNGIterator, elastic_rank_seed
from .pipeline.valid import BagelValidLoader
from .state import ELASTIC_TOPOLOGY_KEYS
from .tokenizer import add_special_tokens

__all__ = ["build_bagel_train_loader", "build_bagel_valid_loader", "build_upstream", "dp_rank_size", "rank_seed"]

logger = logging.getLogger(__name__)


def dp_rank_size(context_or_dp: Any) -> tuple[int, int]:
    """(DP rank, DP size) from a ``(rank, size)`` pair or a build context (``context.pg_collection.dp``).

    A context without ``pg_collection`` (Bridge's MIMO path) means every data rank reads the same global
    stream: (0, 1).
    """
    if isinstance(context_or_dp, (tuple, list)):
        rank, size = (int(v) for v in context_or_dp)
    else:
        dp = getattr(getattr(context_or_dp, "pg_collection", None), "dp", None)
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


def _group_datasets(group: ResolvedGroup, config: BagelDataConfig) -> GroupDatasets:
    """The converted Energon directories of one group (present: ``validate_data`` checked them)."""
    try:
        return GroupDatasets([str(entry.energon_path) for entry in group.datasets], group.group.name)
    except ManifestError:  # names the manifest and the remedy itself: the groups YAML is not at fault
        raise
    except ValueError as exc:
        raise ConfigError(f"{config.groups_source}: group {group.group.name!r}: {exc}") from exc


def _describe_verification(datasets: list[GroupDatasets], config: BagelDataConfig) -> None:
    """One warning when samples will be read unverified: ``data.verify_checksums`` off, or datasets that record no
    checksums (converted before them, or not by ``bagel-data convert``)."""
    total = sum(len(d.paths) for d in datasets)
    if not config.verify_checksums:
        logger.warning("data.verify_checksums is false: the samples of %d datasets are not verified on read", total)
        return
    unverified = [p for d in datasets for p in d.unverified()]
    if unverified:
        logger.warning("%d of %d datasets record no checksums (converted before they existed, or not by bagel-data "
                       "convert): their samples are not verified on read; convert them again (--overwrite) to verify "
                       "them: %s", len(unverified), total,
                       ", ".join(unverified[:5]) + (f" (+{len(unverified) - 5} more)" if len(unverified) > 5 else ""))


def _reader(order: str, group: ResolvedGroup, datasets: GroupDatasets, tokenizer: Any, config: BagelDataConfig,
            dp_rank: int, dp_size: int, **kw: Any) -> Any:
    g = group.group
    try:
        ctx = make_cook_context(g.name, tokenizer, g.image_transform_args, g.vit_image_transform_args,
                                verify_checksums=config.verify_checksums,
                                truncated_images=config.truncated_images, frame_sampler_args=g.frame_sampler_args)
        _check_video(g.name, datasets, ctx, config)
        return open_group_reader(order, datasets, ctx, num_used_data=g.num_used_data, shuffle_lines=g.shuffle_lines,
                                 shuffle_seed=g.shuffle_seed, seed=config.effective_data_seed, dp_rank=dp_rank,
                                 dp_size=dp_size, partitions=config.partitions, stall_warn_s=config.stall_warn_s,
                                 timeout_s=config.timeout_s, **kw)
    except ManifestError:
        raise
    except ValueError as exc:
        raise ConfigError(f"{config.groups_source}: group {g.name!r}: {exc}") from exc


def _check_video(group: str, datasets: GroupDatasets, ctx: Any, config: BagelDataConfig) -> None:
    """A group whose datasets hold video files needs decord (the ``video`` extra; frame folders need PIL only): one
    ConfigError line otherwise; one warning when it has video lines and no ``frame_sampler_args`` (they are dropped
    as ``no_frame_sampler``)."""
    counts = [video_lines_of(p) for p in datasets.paths]
    lines, files = sum(c[0] for c in counts), sum(c[1] for c in counts)
    if not lines:
        return
    if ctx.frame_sampler is None:
        logger.warning("%s: group %r: %d video lines and no frame_sampler_args: they are dropped (no_frame_sampler)",
                       config.groups_source, group, lines)
        return
    try:
        if files:
            require_decord(f"{config.groups_source}: group {group!r} ({files} video files)")
    except ModuleNotFoundError as exc:
        raise ConfigError(str(exc)) from None


def _packer(groups: list[ResolvedGroup], special: dict[str, int], config: BagelDataConfig,
            make_reader: Callable[[int, ResolvedGroup], Any]) -> BagelPacker:
    """One reader per group (``make_reader(index, group)``) owned by a ``BagelPacker`` (``BalancedPacker`` under
    ``packer.strategy: balanced``); readers opened so far are closed when building fails."""
    readers: list[Any] = []
    try:
        for i, g in enumerate(groups):
            readers.append(make_reader(i, g))
        packer_cls = BalancedPacker if config.packer.strategy == "balanced" else BagelPacker
        return packer_cls(readers, [g.group.weight for g in groups], [g.group.is_mandatory for g in groups],
                          special, config.packer, group_names=[g.group.name for g in groups])
    except BaseException:
        for reader in readers:
            reader.close()
        raise


def _upstream(config: BagelDataConfig, groups: list[ResolvedGroup], tokenizer: Any, special: dict[str, int],
              dp_rank: int, dp_size: int, *, describe: bool = False) -> Any:
    """The chain under the loader (and under a prefetch stage): readers -> packer -> RNG iterator, per order;
    ``describe``: say which datasets are read unverified (once per job: rank 0, not a rebuilding producer)."""
    datasets = [_group_datasets(g, config) for g in groups]
    if describe:
        _describe_verification(datasets, config)
    if config.order == "official":
        chains: list[BagelRNGIterator] = []
        try:
            for w in range(config.num_workers):
                packer = _packer(groups, special, config, lambda i, g: _reader(
                    "official", g, datasets[i], tokenizer, config, dp_rank, dp_size, num_workers=config.num_workers,
                    worker_id=w))
                chains.append(BagelRNGIterator(packer, rank_seed(config.seed, dp_rank, dp_size), worker_id=w))
        except BaseException:
            for c in chains:
                c.close()
            raise
        return OfficialWorkers(chains)
    pool = None
    if config.num_workers > 0:
        shm.register_workers()  # the read workers' shared memory is reclaimed by the next start if the job is killed
        pool = ReadPool(config.num_workers)
    packer = _packer(groups, special, config, lambda i, g: _reader("elastic", g, datasets[i], tokenizer, config,
                                                                  dp_rank, dp_size, pool=pool))
    return BagelRNGIterator(packer, elastic_rank_seed(config.seed, dp_rank))


def build_upstream(data: ValidatedData, tokenizer: Any, dp_rank: int, dp_size: int) -> Any:
    """The same source chain ``build_bagel_train_loader`` builds, from the same validated config: the recipe
    a ``forkserver`` prefetch producer calls to rebuild it in its own process (picklable with
    ``functools.partial``; the producer neither re-reads the files nor re-warns)."""
    tokenizer, special, _ = add_special_tokens(tokenizer)
    return _upstream(data.config, data.groups, tokenizer, special, dp_rank, dp_size)


def build_bagel_train_loader(config: BagelDataConfig | ValidatedData, tokenizer: Any, context_or_dp: Any = (0, 1),
                             *, length: int | None = None) -> BagelExternalLoader:
    """One rank's external loader from ``config`` (groups YAML + registry + packer knobs + seed + workers).

    ``config``: a ``BagelDataConfig`` (validated here, once: ``config.validate_data``) or the ``ValidatedData`` an
    entry point already holds. ``context_or_dp`` is ``(dp_rank, dp_size)`` or a Bridge ``DatasetBuildContext``;
    ``length`` (a hint for Megatron) defaults to the context's ``train_samples``, or 1. Raises ``ConfigError``
    listing every configuration problem.
    """
    data = config if isinstance(config, ValidatedData) else validate_data(config)
    dp_rank, dp_size = dp_rank_size(context_or_dp)
    if length is None:
        length = max(int(getattr(context_or_dp, "train_samples", 0) or 0), 1)
    return _build_loader(data, tokenizer, dp_rank, dp_size, True, length=length)


def _build_loader(data: ValidatedData, tokenizer: Any, dp_rank: int, dp_size: int, announce: bool, *, length: int,
                  what: str = "BAGEL loader") -> BagelExternalLoader:
    """One rank's loader from validated ``data``; ``announce``: log the loader line and the verification warning
    (a validation stream rebuilt at every evaluation announces itself once: its ``build(first)``)."""
    config, groups = data.config, data.groups
    warn_once_if_unproven()  # one WARNING per process outside the versions bit parity was proven on
    shm.reclaim_stale()  # shared memory of killed jobs (read workers, prefetch) on this machine, whatever this one runs
    tokenizer, special, _ = add_special_tokens(tokenizer)
    if announce:
        logger.info("%s: order %s, DP rank %d/%d, groups %s, data seed %d, %d workers, prefetch %d", what,
                    config.order, dp_rank, dp_size, [g.group.name for g in groups], config.effective_data_seed,
                    config.num_workers, config.prefetch)
    upstream = _upstream(config, groups, tokenizer, special, dp_rank, dp_size, describe=announce and dp_rank == 0)
    if config.prefetch:
        rebuild = (functools.partial(build_upstream, data, tokenizer, dp_rank, dp_size)
                   if config.prefetch_start != "fork" else None)
        upstream = PrefetchStage(upstream, depth=config.prefetch, start_method=config.prefetch_start, rebuild=rebuild,
                                 timeout_s=config.timeout_s)
    return BagelExternalLoader(upstream, length=length, fingerprint=data.fingerprint(special, dp_rank, dp_size),
                               topology_keys=ELASTIC_TOPOLOGY_KEYS if config.order == "elastic" else (),
                               fresh_stream=config.fresh_stream, resume_budget_change=config.resume_budget_change)


def build_bagel_valid_loader(config: BagelDataConfig | ValidatedData, tokenizer: Any, context_or_dp: Any = (0, 1),
                             *, batches_per_eval: int) -> BagelValidLoader:
    """One rank's validation stream over ``data.valid``'s groups: the training builder's chain (same packer,
    seed, order, partitions, workers; no prefetch process), rebuilt from ``data.seed`` at the first pull of every
    evaluation, so every evaluation gets the same ``batches_per_eval`` packed batches (``BagelValidLoader``).

    ``config``: as for ``build_bagel_train_loader`` (validated here when a ``BagelDataConfig``: the one pass checks
    the validation groups with training's). ``context_or_dp``: ``(dp_rank, dp_size)`` or a Bridge build context,
    the same DP slicing as training. ``batches_per_eval``: micro-batches one evaluation pulls on this rank (> 0).
    Raises ``ValueError`` when ``data.valid`` is not set, ``ConfigError`` listing every configuration problem.
    """
    data = config if isinstance(config, ValidatedData) else validate_data(config)
    if not data.has_valid:
        raise ValueError("build_bagel_valid_loader: data.valid is not set (the validation split's groups and "
                         "registry: docs/configuration.md)")
    valid = data.valid_data()
    dp_rank, dp_size = dp_rank_size(context_or_dp)
    build = functools.partial(_build_loader, valid, tokenizer, dp_rank, dp_size, length=batches_per_eval,
                              what="BAGEL validation loader (rebuilt at every evaluation)")
    return BagelValidLoader(build, batches_per_eval, seq_length=valid.config.packer.max_num_tokens)
