"""A killed prefetch job leaves no shared memory behind: its segments are reclaimed at the next start once its
owner is dead, never while it lives; torch's segment naming that this relies on; a normal exit leaves nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bridge.models.bagel.data.pipeline import shm

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")

# A prefetching "job": golden packer, prefetch=2, a few batches, then it holds its batches and waits for
# commands on stdin ("next": one more batch; "exit": normal exit). Prints its trainer and producer pids.
_JOB = r"""
import json, os, sys, time
sys.path.insert(0, "tests")
from _external_common import FLEX_CASE, golden_loader
from bridge.models.bagel.data.pipeline.prefetch import live_producers
loader = golden_loader(FLEX_CASE, prefetch=2)
held = [next(loader) for _ in range(2)]
time.sleep(0.5)  # let the producer fill its queue: segments in flight as well as in use
print(json.dumps({"trainer": os.getpid(), "producer": [p.pid for p in live_producers()]}),
      flush=True)
for line in sys.stdin:
    if line.strip() == "next":
        held.append(next(loader))
        print("ok", flush=True)
    else:
        break
held.clear()
loader.close()
"""


def _start_job() -> tuple[subprocess.Popen, dict]:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    proc = subprocess.Popen([sys.executable, "-c", _JOB], cwd=REPO, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    line = proc.stdout.readline()
    assert line, f"job did not start (exit code {proc.poll()})"
    return proc, json.loads(line)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _kill_like_a_preemption(proc: subprocess.Popen) -> None:
    """SIGKILL every process of the job at once, torch_shm_manager included (it runs in its own session, but a
    scancel / cgroup / container kill takes it too; with it alive torch itself would clean up)."""
    pids = _descendants(proc.pid)
    for pid in reversed(pids):  # deepest first: the manager before it can notice its clients dying
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)
    for pid in pids:  # reap-free wait: the non-children (producer, manager) are gone once /proc forgets them
        deadline = time.time() + 10
        while Path(f"/proc/{pid}").exists() and time.time() < deadline:
            time.sleep(0.05)


def _ours(info: dict) -> list[str]:
    return [s for pid in info["producer"] for s in shm.segments_of(pid)]


def _owner_files_of(info: dict) -> list[str]:
    return [f for f in shm.owner_files() if f"{shm._PREFIX}{info['trainer']}-" in f]


def _wait_gone(info: dict, timeout: float = 15.0) -> list[str]:
    deadline = time.time() + timeout
    while (_ours(info) or _owner_files_of(info)) and time.time() < deadline:
        time.sleep(0.1)
    return _ours(info) + _owner_files_of(info)


def _exit_normally(proc: subprocess.Popen) -> None:
    proc.stdin.write("exit\n")
    proc.stdin.flush()
    assert proc.wait(timeout=60) == 0


@pytest.mark.slow
@pytest.mark.serial  # any producer starting in a parallel test process would reclaim the killed job's debris first
def test_killed_job_debris_is_reclaimed_at_restart_but_a_live_job_is_not_touched() -> None:
    live, live_info = _start_job()
    try:
        killed, killed_info = _start_job()
        _kill_like_a_preemption(killed)
        debris = _ours(killed_info)
        assert debris, "no segments left by the killed job: the kill did not reproduce the leak"
        assert _owner_files_of(killed_info)
        live_segments = _ours(live_info)
        assert live_segments and _owner_files_of(live_info)

        restart, restart_info = _start_job()  # its producer start reclaims what dead jobs left
        assert not [s for s in debris if os.path.exists(s)], "the killed job's segments survived the restart"
        assert not _owner_files_of(killed_info)
        assert all(os.path.exists(s) for s in live_segments), "a live job's segments were reclaimed"
        assert _owner_files_of(live_info)

        live.stdin.write("next\n")  # the live job still works after the restart's reclaim
        live.stdin.flush()
        assert live.stdout.readline().strip() == "ok"
        _exit_normally(restart)
        _exit_normally(live)
        assert not _wait_gone(restart_info) and not _wait_gone(live_info), "a normal exit left something"
    finally:
        for p in (live, locals().get("killed"), locals().get("restart")):
            if p is not None and p.poll() is None:
                _kill_like_a_preemption(p)


def _fake_dead_job(shm_dir: Path, n_segments: int) -> int:
    """A forked 'producer' that registers under a fresh owner file, makes segments, and dies by SIGKILL."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: the trainer side of a job that is about to be killed ...
        try:
            shm.register_job(str(shm_dir))
            child = os.fork()
            if child == 0:  # ... and its producer
                shm.register_process()
                for i in range(n_segments):
                    (shm_dir / f"torch_{os.getpid()}_123_{i}").write_bytes(b"x" * 100)
                os.write(w, f"{os.getpid()}\n".encode())
                time.sleep(60)
            time.sleep(60)
        finally:
            os._exit(1)
    producer = int(os.fdopen(r).readline())
    os.close(w)
    for p in (producer, pid):
        os.kill(p, signal.SIGKILL)
    os.waitpid(pid, 0)
    while Path(f"/proc/{producer}").exists():  # reparented: not ours to reap
        time.sleep(0.01)
    return producer


def test_reclaim_takes_only_dead_owners(tmp_path: Path) -> None:
    dead = _fake_dead_job(tmp_path, 3)
    assert len(shm.segments_of(dead, str(tmp_path))) == 3
    live = shm.register_job(str(tmp_path))  # this process: alive, holds its lock
    try:
        shm.register_process()
        mine = tmp_path / f"torch_{os.getpid()}_1_0"
        mine.write_bytes(b"y" * 10)
        stranger = tmp_path / "torch_1_2_3"  # not registered by any job of ours
        stranger.write_bytes(b"z")
        t0 = time.perf_counter()
        count, nbytes = shm.reclaim_stale(str(tmp_path))
        elapsed = time.perf_counter() - t0
        assert (count, nbytes) == (3, 300)
        assert not shm.segments_of(dead, str(tmp_path))
        assert mine.exists() and stranger.exists() and os.path.exists(live.path)
        assert shm.owner_files(str(tmp_path)) == [live.path]
        assert elapsed < 0.5
    finally:
        live.release()
    assert not shm.owner_files(str(tmp_path))


def test_torch_names_file_system_segments_after_the_creating_pid() -> None:
    """What reclaim relies on: file_system segments are /dev/shm/torch_<creator pid>_* (checked in a child)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            import torch.multiprocessing as torch_mp

            torch_mp.set_sharing_strategy("file_system")
            storage = torch.UntypedStorage._new_shared(4096)
            name = storage._share_filename_cpu_()[1].decode()
            os.write(w, f"{name} {int(os.path.exists(os.path.join(shm.SHM_DIR, name.lstrip('/'))))}\n".encode())
        finally:
            os._exit(0)
    os.close(w)
    name, exists = os.fdopen(r).readline().split()
    os.waitpid(pid, 0)
    assert name.startswith(f"/torch_{pid}_") and exists == "1"


# A job reading with 2 read processes and no prefetch producer: builds the demo loader, takes 2 batches (the
# workers are forked at the first read), prints its pid and waits to be killed.
_WORKERS_JOB = r"""
import json, os, sys, time
sys.path.insert(0, "tests")
from _external_common import demo_config
from bridge.models.bagel.data.build import build_bagel_train_loader
from bridge.models.bagel.data.tokenizer import build_qwen2_tokenizer
from pathlib import Path
loader = build_bagel_train_loader(demo_config(Path(sys.argv[1]), 2, True, prefetch=0), build_qwen2_tokenizer(), (0, 1))
held = [next(loader) for _ in range(2)]
print(json.dumps({"trainer": os.getpid()}), flush=True)
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.serial  # another test's loader start would reclaim the killed job's debris first
def test_a_killed_jobs_read_workers_leave_nothing_after_the_next_loader_start(demo_setup) -> None:
    """SIGKILL a job with ``data.num_workers=2, prefetch=0`` (its read workers' ``torch_<pid>_*`` segments have
    no producer to own them): its owner file records the workers, and the next loader start, without workers
    or prefetch, reclaims everything of it."""
    from _external_common import demo_config
    from bridge.models.bagel.data.build import build_bagel_train_loader

    out, tok = demo_setup
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    proc = subprocess.Popen([sys.executable, "-c", _WORKERS_JOB, str(out)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line, f"job did not start (exit code {proc.poll()})"
        info = json.loads(line)
        pids = _descendants(proc.pid)
        owners = _owner_files_of(info)
        assert len(owners) == 1, owners
        recorded = {int(x.split()[1]) for x in Path(owners[0]).read_text().splitlines() if x.startswith("pid ")}
        workers = set(pids) - {proc.pid}
        assert workers and workers <= recorded, (workers, recorded)  # every forked read worker is on record
        _kill_like_a_preemption(proc)
        left = [s for pid in pids for s in shm.segments_of(pid)]
        loader = build_bagel_train_loader(demo_config(out, 0, True, prefetch=0), tok, (0, 1))
        loader.close()
        assert not [s for pid in pids for s in shm.segments_of(pid)], f"segments survived the next start ({left})"
        assert not _owner_files_of(info)
    finally:
        if proc.poll() is None:
            _kill_like_a_preemption(proc)
