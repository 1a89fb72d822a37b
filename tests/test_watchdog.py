"""Never a hang on bad storage: a shard read that never returns (a FIFO nobody writes, as a mount that stopped
answering) ends in one warning and then a DataTimeoutError naming group, dataset and shard, inline, through
Energon workers, through the prefetch producer and under a 2-rank torchrun job; a slow but healthy source is
never cut off; a killed prefetch job's shared memory is reclaimed by the next loader build, prefetch on or off."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from _warm_torchrun import warm_torchrun
from bridge.models.bagel.data.pipeline import shm
from bridge.models.bagel.data.build import build_bagel_train_loader
from bridge.models.bagel.data.errors import FIRST_LINE_LIMIT, error_lines
from bridge.models.bagel.data.watchdog import DataTimeoutError, ReadWatch, batch_call
from bridge.models.bagel.data.watchdog.stacks import enable_agents
from test_liveness import SMALL, T2I_ARGS, _config, _png, _t2i
from test_shm import _descendants, _kill_like_a_preemption, _ours, _owner_files_of, _start_job

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]
WARN_S, TIMEOUT_S = 1.5, 4.0


@pytest.fixture(scope="module")
def tok():
    from bridge.models.bagel.data.tokenizer import build_qwen2_tokenizer

    return build_qwen2_tokenizer()


def _dataset(root: Path) -> str:
    rows = [{"image": _png(24, 16, i), "captions": json.dumps({"c": f"photo {i}"})} for i in range(8)]
    return _t2i(root, rows)


def _stuck_mount(path: str) -> str:
    """Replace the dataset's shard by a FIFO nobody writes: opening it blocks forever, like a dead mount."""
    shard = os.path.join(path, "shards", "shard-000000.tar")
    os.unlink(shard)
    os.mkfifo(shard)
    return shard


def _release(shard: str) -> None:
    """Unblock readers still stuck in open() on the FIFO (a writer opens and closes it: they read EOF)."""
    try:
        os.close(os.open(shard, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def _others(before: set[int]) -> list[str]:
    left = []
    for pid in set(_descendants(os.getpid())) - before - {os.getpid()}:
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if "torch_shm" not in name and Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z":
            left.append(f"{pid} {name}")
    return left


@pytest.mark.parametrize("workers,prefetch,order", [(0, 0, "elastic")] + [
    pytest.param(w, p, o, marks=pytest.mark.slow) for w, p, o in ((2, 0, "elastic"), (0, 2, "elastic"),
                                                                  (2, 2, "elastic"))])
def test_a_read_that_never_returns_warns_then_times_out(tmp_path, tok, workers, prefetch, order):
    path = _dataset(tmp_path)
    shard = _stuck_mount(path)
    log = tmp_path / "watch.log"
    handler = logging.FileHandler(log)  # inherited by the producer and the workers: their lines land here too
    handler.setLevel(logging.WARNING)
    logging.getLogger("bridge.models.bagel.data").addHandler(handler)
    # a process of someone else's, forked from this one with a report agent (as an earlier loader's DataLoader
    # worker still alive in a long-lived process): the time-out must never kill it (SIGCHLD raised in the owner)
    enable_agents()
    bystander = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,), daemon=True)
    bystander.start()
    before = set(_descendants(os.getpid()))
    cfg = _config(tmp_path, "t2i_pretrain", path, T2I_ARGS, workers=workers, prefetch=prefetch)
    cfg.stall_warn_s, cfg.timeout_s, cfg.order = WARN_S, TIMEOUT_S, order
    try:
        loader = build_bagel_train_loader(cfg, tok, (0, 1), length=4)
        t0 = time.monotonic()
        with pytest.raises(DataTimeoutError) as err:
            next(loader)
        took = time.monotonic() - t0
        loader.close()
    finally:
        logging.getLogger("bridge.models.bagel.data").removeHandler(handler)
        handler.close()
        _release(shard)
        bystander_alive = bystander.is_alive()
        bystander.kill()
        bystander.join()
    assert bystander_alive, "the time-out killed a process that is not one of the reader's read workers"
    msg = str(err.value)
    assert "group 't2i_pretrain'" in msg and "dataset 't2i'" in msg and f"shard file {shard}" in msg, msg
    first, *detail = error_lines(0, "DataTimeoutError", msg)  # the job's error line: <= 300, the remedy below
    assert len(first) <= FIRST_LINE_LIMIT and detail and "check it" in " ".join(detail), (first, detail)
    assert ("in read worker" in msg) == (workers > 0), msg
    assert ("in prefetch producer" in msg) == (prefetch > 0 and workers == 0), msg
    assert TIMEOUT_S <= took < TIMEOUT_S + 8, took  # within the bound (plus the agents' report time)
    warnings = [x for x in log.read_text().splitlines() if "has waited" in x]
    assert len(warnings) == 1 and "group 't2i_pretrain'" in warnings[0], log.read_text()
    deadline = time.time() + 10
    while _others(before) and time.time() < deadline:
        time.sleep(0.2)
    assert not _others(before), "a process of the stuck loader was left behind"


@pytest.mark.parametrize("expected", [True, False])
def test_workers_the_reader_killed_are_not_an_error_at_close(expected):
    """After a time-out the reader SIGKILLs its stuck workers; torch's SIGCHLD handler then raises 'killed by signal'
    wherever the main thread is (fresh-clone CI: inside the close's worker join). A close step inside
    ``killed_workers_expected(True)`` goes on; without it (nothing killed on purpose) the error still propagates."""
    import signal

    from torch.utils.data import DataLoader, IterableDataset

    from bridge.models.bagel.data.energon.readers.workers import killed_workers_expected, shutdown_workers

    class Forever(IterableDataset):
        def __iter__(self):
            while True:
                time.sleep(60)
                yield 0

    loader = DataLoader(Forever(), batch_size=None, num_workers=1, persistent_workers=True,
                        multiprocessing_context="fork")
    iter(loader)  # starts the worker, stuck in the dataset
    pid = loader._iterator._workers[0].pid
    os.kill(pid, signal.SIGKILL)
    raised = None
    try:
        with killed_workers_expected(expected):
            time.sleep(2)  # the SIGCHLD handler runs here
            shutdown_workers(loader)
    except RuntimeError as e:
        raised = e
    finally:
        shutdown_workers(loader)
    assert (raised is None) == expected and (expected or "killed by signal" in str(raised)), raised


def test_a_slow_but_healthy_source_is_not_cut_off(caplog):
    """First item takes 2x the warning time, the time-out is above that: the read completes, nothing raised."""
    def source():
        time.sleep(2 * WARN_S)
        yield from range(5)

    watch = ReadWatch("reader 'slow'", "slow", ["/data/slow"], stall_warn_s=WARN_S, timeout_s=3 * WARN_S)
    it = source()
    with caplog.at_level(logging.WARNING, logger="bridge.models.bagel.data.watchdog"):
        got = [watch.call(next, it) for _ in range(5)]
    assert got == [0, 1, 2, 3, 4] and watch.stuck is None
    lines = [r.getMessage() for r in caplog.records]
    assert sum("has waited" in x for x in lines) == 1 and any("returned after" in x for x in lines), lines
    assert watch.stop()


def test_a_slow_but_healthy_batch_is_not_cut_off_and_its_reads_run_on_one_thread(caplog):
    """Per batch (the loader's path): reads run inline on the batch thread (one hand-over per batch), the waiter
    still warns once for the slow first read and lets it finish; a stuck read after it times out by itself."""
    def source():
        time.sleep(2 * WARN_S)
        yield from range(5)

    watch = ReadWatch("reader 'slow'", "slow", ["/data/slow"], stall_warn_s=WARN_S, timeout_s=3 * WARN_S)
    it, threads = source(), set()

    def batch() -> list[int]:
        threads.add(threading.get_ident())
        return [watch.call(next, it) for _ in range(5)]

    with caplog.at_level(logging.WARNING, logger="bridge.models.bagel.data.watchdog"):
        got = batch_call(batch)
    assert got == [0, 1, 2, 3, 4] and watch.stuck is None and watch._thread is None  # no per-read thread
    assert threads and threading.get_ident() not in threads
    lines = [r.getMessage() for r in caplog.records]
    assert sum("has waited" in x for x in lines) == 1 and any("returned after" in x for x in lines), lines
    t0 = time.monotonic()
    with pytest.raises(DataTimeoutError, match="group 'slow'"):
        batch_call(lambda: watch.call(time.sleep, 60))
    assert 3 * WARN_S <= time.monotonic() - t0 < 3 * WARN_S + 2 and watch.busy
    assert not watch.stop(wait_s=0.1)  # the stuck read's thread is left behind, a daemon thread


def test_disabled_watch_calls_directly():
    watch = ReadWatch("r", "g", [], stall_warn_s=0, timeout_s=0)
    assert not watch.enabled and watch.call(sum, [1, 2]) == 3 and watch._thread is None


@pytest.mark.slow
def test_two_rank_job_every_rank_ends_with_the_time_out(tmp_path):
    path = _dataset(tmp_path)
    shard = _stuck_mount(path)
    cfg = _config(tmp_path, "t2i_pretrain", path, T2I_ARGS)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            warm_torchrun(2, [f"data.groups={cfg.groups}", f"data.dataset_info={cfg.dataset_info}", "data.prefetch=2",
                              f"data.stall_warn_s={WARN_S}", f"data.timeout_s={TIMEOUT_S}",
                              *(f"data.packer.{k}={v}" for k, v in SMALL.items()), "train.train_iters=3",
                              "train.progress=false", "demo_data=null", "train.save=null"],
                          options=("--log-dir", str(Path(cfg.groups).parent / "torchelastic")),
                          server=False),  # its own agent: the command lines scanned below name tmp_path
            cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    finally:
        _release(shard)
    took = time.monotonic() - t0
    assert proc.returncode != 0
    lines = [x for x in proc.stderr.replace("\n  ", " ").splitlines() if x.startswith("error [rank")]
    assert sorted(x.split("]")[0] for x in lines) == ["error [rank 0", "error [rank 1"], proc.stderr[-3000:]
    for line in lines:
        assert "DataTimeoutError" in line and "'t2i_pretrain'" in line and "shard-000000.tar" in line, line
    assert sum("has waited" in x for x in proc.stderr.splitlines()) >= 1, proc.stderr[-3000:]
    assert took < 90, (took, proc.stderr[-3000:])
    time.sleep(1)
    left = [p for p in os.listdir("/proc") if p.isdigit() and str(tmp_path) in _cmdline(p)]
    assert not left, f"processes of the job left behind: {left}"


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.slow
@pytest.mark.serial  # a producer starting in a parallel test process may be reclaiming the same debris (shm.py)
def test_a_killed_prefetch_jobs_shared_memory_is_reclaimed_by_a_loader_build_without_prefetch(tmp_path, tok):
    killed, info = _start_job()
    _kill_like_a_preemption(killed)
    debris = _ours(info)
    cfg = _config(tmp_path, "t2i_pretrain", _dataset(tmp_path), T2I_ARGS, prefetch=0)
    with build_bagel_train_loader(cfg, tok, (0, 1), length=4) as loader:  # building it reclaims
        assert not [s for s in debris if os.path.exists(s)], "the killed job's segments survived the build"
        assert not _owner_files_of(info)
        next(loader)
    assert not shm.segments_of(info["trainer"])


@pytest.mark.slow
def test_a_job_stuck_inline_exits_promptly_after_the_time_out(tmp_path):
    """Inline reads (no prefetch, no workers): the stuck read leaves its thread blocked in open() for good (a
    thread in the kernel cannot be cancelled from Python); the job still prints its line and exits at once."""
    path = _dataset(tmp_path)
    shard = _stuck_mount(path)
    cfg = _config(tmp_path, "t2i_pretrain", path, T2I_ARGS)
    env = dict(os.environ, PYTHONWARNINGS="ignore", MASTER_PORT="29641")
    cmd = [sys.executable, "scripts/pretrain_bagel.py",  # one process, no torchrun: its own exit is timed
           f"data.groups={cfg.groups}", f"data.dataset_info={cfg.dataset_info}",
           "data.prefetch=0", "data.num_workers=0", f"data.stall_warn_s={WARN_S}", f"data.timeout_s={TIMEOUT_S}",
           *(f"data.packer.{k}={v}" for k, v in SMALL.items()), "train.train_iters=3", "train.progress=false",
           "demo_data=null", "train.save=null"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[tuple[float, str]] = []  # (when it arrived, line)
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), x) for x in proc.stderr), daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=120)
        exited_at = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
        _release(shard)
    reader.join(5)
    text = "".join(x for _, x in lines)
    error_at = next((t for t, x in lines if x.startswith("error [rank 0]")), None)
    assert error_at is not None, text[-3000:]
    assert "DataTimeoutError" in text and "shard-000000.tar" in text, text[-3000:]
    assert rc != 0
    assert exited_at - error_at < 30, f"the job took {exited_at - error_at:.1f}s to exit after its error line"
    time.sleep(1)
    left = [p for p in os.listdir("/proc") if p.isdigit() and str(tmp_path) in _cmdline(p)]
    assert not left, f"processes of the job left behind: {left}"


_AGENTS_SCRIPT = r"""
import json, multiprocessing as mp, os, signal, sys, time
import torch  # as in every real process (the agent asks torch which worker it is)
from bridge.models.bagel.data.watchdog import stacks

def worker():
    time.sleep(30)

mode = sys.argv[1]
stacks.enable_agents()
child = mp.get_context("fork").Process(target=worker, daemon=True)
child.start()
reports = []
for _ in range(20):  # a loaded machine may be slow to schedule the child's agent
    reports = stacks.collect_reports()
    if reports:
        break
print(json.dumps({"dir": stacks._agents.dir, "pids": [r["pid"] for r in reports], "child": child.pid}), flush=True)
child.terminate(); child.join()
if mode == "killed":        # as a preemption: no atexit
    os.kill(os.getpid(), signal.SIGKILL)
elif mode == "hold":        # a live job: until its stdin closes
    sys.stdin.read()
"""


def _agents_run(tmp: Path, mode: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", _AGENTS_SCRIPT, mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, **kw)


def _report(proc: subprocess.Popen) -> dict:
    seen = json.loads(proc.stdout.readline())
    assert seen["pids"] == [seen["child"]], seen  # the agent worked: the forked worker reported into the dir
    return seen


def test_the_report_directory_of_agents_is_removed_when_its_owner_exits_or_dies(short_tmp_path):
    """Every process that enabled agents (each rank, each restart) left a ``bagel-watch-*`` directory in the temp
    dir. Its owner removes it at exit; one of an owner killed with SIGKILL (no atexit) is removed by the next
    owner's start; a live owner's is never touched."""
    tmp = short_tmp_path  # the children's TMPDIR: short, they may open unix sockets
    procs: list[subprocess.Popen] = []
    try:
        killed = _agents_run(tmp, "killed")
        procs.append(killed)
        dead_dir = _report(killed)["dir"]
        assert killed.wait(60) == -9 and os.path.isdir(dead_dir)  # what a preemption leaves
        hold = _agents_run(tmp, "hold", stdin=subprocess.PIPE)
        procs.append(hold)
        live_dir = _report(hold)["dir"]
        assert not os.path.exists(dead_dir)                      # the next start reclaimed it
        normal = _agents_run(tmp, "normal")
        procs.append(normal)
        normal_dir = _report(normal)["dir"]
        assert normal.wait(60) == 0, normal.stderr.read()
        assert os.path.isdir(live_dir) and not os.path.exists(normal_dir)  # live: kept; exited: removed
        hold.stdin.close()
        assert hold.wait(60) == 0, hold.stderr.read()
        assert os.path.dirname(live_dir) == str(tmp)
        assert list(tmp.iterdir()) == []
    finally:
        for proc in procs:  # a failed assertion must not leave the live one waiting on its stdin
            if proc.poll() is None:
                proc.kill()
                proc.wait()
