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

from _warm_torchrun import free_port
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
    report = clock.report((3, 9.87654))
    assert report["slowest_rank"] == {"rank": 3, "ready": 9.88} and set(report["phases"]) == {"imports", "tokenizer"}
    line = clock.line((3, 9.87654))
    assert line.startswith("start-up: 2.") and "(slowest: rank 3, ready at 9.9 s)" in line and "tokenizer 0." in line


def _slow_rank_world(rank: int, world: int, port: int, out: str) -> None:
    """One rank of a gloo world whose last rank works 1 s longer than the others before it is ready."""
    import torch.distributed as dist

    from bridge.models.bagel.data.job.startup import StartupClock, reduce_startup

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        clock = StartupClock(origin=time.time() - 1.0)  # every rank started 1 s ago
        clock.mark("imports")
        if rank == world - 1:
            time.sleep(1.0)  # its loader takes 1 s: the others wait for it
        clock.mark("loader")
        who, ready = reduce_startup(clock)
        Path(out, f"{rank}.json").write_text(json.dumps({"who": who, "ready": ready, "phases": clock.seconds()}))
    finally:
        dist.destroy_process_group()


def test_reduce_startup_names_the_rank_that_was_ready_last(tmp_path: Path) -> None:
    """A real 3-rank gloo world: every rank learns that rank 2 was ready last, and when: its own time, not the total
    after the wait (which ends at about the same moment on every rank, so its maximum could name any rank); the
    others book their wait for it to the wait phase."""
    import torch.multiprocessing as mp

    mp.start_processes(_slow_rank_world, args=(3, free_port(), str(tmp_path)), nprocs=3, start_method="spawn")
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    assert {r["who"] for r in results} == {2}
    assert all(1.95 <= r["ready"] < 2.9 for r in results), results
    for r in results[:2]:
        assert r["phases"]["loader"] < 0.5 and r["phases"]["waiting for the other ranks"] >= 0.8, r  # waited for rank 2
    assert results[2]["phases"]["loader"] >= 1.0 and results[2]["phases"]["waiting for the other ranks"] < 0.5


def test_clock_origin_defaults_to_the_process_start() -> None:
    clock = StartupClock()
    clock.mark("everything so far")
    start = process_start_time()
    assert start is not None and clock.origin == pytest.approx(start, abs=0.05)
    assert clock.total() > 0.5  # this pytest process has been running for longer than that


@pytest.mark.slow
def test_data_commands_import_neither_bridge_nor_modelopt_nor_megatron_core(demo_setup, tmp_path: Path) -> None:
    """``bagel-data stats`` / ``verify`` (fresh process) load none of the job's heavy imports (``ledger`` and
    ``resize-state`` do import Megatron-Bridge, for its restricted unpickler of the state files: not checked here)."""
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


def test_gc_is_paused_for_start_up_enabled_in_forked_children_and_frozen_on_resume(tmp_path: Path) -> None:
    """``pause_gc`` switches the collector off (a child forked meanwhile has it on), ``resume_gc`` freezes the
    start-up's objects and switches it on again; both leave a collector the caller had switched off alone; and the
    job's entry point gives a caller its collector back when its start-up fails (here: a missing dataset file)."""
    script = f"""
import gc, os, sys
sys.path.insert(0, {str(REPO)!r})
from bridge.models.bagel.data.job.startup import pause_gc, resume_gc
pause_gc()
paused = gc.isenabled()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(w, b"1" if gc.isenabled() else b"0")
    os._exit(0)
os.waitpid(pid, 0)
child = os.read(r, 1).decode()
resume_gc()
frozen, enabled = gc.get_freeze_count(), gc.isenabled()
gc.disable()
pause_gc()
resume_gc()
kept_off = not gc.isenabled()
gc.enable()
from bridge.models.bagel.launch import main
code = main(["data.dataset_info={tmp_path / 'nope.yaml'}", "train.progress=false"])
print(paused, child, frozen > 0, enabled, kept_off, code, gc.isenabled())
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-7:] == ["False", "1", "True", "True", "True", "1", "True"], out.stdout + out.stderr[-2000:]
