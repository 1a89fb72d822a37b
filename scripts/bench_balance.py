#!/usr/bin/env python3
"""Benchmark ``packer.strategy: balanced`` against the official loop: does any data-parallel rank wait for another?

Packs are simulated at the length level with the packers' own loops (``packing.step.PackLoop``,
``packing.balance.BalancedLoop``) through ``tools.budget_stats.straggler.simulate_ranks``: every DP rank draws
its own samples and packs on its own; step ``s`` is pack ``s`` of every rank; a sample's cost is
``packing.cost.CostModel.cost`` (BAGEL-7B) of its split layout. Both strategies run on the same streams in the
same run, at the official budgets (32768 / 36864 / 16384, buffer 50), on these mixes:

* ``bagel``: t2i (mandatory; 256-4096 latent tokens, caption ~60 tokens), edit (2-3 images of 1024-4096 latent
  tokens with ViT copies), VLM (mandatory; log-normal around 1.5K tokens, sigma 0.9, a long tail to 15.5K);
  weights 1 : 1 : 1 (the mix of issue 34);
* ``longtail``: the same groups, VLM weight 2 with sigma 1.2 (a heavier tail: ~6 % of VLM samples over 8K);
* ``t2i_heavy``: weights 4 : 1 : 1 (most of the compute in bidirectional noise splits);
* ``demo``: the converted demo dataset's samples, from its metadata (``bagel-data stats``' estimates, no pixel
  decoded), with the demo's group weights and mandatory flags.

Per mix: the straggler ratio (mean over steps of the slowest rank's compute over the mean) and the share of
step time lost at DP 8, 64 and 512, after a warm-up of ``--warmup`` packs per rank (and over the warm-up: a
cold start); then one long run of ``--long`` packs on one rank: mean real tokens per pack, samples' wait in
packs (p50 / p99 / max; also for samples of half the per-sample limit or more), the group-mix deviation (the
largest difference between a group's share of the packed samples or tokens and its share of the samples
drawn), drops by reason and the loop's CPU per pack. Last, the real packers' CPU time per pack (``BagelPacker``
and ``BalancedPacker`` laying out tensors, flex, on ``bench_packer``'s synthetic samples at the same budgets).

Last line: ``balance: official_dp64=<r> balanced_dp64=<r> balanced_dp512=<r> tokens_ratio=<balanced/official
mean tokens per pack> wait_p99=<packs> mix_dev=<max share deviation> cpu_ratio=<balanced/official CPU per
pack>``, each the worst over the mixes (the largest ratio, wait and deviation, the smallest tokens ratio).
``--quick`` (``tests/test_benches.py``) runs everything small: its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bridge.models.bagel.data.config import PackerConfig  # noqa: E402
from bridge.models.bagel.data.packing.cost import CostModel, Work, split_pairs  # noqa: E402
from bridge.models.bagel.data.tools.budget_stats.straggler import (  # noqa: E402
    StragglerResult, cycled, simulate_ranks)

Sample = tuple[int, float]
MODEL = CostModel.of()
NAMES = ("t2i_pretrain", "unified_edit", "vlm_sft")


def work_of(splits: list[tuple[int, str]], vit: tuple[int, ...] = (), vae: int = 0) -> Sample:
    """(packed length, cost) of a sample laid out as (tokens without the two special tokens, mode) splits."""
    lens = [n + 2 for n, _ in splits]
    w = Work(sum(lens), split_pairs(lens, [m for _, m in splits]), sum(vit), sum(n * n for n in vit), vae)
    return sum(lens), MODEL.cost(w)


def t2i(rng: random.Random) -> Sample:
    """A caption (log-normal around 60 tokens) and a noised VAE target of 16-64 x 16-64 latents."""
    cap = min(400, max(5, int(rng.lognormvariate(math.log(60), 0.6))))
    n = rng.randint(16, 64) * rng.randint(16, 64)
    return work_of([(cap, "causal"), (n, "noise")], vae=n)


def vlm(rng: random.Random, sigma: float = 0.9) -> Sample:
    """Log-normal total around 1.5K tokens (cut at 15.5K): one ViT image and a question / answer (85 %), or a
    text-only conversation of 2-6 turns."""
    total = min(15500, int(rng.lognormvariate(math.log(1500), sigma)))
    if rng.random() < 0.85:
        n = min(rng.randint(16, 48) * rng.randint(16, 48), max(total - 20, 64))
        rest = max(total - n, 10)
        q = max(1, rest // 4)
        return work_of([(n, "full"), (q, "causal"), (max(1, rest - q), "causal")], vit=(n,))
    turns = rng.randint(2, 6)
    return work_of([(max(1, total // turns), "causal")] * turns)


def edit(rng: random.Random) -> Sample:
    """Context (clean VAE + ViT copy), instruction, target; half of the rows a 3-image two-step edit."""
    s, v, ins = rng.randint(32, 64) * rng.randint(32, 64), rng.randint(16, 37) ** 2, rng.randint(10, 80)
    one = [(s, "full"), (v, "full"), (ins, "causal"), (s, "noise")]
    if rng.random() < 0.5:
        return work_of(one, vit=(v,), vae=2 * s)
    return work_of(one + [(s, "full"), (v, "full"), (ins, "causal"), (s, "noise")], vit=(v, v), vae=4 * s)


def synthetic(gens: list[Callable[[random.Random], Sample]], seed: int) -> Callable[[int], list[Iterator[Sample]]]:
    """Per rank, one infinite stream per group (generator seeded by (seed, rank, group))."""
    def stream(f: Callable[[random.Random], Sample], s: int) -> Iterator[Sample]:
        rng = random.Random(s)
        while True:
            yield f(rng)

    return lambda rank: [stream(f, (seed * 1009 + rank) * 31 + g) for g, f in enumerate(gens)]


#: name -> (per-group generators, weights, mandatory flags)
MIXES: dict[str, tuple[list[Callable[[random.Random], Sample]], list[float], list[bool]]] = {
    "bagel": ([t2i, edit, vlm], [1.0, 1.0, 1.0], [True, False, True]),
    "longtail": ([t2i, edit, lambda r: vlm(r, 1.2)], [1.0, 1.0, 2.0], [True, False, True]),
    "t2i_heavy": ([t2i, edit, vlm], [4.0, 1.0, 1.0], [True, False, True]),
}


def demo_mix(data: Path | None) -> tuple[Callable[[int], list[Iterator[Sample]]], list[float], list[bool]]:
    """The demo dataset (generated into a temp dir unless ``data`` names one) as per-rank shuffled streams of its
    samples' (mean estimate, cost of the expected work) from ``bagel-data stats``' metadata reader."""
    from bridge.models.bagel.data.config import load_dataset_info, load_grouped_yaml, resolve_groups
    from bridge.models.bagel.data.converter.demo import make_demo_data
    from bridge.models.bagel.data.tokenizer import build_qwen2_tokenizer
    from bridge.models.bagel.data.tools.budget_stats.estimate import dataset_stats

    if data is None:
        data = Path(tempfile.mkdtemp(prefix="bench-balance-")) / "demo"
        make_demo_data(str(data), seed=0)
    groups = resolve_groups(load_grouped_yaml(str(data / "groups.yaml")),
                            load_dataset_info(str(data / "dataset_info.yaml")))
    tok = build_qwen2_tokenizer()
    samples = []
    for rg in groups:
        ests = [e for name, entry in zip(rg.group.dataset_names, rg.datasets)
                for e in dataset_stats(rg.group, name, entry.energon_path, tok, progress=False).estimates]
        samples.append([(max(1, round(e.mean)), MODEL.cost(e.work)) for e in ests])

    def sources(rank: int) -> list[Iterator[Sample]]:
        rng = random.Random(rank)
        return [cycled(s, rng) for s in samples]

    return sources, [g.group.weight for g in groups], [g.group.is_mandatory for g in groups]


def real_packer_cpu(packs: int, warmup: int) -> tuple[float, float]:
    """CPU seconds per pack of BagelPacker and BalancedPacker (flex, official budgets) on ``bench_packer``'s
    synthetic samples: two rounds each, in rotated order, ``warmup`` untimed packs first."""
    from bench_packer import SPECIAL, make_samples

    from bridge.models.bagel.data.packing import BagelPacker, ListGroupSource
    from bridge.models.bagel.data.packing.balanced_packer import BalancedPacker

    streams = make_samples(40, 0)
    out = {"official": 0.0, "balanced": 0.0}
    order = [("official", BagelPacker), ("balanced", BalancedPacker)]
    for r in range(2):
        for strategy, cls in order[r:] + order[:r]:  # rotated: each strategy goes first once
            random.seed(0)
            np.random.seed(0)
            packer = cls([ListGroupSource(streams[n], cycle=True, name=n) for n in streams], [1.0, 1.0, 1.0],
                         [True, True, False], SPECIAL, PackerConfig(use_flex=True, strategy=strategy),
                         group_names=list(streams))
            for _ in range(warmup):
                next(packer)
            t0 = time.process_time()
            for _ in range(packs):
                next(packer)
            out[strategy] += (time.process_time() - t0) / packs / 2
    return out["official"], out["balanced"]


def run_mix(name: str, make: Callable[[int], list[Iterator[Sample]]], weights: list[float], mandatory: list[bool],
            args: argparse.Namespace) -> dict[str, dict]:
    """Both strategies on one mix: DP runs and the long run (printed); the figures for the last line."""
    out: dict[str, dict] = {}
    print(f"\n== mix {name} (weights {weights}, mandatory {mandatory})")
    print(f"{'DP':>4}  {'official ratio (lost, cold)':>28}  {'balanced ratio (lost, cold)':>28}  tokens/pack off / bal")
    for dp in args.dp:
        res: dict[str, StragglerResult] = {}
        for strategy in ("official", "balanced"):
            res[strategy] = simulate_ranks(make, weights, mandatory, PackerConfig(strategy=strategy), dp=dp,
                                           packs=args.steps, warmup=args.warmup, seed=args.seed)
        o, b = res["official"], res["balanced"]
        print(f"{dp:>4}  {o.ratio:>8.4f} ({o.lost:6.2%}, {o.cold_ratio:.3f})  {b.ratio:>12.4f} ({b.lost:6.2%}, "
              f"{b.cold_ratio:.3f})  {o.tokens_per_pack:.0f} / {b.tokens_per_pack:.0f}")
        out[f"dp{dp}"] = {"official": o.ratio, "balanced": b.ratio}
    long = {s: simulate_ranks(make, weights, mandatory, PackerConfig(strategy=s), dp=1, packs=args.long, seed=args.seed)
            for s in ("official", "balanced")}
    print(f"long run, 1 rank x {args.long} packs:")
    for s, r in long.items():
        print(f"  {s:>8}: {r.tokens_per_pack:8.0f} tokens/pack, {r.cost_per_pack / 1e12:6.1f} TFLOPs/pack; wait "
              f"p50/p99/max {r.wait_quantile(0.5)}/{r.wait_quantile(0.99)}/{max(r.waits, default=0)} packs (long "
              f"samples p99/max {r.wait_quantile(0.99, long=True)}/{max(r.waits_long, default=0)}, "
              f"{len(r.waits_long)} of them); mix deviation {r.mix_dev:.4f}; group shares (samples, tokens) "
              f"{[(round(a, 3), round(t, 3)) for a, t in r.shares]}; drops {r.drops or 'none'}; loop CPU "
              f"{r.cpu_us_per_pack:.0f} us/pack")
    o, b = long["official"], long["balanced"]
    out["long"] = {"tokens_ratio": b.tokens_per_pack / o.tokens_per_pack, "wait_p99": b.wait_quantile(0.99),
                   "mix_dev": b.mix_dev, "loop_cpu_ratio": b.cpu_us_per_pack / o.cpu_us_per_pack,
                   "flush": sum(v for k, v in b.drops.items() if k.startswith("flush"))}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI smoke run: small sizes (numbers mean nothing)")
    ap.add_argument("--data", type=Path, help="an existing demo dataset directory (default: generate one)")
    ap.add_argument("--dp", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--steps", type=int, default=16, help="measured steps (packs per rank) after the warm-up")
    ap.add_argument("--warmup", type=int, default=20, help="packs per rank before the measured steps")
    ap.add_argument("--long", type=int, default=3000, help="packs of the one-rank long run")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.quick:
        args.dp, args.steps, args.warmup, args.long = [8, 64, 512], 1, 1, 60
    if not {64, 512} <= set(args.dp):
        ap.error("--dp must include 64 and 512 (the last line reports them)")
    t0 = time.perf_counter()
    print(f"cost model (BAGEL-7B): {MODEL.token_flops / 1e9:.2f} GFLOPs per token, {MODEL.pair_flops:.0f} FLOPs per "
          f"attention pair, ViT {MODEL.vit_token_flops / 1e9:.2f} GFLOPs per token (training step)")
    figures: dict[str, dict] = {}
    for name, (gens, weights, mandatory) in MIXES.items():
        figures[name] = run_mix(name, synthetic(gens, args.seed), weights, mandatory, args)
    make, weights, mandatory = demo_mix(args.data)
    figures["demo"] = run_mix("demo (converted dataset metadata)", make, weights, mandatory, args)
    off, bal = real_packer_cpu(1 if args.quick else 12, 1 if args.quick else 3)
    print(f"\nreal packers (tensors, flex, official budgets): official {1e3 * off:.0f} ms/pack, balanced "
          f"{1e3 * bal:.0f} ms/pack CPU")
    print(f"loop alone (length level, long runs): balanced/official CPU "
          f"{max(f['long']['loop_cpu_ratio'] for f in figures.values()):.2f}x (worst mix)")
    flush = sum(f["long"]["flush"] for f in figures.values())
    print(f"balanced flush drops: {flush}; wall {time.perf_counter() - t0:.0f} s")
    worst = {
        "official_dp64": max(f["dp64"]["official"] for f in figures.values()),
        "balanced_dp64": max(f["dp64"]["balanced"] for f in figures.values()),
        "balanced_dp512": max(f["dp512"]["balanced"] for f in figures.values()),
        "tokens_ratio": min(f["long"]["tokens_ratio"] for f in figures.values()),
        "wait_p99": max(f["long"]["wait_p99"] for f in figures.values()),
        "mix_dev": max(f["long"]["mix_dev"] for f in figures.values()),
        "cpu_ratio": bal / off,
    }
    print("balance: " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in worst.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
