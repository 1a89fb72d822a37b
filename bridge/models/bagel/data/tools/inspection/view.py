"""The per-token view of one pack's attention, read from flex split metadata or dense per-sample masks.

:func:`pack_view` turns a packed batch into one canonical :class:`PackView`, so both mask representations
of the same pack give the same view (and therefore the same picture); :func:`attention_allowed` answers
"may query q attend to key k" from a view with the official mask rule (``attention.mask_rule``, spec
``bagel_packer.md`` §7). Named *view* (not layout) to keep it apart from the packer's
``packing.sequence.PackLayout`` (the packer's knobs and special tokens).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...attention import ATTN_MODES, mask_rule

__all__ = ["PackView", "attention_allowed", "pack_view"]

logger = logging.getLogger(__name__)

#: Modality codes of :attr:`PackView.modality`.
TEXT, VIT, VAE = 0, 1, 2
#: Attention mode codes of :attr:`PackView.mode`: the index of the mode's name in ``attention.ATTN_MODES``.
CAUSAL, FULL, NOISE = (ATTN_MODES.index(name) for name in ("causal", "full", "noise"))
_MODE_CODE = {name: code for code, name in enumerate(ATTN_MODES)}


@dataclass
class PackView:
    """Canonical per-token description of one pack's attention (same for flex and dense batches).

    Token arrays are numpy, shape ``[tokens]``:

    * ``modality``: 0 text (incl. bos/eos/soi/eoi), 1 ViT patch, 2 VAE latent token (int8);
    * ``mode``: attention mode of the token's split, 0 causal, 1 full, 2 noise (int8);
    * ``sample``: index of the packed sample (document) holding the token, -1 for a token outside every
      sample (int32; see ``tokens``);
    * ``block``: id of the token's full/noise split, or -1 for tokens in causal splits (int32) — consecutive
      causal splits are merged because they attend identically.

    ``tokens`` is the number of packed positions (``len(packed_position_ids)``). It equals
    ``sequence_length`` except after the official packer's unclosed-split quirk (a dropped last video frame
    with ``split_end``), where a few positions belong to no sample (``sample == -1``; they attend nothing).
    ``sample_starts``/``sample_lens`` (python ints) cover ``[0, sequence_length)``; ``length`` is the drawn
    axis length (``max(max_num_tokens, tokens)``): positions ``>= tokens`` are padding.
    ``ce``/``mse`` are bool ``[tokens]`` marks of CE-loss positions and MSE (noised VAE) positions.

    The mode of a sample's *last* full/noise split is canonical: no later token of the sample exists to tell
    ``full`` from ``noise``, so it is ``noise`` iff it holds MSE tokens (a video frame with ``frame_delta``
    is ``full`` with MSE tokens in the packer; as a last split it attends identically either way).
    """

    sequence_length: int
    tokens: int
    length: int
    modality: np.ndarray
    mode: np.ndarray
    sample: np.ndarray
    block: np.ndarray
    sample_starts: list[int]
    sample_lens: list[int]
    ce: np.ndarray
    mse: np.ndarray
    source: str = ""  # "flex" or "dense": which representation the view was read from

    def same_attention(self, other: "PackView") -> bool:
        """True when both views describe the same attention pattern (``source`` is ignored)."""
        keys = ("sequence_length", "tokens", "length", "sample_lens", "modality", "mode", "sample", "block", "ce",
                "mse")
        return all(np.array_equal(getattr(self, k), getattr(other, k)) for k in keys)


def as_index(t: Any) -> np.ndarray:
    """A batch's index tensor/list (or None) as int64 numpy ``[n]`` (empty when None)."""
    if t is None:
        return np.zeros(0, dtype=np.int64)
    if isinstance(t, torch.Tensor):
        return t.detach().to(torch.int64).reshape(-1).numpy()
    return np.asarray(list(t), dtype=np.int64).reshape(-1)


def num_tokens(batch: Mapping[str, Any]) -> int:
    """Packed positions actually used (``sequence_length`` unless the unclosed-split quirk hid some)."""
    n = int(batch["sequence_length"])
    for key in ("packed_text_indexes", "packed_vit_token_indexes", "packed_vae_token_indexes"):
        idx = as_index(batch.get(key))
        if len(idx):
            n = max(n, int(idx.max()) + 1)
    return n


def take(arr: np.ndarray, pos: np.ndarray, n: int) -> np.ndarray:
    """``arr[pos]`` for positions below ``n``; positions ``>= n`` (padding) read element 0, or 0 if empty."""
    if not n:
        return np.zeros(len(pos), dtype=arr.dtype)
    return arr[np.where(pos < n, pos, 0)]


def _token_marks(batch: Mapping[str, Any], seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    modality = np.zeros(seq_len, dtype=np.int8)
    modality[as_index(batch.get("packed_vit_token_indexes"))] = VIT
    modality[as_index(batch.get("packed_vae_token_indexes"))] = VAE
    ce, mse = np.zeros(seq_len, dtype=bool), np.zeros(seq_len, dtype=bool)
    ce[as_index(batch.get("ce_loss_indexes"))] = True
    mse[as_index(batch.get("mse_loss_indexes"))] = True
    return modality, ce, mse


def _splits_from_flex(batch: Mapping[str, Any], seq_len: int) -> list[tuple[int, int, int]]:
    """(start, length, mode) of the real splits; the trailing pad split (and anything past seq_len) is dropped.

    Not ``attention.flex_metadata``: that refuses the official malformed packs (unpaired split_lens and
    attn_modes, an unclosed split, a negative pad) with ValueError so that no wrong mask is ever trained on,
    while inspection must still draw them (with a warning) to show what the packer produced.
    """
    if len(batch["split_lens"]) != len(batch["attn_modes"]):
        logger.warning("pack_view: %d split_lens but %d attn_modes (official unclosed-split quirk); pairing them "
                       "in order", len(batch["split_lens"]), len(batch["attn_modes"]))
    out, pos = [], 0
    for length, mode in zip(batch["split_lens"], batch["attn_modes"]):
        length = int(length)
        if pos >= seq_len or length <= 0:
            break
        if mode not in _MODE_CODE:
            raise ValueError(f"pack_view: unknown attention mode {mode!r} in attn_modes")
        out.append((pos, min(length, seq_len - pos), _MODE_CODE[mode]))
        pos += length
    if pos < seq_len:
        raise ValueError(f"pack_view: split_lens cover {pos} tokens, sequence_length is {seq_len}")
    return out


def _splits_from_dense(mask: torch.Tensor, start: int) -> list[tuple[int, int, int]]:
    """Recover (start, length, mode) splits of one sample from its additive mask ``[L, L]`` (0 = attend).

    Row i's last visible column is i for a causal token and the split's last token for a full/noise split,
    so runs of equal "last visible column" are the splits. A full/noise split is ``noise`` when a later row
    of the sample cannot see it (the sample's last split is labelled by :func:`pack_view`).
    Consecutive causal splits are indistinguishable in a dense mask (and attend identically): one run each.
    """
    allowed = mask == 0
    n = allowed.shape[0]
    # last True per row (every row sees itself), without an [L, L] int64 temporary: first True of the flipped row
    last = (n - 1 - torch.flip(allowed, dims=[1]).to(torch.uint8).argmax(dim=1)).numpy()
    out: list[tuple[int, int, int]] = []
    starts = np.flatnonzero(np.diff(last, prepend=-1)).tolist()  # runs of an equal last visible column
    for i, j in zip(starts, [s - 1 for s in starts[1:]] + [n - 1]):
        if j == i and last[i] == i:
            mode = CAUSAL
        elif last[i] != j:
            raise ValueError(f"pack_view: dense mask rows {i}..{j} do not form a split (last visible column "
                             f"{int(last[i])})")
        elif j + 1 < n:
            mode = NOISE if not bool(allowed[j + 1:, i].all()) else FULL
        else:
            mode = FULL  # the sample's last split: relabelled canonically by pack_view
        out.append((start + i, j - i + 1, mode))
    return out


def pack_view(batch: Mapping[str, Any], max_num_tokens: int | None = None) -> PackView:
    """The canonical :class:`PackView` of a packed batch (flex or dense).

    ``batch`` is one packed batch as the packer yields it (spec §8). Flex batches are read from
    ``split_lens``/``attn_modes``, dense batches from ``nested_attention_masks`` (``[L_i, L_i]`` float, 0 or
    -inf). ``max_num_tokens`` is the packed budget drawn on the axes (flex batches carry it as
    ``sum(split_lens)``; dense batches need it passed, otherwise the axis ends at ``sequence_length``).

    Raises ``ValueError`` when the batch carries neither representation or they do not cover
    ``sequence_length``.
    """
    seq_len = int(batch["sequence_length"])
    nreal = len(batch["batch_data_indexes"])  # packed samples: sample_lens may end with a flex pad entry
    sample_lens = [int(x) for x in batch["sample_lens"][:nreal]]
    if sum(sample_lens) != seq_len:
        raise ValueError(f"pack_view: sample_lens {sample_lens} do not sum to sequence_length {seq_len}")
    tokens = num_tokens(batch)
    if tokens != seq_len:
        logger.warning("pack_view: %d packed positions but sequence_length %d (official unclosed-split quirk): "
                       "%d positions belong to no sample", tokens, seq_len, tokens - seq_len)
    modality, ce, mse = _token_marks(batch, tokens)
    starts = [int(s) for s in np.cumsum([0] + sample_lens[:-1])] if sample_lens else []
    if "split_lens" in batch and "attn_modes" in batch:
        splits, source = _splits_from_flex(batch, seq_len), "flex"
        if max_num_tokens is None:
            max_num_tokens = int(sum(int(x) for x in batch["split_lens"]))
    elif "nested_attention_masks" in batch:
        masks = batch["nested_attention_masks"]
        if len(masks) != nreal:
            raise ValueError(f"pack_view: {len(masks)} dense masks for {nreal} samples")
        splits, source = [], "dense"
        for s, (start, m) in enumerate(zip(starts, masks)):
            if tuple(m.shape) != (sample_lens[s], sample_lens[s]):
                raise ValueError(f"pack_view: dense mask {s} has shape {tuple(m.shape)}, sample length "
                                 f"{sample_lens[s]}")
            splits.extend(_splits_from_dense(m, start))
    else:
        raise ValueError("pack_view: batch has neither split_lens/attn_modes (flex) nor nested_attention_masks")
    sample = np.full(tokens, -1, dtype=np.int32)
    sample[:seq_len] = np.repeat(np.arange(nreal, dtype=np.int32), sample_lens)
    mode = np.zeros(tokens, dtype=np.int8)
    block = np.full(tokens, -1, dtype=np.int32)
    ends = {s + n for s, n in zip(starts, sample_lens)}
    for b, (start, length, m) in enumerate(splits):
        if m != CAUSAL and start + length in ends:  # a sample's last split: full and noise attend alike
            m = NOISE if bool(mse[start:start + length].any()) else FULL
        mode[start:start + length] = m
        if m != CAUSAL:
            block[start:start + length] = b
    # Canonical block ids 0, 1, ... in order of position (split numbers grow with position, so the sorted
    # unique ids are in that order), independent of how the causal splits around them were cut.
    _, inverse = np.unique(block[block >= 0], return_inverse=True)
    block[block >= 0] = inverse.astype(np.int32)
    length = max(int(max_num_tokens) if max_num_tokens is not None else tokens, tokens)
    return PackView(seq_len, tokens, length, modality, mode, sample, block, starts, sample_lens, ce, mse, source)


def attention_allowed(view: PackView, q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Boolean ``[len(q), len(k)]``: may query position q attend to key position k (spec §7).

    q and k are absolute positions (int arrays). The rule is ``attention.mask_rule`` (the one FlexAttention
    trains with) on the view's ids: document = ``sample``, full split = ``block``, noise split = ``block``
    where ``mode`` is noise. Padding (``>= tokens``) and positions outside every sample are outside that
    rule's documents here: they attend nothing and are attended by nothing.
    """
    q = np.asarray(q, dtype=np.int64)
    k = np.asarray(k, dtype=np.int64)
    n = view.tokens
    if not n:  # an empty pack: padding only
        return np.zeros((len(q), len(k)), dtype=bool)
    qc, kc = np.where(q < n, q, 0), np.where(k < n, k, 0)  # padding reads position 0, then is masked out
    qr, kr = (q < n) & (view.sample[qc] >= 0), (k < n) & (view.sample[kc] >= 0)
    # numpy arrays, not torch tensors: the rule only indexes and compares, and torch's per-op thread start-up
    # made a 512×512 call 4-40x slower on 2 shared CPU cores.
    noise = np.where(view.mode == NOISE, view.block, -1)
    ok = mask_rule(view.sample, view.block, noise, qc[:, None], kc[None, :])
    return ok & qr[:, None] & kr[None, :]
