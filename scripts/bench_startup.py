"""Time to first batch after imports, per process, at the default budgets (32K expected / 36K max) on demo data.

Each measurement is a fresh Python process (what every rank pays at launch and at every restart): it imports
torch, transformers' Qwen2 tokenizer module and our builder (``imports_s``), then loads the offline tokenizer
(``tokenizer_s``: the disk cache, see ``tokenizer.py``), builds one rank's loader (``build_s``) and takes the first
batch (``first_batch_s``). ``after_imports_s`` is the sum of the last three; target <= 2 s. The first process may
also write the tokenizer's snapshot, so ``--runs`` processes are timed and the median is reported. Last line:
``startup: imports_s=<a> tokenizer_s=<b> build_s=<c> first_batch_s=<d> after_imports_s=<e>``.
``--quick`` is the CI smoke run (small sizes, one run; ``tests/test_benches.py``): it proves the bench still works,
its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TARGET_S = 2.0
KEYS = ("imports_s", "tokenizer_s", "build_s", "first_batch_s", "after_imports_s")


def _child(demo_dir: str, use_flex: bool, num_workers: int) -> None:
    t0 = time.perf_counter()
    sys.path.insert(0, REPO)
    import logging
    import warnings

    import torch  # noqa: F401
    from transformers import Qwen2Tokenizer  # noqa: F401  (resolves transformers' lazy module, as a trainer does)

    from bridge.models.bagel.data.build import build_bagel_train_loader
    from bridge.models.bagel.data.config import BagelDataConfig, PackerConfig
    from bridge.models.bagel.data.tokenizer import build_qwen2_tokenizer

    logging.basicConfig(level=logging.ERROR)
    warnings.filterwarnings("ignore")
    t1 = time.perf_counter()
    tok = build_qwen2_tokenizer()
    t2 = time.perf_counter()
    cfg = BagelDataConfig(groups=os.path.join(demo_dir, "groups.yaml"),
                          dataset_info=os.path.join(demo_dir, "dataset_info.yaml"), num_workers=num_workers,
                          packer=PackerConfig(use_flex=use_flex, max_latent_size=64))
    loader = build_bagel_train_loader(cfg, tok, (0, 1), length=1000)
    t3 = time.perf_counter()
    next(loader)
    t4 = time.perf_counter()
    loader.close()
    print(json.dumps({"imports_s": t1 - t0, "tokenizer_s": t2 - t1, "build_s": t3 - t2, "first_batch_s": t4 - t3,
                      "after_imports_s": t4 - t1}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo-dir", default=os.path.join(tempfile.gettempdir(), "bagel_demo_bench_startup"))
    ap.add_argument("--runs", type=int, default=3, help="fresh processes timed (median reported)")
    ap.add_argument("--dense", action="store_true", help="dense masks instead of flex metadata")
    ap.add_argument("--num-workers", type=int, default=0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="CI smoke run: one fresh process")
    args = ap.parse_args()
    if args.quick:
        args.runs = 1
    if args.child:
        _child(args.demo_dir, not args.dense, args.num_workers)
        return 0
    sys.path.insert(0, REPO)
    from bridge.models.bagel.data.converter.demo import make_demo_data

    make_demo_data(args.demo_dir, seed=0)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--demo-dir", args.demo_dir,
           "--num-workers", str(args.num_workers)] + (["--dense"] if args.dense else [])
    runs = []
    for i in range(args.runs):
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        runs.append(json.loads(out))
        print(f"process {i}: " + " ".join(f"{k}={runs[-1][k]:.2f}" for k in KEYS))
    med = {k: statistics.median(r[k] for r in runs) for k in KEYS}
    print(f"{'flex' if not args.dense else 'dense'} masks, {args.num_workers} Energon workers; target after imports "
          f"<= {TARGET_S:.0f} s: {'met' if med['after_imports_s'] <= TARGET_S else 'MISSED'}")
    print("startup: " + " ".join(f"{k}={med[k]:.2f}" for k in KEYS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
