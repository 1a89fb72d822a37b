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
    assert f"dp rank {rank}" in message
    assert fresh.iterable.position == 0  # nothing was restored


def test_good_state_file_still_restores(saved) -> None:
    from megatron.core.rerun_state_machine import RerunDataIterator

    root, pgs = saved
    fresh = RerunDataIterator(golden_loader())
    pg = types.SimpleNamespace(tp=pgs.tp, pp=pgs.pp, cp=pgs.cp, dp=_Rank(0))  # the 2-replica checkpoint's rank 0
    restore_loader(str(root), 2, fresh, pg)
    assert fresh.iterable.position == 1
