"""The packed-batch contract (spec §8/§15) as executable checks, plus per-batch accounting.

``check_batch`` returns a list of human-readable problems (empty when the batch is well formed);
``account_batch`` returns the numbers a trainer logs (real tokens, padding, CE/MSE targets, group mix).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

__all__ = ["account_batch", "check_batch"]

_MODES = {"causal", "full", "noise"}


def _ints(t: Any) -> torch.Tensor:
    return t if isinstance(t, torch.Tensor) else torch.tensor(t, dtype=torch.int64)


def _position_range(ids: Any, side: int | None, name: str, key: str) -> list[str]:
    """``ids`` (int64 [T]) must index a ``side`` x ``side`` position table: 0 <= id < side**2."""
    ids = _ints(ids)
    if side is None or not len(ids):
        return []
    size = side * side
    bad = int(((ids < 0) | (ids >= size)).sum())
    if bad:
        return [f"{bad} {name} outside [0, {size}) (max {int(ids.max())}; the table is {key} {side} squared): "
                f"raise {key} or lower the group's max_image_size"]
    return []


def check_batch(batch: dict[str, Any], *, max_num_tokens: int, use_flex: bool, max_latent_size: int | None = None,
                max_num_patch_per_side: int | None = None) -> list[str]:
    """Problems with ``batch`` under the official batch contract (empty list = valid).

    ``max_latent_size`` / ``max_num_patch_per_side`` (the packer's table sides; None = not checked) bound
    ``packed_latent_position_ids`` / ``packed_vit_position_ids`` to ``[0, side**2)``: the model looks them up
    in its 2D sin-cos position tables, and an id past the end is a device-side assert on a GPU.
    """
    total = int(batch["packed_position_ids"].numel())
    sample_lens = batch["sample_lens"][:-1] if use_flex else batch["sample_lens"]
    p = _check_lengths(batch, total, sample_lens, max_num_tokens)
    covered = [batch["packed_text_indexes"]]
    if "packed_vit_tokens" in batch:
        p += _check_vit(batch, max_num_patch_per_side)
        covered.append(batch["packed_vit_token_indexes"])
    if "padded_images" in batch:
        p += _check_vae(batch, max_latent_size)
        covered.append(batch["packed_vae_token_indexes"])
    positions = torch.cat([_ints(c) for c in covered])
    if len(positions) != total or not torch.equal(torch.sort(positions).values, torch.arange(total)):
        p.append(f"text/ViT/VAE indexes do not tile the {total} packed positions exactly once")
    if "packed_label_ids" in batch:
        p += _check_ce(batch, total)
    p += _check_flex(batch, max_num_tokens) if use_flex else _check_dense(batch, sample_lens)
    if len(batch["batch_data_indexes"]) != len(sample_lens):
        p.append("batch_data_indexes and sample_lens differ in length")
    return p


def _check_lengths(batch: dict[str, Any], total: int, sample_lens: list[int], max_num_tokens: int) -> list[str]:
    """The sequence length against the samples, the packed tokens and the budget; text ids against indexes."""
    p: list[str] = []
    seq_len = batch["sequence_length"]
    if seq_len != sum(sample_lens):
        p.append(f"sequence_length {seq_len} != sum(sample_lens) {sum(sample_lens)}")
    if seq_len != total:
        p.append(f"sequence_length {seq_len} != {total} packed tokens (a split was never closed)")
    if seq_len > max_num_tokens:
        p.append(f"sequence_length {seq_len} exceeds max_num_tokens {max_num_tokens}")
    if len(batch["packed_text_ids"]) != len(batch["packed_text_indexes"]):
        p.append("packed_text_ids and packed_text_indexes differ in length")
    return p


def _check_vit(batch: dict[str, Any], max_num_patch_per_side: int | None) -> list[str]:
    """ViT patches: one count for tokens / indexes / position ids / seqlens, no NaN, position ids in the table."""
    p: list[str] = []
    n = int(batch["vit_token_seqlens"].sum())
    lens = {len(batch["packed_vit_tokens"]), len(batch["packed_vit_token_indexes"]),
            len(batch["packed_vit_position_ids"]), n}
    if len(lens) != 1:
        p.append(f"ViT token count mismatch between tokens/indexes/position ids/seqlens: {sorted(lens)}")
    if torch.isnan(batch["packed_vit_tokens"]).any():
        p.append("NaN in packed_vit_tokens")
    return p + _position_range(batch["packed_vit_position_ids"], max_num_patch_per_side, "ViT position ids",
                               "max_num_patch_per_side")


def _check_vae(batch: dict[str, Any], max_latent_size: int | None) -> list[str]:
    """VAE latents: one count for indexes / position ids / timesteps / latent shapes, images per shape, no NaN,
    ``mse_loss_indexes`` = the noised tokens' positions, position ids in the table."""
    p: list[str] = []
    n = sum(h * w for h, w in batch["patchified_vae_latent_shapes"])
    lens = {len(batch["packed_vae_token_indexes"]), len(batch["packed_latent_position_ids"]),
            len(batch["packed_timesteps"]), n}
    if len(lens) != 1:
        p.append(f"VAE token count mismatch between indexes/position ids/timesteps/latent shapes: {sorted(lens)}")
    if len(batch["padded_images"]) != len(batch["patchified_vae_latent_shapes"]):
        p.append("padded_images and patchified_vae_latent_shapes differ in length")
    if torch.isnan(batch["padded_images"]).any():
        p.append("NaN in padded_images")
    noised = torch.isfinite(batch["packed_timesteps"])
    if int(noised.sum()) != len(batch["mse_loss_indexes"]):
        p.append("the number of noised VAE tokens differs from len(mse_loss_indexes)")
    elif len(batch["mse_loss_indexes"]) and not torch.equal(
            batch["packed_vae_token_indexes"][noised], _ints(batch["mse_loss_indexes"])):
        p.append("mse_loss_indexes are not the positions of the noised VAE tokens")
    return p + _position_range(batch["packed_latent_position_ids"], max_latent_size, "latent position ids",
                               "max_latent_size")


def _check_ce(batch: dict[str, Any], total: int) -> list[str]:
    """CE targets: labels / indexes / weights of one length, indexes inside the sequence, weights positive."""
    p: list[str] = []
    ce = batch["ce_loss_indexes"]
    if not len(batch["packed_label_ids"]) == len(ce) == len(batch["ce_loss_weights"]):
        p.append("CE labels/indexes/weights differ in length")
    if len(ce) and (int(ce.min()) < 0 or int(ce.max()) >= total):
        p.append(f"ce_loss_indexes outside [0, {total})")
    if (batch["ce_loss_weights"] <= 0).any():
        p.append("non-positive ce_loss_weights")
    return p


def _check_flex(batch: dict[str, Any], max_num_tokens: int) -> list[str]:
    """Flex metadata: one attention mode per split, splits covering the padded sequence, known modes."""
    p: list[str] = []
    if len(batch["split_lens"]) != len(batch["attn_modes"]):
        p.append("split_lens and attn_modes differ in length")
    if sum(batch["split_lens"]) != max_num_tokens:
        p.append(f"flex splits sum to {sum(batch['split_lens'])}, expected max_num_tokens {max_num_tokens}")
    if set(batch["attn_modes"]) - _MODES:
        p.append(f"unknown attention modes {sorted(set(batch['attn_modes']) - _MODES)}")
    return p


def _check_dense(batch: dict[str, Any], sample_lens: list[int]) -> list[str]:
    """Dense masks: one (n, n) mask per sample, holding only 0.0 and -inf."""
    masks = batch["nested_attention_masks"]
    if [tuple(m.shape) for m in masks] != [(n, n) for n in sample_lens]:
        return ["nested_attention_masks shapes do not match sample_lens"]
    for m in masks:
        if torch.isnan(m).any() or not bool(((m == 0) | (m == float("-inf"))).all()):
            return ["a dense mask holds values other than 0.0 and -inf"]
    return []


def account_batch(batch: dict[str, Any], *, max_num_tokens: int) -> dict[str, Any]:
    """What one batch contributes to throughput/fill/loss-target statistics: ``tokens``, ``padding``, ``ce_tokens``,
    ``mse_tokens``, ``samples``, ``images`` (ints) and ``groups`` (``Counter``: samples per group)."""
    tokens = int(batch["sequence_length"])
    groups = Counter(d.get("dataset_name", "?") if isinstance(d, dict) else "?" for d in batch["batch_data_indexes"])
    return dict(
        tokens=tokens,
        padding=max(max_num_tokens - tokens, 0),
        ce_tokens=int(len(batch.get("ce_loss_indexes", ()))),
        mse_tokens=int(len(batch.get("mse_loss_indexes", ()))),
        samples=len(batch["batch_data_indexes"]),
        images=int(len(batch.get("vit_token_seqlens", ()))) + int(len(batch.get("patchified_vae_latent_shapes", ()))),
        groups=groups,
    )
