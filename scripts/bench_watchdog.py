#!/usr/bin/env python3
"""What the data watchdog costs per batch: the real loader on the demo data at default budgets, watchdog on
(``data.stall_warn_s`` / ``data.timeout_s`` at their defaults: every read runs on a reader thread the trainer
waits on with a timed get) against off (both 0: reads run inline), in the same run.

Rounds alternate the two settings (on, off, off, on, ...) so drift on a shared machine hits both alike; each
round builds a fresh loader and times ``--batches`` batches after the first (start-up excluded). Reported: the
median ms/batch of each setting and their ratio, and the per-read overhead in µs implied by the difference.
Last line: ``watchdog: on_ms=<m> off_ms=<m> overhead=<ratio> per_read_us=<us>``. ``--quick`` is the CI smoke run
(2 batches, 1 round each; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bridge.models.bagel.data.build import build_bagel_train_loader  # noqa: E402
from bridge.models.bagel.data.config import load_config  # noqa: E402
from bridge.models.bagel.data.converter.demo import make_demo_data  # noqa: E402
from bridge.models.bagel.data.tokenizer import load_tokenizer  # noqa: E402


def run_once(data_dir: Path, tokenizer, watchdog: bool, batches: int, workers: int) -> tuple[float, int]:
    """(ms per batch over ``batches`` batches after the first, samples read in them)."""
    knobs = [] if watchdog else ["stall_warn_s=0", "timeout_s=0"]
    cfg = load_config(None, [f"groups={data_dir / 'groups.yaml'}", f"dataset_info={data_dir / 'dataset_info.yaml'}",
                             f"num_workers={workers}", "packer.use_flex=true", "packer.max_latent_size=64", *knobs])
    with build_bagel_train_loader(cfg, tokenizer, (0, 1), length=1000) as loader:
        next(loader)
        before = sum(loader.stats().get("consumed", {}).values())
        t0 = time.perf_counter()
        for _ in range(batches):
            next(loader)
        ms = (time.perf_counter() - t0) * 1000 / batches
        reads = sum(loader.stats().get("consumed", {}).values()) - before
    return ms, reads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(REPO / "demo_data"), help="demo data dir (generated if missing)")
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="rounds per setting (alternated)")
    ap.add_argument("--workers", type=int, default=0, help="Energon num_workers")
    ap.add_argument("--quick", action="store_true", help="CI smoke run: 2 batches, 1 round per setting")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.quick:
        args.batches, args.rounds = 2, 1
    data_dir = Path(args.data)
    if not (data_dir / "groups.yaml").exists():
        make_demo_data(str(data_dir), seed=0)
    tokenizer = load_tokenizer(None)
    results: dict[bool, list[tuple[float, int]]] = {True: [], False: []}
    order = ([True, False, False, True] * args.rounds)[:2 * args.rounds]  # on, off, off, on, ...
    for i, on in enumerate(order):
        results[on].append(run_once(data_dir, tokenizer, on, args.batches, args.workers))
        print(f"  round {i}: watchdog {'on ' if on else 'off'} {results[on][-1][0]:.1f} ms/batch "
              f"({results[on][-1][1]} samples read)")
    on_ms = statistics.median(r[0] for r in results[True])
    off_ms = statistics.median(r[0] for r in results[False])
    reads = statistics.median(r[1] for r in results[True]) / args.batches
    per_read_us = (on_ms - off_ms) * 1000 / reads if reads else float("nan")
    print(f"watchdog on {on_ms:.1f} ms/batch, off {off_ms:.1f} ms/batch ({on_ms / off_ms:.3f}x; "
          f"{reads:.1f} samples read per batch, {per_read_us:.0f} us per read implied)")
    print(f"watchdog: on_ms={on_ms:.1f} off_ms={off_ms:.1f} overhead={on_ms / off_ms:.3f} per_read_us={per_read_us:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
