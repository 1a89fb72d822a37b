"""The packer's ledger (per group: consumed = packed + dropped + buffered) and its share of an elastic resize.

Real packers over the golden cases' sample streams (``ListGroupSource``), with lossless off and on; the resize
runs through the real ``ResizeContext``, which dispatches each group's source states to the live source's
``resize_state``.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from bridge.models.bagel.data.packing import BagelPacker, ListGroupSource
from bridge.models.bagel.data.packing.packer import END_OF_STREAM, ledger_errors
from bridge.models.bagel.data.state import ResizeContext, StateError, check_restricted
from bridge.models.bagel.data.stats import merge_counts
from _external_common import packer_config
from packer_golden import load_case

CASE = "c02_flex_extrap_3g2m_s14"  # buffer pops, flushes of both kinds, two mandatory groups of three


def _packer(lossless: bool, *, cycle: bool = True, case: str = CASE) -> BagelPacker:
    cfg = load_case(case)["config"]
    sources = [ListGroupSource(load_case(case)["groups"][g], cycle=cycle, name=g) for g in cfg["group_names"]]
    config = dataclasses.replace(packer_config(cfg), lossless=lossless)
    return BagelPacker(sources, cfg["group_weights"], cfg["is_mandatory"], cfg["special_tokens"], config,
                       group_names=cfg["group_names"])


def _check_ledger(packer: BagelPacker, batches: list[dict], packed_before: int = 0) -> dict:
    """The invariant plus its ties to the other counters: packed = samples in the batches (+ ``packed_before``,
    the history a resized rank 0 carries), dropped = drops."""
    stats = packer.stats()
    ledger = stats["ledger"]
    assert ledger_errors(ledger) == [], ledger
    assert list(ledger) == packer.group_names
    assert {n: g["consumed"] for n, g in ledger.items()} == stats["consumed"]
    assert sum(g["packed"] for g in ledger.values()) == packed_before + sum(len(b["batch_data_indexes"])
                                                                           for b in batches)
    assert merge_counts(g["dropped"] for g in ledger.values()) == merge_counts([stats["packer_drops"]])
    assert sum(g["buffered"] for g in ledger.values()) == stats["buffer_len"] + stats["carry_len"]
    return ledger


def _seeded(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@pytest.mark.parametrize("lossless", [False, True])
def test_ledger_balances_at_every_batch_and_across_restore(lossless: bool) -> None:
    packer = _packer(lossless)
    _seeded(14)
    batches = []
    for _ in range(12):
        batches.append(next(packer))
        _check_ledger(packer, batches)
    state = packer.state_dict()
    rng = random.getstate(), np.random.get_state(), torch.get_rng_state()
    ledger = packer.stats()["ledger"]
    assert any(g["buffered"] for g in ledger.values()), "the save point holds waiting samples"
    drops = merge_counts(g["dropped"] for g in ledger.values())
    if lossless:
        assert "flush_drop" not in drops and "flush_drop_buffered" not in drops, drops
    else:
        assert drops.get("flush_drop", 0) + drops.get("flush_drop_buffered", 0) > 0, drops  # the paths are taken
    expected = [next(packer) for _ in range(8)]
    after = packer.stats()["ledger"]

    fresh = _packer(lossless)
    fresh.load_state_dict(state)
    assert fresh.stats()["ledger"] == ledger
    random.setstate(rng[0]), np.random.set_state(rng[1]), torch.set_rng_state(rng[2])
    resumed = []
    for exp in expected:
        resumed.append(next(fresh))
        _check_ledger(fresh, batches + resumed)
        assert torch.equal(resumed[-1]["packed_text_ids"], exp["packed_text_ids"])
    assert fresh.stats()["ledger"] == after


def test_end_of_stream_is_counted_and_the_ledger_still_balances() -> None:
    packer = _packer(False, cycle=False)
    _seeded(14)
    batches = []
    with pytest.raises(StopIteration):
        while True:
            batches.append(next(packer))
    ledger = _check_ledger(packer, batches)
    assert sum(g["dropped"].get(END_OF_STREAM, 0) for g in ledger.values()) > 0  # the unfinished pack


def test_state_carries_the_ledger_and_refuses_other_groups() -> None:
    packer = _packer(True)
    _seeded(3)
    for _ in range(4):
        next(packer)
    state = packer.state_dict()
    check_restricted(state)
    assert state["groups"] == packer.group_names and len(state["packed"]) == len(state["group_drops"]) == 3
    fresh = _packer(True)
    with pytest.raises(StateError, match="groups"):
        fresh.load_state_dict({**state, "groups": ["a", "b", "c"]})
    with pytest.raises(StateError, match="state has 2 packed entries, this packer has 3 groups"):
        fresh.load_state_dict({**state, "packed": [0, 0]})


# -- elastic resize -----------------------------------------------------------------------------------------

class _Ctx(ResizeContext):
    """The real resize context for one new rank (it dispatches to the live stage's own ``resize_state``), recording
    what each group's source is handed."""

    def __init__(self, dp_rank: int, dp_size: int, generation: int = 1) -> None:
        super().__init__(dp_rank, dp_size, generation, seed=0)
        self.handed: list[list] = []

    def resize(self, stage, tagged_olds: list, **kw) -> dict:
        self.handed.append(list(kw.get("handover", ())))
        return super().resize(stage, tagged_olds, **kw)


def _old_world(n: int, lossless: bool) -> list[BagelPacker]:
    """``n`` packers over the same streams, each with its own seed and a different number of batches."""
    packers = []
    for rank in range(n):
        packer = _packer(lossless)
        _seeded(100 + rank)
        for _ in range(3 + 2 * rank):
            next(packer)
        packers.append(packer)
    return packers


def _world_sum(ledgers: list[dict]) -> dict:
    out: dict = {}
    for ledger in ledgers:
        for name, g in ledger.items():
            acc = out.setdefault(name, {"consumed": 0, "packed": 0, "dropped": {}, "buffered": 0})
            for k in ("consumed", "packed", "buffered"):
                acc[k] += g[k]
            acc["dropped"] = merge_counts([acc["dropped"], g["dropped"]])
    return out


@pytest.mark.parametrize("lossless", [False, True])
@pytest.mark.parametrize("old_size, new_size", [(2, 3), (3, 1)])
def test_resize_hands_buffers_to_sources_and_keeps_the_world_ledger(old_size, new_size, lossless) -> None:
    olds = _old_world(old_size, lossless)
    old_states = [p.state_dict() for p in olds]
    old_world = _world_sum([p.stats()["ledger"] for p in olds])
    assert ledger_errors(old_world) == []
    waiting = sum(len(s["buffer"]) + len(s["carry"]) for s in old_states)
    assert waiting > 0, "some old ranks hold buffered samples"

    new_packers, new_states = [], []
    for rank in range(new_size):
        ctx = _Ctx(rank, new_size)
        state = _packer(lossless).resize_state(old_states, ctx)
        check_restricted(state)
        assert state["buffer"] == [] and state["carry"] == []
        # every group's source got that group's keys: old-rank order, buffer order, carry last
        for g in range(3):
            want = [k for s in old_states for f in ("buffer", "carry") for gg, k in s[f] if gg == g]
            assert ctx.handed[g] == want
            assert state["source"][g]["state"]["handover"] == want[rank::new_size]
        packer = _packer(lossless)
        packer.load_state_dict(state)
        new_packers.append(packer)
        new_states.append(state)
    # the world ledger right after the resize: history on rank 0, the waiting samples handed to the sources
    summed = _world_sum([p.stats()["ledger"] for p in new_packers])
    assert ledger_errors(summed) == []
    for name in summed:
        assert summed[name]["packed"] == old_world[name]["packed"]
        assert summed[name]["dropped"] == old_world[name]["dropped"]
        assert summed[name]["consumed"] == old_world[name]["consumed"] - old_world[name]["buffered"]
        assert summed[name]["buffered"] == 0
    assert sum(p.num_batches for p in new_packers) == sum(p.num_batches for p in olds)
    assert sum(s["drops"]["state"]["counts"].get("overlength", 0) for s in new_states) == \
        sum(p.drops.counts.get("overlength", 0) for p in olds)

    # run the new world: the handed-over samples come out of their sources first, nothing is lost
    for rank, packer in enumerate(new_packers):
        _seeded(1000 + rank)
        batches, before = [], sum(packer.packed)
        for _ in range(8):
            batches.append(next(packer))
            _check_ledger(packer, batches, before)
        assert all(not src.handover for src in packer.source), "the handover was consumed"
    final = _world_sum([p.stats()["ledger"] for p in new_packers])
    assert ledger_errors(final) == []


def test_handed_over_samples_arrive_first_and_in_order() -> None:
    olds = _old_world(2, True)
    old_states = [p.state_dict() for p in olds]
    state = _packer(False).resize_state(old_states, _Ctx(0, 1))
    packer = _packer(True)
    packer.load_state_dict(state)
    for g, src in enumerate(packer.source):
        want = [k for s in old_states for f in ("buffer", "carry") for gg, k in s[f] if gg == g]
        pos = src.position
        got = [next(src)["restore_key"] for _ in want]
        assert got == want and src.position == pos  # handed-over keys first, in order; the list has not moved


def test_resize_refuses_olds_that_disagree() -> None:
    olds = [p.state_dict() for p in _old_world(2, False)]
    with pytest.raises(StateError, match="old rank 1 has groups"):
        _packer(False).resize_state([olds[0], {**olds[1], "groups": ["x", "y", "z"]}], _Ctx(0, 2))
    with pytest.raises(StateError, match="old rank 1 has 2 source entries"):
        _packer(False).resize_state([olds[0], {**olds[1], "source": olds[1]["source"][:2]}], _Ctx(0, 2))
    with pytest.raises(StateError, match="old rank 0's state has fields"):
        _packer(False).resize_state([{"consumed": [0]}], _Ctx(0, 2))
    with pytest.raises(StateError, match="non-empty list"):
        _packer(False).resize_state([], _Ctx(0, 2))
    with pytest.raises(StateError) as e:
        _packer(False).resize_state([olds[0], {**olds[1], "groups": ["x"]}], _Ctx(0, 2))
    assert "\n" not in str(e.value)  # one line
