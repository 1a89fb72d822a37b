"""The main job: Megatron-style training steps over the external BAGEL loader, on CPU or GPU ranks.

Per step each rank pulls ``global_batch_size / (micro_batch_size × DP)`` packed micro-batches through
Megatron-Bridge's real data path (provider → ``build_pretraining_data_loader(..., "external")`` →
``RerunDataIterator``), validates each against the batch contract, accounts for it, and optionally
records a digest. Loader state is checkpointed with Bridge's own functions and restored on ``train.load``.

Topology (``train.tensor/pipeline/context/virtual_pipeline_model_parallel_size``, see ``topology``): DP
rank/size come from Megatron's ``dp`` group; every rank — all TP/CP peers and every PP stage — builds
and reads its own loader, as BAGEL's packed metadata (sample lengths, masks, position ids) is needed on
every stage; peers of one DP replica therefore read identical streams. With a virtual pipeline the
micro-batches are served to the model chunks through Bridge's ``make_data_iterator_list``.

Validation: with ``data.valid`` and ``train.eval_interval`` > 0, every ``eval_interval`` steps (after the step,
before its checkpoint, as Megatron does) each rank pulls ``train.eval_iters × micro-batches per step`` batches
from the validation stream (``build.build_bagel_valid_loader``, handed over through the same provider and
``RerunDataIterator`` as Bridge's valid split), checks them against the batch contract, and — with a trainer that
has ``eval_step`` — computes their loss without an optimizer step. Every evaluation sees the same batches; rank 0
logs one line per evaluation, and ``train.digest_log`` gets the batches' digests with ``"split": "valid"``.

Training: ``run_job(..., trainer=...)`` also trains a model on every step's micro-batches. The trainer is any
object with the ``Trainer`` protocol below (the reference one is ``bridge.models.bagel.model.trainer``, composed
by the launcher ``bridge.models.bagel.launch``; this data package never imports a model). Without one
(``None``) the job is data-only: the pipeline measured alone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch.distributed as dist

from .._bridge import import_bridge
from ..config import ConfigError
from ..packing import batch_digest
from ..config import ValidatedData, validate_data
from .batch_check import account_batch, check_batch
from .checkpoint import (PackedLedger, check_resume_dp, load_trainer_state, read_step, restore_loader,
                         save_checkpoint)
from .config import JobConfig, validate_job
from .startup import StartupClock, reduce_startup
from .straggler import StragglerMeter
from .telemetry import Telemetry
from .topology import agree, rank_coords
from .world import completed_epochs, reduce_world

__all__ = ["DataContractError", "JobIterators", "Trainer", "build_iterator", "build_iterators", "run_job"]

logger = logging.getLogger(__name__)


class DataContractError(RuntimeError):
    """A batch violated the packed-batch contract."""


class Trainer(Protocol):
    """What ``run_job`` trains. Every method is called on every rank at the same point (collectives allowed).

    ``train_step(batches, step)``: forward, backward and one optimizer step over this rank's micro-batches of
    job step ``step`` (a list of packed batch dicts, already checked against the contract); returns at least
    ``{"loss": float}`` (the step's loss, identical on every rank), optionally more scalars (logged too).
    ``state_dict()``: everything a restart needs besides the loader (model, optimizer), torch-saveable with
    ``weights_only`` types; rank 0's is written. ``load_state_dict(state)``: restore it (every rank).
    ``eval_step(batches, step)`` (optional: a trainer without it gets a data-only evaluation): the loss over this
    rank's validation batches of the evaluation after step ``step``, without gradients or an optimizer step;
    returns at least ``{"loss": float}``, identical on every rank.
    """

    def train_step(self, batches: Sequence[Mapping[str, Any]], step: int) -> Mapping[str, float]: ...

    def eval_step(self, batches: Sequence[Mapping[str, Any]], step: int) -> Mapping[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class JobIterators(NamedTuple):
    """What ``build_iterators`` returns: the training iterator Megatron's loop pulls (``RerunDataIterator``) and
    the loader under it; the validation iterator and its ``BagelValidLoader`` (None without validation)."""

    train: Any
    loader: Any
    valid: Any = None
    valid_loader: Any = None


def evaluations(train_iters: int, eval_interval: int) -> int:
    """How many evaluations a run of ``train_iters`` steps makes (``eval_interval`` 0: none)."""
    return train_iters // eval_interval if eval_interval > 0 else 0


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
    valid_samples = valid_batches_per_eval * pg_collection.dp.size() * evaluations(train.train_iters,
                                                                                    train.eval_interval)
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
        loaders = []
        for ds in (train_ds, valid_ds):
            loaders.append(None if ds is None else api.build_pretraining_data_loader(
                ds, 0, provider.dataloader_type, train.micro_batch_size, provider.num_workers, True,
                collate_fn=provider.get_collate_fn(), pin_memory=False, data_parallel_rank=pg_collection.dp.rank(),
                data_parallel_size=pg_collection.dp.size()))
        if loaders[0] is not loader or loaders[1] is not valid_loader:
            raise RuntimeError("build_pretraining_data_loader(..., 'external') did not return the provider's loader")
    except BaseException:
        loader.close()
        if valid_loader is not None:
            valid_loader.close()
        raise
    return JobIterators(RerunDataIterator(loader), loader,
                        RerunDataIterator(valid_loader) if valid_loader is not None else None, valid_loader)


def build_iterator(cfg: JobConfig, pg_collection: Any, tokenizer: Any, data: ValidatedData | None = None
                   ) -> tuple[Any, Any]:
    """The training part of ``build_iterators``: ``(RerunDataIterator, loader)``."""
    its = build_iterators(cfg, pg_collection, tokenizer, data)
    return its.train, its.loader


def _evaluate(step: int, valid: Any, num_batches: int, trainer: Any, cfg: JobConfig, coords: Mapping[str, Any],
              digest_fh: Any) -> dict[str, Any]:
    """One evaluation after ``step``: ``num_batches`` validation batches per rank, checked against the batch
    contract, their loss through ``trainer.eval_step`` when it has one; collective (every rank). Returns
    ``{"step", "batches" (over all ranks), "digest" (sha256 over every rank's batch digests in rank order),
    "loss" (float or None)}``; writes the batches' digests (``"split": "valid"``) to ``digest_fh``."""
    packer_cfg = cfg.data.packer
    rank = coords["rank"]
    batches: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    error: BaseException | None = None
    try:
        for i in range(num_batches):
            batch = next(valid)
            problems = check_batch(batch, max_num_tokens=packer_cfg.max_num_tokens, use_flex=packer_cfg.use_flex,
                                   max_latent_size=packer_cfg.max_latent_size,
                                   max_num_patch_per_side=packer_cfg.max_num_patch_per_side)
            if problems:
                raise DataContractError(f"rank {rank} evaluation at step {step} batch {i}: " + "; ".join(problems))
            batches.append(batch)
            rows.append({**coords, "split": "valid", "step": step, "micro": i, "digest": batch_digest(batch)})
    except Exception as exc:  # noqa: BLE001 - agreed on below, then raised on every rank
        error = exc
    agree(error, f"in the evaluation at step {step}", warn_s=cfg.data.stall_warn_s)
    loss = None
    eval_step = getattr(trainer, "eval_step", None)
    if eval_step is not None:
        loss = float(eval_step(batches, step)["loss"])
        for row in rows:
            row["loss"] = loss.hex()
    del batches
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [row["digest"] for row in rows])
    digest = hashlib.sha256("".join(d for ds in gathered for d in ds).encode()).hexdigest()
    if digest_fh is not None and rows:
        digest_fh.write("".join(json.dumps(row) + "\n" for row in rows))
        digest_fh.flush()
    return {"step": step, "batches": sum(len(ds) for ds in gathered), "digest": digest, "loss": loss}


def _chunk_iterators(iterator: Any, vpp: int | None) -> list[Any]:
    """One step's per-model-chunk iterators: Bridge's ``make_data_iterator_list`` over ``vpp`` chunks, or
    ``[iterator]`` without a virtual pipeline (the source advances once per micro-batch either way)."""
    if not vpp:
        return [iterator]
    return import_bridge().make_data_iterator_list([None] * vpp, iterator)


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
        for opened in (its.loader, its.valid_loader):
            if opened is not None:
                opened.close()
        raise
    assert data is not None
    return its, start_step, data


def _report_startup(clock: StartupClock) -> dict[str, Any]:
    """Close the start-up: the world's slowest rank and when it was ready (``reduce_startup``; what the first step
    waited for), the ``start-up:`` line on rank 0; returns ``StartupClock.report`` (the summary's ``startup_s``)."""
    slowest = reduce_startup(clock)
    if dist.get_rank() == 0:
        logger.info("%s", clock.line(slowest))
    return clock.report(slowest)


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


def _pull_step(step: int, chunks: list[Any], num_micro: int, packer_cfg: Any, coords: Mapping[str, Any],
               tele: Telemetry, straggler: StragglerMeter, batches: list[dict[str, Any]],
               rows: list[dict[str, Any]] | None) -> None:
    """This rank's ``num_micro`` micro-batches of ``step``: each pulled (its wait timed), the same object for every
    model chunk, checked against the batch contract, accounted (``tele``, ``straggler``); appended to
    ``batches`` and, when ``rows`` is a list, one digest row each (with the ledger's ``reads`` under the elastic
    order). Raises ``DataContractError`` (or the loader's error) at the first bad micro-batch."""
    rank = coords["rank"]
    for micro in range(num_micro):
        t0 = time.perf_counter()
        batch = next(chunks[0])
        wait = time.perf_counter() - t0
        batches.append(batch)
        if any(next(view) is not batch for view in chunks[1:]):
            raise DataContractError(f"rank {rank} step {step}: model chunks saw different micro-batches")
        problems = check_batch(batch, max_num_tokens=packer_cfg.max_num_tokens, use_flex=packer_cfg.use_flex,
                               max_latent_size=packer_cfg.max_latent_size,
                               max_num_patch_per_side=packer_cfg.max_num_patch_per_side)
        if problems:
            raise DataContractError(f"rank {rank} step {step} micro-batch {micro}: " + "; ".join(problems))
        tele.record(account_batch(batch, max_num_tokens=packer_cfg.max_num_tokens), wait)
        straggler.record(step, batch)
        if rows is not None:
            row = {**coords, "step": step, "micro": micro, "digest": batch_digest(batch)}
            reads = [[d["dataset_name"], d["position"], d["epoch"]]
                     for d in batch.get("batch_data_indexes", ()) if "position" in d]
            if reads:  # elastic order: the ledger's identity of every packed sample
                row["reads"] = reads
            rows.append(row)


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
    the straggler figures; ``start_step``, ``steps`` run, ``stream_position`` (batches
    each rank's loader has handed out since its data stream began), ``layout``; ``stopped_at_epoch`` when
    ``train.stop_at_epoch`` ended the run early; ``startup_s``: this rank's seconds from its process's start to
    the first step, per phase, and the world's slowest rank with the time it was ready) and ``pipeline``, this
    rank's own ``loader.stats()``.

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
    train, packer_cfg = cfg.train, cfg.data.packer
    coords = rank_coords(pg_collection)
    rank, dp_size = coords["rank"], coords["dp_size"]
    layout = train.parallel_layout(dist.get_world_size())
    if layout["dp"] != dp_size:
        raise ConfigError(f"train: Megatron's data-parallel group has {dp_size} ranks, the config implies {layout['dp']}")
    num_micro = _init_megatron_globals(train, rank, dp_size)
    vpp = train.virtual_pipeline_model_parallel_size
    per_eval = train.eval_iters * num_micro if cfg.data.valid is not None and train.eval_interval > 0 else 0
    (iterator, loader, valid, valid_loader), start_step, data = _open_streams(
        cfg, pg_collection, tokenizer, data, trainer, clock, per_eval)
    startup_s = _report_startup(clock)
    ledger = PackedLedger(None if cfg.data.fresh_stream else train.load, start_step)  # at every checkpoint
    if rank == 0:
        _announce_validation(cfg, valid is not None, num_micro)
    eval_results: list[dict[str, Any]] = []

    weights = {g.name: g.weight for g in data.group_configs}
    group_names = list(weights)
    tele = Telemetry(max_num_tokens=packer_cfg.max_num_tokens, group_weights=weights,
                     tensorboard_dir=train.tensorboard_dir if rank == 0 else None, enabled=rank == 0)
    straggler = StragglerMeter(packer_cfg.cost, enabled=rank == 0)
    digest_fh = open(train.digest_log, "a", encoding="utf-8") if train.digest_log else None
    bar = None
    if rank == 0 and train.progress:
        from tqdm import tqdm

        bar = tqdm(total=train.train_iters, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
    last_step, stopped = start_step, None
    try:
        for step in range(start_step + 1, train.train_iters + 1):
            step_t0 = time.perf_counter()
            batches: list[dict[str, Any]] = []
            rows: list[dict[str, Any]] = []
            step_error: BaseException | None = None
            try:
                _pull_step(step, _chunk_iterators(iterator, vpp), num_micro, packer_cfg, coords, tele, straggler,
                           batches, rows if digest_fh is not None else None)
            except Exception as exc:  # noqa: BLE001 - agreed on below, then raised on every rank
                step_error = exc
            ledger.add(batches)
            # Every rank learns of a failing rank's data error at the same step, so none waits in a collective.
            agree(step_error, f"at step {step}", warn_s=cfg.data.stall_warn_s)
            if trainer is not None:
                metrics = dict(trainer.train_step(batches, step))
                tele.record_step(step, metrics)
                for row in rows:  # exact per-step loss, for resume checks (float.hex: every bit)
                    row["loss"] = float(metrics["loss"]).hex()
            del batches  # freed before the next step pulls its own (a 32K-token pack is ~100 MB)
            tele.record_step_time(time.perf_counter() - step_t0)
            if digest_fh is not None and rows:
                digest_fh.write("".join(json.dumps(row) + "\n" for row in rows))
                digest_fh.flush()
            last_step = step
            world = None
            if train.stop_at_epoch is not None:  # the world's completed epochs, every step (two small collectives)
                world = reduce_world(tele.local(), loader.stats(), group_names, pg_collection.dp)
                done = {g: e for g, e in completed_epochs(world).items() if e >= train.stop_at_epoch}
                if done:
                    stopped = {"step": step, "epochs": done}
            if step % train.log_interval == 0 or step == train.train_iters or stopped:
                if world is None:  # TP/PP/CP peers hold copies of the same batches: reduced over DP only
                    world = reduce_world(tele.local(), loader.stats(), group_names, pg_collection.dp)
                waits = straggler.log(step, straggler.reduce(pg_collection.dp))  # compute per step over DP ranks
                tele.log(step, world, extra=waits)
            if valid is not None and step % train.eval_interval == 0:
                result = _evaluate(step, valid, per_eval, trainer, cfg, coords, digest_fh)
                eval_results.append(result)
                if rank == 0:
                    loss_text = "n/a (data only)" if result["loss"] is None else f"{result['loss']:.6g}"
                    logger.info("eval at step %d | batches %d | digest %s | loss %s", step, result["batches"],
                                result["digest"][:16], loss_text)
            if train.exit_after_step is not None and step == train.exit_after_step:
                logger.warning("train.exit_after_step=%d: simulating a crash (no final checkpoint)", step)
                if digest_fh is not None:
                    digest_fh.close()
                dist.barrier()
                os._exit(17)
            if train.save and ((train.save_interval and step % train.save_interval == 0)
                               or step == train.train_iters or stopped):
                save_checkpoint(train.save, step, iterator, pg_collection,
                                trainer_state=trainer.state_dict() if trainer is not None else None, ledger=ledger)
                logger.info("saved checkpoint at step %d to %s", step, train.save)
            if bar is not None:
                bar.update(1)
            if stopped:
                if rank == 0:
                    logger.info("train.stop_at_epoch=%d: stopping after step %d (of train_iters %d): group(s) %s "
                                "completed epoch %d over the %d DP ranks", train.stop_at_epoch, step,
                                train.train_iters, ", ".join(repr(g) for g in stopped["epochs"]),
                                train.stop_at_epoch, dp_size)
                break
        own = loader.stats()
        final = reduce_world(tele.local(p95=True), own, group_names, pg_collection.dp)
        logger.debug("this rank's pipeline counters at the end: %s", json.dumps(own, default=str))
    finally:
        if bar is not None:
            bar.close()
        if digest_fh is not None:
            digest_fh.close()
        tele.close()
        loader.close()
        if valid_loader is not None:
            valid_loader.close()
    summary = {**tele.summary(final), **straggler.summary()}
    summary.update(start_step=start_step, steps=last_step - start_step, micro_batches_per_step=num_micro,
                   stream_position=own.get("position"), startup_s=startup_s,
                   layout=layout, **({"stopped_at_epoch": stopped} if stopped else {}))
    if eval_results:  # the count and the last one: the summary stays small however many evaluations ran
        summary["evaluations"] = len(eval_results)
        summary["eval_last"] = eval_results[-1]
    summary["pipeline"] = own  # this rank's own counters (``loader.stats()``): not part of the logged line
    return summary
