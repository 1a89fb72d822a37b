"""Bit-exact parity with the unmodified official BAGEL packer on every golden case."""

from __future__ import annotations

import pytest

from packer_golden import CASES, build_packer, first_difference, load_case, seed_like_official


@pytest.mark.parametrize("name", CASES)
def test_reproduces_every_golden_batch(name: str) -> None:
    case = load_case(name)
    cfg = case["config"]
    packer, sources = build_packer(case)
    seed_like_official(cfg["seed"])
    for k, expected in enumerate(case["batches"]):
        batch = next(packer)
        diff = first_difference(expected, batch, path=f"{name}.batches[{k}]")
        assert diff is None, diff
    consumed = {g: s.position for g, s in zip(cfg["group_names"], sources)}
    assert consumed == cfg["consumed_per_group"]
    assert packer.consumed == [cfg["consumed_per_group"][g] for g in cfg["group_names"]]


@pytest.mark.parametrize("name", CASES)
def test_drop_counters_match_official_trace(name: str) -> None:
    """Every sample the official loop discarded is counted under its reason."""
    case = load_case(name)
    cfg, stats = case["config"], case["config"]["stats"]
    packer, _ = build_packer(case)
    seed_like_official(cfg["seed"])
    for _ in case["batches"]:
        next(packer)
    drops = packer.drops.counts
    assert drops.get("overlength_mandatory", 0) == stats["mandatory_skip"]
    assert drops.get("overlength", 0) == stats["skip_drawn"] + stats["skip_from_buffer"]
    assert drops.get("flush_drop", 0) == stats["flush_yield_dropping_drawn_candidate_buffer_full"]
    assert drops.get("flush_drop_buffered", 0) == stats["flush_yield_dropping_buffered_candidate"]
    assert len(packer.buffer) == stats["buffer_len_at_end"]
    assert packer.num_batches == cfg["num_batches"]


def test_digest_and_comparator_are_bit_exact() -> None:
    """Our comparator/digest (used by benchmarks and the resume demo) agree with the golden rule."""
    import torch

    from bridge.models.bagel.data.packing import batch_digest
    from bridge.models.bagel.data.packing import first_difference as ours

    case = load_case(CASES[0])
    a = case["batches"][0]
    b = {**a, "packed_text_ids": a["packed_text_ids"].clone()}
    assert ours(a, b) is None and batch_digest(a) == batch_digest(b)
    b["packed_text_ids"][0] += 1
    assert ours(a, b) is not None and batch_digest(a) != batch_digest(b)
    z = {"x": torch.tensor([0.0])}
    nz = {"x": torch.tensor([-0.0])}
    assert ours(z, nz) is not None and batch_digest(z) != batch_digest(nz)
    assert first_difference(z, nz) is not None
