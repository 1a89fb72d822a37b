"""The main job: Megatron-style training steps over the external BAGEL loader, on CPU or GPU ranks.

Per step each rank pulls ``global_batch_size / (micro_batch_size × DP)`` packed micro-batches through
Megatron-Bridge's real data path (provider → ``build_pretraining_data_loader(..., "external")`` →
``RerunDataIterator``), validates each against the batch contract, accounts for it, and optionally
records a digest. Loader state is checkpointed with Bridge's own functions and restored on ``train.load``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from .._bridge import import_bridge
from ..config import ConfigError
from ..packing import batch_digest
from .batch_check import account_batch, check_batch
from .checkpoint import read_step, restore_loader, save_checkpoint
from .config import JobConfig
from .telemetry import Telemetry

__all__ = ["DataContractError", "OtherRankFailed", "build_iterator", "run_job"]

logger = logging.getLogger(__name__)


class DataContractError(RuntimeError):
    """A batch violated the packed-batch contract."""


class OtherRankFailed(RuntimeError):
    """This rank stops because another rank's data pipeline failed (that rank reports why)."""


def _all_ok(ok: bool) -> bool:
    """True on every rank iff ``ok`` holds on every rank (so one failing rank never leaves others hanging)."""
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item()) == 0


def build_iterator(cfg: JobConfig, pg_collection: Any, tokenizer: Any) -> tuple[Any, Any]:
    """Provider → Bridge ``build_pretraining_data_loader(..., "external")`` → ``RerunDataIterator``."""
    from megatron.core.rerun_state_machine import RerunDataIterator

    from ..build import build_bagel_train_loader
    from ..external import BagelMegatronMIMODatasetProvider

    api = import_bridge()
    train = cfg.train
    context = api.DatasetBuildContext(train_samples=train.train_iters * train.global_batch_size, valid_samples=0,
                                      test_samples=0, tokenizer=None, pg_collection=pg_collection)
    loader = build_bagel_train_loader(cfg.data, tokenizer, context)
    provider = BagelMegatronMIMODatasetProvider(train_loader=loader)
    train_ds, valid_ds, test_ds = provider.build_datasets(context)
    assert valid_ds is None and test_ds is None
    external = api.build_pretraining_data_loader(
        train_ds, 0, provider.dataloader_type, train.micro_batch_size, provider.num_workers, True,
        collate_fn=provider.get_collate_fn(), pin_memory=False, data_parallel_rank=pg_collection.dp.rank(),
        data_parallel_size=pg_collection.dp.size())
    if external is not loader:
        raise RuntimeError("build_pretraining_data_loader(..., 'external') did not return the provider's loader")
    return RerunDataIterator(external), loader


def run_job(cfg: JobConfig, pg_collection: Any, tokenizer: Any) -> dict[str, Any]:
    """Run ``cfg.train.train_iters`` steps (from the checkpoint step when ``train.load`` is set)."""
    from megatron.core import num_microbatches_calculator as nmc

    train, packer_cfg = cfg.train, cfg.data.packer
    rank, dp_size = dist.get_rank(), pg_collection.dp.size()
    if train.global_batch_size % (train.micro_batch_size * dp_size):
        raise ConfigError(f"train.global_batch_size {train.global_batch_size} is not divisible by micro_batch_size "
                          f"{train.micro_batch_size} x data-parallel size {dp_size}")
    nmc.init_num_microbatches_calculator(rank, None, train.global_batch_size, train.micro_batch_size, dp_size)
    num_micro = nmc.get_num_microbatches()

    error: BaseException | None = None
    iterator = loader = None
    start_step = 0
    try:
        iterator, loader = build_iterator(cfg, pg_collection, tokenizer)
        if train.load:
            start_step = read_step(train.load)
            restore_loader(train.load, start_step, iterator, pg_collection)
            logger.info("resumed from %s at step %d", train.load, start_step)
    except Exception as exc:  # agree across ranks before raising, so no rank waits forever in a collective
        error = exc
    if not _all_ok(error is None):
        if loader is not None:
            loader.close()
        raise error if error is not None else RuntimeError("another rank failed while building/restoring the loader")

    weights = {g.group.name: g.group.weight for g in cfg.data.load_groups()}
    tele = Telemetry(max_num_tokens=packer_cfg.max_num_tokens, group_weights=weights,
                     tensorboard_dir=train.tensorboard_dir if rank == 0 else None, enabled=rank == 0)
    digest_fh = open(train.digest_log, "a", encoding="utf-8") if train.digest_log else None
    bar = None
    if rank == 0 and train.progress:
        from tqdm import tqdm

        bar = tqdm(total=train.train_iters, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
    try:
        for step in range(start_step + 1, train.train_iters + 1):
            step_error: BaseException | None = None
            try:
                for micro in range(num_micro):
                    t0 = time.perf_counter()
                    batch = next(iterator)
                    wait = time.perf_counter() - t0
                    problems = check_batch(batch, max_num_tokens=packer_cfg.max_num_tokens,
                                           use_flex=packer_cfg.use_flex, max_latent_size=packer_cfg.max_latent_size,
                                           max_num_patch_per_side=packer_cfg.max_num_patch_per_side)
                    if problems:
                        raise DataContractError(f"rank {rank} step {step} micro-batch {micro}: " + "; ".join(problems))
                    tele.record(account_batch(batch, max_num_tokens=packer_cfg.max_num_tokens), wait)
                    if digest_fh is not None:
                        digest_fh.write(json.dumps({"rank": rank, "step": step, "micro": micro,
                                                    "digest": batch_digest(batch)}) + "\n")
                        digest_fh.flush()
            except Exception as exc:  # noqa: BLE001 - agreed on below, then re-raised
                step_error = exc
            # Every rank learns of a failing rank's data error at the same step, so none waits in a collective.
            if not _all_ok(step_error is None):
                raise step_error if step_error is not None else OtherRankFailed(
                    f"rank {rank}: another rank's data pipeline failed at step {step} (see its error line)")
            if step % train.log_interval == 0 or step == train.train_iters:
                tokens = torch.tensor([tele.interval["tokens"]], dtype=torch.int64)
                dist.all_reduce(tokens)
                tele.log(step, loader.stats(), global_tokens=int(tokens.item()))
            if train.exit_after_step is not None and step == train.exit_after_step:
                logger.warning("train.exit_after_step=%d: simulating a crash (no final checkpoint)", step)
                if digest_fh is not None:
                    digest_fh.close()
                dist.barrier()
                os._exit(17)
            if train.save and ((train.save_interval and step % train.save_interval == 0)
                               or step == train.train_iters):
                save_checkpoint(train.save, step, iterator, pg_collection)
                logger.info("saved checkpoint at step %d to %s", step, train.save)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        if digest_fh is not None:
            digest_fh.close()
        tele.close()
        loader.close()
    summary = tele.summary()
    summary.update(start_step=start_step, steps=train.train_iters - start_step, micro_batches_per_step=num_micro,
                   pipeline=loader.stats())
    return summary
