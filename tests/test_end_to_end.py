"""Demo data → Energon readers → cookers → BagelPacker: every batch satisfies the official batch contract."""

from __future__ import annotations

import pytest
import torch

from _external_common import DEMO_MAX_TOKENS, demo_loader
from bridge.models.bagel.data.job.batch_check import check_batch

pytestmark = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")

MAX_TOKENS = DEMO_MAX_TOKENS
INDEX_KEYS = ("packed_text_indexes", "packed_vit_token_indexes", "packed_vae_token_indexes", "mse_loss_indexes",
              "ce_loss_indexes")


@pytest.mark.parametrize("use_flex", [True, False], ids=["flex", "dense"])
def test_demo_batches_satisfy_the_official_invariants(demo_setup, use_flex: bool) -> None:
    out, tok = demo_setup
    groups_seen, with_vit = set(), 0
    with demo_loader(out, tok, 0, use_flex) as loader:
        for _ in range(8):
            batch = next(loader)
            assert check_batch(batch, max_num_tokens=MAX_TOKENS, use_flex=use_flex, max_latent_size=64,
                               max_num_patch_per_side=70) == []
            seq = batch["sequence_length"]
            sample_lens = batch["sample_lens"]
            if use_flex:
                assert sum(sample_lens[:-1]) == seq and sum(sample_lens) == MAX_TOKENS
                assert sum(batch["split_lens"]) == MAX_TOKENS and batch["attn_modes"][-1] == "causal"
            else:
                assert sum(sample_lens) == seq
                assert [m.shape for m in batch["nested_attention_masks"]] == [(n, n) for n in sample_lens]
            for key in INDEX_KEYS:
                if key in batch and len(batch[key]):
                    assert int(batch[key].min()) >= 0 and int(batch[key].max()) < seq, key
            assert batch["packed_position_ids"].shape == (seq,)
            names = [d["dataset_name"] for d in batch["batch_data_indexes"]]
            assert names[:2] == ["t2i_pretrain", "vlm_sft"], "mandatory groups are packed first, in YAML order"
            groups_seen.update(names)
            # mandatory t2i (noised VAE target) and vlm (CE answer) guarantee these key groups; ViT keys need an
            # image in the vlm sample (text-only conversations exist) or an undropped edit context image
            assert {"padded_images", "packed_label_ids", "mse_loss_indexes"} <= set(batch)
            with_vit += "packed_vit_tokens" in batch
            assert batch["padded_images"].dtype == torch.float32
            assert float(batch["padded_images"].min()) >= -1.0 and float(batch["padded_images"].max()) <= 1.0
            if "packed_vit_tokens" in batch:
                assert batch["packed_vit_tokens"].shape[1] == 14 * 14 * 3
            assert seq <= MAX_TOKENS
        stats = loader.stats()
        assert stats["num_batches"] == stats["position"] == 8
    assert groups_seen == {"t2i_pretrain", "vlm_sft", "unified_edit"}
    assert with_vit >= 4
