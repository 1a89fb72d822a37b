"""Loader-state size and save/restore time at the default budgets (32K expected / 36K max) on the demo data.

Builds one rank's loader over the demo dataset (all three groups), takes some batches so the packer buffer
is in use, then measures what Bridge's checkpoint hooks do per DP rank: ``save_state()`` + ``torch.save``
(bytes, ms) and ``energon_torch_load`` + ``restore_state()`` into a freshly built loader (ms; building the
loader itself is not counted), at DP 1 and for the last rank of DP 8192 (the default ``data.partitions`` cover it;
the demo's small groups are striped over epochs). Then the state size of the same loader with 2 read workers.
Targets: <= 64 KiB (all) and <= 1 s. Last line:
``state: bytes=<n> bytes_dp8192=<n> bytes_nw2=<m> save_ms=<x> restore_ms=<y> restore_ms_dp8192=<y>``.
``--quick`` is the CI smoke run (small sizes, one run; ``tests/test_benches.py``): it proves the bench still works,
its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import pickle
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from bridge.models.bagel.data._bridge import import_bridge  # noqa: E402
from bridge.models.bagel.data.build import build_bagel_train_loader  # noqa: E402
from bridge.models.bagel.data.config import BagelDataConfig, PackerConfig  # noqa: E402
from bridge.models.bagel.data.converter.demo import make_demo_data  # noqa: E402
from bridge.models.bagel.data.tokenizer import build_qwen2_tokenizer  # noqa: E402

TARGET_BYTES = 64 * 1024
TARGET_MS = 1000.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo-dir", default=os.path.join(tempfile.gettempdir(), "bagel_demo_bench_state"))
    ap.add_argument("--batches", type=int, default=6, help="batches taken before saving")
    ap.add_argument("--repeats", type=int, default=3, help="save/restore repetitions (median reported)")
    ap.add_argument("--num-workers", type=int, default=0)
    ap.add_argument("--flex", action="store_true")
    ap.add_argument("--quick", action="store_true", help="CI smoke run: 1 batch before saving, one save/restore, "
                    "4K/8K-token packs")
    args = ap.parse_args()
    packer = PackerConfig(use_flex=args.flex, max_latent_size=64)
    if args.quick:  # small packs (the tests' demo budgets): every step still runs, on a quarter of the tokens
        args.batches, args.repeats = 1, 1
        packer = PackerConfig(use_flex=args.flex, max_latent_size=64, expected_num_tokens=4096, max_num_tokens=8192,
                              max_num_tokens_per_sample=4096, prefer_buffer_before=2048)
    logging.basicConfig(level=logging.ERROR)
    warnings.filterwarnings("ignore")

    make_demo_data(args.demo_dir, seed=0)
    tok = build_qwen2_tokenizer()
    load = import_bridge().energon_torch_load
    cfg = BagelDataConfig(groups=os.path.join(args.demo_dir, "groups.yaml"),
                          dataset_info=os.path.join(args.demo_dir, "dataset_info.yaml"),
                          num_workers=args.num_workers, packer=packer)

    def measure(dp: tuple[int, int]) -> tuple[dict, list[int], list[float], list[float], list[float]]:
        loader = build_bagel_train_loader(cfg, tok, dp, length=1000)
        for _ in range(args.batches):
            next(loader)
        sizes, save_ms, restore_ms, first_ms = [], [], [], []
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, f"train_dataloader_dprank{dp[0]:03d}.pt")
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                state = loader.save_state()
                torch.save({"dataloader_state_dict": state}, path)
                save_ms.append((time.perf_counter() - t0) * 1e3)
                sizes.append(os.path.getsize(path))
                fresh = build_bagel_train_loader(cfg, tok, dp, length=1000)
                t0 = time.perf_counter()
                fresh.restore_state(load(path)["dataloader_state_dict"])
                restore_ms.append((time.perf_counter() - t0) * 1e3)
                t0 = time.perf_counter()
                next(fresh)  # the first batch after a restore (reads and packs)
                first_ms.append((time.perf_counter() - t0) * 1e3)
                fresh.close()
        loader.close()
        return state, sizes, save_ms, restore_ms, first_ms

    state, sizes, save_ms, restore_ms, first_ms = measure((0, 1))
    _, sizes_big, _, restore_big, _ = measure((8191, 8192))
    rng = state["source"]["state"]                    # BagelRNGIterator (prefetch is transparent in the state)
    packer = rng["source"]["state"]                   # BagelPacker
    parts = {k: len(pickle.dumps(v)) for k, v in state.items()}
    parts.update({f"packer.{k}": len(pickle.dumps(v)) for k, v in packer.items()})
    parts.update({f"packer.source[{i}]": len(pickle.dumps(v)) for i, v in enumerate(packer["source"])})
    cfg_nw2 = BagelDataConfig(groups=cfg.groups, dataset_info=cfg.dataset_info, num_workers=2, packer=cfg.packer)
    with build_bagel_train_loader(cfg_nw2, tok, (0, 1), length=1000) as loader_nw2:
        for _ in range(args.batches):
            next(loader_nw2)
        buf = io.BytesIO()
        torch.save({"dataloader_state_dict": loader_nw2.save_state()}, buf)
        n_nw2 = len(buf.getvalue())
    print(f"budgets: expected {cfg.packer.expected_num_tokens} / max {cfg.packer.max_num_tokens}, "
          f"{args.batches} batches taken, buffer holds {len(packer['buffer'])} samples, "
          f"{args.num_workers} read workers")
    print("pickled bytes by part: " + ", ".join(f"{k}={v}" for k, v in parts.items()))
    n, s, r = max(sizes), statistics.median(save_ms), statistics.median(restore_ms)
    n_big, r_big = max(sizes_big), statistics.median(restore_big)
    ok = max(n, n_big, n_nw2) <= TARGET_BYTES and s <= TARGET_MS and max(r, r_big) <= TARGET_MS
    print(f"first batch after restore (reads + packing): {statistics.median(first_ms):.1f} ms")
    print(f"targets (<= {TARGET_BYTES} bytes, <= {TARGET_MS:.0f} ms): {'met' if ok else 'MISSED'}")
    print(f"state: bytes={n} bytes_dp8192={n_big} bytes_nw2={n_nw2} save_ms={s:.1f} restore_ms={r:.1f} "
          f"restore_ms_dp8192={r_big:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
