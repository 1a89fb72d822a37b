"""Job checkpoints: a truncated or corrupt per-rank loader state file is reported with its own path."""

from __future__ import annotations

import os
import shutil
import types

import pytest

from _external_common import golden_loader, single_process_pg_collection
from bridge.models.bagel.data.config import ConfigError
from bridge.models.bagel.data.job.checkpoint import rank_state_file, restore_loader


class _Rank:
    """A DP process group stand-in of a 2-replica world: ``rank()`` (Bridge's per-rank file lookup) and
    ``size()`` (the job's DP-size check)."""

    def __init__(self, rank: int) -> None:
        self._rank = rank

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return 2


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A job checkpoint root with two ranks' good loader state files at step 2."""
    from megatron.core.rerun_state_machine import RerunDataIterator

    from bridge.models.bagel.data._bridge import import_bridge

    api = import_bridge()
    if api.maybe_save_dataloader_state is None:
        pytest.skip(api.checkpointing_error)
    pgs = single_process_pg_collection()
    root = tmp_path_factory.mktemp("ckpt")
    loader = RerunDataIterator(golden_loader())
    next(loader)
    api.maybe_save_dataloader_state(None, loader, 2, str(root / "energon"), pg_collection=pgs)
    rank0 = rank_state_file(str(root / "energon"), 2, 0)
    shutil.copy(rank0, rank_state_file(str(root / "energon"), 2, 1))
    return root, pgs


def _damaged_copy(saved, tmp_path, rank: int, damage) -> tuple[str, str, object]:
    root, pgs = saved
    copy = tmp_path / "ckpt"
    shutil.copytree(root, copy)
    path = rank_state_file(str(copy / "energon"), 2, rank)
    data = open(path, "rb").read()
    open(path, "wb").write(damage(data))
    pg = types.SimpleNamespace(tp=pgs.tp, pp=pgs.pp, cp=pgs.cp, dp=_Rank(rank))
    return str(copy), path, pg


DAMAGE = {
    "truncated": lambda d: d[: len(d) // 2],
    "empty": lambda d: b"",
    "flipped-byte": lambda d: d[:200] + bytes([d[200] ^ 0xFF]) + d[201:],
}


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_state_file_is_named_in_the_error(saved, tmp_path, rank: int, damage: str) -> None:
    from megatron.core.rerun_state_machine import RerunDataIterator

    root, path, pg = _damaged_copy(saved, tmp_path, rank, DAMAGE[damage])
    other = rank_state_file(os.path.join(root, "energon"), 2, 1 - rank)
    fresh = RerunDataIterator(golden_loader())
    with pytest.raises(ConfigError) as info:
        restore_loader(root, 2, fresh, pg)
    message = str(info.value)
    assert path in message and other not in message, message
    assert f"of DP rank {rank} cannot be read" in message
    assert fresh.iterable.position == 0  # nothing was restored


def test_good_state_file_still_restores(saved) -> None:
    from megatron.core.rerun_state_machine import RerunDataIterator

    root, pgs = saved
    fresh = RerunDataIterator(golden_loader())
    pg = types.SimpleNamespace(tp=pgs.tp, pp=pgs.pp, cp=pgs.cp, dp=_Rank(0))  # the 2-replica checkpoint's rank 0
    restore_loader(str(root), 2, fresh, pg)
    assert fresh.iterable.position == 1


def test_resize_state_on_a_damaged_file_is_one_line_without_megatrons_import_notes(tmp_path):
    """``bagel-data resize-state`` (run as a user runs it) names the unreadable file in one error line; Megatron's
    ~30 import-time notes (no Transformer Engine / Apex, experimental classes) no longer bury it (--verbose
    shows them)."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    bad = tmp_path / "energon" / "iter_0000020" / "train_dataloader_dprank000.pt"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"junk\n")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("20")
    cli = [sys.executable, "-m", "bridge.models.bagel.data.tools.cli", "resize-state", str(tmp_path), "--dp-size", "2",
           "--config", "configs/demo.yaml"]
    proc = subprocess.run(cli, capture_output=True, text=True, cwd=repo, timeout=300)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "loader state file of DP rank 0 cannot be read" in errors[0], proc.stderr
    assert f"file: {bad}" in proc.stderr, proc.stderr
    assert "UserWarning" not in proc.stderr and " INFO megatron." not in proc.stderr, proc.stderr


def test_load_on_an_empty_root_starts_fresh_and_a_foreign_root_is_refused(tmp_path, caplog):
    """``train.load`` = ``train.save`` (requeue scripts, torchrun restarts): a missing or empty root, or one holding
    only a first save killed before its tracker, starts from scratch with one line; a root holding anything else is
    refused by the validation pass, naming what it holds; a root with a tracker resumes."""
    import logging

    from bridge.models.bagel.data.job.checkpoint import TRACKER, fresh_start_reason
    from bridge.models.bagel.data.job.config import TrainConfig, resolve_load

    assert "does not exist" in fresh_start_reason(str(tmp_path / "new"))
    (tmp_path / "empty").mkdir()
    train = TrainConfig(save=str(tmp_path / "empty"), load=str(tmp_path / "empty"))
    with caplog.at_level(logging.INFO):
        assert resolve_load(train) == [] and train.load is None
    assert [r.getMessage() for r in caplog.records if "train.load" in r.getMessage()] == [
        f"train.load: no checkpoint to resume ({tmp_path / 'empty'} is empty): starting from scratch"]
    partial = tmp_path / "partial"
    (partial / "energon" / "iter_0000002").mkdir(parents=True)
    (partial / "iter_0000002").mkdir()
    (partial / (TRACKER + ".tmp")).write_text("2")
    assert "interrupted first save" in fresh_start_reason(str(partial))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "model.safetensors").write_bytes(b"x")
    train = TrainConfig(load=str(foreign))
    problems = resolve_load(train)
    assert len(problems) == 1 and "model.safetensors" in problems[0] and "holds no checkpoint" in problems[0]
    assert train.load == str(foreign)  # still set: the job refuses it, nothing starts from scratch
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match="is a file"):
        fresh_start_reason(str(tmp_path / "afile"))
    (partial / TRACKER).write_text("2")
    assert fresh_start_reason(str(partial)) is None
    train = TrainConfig(load=str(partial))
    assert resolve_load(train) == [] and train.load == str(partial)


def test_packed_ledger_round_trips_a_multiset_through_the_checkpoint_chain(tmp_path):
    """``PackedLedger``: per group and epoch the positions as ranges plus repeats, exact as a multiset (a repeat is
    what the exactly-once check looks for); ``read_run_reads`` follows each launch's start checkpoint back to the
    fresh start, and names a checkpoint written without a ledger."""
    from collections import Counter

    from bridge.models.bagel.data.job.checkpoint import PackedLedger, read_run_reads

    def batch(*reads):
        return {"batch_data_indexes": [{"dataset_name": g, "position": j, "epoch": e} for g, j, e in reads]
                + [{"dataset_name": "official", "data_indexes": [0]}]}  # no position: not recorded

    first = PackedLedger(None, 0)
    first.add([batch(("a", 0, 0), ("a", 1, 0), ("a", 2, 0), ("b", 5, 1))])
    first.add([batch(("a", 7, 0), ("a", 1, 0))])  # position 1 twice
    for r in range(2):
        first.write(str(tmp_path / "one"), 4, r, 2)
    doc = first.encode()
    assert doc["groups"]["a"]["0"] == {"ranges": [[0, 2], [7, 7]], "repeats": [[1, 1]]}
    second = PackedLedger(str(tmp_path / "one"), 4)
    second.add([batch(("b", 6, 1))])
    second.write(str(tmp_path / "two"), 6, 0, 3)
    reads, chain = read_run_reads(str(tmp_path / "two"), 6)
    assert chain == [f"{tmp_path / 'two'}@6", f"{tmp_path / 'one'}@4"]
    key = Counter((r["dataset_name"], r["position"], r["epoch"]) for r in reads)
    assert key == Counter({("a", 0, 0): 2, ("a", 1, 0): 4, ("a", 2, 0): 2, ("a", 7, 0): 2, ("b", 5, 1): 2,
                           ("b", 6, 1): 1})  # rank 0 and 1 of the first launch wrote the same ledger here
    with pytest.raises(ConfigError, match="without the packed-reads ledger"):
        read_run_reads(str(tmp_path / "one"), 2)
