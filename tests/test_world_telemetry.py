"""Every rank in the numbers (issue 33): rank 0's interval line and the summary are the DP world's.

A 2-rank ``torchrun`` job over a 32-sample t2i group whose one broken row (no image) is read only by DP rank 1:
rank 0's interval lines and the summary count that drop (and say it happened on 1 of 2 ranks), every interval
line names the group's completed epochs, and ``train.stop_at_epoch`` ends the run at the step the world
completes that epoch; the same job (``packer.strategy: balanced``) logs the straggler line of every step
(issue 34). In process: the summary of a group read through 1024 partitions stays small; a rank that waits for a
slower one says so.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from _external_common import run_job_in_process
from _warm_torchrun import free_port, warm_torchrun
from bridge.models.bagel.data.job.config import TrainConfig
from test_liveness import SMALL, T2I_ARGS, _png, _t2i

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]
BROKEN_ROW = 7  # elastic order, 32 partitions of one sample on 2 ranks: partition p is read by rank p % 2
LARGER = {"max_image_size": 256, "min_image_size": 128, "image_stride": 16}  # ~100 tokens a sample: ~4 per pack


def _job_files(root: Path, rows: list[dict], transform: dict) -> Path:
    path = _t2i(root, rows)
    (root / "groups.yaml").write_text(yaml.safe_dump({"t2i_pretrain": {
        "dataset_names": ["d"], "weight": 1, "is_mandatory": True, "image_transform_args": transform}}))
    (root / "dataset_info.yaml").write_text(yaml.safe_dump({"t2i_pretrain": {"d": {
        "data_dir": "unused", "energon_path": path}}}))
    return root


def _overrides(root: Path) -> list[str]:
    return [f"data.groups={root / 'groups.yaml'}", f"data.dataset_info={root / 'dataset_info.yaml'}",
            *(f"data.packer.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in SMALL.items()),
            "data.packer.max_latent_size=64", "data.prefetch=0", "train.progress=false", "train.log_interval=1"]


def test_rank0_counts_rank1s_drop_logs_epochs_and_stops_at_one(tmp_path) -> None:
    rows = [{"image": None if i == BROKEN_ROW else _png(24, 16, i), "captions": json.dumps({"c": f"photo {i}"})}
            for i in range(32)]
    root = _job_files(tmp_path, rows, LARGER)
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = warm_torchrun(2, ["demo_data=null", *_overrides(root), "train.train_iters=60", "train.global_batch_size=2",
                            "train.stop_at_epoch=2", f"train.save={tmp_path}/ck", "data.packer.strategy=balanced"],
                        options=("--log-dir", str(tmp_path / "torchelastic")))
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    # only rank 1 read the broken row (each rank warns about its own drops) ...
    own = [x for x in log.splitlines() if "dropped a sample (missing_image)" in x]
    assert own and all("[rank1]" in x for x in own), own
    # ... and rank 0's lines count it, over the world
    lines = [x for x in log.splitlines() if "[rank0]" in x and " | drops " in x]
    assert lines and all("| epochs t2i_pretrain " in x for x in lines), log[-4000:]
    last = lines[-1]
    assert re.search(r"drops \{'missing_image': \d+\} on 1 of 2 ranks", last), last
    epochs = [int(re.search(r"epochs t2i_pretrain (\d+) \(", x).group(1)) for x in lines]
    assert epochs == sorted(epochs) and epochs[0] < 2 and epochs[-1] == 2, epochs  # crossed boundaries, stopped at 2
    step = int(re.search(r"step (\d+) \|", last).group(1))
    assert 1 < step < 60
    assert re.search(rf"train.stop_at_epoch=2: stopping after step {step} .*'t2i_pretrain' completed epoch 2", log)
    summary_line = next(x for x in log.splitlines() if " summary: " in x)
    summary = json.loads(summary_line.split(" summary: ", 1)[1])
    assert summary["stopped_at_epoch"] == {"step": step, "epochs": {"t2i_pretrain": 2}}
    assert summary["steps"] == step and summary["dp_size"] == 2 and summary["batches"] == 2 * step
    group = summary["groups"]["t2i_pretrain"]
    assert summary["drops"]["missing_image"] == group["dropped"]["missing_image"] >= 2  # once per epoch read
    assert group["consumed"] == group["packed"] + group["buffered"] + sum(
        n for r, n in group["dropped"].items() if r != "missing_image")  # the packer's ledger, over the world
    assert group["epoch"] == 2 and group["epochs_read"] >= 2
    straggler = [x for x in log.splitlines() if "straggler: compute max/mean over 2 DP ranks" in x]
    assert len(straggler) == step and "straggler_ratio" in summary, log[-4000:]  # every step's line; the run's ratio
    saved = (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip()
    assert saved == str(step), saved  # the checkpoint is where it stopped


def test_summary_is_small_at_1024_partitions(tmp_path, demo_setup) -> None:
    _, tokenizer = demo_setup
    rows = [{"image": _png(16, 16, i), "captions": json.dumps({"c": f"p{i}"})} for i in range(1100)]
    root = _job_files(tmp_path, rows, T2I_ARGS)
    summary = run_job_in_process(None, [*_overrides(root), "data.partitions=1024", "train.train_iters=2",
                                        "train.global_batch_size=1"], tokenizer)
    assert summary["pipeline"]["sources"]["t2i_pretrain"]["blocks_open"] == 1024  # one rank reads all 1024
    logged = json.dumps({k: v for k, v in summary.items() if k != "pipeline"})  # what the launcher logs
    assert len(logged) < 2048, len(logged)
    assert summary["groups"]["t2i_pretrain"]["epoch"] == 0 and summary["dp_size"] == 1


def test_stop_at_epoch_is_checked_with_the_other_keys() -> None:
    assert TrainConfig(stop_at_epoch=0).problems() == [
        "train.stop_at_epoch: must be null or a positive integer (completed epochs), got 0"]
    assert TrainConfig(stop_at_epoch=3).problems() == []


_WAITING_RANKS = r"""
import logging, os, time
import torch.distributed as dist
from bridge.models.bagel.data.job.topology import agree

dist.init_process_group("gloo")
rank = dist.get_rank()
logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(levelname)s %(message)s")
if rank == 1:
    time.sleep(3.0)  # this rank's data is slow (the watchdog would name its shard on this rank)
agree(None, "at step 7", warn_s=0.5)
dist.destroy_process_group()
"""


def test_a_rank_waiting_for_a_slower_one_says_so(tmp_path) -> None:
    """The waiting ranks warn too while one rank's data stalls: rank 0, ready, says it waits at that step for the
    others (the slow rank's own watchdog line names the shard), then when they arrived; rank 1 says nothing."""
    script = tmp_path / "waiting.py"
    script.write_text(_WAITING_RANKS)
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr",
                           "127.0.0.1", "--master-port", str(free_port()), str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=env)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    waited = [x for x in log.splitlines() if "for other ranks" in x]
    assert len(waited) == 1 and waited[0].startswith("[rank0] WARNING rank 0 has waited") and "at step 7" in waited[0]
    arrived = [x for x in log.splitlines() if "the other ranks arrived at step 7" in x]
    assert len(arrived) == 1 and arrived[0].startswith("[rank0]"), log[-3000:]
