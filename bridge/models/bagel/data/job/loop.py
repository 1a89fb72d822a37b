"""The main job's steps: ``JobLoop`` runs ``pull → agree → train → record`` per step, the interval work as a
``Schedule``.

The loop owns the run's recorders: telemetry, straggler meter, the packed ledger saved with every checkpoint
(``checkpoint.PackedLedger``), digest file (``train.digest_log``), progress bar.
**pull**: this rank's micro-batches, each timed, the same object for every model chunk, checked against the batch
contract, accounted; **agree**: every rank learns of any rank's data error at the same step (``topology.agree``);
**train**: the trainer's step (``Trainer``; none: data-only); **record**: the step's time and digest rows, then,
on the steps the schedule needs the world's numbers, ONE world reduce (``world.reduce_world``: telemetry, pipeline
counters and the straggler meter's compute per step in one summed and one maxed vector) that the stop-at-epoch
check, the straggler line and the interval line read. Then the scheduled work: evaluate, the simulated crash
(``train.exit_after_step``), save, the progress bar, the ``train.stop_at_epoch`` stop.

Validation: with ``data.valid`` and ``train.eval_interval`` > 0, every ``eval_interval`` steps (after the step,
before its checkpoint, as Megatron does) each rank pulls ``train.eval_iters × micro-batches per step`` batches
from the validation stream (``build.build_bagel_valid_loader``, handed over through the same provider and
``RerunDataIterator`` as Bridge's valid split), checks them against the batch contract, and — with a trainer that
has ``eval_step`` — computes their loss without an optimizer step. Every evaluation sees the same batches; rank 0
logs one line per evaluation, and ``train.digest_log`` gets the batches' digests with ``"split": "valid"``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch.distributed as dist

from .._bridge import import_bridge
from ..packing import batch_digest
from .batch_check import account_batch, check_batch
from .checkpoint import PackedLedger, save_checkpoint
from .config import JobConfig
from .straggler import StragglerMeter
from .telemetry import Telemetry
from .topology import agree
from .world import reduce_world

__all__ = ["DataContractError", "JobLoop", "Schedule", "Trainer"]

logger = logging.getLogger(__name__)

Batch = dict[str, Any]  # one packed micro-batch (the batch contract: ``batch_check``)


class DataContractError(RuntimeError):
    """A batch violated the packed-batch contract."""


class Trainer(Protocol):
    """What the job trains. Every method is called on every rank at the same point (collectives allowed).

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


class Schedule(NamedTuple):
    """The interval work of ``train`` (``job.config.TrainConfig``), step by step: the log line every
    ``log_interval`` steps, at ``train_iters`` and where ``stop_at_epoch`` stops (the world's completed epochs are
    checked after every step when it is set); with ``evaluating`` (a validation stream is open) an evaluation every
    ``eval_interval`` steps; the simulated crash at ``exit_after_step``; with ``save`` a checkpoint every
    ``save_interval`` steps (0 / None: none between), at ``train_iters`` and where the run stops."""

    train: Any
    evaluating: bool

    def logs(self, step: int, stopped: bool = False) -> bool:
        return step % self.train.log_interval == 0 or step == self.train.train_iters or stopped

    def reduces(self, step: int) -> bool:
        """The world's numbers are needed after ``step``: for the stop-at-epoch check or the log line."""
        return self.train.stop_at_epoch is not None or self.logs(step)

    def evaluates(self, step: int) -> bool:
        return self.evaluating and step % self.train.eval_interval == 0

    def crashes(self, step: int) -> bool:
        return step == self.train.exit_after_step

    def saves(self, step: int, stopped: bool = False) -> bool:
        t = self.train
        return bool(t.save) and (bool(t.save_interval and step % t.save_interval == 0) or step == t.train_iters
                                 or stopped)


class JobLoop:
    """The steps ``start_step + 1 .. train.train_iters`` of one job, on every rank (collective throughout).

    ``iterator``: the training ``RerunDataIterator`` over ``loader`` (whose ``stats()`` the world reduce reads);
    ``valid``: the validation iterator (None: no evaluation; ``per_eval`` micro-batches per rank each);
    ``num_micro``: micro-batches per step and rank; ``coords``: ``topology.rank_coords`` (the digest rows'
    columns); ``group_weights``: ``{group: weight}`` in config order. Leaving the ``with`` block closes the
    recorders (not the loaders). After ``run``: ``last_step``, ``stopped`` (``{"step", "epochs"}`` when
    ``train.stop_at_epoch`` ended the run), ``evaluations`` (each ``{"step", "batches", "digest", "loss"}``).
    """

    def __init__(self, cfg: JobConfig, pg_collection: Any, iterator: Any, loader: Any, valid: Any,
                 trainer: Trainer | None, *, coords: Mapping[str, Any], group_weights: Mapping[str, float],
                 num_micro: int, per_eval: int, start_step: int) -> None:
        train, packer_cfg = cfg.train, cfg.data.packer
        self.cfg, self.packer_cfg = cfg, packer_cfg
        self.pg_collection, self.iterator, self.loader, self.valid = pg_collection, iterator, loader, valid
        self.trainer, self.coords, self.rank = trainer, coords, coords["rank"]
        self.num_micro, self.per_eval, self.start_step = num_micro, per_eval, start_step
        self.group_names = list(group_weights)
        self.schedule = Schedule(train, valid is not None)
        self.last_step, self.stopped = start_step, None
        self.evaluations: list[dict[str, Any]] = []
        main = self.rank == 0
        self.tele = Telemetry(max_num_tokens=packer_cfg.max_num_tokens, group_weights=group_weights,
                              tensorboard_dir=train.tensorboard_dir if main else None, enabled=main)
        self.straggler = StragglerMeter(packer_cfg.cost, enabled=main)
        self.ledger = PackedLedger(None if cfg.data.fresh_stream else train.load, start_step)  # in every checkpoint
        self.digest_fh = open(train.digest_log, "a", encoding="utf-8") if train.digest_log else None
        self.bar = None
        if main and train.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=train.train_iters, initial=start_step, desc="train", unit="step",
                            dynamic_ncols=True)

    def __enter__(self) -> JobLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.digest_fh is not None:
            self.digest_fh.close()
        self.tele.close()

    def run(self) -> None:
        """Every step of the run, up to ``train.train_iters`` or the step ``train.stop_at_epoch`` stops at."""
        train = self.cfg.train
        for step in range(self.start_step + 1, train.train_iters + 1):
            self._step(step)
            if self.stopped:
                if self.rank == 0:
                    logger.info("train.stop_at_epoch=%d: stopping after step %d (of train_iters %d): group(s) %s "
                                "completed epoch %d over the %d DP ranks", train.stop_at_epoch, step,
                                train.train_iters, ", ".join(repr(g) for g in self.stopped["epochs"]),
                                train.stop_at_epoch, self.coords["dp_size"])
                break

    def finish(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The end of the run: ``(world, own)``, the final world reduce (with the run's p95 wait) and this rank's
        own ``loader.stats()``."""
        own = self.loader.stats()
        world = self._reduce(own, p95=True)
        logger.debug("this rank's pipeline counters at the end: %s", json.dumps(own, default=str))
        return world, own

    # -- one step ------------------------------------------------------------------------------------------------

    def _step(self, step: int) -> None:
        """pull → agree → train → record, then the scheduled interval work of ``step``."""
        step_t0 = time.perf_counter()
        batches, rows = self._agreed(f"at step {step}", lambda b, r: self._pull(step, b, r))
        self.ledger.add(batches)
        loss = None
        if self.trainer is not None:
            metrics = dict(self.trainer.train_step(batches, step))
            self.tele.record_step(step, metrics)
            loss = float(metrics["loss"])
        del batches  # freed before the next step pulls its own (a 32K-token pack is ~100 MB)
        self.tele.step_seconds += time.perf_counter() - step_t0
        self._write_digests(rows, loss)
        self.last_step = step
        self._record(step)
        self._interval_work(step)

    def _agreed(self, what: str, pull: Callable[[list, list], None]) -> tuple[list[Batch], list[dict[str, Any]]]:
        """``(batches, rows)`` that ``pull(batches, rows)`` appended, once every rank has pulled: a failure on any
        rank is raised on every rank at the same point (``topology.agree``, ``what`` names it)."""
        batches: list[dict[str, Any]] = []
        rows: list[dict[str, Any]] = []
        error: BaseException | None = None
        try:
            pull(batches, rows)
        except Exception as exc:  # noqa: BLE001 - agreed on below, then raised on every rank
            error = exc
        agree(error, what, warn_s=self.cfg.data.stall_warn_s)
        return batches, rows

    def _check(self, batch: Mapping[str, Any], where: str) -> None:
        """Raise ``DataContractError`` naming this rank and ``where`` when ``batch`` breaks the batch contract."""
        p = self.packer_cfg
        problems = check_batch(batch, max_num_tokens=p.max_num_tokens, use_flex=p.use_flex,
                               max_latent_size=p.max_latent_size, max_num_patch_per_side=p.max_num_patch_per_side)
        if problems:
            raise DataContractError(f"rank {self.rank} {where}: " + "; ".join(problems))

    def _pull(self, step: int, batches: list[Batch], rows: list[dict[str, Any]]) -> None:
        """This rank's micro-batches of ``step`` into ``batches`` and, with a digest file, their digest rows into
        ``rows`` (module docstring: **pull**); raises ``DataContractError`` (or the loader's error) at the first
        bad one."""
        # one iterator per model chunk (Bridge's make_data_iterator_list): the source advances once per micro-batch
        vpp = self.cfg.train.virtual_pipeline_model_parallel_size
        chunks = import_bridge().make_data_iterator_list([None] * vpp, self.iterator) if vpp else [self.iterator]
        for micro in range(self.num_micro):
            t0 = time.perf_counter()
            batch = next(chunks[0])
            wait = time.perf_counter() - t0
            batches.append(batch)
            if any(next(view) is not batch for view in chunks[1:]):
                raise DataContractError(f"rank {self.rank} step {step}: model chunks saw different micro-batches")
            self._check(batch, f"step {step} micro-batch {micro}")
            self.tele.record(account_batch(batch, max_num_tokens=self.packer_cfg.max_num_tokens), wait)
            self.straggler.record(step, batch)
            if self.digest_fh is not None:
                row = {**self.coords, "step": step, "micro": micro, "digest": batch_digest(batch)}
                reads = [[d["dataset_name"], d["position"], d["epoch"]]
                         for d in batch.get("batch_data_indexes", ()) if "position" in d]
                if reads:  # elastic order: the ledger's identity of every packed sample
                    row["reads"] = reads
                rows.append(row)

    def _write_digests(self, rows: list[dict[str, Any]], loss: float | None) -> None:
        """Append ``rows`` to ``train.digest_log``, one JSON line each, with ``loss`` (the step's or the
        evaluation's; ``float.hex``: every bit, for resume checks) when there is one."""
        if self.digest_fh is None or not rows:
            return
        if loss is not None:
            for row in rows:
                row["loss"] = loss.hex()
        self.digest_fh.write("".join(json.dumps(row) + "\n" for row in rows))
        self.digest_fh.flush()

    def _reduce(self, pipeline: Mapping[str, Any], *, p95: bool = False) -> dict[str, Any]:
        """The job's one world reduce (``world.reduce_world`` over the DP group: TP / PP / CP peers hold copies of the
        same batches), its compute figures booked into the straggler meter. Collective: every rank, the same step."""
        world = reduce_world(self.tele.local(p95=p95), pipeline, self.group_names, self.pg_collection.dp,
                             step_compute=self.straggler.local())
        self.straggler.book(world.pop("step_compute_max"), world.pop("step_compute_mean"), world["dp_size"])
        return world

    def _record(self, step: int) -> None:
        """On the steps the schedule needs the world's numbers: the world reduce, the stop-at-epoch check (the
        world's completed epochs) and, on a log step, the straggler line and the interval line."""
        if not self.schedule.reduces(step):
            return
        world = self._reduce(self.loader.stats())
        stop_at = self.cfg.train.stop_at_epoch
        if stop_at is not None:
            done = {g: e for g, v in world["groups"].items() if (e := v["epoch"]) is not None and e >= stop_at}
            if done:
                self.stopped = {"step": step, "epochs": done}
        if self.schedule.logs(step, bool(self.stopped)):
            waits = self.straggler.log(step, self.straggler.interval())  # compute per step over DP ranks
            self.tele.log(step, world, extra=waits)

    def _interval_work(self, step: int) -> None:
        """The schedule's work after ``step``'s record: evaluation, the simulated crash, the checkpoint, the bar."""
        schedule, train = self.schedule, self.cfg.train
        if schedule.evaluates(step):
            result = self._evaluate(step)
            self.evaluations.append(result)
            if self.rank == 0:
                loss_text = "n/a (data only)" if result["loss"] is None else f"{result['loss']:.6g}"
                logger.info("eval at step %d | batches %d | digest %s | loss %s", step, result["batches"],
                            result["digest"][:16], loss_text)
        if schedule.crashes(step):
            logger.warning("train.exit_after_step=%d: simulating a crash (no final checkpoint)", step)
            if self.digest_fh is not None:
                self.digest_fh.close()
            dist.barrier()
            os._exit(17)
        if schedule.saves(step, bool(self.stopped)):
            save_checkpoint(train.save, step, self.iterator, self.pg_collection,
                            trainer_state=self.trainer.state_dict() if self.trainer is not None else None,
                            ledger=self.ledger)
            logger.info("saved checkpoint at step %d to %s", step, train.save)
        if self.bar is not None:
            self.bar.update(1)

    def _evaluate(self, step: int) -> dict[str, Any]:
        """One evaluation after ``step``: ``per_eval`` validation batches per rank, checked against the batch
        contract, their loss through ``trainer.eval_step`` when it has one; collective (every rank). Returns
        ``{"step", "batches" (over all ranks), "digest" (sha256 over every rank's batch digests in rank order),
        "loss" (float or None)}``; writes the batches' digests (``"split": "valid"``) to the digest file."""
        def pull(batches: list[Batch], rows: list[dict[str, Any]]) -> None:
            for i in range(self.per_eval):
                batch = next(self.valid)
                self._check(batch, f"evaluation at step {step} batch {i}")
                batches.append(batch)
                rows.append({**self.coords, "split": "valid", "step": step, "micro": i,
                             "digest": batch_digest(batch)})

        batches, rows = self._agreed(f"in the evaluation at step {step}", pull)
        loss = None
        eval_step = getattr(self.trainer, "eval_step", None)
        if eval_step is not None:
            loss = float(eval_step(batches, step)["loss"])
        del batches
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, [row["digest"] for row in rows])
        digest = hashlib.sha256("".join(d for ds in gathered for d in ds).encode()).hexdigest()
        self._write_digests(rows, loss)
        return {"step": step, "batches": sum(len(ds) for ds in gathered), "digest": digest, "loss": loss}
