"""The main job under Megatron model parallelism: TP=2xDP=2, PP=2xDP=2, CP=2xDP=2 on 4 gloo ranks (torchrun).

Per topology one run B goes 4 steps uninterrupted (2 packed micro-batches per rank per step), checkpoints at
step 2 and is hard-killed after step 4 before its final save; run C restarts from B's step-2 checkpoint and
replays steps 3-4. Checked: per-batch digests identical across the TP/CP peers and PP stages of a DP replica
and different across replicas; C equals B per DP replica, and on every rank where C keeps B's layout (PP=2,
whose restart adds the virtual pipeline, and CP=2); one ``train_dataloader_dprankNNN.pt`` per DP replica; the
stream is the same under every topology with DP=2; a restart that changes TP/PP/CP (TP=2 restarted as PP=2)
and one that changes the virtual pipeline size keep DP and are exact; one that changes DP is refused on every
rank with one line. Budgets are tiny (4K-token packs, no prefetch process) so the runtime is almost all process
start-up: each ``torchrun`` launch (4 ranks importing torch, Megatron-Core and Megatron-Bridge on 2 cores) costs
about a minute, so every launch is checked for all it can show (7 launches).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from _warm_torchrun import warm_torchrun
from bridge.models.bagel.data.config import ConfigError
from bridge.models.bagel.data.job.checkpoint import check_resume_dp, loader_state_files
from bridge.models.bagel.data.job.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]
NPROC = 4
STEPS, SAVE_AT = 4, 2
TOPOLOGIES = {  # name -> (crash-run overrides, restart overrides)
    # TP=2 restarts as PP=2 (same DP): the changed-layout case; a same-layout TP restart would re-prove CP's (TP
    # and CP peers find their state file through the same DP coordinate), one torchrun launch less
    "tp2_dp2": (["train.tensor_model_parallel_size=2"], ["train.pipeline_model_parallel_size=2"]),
    "pp2_dp2": (["train.pipeline_model_parallel_size=2"],  # restart also turns on the interleaved schedule
                ["train.pipeline_model_parallel_size=2", "train.virtual_pipeline_model_parallel_size=2"]),
    "cp2_dp2": (["train.context_parallel_size=2"], ["train.context_parallel_size=2"]),
}


def _torchrun(args: list[str], log: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))
    cmd = warm_torchrun(NPROC, args, options=("--log-dir", str(log.parent / "torchelastic")))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    log.write_text(proc.stdout + proc.stderr)
    return proc


def _digests(path: Path) -> dict[tuple[int, int, int], dict]:
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return {(r["rank"], r["step"], r["micro"]): r for r in rows}


class Runs:
    """Runs launched once per module, shared by the tests below (each launch costs ~1-2 min of start-up)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        data = root / "data"
        self.common = [f"demo_data={data}", f"data.groups={data}/groups.yaml",
                       f"data.dataset_info={data}/dataset_info.yaml", "data.prefetch=0",
                       "data.packer.expected_num_tokens=4096", "data.packer.max_num_tokens=8192",
                       "data.packer.max_num_tokens_per_sample=4096", "data.packer.prefer_buffer_before=2048",
                       f"train.train_iters={STEPS}", "train.global_batch_size=4", "train.progress=false"]
        self.crashed: dict[str, Path] = {}
        self.restarted: dict[str, subprocess.CompletedProcess] = {}

    def crash(self, name: str) -> Path:
        """Run B of topology ``name`` (cached): 4 steps, checkpoint at step 2, killed after step 4."""
        if name not in self.crashed:
            out = self.root / name
            out.mkdir()
            proc = _torchrun([*self.common, *TOPOLOGIES[name][0], f"train.save={out}/ckpt",
                              f"train.save_interval={SAVE_AT}", f"train.exit_after_step={STEPS}",
                              f"train.digest_log={out}/b.jsonl"], out / "b.log")
            assert proc.returncode != 0, "run B was expected to crash"
            assert (out / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == str(SAVE_AT)
            self.crashed[name] = out
        return self.crashed[name]

    def restart(self, name: str, tag: str, overrides: list[str]) -> subprocess.CompletedProcess:
        """Restart topology ``name``'s crashed run from its step-2 checkpoint, saving into ``{tag}_ckpt``."""
        out = self.crash(name)
        return _torchrun([*self.common, *overrides, f"train.load={out}/ckpt", f"train.save={out}/{tag}_ckpt",
                          f"train.digest_log={out}/{tag}.jsonl"], out / f"{tag}.log")

    def run_c(self, name: str) -> subprocess.CompletedProcess:
        """Run C of topology ``name`` (cached): its restart overrides, digests in ``c.jsonl``, saves in ``c_ckpt``."""
        if name not in self.restarted:
            self.restarted[name] = self.restart(name, "c", TOPOLOGIES[name][1])
        return self.restarted[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("topologies"))


def _by_replica(rows: dict) -> dict[tuple[int, int, int], set[str]]:
    out: dict[tuple[int, int, int], set[str]] = {}
    for r in rows.values():
        out.setdefault((r["dp"], r["step"], r["micro"]), set()).add(r["digest"])
    return out


def _assert_restart_matches(crash_rows: dict, restart_rows: dict) -> None:
    assert {k[0] for k in restart_rows} == set(range(NPROC))
    assert {k[1] for k in restart_rows} == set(range(SAVE_AT + 1, STEPS + 1))
    # compare per (DP rank, step, micro): the stream belongs to the replica, not to the global rank
    crash, restart = _by_replica(crash_rows), _by_replica(restart_rows)
    for key, digests in restart.items():
        assert digests == crash[key], f"restart differs from the uninterrupted run at (dp, step, micro) = {key}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_crash_and_restart_per_topology(runs: Runs, name: str) -> None:
    out = runs.crash(name)
    b = _digests(out / "b.jsonl")
    assert {k[0] for k in b} == set(range(NPROC)) and {k[1] for k in b} == set(range(1, STEPS + 1))
    assert len(b) == NPROC * STEPS * 2                                   # 2 micro-batches per rank per step
    assert all(r["dp_size"] == 2 for r in b.values())
    replicas = _by_replica(b)
    assert all(len(d) == 1 for d in replicas.values()), "TP/PP/CP peers of a replica read different batches"
    for step in range(1, STEPS + 1):
        for micro in range(2):
            assert replicas[(0, step, micro)] != replicas[(1, step, micro)], "DP replicas read the same batch"
    assert loader_state_files(str(out / "ckpt"), SAVE_AT) == ["train_dataloader_dprank000.pt",
                                                               "train_dataloader_dprank001.pt"]

    proc = runs.run_c(name)
    assert proc.returncode == 0, proc.stderr[-4000:]
    c = _digests(out / "c.jsonl")
    if name != "tp2_dp2":  # C keeps B's layout (PP also adds the virtual pipeline): same rank, same batch
        assert all(c[k]["digest"] == b[k]["digest"] for k in c)
    _assert_restart_matches(b, c)
    assert loader_state_files(str(out / "c_ckpt"), STEPS) == ["train_dataloader_dprank000.pt",
                                                              "train_dataloader_dprank001.pt"]


@pytest.mark.slow
def test_stream_depends_only_on_dp(runs: Runs) -> None:
    """Every topology with DP=2 reads the same per-replica stream (TP/PP/CP never enter the data)."""
    streams = {name: _by_replica(_digests(runs.crash(name) / "b.jsonl")) for name in TOPOLOGIES}
    first = streams.pop("tp2_dp2")
    assert all(s == first for s in streams.values())


@pytest.mark.slow
def test_restart_with_changed_tp_pp_keeps_the_stream(runs: Runs) -> None:
    """TP=2xDP=2 checkpoint restarted as PP=2xDP=2: allowed and exact (same DP). The launch is tp2_dp2's run C."""
    proc = runs.run_c("tp2_dp2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = runs.crash("tp2_dp2")
    rows = _digests(out / "c.jsonl")
    assert {(r["tp"], r["pp"]) for r in rows.values()} == {(0, 0), (0, 1)}
    _assert_restart_matches(_digests(out / "b.jsonl"), rows)


@pytest.mark.slow
def test_restart_with_changed_dp_resizes_under_the_default_order(runs: Runs) -> None:
    """TP=2xDP=2 checkpoint restarted as DP=4 (TP 1): the default elastic order resizes the loader states and the
    run continues on 4 data-parallel ranks (the refusal under data.order: official is checked below)."""
    proc = runs.restart("tp2_dp2", "as_dp4", [])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _digests(runs.crash("tp2_dp2") / "as_dp4.jsonl")
    assert rows and {r["dp_size"] for r in rows.values()} == {4}
    ours = [f'File "{REPO / d}' for d in ("bridge", "scripts")]
    assert not any(x in proc.stderr for x in ours), proc.stderr[-3000:]  # no traceback from our ranks


def test_parallel_layout_is_validated() -> None:
    """Layout errors are one ``ConfigError`` line naming the keys (checked before any process group exists)."""
    assert TrainConfig(tensor_model_parallel_size=2, global_batch_size=4).parallel_layout(4) == \
        {"tp": 2, "pp": 1, "cp": 1, "dp": 2, "num_microbatches": 2}
    cases = [
        (TrainConfig(tensor_model_parallel_size=3), 4, "not divisible by tensor_model_parallel_size 3"),
        (TrainConfig(context_parallel_size=2, global_batch_size=3), 4, "global_batch_size 3 is not divisible"),
        (TrainConfig(pipeline_model_parallel_size=0), 4, "train.pipeline_model_parallel_size: must be a positive"),
        (TrainConfig(virtual_pipeline_model_parallel_size=2), 4, "needs train.pipeline_model_parallel_size >= 2"),
        (TrainConfig(micro_batch_size=2, global_batch_size=4), 2, "train.micro_batch_size: must be 1 for BAGEL"),
        (TrainConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, global_batch_size=2),
         4, "at least pipeline_model_parallel_size=2 micro-batches"),
    ]
    for cfg, world, needle in cases:
        with pytest.raises(ConfigError, match=needle.replace("(", r"\(")) as info:
            cfg.parallel_layout(world)
        assert "\n" not in str(info.value)


def test_resume_refuses_a_changed_dp_size(tmp_path: Path) -> None:
    """The checkpoint's DP size is its number of per-replica files; a different DP is refused up front."""
    with pytest.raises(ConfigError, match="no loader state for step 2"):
        check_resume_dp(str(tmp_path), 2, 2)
    iter_dir = tmp_path / "energon" / "iter_0000002"
    iter_dir.mkdir(parents=True)
    for dp in range(2):
        (iter_dir / f"train_dataloader_dprank{dp:03d}.pt").write_bytes(b"")
    check_resume_dp(str(tmp_path), 2, 2)
    for dp_size in (1, 4):
        with pytest.raises(ConfigError, match=f"data-parallel size 2 .* this run has DP {dp_size}"):
            check_resume_dp(str(tmp_path), 2, dp_size, "official")
        assert check_resume_dp(str(tmp_path), 2, dp_size) == 2  # the default elastic order resizes instead
