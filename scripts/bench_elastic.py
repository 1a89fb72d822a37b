#!/usr/bin/env python3
"""Benchmark the default order (``data.order: elastic``) against the official order (``official``), same run.

On the demo data at default budgets, for ``num_workers`` 0 and 2, in alternated rounds (official, elastic,
official, elastic, …, so load drifts hit both alike):
(a) start-up: loader build + first batch, per order;
(b) steady-state batches/s and tokens/s, per order;
(c) with ``num_workers`` 2: the rank's processes (the loader's process and its read workers) and their memory
    (proportional set size, MB, from ``/proc/PID/smaps_rollup``): one read pool per rank serves every group;
(d) the state after an elastic resize (DP 2 -> 3): bytes per rank, and the time to compute and restore it.
Growth: the elastic reader's per-rank cost is O(owned partitions) (cursors) plus O(runs) (the selection layout);
``--partitions`` shows the state at another partition count.
Last line: ``elastic: throughput_ratio=<elastic/official tokens/s, workers 0> throughput_ratio_w2=<…, workers 2>
startup_ratio=<elastic/official start-up> processes_w2=<processes of one rank> pss_mb_w2=<their memory>
state_bytes=<max per rank after resize> restore_s=<…>``.
``--quick`` is the CI smoke run (one round, few batches): it proves the bench works, its numbers mean little.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import statistics
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bridge.models.bagel.data.build import build_bagel_train_loader  # noqa: E402
from bridge.models.bagel.data.config import load_config  # noqa: E402
from bridge.models.bagel.data.converter.demo import make_demo_data  # noqa: E402
from bridge.models.bagel.data.tokenizer import load_tokenizer  # noqa: E402


def _config(data_dir: Path, order: str, workers: int, partitions: int):
    return load_config(None, [f"groups={data_dir / 'groups.yaml'}", f"dataset_info={data_dir / 'dataset_info.yaml'}",
                              f"num_workers={workers}", "prefetch=0", "packer.use_flex=true",
                              "packer.max_latent_size=64", f"order={order}", f"partitions={partitions}"])


def rank_footprint() -> dict[str, float]:
    """This process and its descendants: how many, and their proportional set size in MB (shared pages split)."""
    def children(pid: int) -> list[int]:
        out = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            text = (task / "children").read_text().split()
            out += [int(c) for c in text]
        return out

    pids, todo = [], [os.getpid()]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        try:
            todo += children(pid)
        except OSError:
            pass
    pss_kb = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss_kb += int(line.split()[1])
        except OSError:
            pass
    return {"processes": float(len(pids)), "pss_mb": pss_kb / 1024}


def measure(data_dir: Path, order: str, workers: int, n: int, tok, partitions: int) -> dict[str, float]:
    """Start-up (build + first batch, s), steady tokens/s and the rank's footprint of one fresh loader of DP rank
    0 of 1."""
    if order == "official":  # its num_workers are emulated DataLoader workers (in this process), at least one
        workers = max(workers, 1)
    t0 = time.perf_counter()
    loader = build_bagel_train_loader(_config(data_dir, order, workers, partitions), tok, (0, 1), length=1000)
    with loader:
        next(loader)
        startup = time.perf_counter() - t0
        tokens, t0 = 0, time.perf_counter()
        for _ in range(n):
            tokens += int(next(loader)["sequence_length"])
        return {"startup_s": startup, "tokens_per_s": tokens / (time.perf_counter() - t0), **rank_footprint()}


def resize_cost(data_dir: Path, tok, partitions: int, steps: int) -> dict[str, float]:
    """Run DP 2 for ``steps`` batches per rank, resize to DP 3: state bytes per new rank, resize + restore time."""
    cfg = _config(data_dir, "elastic", 0, partitions)
    olds = []
    for r in range(2):
        with build_bagel_train_loader(cfg, tok, (r, 2), length=1000) as loader:
            for _ in range(steps):
                next(loader)
            olds.append(loader.save_state())
    sizes, times = [], []
    for r in range(3):
        loader = build_bagel_train_loader(cfg, tok, (r, 3), length=1000)
        t0 = time.perf_counter()
        state = loader.resize_states(olds, r, 3)
        loader.restore_state(state)
        times.append(time.perf_counter() - t0)
        sizes.append(len(pickle.dumps(state)))
        loader.close()
    return {"state_bytes": max(sizes), "restore_s": max(times)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=REPO / "runs" / "bench_elastic_data", help="demo data directory")
    ap.add_argument("--batches", type=int, default=12, help="steady-state batches per measurement")
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds per order")
    ap.add_argument("--partitions", type=int, default=1024)
    ap.add_argument("--quick", action="store_true", help="CI smoke run: 1 round, 2 batches, workers 0 only")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    warnings.filterwarnings("ignore")
    if args.quick:
        args.rounds, args.batches = 1, 2
    if not (args.data / "groups.yaml").exists():
        make_demo_data(str(args.data), seed=0)
    tok = load_tokenizer(None)
    result: dict[str, float] = {}
    for workers in ((0,) if args.quick else (0, 2)):
        runs: dict[str, list[dict[str, float]]] = {"official": [], "elastic": []}
        for _ in range(args.rounds):
            for order in runs:
                runs[order].append(measure(args.data, order, workers, args.batches, tok, args.partitions))
        med = {o: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for o, rs in runs.items()}
        for order, m in med.items():
            print(f"workers {workers}  {order:8s} start-up {m['startup_s']:6.2f} s   {m['tokens_per_s']:9.0f} tokens/s"
                  f"   {m['processes']:.0f} processes, {m['pss_mb']:.0f} MB")
        suffix = "" if workers == 0 else f"_w{workers}"
        result[f"throughput_ratio{suffix}"] = med["elastic"]["tokens_per_s"] / med["official"]["tokens_per_s"]
        if workers == 0:
            result["startup_ratio"] = med["elastic"]["startup_s"] / med["official"]["startup_s"]
        else:
            result[f"processes{suffix}"] = int(med["elastic"]["processes"])
            result[f"pss_mb{suffix}"] = med["elastic"]["pss_mb"]
    cost = resize_cost(args.data, tok, args.partitions, 2 if args.quick else 4)
    print(f"resize DP 2 -> 3: state {cost['state_bytes']} bytes per rank (max), resize + restore {cost['restore_s']:.3f} s")
    result.update(cost)
    print("elastic: " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
