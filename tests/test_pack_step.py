"""The shared pack loop (``packing.step``): BagelPacker and the ``bagel-data stats`` simulator agree on real data;
the step's rules (spec §5, quirks §13.1-§13.3) one by one; packing/ imports no config-time or later stage."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from bridge.models.bagel.data.tools.budget_stats import simulate_packing
from bridge.models.bagel.data.build import build_upstream
from bridge.models.bagel.data.config import PackerConfig, validate_data
from bridge.models.bagel.data.packing import BagelPacker, ListGroupSource, SPECIAL_TOKEN_KEYS
from bridge.models.bagel.data.config.lengths import estimate
from bridge.models.bagel.data.packing.step import ADD, BUFFER, DROP_REASONS, GroupDraw, PackBudgets, step
from bridge.models.bagel.data.tokenizer import add_special_tokens
from _external_common import demo_config

#: Budgets that reach every drop reason on the demo data: vlm samples up to ~5000 tokens (mandatory drop),
#: edit up to ~6200 (overlength), a 1-sample buffer (flush_drop) and prefer_buffer_before + per-sample > max
#: (a popped sample can overflow: flush_drop_buffered). ``_parity_for`` moves the per-sample limit onto a real
#: sample's estimate, so the non-strict ``>`` (kept at the limit) is exercised, not only the clear cases.
PARITY = PackerConfig(expected_num_tokens=7168, max_num_tokens=8192, max_num_tokens_per_sample=4110,
                      prefer_buffer_before=6144, max_buffer_size=1, use_flex=True, max_latent_size=64)
PER_GROUP, PACKS, SEED = 24, 40, 1234


def _as_dict(sample, *, no_cfg: bool) -> dict:
    """A reader's sample as a ListGroupSource dict (``enable_cfg`` cleared when ``no_cfg``)."""
    plan = [dict(item, enable_cfg=0) if no_cfg else dict(item) for item in sample.sequence_plan]
    return {"sequence_plan": plan, "text_ids_list": sample.text_ids_list,
            "image_tensor_list": sample.image_tensor_list, "num_tokens": sample.num_tokens,
            "data_indexes": sample.data_indexes}


@pytest.fixture(scope="module")
def demo_samples(demo_setup):
    """The first PER_GROUP samples of each demo group read by the real Energon readers (groups in YAML order)."""
    out, tok = demo_setup
    cfg = demo_config(out, 0, True)
    chain = build_upstream(validate_data(cfg), tok, 0, 1)
    packer = chain.source
    try:
        samples = [[next(src) for _ in range(PER_GROUP)] for src in packer.source]
    finally:
        chain.close()
    _, special, _ = add_special_tokens(tok)
    return packer.group_names, packer.group_weights, packer.is_mandatory, special, samples


def _parity_for(demo) -> PackerConfig:
    """PARITY with the per-sample limit moved to the nearest real non-mandatory sample's estimate, so the
    kept-at-the-limit boundary is in the data whatever order the readers deliver the demo samples in."""
    _, _, mandatory, _, samples = demo
    ests = [estimate(s.num_tokens, len(s.sequence_plan)) for ss, m in zip(samples, mandatory) if not m for s in ss]
    limit = min(ests, key=lambda e: (abs(e - PARITY.max_num_tokens_per_sample), e))
    return dataclasses.replace(PARITY, max_num_tokens_per_sample=limit)


def _run_packer(demo, *, no_cfg: bool) -> tuple[list[int], list[int], dict[str, int], int]:
    names, weights, mandatory, special, samples = demo
    sources = [ListGroupSource([_as_dict(s, no_cfg=no_cfg) for s in ss], cycle=True, name=n)
               for n, ss in zip(names, samples)]
    packer = BagelPacker(sources, weights, mandatory, {k: special[k] for k in SPECIAL_TOKEN_KEYS}, _parity_for(demo),
                         group_names=names)
    py, npy = random.getstate(), np.random.get_state()
    random.seed(SEED)
    np.random.seed(SEED)
    try:
        batches = [next(packer) for _ in range(PACKS)]
    finally:
        random.setstate(py)
        np.random.set_state(npy)
    lengths = [b["sequence_length"] for b in batches]
    samples_per_pack = [len(b["batch_data_indexes"]) for b in batches]
    return lengths, samples_per_pack, dict(packer.drops.counts), sum(packer.consumed)


def test_packer_and_stats_simulator_agree_on_real_demo_samples(demo_samples) -> None:
    """Same samples (real converted demo data, all three groups), same seed: the simulator of ``bagel-data stats``
    and the real packer build packs of the same token counts and drop the same samples for the same reasons.

    CFG dropout is the simulator's documented approximation (it packs estimates and draws no CFG coins), so the
    samples' ``enable_cfg`` flags are cleared for this comparison; the packed length then equals the estimate.
    """
    names, weights, mandatory, _, samples = demo_samples
    lengths, per_pack, drops, consumed = _run_packer(demo_samples, no_cfg=True)
    streams = [[estimate(s.num_tokens, len(s.sequence_plan)) for s in ss] for ss in samples]
    parity = _parity_for(demo_samples)
    limit = parity.max_num_tokens_per_sample
    assert any(e == limit for ss, m in zip(streams, mandatory) if not m for e in ss)  # the boundary is in the data
    sim = simulate_packing(streams, weights, mandatory, names, parity, packs=PACKS, seed=SEED)
    assert sim.impossible is None and sim.packs == PACKS
    assert sim.pack_lengths == lengths
    assert sim.drops == drops and sim.consumed == consumed
    assert sim.samples_per_pack == pytest.approx(sum(per_pack) / PACKS)
    assert set(drops) == set(DROP_REASONS) and all(drops[r] > 0 for r in DROP_REASONS), drops  # every path taken
    assert sim.over_limit == drops["overlength"] + drops["overlength_mandatory"]
    assert sim.flushed == drops["flush_drop"] + drops["flush_drop_buffered"]
    assert sim.fill == pytest.approx(sum(lengths) / PACKS / parity.max_num_tokens)
    # The comparison can fail: with the samples' real CFG flags the packer draws CFG coins from the same global
    # stream and packs dropped items shorter, so its packs are no longer the simulator's.
    real_lengths, _, _, _ = _run_packer(demo_samples, no_cfg=False)
    assert real_lengths != sim.pack_lengths


B = PackBudgets(expected_num_tokens=900, max_num_tokens=1000, max_num_tokens_per_sample=500,
                prefer_buffer_before=100, max_buffer_size=2)


def test_step_rules() -> None:
    """Spec §5 steps 2.3-2.5: ``>`` for the per-sample limit, ``>`` for the pack cap, buffer only fresh samples."""
    assert step(B, 0, 500, from_buffer=False, buffer_len=0) == ADD               # est == limit is kept (non-strict)
    assert step(B, 0, 501, from_buffer=False, buffer_len=0) == "overlength"
    assert step(B, 999, 501, from_buffer=True, buffer_len=0) == "overlength"      # the limit is checked first
    assert step(B, 500, 500, from_buffer=False, buffer_len=0) == ADD              # curr + est == max fits
    assert step(B, 501, 500, from_buffer=False, buffer_len=1) == BUFFER
    assert step(B, 501, 500, from_buffer=False, buffer_len=2) == "flush_drop"     # buffer full
    assert step(B, 501, 500, from_buffer=True, buffer_len=0) == "flush_drop_buffered"  # never re-buffered
    assert PackBudgets.of(PARITY) == PackBudgets(7168, 8192, 4110, 6144, 1)


def test_mandatory_samples_use_the_strict_limit_and_skip_the_cap() -> None:
    """Quirks §13.1 / §13.3 through the simulator: est == limit is dropped in a mandatory group only, and two
    mandatory samples may together exceed max_num_tokens."""
    cfg = PackerConfig(expected_num_tokens=900, max_num_tokens=1000, max_num_tokens_per_sample=600,
                       prefer_buffer_before=100, max_buffer_size=0)
    r = simulate_packing([[600, 599], [599]], [1, 1], [True, True], ["a", "b"], cfg, packs=3)
    # a drops its 600 (>= limit), packs 599; b packs 599: 1198 > max_num_tokens; the next candidate overflows
    # and, with no buffer, ends the pack by the official flush
    assert r.pack_lengths == [1198] * 3 and r.drops["flush_drop"] == 3 and r.drops["overlength_mandatory"] >= 1
    assert set(r.drops) == {"flush_drop", "overlength_mandatory"}
    r = simulate_packing([[600, 100]], [1], [False], ["a"], dataclasses.replace(cfg, max_buffer_size=50), packs=1)
    assert r.drops == {} and r.pack_lengths == [900]  # 600 + 100 + 100 + 100 (later 600s wait in the buffer)


def test_group_draw_is_the_official_first_cumulative_above_u() -> None:
    """``GroupDraw`` (bisect) equals the spec's linear scan ``first i with u < cum_i, else 0`` at every edge."""
    weights = [1, 0, 2.5, 0, 0.5]
    draw = GroupDraw(weights)
    total = float(sum(weights))
    cum = [sum(weights[:i + 1]) / total for i in range(len(weights))]
    assert draw.cum == cum and draw.cum[-1] == 1.0
    rng = random.Random(0)
    us = [0.0, *cum, *(np.nextafter(c, 0.0) for c in cum), *(rng.random() for _ in range(2000))]
    for u in us:
        assert draw(u) == next((i for i, c in enumerate(cum) if u < c), 0), u
    assert 1 not in {draw(u) for u in us} and 3 not in {draw(u) for u in us}  # zero weight: never drawn
