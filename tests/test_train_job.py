"""The main job trains the reference model under ``torchrun`` on gloo (``python -m bridge.models.bagel.launch``):

* run A: DP 2, two micro-batches per rank per step (global batch 4: gradient accumulation), uninterrupted;
  the loss is strictly lower at the end than at the start;
* run B: the same job with checkpoints under ``torchrun --max-restarts=1``, launched with ``train.save`` =
  ``train.load`` on an empty root (it starts from scratch); rank 1 alone is SIGKILLed mid-run once step 3 has been
  logged; torchrun restarts the workers, the job resumes from its last checkpoint by itself (the launcher's
  per-attempt store) and exits 0: every per-step loss (every bit, ``float.hex``), every batch digest and the final
  parameters equal run A's;
* run D: A's final checkpoint restarted on 3 ranks (elastic order): it trains on from A's model (its first loss
  is A's regime, not a fresh model's) and the data ledger over A and D proves every sample packed exactly once;
* validation (``data.valid``: the demo's t2i group, an evaluation every 2 steps): every evaluation of A, and of B
  after the restart, pulls the same validation batches on each rank, and the model's loss on them is computed.

Data: the demo dataset with small images (``_train_common``), 2K-token packs, elastic order; the tiny model.
"""

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

from _train_common import SMALL_BUDGETS, small_image_groups, valid_groups
from _warm_torchrun import free_port, warm_torchrun, zygote_pid

from bridge.models.bagel.data.job.checkpoint import read_loader_states, trainer_state_file
from bridge.models.bagel.data.tools.ledger import check_exactly_once

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
STEPS = 8
EVAL_INTERVAL = 2


def _cmd(nproc: int, args: list[str], log_dir: Path, *, warm: bool = True, options: tuple[str, ...] = ()) -> list[str]:
    """Run A, whose start-up phases are checked, is the cold ``torchrun -m bridge.models.bagel.launch``; B and D
    start warm ranks (``tests/_warm_torchrun.py``)."""
    options = ("--log-dir", str(log_dir / "torchelastic"), *options)
    if warm:
        return warm_torchrun(nproc, args, options=options)
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), *options, "-m", "bridge.models.bagel.launch", *args]


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc: parent ids)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, frontier = [], [pid]
    while frontier:
        children = [c for c, p in parents.items() if p in frontier]
        out += children
        frontier = children
    return out


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def _rows(path: Path, split: str = "train") -> dict[tuple[int, int, int], dict]:
    """The digest log's rows of one split (training rows carry no ``split``; evaluations' say ``"valid"``)."""
    return {(r["rank"], r["step"], r["micro"]): r for r in map(json.loads, path.read_text().splitlines())
            if r.get("split", "train") == split}


def _losses(rows: dict) -> dict[int, float]:
    return {step: float.fromhex(r["loss"]) for (rank, step, micro), r in sorted(rows.items())}


class Runs:
    def __init__(self, root: Path, out: Path) -> None:
        groups = small_image_groups(out, root / "groups.yaml")
        self.root = root
        self.common = ["demo_data=null", f"data.groups={groups}", f"data.dataset_info={out}/dataset_info.yaml",
                       "data.order=elastic", "data.partitions=8", "data.prefetch=0", *SMALL_BUDGETS,
                       "model.name=bagel-tiny", "model.optimizer.lr=0.01", "train.progress=false",
                       "train.log_interval=2", "train.micro_batch_size=1",
                       f"data.valid.groups={valid_groups(out, root / 'valid_groups.yaml')}",
                       f"train.eval_interval={EVAL_INTERVAL}", "train.eval_iters=1"]
        dp2 = [*self.common, f"train.train_iters={STEPS}", "train.global_batch_size=4", "train.save_interval=2"]
        self.a = self.run(2, [*dp2, f"train.save={root}/a", f"train.tensorboard_dir={root}/tb",
                              f"--digest-log={root}/a.jsonl"], "a", warm=False)
        self.b_killed_at = self.run_and_kill_one_rank(
            2, [*dp2, f"train.save={root}/b", f"train.load={root}/b", f"--digest-log={root}/b.jsonl"], "b")
        resumed = [line for line in (root / "b.log").read_text().splitlines() if "resumed from " in line]
        assert len(resumed) == 1, resumed  # the restarted attempt, once (the first one started from scratch)
        self.resumed_from = int(resumed[0].rsplit("at step ", 1)[1].split()[0])
        self.d = self.run(3, [*self.common, f"train.train_iters={STEPS + 2}", "train.global_batch_size=3",
                              "train.save_interval=0", f"train.save={root}/d", f"train.load={root}/a",
                              f"--digest-log={root}/d.jsonl"], "d")

    def run(self, nproc: int, args: list[str], name: str, warm: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(_cmd(nproc, args, self.root, warm=warm), cwd=REPO, capture_output=True, text=True,
                              timeout=600, env=_env())
        (self.root / f"{name}.log").write_text(proc.stdout + proc.stderr)
        assert proc.returncode == 0, f"run {name} failed:\n{proc.stderr[-4000:]}"
        return proc

    def run_and_kill_one_rank(self, nproc: int, args: list[str], name: str) -> int:
        """Start the job under ``torchrun --max-restarts=1``; SIGKILL rank 1's worker alone once step 3 is in the
        digest log (a checkpoint of step 2 is complete by then); torchrun restarts the workers and the run must end
        with exit 0. Returns the last step logged before the kill."""
        digest = self.root / f"{name}.jsonl"
        cmd = _cmd(nproc, args, self.root, options=("--max-restarts=1",))
        with open(self.root / f"{name}.log", "w") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=_env(),
                                    start_new_session=True)
            try:
                deadline = time.monotonic() + 600
                while time.monotonic() < deadline and proc.poll() is None:
                    if digest.exists() and any(r["step"] >= 3 for r in _rows(digest).values()):
                        break
                    time.sleep(0.05)
                assert proc.poll() is None, f"run {name} ended before it could be killed (exit {proc.returncode})"
                killed_at = max(r["step"] for r in _rows(digest).values())
                # torchrun's worker of rank 1, not its loader workers (the agent: a child of the zygote)
                rank1 = [pid for pid in _descendants(zygote_pid()) if _rank(pid) == 1 and _rank(_parent(pid)) != 1]
                assert len(rank1) == 1, rank1
                os.kill(rank1[0], signal.SIGKILL)
                assert proc.wait(timeout=600) == 0, (self.root / f"{name}.log").read_text()[-4000:]
            finally:
                if proc.poll() is None:
                    for pid in [proc.pid, *_descendants(proc.pid)]:
                        os.kill(pid, signal.SIGKILL)
        return killed_at


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _rank(pid: int) -> int | None:
    """The rank a worker process runs: a warm rank's name (``tests/_warm_rank.py``: forked, its environment in
    /proc is the agent's), else ``RANK`` in its environment."""
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
        env = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
    except OSError:
        return None
    if name.startswith("bagel-rank"):
        return int(name[len("bagel-rank"):])
    return int(env["RANK"]) if "RANK" in env else None


def _occurrences(path: Path, split: str = "train") -> list[dict]:
    """Every row of one split in file order (a restarted attempt logs the steps after its checkpoint again)."""
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("split", "train") == split]


@pytest.fixture(scope="module")
def runs(demo_setup, tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("train_job"), demo_setup[0])


def test_loss_goes_down(runs: Runs) -> None:
    losses = _losses(_rows(runs.root / "a.jsonl"))
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1], losses
    a_log = (runs.root / "a.log").read_text()
    assert "| loss " in a_log and '"loss_first"' in a_log and '"loss_last"' in a_log  # interval lines + summary
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(runs.root / "tb"))
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("train/loss")}
    assert sorted(logged) == list(range(2, STEPS + 1, 2))  # one point per log interval (2 steps)
    assert logged[STEPS] == pytest.approx((losses[STEPS - 1] + losses[STEPS]) / 2, rel=1e-6)


def _summary(log: str) -> dict:
    return json.loads(log.split("summary: ", 1)[1].splitlines()[0])


def test_start_up_is_reported_per_phase_with_the_slowest_rank(runs: Runs) -> None:
    """One rank-0 line as the first step begins and the summary's ``startup_s``: the launcher's phases and the job's,
    adding up to the total, the slowest rank (0 or 1) and when it was ready (no later than rank 0's total, which
    includes the wait for it); a restart books its checkpoint checks and restore to ``resume``."""
    a_log, c_log = (runs.root / "a.log").read_text(), (runs.root / "b.log").read_text()  # B: the restart's summary
    lines = [line for line in a_log.splitlines() if "start-up: " in line]
    assert len(lines) == 1 and "[rank0]" in lines[0] and len(lines[0].split(": ", 1)[1]) <= 300, lines
    for log, resumed in ((a_log, False), (c_log, True)):
        startup = _summary(log)["startup_s"]
        phases = startup["phases"]
        assert list(phases) == ["imports", "config", "Megatron-Core import", "process groups", "tokenizer", "model",
                                *(["resume"] if resumed else []), "Megatron-Bridge import", "loader",
                                "waiting for the other ranks"], phases
        assert startup["total"] == pytest.approx(sum(phases.values()), abs=0.1)
        slowest = startup["slowest_rank"]
        assert slowest["rank"] in (0, 1) and 0 < slowest["ready"] <= startup["total"] + 0.01, startup
        if slowest["rank"] == 0:  # rank 0 was ready last: it waited for nobody
            assert slowest["ready"] == pytest.approx(startup["total"] - phases["waiting for the other ranks"],
                                                     abs=0.02), startup
        if not resumed:  # run A's cold ranks imported for real (B's warm ranks found the modules loaded)
            assert phases["imports"] > 0.3 and phases["Megatron-Bridge import"] > 0.3, phases


def test_two_micro_batches_per_rank_and_identical_losses_on_every_rank(runs: Runs) -> None:
    rows = _rows(runs.root / "a.jsonl")
    assert {k[0] for k in rows} == {0, 1} and {k[2] for k in rows} == {0, 1}  # DP 2, gradient accumulation
    for step in range(1, STEPS + 1):
        assert len({r["loss"] for k, r in rows.items() if k[1] == step}) == 1  # the reduced loss, every rank


def test_sigkill_of_one_rank_and_torchruns_restart_reproduce_the_uninterrupted_run(runs: Runs) -> None:
    """Every row B logged, before the kill and after torchrun's restart, equals A's (digest and loss); the restart
    re-ran the steps after its checkpoint (they are logged twice) and B covers every step on every rank."""
    a, b = _rows(runs.root / "a.jsonl"), _occurrences(runs.root / "b.jsonl")
    assert 2 <= runs.resumed_from < STEPS and runs.resumed_from <= runs.b_killed_at < STEPS
    key = lambda r: (r["rank"], r["step"], r["micro"])  # noqa: E731
    assert {key(r) for r in b} == set(a)
    assert all(r == a[key(r)] for r in b), [(key(r), a[key(r)]["loss"], r["loss"]) for r in b if r != a[key(r)]][:3]
    count = {k: sum(key(r) == k for r in b) for k in a}
    assert all(n == 1 for k, n in count.items() if k[1] <= runs.resumed_from)  # before the checkpoint: once
    assert all(n in (1, 2) for n in count.values())  # after it: again in the restarted attempt, never more
    log = (runs.root / "b.log").read_text()
    assert "starting from scratch" in log  # the first attempt: train.load on an empty root
    final_a = torch.load(trainer_state_file(str(runs.root / "a"), STEPS), weights_only=True)
    final_c = torch.load(trainer_state_file(str(runs.root / "b"), STEPS), weights_only=True)
    tensors = [k for k, v in final_a["model"].items() if isinstance(v, torch.Tensor)]
    assert tensors and all(torch.equal(final_a["model"][k], final_c["model"][k]) for k in tensors)
    opt_a, opt_c = final_a["optimizer"]["state"], final_c["optimizer"]["state"]
    assert opt_a.keys() == opt_c.keys() and all(
        torch.equal(opt_a[i][s], opt_c[i][s]) for i in opt_a for s in opt_a[i])


def test_elastic_resize_to_three_ranks_trains_on(runs: Runs) -> None:
    a, d = _rows(runs.root / "a.jsonl"), _rows(runs.root / "d.jsonl")
    assert {k[0] for k in d} == {0, 1, 2} and {k[1] for k in d} == {STEPS + 1, STEPS + 2}
    la, ld = _losses(a), _losses(d)
    assert all(torch.isfinite(torch.tensor(v)) for v in ld.values())
    assert ld[STEPS + 1] < la[1] - 0.5, (la, ld)  # A's model trains on; a fresh one would start near la[1]
    reads = [{"dataset_name": g, "position": j, "epoch": e}
             for rows in (a, d) for r in rows.values() for g, j, e in r["reads"]]
    report = check_exactly_once(reads, read_loader_states(str(runs.root / "d"), STEPS + 2))
    assert report.ok, report.problems


def test_every_evaluation_and_the_restart_see_the_same_validation_batches(runs: Runs) -> None:
    """Evaluations every 2 steps (1 iteration x 2 micro-batches per rank): A's four evaluations and C's after the
    restart from B's checkpoint pull the same validation batches, rank by rank; the loss on them is the model's
    (it moves as the model trains: no optimizer step is taken on them, training's losses equal the run without
    evaluations' rules above)."""
    a = _rows(runs.root / "a.jsonl", "valid")
    c = {(r["rank"], r["step"], r["micro"]): r for r in _occurrences(runs.root / "b.jsonl", "valid")
         if r["step"] > runs.resumed_from}  # B's evaluations after the restart (and any before the kill: equal)
    evals = {}
    for rows in (a, c):
        for (rank, step, micro), r in rows.items():
            evals.setdefault(step, {})[(rank, micro)] = r["digest"]
    assert sorted({k[1] for k in a}) == list(range(EVAL_INTERVAL, STEPS + 1, EVAL_INTERVAL))
    assert {k[1] for k in c} == {s for s in range(EVAL_INTERVAL, STEPS + 1, EVAL_INTERVAL) if s > runs.resumed_from}
    first = evals[EVAL_INTERVAL]
    assert set(first) == {(0, 0), (0, 1), (1, 0), (1, 1)}  # 2 ranks x 2 micro-batches
    assert all(e == first for e in evals.values())  # every evaluation, before and after the restart
    assert all(a[k] == c[k] for k in c)  # ... with the same loss, bit for bit (the same model at that step)
    assert len(set(first.values())) == 4  # ranks and micro-batches read their own slices, as in training
    train_digests = {r["digest"] for r in _rows(runs.root / "a.jsonl").values()}
    assert not train_digests & set(first.values())
    losses = [float.fromhex(r["loss"]) for r in a.values()]
    assert all(v > 0 for v in losses) and len(set(losses)) > 1  # the model's loss, as it trains
    lines = [line for line in (runs.root / "a.log").read_text().splitlines() if "eval at step" in line]
    assert len(lines) == STEPS // EVAL_INTERVAL and all("| batches 4 | digest " in line for line in lines), lines
    assert len({line.split("| digest ")[1].split()[0] for line in lines}) == 1
