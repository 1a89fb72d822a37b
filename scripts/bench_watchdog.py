#!/usr/bin/env python3
"""What the data watchdog costs per batch: the real loader on the demo data at default budgets, watchdog on
(``data.stall_warn_s`` / ``data.timeout_s`` at their defaults: each batch is built on a batch thread the trainer
waits on with a timed get, the reads inside it stamp a slot) against off (both 0: everything inline), in the
same run.

Three arms: ``on``, ``off`` and ``off2`` (the same setting as ``off``, timed separately), so the bench measures
its own noise band: ``noise`` = off2/off is what two identical settings differ by on this machine in this run,
and the watchdog's cost is "not measurable" when ``overhead`` = on/off lies inside it (|overhead - 1| <=
|noise - 1|, printed as ``inside_noise=1``) or below it (``on`` faster than ``off``: overhead - 1 <= |noise - 1|,
``no_cost=1``, the verdict; ``inside_noise`` says whether the arms differ at all). Rounds alternate the arms
(on, off, off2, off2, off, on, ...) after discarded warm-up rounds of both settings (the first loader of each
is cold) so drift on a shared machine hits all alike; each round builds a fresh loader and times ``--batches``
batches after the first (start-up excluded). Reported: the median ms/batch of each arm, the ratios, and the per-read
overhead in us implied by the difference. Last line:
``watchdog: on_ms=<m> off_ms=<m> off2_ms=<m> overhead=<on/off> noise=<off2/off> inside_noise=<0|1> no_cost=<0|1>
per_read_us=<us> mech_batch_us=<us> mech_read_us=<us>`` (one line; ``mech_*``: the mechanism alone, without the loader, see
``mechanism``).
``--quick`` is the CI smoke run (2 batches, 1 round per arm; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bridge.models.bagel.data.build import build_bagel_train_loader  # noqa: E402
from bridge.models.bagel.data.config import load_config  # noqa: E402
from bridge.models.bagel.data.converter.demo import make_demo_data  # noqa: E402
from bridge.models.bagel.data.tokenizer import load_tokenizer  # noqa: E402
from bridge.models.bagel.data.watchdog import (  # noqa: E402
    DEFAULT_STALL_WARN_S, DEFAULT_TIMEOUT_S, ReadWatch, batch_call)


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


def mechanism(reads_per_batch: int, batches: int) -> tuple[float, float]:
    """The watchdog's own cost without the loader: (us per batch through ``batch_call`` with ``reads_per_batch``
    stamped inline reads, minus the same reads called directly; us per read through the per-read reader thread,
    minus a direct call). Medians of 5 runs; far less sensitive to a loaded machine than the loader's ms/batch."""
    watch = ReadWatch("bench", "bench", ["/bench"], stall_warn_s=DEFAULT_STALL_WARN_S, timeout_s=DEFAULT_TIMEOUT_S)
    off = ReadWatch("bench", "bench", ["/bench"], stall_warn_s=0, timeout_s=0)

    def one_batch(w: ReadWatch) -> int:
        return sum(w.call(int, 1) for _ in range(reads_per_batch))

    def timed(fn: Any, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) * 1e6 / n

    per_batch, per_read = [], []
    for _ in range(5):
        direct = timed(lambda: one_batch(off), batches)
        per_batch.append(timed(lambda: batch_call(one_batch, watch), batches) - direct)
        per_read.append((timed(lambda: one_batch(watch), batches) - direct) / reads_per_batch)
    watch.stop()
    return statistics.median(per_batch), statistics.median(per_read)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(REPO / "demo_data"), help="demo data dir (generated if missing)")
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="rounds per arm (alternated)")
    ap.add_argument("--workers", type=int, default=0, help="Energon num_workers")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads (0: torch's default); 1 steadies the numbers on a shared machine")
    ap.add_argument("--quick", action="store_true", help="CI smoke run: 2 batches, 1 round per arm")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.quick:
        args.batches, args.rounds = 2, 1
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    data_dir = Path(args.data)
    if not (data_dir / "groups.yaml").exists():
        make_demo_data(str(data_dir), seed=0)
    tokenizer = load_tokenizer(None)
    arms = ("on", "off", "off2")
    results: dict[str, list[tuple[float, int]]] = {a: [] for a in arms}
    order = (["on", "off", "off2", "off2", "off", "on"] * args.rounds)[:3 * args.rounds]
    if not args.quick:  # discarded warm-up rounds of both settings: the first loader of each is cold (caches,
        for on in (True, False):  # lazy imports; with the watchdog on, the batch thread's fresh malloc arena)
            run_once(data_dir, tokenizer, on, 2, args.workers)
    for i, arm in enumerate(tqdm(order, desc="rounds", unit="round", disable=args.quick)):
        results[arm].append(run_once(data_dir, tokenizer, arm == "on", args.batches, args.workers))
        tqdm.write(f"  round {i}: watchdog {arm:<4} {results[arm][-1][0]:.1f} ms/batch "
                   f"({results[arm][-1][1]} samples read)")
    mech_batch_us, mech_read_us = mechanism(16, 50 if args.quick else 500)
    ms = {a: statistics.median(r[0] for r in results[a]) for a in arms}
    reads = statistics.median(r[1] for r in results["on"]) / args.batches
    per_read_us = (ms["on"] - ms["off"]) * 1000 / reads if reads else float("nan")
    overhead, noise = ms["on"] / ms["off"], ms["off2"] / ms["off"]
    inside = int(abs(overhead - 1) <= abs(noise - 1))
    no_cost = int(overhead - 1 <= abs(noise - 1))  # one-sided: "on" is not slower than the noise band allows
    print(f"watchdog on {ms['on']:.1f} ms/batch, off {ms['off']:.1f} / {ms['off2']:.1f} ms/batch: overhead "
          f"{overhead:.3f}x, noise band (off vs off) {noise:.3f}x -> {'inside' if inside else 'outside'} the noise "
          f"({reads:.1f} samples read per batch, {per_read_us:.0f} us per read implied)")
    print(f"mechanism alone: {mech_batch_us:.0f} us per batch of 16 reads (one hand-over, stamped reads; "
          f"{mech_batch_us / 1000 / ms['off'] * 100:.3f} % of an off batch) vs {mech_read_us:.0f} us per read on a "
          "per-read reader thread")
    print(f"watchdog: on_ms={ms['on']:.1f} off_ms={ms['off']:.1f} off2_ms={ms['off2']:.1f} overhead={overhead:.3f} "
          f"noise={noise:.3f} inside_noise={inside} no_cost={no_cost} per_read_us={per_read_us:.0f} mech_batch_us={mech_batch_us:.0f} "
          f"mech_read_us={mech_read_us:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
