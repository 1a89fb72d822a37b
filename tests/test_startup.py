"""Start-up accounting (``job/startup.py``) and which paths import Megatron-Bridge / modelopt / Megatron-Core.

The job's own start-up line and ``startup_s`` summary under ``torchrun`` are checked in ``test_train_job.py`` (run A);
``scripts/bench_startup.py`` times the 2-rank job against its import floor.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bridge.models.bagel.data.job.startup import StartupClock, process_start_time

REPO = Path(__file__).resolve().parents[1]


def test_process_start_time_is_when_the_process_started() -> None:
    """A child's own reading of its start is within a few hundred ms of when we started it (10 ms ticks)."""
    before = time.time()
    out = subprocess.run([sys.executable, "-c", "import time; time.sleep(0.5); "
                          "from bridge.models.bagel.data.job.startup import process_start_time as p; print(p())"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    after = time.time()
    started = float(out.strip())
    assert before - 0.05 <= started <= before + 0.5, (before, started, after)
    assert process_start_time() is not None and process_start_time() < before


def test_clock_books_the_time_between_marks_to_phases() -> None:
    clock = StartupClock(origin=time.time() - 2.0)  # started 2 s ago
    clock.mark("imports")
    time.sleep(0.05)
    clock.mark("tokenizer")
    clock.mark("tokenizer")  # marked twice: added up
    phases = clock.seconds()
    assert list(phases) == ["imports", "tokenizer"]
    assert 2.0 <= phases["imports"] < 2.5 and 0.05 <= phases["tokenizer"] < 0.5
    assert clock.total() == pytest.approx(sum(phases.values()), abs=1e-6)
    report = clock.report(9.87654)
    assert report["slowest_rank"] == 9.88 and set(report["phases"]) == {"imports", "tokenizer"}
    line = clock.line(9.87654)
    assert line.startswith("start-up: 2.") and "(slowest rank 9.9 s)" in line and "tokenizer 0." in line


def test_clock_origin_defaults_to_the_process_start() -> None:
    clock = StartupClock()
    clock.mark("everything so far")
    start = process_start_time()
    assert start is not None and clock.origin == pytest.approx(start, abs=0.05)
    assert clock.total() > 0.5  # this pytest process has been running for longer than that


@pytest.mark.slow
def test_data_commands_import_neither_bridge_nor_modelopt_nor_megatron_core(demo_setup, tmp_path: Path) -> None:
    """``bagel-data stats`` / ``verify`` (fresh process) load none of the job's heavy imports; ``ledger`` does load
    Megatron-Bridge (its restricted unpickler reads the state files)."""
    out = demo_setup[0]
    config = tmp_path / "job.yaml"
    config.write_text(f"data:\n  groups: {out}/groups.yaml\n  dataset_info: {out}/dataset_info.yaml\n"
                      "  packer:\n    max_latent_size: 64\n")
    probe = ("import contextlib, io, json, sys\n"
             "from bridge.models.bagel.data.tools.cli import main\n"
             "codes = []\n"
             "with contextlib.redirect_stdout(io.StringIO()):\n"
             f"    codes.append(main(['stats', '--config', {str(config)!r}, '--histogram', '']))\n"
             f"    codes.append(main(['verify', {str(out)!r}]))\n"
             "heavy = sorted({m.split('.')[0] + ('.' + m.split('.')[1] if m.startswith('megatron.') else '')\n"
             "                for m in sys.modules if m.startswith(('megatron.bridge', 'megatron.core', 'modelopt',\n"
             "                                                      'megatron.training'))})\n"
             "print(json.dumps({'codes': codes, 'heavy': heavy}))\n")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"codes": [0, 0], "heavy": []}, result
