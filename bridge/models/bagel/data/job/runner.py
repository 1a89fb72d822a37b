"""The main job: Megatron-style training steps over the external BAGEL loader, on CPU or GPU ranks.

Per step each rank pulls ``global_batch_size / (micro_batch_size × DP)`` packed micro-batches through
Megatron-Bridge's real data path (provider → ``build_pretraining_data_loader(..., "external")`` →
``RerunDataIterator``), validates each against the batch contract, accounts for it, and optionally
records a digest. Loader state is checkpointed with Bridge's own functions and restored on ``train.load``.
``run_job`` opens the streams (build, restore, agree), runs the steps (``loop.JobLoop``: ``pull → agree → train
→ record``, the interval work as a ``loop.Schedule``) and returns the run's summary.

Topology (``train.tensor/pipeline/context/virtual_pipeline_model_parallel_size``): see ``topology``; every rank
builds and reads its own loader, as BAGEL's packed metadata (sample lengths, masks, position ids) is needed on
every stage.

Validation (``data.valid``, every ``train.eval_interval`` steps): see ``loop``.

Training: ``run_job(..., trainer=...)`` also trains a model on every step's micro-batches. The trainer is any
object with the ``Trainer`` protocol (``loop.Trainer``; the reference one is ``bridge.models.bagel.model.trainer``,
composed by the launcher ``bridge.models.bagel.launch``; this data package never imports a model). Without one
(``None``) the job is data-only: the pipeline measured alone.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch.distributed as dist

from .._bridge import import_bridge
from ..config import ConfigError, ValidatedData, validate_data
from .checkpoint import check_resume_dp, load_trainer_state, read_step, restore_loader
from .config import JobConfig, validate_job
from .loop import DataContractError, JobLoop, Trainer
from .startup import StartupClock, reduce_startup, resume_gc
from .topology import agree, rank_coords

__all__ = ["DataContractError", "JobIterators", "Trainer", "build_iterators", "run_job"]

logger = logging.getLogger(__name__)


class JobIterators(NamedTuple):
    """What ``build_iterators`` returns: the training iterator Megatron's loop pulls (``RerunDataIterator``) and
    the loader under it; the validation iterator and its ``BagelValidLoader`` (None without validation)."""

    train: Any
    loader: Any
    valid: Any = None
    valid_loader: Any = None

    def close(self) -> None:
        """Close the loaders ``build_iterators`` opened (training, then validation; those not opened are None)."""
        for opened in (self.loader, self.valid_loader):
            if opened is not None:
                opened.close()


def build_iterators(cfg: JobConfig, pg_collection: Any, tokenizer: Any, data: ValidatedData | None = None, *,
                    valid_batches_per_eval: int = 0) -> JobIterators:
    """Provider → Bridge ``build_pretraining_data_loader(..., "external")`` → ``RerunDataIterator``, for the
    training loader and, with ``valid_batches_per_eval`` > 0 (micro-batches one evaluation pulls on this rank;
    ``data.valid`` must be set), the validation stream as Bridge's valid split (``BagelValidLoader``).

    ``data``: ``cfg.data`` already through ``validate_data`` (validated here when None)."""
    from megatron.core.rerun_state_machine import RerunDataIterator

    from ..build import build_bagel_train_loader, build_bagel_valid_loader
    from ..external import BagelMegatronMIMODatasetProvider

    api = import_bridge()
    train = cfg.train
    if data is None:
        data = validate_data(cfg.data)
    evaluations = train.train_iters // train.eval_interval if train.eval_interval > 0 else 0
    valid_samples = valid_batches_per_eval * pg_collection.dp.size() * evaluations
    context = api.DatasetBuildContext(train_samples=train.train_iters * train.global_batch_size,
                                      valid_samples=valid_samples, test_samples=0, tokenizer=None,
                                      pg_collection=pg_collection)
    loader = build_bagel_train_loader(data, tokenizer, context)
    valid_loader = None
    try:
        if valid_samples > 0:
            valid_loader = build_bagel_valid_loader(data, tokenizer, context, batches_per_eval=valid_batches_per_eval)
        provider = BagelMegatronMIMODatasetProvider(train_loader=loader, valid_loader=valid_loader)
        train_ds, valid_ds, test_ds = provider.build_datasets(context)
        assert test_ds is None and valid_ds is valid_loader
        loaders = [None if ds is None else api.build_pretraining_data_loader(
            ds, 0, provider.dataloader_type, train.micro_batch_size, provider.num_workers, True,
            collate_fn=provider.get_collate_fn(), pin_memory=False, data_parallel_rank=pg_collection.dp.rank(),
            data_parallel_size=pg_collection.dp.size()) for ds in (train_ds, valid_ds)]
        if loaders[0] is not loader or loaders[1] is not valid_loader:
            raise RuntimeError("build_pretraining_data_loader(..., 'external') did not return the provider's loader")
    except BaseException:
        JobIterators(None, loader, None, valid_loader).close()
        raise
    return JobIterators(RerunDataIterator(loader), loader,
                        RerunDataIterator(valid_loader) if valid_loader is not None else None, valid_loader)


def _init_megatron_globals(train: Any, rank: int, dp_size: int) -> int:
    """Megatron-Core's global micro-batch calculator (``train`` batch sizes over ``dp_size`` ranks) and, where
    nothing made one yet, its rerun state machine in the mode the implicit init would pick (disabled), without the
    implicit init's warnings. Returns the micro-batches per step and rank."""
    from megatron.core import num_microbatches_calculator as nmc
    from megatron.core import rerun_state_machine as rsm

    nmc.init_num_microbatches_calculator(rank, None, train.global_batch_size, train.micro_batch_size, dp_size)
    if rsm._GLOBAL_RERUN_STATE_MACHINE is None:
        rsm_log = logging.getLogger(rsm.__name__)
        level = rsm_log.level
        rsm_log.setLevel(logging.ERROR)  # "initialized in mode RerunMode.DISABLED": the CPU job's only mode
        try:
            rsm.initialize_rerun_state_machine()
        finally:
            rsm_log.setLevel(level)
    return nmc.get_num_microbatches()


def _open_streams(cfg: JobConfig, pg_collection: Any, tokenizer: Any, data: ValidatedData | None,
                  trainer: Trainer | None, clock: StartupClock, per_eval: int
                  ) -> tuple[JobIterators, int, ValidatedData]:
    """Build the training (and validation) streams and, with ``train.load``, restore the loader and the trainer:
    ``(JobIterators, start step, validated data)``. Collective: a failure on any rank is raised on every rank
    (``agree``), after this rank closed what it opened. Marks the clock's ``config`` (when it validates),
    ``resume`` (the checkpoint's checks and the restore), ``Megatron-Bridge import`` and ``loader`` phases."""
    train = cfg.train
    error: BaseException | None = None
    its = JobIterators(None, None)
    start_step = 0
    try:
        if data is None:
            data = validate_job(cfg)  # the one validation pass of this job
            clock.mark("config")
        if train.load:
            start_step = read_step(train.load)
            if not cfg.data.fresh_stream:  # a fresh data stream reads no loader state
                check_resume_dp(train.load, start_step, pg_collection.dp.size(), cfg.data.order)
            clock.mark("resume")  # with the restore below: one phase
        import_bridge()  # what the data path and its checkpoints need; timed apart (most of a CPU start-up)
        clock.mark("Megatron-Bridge import")
        its = build_iterators(cfg, pg_collection, tokenizer, data, valid_batches_per_eval=per_eval)
        clock.mark("loader")
        if train.load:
            restore_loader(train.load, start_step, its.train, pg_collection)
            if trainer is not None:
                trainer.load_state_dict(load_trainer_state(train.load, start_step))
            logger.info("resumed from %s at step %d", train.load, start_step)
            if start_step >= train.train_iters:  # Megatron's rule: nothing to train, not an error
                logger.warning("train.train_iters %d is not above the checkpoint's step %d: no step to run (raise "
                               "train.train_iters to continue training)", train.train_iters, start_step)
            clock.mark("resume")
    except Exception as exc:  # agree across ranks before raising, so no rank waits forever in a collective
        error = exc
    try:
        agree(error, "while building/restoring the loader")
    except BaseException:
        its.close()
        raise
    assert data is not None
    return its, start_step, data


def _announce_validation(cfg: JobConfig, evaluating: bool, num_micro: int) -> None:
    """One line on whether and how this run evaluates on ``data.valid`` (rank 0 calls it)."""
    train = cfg.train
    if evaluating:
        logger.info("validation: every %d steps, %d step(s) x %d micro-batch(es) per rank from data.valid (the same "
                    "batches at every evaluation)", train.eval_interval, train.eval_iters, num_micro)
    elif cfg.data.valid is not None:
        logger.info("validation is off: data.valid is set but this run evaluates nothing (train.eval_interval %d, "
                    "train.eval_iters %d, train.train_iters %d)", train.eval_interval, train.eval_iters,
                    train.train_iters)
    else:
        logger.info("validation is off: data.valid is not set")


def run_job(cfg: JobConfig, pg_collection: Any, tokenizer: Any, data: ValidatedData | None = None,
            trainer: Trainer | None = None, *, startup: StartupClock | None = None) -> dict[str, Any]:
    """Run ``cfg.train.train_iters`` steps (from the checkpoint step when ``train.load`` is set).

    ``data``: ``cfg`` already through ``job.config.validate_job`` (validated here when None). ``trainer``: trains
    on every step's micro-batches and is checkpointed with the loader (``Trainer``); None = data-only. The summary
    then holds ``loss_first`` / ``loss_last`` (the run's first and last step losses). With ``data.valid`` and
    ``train.eval_interval`` > 0 the job evaluates every ``eval_interval`` steps (module docstring); the summary's
    ``evaluations`` counts them and ``eval_last`` is the last one (``step``, ``batches`` over all ranks, ``digest``,
    ``loss`` or None).

    Returns the run's summary (``Telemetry.summary``: every DP rank's numbers, per group epochs, ledger and drops;
    the straggler figures; ``start_step``, ``steps`` run, ``stream_position`` (batches each rank's loader has handed
    out since its data stream began), ``layout``; ``stopped_at_epoch`` when ``train.stop_at_epoch`` ended the run
    early; ``startup_s``: this rank's seconds from its process's start to the first step, per phase, and the world's
    slowest rank with the time it was ready) and ``pipeline``, this rank's own ``loader.stats()``.

    ``startup``: the launcher's ``StartupClock`` with the phases before this call marked (imports, config, process
    groups, tokenizer, model); None books everything before this call to one phase, ``before run_job``. Rank 0 logs
    the start-up once, when the first step begins.

    ``pg_collection`` holds Megatron's ``tp``/``pp``/``cp``/``dp`` groups (``topology.init_model_parallel``).
    Collective: every rank must call it. A failure while building or restoring the loader on any rank is
    raised on every rank as the same ``AgreedError``; a changed DP size on resume is a ``ConfigError``
    (via ``AgreedError``) before the loader is built.
    """
    clock = startup if startup is not None else StartupClock()
    if startup is None:
        clock.mark("before run_job")
    train = cfg.train
    coords = rank_coords(pg_collection)
    rank, dp_size = coords["rank"], coords["dp_size"]
    layout = train.parallel_layout(dist.get_world_size())
    if layout["dp"] != dp_size:
        raise ConfigError(f"train: Megatron's data-parallel group has {dp_size} ranks, the config implies "
                          f"{layout['dp']}")
    num_micro = _init_megatron_globals(train, rank, dp_size)
    per_eval = train.eval_iters * num_micro if cfg.data.valid is not None and train.eval_interval > 0 else 0
    its, start_step, data = _open_streams(cfg, pg_collection, tokenizer, data, trainer, clock, per_eval)
    resume_gc()  # start-up is over and nothing forked yet (the loader's processes start at the first batch)
    slowest = reduce_startup(clock)  # the world's slowest rank and when it was ready: what the first step waited for
    if rank == 0:
        logger.info("%s", clock.line(slowest))
        _announce_validation(cfg, its.valid is not None, num_micro)
    try:
        with JobLoop(cfg, pg_collection, its.train, its.loader, its.valid, trainer, coords=coords,
                     group_weights={g.name: g.weight for g in data.group_configs}, num_micro=num_micro,
                     per_eval=per_eval, start_step=start_step) as loop:
            loop.run()
            final, own = loop.finish()
    finally:
        its.close()
    summary = {**loop.tele.summary(final), **loop.straggler.summary()}
    summary.update(start_step=start_step, steps=loop.last_step - start_step, micro_batches_per_step=num_micro,
                   stream_position=own.get("position"), startup_s=clock.report(slowest), layout=layout,
                   **({"stopped_at_epoch": loop.stopped} if loop.stopped else {}))
    if loop.evaluations:  # the count and the last one: the summary stays small however many evaluations ran
        summary["evaluations"] = len(loop.evaluations)
        summary["eval_last"] = loop.evaluations[-1]
    summary["pipeline"] = own  # this rank's own counters (``loader.stats()``): not part of the logged line
    return summary
