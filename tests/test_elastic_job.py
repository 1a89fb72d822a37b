"""Elastic restarts of the real job (``scripts/pretrain_bagel.py``) under ``torchrun`` on gloo: one run that is
checkpointed and restarted on another number of ranks six times, DP 2 -> 3 -> 1 -> 4 -> 2 -> 4 -> 3 (every resize
of the issue's list: 2->3, 3->1, 1->4, 4->2 and the double resize 2->4->3), with workers 2 and 0 and the prefetch
process on and off across the phases. The ledger over every batch of every rank of every phase and the last
checkpoint's states proves exactly once (``tools.ledger``); a changed config is still refused on a resize. The first
two phases (DP 2 -> 3) are launched without digest logs: their reads come from the packed-reads ledger the job
writes into every checkpoint (``bagel-data ledger --run``), the later phases' from their digest logs as well.
Data: the demo dataset with a smaller selection (16 t2i, 8 edit, 12 vlm reads per epoch, 4 partitions), so the
run covers several epochs of every group in 38 packed batches.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from _external_common import assert_same
from _warm_torchrun import warm_torchrun

from bridge.models.bagel.data.job.checkpoint import loader_state_files, read_loader_states, read_run_reads
from bridge.models.bagel.data.tools.ledger import check_exactly_once

REPO = Path(__file__).resolve().parents[1]
#: Phases launched without a digest log (their reads: the job's packed-reads ledger in the checkpoints)
NO_DIGEST_LOG = (0, 1)
#: (DP size = world, steps in the phase, Energon-side workers, prefetch depth)
PHASES = [(2, 2, 2, 2), (3, 2, 0, 0), (1, 3, 2, 0), (4, 2, 0, 2), (2, 2, 0, 0), (4, 1, 0, 0), (3, 3, 2, 0)]


def _torchrun(nproc: int, args: list[str], log: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = warm_torchrun(nproc, args, options=("--log-dir", str(log.parent / "torchelastic")))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    log.write_text(proc.stdout + proc.stderr)
    return proc


def _small_groups(out: Path, dest: Path) -> Path:
    groups = yaml.safe_load((out / "groups.yaml").read_text())
    groups["t2i_pretrain"]["num_used_data"] = [2]
    groups["unified_edit"]["num_used_data"] = [1]
    groups["vlm_sft"]["num_used_data"] = [12]
    dest.write_text(yaml.safe_dump(groups))
    return dest


class Chain:
    def __init__(self, root: Path, out: Path) -> None:
        self.root = root
        groups = _small_groups(out, root / "groups.yaml")
        self.common = ["demo_data=null", f"data.groups={groups}", f"data.dataset_info={out}/dataset_info.yaml", "data.order=elastic",
                       "data.partitions=4", "data.packer.expected_num_tokens=4096", "data.packer.max_num_tokens=8192",
                       "data.packer.max_num_tokens_per_sample=4096", "data.packer.prefer_buffer_before=2048",
                       "train.progress=false", "train.save_interval=0", "train.log_interval=1"]
        self.reads: list[dict] = []
        self.logs: list[Path] = []
        step, load = 0, None
        for k, (world, steps, workers, prefetch) in enumerate(PHASES):
            step += steps
            save = root / f"ckpt{k}"
            args = [*self.common, f"train.train_iters={step}", f"train.global_batch_size={world}",
                    f"data.num_workers={workers}", f"data.prefetch={prefetch}", f"train.save={save}"]
            args += [] if k in NO_DIGEST_LOG else [f"train.digest_log={root}/phase{k}.jsonl"]
            args += [f"train.load={load}"] if load else []
            log = root / f"phase{k}.log"
            proc = _torchrun(world, args, log)
            assert proc.returncode == 0, f"phase {k} (DP {world}) failed:\n{proc.stderr[-4000:]}"
            self.logs.append(log)
            if k == NO_DIGEST_LOG[-1]:  # the phases without digest logs: what the job's own ledger says they packed
                self.reads += read_run_reads(str(save), step)[0]
                self.no_digest = (save, step)
            elif k not in NO_DIGEST_LOG:
                rows = [json.loads(x) for x in (root / f"phase{k}.jsonl").read_text().splitlines()]
                assert {r["dp_size"] for r in rows} == {world} and len(rows) == world * steps
                self.reads += [{"dataset_name": g, "position": j, "epoch": e} for r in rows for g, j, e in r["reads"]]
            assert len(loader_state_files(str(save), step)) == world
            load = save
        self.final = read_loader_states(str(load), step)
        self.last, self.step = load, step


@pytest.fixture(scope="module")
def chain(demo_setup, tmp_path_factory) -> Chain:
    out, _tok = demo_setup
    return Chain(tmp_path_factory.mktemp("elastic_job"), out)


@pytest.mark.slow
def test_resizes_keep_every_sample_exactly_once(chain: Chain) -> None:
    """2 -> 3 -> 1 -> 4 -> 2 -> 4 -> 3 ranks: every read is packed once, dropped with a reason, or still waiting."""
    report = check_exactly_once(chain.reads, chain.final)
    assert report.ok, report.problems
    assert report.epoch_complete, report
    for group, counts in report.groups.items():
        assert counts["taken"] > counts["selection"], (group, counts)  # more than one epoch of every group
        assert counts["packed"] > 0


@pytest.mark.slow
def test_ledger_catches_a_lost_and_a_repeated_sample(chain: Chain) -> None:
    """The proof is not vacuous: one read removed or duplicated is reported."""
    lost = check_exactly_once(chain.reads[1:], chain.final)
    assert not lost.ok and "unaccounted" in " ".join(lost.problems)
    twice = check_exactly_once(chain.reads + chain.reads[:1], chain.final)
    assert not twice.ok and "more than once" in " ".join(twice.problems)


@pytest.mark.slow
def test_resize_state_cli_gives_bridge_pretrain_its_files(chain: Chain, demo_setup, tmp_path: Path) -> None:
    """``bagel-data resize-state`` rewrites the last (DP-3) checkpoint for DP 2 offline: each new file passes Bridge's
    restricted loader and restores the same state the job computes online (so ``pretrain()``, which opens only
    its own rank's file, resumes elastically too); the old files are kept aside; a second call does nothing."""
    import shutil

    from bridge.models.bagel.data._bridge import import_bridge
    from bridge.models.bagel.data.build import build_bagel_train_loader
    from bridge.models.bagel.data.job.checkpoint import TRACKER
    from bridge.models.bagel.data.job.config import load_job_config
    from bridge.models.bagel.data.tools.cli import main

    root = tmp_path / "ckpt"
    shutil.copytree(chain.last, root)
    assert (root / TRACKER).read_text().strip() == str(chain.step)
    cli = ["resize-state", str(root), "--dp-size", "2", "--config", str(REPO / "configs" / "demo.yaml"), *chain.common]
    assert main(cli) == 0
    iter_dir = root / "energon" / f"iter_{chain.step:07d}"
    assert sorted(p.name for p in (iter_dir / "resized_from_dp3").iterdir()) == loader_state_files(str(chain.last),
                                                                                                 chain.step)
    assert len(loader_state_files(str(root), chain.step)) == 2
    load = import_bridge().energon_torch_load
    cfg = load_job_config(str(REPO / "configs" / "demo.yaml"), chain.common)
    with build_bagel_train_loader(cfg.data, demo_setup[1], (1, 2)) as live:  # the job's own resize, online
        for r in range(2):
            offline = load(str(iter_dir / f"train_dataloader_dprank{r:03d}.pt"))["dataloader_state_dict"]
            online = live.resize_states(chain.final, r, 2)
            assert_same(offline, online, f"rank {r} state")
    assert main(cli) == 0  # already DP 2: nothing written



@pytest.mark.slow
def test_ledger_cli_exit_code(chain: Chain, capsys) -> None:
    """``bagel-data ledger --run CKPT``: the job's own packed-reads ledgers, chained back through every launch's
    start checkpoint, prove exactly once without a digest log, over the DP 2 -> 3 run launched without any, and over
    the whole chain (where they agree with the later phases' digest logs, read for read); ``CKPT --digests …``:
    1 and the problem when the launches without a log are missing (their reads are unaccounted for); 2 for a file
    that is not a digest log, or a root whose checkpoint has no ledger."""
    from collections import Counter

    from bridge.models.bagel.data.tools.cli import main

    first, first_step = chain.no_digest
    assert main(["ledger", "--run", str(first)]) == 0  # DP 2 -> 3, launched without digest logs
    out = capsys.readouterr().out
    assert "exactly once: yes" in out and "t2i_pretrain" in out and "2 checkpoints' packed-reads ledgers" in out, out
    assert main(["ledger", "--run", str(chain.last)]) == 0
    out = capsys.readouterr().out
    assert "exactly once: yes" in out and f"{len(PHASES)} checkpoints' packed-reads ledgers" in out, out
    key = lambda r: (r["dataset_name"], r["position"], r["epoch"])  # noqa: E731
    assert Counter(map(key, read_run_reads(str(chain.last), chain.step)[0])) == Counter(map(key, chain.reads))
    logs = sorted(chain.root.glob("phase*.jsonl"), key=lambda p: int(p.stem[len("phase"):]))
    assert len(logs) == len(PHASES) - len(NO_DIGEST_LOG)
    assert main(["ledger", str(chain.last), "--digests", *map(str, logs)]) == 1
    out = capsys.readouterr().out
    assert "exactly once: NO" in out and "unaccounted" in out, out
    not_a_log = chain.root / "not_a_log.jsonl"
    not_a_log.write_text('{"hello": 1}\n')
    assert main(["ledger", str(chain.last), "--digests", str(not_a_log)]) == 2
    bare = chain.root / "bare"
    (bare / "energon" / f"iter_{first_step:07d}").mkdir(parents=True)
    for name in loader_state_files(str(first), first_step):
        (bare / "energon" / f"iter_{first_step:07d}" / name).write_bytes(
            (first / "energon" / f"iter_{first_step:07d}" / name).read_bytes())
    (bare / "latest_checkpointed_iteration.txt").write_text(str(first_step))
    assert main(["ledger", "--run", str(bare)]) == 2
