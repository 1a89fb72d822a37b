"""The batch-contract checker accepts every regular official batch and flags broken ones."""

from __future__ import annotations

import pytest
import torch

from bridge.models.bagel.data.job.batch_check import account_batch, check_batch
from packer_golden import CASES, load_case

# Official quirk batches (golden README statistics): unclosed video splits, misaligned split/mode lists,
# mandatory samples over the cap. Everything else must pass.
QUIRKS = {"batches_seq_len_ne_tokens", "batches_split_modes_misaligned", "batches_over_max_num_tokens"}


@pytest.mark.parametrize("name", CASES)
def test_official_batches_pass_except_documented_quirks(name: str) -> None:
    case = load_case(name)
    cfg = case["config"]
    flagged = sum(bool(check_batch(b, max_num_tokens=cfg["max_num_tokens"], use_flex=cfg["use_flex"]))
                  for b in case["batches"])
    quirky = max((cfg["stats"].get(k, 0) for k in QUIRKS), default=0)
    assert quirky <= flagged <= sum(cfg["stats"].get(k, 0) for k in QUIRKS)
    if quirky == 0:
        assert flagged == 0


def _regular_batch() -> tuple[dict, dict]:
    case = load_case("c02_flex_extrap_3g2m_s14")
    return dict(case["batches"][0]), case["config"]


def test_broken_batches_are_flagged() -> None:
    batch, cfg = _regular_batch()
    kw = dict(max_num_tokens=cfg["max_num_tokens"], use_flex=True)
    assert check_batch(batch, **kw) == []
    nan = dict(batch, padded_images=batch["padded_images"].clone())
    nan["padded_images"][0, 0, 0, 0] = float("nan")
    assert any("NaN" in p for p in check_batch(nan, **kw))
    shifted = dict(batch, packed_text_indexes=batch["packed_text_indexes"] + 1)
    assert any("tile" in p for p in check_batch(shifted, **kw))
    short = dict(batch, sample_lens=batch["sample_lens"][:-2] + batch["sample_lens"][-1:])
    assert check_batch(short, **kw)
    bad_mode = dict(batch, attn_modes=["sideways"] + batch["attn_modes"][1:])
    assert any("unknown attention modes" in p for p in check_batch(bad_mode, **kw))


def test_account_batch_counts_targets_and_groups() -> None:
    batch, cfg = _regular_batch()
    acc = account_batch(batch, max_num_tokens=cfg["max_num_tokens"])
    assert acc["tokens"] == batch["sequence_length"]
    assert acc["padding"] == cfg["max_num_tokens"] - batch["sequence_length"]
    assert acc["ce_tokens"] == len(batch["ce_loss_indexes"])
    assert acc["mse_tokens"] == len(batch["mse_loss_indexes"])
    assert sum(acc["groups"].values()) == acc["samples"] == len(batch["batch_data_indexes"])
    assert torch.is_tensor(batch["packed_text_ids"])
