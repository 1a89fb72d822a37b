"""Dense per-sample additive attention masks (``use_flex=False``), official semantics, built block-wise.

A sample's mask is float32 (L, L) with 0.0 = attend and -inf = blocked (rows are queries), L = sum(split_lens):
1. split k at offset c with length s: its rows see every earlier column [0, c) and, inside its own block,
   the lower triangle (causal) or the whole block (full / noise);
2. then every noise split's columns are blocked for all rows and only its own diagonal block re-opened.
Splits and modes are paired like ``zip`` (the shorter list wins), so a split whose mode was never
recorded (a CFG-dropped first video frame) keeps fully blocked rows, exactly as upstream does.
"""

from __future__ import annotations

import torch

from . import memory

__all__ = ["dense_attention_mask"]

_NEG_INF = float("-inf")


def dense_attention_mask(split_lens: list[int], attn_modes: list[str]) -> torch.Tensor:
    """Build the (L, L) float32 additive mask for one sample from its splits (see module docstring)."""
    total = sum(split_lens)
    mask = memory.empty((total, total), torch.float32)
    offset = 0
    noise_blocks: list[tuple[int, int]] = []
    for length, mode in zip(split_lens, attn_modes):
        if mode not in ("causal", "full", "noise"):
            raise ValueError(f"unknown attention mode {mode!r} (expected causal, full or noise)")
        end = offset + length
        if length > 0:  # each element is written exactly once: [earlier | own block | later]
            mask[offset:end, :offset] = 0.0
            if mode == "causal":
                mask[offset:end, offset:end] = torch.full((length, length), _NEG_INF).triu_(1)
            else:
                mask[offset:end, offset:end] = 0.0
            mask[offset:end, end:] = _NEG_INF
        if mode == "noise":
            noise_blocks.append((offset, end))
        offset = end
    mask[offset:] = _NEG_INF  # rows of splits without a recorded mode stay fully blocked
    for start, end in noise_blocks:
        mask[:, start:end] = _NEG_INF
        mask[start:end, start:end] = 0.0
    return mask
