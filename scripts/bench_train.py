#!/usr/bin/env python3
"""Benchmark the data side while a model trains: the trainer's wait in ``next()`` as a share of the step time.

One process, one rank (gloo world of one): the real loader (Energon readers -> packer -> RNG iterator ->
[prefetch]) feeds ``BagelTrainer`` (the tiny reference model: forward, backward, AdamW: what the main job runs per
step). Twice, on the same data and the same model initialisation: prefetch on (``data.prefetch=2``, the producer
forked, as ``configs/demo.yaml`` runs) and prefetch off (inline packing, the baseline of the same run). After
``--warmup`` steps (start-up, first batches), ``--steps`` steps are timed; per step, wait = the time ``next()``
took, step = wait + the training step. The wait share is Σ wait / Σ step.

Budgets: ``configs/demo.yaml``'s (16K expected / 20K max tokens per pack); ``--quick`` (CI smoke run, numbers
meaningless): 4K / 8K-token packs, 1 warm-up and 2 timed steps.

Last line: ``train_wait: wait_share_prefetch=<a> wait_share_inline=<b> step_ms_prefetch=<c> step_ms_inline=<d>
speedup=<d/c>``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

QUICK_BUDGETS = ["data.packer.expected_num_tokens=4096", "data.packer.max_num_tokens=8192",
                 "data.packer.max_num_tokens_per_sample=4096", "data.packer.prefer_buffer_before=2048"]


def measure(data: Path, prefetch: int, warmup: int, steps: int, overrides: list[str], pgs, tokenizer) -> dict:
    """Warm up, then time ``steps`` steps of the loader + trainer; wait / step times in ms."""
    from bridge.models.bagel.data.build import build_bagel_train_loader
    from bridge.models.bagel.data.job.config import load_job_config
    from bridge.models.bagel.data.tokenizer import add_special_tokens
    from bridge.models.bagel.launch import model_config
    from bridge.models.bagel.model.trainer import BagelTrainer

    cfg = load_job_config(str(REPO / "configs" / "demo.yaml"),
                          [f"data.groups={data / 'groups.yaml'}", f"data.dataset_info={data / 'dataset_info.yaml'}",
                           f"data.prefetch={prefetch}", "model.name=bagel-tiny", *overrides])
    model = model_config(cfg.model).resolved(vocab_size=len(add_special_tokens(tokenizer)[0]),
                                             max_latent_size=cfg.data.packer.max_latent_size)
    trainer = BagelTrainer(model, pgs)
    waits, totals, tokens = [], [], 0
    with build_bagel_train_loader(cfg.data, tokenizer, (0, 1), length=warmup + steps) as loader:
        for step in range(1, warmup + steps + 1):
            t0 = time.perf_counter()
            batch = next(loader)
            t1 = time.perf_counter()
            trainer.train_step([batch], step)
            t2 = time.perf_counter()
            if step > warmup:
                waits.append(1000 * (t1 - t0))
                totals.append(1000 * (t2 - t0))
                tokens += int(batch["sequence_length"])
    return {"wait_share": sum(waits) / sum(totals), "wait_ms": statistics.fmean(waits),
            "step_ms": statistics.fmean(totals), "tokens_per_s": tokens / (sum(totals) / 1000)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(REPO / "demo_data"), help="demo data dir (generated there if missing)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per case (default 8)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed first steps per case (default 2)")
    ap.add_argument("--quick", action="store_true", help="CI smoke run: small packs, 1 + 2 steps")
    args = ap.parse_args(argv)
    overrides = []
    if args.quick:
        args.steps, args.warmup, overrides = 2, 1, QUICK_BUDGETS
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from bridge.models.bagel.data.converter.demo import make_demo_data
    from bridge.models.bagel.data.tokenizer import build_qwen2_tokenizer

    data = Path(args.data)
    if not (data / "groups.yaml").exists():
        make_demo_data(str(data))
    tokenizer = build_qwen2_tokenizer()
    with tempfile.TemporaryDirectory(prefix="bench_train_") as store:
        dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        try:
            pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "pp", "cp", "dp"])
            print(f"tiny reference model, {'4K/8K' if args.quick else '16K/20K'}-token packs, {args.warmup} warm-up + "
                  f"{args.steps} timed steps per case, torch {torch.get_num_threads()} threads", flush=True)
            results = {}
            for name, prefetch in (("prefetch", 2), ("inline", 0)):
                r = results[name] = measure(data, prefetch, args.warmup, args.steps, overrides, pgs, tokenizer)
                print(f"  {name:8s}: wait {r['wait_ms']:8.1f} ms/step of {r['step_ms']:8.1f} ms = wait share "
                      f"{r['wait_share']:.3f}  ({r['tokens_per_s']:.0f} tokens/s)", flush=True)
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
    p, i = results["prefetch"], results["inline"]
    print(f"train_wait: wait_share_prefetch={p['wait_share']:.3f} wait_share_inline={i['wait_share']:.3f} "
          f"step_ms_prefetch={p['step_ms']:.0f} step_ms_inline={i['step_ms']:.0f} "
          f"speedup={i['step_ms'] / p['step_ms']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
