#!/usr/bin/env python3
"""Benchmark attention-mask cost per 32K batch: official dense masks vs flex metadata + BlockMask, on CPU.

Packs come from the real ``BagelPacker`` in flex mode at the BAGEL default budgets (32768 expected / 36864 max
tokens) over the synthetic, realistically sized samples of ``scripts/bench_packer.py``. For each pack it times
(in one run, same packs, after ``--warmup`` untimed packs through both paths):
- dense: what dense mode (``use_flex=False``) builds on the host, one float32 [L_i, L_i] additive mask per
  sample (``packing.dense_attention_mask``, the official ``prepare_attention_mask_per_sample``); bytes = 4·ΣL_i²;
- flex: ``attention.flex_metadata`` + ``attention.block_mask`` (the FlexAttention ``BlockMask`` for the whole
  padded sequence, built from ``sample_lens`` / ``split_lens`` / ``attn_modes`` only); bytes = every tensor
  they produce (per-token ids + block tables).
With ``--full-dense`` it also times materialising the whole (L, L) bool mask for SDPA (``attention.dense_mask``).
The last line is machine-readable: ``attention: dense_ms=<x> flex_ms=<y> ratio=<dense/flex>`` (means per batch).
``--quick`` is the CI smoke run (small sizes, one run; ``tests/test_benches.py``): it proves the bench still works,
its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from itertools import accumulate
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_packer import build, make_samples, ours  # noqa: E402
from bridge.models.bagel.data.attention import block_mask, dense_mask, flex_metadata  # noqa: E402
from bridge.models.bagel.data.packing import dense_attention_mask  # noqa: E402


def per_sample_splits(batch: dict) -> list[tuple[list[int], list[str]]]:
    """Cut the flex batch's global split lists back into each real sample's (split_lens, attn_modes)."""
    out, i = [], 0
    splits, modes = batch["split_lens"], batch["attn_modes"]
    for n in batch["sample_lens"][:-1]:
        j, total = i, 0
        while total < n:
            total += splits[j]
            j += 1
        out.append((splits[i:j], modes[i:j]))
        i = j
    return out


def tensor_bytes(*objs) -> int:
    total = 0
    for o in objs:
        if isinstance(o, torch.Tensor):
            total += o.numel() * o.element_size()
        elif hasattr(o, "__dataclass_fields__"):
            total += tensor_bytes(*(getattr(o, f) for f in o.__dataclass_fields__))
    return total


def block_mask_bytes(bm) -> int:
    return tensor_bytes(*(getattr(bm, name) for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks",
                                                          "full_kv_indices", "q_num_blocks", "q_indices",
                                                          "full_q_num_blocks", "full_q_indices")))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=5, help="32K packs measured (default 5)")
    ap.add_argument("--samples-per-group", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=2, help="untimed packs through both paths first (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, like bench_packer)")
    ap.add_argument("--full-dense", action="store_true", help="also time the whole (L, L) bool mask (SDPA)")
    ap.add_argument("--quick", action="store_true",
                    help="CI smoke run: 1 pack from 12 samples per group (same budgets, same code path)")
    args = ap.parse_args()
    if args.quick:
        args.batches, args.samples_per_group, args.warmup = 1, 12, 1
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    # ``ours`` is BagelPacker behind bench_packer's factory signature (PackerConfig at BAGEL defaults, flex on)
    packer = build(ours, make_samples(args.samples_per_group, args.seed), True)
    # Warm-up, both paths alike: first-call allocations, lazy imports and the first touch of the warm-memory pool's
    # pages (``packing/memory.py``; dense masks are carved from it, as in dense mode) are not part of a batch's cost.
    for _ in range(args.warmup):
        warm = next(packer)
        block_mask(flex_metadata(warm))
        warm_masks = [dense_attention_mask(s, m) for s, m in per_sample_splits(warm)]
        del warm_masks, warm
    rows = []
    for k in range(args.batches):
        batch = next(packer)
        L = sum(batch["sample_lens"])
        t0 = time.perf_counter()
        masks = [dense_attention_mask(s, m) for s, m in per_sample_splits(batch)]
        t1 = time.perf_counter()
        meta = flex_metadata(batch)
        t2 = time.perf_counter()
        bm = block_mask(meta)
        t3 = time.perf_counter()
        assert [m.shape[0] for m in masks] == batch["sample_lens"][:-1]
        dense_b, flex_b = tensor_bytes(*masks), tensor_bytes(meta) + block_mask_bytes(bm)
        del masks
        row = dict(dense_ms=1e3 * (t1 - t0), meta_ms=1e3 * (t2 - t1), bm_ms=1e3 * (t3 - t2), dense_b=dense_b,
                   flex_b=flex_b, sparsity=bm.sparsity())
        line = (f"batch {k}: L={L} real={batch['sequence_length']} samples={len(batch['sample_lens']) - 1} "
                f"splits={len(batch['split_lens'])} | dense {row['dense_ms']:8.1f} ms {dense_b / 2**20:8.1f} MiB | "
                f"flex {row['meta_ms']:5.1f} ms metadata + {row['bm_ms']:6.1f} ms BlockMask "
                f"{flex_b / 2**20:5.2f} MiB (sparsity {row['sparsity']:.1f}%)")
        if args.full_dense:
            t4 = time.perf_counter()
            full = dense_mask(meta)
            row["full_ms"] = 1e3 * (time.perf_counter() - t4)
            line += f" | full (L, L) bool {row['full_ms']:.1f} ms {full.numel() / 2**20:.0f} MiB"
            del full
        print(line, flush=True)
        rows.append(row)
    mean = {key: statistics.fmean(r[key] for r in rows) for key in rows[0]}
    flex_ms = mean["meta_ms"] + mean["bm_ms"]
    print(f"mean per 32K batch ({args.batches} batches, {args.threads} thread(s)): dense {mean['dense_ms']:.1f} ms, "
          f"{mean['dense_b'] / 2**20:.1f} MiB | flex {flex_ms:.1f} ms, {mean['flex_b'] / 2**20:.2f} MiB | "
          f"bytes ratio {mean['dense_b'] / mean['flex_b']:.0f}x")
    print(f"attention: dense_ms={mean['dense_ms']:.1f} flex_ms={flex_ms:.1f} ratio={mean['dense_ms'] / flex_ms:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
