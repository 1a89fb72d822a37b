"""Start-up: one rank's time to its first batch after imports, and the 2-rank main job's time to its first step.

**Loader** (``startup:`` keys ``imports_s`` … ``after_imports_s``), at the default budgets (32K expected / 36K max)
on demo data.

Each measurement is a fresh Python process (what every rank pays at launch and at every restart): it imports
torch, transformers' Qwen2 tokenizer module and our builder (``imports_s``), then loads the offline tokenizer
(``tokenizer_s``: the disk cache, see ``tokenizer.py``), builds one rank's loader (``build_s``) and takes the first
batch (``first_batch_s``). ``after_imports_s`` is the sum of the last three; target <= 2 s. The first process may
also write the tokenizer's snapshot, so ``--runs`` processes are timed and the median is reported. Last line:
``startup: imports_s=<a> tokenizer_s=<b> build_s=<c> first_batch_s=<d> after_imports_s=<e>``.

**Job** (keys ``job_*``; ``--loader-only`` skips it): ``torchrun --nproc-per-node=2 scripts/pretrain_bagel.py`` on
the demo data, one step (``--model``: ``null`` data only, the default, or ``bagel-tiny``), timed from the launch to
rank 0's ``start-up:`` line (logged as the first step begins: ``job_first_step_s``), with the job's own phase
split from its summary (``job_<phase>_s``: rank 0's ``startup_s``). The baseline, measured in the same run:
``job_import_floor_s``, the same launch of a 2-rank script that only imports what the job's path imports (torch,
Megatron-Core, transformers' Qwen2 tokenizer module, Megatron-Bridge's data and checkpoint modules, this
package's job; with the cyclic collector paused, as the job has it) and exits at once; ``job_over_floor`` is the ratio, what the job adds on top of its imports.
Runs alternate job / floor; medians of ``--runs``.

``--quick`` is the CI smoke run (one run of each, the job and its floor on 1 rank instead of 2, no verdict;
``tests/test_benches.py``): it proves the bench still works, its numbers mean nothing.
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
#: the import floor's script: what the job's path imports, then nothing (rank 0 prints when done)
FLOOR = """
import sys
sys.path.insert(0, {repo!r})
from bridge.models.bagel.data.job.startup import pause_gc
pause_gc()  # the job imports with the collector paused (job/startup.py): the floor imports the same way
import torch, megatron.core.parallel_state
from transformers import Qwen2Tokenizer
from bridge.models.bagel.data._bridge import import_bridge
import bridge.models.bagel.data.job.runner, bridge.models.bagel.launch
import_bridge()
print("imports done", flush=True)
"""


def _torchrun(script: list[str], port: int, nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr", "127.0.0.1",
            "--master-port", str(port), *script]


def _time_until(cmd: list[str], marker: str, log: str) -> tuple[float, str]:
    """Seconds from starting ``cmd`` to the first output line holding ``marker`` (the whole output is kept in
    ``log``); RuntimeError naming the log when the command ends without it or fails."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    seen = None
    lines: list[str] = []
    with open(log, "w", encoding="utf-8") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            fh.write(line)
            lines.append(line)
            if seen is None and marker in line:
                seen = time.perf_counter() - t0
        rc = proc.wait()
    if rc != 0 or seen is None:
        raise RuntimeError(f"{' '.join(cmd[-3:])}: exit {rc}, {marker!r} {'seen' if seen else 'never logged'}; "
                           f"see {log}")
    return seen, "".join(lines)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_startup(demo_dir: str, runs: int, model: str, work: str, nproc: int = 2) -> dict[str, float]:
    """Median launch -> first step of the ``nproc``-rank job and of its import floor (alternated), with the job's
    phases."""
    floor_py = os.path.join(work, "import_floor.py")
    with open(floor_py, "w", encoding="utf-8") as fh:
        fh.write(FLOOR.format(repo=REPO))
    job = [os.path.join(REPO, "scripts", "pretrain_bagel.py"), f"--config={os.path.join(REPO, 'configs', 'demo.yaml')}",
           f"demo_data={demo_dir}", f"data.groups={demo_dir}/groups.yaml",
           f"data.dataset_info={demo_dir}/dataset_info.yaml", "train.train_iters=1", f"train.global_batch_size={nproc}",
           "train.save=null", "train.progress=false", f"model.name={model}"]
    firsts, floors, phases = [], [], []
    for i in range(runs):
        first, out = _time_until(_torchrun(["--log-dir", os.path.join(work, "te"), *job], _free_port(), nproc),
                                 "start-up:", os.path.join(work, f"job{i}.log"))
        floor, _ = _time_until(_torchrun(["--log-dir", os.path.join(work, "te"), floor_py], _free_port(), nproc),
                               "imports done", os.path.join(work, f"floor{i}.log"))
        summary = json.loads(out.split("summary: ", 1)[1].splitlines()[0])
        firsts.append(first)
        floors.append(floor)
        phases.append(summary["startup_s"]["phases"])
        print(f"job run {i}: first step {first:.2f} s, import floor {floor:.2f} s; rank 0 phases {phases[-1]}",
              flush=True)
    out = {"job_first_step_s": statistics.median(firsts), "job_import_floor_s": statistics.median(floors)}
    out["job_over_floor"] = out["job_first_step_s"] / out["job_import_floor_s"]
    for name in dict.fromkeys(n for p in phases for n in p):  # every phase any run had, in order of appearance
        out[f"job_{name.replace(' ', '_').replace('-', '_').lower()}_s"] = statistics.median(
            p.get(name, 0.0) for p in phases)
    return out


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
    ap.add_argument("--loader-only", action="store_true", help="skip the 2-rank job and its import floor")
    ap.add_argument("--model", default="null", help="the job's model.name (default %(default)s: data only)")
    ap.add_argument("--quick", action="store_true", help="CI smoke run: one fresh process (and one 1-rank job run)")
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
    verdict = ("not judged (--quick)" if args.quick
               else "met" if med["after_imports_s"] <= TARGET_S else "MISSED")
    print(f"{'flex' if not args.dense else 'dense'} masks, {args.num_workers} Energon workers; target after imports "
          f"<= {TARGET_S:.0f} s: {verdict}")
    if not args.loader_only:
        with tempfile.TemporaryDirectory(prefix="bench_startup_") as work:
            job = job_startup(args.demo_dir, args.runs, args.model, work, nproc=1 if args.quick else 2)
        print(f"{1 if args.quick else 2}-rank job (model {args.model}): launch -> first step {job['job_first_step_s']:.2f} s, its imports "
              f"alone {job['job_import_floor_s']:.2f} s (x{job['job_over_floor']:.2f})")
        med.update(job)
    print("startup: " + " ".join(f"{k}={v:.2f}" for k, v in med.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
