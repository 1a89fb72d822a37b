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
_causal = torch.zeros(0, 0)


def _causal_block(n: int) -> torch.Tensor:
    """(n, n) float32 view: 0.0 on and below the diagonal, -inf above (cached, grown on demand)."""
    global _causal
    if _causal.shape[0] < n:
        _causal = torch.full((n, n), _NEG_INF).triu_(1)
    return _causal[:n, :n]


def dense_attention_mask(split_lens: list[int], attn_modes: list[str]) -> torch.Tensor:
    """Build the (L, L) float32 additive mask for one sample from its splits (see module docstring).

    Row block by row block, every element written exactly once: the columns of earlier splits are copied
    from a one-row ``seen`` template (0.0, or -inf for noise splits: rule 2), then the split's own block,
    then -inf for every later column.
    """
    total = sum(split_lens)
    mask = memory.empty((total, total), torch.float32)
    seen = torch.empty(total, dtype=torch.float32)  # what later rows see in columns [0, offset)
    offset = 0
    for length, mode in zip(split_lens, attn_modes):
        if mode not in ("causal", "full", "noise"):
            raise ValueError(f"unknown attention mode {mode!r} (expected causal, full or noise)")
        end = offset + length
        if length > 0:
            rows = mask[offset:end]
            if offset:
                rows[:, :offset].copy_(seen[:offset].expand(length, offset))
            if mode == "causal":
                rows[:, offset:end].copy_(_causal_block(length))
            else:
                rows[:, offset:end].fill_(0.0)
            rows[:, end:].fill_(_NEG_INF)
        seen[offset:end].fill_(_NEG_INF if mode == "noise" else 0.0)
        offset = end
    mask[offset:].fill_(_NEG_INF)  # rows of splits without a recorded mode stay fully blocked
    return mask
