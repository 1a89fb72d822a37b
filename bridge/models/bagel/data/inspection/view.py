"""Look at packed batches before training: per-batch numbers and one picture of each pack's attention.

``bagel-data inspect`` (see ``cli.py``) builds the job's real loader with ``build_bagel_train_loader`` from
the job YAML, pulls N batches and, for each, reports what went into the pack and draws its attention layout.

The pieces are usable on their own:

* :func:`pack_layout` turns a packed batch (flex split metadata *or* dense per-sample masks) into one
  canonical per-token description (:class:`PackLayout`), so both mask representations of the same pack give
  the same layout and therefore the same picture.
* :func:`attention_allowed` answers "may query q attend to key k" from a layout (the official mask rule,
  spec ``bagel_packer.md`` §7), for any index arrays.
* :func:`summarize_batch` counts tokens per sample and modality, loss targets, fill and padding.
* :func:`render_pack` draws the picture (Pillow; deterministic: same batch and arguments, same pixels).

Module name: ``inspection`` (not ``inspect``) so that it never shadows the standard library module.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

__all__ = [
    "BatchSummary",
    "PackLayout",
    "attention_allowed",
    "canvas_size",
    "format_batch_summary",
    "pack_layout",
    "render_pack",
    "run_inspect",
    "sampled_positions",
    "summarize_batch",
]

logger = logging.getLogger(__name__)

TEXT, VIT, VAE = 0, 1, 2
MODALITIES = ("text", "ViT", "VAE")
CAUSAL, FULL, NOISE = 0, 1, 2
MODES = ("causal", "full", "noise")
_MODE_CODE = {name: code for code, name in enumerate(MODES)}

#: Colour of an attended (query, key) cell by the key's (modality, attention mode).
PALETTE: dict[tuple[int, int], tuple[int, int, int]] = {
    (TEXT, CAUSAL): (52, 101, 164),    # text in a causal split: blue
    (TEXT, FULL): (114, 159, 207),     # soi/eoi around a ViT or clean VAE image: light blue
    (TEXT, NOISE): (173, 127, 168),    # soi/eoi around a noised VAE target: mauve
    (VIT, CAUSAL): (78, 154, 6),       # (not produced by the packer; kept so every pair has a colour)
    (VIT, FULL): (115, 210, 22),       # ViT image tokens: green
    (VIT, NOISE): (78, 154, 6),
    (VAE, CAUSAL): (245, 121, 0),
    (VAE, FULL): (245, 121, 0),        # clean VAE latent (conditioning image): orange
    (VAE, NOISE): (204, 0, 0),         # noised VAE latent (diffusion target, MSE): red
}
BLOCKED = (255, 255, 255)              # same sample, attention blocked
OTHER_SAMPLE = (238, 238, 236)         # different samples (documents): never attend
PADDING = (186, 189, 182)              # flex padding up to max_num_tokens / unused budget in dense mode
ORPHAN = (255, 0, 255)                 # a position outside every sample (official unclosed-split quirk)
BOUNDARY = (46, 52, 54)
CE_MARK = (92, 53, 102)
MSE_MARK = (204, 0, 0)

# Picture geometry (pixels). The canvas size depends only on ``size`` (see canvas_size).
_MARGIN = 12
_TITLE_H = 18
_BAR = 8
_TICK = 4
_GAP = 2
_LEGEND_H = 52
_THUMB_H = 60
_THUMB_LABEL_H = 14
_THUMB_ROWS = 2


@dataclass
class PackLayout:
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
    source: str = ""  # "flex" or "dense": which representation the layout was read from

    def same_attention(self, other: "PackLayout") -> bool:
        """True when both layouts describe the same attention pattern (``source`` is ignored)."""
        return (self.sequence_length == other.sequence_length and self.tokens == other.tokens
                and self.length == other.length
                and self.sample_lens == other.sample_lens
                and all(np.array_equal(getattr(self, k), getattr(other, k))
                        for k in ("modality", "mode", "sample", "block", "ce", "mse")))


def _as_index(t: Any) -> np.ndarray:
    if t is None:
        return np.zeros(0, dtype=np.int64)
    if isinstance(t, torch.Tensor):
        return t.detach().to(torch.int64).reshape(-1).numpy()
    return np.asarray(list(t), dtype=np.int64).reshape(-1)


def _num_real_samples(batch: Mapping[str, Any]) -> int:
    return len(batch["batch_data_indexes"])


def _num_tokens(batch: Mapping[str, Any]) -> int:
    """Packed positions actually used (``sequence_length`` unless the unclosed-split quirk hid some)."""
    n = int(batch["sequence_length"])
    for key in ("packed_text_indexes", "packed_vit_token_indexes", "packed_vae_token_indexes"):
        idx = _as_index(batch.get(key))
        if len(idx):
            n = max(n, int(idx.max()) + 1)
    return n


def _token_marks(batch: Mapping[str, Any], seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    modality = np.zeros(seq_len, dtype=np.int8)
    modality[_as_index(batch.get("packed_vit_token_indexes"))] = VIT
    modality[_as_index(batch.get("packed_vae_token_indexes"))] = VAE
    ce = np.zeros(seq_len, dtype=bool)
    ce[_as_index(batch.get("ce_loss_indexes"))] = True
    mse = np.zeros(seq_len, dtype=bool)
    mse[_as_index(batch.get("mse_loss_indexes"))] = True
    return modality, ce, mse


def _splits_from_flex(batch: Mapping[str, Any], seq_len: int) -> list[tuple[int, int, int]]:
    """(start, length, mode) of the real splits; the trailing pad split (and anything past seq_len) is dropped."""
    if len(batch["split_lens"]) != len(batch["attn_modes"]):
        logger.warning("pack_layout: %d split_lens but %d attn_modes (official unclosed-split quirk); pairing them "
                       "in order", len(batch["split_lens"]), len(batch["attn_modes"]))
    out, pos = [], 0
    for length, mode in zip(batch["split_lens"], batch["attn_modes"]):
        length = int(length)
        if pos >= seq_len or length <= 0:
            break
        if mode not in _MODE_CODE:
            raise ValueError(f"pack_layout: unknown attention mode {mode!r} in attn_modes")
        out.append((pos, min(length, seq_len - pos), _MODE_CODE[mode]))
        pos += length
    if pos < seq_len:
        raise ValueError(f"pack_layout: split_lens cover {pos} tokens, sequence_length is {seq_len}")
    return out


def _splits_from_dense(mask: torch.Tensor, start: int) -> list[tuple[int, int, int]]:
    """Recover (start, length, mode) splits of one sample from its additive mask ``[L, L]`` (0 = attend).

    Row i's last visible column is i for a causal token and the split's last token for a full/noise split,
    so runs of equal "last visible column" are the splits. A full/noise split is ``noise`` when a later row
    of the sample cannot see it (the sample's last split is labelled by :func:`pack_layout`).
    Consecutive causal splits are indistinguishable in a dense mask (and attend identically): one run each.
    """
    allowed = mask == 0
    n = allowed.shape[0]
    # last True per row (every row sees itself), without an [L, L] int64 temporary: first True of the flipped row
    last = (n - 1 - torch.flip(allowed, dims=[1]).to(torch.uint8).argmax(dim=1)).numpy()
    out: list[tuple[int, int, int]] = []
    i = 0
    while i < n:
        j = i
        while j + 1 < n and last[j + 1] == last[i]:
            j += 1
        if j == i and last[i] == i:
            mode = CAUSAL
        elif last[i] != j:
            raise ValueError(f"pack_layout: dense mask rows {i}..{j} do not form a split (last visible column "
                             f"{int(last[i])})")
        elif j + 1 < n:
            mode = NOISE if not bool(allowed[j + 1:, i].all()) else FULL
        else:
            mode = FULL  # the sample's last split: relabelled canonically by pack_layout
        out.append((start + i, j - i + 1, mode))
        i = j + 1
    return out


def pack_layout(batch: Mapping[str, Any], max_num_tokens: int | None = None) -> PackLayout:
    """The canonical :class:`PackLayout` of a packed batch (flex or dense).

    ``batch`` is one packed batch as the packer yields it (spec §8). Flex batches are read from
    ``split_lens``/``attn_modes``, dense batches from ``nested_attention_masks`` (``[L_i, L_i]`` float, 0 or
    -inf). ``max_num_tokens`` is the packed budget drawn on the axes (flex batches carry it as
    ``sum(split_lens)``; dense batches need it passed, otherwise the axis ends at ``sequence_length``).

    Raises ``ValueError`` when the batch carries neither representation or they do not cover
    ``sequence_length``.
    """
    seq_len = int(batch["sequence_length"])
    nreal = _num_real_samples(batch)
    sample_lens = [int(x) for x in batch["sample_lens"][:nreal]]
    if sum(sample_lens) != seq_len:
        raise ValueError(f"pack_layout: sample_lens {sample_lens} do not sum to sequence_length {seq_len}")
    tokens = _num_tokens(batch)
    if tokens != seq_len:
        logger.warning("pack_layout: %d packed positions but sequence_length %d (official unclosed-split quirk): "
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
            raise ValueError(f"pack_layout: {len(masks)} dense masks for {nreal} samples")
        splits, source = [], "dense"
        for s, (start, m) in enumerate(zip(starts, masks)):
            if tuple(m.shape) != (sample_lens[s], sample_lens[s]):
                raise ValueError(f"pack_layout: dense mask {s} has shape {tuple(m.shape)}, sample length "
                                 f"{sample_lens[s]}")
            splits.extend(_splits_from_dense(m, start))
    else:
        raise ValueError("pack_layout: batch has neither split_lens/attn_modes (flex) nor nested_attention_masks")
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
    return PackLayout(seq_len, tokens, length, modality, mode, sample, block, starts, sample_lens, ce, mse, source)


def _take(arr: np.ndarray, pos: np.ndarray, n: int) -> np.ndarray:
    """``arr[pos]`` for positions below ``n``; positions ``>= n`` (padding) read element 0, or 0 if empty."""
    if not n:
        return np.zeros(len(pos), dtype=arr.dtype)
    return arr[np.where(pos < n, pos, 0)]


def attention_allowed(layout: PackLayout, q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Boolean ``[len(q), len(k)]``: may query position q attend to key position k (spec §7).

    q and k are absolute positions (int arrays); padding (``>= tokens``) and positions outside every sample
    attend nothing and are attended by nothing here. The rule: same sample, and (k <= q or both in the same
    full/noise split), and k is not in a *different* noise split.
    """
    q = np.asarray(q, dtype=np.int64)
    k = np.asarray(k, dtype=np.int64)
    n = layout.tokens
    qc, kc = np.where(q < n, q, 0), np.where(k < n, k, 0)
    qs, ks = _take(layout.sample, q, n), _take(layout.sample, k, n)
    qr, kr = (q < n) & (qs >= 0), (k < n) & (ks >= 0)
    same_sample = qs[:, None] == ks[None, :]
    qb, kb = _take(layout.block, q, n)[:, None], _take(layout.block, k, n)[None, :]
    same_block = (qb == kb) & (kb >= 0)
    key_noise = (_take(layout.mode, k, n) == NOISE)[None, :]
    ok = same_sample & ((kc[None, :] <= qc[:, None]) | same_block) & ~(key_noise & ~same_block)
    return ok & qr[:, None] & kr[None, :]


# -- numbers -----------------------------------------------------------------------------------------------


@dataclass
class BatchSummary:
    """What one packed batch holds (all counts are tokens unless named otherwise).

    ``samples``: one dict per packed sample in pack order with ``group``, ``data_indexes``, ``tokens``,
    ``text``, ``vit``, ``vae``, ``ce``, ``mse``. ``totals``: the same token keys summed over the pack.
    ``fill`` = sequence_length / max_num_tokens (1.0 = full); ``padding`` = max_num_tokens - sequence_length
    (0 when a pack exceeds the budget). ``totals`` count every position of the batch's tensors; per-sample
    counts leave out ``outside_samples`` positions that lie past ``sum(sample_lens)`` (the official
    unclosed-split quirk; normally 0). ``groups``: samples per group. ``stats``: the loader's cumulative
    ``stats()`` after this batch (``buffer_len``, ``drops``, ``consumed``), empty when unknown.
    """

    index: int
    sequence_length: int
    max_num_tokens: int
    samples: list[dict[str, Any]]
    totals: dict[str, int]
    groups: dict[str, int]
    fill: float
    padding: int
    outside_samples: int = 0
    stats: dict[str, Any] = field(default_factory=dict)


def _count_per_sample(positions: np.ndarray, bounds: np.ndarray, n: int, seq_len: int) -> list[int]:
    positions = positions[positions < seq_len]  # positions outside every sample (unclosed-split quirk) excluded
    which = np.searchsorted(bounds, positions, side="right") - 1
    return np.bincount(which, minlength=n)[:n].astype(int).tolist() if n else []


def summarize_batch(batch: Mapping[str, Any], max_num_tokens: int, *, batch_index: int = 0,
                    stats: Mapping[str, Any] | None = None) -> BatchSummary:
    """Per-sample and per-modality token counts of one packed batch (see :class:`BatchSummary`)."""
    seq_len = int(batch["sequence_length"])
    nreal = _num_real_samples(batch)
    lens = [int(x) for x in batch["sample_lens"][:nreal]]
    bounds = np.cumsum([0] + lens[:-1]).astype(np.int64) if lens else np.zeros(0, dtype=np.int64)
    keys = {"text": "packed_text_indexes", "vit": "packed_vit_token_indexes", "vae": "packed_vae_token_indexes",
            "ce": "ce_loss_indexes", "mse": "mse_loss_indexes"}
    index = {k: _as_index(batch.get(key)) for k, key in keys.items()}
    per = {k: _count_per_sample(v, bounds, nreal, seq_len) for k, v in index.items()}
    samples, groups = [], {}
    for i, d in enumerate(batch["batch_data_indexes"]):
        group = d.get("dataset_name", "?") if isinstance(d, Mapping) else "?"
        groups[group] = groups.get(group, 0) + 1
        samples.append({"group": group, "data_indexes": d.get("data_indexes") if isinstance(d, Mapping) else d,
                        "tokens": lens[i], **{k: v[i] for k, v in per.items()}})
    totals = {"tokens": seq_len, **{k: len(v) for k, v in index.items()}}
    return BatchSummary(index=batch_index, sequence_length=seq_len, max_num_tokens=int(max_num_tokens),
                        samples=samples, totals=totals, groups=groups,
                        fill=seq_len / max_num_tokens if max_num_tokens else 0.0,
                        padding=max(int(max_num_tokens) - seq_len, 0),
                        outside_samples=_num_tokens(batch) - seq_len, stats=dict(stats or {}))


def format_batch_summary(s: BatchSummary, previous_drops: Mapping[str, int] | None = None) -> str:
    """Plain-text report of one batch: a header line, one line per sample, buffer and drops."""
    t = s.totals
    lines = [f"batch {s.index}: tokens {t['tokens']}/{s.max_num_tokens} fill {100 * s.fill:.1f}% padding "
             f"{s.padding} | text {t['text']} vit {t['vit']} vae {t['vae']} | ce {t['ce']} mse {t['mse']} | "
             f"samples {len(s.samples)} " + " ".join(f"{g}={n}" for g, n in sorted(s.groups.items()))]
    if s.outside_samples:
        lines.append(f"  WARNING {s.outside_samples} packed positions lie outside sample_lens (unclosed split)")
    for i, smp in enumerate(s.samples):
        lines.append(f"  sample {i:>2} {smp['group']:<14} tokens {smp['tokens']:>6} text {smp['text']:>6} "
                     f"vit {smp['vit']:>6} vae {smp['vae']:>6} ce {smp['ce']:>6} mse {smp['mse']:>6}  "
                     f"data_indexes {smp['data_indexes']}")
    st = s.stats
    if st:
        drops = dict(st.get("drops") or {})
        prev = dict(previous_drops or {})
        new = {k: v - prev.get(k, 0) for k, v in drops.items() if v - prev.get(k, 0)}
        lines.append(f"  buffer {st.get('buffer_len', '?')} | consumed {st.get('consumed', '?')} | drops so far "
                     f"{drops or 'none'}" + (f" (this batch: {new})" if new else ""))
    return "\n".join(lines)


# -- picture -----------------------------------------------------------------------------------------------


def canvas_size(size: int = 512) -> tuple[int, int]:
    """(width, height) in pixels of the picture :func:`render_pack` draws for a ``size``-pixel matrix."""
    width = _MARGIN + _BAR + _GAP + size + _MARGIN
    height = (_MARGIN + _TITLE_H + _BAR + _GAP + size + _MARGIN + _LEGEND_H
              + _THUMB_ROWS * (_THUMB_H + _THUMB_LABEL_H) + _MARGIN)
    return width, height


def _font(px: int = 11) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=px)
    except TypeError:  # Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


#: Runs shorter than this (the 1-token soi/eoi around images) are not favoured when choosing a pixel's token.
_MIN_FAVOURED_RUN = 4


def _runs(layout: PackLayout) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) of the maximal runs of equal (sample, split, mode, modality), padding as one run."""
    keys = np.stack([layout.sample, layout.block, layout.mode, layout.modality]).astype(np.int64)
    change = np.flatnonzero((keys[:, 1:] != keys[:, :-1]).any(axis=0)) + 1
    if layout.tokens:
        starts = np.concatenate([[0], change]).astype(np.int64)
        ends = np.concatenate([starts[1:], [layout.tokens]]).astype(np.int64)
    else:  # an empty pack: padding only
        starts = ends = np.zeros(0, dtype=np.int64)
    if layout.length > layout.tokens:
        starts, ends = np.append(starts, layout.tokens), np.append(ends, layout.length)
    return starts, ends - starts


def sampled_positions(layout: PackLayout, pixels: int) -> np.ndarray:
    """The packed position drawn at each of ``pixels`` pixels along an axis of ``layout.length`` positions.

    Pixel p covers positions ``[p·L/pixels, (p+1)·L/pixels)``. It shows the position at its centre, unless
    it also overlaps a run (see :func:`_runs`) that is shorter than the centre's run and at least
    ``_MIN_FAVOURED_RUN`` tokens long: then the middle of the shortest such run's overlap. A 30-token
    caption between 1000-token images thus stays visible at 40 tokens per pixel. Each drawn cell is a real
    (query, key) pair, so the attention shown is exact for the sampled positions. Depends only on the
    layout: flex and dense give the same positions.
    """
    length = layout.length
    starts, lens = _runs(layout)
    ends = starts + lens
    out = np.empty(pixels, dtype=np.int64)
    for p in range(pixels):
        a = (p * length) // pixels
        b = max(a + 1, ((p + 1) * length) // pixels)
        centre = min(max((2 * p + 1) * length // (2 * pixels), a), b - 1)
        out[p] = centre
        lo = int(np.searchsorted(ends, a, side="right"))
        hi = int(np.searchsorted(starts, b, side="left"))
        if hi - lo <= 1:
            continue
        cand = np.arange(lo, hi)
        cand = cand[lens[cand] >= _MIN_FAVOURED_RUN]
        if not len(cand):
            continue
        best = int(cand[np.argmin(lens[cand])])  # argmin: the earliest among equally short runs
        own = int(np.searchsorted(ends, centre, side="right"))
        if lens[best] < lens[own]:
            s, e = max(starts[best], a), min(ends[best], b)
            out[p] = (s + e - 1) // 2
    return out


def _token_colours(layout: PackLayout, pos: np.ndarray) -> np.ndarray:
    lut = np.array([PALETTE[(m, a)] for m in range(3) for a in range(3)], dtype=np.uint8)
    real = pos < layout.tokens
    n = layout.tokens
    cat = _take(layout.modality, pos, n).astype(np.int64) * 3 + _take(layout.mode, pos, n).astype(np.int64)
    out = lut[cat]
    out[real & (_take(layout.sample, pos, n) < 0)] = ORPHAN
    out[~real] = PADDING
    return out


def _matrix(layout: PackLayout, size: int) -> np.ndarray:
    pos = sampled_positions(layout, size)
    ok = attention_allowed(layout, pos, pos)
    real = pos < layout.tokens
    smp = _take(layout.sample, pos, layout.tokens)
    img = np.empty((size, size, 3), dtype=np.uint8)
    img[:] = OTHER_SAMPLE
    img[smp[:, None] == smp[None, :]] = BLOCKED
    keys = np.broadcast_to(_token_colours(layout, pos)[None, :, :], (size, size, 3))
    img[ok] = keys[ok]
    orphan = real & (smp < 0)
    img[orphan[:, None] | orphan[None, :]] = ORPHAN
    img[~real[:, None] | ~real[None, :]] = PADDING
    return img


def _to_uint8(img: torch.Tensor, mean: float, std: float) -> np.ndarray:
    """[3, H, W] normalised float -> [H', W', 3] uint8 (x * std + mean, clipped to [0, 1]).

    Every k-th pixel is kept first (k chosen so H' stays >= 2 thumbnail heights): thumbnails only.
    """
    step = max(1, img.shape[-2] // (2 * _THUMB_H))
    x = (img[:, ::step, ::step].detach().to(torch.float32) * std + mean).clamp(0.0, 1.0)
    return (x * 255.0 + 0.5).to(torch.uint8).permute(1, 2, 0).numpy()


def _vit_images(batch: Mapping[str, Any], patch: int, side: int) -> list[np.ndarray | None]:
    """Each ViT image's normalised pixels ``[3, H, W]`` rebuilt from its patches, or None if not possible."""
    if "packed_vit_tokens" not in batch:
        return []
    tokens = batch["packed_vit_tokens"]
    ids = _as_index(batch["packed_vit_position_ids"])
    out: list[Any] = []
    start = 0
    for n in _as_index(batch["vit_token_seqlens"]).tolist():
        chunk, pid = tokens[start:start + n], ids[start:start + n]
        start += n
        rows = np.unique(pid // side, return_inverse=True)
        cols = np.unique(pid % side, return_inverse=True)
        nh, nw = len(rows[0]), len(cols[0])
        if nh * nw != n or chunk.shape[-1] != patch * patch * 3:
            out.append(None)
            continue
        grid = torch.zeros(nh, nw, patch, patch, 3, dtype=torch.float32)
        grid[torch.as_tensor(rows[1]), torch.as_tensor(cols[1])] = chunk.to(torch.float32).reshape(n, patch, patch, 3)
        out.append(grid.permute(4, 0, 2, 1, 3).reshape(3, nh * patch, nw * patch))
    return out


def _thumbnails(batch: Mapping[str, Any], vae_stride: int, vit_patch: int, vit_side: int,
                vae_norm: tuple[float, float], vit_norm: tuple[float, float]) -> list[tuple[str, np.ndarray]]:
    out: list[tuple[str, np.ndarray]] = []
    if "padded_images" in batch:
        ts = batch.get("packed_timesteps")
        start = 0
        for i, (h, w) in enumerate(batch["patchified_vae_latent_shapes"]):
            n = int(h) * int(w)
            noised = ts is not None and bool(torch.isfinite(ts[start:start + n]).any())
            start += n
            img = batch["padded_images"][i][:, :int(h) * vae_stride, :int(w) * vae_stride]
            out.append((f"VAE{i}{' target' if noised else ''}", _to_uint8(img, *vae_norm)))
    for i, img in enumerate(_vit_images(batch, vit_patch, vit_side)):
        if img is not None:
            out.append((f"ViT{i}", _to_uint8(img, *vit_norm)))
    return out


def render_pack(batch: Mapping[str, Any], *, max_num_tokens: int | None = None, size: int = 512, title: str = "",
                vae_image_downsample: int = 16, vit_patch_size: int = 14, max_num_patch_per_side: int = 70,
                vae_norm: tuple[float, float] = (0.5, 0.5), vit_norm: tuple[float, float] = (0.5, 0.5)
                ) -> Image.Image:
    """Draw one pack: the attention layout plus a thumbnail strip of its images; returns an RGB image.

    The matrix has the packed sequence (``max(max_num_tokens, tokens)`` positions) on both axes, queries
    down, keys across, one sampled position per pixel (:func:`sampled_positions`). An attended cell has the
    key's colour (:data:`PALETTE`: modality × attention mode); white = blocked inside a sample, light grey =
    another sample, grey = padding. The bars on the top and left show each position's colour, dark ticks
    through them mark sample boundaries, and the thin strip under the top bar marks CE (purple) and MSE
    (red) positions.
    Thumbnails: VAE images cropped to their latent grid (``h·ds × w·ds`` px) and ViT images rebuilt from
    patches, de-normalised with ``(mean, std)`` (``x * std + mean``); those that do not fit are counted.

    Deterministic (no clock, no RNG). Canvas size: :func:`canvas_size` (``size``). Raises ``ValueError`` as
    :func:`pack_layout` does.
    """
    layout = pack_layout(batch, max_num_tokens)
    width, height = canvas_size(size)
    canvas = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    font = _font()
    x0 = _MARGIN + _BAR + _GAP
    y0 = _MARGIN + _TITLE_H + _BAR + _GAP
    head = (f"{len(layout.sample_lens)} samples, {layout.sequence_length}/{layout.length} tokens "
            f"({100.0 * layout.sequence_length / max(layout.length, 1):.1f}% full)")
    draw.text((_MARGIN, _MARGIN), f"{title}  {head}" if title else head, fill=BOUNDARY, font=font)
    canvas.paste(Image.fromarray(_matrix(layout, size), "RGB"), (x0, y0))
    pos = sampled_positions(layout, size)
    colours = _token_colours(layout, pos)
    bar = Image.fromarray(np.ascontiguousarray(np.broadcast_to(colours[None], (_BAR, size, 3))), "RGB")
    canvas.paste(bar, (x0, y0 - _GAP - _BAR))
    canvas.paste(bar.transpose(Image.Transpose.ROTATE_270).transpose(Image.Transpose.FLIP_LEFT_RIGHT),
                 (x0 - _GAP - _BAR, y0))
    real = pos < layout.tokens
    loss = np.full((size, 3), 255, dtype=np.uint8)
    loss[real & _take(layout.ce, pos, layout.tokens)] = CE_MARK
    loss[real & _take(layout.mse, pos, layout.tokens)] = MSE_MARK
    canvas.paste(Image.fromarray(np.ascontiguousarray(np.broadcast_to(loss[None], (2, size, 3))), "RGB"),
                 (x0, y0 - _GAP))
    # sample boundaries: dark ticks through the bars (outside the matrix, so no cell is covered)
    edges = sorted(set(layout.sample_starts[1:]) | {layout.sequence_length})
    for p in np.unique(np.searchsorted(pos, np.asarray(edges, dtype=np.int64), side="left")).tolist():
        if 0 < p < size:
            draw.line([x0 + p, y0 - _GAP - _BAR - _TICK, x0 + p, y0 - _GAP - 1], fill=BOUNDARY)
            draw.line([x0 - _GAP - _BAR - _TICK, y0 + p, x0 - _GAP - 1, y0 + p], fill=BOUNDARY)
    # legend
    ly = y0 + size + _MARGIN
    items = [("text causal", PALETTE[(TEXT, CAUSAL)]), ("soi/eoi", PALETTE[(TEXT, FULL)]),
             ("soi/eoi noised", PALETTE[(TEXT, NOISE)]), ("ViT full", PALETTE[(VIT, FULL)]),
             ("VAE clean", PALETTE[(VAE, FULL)]), ("VAE noised", PALETTE[(VAE, NOISE)]),
             ("blocked", BLOCKED), ("other sample", OTHER_SAMPLE), ("padding", PADDING),
             ("CE", CE_MARK), ("MSE", MSE_MARK)]
    per_row = 4
    col_w = max((width - 2 * _MARGIN) // per_row, 1)
    for i, (name, colour) in enumerate(items):
        x, y = _MARGIN + (i % per_row) * col_w, ly + (i // per_row) * 16
        draw.rectangle([x, y + 2, x + 9, y + 11], fill=colour, outline=BOUNDARY)
        draw.text((x + 13, y), name, fill=BOUNDARY, font=font)
    # thumbnails
    ty = ly + _LEGEND_H
    x, row = _MARGIN, 0
    thumbs = _thumbnails(batch, vae_image_downsample, vit_patch_size, max_num_patch_per_side, vae_norm, vit_norm)
    shown = 0
    for name, arr in thumbs:
        h, w = arr.shape[:2]
        tw = min(max(1, int(round(w * _THUMB_H / h))), width - 2 * _MARGIN - 60)
        slot = max(tw, int(draw.textlength(name, font=font)) + 2)
        last_row = row == _THUMB_ROWS - 1
        more = len(thumbs) - shown - 1  # thumbnails after this one: keep room for the "+k more" note
        if x + slot > width - _MARGIN - (60 if more and last_row else 0):
            if last_row or x == _MARGIN:
                break
            x, row = _MARGIN, row + 1
            ty += _THUMB_H + _THUMB_LABEL_H
            if x + slot > width - _MARGIN - (60 if more else 0):
                break
        canvas.paste(Image.fromarray(arr, "RGB").resize((tw, _THUMB_H), Image.Resampling.BILINEAR), (x, ty))
        draw.text((x, ty + _THUMB_H), name, fill=BOUNDARY, font=font)
        x += slot + 6
        shown += 1
    if shown < len(thumbs):
        draw.text((x, ty + _THUMB_H // 2), f"+{len(thumbs) - shown} more", fill=BOUNDARY, font=font)
    return canvas


# -- the command -------------------------------------------------------------------------------------------


def _norms(cfg_data: Any) -> tuple[tuple[float, float], tuple[float, float]]:
    """(mean, std) for VAE and ViT images from the groups' transform args (0.5/0.5 when unset or mixed)."""
    from .transforms import ImageTransform

    vae, vit = set(), set()
    for g in cfg_data.load_groups():
        grp = g.group
        if grp.image_transform_args:
            t = ImageTransform(**grp.image_transform_args)
            (vit if grp.name == "vlm_sft" else vae).add((t.image_mean, t.image_std))
        if grp.vit_image_transform_args:
            t = ImageTransform(**grp.vit_image_transform_args)
            vit.add((t.image_mean, t.image_std))

    def pick(found: set, kind: str) -> tuple[float, float]:
        if len(found) == 1:
            return next(iter(found))
        if found:
            logger.warning("inspect: groups normalise %s images differently (%s); thumbnails use 0.5/0.5", kind,
                           sorted(found))
        return 0.5, 0.5

    return pick(vae, "VAE"), pick(vit, "ViT")


def run_inspect(config: str | os.PathLike | None, *, overrides: Sequence[str] = (), batches: int = 4,
                out: str | os.PathLike | None = "runs/inspect", size: int = 512, dp_rank: int = 0, dp_size: int = 1,
                progress: bool = True, emit: Callable[[str], None] | None = None) -> list[BatchSummary]:
    """Build the job's loader from ``config`` (+ ``overrides``) and report/draw ``batches`` batches.

    Uses the job's own path: ``load_job_config`` → demo data generated if ``demo_data`` is set and missing →
    ``load_tokenizer(data.tokenizer)`` → ``build_bagel_train_loader(data, tokenizer, (dp_rank, dp_size))``.
    ``data.prefetch`` is set to 0: for a few batches a producer process only adds start-up time, and
    prefetching changes neither the batches nor ``stats()``. Each batch's report goes to ``emit`` (default: the logger) and
    its picture to ``out/batch_NNNN.png`` (``out=None``: no pictures). Returns one :class:`BatchSummary` per
    batch. Raises ``ConfigError`` for a bad config and ``ValueError`` for ``batches < 1``.
    """
    from .build import build_bagel_train_loader
    from .job.config import load_job_config
    from .tokenizer import load_tokenizer

    if batches < 1:
        raise ValueError(f"inspect: --batches must be >= 1, got {batches}")
    emit = emit or logger.info
    cfg = load_job_config(config, [*overrides, "data.prefetch=0"])
    if cfg.demo_data:
        from .converter.demo import make_demo_data

        make_demo_data(cfg.demo_data, seed=cfg.demo_seed)
    packer_cfg = cfg.data.packer
    vae_norm, vit_norm = _norms(cfg.data)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if out is not None:
        os.makedirs(out, exist_ok=True)
    summaries: list[BatchSummary] = []
    loader = build_bagel_train_loader(cfg.data, tokenizer, (dp_rank, dp_size), length=batches)
    try:
        from tqdm import tqdm

        drops: dict[str, int] = {}
        for i in tqdm(range(batches), desc="inspect", unit="batch", disable=not progress):
            batch = next(loader)
            stats = loader.stats() if hasattr(loader, "stats") else {}
            s = summarize_batch(batch, packer_cfg.max_num_tokens, batch_index=i, stats=stats)
            emit(format_batch_summary(s, drops))
            drops = dict(stats.get("drops") or {})
            summaries.append(s)
            if out is not None:
                pic = render_pack(batch, max_num_tokens=packer_cfg.max_num_tokens, size=size,
                                  title=f"batch {i} (rank {dp_rank}/{dp_size})",
                                  vae_image_downsample=packer_cfg.vae_image_downsample,
                                  vit_patch_size=packer_cfg.vit_patch_size,
                                  max_num_patch_per_side=packer_cfg.max_num_patch_per_side,
                                  vae_norm=vae_norm, vit_norm=vit_norm)
                pic.save(os.path.join(out, f"batch_{i:04d}.png"), optimize=True)
    finally:
        loader.close()
    return summaries
