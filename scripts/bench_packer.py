#!/usr/bin/env python3
"""Benchmark BagelPacker at default budgets (32K expected / 36K max) in flex and dense mode.

Samples are synthetic but realistically sized: t2i (caption 20-400 tokens + VAE image 512-1024 px),
VLM (ViT image 378-980 px + question + answer) and edit (VAE+ViT source, instruction, VAE target).
Prints batches/s, tokens/s and ms/batch per mode. The comparison packer is ``--reference MODULE:FACTORY``
(any callable with BagelPacker's signature, e.g. the official packer behind an adapter) or, without one, our
own packer at git revision ``--baseline`` (default: the commit before the warm-memory work), imported from
``git archive`` under another package name. Equality first: both must produce equal batches on the same
samples and RNG. Then ``--runs`` timed runs per mode in rotated order (ours first, then the other first, ...)
and the median of the per-run ratios. The second-to-last line reads ``speedup vs reference: flex=<x> dense=<y>`` (or ``speedup vs baseline <rev>: …``);
the last line is the machine-readable one: ``packer: speedup_flex=<x> speedup_dense=<y> vs=<reference|baseline@rev>``.
``--quick`` is the CI smoke run (small sizes, one run; ``tests/test_benches.py``): it proves the bench still works,
its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import io
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bridge.models.bagel.data.config import PackerConfig  # noqa: E402
from bridge.models.bagel.data.packing import BagelPacker, ListGroupSource, first_difference  # noqa: E402

SPECIAL = {"bos_token_id": 151644, "eos_token_id": 151645, "start_of_image": 151652, "end_of_image": 151653}


def _plan(kind: str, enable_cfg: int, loss: int) -> dict:
    return {"type": kind, "enable_cfg": enable_cfg, "loss": loss, "special_token_loss": 0, "special_token_label": None}


def make_samples(n_per_group: int, seed: int) -> dict[str, list[dict]]:
    """Deterministic synthetic streams; image tensors are shared from a small pool to bound memory."""
    g = np.random.default_rng(seed)
    pool: dict[tuple[int, int], torch.Tensor] = {}

    def image(stride: int, lo: int, hi: int) -> torch.Tensor:
        h = int(g.integers(lo // stride, hi // stride + 1)) * stride
        w = int(g.integers(lo // stride, hi // stride + 1)) * stride
        if (h, w) not in pool:
            pool[(h, w)] = torch.rand((3, h, w), generator=torch.Generator().manual_seed(h * 7919 + w)) * 2 - 1
        return pool[(h, w)]

    def text(lo: int = 20, hi: int = 400) -> list[int]:
        return g.integers(0, 150000, int(g.integers(lo, hi + 1))).tolist()

    streams: dict[str, list[dict]] = {"t2i_pretrain": [], "vlm_sft": [], "unified_edit": []}
    for i in range(n_per_group):
        cap, vae = text(), image(16, 512, 1024)
        streams["t2i_pretrain"].append(dict(
            sequence_plan=[_plan("text", 1, 0), _plan("vae_image", 0, 1)], text_ids_list=[cap],
            image_tensor_list=[vae], num_tokens=len(cap) + vae.shape[1] * vae.shape[2] // 256,
            data_indexes={"data_indexes": i, "worker_id": 0, "dataset_name": "t2i_pretrain"}))
        vit, q, a = image(14, 378, 980), text(), text()
        streams["vlm_sft"].append(dict(
            sequence_plan=[_plan("vit_image", 0, 0), _plan("text", 0, 0), _plan("text", 0, 1)],
            text_ids_list=[q, a], image_tensor_list=[vit],
            num_tokens=len(q) + len(a) + vit.shape[1] * vit.shape[2] // 196,
            data_indexes={"data_indexes": i, "worker_id": 0, "dataset_name": "vlm_sft"}))
        src, src_vit, instr, tgt = image(16, 512, 1024), image(14, 224, 518), text(), image(16, 512, 1024)
        streams["unified_edit"].append(dict(
            sequence_plan=[_plan("vae_image", 1, 0), _plan("vit_image", 1, 0), _plan("text", 1, 0),
                           _plan("vae_image", 0, 1)],
            text_ids_list=[instr], image_tensor_list=[src, src_vit, tgt],
            num_tokens=len(instr) + (src.numel() + tgt.numel()) // 768 + src_vit.numel() // 588,
            data_indexes={"data_indexes": i, "worker_id": 0, "dataset_name": "unified_edit"}))
    return streams


def build(factory, streams: dict[str, list[dict]], use_flex: bool):
    names = list(streams)
    sources = [ListGroupSource(streams[n], cycle=True, name=n) for n in names]
    return factory(sources, [1.0, 1.0, 1.0], [True, True, False], SPECIAL, use_flex=use_flex)


def ours(sources, weights, mandatory, special, *, use_flex: bool) -> BagelPacker:
    """Our packer behind the reference factory signature (knobs other than use_flex at BAGEL defaults)."""
    return BagelPacker(sources, weights, mandatory, special, PackerConfig(use_flex=use_flex))


def run(factory, streams, use_flex: bool, n_batches: int, seed: int, keep: bool = False, warmup: int = 0):
    """Time ``n_batches`` after ``warmup`` untimed ones (steady state: the warm-memory pool has filled)."""
    random.seed(seed)
    np.random.seed(seed)
    packer = build(factory, streams, use_flex)
    for _ in range(warmup):
        next(packer)
    batches, tokens = [], 0
    t0 = time.perf_counter()
    for _ in range(n_batches):
        b = next(packer)
        tokens += b["sequence_length"]
        if keep:
            batches.append(b)
    return time.perf_counter() - t0, tokens, batches


BASELINE_REV = "660104d"  # last commit before the warm-memory pool and the one-pass patchify


def load_baseline(rev: str):
    """Our packer as of git ``rev``: its ``bridge/models/bagel/data`` imported as ``_bagel_data_<rev>``."""
    root = Path(__file__).resolve().parents[1]
    tmp = Path(tempfile.mkdtemp(prefix="bagel-baseline-"))
    atexit.register(shutil.rmtree, tmp, True)  # imported lazily while the bench runs; gone after it
    blob = subprocess.run(["git", "-C", str(root), "archive", rev, "bridge/models/bagel/data"],
                          check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(tmp, filter="data")
    name = f"_bagel_data_{rev.replace('~', '_').replace('^', '_')}"
    (tmp / "bridge/models/bagel/data").rename(tmp / name)
    sys.path.insert(0, str(tmp))
    old_config = importlib.import_module(f"{name}.config")
    old_packing = importlib.import_module(f"{name}.packing")

    def factory(sources, weights, mandatory, special, *, use_flex: bool):
        return old_packing.BagelPacker(sources, weights, mandatory, special, old_config.PackerConfig(use_flex=use_flex))

    return factory


def load_factory(spec: str):
    module, _, attr = spec.partition(":")
    if not attr:
        raise SystemExit(f"--reference must be MODULE:FACTORY, got {spec!r}")
    return getattr(importlib.import_module(module), attr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=20, help="batches per mode (default 20)")
    ap.add_argument("--samples-per-group", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reference", help="MODULE:FACTORY(sources, weights, mandatory, special_tokens, use_flex=...) to compare against")
    ap.add_argument("--check-batches", type=int, default=5, help="batches compared for equality with the reference")
    ap.add_argument("--baseline", default=BASELINE_REV, help=f"git revision compared against when no --reference "
                    f"is given (default {BASELINE_REV})")
    ap.add_argument("--warmup", type=int, default=8, help="untimed batches before each timed run (default 8)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per mode, in rotated order (default 3)")
    ap.add_argument("--quick", action="store_true", help="CI smoke run: 12 samples per group, 1 batch compared, "
                    "1 warm-up and 1 timed run of 2 batches per mode (the ratio is noise at this size)")
    args = ap.parse_args()
    if args.quick:
        args.samples_per_group, args.check_batches, args.warmup, args.runs, args.batches = 12, 1, 1, 1, 2
    torch.set_num_threads(1)
    streams = make_samples(args.samples_per_group, args.seed)
    if args.reference:
        reference, label = load_factory(args.reference), "reference"
    else:
        reference, label = load_baseline(args.baseline), f"baseline {args.baseline}"
    ratios = {}
    for mode, use_flex in (("flex", True), ("dense", False)):
        _, _, ours_b = run(ours, streams, use_flex, args.check_batches, args.seed, keep=True)
        _, _, ref_b = run(reference, streams, use_flex, args.check_batches, args.seed, keep=True)
        for k, (a, b) in enumerate(zip(ref_b, ours_b)):
            diff = first_difference(a, b, f"{mode}[{k}]")
            if diff:
                print(f"{label} and ours differ: {diff}")
                return 1
        print(f"{mode:5s} equal: {len(ours_b)} batches identical to the {label}")
        ours_b = ref_b = a = b = None  # free the kept batches (their pooled blocks) before timing
        per_run = []
        for r in range(args.runs):
            order = [("ours", ours), ("ref ", reference)]
            secs = {}
            for name, factory in (order if r % 2 == 0 else order[::-1]):
                secs[name], tokens, _ = run(factory, streams, use_flex, args.batches, args.seed, warmup=args.warmup)
                print(f"{mode:5s} run {r} {name}: {args.batches / secs[name]:8.2f} batches/s  "
                      f"{tokens / secs[name]:12.0f} tokens/s  {1000 * secs[name] / args.batches:8.1f} ms/batch")
            per_run.append(secs["ref "] / secs["ours"])
        ratios[mode] = statistics.median(per_run)
        print(f"{mode:5s} ratios per run: {' '.join(f'{x:.2f}' for x in per_run)}")
    vs = "reference" if args.reference else f"baseline@{args.baseline}"
    print(f"speedup vs {label}: flex={ratios['flex']:.2f} dense={ratios['dense']:.2f}")
    print(f"packer: speedup_flex={ratios['flex']:.2f} speedup_dense={ratios['dense']:.2f} vs={vs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
