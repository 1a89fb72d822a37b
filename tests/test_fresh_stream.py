"""``data.fresh_stream``: the model resumes, the data stream starts fresh — the way out of a deliberate change.

A checkpoint written under one packer budget is refused under another (the refusal names the changed key and
``data.fresh_stream``); with ``data.fresh_stream=true`` the same resume runs, says so in one line, and the loader
starts at batch 0. The last run is a real 2-rank ``torchrun`` job launched from another directory with a
relative-path config (the path rule of ``load_job_config``), on another DP size than the checkpoint's.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from _external_common import SMALL_JOB, run_job_in_process
from _relative_project import project
from _warm_torchrun import warm_torchrun
from bridge.models.bagel.data.job.topology import AgreedError

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]
REPO = Path(__file__).resolve().parents[1]


def test_fresh_stream_resumes_a_changed_budget_and_says_so(demo_setup, tmp_path, caplog):
    job_yaml = project(demo_setup, tmp_path)
    _, tokenizer = demo_setup
    ckpt = tmp_path / "ckpt"

    def run(*overrides: str) -> dict:
        return run_job_in_process(job_yaml, [*SMALL_JOB, *overrides], tokenizer)

    first = run("train.train_iters=2", f"train.save={ckpt}")
    assert first["pipeline"]["position"] == 2
    changed = ["train.train_iters=3", f"train.load={ckpt}", "data.packer.max_num_tokens=9216"]
    with pytest.raises(AgreedError) as refused:
        run(*changed)
    text = str(refused.value)
    assert refused.value.kind == "ResumeMismatchError"
    assert "packer.max_num_tokens: saved=8192 current=9216" in text and "data.fresh_stream=true" in text, text

    # the same change, from another directory, on 2 ranks (the checkpoint has 1), with the key
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    rel_config = os.path.relpath(job_yaml, elsewhere)
    proc = subprocess.run(
        warm_torchrun(2, ["--config", rel_config, *SMALL_JOB, "train.global_batch_size=2", *changed,
                          "data.fresh_stream=true"]),
        cwd=elsewhere, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    said = [line for line in out.splitlines() if "data.fresh_stream=true: the loader state" in line]
    assert len(said) == 1 and "[rank0]" in said[0], said  # one line per job (rank 0's INFO)
    summary = json.loads(next(line for line in out.splitlines() if " summary: " in line).split(" summary: ", 1)[1])
    assert summary["start_step"] == 2 and summary["steps"] == 1
    assert summary["stream_position"] == 1  # batch 1 of a fresh stream, not batch 3 of the old one
