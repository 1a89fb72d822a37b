"""Attention masks from a packed BAGEL batch's flex metadata, on any device (torch only, no Megatron import).

In flex mode (``use_flex=True``) a packed batch carries no O(L²) masks but three lists (spec §7, §8):
``sample_lens`` (one document per packed sample, then the trailing pad), ``split_lens`` and ``attn_modes``
(one global entry per attention split, then the pad split ``(pad_len, 'causal')``). The official model turns
them into a FlexAttention block mask on the GPU (``data/data_utils.py`` ``create_sparse_mask`` L13–L40, used
by ``modeling/bagel/qwen2_navit.py`` L294/L478). This module does the same from its own code:

* ``flex_metadata(batch)`` validates the lists and expands them to per-token id tensors (``FlexMetadata``);
* ``make_mask_mod(meta)`` is the FlexAttention ``mask_mod`` (``mask_rule`` on the per-token ids); query ``q``
  may attend key ``k`` iff
  - ``q`` and ``k`` are in the same document (sample; the pad is a document of its own), and
  - ``q >= k``, or both lie in the same ``full``/``noise`` split (bidirectional inside it), and
  - ``k`` is not in a ``noise`` split other than ``q``'s (noised targets are invisible to every other token);
* ``block_mask(batch)`` builds the ``BlockMask`` for the whole padded sequence (``sum(sample_lens)`` =
  ``max_num_tokens`` tokens);
* ``dense_mask(batch)`` materialises the same mask as an (L, L) bool or additive tensor (for SDPA or checks);
* ``block_diagonal_mask(nested_attention_masks, pad_len)`` lays a dense-mode batch's official per-sample
  masks out block-diagonally, with the pad block exactly as flex mode defines it;
* ``to_device(batch, device)`` moves every tensor of a batch (pinned first when the target is CUDA).

Padding: the pad split is a causal document of its own, so in the materialised mask the last ``pad_len`` rows
and columns form a lower-triangular block that no real token sees and that sees no real token. Every row
therefore attends to at least itself (no all-blocked rows, no NaN under softmax); the model strips the pad
rows after attention. The real-token part is, element for element, the block-diagonal of the dense-mode
``nested_attention_masks`` of the same pack (``tests/test_attention.py`` checks this on the golden cases).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

__all__ = ["ATTN_MODES", "DEFAULT_BLOCK_SIZE", "FlexMetadata", "block_diagonal_mask", "block_mask", "dense_mask",
           "flex_metadata", "make_mask_mod", "mask_rule", "to_device"]

logger = logging.getLogger(__name__)

ATTN_MODES = ("causal", "full", "noise")
#: FlexAttention's default sparse block size (tokens per query/key tile); official BAGEL uses 128 too.
DEFAULT_BLOCK_SIZE = 128

MaskMod = Callable[[Any, Any, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class FlexMetadata:
    """Per-token ids of one packed flex batch (all int32 tensors of shape [L] on ``device``, L = ``length``).

    ``document_id``: index of the token's document (0-based sample index; the pad is the last document).
    ``full_id``: global split index for tokens of ``full`` and ``noise`` splits, -1 for ``causal`` tokens.
    ``noise_id``: global split index for tokens of ``noise`` splits, -1 otherwise.
    ``doc_bounds``: host-side cumulative document ends (``[0, e_0, e_1, ..., L]``, token units).
    ``split_lens`` / ``attn_modes``: the validated host-side lists (pad split included).
    """

    document_id: torch.Tensor
    full_id: torch.Tensor
    noise_id: torch.Tensor
    doc_bounds: tuple[int, ...]
    split_lens: tuple[int, ...]
    attn_modes: tuple[str, ...]

    @property
    def length(self) -> int:
        """Total tokens L covered by the mask (real tokens plus the pad), i.e. ``sum(sample_lens)``."""
        return self.doc_bounds[-1]

    @property
    def device(self) -> torch.device:
        return self.document_id.device


def _validate(sample_lens: Sequence[int], split_lens: Sequence[int], attn_modes: Sequence[str]) -> None:
    if len(split_lens) != len(attn_modes):
        raise ValueError(
            f"flex batch has {len(split_lens)} split_lens but {len(attn_modes)} attn_modes: a split was never "
            "closed or never given a mode (official quirk: a CFG-dropped video frame that opens or closes a "
            "split); the official create_sparse_mask would pair modes with the wrong splits, so no mask is built"
        )
    bad = sorted({m for m in attn_modes if m not in ATTN_MODES})
    if bad:
        raise ValueError(f"unknown attention modes {bad} (expected one of {ATTN_MODES})")
    if any(n < 0 for n in sample_lens) or any(n < 0 for n in split_lens):
        raise ValueError(
            f"negative length in sample_lens {list(sample_lens)} / split_lens: the pack exceeds max_num_tokens "
            "(official quirk: mandatory samples bypass the cap, so pad_len = max_num_tokens - sequence_length < 0)"
        )
    if sum(split_lens) != sum(sample_lens):
        raise ValueError(f"split_lens sum to {sum(split_lens)} but sample_lens to {sum(sample_lens)}")
    split_ends = set(accumulate(split_lens))
    stray = [e for e in accumulate(sample_lens) if e and e not in split_ends]
    if stray:
        raise ValueError(f"document ends {stray} fall inside a split: sample_lens and split_lens disagree")


def flex_metadata(batch: Mapping[str, Any], device: torch.device | str | None = None) -> FlexMetadata:
    """Validate a flex batch's ``sample_lens`` / ``split_lens`` / ``attn_modes`` and expand them per token.

    Args:
        batch: a packed batch dict in flex mode (lists of Python ints / strs; the pad entries included).
        device: where the id tensors go (default CPU). The expansion runs on the host (O(#splits) Python
            work, O(L) tensor work) and is copied once.
    Returns:
        ``FlexMetadata`` with three int32 [L] tensors, L = ``sum(sample_lens)``.
    Raises:
        ValueError: a dense-mode batch (``nested_attention_masks``), lists of different lengths, unknown modes,
            negative lengths (over-cap pack), split/document boundaries that disagree, or (when the batch has
            ``packed_position_ids``) more packed tokens than ``sequence_length``. The list-length and packed-token
            checks together catch every pack whose modes are paired with the wrong splits: an extra mode comes
            only from an unclosed split, whose tokens are packed but not counted. With the three lists alone, an
            unclosed split compensated by a mode-less one elsewhere in the pack cannot be detected.
    """
    if "split_lens" not in batch:
        what = "a dense-mode batch (use block_diagonal_mask)" if "nested_attention_masks" in batch else "not a batch"
        raise ValueError(f"no flex metadata (split_lens/attn_modes): {what}")
    sample_lens = [int(n) for n in batch["sample_lens"]]
    split_lens = [int(n) for n in batch["split_lens"]]
    attn_modes = list(batch["attn_modes"])
    _validate(sample_lens, split_lens, attn_modes)
    positions = batch.get("packed_position_ids")
    if positions is not None and "sequence_length" in batch and len(positions) != batch["sequence_length"]:
        raise ValueError(
            f"{len(positions)} packed tokens but sequence_length {batch['sequence_length']}: a split was opened and "
            "never closed (official quirk: the closing video frame was CFG-dropped), so its mode is paired with a "
            "later split; the official flex and dense masks of this pack disagree, so no mask is built"
        )
    lens = torch.tensor(split_lens, dtype=torch.int64)
    idx = torch.arange(len(split_lens), dtype=torch.int32)
    full_id, noise_id = (torch.repeat_interleave(torch.where(torch.tensor(flags, dtype=torch.bool), idx, -1), lens)
                         for flags in ([m != "causal" for m in attn_modes], [m == "noise" for m in attn_modes]))
    document_id = torch.repeat_interleave(torch.arange(len(sample_lens), dtype=torch.int32),
                                          torch.tensor(sample_lens, dtype=torch.int64))
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return FlexMetadata(document_id.to(dev), full_id.to(dev), noise_id.to(dev), (0, *accumulate(sample_lens)),
                        tuple(split_lens), tuple(attn_modes))


def make_mask_mod(meta: FlexMetadata) -> MaskMod:
    """The FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` of ``meta`` (rule in the module docstring).

    ``q_idx`` / ``kv_idx`` are integer tensors of any broadcastable shapes, indices in [0, L); ``b`` and ``h``
    are ignored (one packed sequence, the same mask for every head). Mirrors the official ``create_sparse_mask``
    (BAGEL ``data/data_utils.py`` L13–L40): or(causal, same full/noise split) and not-other-noise and same-doc.
    """
    doc, full, noise = meta.document_id, meta.full_id, meta.noise_id

    def bagel_mask_mod(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return mask_rule(doc, full, noise, q_idx, kv_idx)

    return bagel_mask_mod


def mask_rule(document_id: torch.Tensor, full_id: torch.Tensor, noise_id: torch.Tensor, q_idx: torch.Tensor,
              kv_idx: torch.Tensor) -> torch.Tensor:
    """The mask rule (module docstring) on per-token ids: True where query ``q_idx`` may attend key ``kv_idx``.

    ``document_id`` / ``full_id`` / ``noise_id`` are int [L] tensors as in ``FlexMetadata`` (only equality and
    the sign of the ids matter); ``q_idx`` / ``kv_idx`` are integer tensors of broadcastable shapes, indices in
    [0, L). Returns a bool tensor of the broadcast shape. Numpy arrays work the same way (the rule only
    indexes, compares and combines). ``make_mask_mod`` is this rule over a ``FlexMetadata``;
    ``bagel-data inspect`` applies it to the ids it reads from flex or dense batches.
    """
    same_doc = document_id[q_idx] == document_id[kv_idx]
    bidirectional = (full_id[q_idx] == full_id[kv_idx]) & (full_id[q_idx] >= 0)
    hidden_noise = (noise_id[kv_idx] >= 0) & (noise_id[kv_idx] != noise_id[q_idx])
    return same_doc & ((q_idx >= kv_idx) | bidirectional) & ~hidden_noise


def _as_meta(batch_or_meta: Mapping[str, Any] | FlexMetadata, device: torch.device | str | None) -> FlexMetadata:
    if isinstance(batch_or_meta, FlexMetadata):
        if device is None or torch.device(device) == batch_or_meta.device:
            return batch_or_meta
        m = batch_or_meta
        return dataclasses.replace(m, document_id=m.document_id.to(device), full_id=m.full_id.to(device),
                                   noise_id=m.noise_id.to(device))
    return flex_metadata(batch_or_meta, device)


def _tile_counts(meta: FlexMetadata, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) int8 [1, 1, n, n] tile tables by interval arithmetic, without evaluating L² pairs.

    Under the mask rule a query ``q`` (document start ``ds``, split [ss, se)) sees exactly the non-noise keys of
    [ds, ss) plus its own split's part: [ss, q] (causal) or [ss, se) (full / noise). Rows are cut into segments
    at tile and split boundaries (S ≈ n + #splits); inside a segment those intervals share their ends (causal:
    grow by one per row), so the allowed pairs of a (segment, key tile) have a closed form and the work is
    O(S · n) for n = ceil(L / bs) tiles. Tiles past L count as blocked, as in ``create_block_mask``, whose
    tables these equal exactly (tested).
    """
    L, dev = meta.length, meta.device
    n = math.ceil(L / bs)
    ends = list(accumulate(meta.split_lens))
    cuts = sorted(set(range(0, L, bs)).union(e - k for e, k in zip(ends, meta.split_lens) if k))

    def t(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=dev)

    seg0, seg1 = t(cuts), t(cuts[1:] + [L])
    split_end = t(ends)
    j = torch.searchsorted(split_end, seg0, right=True)
    ss, se = (split_end - t(meta.split_lens))[j, None], split_end[j, None]
    causal = t([m == "causal" for m in meta.attn_modes])[j, None].bool()
    ds = t(meta.doc_bounds)[torch.searchsorted(t(meta.doc_bounds), seg0, right=True) - 1, None]
    rows = (seg1 - seg0)[:, None]
    visible = torch.cat([t([0]), torch.cumsum(meta.noise_id < 0, 0)])  # non-noise tokens in [0, x)
    k0 = torch.arange(0, n * bs, bs, device=dev)[None, :]
    k1 = torch.clamp(k0 + bs, max=L)
    a = torch.maximum(k0, ds)
    b = torch.maximum(torch.minimum(k1, ss), a)
    c = torch.maximum(k0, ss)
    width = torch.clamp(k1 - c, min=0)

    def causal_prefix(x: torch.Tensor) -> torch.Tensor:  # sum over t = 1..x of max(0, min(k1, t) - c)
        m = torch.clamp(torch.minimum(torch.maximum(x, c), k1) - c, min=0)
        return m * (m + 1) // 2 + torch.clamp(x - k1, min=0) * width

    own = torch.where(causal, causal_prefix(seg1[:, None]) - causal_prefix(seg0[:, None]),
                      rows * torch.clamp(torch.minimum(k1, se) - c, min=0))
    seg_counts = rows * (visible[b] - visible[a]) + own
    counts = torch.zeros((n, n), dtype=torch.int64, device=dev).index_add_(0, seg0 // bs, seg_counts)
    full = (counts == bs * bs).to(torch.int8)
    partial = ((counts > 0) & (counts < bs * bs)).to(torch.int8)
    return partial.view(1, 1, n, n), full.view(1, 1, n, n)


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense 0/1 block table -> (count per row, column indices with the set ones first), int32, like torch does."""
    dense = blocks.to(torch.int32)
    order = torch.argsort(dense, dim=-1, descending=True, stable=True)
    return dense.sum(dim=-1).to(torch.int32), order.to(torch.int32)


@functools.cache
def _compiled_create_block_mask() -> Callable[..., BlockMask]:
    return torch.compile(create_block_mask)


def block_mask(batch_or_meta: Mapping[str, Any] | FlexMetadata, device: torch.device | str | None = None, *,
               block_size: int = DEFAULT_BLOCK_SIZE, method: str = "intervals") -> BlockMask:
    """FlexAttention ``BlockMask`` (B=1, H=1, broadcast over heads) for the whole padded flex sequence.

    Args:
        batch_or_meta: a flex batch dict or its ``FlexMetadata``.
        device: target device (default: the metadata's device, CPU for a batch dict).
        block_size: tokens per sparse tile (query and key).
        method: ``"intervals"`` (default) counts each tile's allowed pairs in closed form (O((L/bs)²) work);
            its tensors equal ``create_block_mask``'s exactly (tested) at a fraction of the cost — eager
            ``create_block_mask`` evaluates all L² pairs (about 95 s for L = 36864 on 2 CPU cores).
            ``"create_block_mask"`` calls torch's builder eagerly; ``"compile"`` calls
            ``torch.compile(create_block_mask)`` (fast per call on GPU, but a long first compile).
    Returns:
        ``BlockMask`` with ``seq_lengths == (L, L)``, L = ``sum(sample_lens)``, and ``mask_mod`` attached.
    Raises:
        ValueError: invalid metadata (see ``flex_metadata``) or an unknown ``method``.
    """
    meta = _as_meta(batch_or_meta, device)
    mod, L = make_mask_mod(meta), meta.length
    if method == "intervals":
        partial, full = _tile_counts(meta, block_size)
        (kv_num, kv_idx), (full_num, full_idx) = _ordered(partial), _ordered(full)
        bm = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size, mask_mod=mod,
                                      seq_lengths=(L, L))
    elif method in ("create_block_mask", "compile"):
        builder = _compiled_create_block_mask() if method == "compile" else create_block_mask
        bm = builder(mod, None, None, L, L, device=meta.device, BLOCK_SIZE=block_size)
    else:
        raise ValueError(f"unknown block mask method {method!r} (intervals, create_block_mask or compile)")
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("BAGEL block mask (%s): L=%d, %d documents, sparsity %.1f%%", method, L,
                     len(meta.doc_bounds) - 1, bm.sparsity())
    return bm


def _finish(allowed: torch.Tensor, additive: bool, dtype: torch.dtype) -> torch.Tensor:
    if not additive:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def dense_mask(batch_or_meta: Mapping[str, Any] | FlexMetadata, device: torch.device | str | None = None, *,
               additive: bool = False, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Materialise the flex mask as one (L, L) tensor (rows = queries), padding included (see module docstring).

    Written split by split with slice assignments (O(#splits) ops, O(Σ document_len²) writes after one zero
    fill), so it is cheap on any device; it equals ``make_mask_mod`` evaluated on every pair (tested).

    Args:
        additive: False -> torch.bool, True = may attend (SDPA's boolean ``attn_mask``);
            True -> ``dtype`` with 0.0 = attend and -inf = blocked (the official dense-mode convention).
    Returns:
        (L, L) tensor on ``device``: L² bytes as bool, 4·L² as float32 (1.3 GiB / 5.1 GiB at L = 36864).
    Raises:
        ValueError: invalid metadata (see ``flex_metadata``).
    """
    meta = _as_meta(batch_or_meta, device)
    L, dev, bounds = meta.length, meta.device, meta.doc_bounds
    allowed = torch.zeros((L, L), dtype=torch.bool, device=dev)
    noise: list[tuple[int, int, int, int]] = []
    doc, s0 = 0, 0
    for length, mode in zip(meta.split_lens, meta.attn_modes):
        s1 = s0 + length
        while bounds[doc + 1] <= s0 and doc + 2 < len(bounds):
            doc += 1
        d0 = bounds[doc]
        if length:
            allowed[s0:s1, d0:s0] = True  # everything earlier in the document ...
            own = torch.ones((length, length), dtype=torch.bool, device=dev)
            allowed[s0:s1, s0:s1] = own.tril_() if mode == "causal" else own  # ... and its own split
            if mode == "noise":
                noise.append((d0, bounds[doc + 1], s0, s1))
        s0 = s1
    for d0, d1, n0, n1 in noise:  # ... except other splits' noised tokens
        allowed[d0:d1, n0:n1] = False
        allowed[n0:n1, n0:n1] = True
    return _finish(allowed, additive, dtype)


def block_diagonal_mask(nested_attention_masks: Sequence[torch.Tensor], pad_len: int = 0, *, additive: bool = False,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense-mode batch's per-sample masks laid out block-diagonally, plus the flex pad block.

    Args:
        nested_attention_masks: the official per-sample additive masks, float [L_i, L_i] (0.0 attend, -inf not).
        pad_len: tokens of trailing padding to append as flex mode does (a causal document of its own).
    Returns:
        (T, T) bool (True = attend) or additive ``dtype`` tensor, T = sum(L_i) + pad_len, on the masks' device.
        For the same pack this equals ``dense_mask`` of the flex batch (official: "semantically equal to the
        dense masks laid out block-diagonally", spec §7).
    Raises:
        ValueError: a non-square mask or a negative ``pad_len``.
    """
    if pad_len < 0:
        raise ValueError(f"pad_len must be >= 0, got {pad_len}")
    for m in nested_attention_masks:
        if m.dim() != 2 or m.shape[0] != m.shape[1]:
            raise ValueError(f"nested attention masks must be square (L_i, L_i), got {tuple(m.shape)}")
    dev = nested_attention_masks[0].device if nested_attention_masks else torch.device("cpu")
    total = sum(m.shape[0] for m in nested_attention_masks) + pad_len
    allowed = torch.zeros((total, total), dtype=torch.bool, device=dev)
    off = 0
    for m in nested_attention_masks:
        n = m.shape[0]
        allowed[off:off + n, off:off + n] = m == 0
        off += n
    allowed[off:, off:] = torch.ones((pad_len, pad_len), dtype=torch.bool, device=dev).tril_()
    return _finish(allowed, additive, dtype)


def to_device(batch: Any, device: torch.device | str, non_blocking: bool = True, *, pin_memory: bool = True) -> Any:
    """Move every tensor in ``batch`` (dicts, lists and tuples are walked) to ``device``; return a new batch.

    Mirrors the official ``SimpleCustomBatch.pin_memory()`` / ``.cuda()`` (``data/dataset_base.py`` L478–L620):
    tensors move (dense masks one by one), lists / tuples / ints / strs are kept — the very same objects when
    they hold no tensor (``sample_lens``, ``split_lens``, ``attn_modes``, ``batch_data_indexes``); a container
    that does is rebuilt (mappings as plain dicts). The top-level batch always comes back as a new dict.
    With a CUDA target, CPU tensors are pinned first (``pin_memory=True``) so ``non_blocking`` copies overlap;
    the caller must synchronise (or use the tensors on the current stream) before reading them on the host.
    Dtypes and shapes are unchanged. Raises whatever ``Tensor.to`` raises for an unavailable device.
    """
    dev = torch.device(device)
    pin = pin_memory and dev.type == "cuda"

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if pin and x.device.type == "cpu" and not x.is_pinned():
                x = x.pin_memory()
            return x.to(dev, non_blocking=non_blocking)
        if isinstance(x, Mapping):
            items = {k: move(v) for k, v in x.items()}
            return x if all(items[k] is v for k, v in x.items()) else items
        if isinstance(x, (list, tuple)):
            moved = [move(v) for v in x]
            if all(a is b for a, b in zip(moved, x)):
                return x
            return type(x)(*moved) if hasattr(x, "_fields") else type(x)(moved)
        return x

    return dict(move(batch)) if isinstance(batch, Mapping) else move(batch)
