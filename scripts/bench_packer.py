#!/usr/bin/env python3
"""Benchmark BagelPacker at default budgets (32K expected / 36K max) in flex and dense mode.

Samples are synthetic but realistically sized: t2i (caption 20-400 tokens + VAE image 512-1024 px),
VLM (ViT image 378-980 px + question + answer) and edit (VAE+ViT source, instruction, VAE target).
Prints batches/s, tokens/s and ms/batch per mode. With ``--reference MODULE:FACTORY`` (any callable with
BagelPacker's signature) it first checks both produce equal batches on the same samples and RNG, then
prints the speed ratio ours/reference. The last line is machine-readable:
``speedup vs reference: flex=<x> dense=<y>`` or ``reference: none``.
"""

from __future__ import annotations

import argparse
import importlib
import random
import sys
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


def run(factory, streams, use_flex: bool, n_batches: int, seed: int, keep: bool = False):
    random.seed(seed)
    np.random.seed(seed)
    packer = build(factory, streams, use_flex)
    batches, tokens = [], 0
    t0 = time.perf_counter()
    for _ in range(n_batches):
        b = next(packer)
        tokens += b["sequence_length"]
        if keep:
            batches.append(b)
    return time.perf_counter() - t0, tokens, batches


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
    args = ap.parse_args()
    torch.set_num_threads(1)
    streams = make_samples(args.samples_per_group, args.seed)
    reference = load_factory(args.reference) if args.reference else None
    ratios = {}
    for mode, use_flex in (("flex", True), ("dense", False)):
        if reference is not None:
            _, _, ours_b = run(ours, streams, use_flex, args.check_batches, args.seed, keep=True)
            _, _, ref_b = run(reference, streams, use_flex, args.check_batches, args.seed, keep=True)
            for k, (a, b) in enumerate(zip(ref_b, ours_b)):
                diff = first_difference(a, b, f"{mode}[{k}]")
                if diff:
                    print(f"reference and ours differ: {diff}")
                    return 1
            del ours_b, ref_b
        secs, tokens, _ = run(ours, streams, use_flex, args.batches, args.seed)
        print(f"{mode:5s} ours: {args.batches / secs:8.2f} batches/s  {tokens / secs:12.0f} tokens/s  "
              f"{1000 * secs / args.batches:8.1f} ms/batch")
        if reference is not None:
            rsecs, rtokens, _ = run(reference, streams, use_flex, args.batches, args.seed)
            print(f"{mode:5s} ref : {args.batches / rsecs:8.2f} batches/s  {rtokens / rsecs:12.0f} tokens/s  "
                  f"{1000 * rsecs / args.batches:8.1f} ms/batch")
            ratios[mode] = rsecs / secs
    if reference is None:
        print("reference: none")
    else:
        print(f"speedup vs reference: flex={ratios['flex']:.2f} dense={ratios['dense']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
