"""The main job end to end: 2-rank torchrun (gloo), crash, restart from a mid-run checkpoint, digests compared;
bad configurations end with one clear error line and a non-zero exit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
DEMO_BUDGETS = ["data.packer.expected_num_tokens=4096", "data.packer.max_num_tokens=8192",
                "data.packer.max_num_tokens_per_sample=4096", "data.packer.prefer_buffer_before=2048"]


def _run(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore", MASTER_PORT="29587")
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    # The demo's own runs A, B, C (prefetch producer on, as configured) at the tests' small budgets (4K/8K-token
    # packs instead of 16K/20K): exact resume does not depend on the pack size, the runs are start-up bound
    proc = _run(["scripts/demo.py", "--steps", "4", "--save-interval", "2", "--crash-after", "3", "--out", str(out),
                 *DEMO_BUDGETS], timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "resume verdict: identical" in proc.stdout
    # video in the mix (issue 40): the demo's vlm_sft videos (mp4 and frame folders), none dropped
    assert re.search(r"video in the mix: vlm_sft holds [1-9]\d* video records \([1-9]\d* mp4 files, [1-9]\d* frame "
                     r"folders\).*dropped for a video reason in run A: 0$", proc.stdout, re.M), proc.stdout[-3000:]
    assert "step loss and the final model" in proc.stdout and "| loss " in proc.stdout  # the demo trains the model
    return out


def test_restart_reproduces_the_uninterrupted_run(demo_run: Path) -> None:
    def digests(name: str) -> dict:
        rows = [json.loads(x) for x in (demo_run / name).read_text().splitlines()]
        return {(r["rank"], r["step"], r["micro"]): r["digest"] for r in rows}

    a, b, c = digests("a.jsonl"), digests("b.jsonl"), digests("c.jsonl")
    assert {k[0] for k in a} == {0, 1} and {k[1] for k in a} == {1, 2, 3, 4}
    assert {k[1] for k in b} == {1, 2, 3}                      # crashed after step 3
    assert {k[1] for k in c} == {3, 4}                         # restarted from the step-2 checkpoint
    assert all(c[k] == a[k] for k in c) and all(b[k] == a[k] for k in b)
    assert a[(0, 1, 0)] != a[(1, 1, 0)]                        # DP ranks read different data
    assert (demo_run / "ckpt_b" / "energon" / "iter_0000002" / "train_dataloader_dprank001.pt").is_file()
    # torchrun's per-launch log directories (one per run: A, B, C) are in the demo's output, not the temp dir
    assert len(list((demo_run / "torchelastic").iterdir())) == 3


def _error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error")]


def test_restore_under_another_order_fails_clearly(demo_run: Path) -> None:
    """A checkpoint of the default (elastic) order resumed under data.order: official (on 1 rank: the official
    order cannot resize either) is refused in one line naming the order."""
    proc = _run(["scripts/pretrain_bagel.py", f"train.load={demo_run / 'ckpt_b'}", "train.global_batch_size=1",
                 "train.train_iters=5", "train.progress=false", "data.order=official", "data.num_workers=1"])
    assert proc.returncode != 0
    lines = _error_lines(proc)
    text = proc.stderr.replace("\n  ", " ")  # the error's detail lines joined to its first line
    assert len(lines) == 1 and "order" in text[text.index("error [rank 0]"):].lower(), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr.split(lines[0])[-1]


def test_missing_dataset_path_fails_clearly(tmp_path: Path) -> None:
    proc = _run(["scripts/pretrain_bagel.py", f"data.dataset_info={tmp_path / 'nope.yaml'}", "train.progress=false"])
    assert proc.returncode != 0
    lines = _error_lines(proc)
    assert len(lines) == 1 and "nope.yaml" in lines[0], proc.stderr[-3000:]


def test_unknown_group_fails_clearly(tmp_path: Path) -> None:
    groups = tmp_path / "groups.yaml"
    groups.write_text("t2i_pretrain:\n  dataset_names: [demo_t2i]\n  weight: 1\n  is_mandatory: true\n"
                      "video_magic:\n  dataset_names: [x]\n  weight: 1\n")
    proc = _run(["scripts/pretrain_bagel.py", f"data.groups={groups}", "train.progress=false"])
    assert proc.returncode != 0
    lines = _error_lines(proc)
    assert len(lines) == 1 and "video_magic" in lines[0], proc.stderr[-3000:]


def test_unknown_config_key_fails_clearly() -> None:
    proc = _run(["scripts/pretrain_bagel.py", "train.trian_iters=3"])
    assert proc.returncode != 0
    lines = _error_lines(proc)
    assert len(lines) == 1 and "trian_iters" in lines[0], proc.stderr[-3000:]
