"""``packer.lossless``: no flush ever discards a sample, every pack obeys the budgets, resume is bit-exact with a
sample in the carry, and lossless off is the official loop unchanged.

Real data: the generated demo dataset (all three groups) read by the real Energon readers with the real Qwen2
tokenizer; the golden cases for "off is today's loop".
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np
import pytest

from bridge.models.bagel.data.build import build_bagel_train_loader, build_upstream
from bridge.models.bagel.data.config import ConfigError, PackerConfig, validate_data
from bridge.models.bagel.data.config.budgets import budget_issues
from bridge.models.bagel.data.packing import SPECIAL_TOKEN_KEYS, BagelPacker, ListGroupSource
from bridge.models.bagel.data.config.lengths import estimate
from bridge.models.bagel.data.packing.packer import ledger_errors
from bridge.models.bagel.data.packing.step import CARRY, PackBudgets, PackLoop, step
from bridge.models.bagel.data.tokenizer import add_special_tokens
from bridge.models.bagel.data.tools.budget_stats import simulate_packing
from _external_common import assert_same, demo_config
from packer_golden import first_difference, load_case, seed_like_official

#: Budgets that make the official loop flush often on the demo data: a one-sample buffer (flush_drop) and
#: prefer_buffer_before + max_num_tokens_per_sample > max_num_tokens (a popped sample can overflow:
#: flush_drop_buffered); two mandatory groups x (4096 - 1) <= 8192, so lossless accepts them.
TIGHT = dict(expected_num_tokens=7168, max_num_tokens=8192, max_num_tokens_per_sample=4096,
             prefer_buffer_before=6144, max_buffer_size=1, use_flex=True, max_latent_size=64)
PER_GROUP, PACKS, SEED = 24, 60, 1234
FLUSHES = ("flush_drop", "flush_drop_buffered")


@pytest.fixture(scope="module")
def demo(demo_setup):
    """The first PER_GROUP samples of each demo group through the real Energon readers, as ListGroupSource dicts."""
    out, tok = demo_setup
    chain = build_upstream(validate_data(demo_config(out, 0, True)), tok, 0, 1)
    packer = chain.source
    try:
        samples = [[next(src) for _ in range(PER_GROUP)] for src in packer.source]
    finally:
        chain.close()
    _, special, _ = add_special_tokens(tok)
    dicts = [[{"sequence_plan": [dict(i) for i in s.sequence_plan], "text_ids_list": s.text_ids_list,
               "image_tensor_list": s.image_tensor_list, "num_tokens": s.num_tokens,
               "data_indexes": s.data_indexes} for s in ss] for ss in samples]
    return packer.group_names, packer.group_weights, packer.is_mandatory, special, dicts


def _run(demo, lossless: bool, packs: int = PACKS) -> tuple[list[dict], BagelPacker, list[int]]:
    """``packs`` batches of a packer over the demo samples (cycled); the carry length at every batch boundary."""
    names, weights, mandatory, special, dicts = demo
    sources = [ListGroupSource(d, cycle=True, name=n) for n, d in zip(names, dicts)]
    packer = BagelPacker(sources, weights, mandatory, {k: special[k] for k in SPECIAL_TOKEN_KEYS},
                         PackerConfig(**TIGHT, lossless=lossless), group_names=names)
    py, npy = random.getstate(), np.random.get_state()
    random.seed(SEED)
    np.random.seed(SEED)
    batches, carries = [], []
    try:
        for _ in range(packs):
            batches.append(next(packer))
            assert ledger_errors(packer.stats()["ledger"]) == []
            carries.append(len(packer.carry))
    finally:
        random.setstate(py)
        np.random.set_state(npy)
    return batches, packer, carries


def test_lossless_never_flush_drops_and_obeys_every_budget(demo) -> None:
    names, _, mandatory, _, dicts = demo
    _, lossy_packer, _ = _run(demo, False)
    assert all(lossy_packer.drops.counts.get(r, 0) > 0 for r in FLUSHES), lossy_packer.drops.counts  # can fail
    batches, packer, carries = _run(demo, True)
    drops = packer.drops.counts
    assert not any(r in drops for r in FLUSHES), drops
    assert max(carries) >= 1, "the carry was used"
    limit, cap = TIGHT["max_num_tokens_per_sample"], TIGHT["max_num_tokens"]
    where = {str(d["data_indexes"]): (g, estimate(d["num_tokens"], len(d["sequence_plan"])))
             for g, ds in enumerate(dicts) for d in ds}
    assert len(where) == sum(map(len, dicts))  # data_indexes name one sample each
    mand = [g for g, m in enumerate(mandatory) if m]
    for k, b in enumerate(batches):
        assert b["sequence_length"] <= cap, (k, b["sequence_length"])
        assert sum(b["sample_lens"]) == cap  # flex: padded to max_num_tokens, the pad is not negative
        packed = [where[str(di)] for di in b["batch_data_indexes"]]
        assert all(e <= limit for _, e in packed)  # the per-sample limit holds for every packed sample
        assert [g for g, _ in packed[:len(mand)]] == mand  # one sample per mandatory group first, as officially
    # the simulator of `bagel-data stats` shares the decision (CFG dropout aside): no flush drop there either
    streams = [[estimate(d["num_tokens"], len(d["sequence_plan"])) for d in ds] for ds in dicts]
    sim = simulate_packing(streams, demo[1], mandatory, names, PackerConfig(**TIGHT, lossless=True), packs=PACKS)
    assert sim.impossible is None and sim.flushed == 0 and not any(r in sim.drops for r in FLUSHES)
    assert max(sim.pack_lengths) <= cap


@pytest.mark.parametrize("case", ["c02_flex_extrap_3g2m_s14", "c05_flex_extrap_nomand_s2"])
def test_lossless_off_is_the_official_loop(case: str) -> None:
    """``lossless: false`` spelled out reproduces the unmodified official packer's golden batches."""
    golden = load_case(case)
    cfg = golden["config"]
    sources = [ListGroupSource(golden["groups"][g], name=g) for g in cfg["group_names"]]
    knobs = {k: v for k, v in cfg.items() if k in PackerConfig.keys()}
    packer = BagelPacker(sources, cfg["group_weights"], cfg["is_mandatory"], cfg["special_tokens"],
                         PackerConfig.from_mapping({**knobs, "lossless": False}), group_names=cfg["group_names"])
    assert packer.config.lossless is False and not packer._loop.lossless
    seed_like_official(golden["config"]["seed"])
    for k, expected in enumerate(golden["batches"]):
        diff = first_difference(expected, next(packer), path=f"{case}.batches[{k}]")
        assert diff is None, diff
    assert packer.carry == [] and packer.stats()["carry_len"] == 0


def _find(state: Any, key: str) -> list:
    """Every value stored under ``key`` anywhere in a nested state."""
    if isinstance(state, dict):
        return [v for k, v in state.items() if k == key] + [x for v in state.values() for x in _find(v, key)]
    if isinstance(state, (list, tuple)):
        return [x for v in state for x in _find(v, key)]
    return []


def test_lossless_resume_is_bit_exact_with_a_sample_in_the_carry(demo_setup) -> None:
    """The full loader (real Energon readers, RNG isolation): saved at a boundary where the carry holds a
    sample, restored into a fresh loader, the next batches are identical bit for bit (``torch.equal`` rule)."""
    out, tok = demo_setup
    cfg = demo_config(out, 0, True)
    cfg = dataclasses.replace(cfg, packer=dataclasses.replace(cfg.packer, lossless=True, **TIGHT))
    loader = build_bagel_train_loader(cfg, tok, (0, 1), length=100)
    try:
        state = None
        for _ in range(40):
            next(loader)
            saved = loader.state_dict()
            if any(_find(saved, "carry")):
                state = saved
                break
        assert state is not None, "no batch boundary with a carried sample in 40 batches"
        expected = [next(loader) for _ in range(4)]
        stats = loader.stats()
    finally:
        loader.close()
    assert not any(r in stats["drops"] for r in FLUSHES)
    assert ledger_errors(stats["ledger"]) == []
    fresh = build_bagel_train_loader(cfg, tok, (0, 1), length=100)
    try:
        fresh.load_state_dict(state)
        for k, exp in enumerate(expected):
            assert_same(exp, next(fresh), f"resumed[{k}]")
        assert fresh.stats()["ledger"] == stats["ledger"]
    finally:
        fresh.close()


def test_lossless_budget_rules() -> None:
    """Mandatory samples alone must fit a pack in lossless mode: refused by the simulator and the budget check
    (``config.validate_data``, below), the one place knobs are checked."""
    b = PackBudgets(expected_num_tokens=900, max_num_tokens=1000, max_num_tokens_per_sample=600,
                    prefer_buffer_before=100, max_buffer_size=0)
    assert step(b, 501, 500, from_buffer=False, buffer_len=0, lossless=True) == CARRY
    assert step(b, 501, 500, from_buffer=True, buffer_len=0, lossless=True) == CARRY
    assert step(b, 0, 601, from_buffer=False, buffer_len=0, lossless=True) == "overlength"  # still dropped
    PackLoop(b, [1, 1], [True, True])  # the official loop lets them overflow (quirk §13.3)
    sim = simulate_packing([[599], [599]], [1, 1], [True, True], ["a", "b"],
                           PackerConfig(expected_num_tokens=900, max_num_tokens=1000, max_num_tokens_per_sample=600,
                                        prefer_buffer_before=100, lossless=True))
    assert sim.impossible and "lossless" in sim.impossible
    with pytest.raises(ConfigError, match="lossless: must be a bool"):
        PackerConfig(lossless="yes").validate()


def test_lossless_makes_the_mandatory_overflow_an_error_in_the_official_order(demo_setup) -> None:
    out, _ = demo_setup
    groups = validate_data(demo_config(out, 0, True)).groups
    tight = PackerConfig(**{**TIGHT, "max_num_tokens_per_sample": 6000})  # 2 x 5999 > 8192
    levels = {i.level for i in budget_issues(tight, groups, official=True) if "mandatory groups" in i.message}
    assert levels == {"warning"}
    lossless = dataclasses.replace(tight, lossless=True)
    levels = {i.level for i in budget_issues(lossless, groups, official=True) if "mandatory groups" in i.message}
    assert levels == {"error"}
