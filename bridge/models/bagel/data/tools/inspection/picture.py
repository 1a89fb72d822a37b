"""The attention picture of one pack: the query × key matrix, its position bars, a legend and image thumbnails.

:func:`render_pack` draws a packed batch (flex or dense) from its :class:`~.view.PackView` with Pillow;
deterministic (same batch and arguments, same pixels). :func:`canvas_size` gives the picture's size and
:func:`sampled_positions` the packed position drawn at each pixel of an axis.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from .view import CAUSAL, FULL, NOISE, TEXT, VAE, VIT, PackView, as_index, attention_allowed, pack_view, take

__all__ = ["PALETTE", "canvas_size", "render_pack", "sampled_positions"]

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

# Picture geometry (pixels; ``_THUMB_ROWS`` rows). The canvas size depends only on ``size`` (see canvas_size).
_MARGIN, _TITLE_H, _BAR, _TICK, _GAP, _LEGEND_H = 12, 18, 8, 4, 2, 52
_THUMB_H, _THUMB_LABEL_H, _THUMB_ROWS = 60, 14, 2


def canvas_size(size: int = 512) -> tuple[int, int]:
    """(width, height) in pixels of the picture :func:`render_pack` draws for a ``size``-pixel matrix."""
    width = _MARGIN + _BAR + _GAP + size + _MARGIN
    height = (_MARGIN + _TITLE_H + _BAR + _GAP + size + _MARGIN + _LEGEND_H
              + _THUMB_ROWS * (_THUMB_H + _THUMB_LABEL_H) + _MARGIN)
    return width, height


#: Runs shorter than this (the 1-token soi/eoi around images) are not favoured when choosing a pixel's token.
_MIN_FAVOURED_RUN = 4


def _runs(view: PackView) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) of the maximal runs of equal (sample, split, mode, modality), padding as one run."""
    keys = np.stack([view.sample, view.block, view.mode, view.modality]).astype(np.int64)
    change = np.flatnonzero((keys[:, 1:] != keys[:, :-1]).any(axis=0)) + 1
    edges = [0, *change] if view.tokens else []  # an empty pack: padding only
    starts = np.asarray(edges + [view.tokens] * (view.length > view.tokens), dtype=np.int64)
    return starts, np.append(starts[1:], view.length) - starts


def sampled_positions(view: PackView, pixels: int) -> np.ndarray:
    """The packed position drawn at each of ``pixels`` pixels along an axis of ``view.length`` positions.

    Pixel p covers positions ``[p·L/pixels, (p+1)·L/pixels)``. It shows the position at its centre, unless
    it also overlaps a run (see :func:`_runs`) that is shorter than the centre's run and at least
    ``_MIN_FAVOURED_RUN`` tokens long: then the middle of the shortest such run's overlap. A 30-token
    caption between 1000-token images thus stays visible at 40 tokens per pixel. Each drawn cell is a real
    (query, key) pair, so the attention shown is exact for the sampled positions. Depends only on the
    view: flex and dense give the same positions.
    """
    length = view.length
    starts, lens = _runs(view)
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


def _token_colours(view: PackView, pos: np.ndarray) -> np.ndarray:
    lut = np.array([PALETTE[(m, a)] for m in range(3) for a in range(3)], dtype=np.uint8)
    real = pos < view.tokens
    n = view.tokens
    cat = take(view.modality, pos, n).astype(np.int64) * 3 + take(view.mode, pos, n).astype(np.int64)
    out = lut[cat]
    out[real & (take(view.sample, pos, n) < 0)] = ORPHAN
    out[~real] = PADDING
    return out


def _matrix(view: PackView, size: int) -> np.ndarray:
    pos = sampled_positions(view, size)
    ok = attention_allowed(view, pos, pos)
    real = pos < view.tokens
    smp = take(view.sample, pos, view.tokens)
    img = np.full((size, size, 3), OTHER_SAMPLE, dtype=np.uint8)
    img[smp[:, None] == smp[None, :]] = BLOCKED
    keys = np.broadcast_to(_token_colours(view, pos)[None, :, :], (size, size, 3))
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
    ids = as_index(batch["packed_vit_position_ids"])
    out: list[Any] = []
    start = 0
    for n in as_index(batch["vit_token_seqlens"]).tolist():
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
    """Draw one pack: its attention matrix plus a thumbnail strip of its images; returns an RGB image.

    The matrix has the packed sequence (``max(max_num_tokens, tokens)`` positions) on both axes, queries
    down, keys across, one sampled position per pixel (:func:`sampled_positions`). An attended cell has the
    key's colour (:data:`PALETTE`: modality × attention mode); white = blocked inside a sample, light grey =
    another sample, grey = padding. The bars on the top and left show each position's colour, dark ticks
    through them mark sample boundaries, and the thin strip under the top bar marks CE (purple) and MSE
    (red) positions.
    Thumbnails: VAE images cropped to their latent grid (``h·ds × w·ds`` px) and ViT images rebuilt from
    patches, de-normalised with ``(mean, std)`` (``x * std + mean``); those that do not fit are counted.

    Deterministic (no clock, no RNG). Canvas size: :func:`canvas_size` (``size``). Raises ``ValueError`` as
    :func:`pack_view` does.
    """
    view = pack_view(batch, max_num_tokens)
    width, height = canvas_size(size)
    canvas = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    font = ImageFont.load_default(size=11)
    x0, y0 = _MARGIN + _BAR + _GAP, _MARGIN + _TITLE_H + _BAR + _GAP  # the matrix's top left corner
    head = (f"{len(view.sample_lens)} samples, {view.sequence_length}/{view.length} tokens "
            f"({100.0 * view.sequence_length / max(view.length, 1):.1f}% full)")
    draw.text((_MARGIN, _MARGIN), f"{title}  {head}" if title else head, fill=BOUNDARY, font=font)
    canvas.paste(Image.fromarray(_matrix(view, size), "RGB"), (x0, y0))
    _draw_bars(canvas, draw, view, size, x0, y0)
    ly = y0 + size + _MARGIN
    _draw_legend(draw, font, width, ly)
    thumbs = _thumbnails(batch, vae_image_downsample, vit_patch_size, max_num_patch_per_side, vae_norm, vit_norm)
    _draw_thumbnails(canvas, draw, font, thumbs, width, ly + _LEGEND_H)
    return canvas


def _draw_bars(canvas: Image.Image, draw: ImageDraw.ImageDraw, view: Any, size: int, x0: int, y0: int) -> None:
    """The token-colour bars on the top and left of the matrix, the CE/MSE strip and the sample-boundary ticks."""
    pos = sampled_positions(view, size)
    colours = _token_colours(view, pos)
    bar = Image.fromarray(np.ascontiguousarray(np.broadcast_to(colours[None], (_BAR, size, 3))), "RGB")
    canvas.paste(bar, (x0, y0 - _GAP - _BAR))
    canvas.paste(bar.transpose(Image.Transpose.ROTATE_270).transpose(Image.Transpose.FLIP_LEFT_RIGHT),
                 (x0 - _GAP - _BAR, y0))
    real = pos < view.tokens
    loss = np.full((size, 3), 255, dtype=np.uint8)
    loss[real & take(view.ce, pos, view.tokens)] = CE_MARK
    loss[real & take(view.mse, pos, view.tokens)] = MSE_MARK
    canvas.paste(Image.fromarray(np.ascontiguousarray(np.broadcast_to(loss[None], (2, size, 3))), "RGB"),
                 (x0, y0 - _GAP))
    # sample boundaries: dark ticks through the bars (outside the matrix, so no cell is covered)
    edges = sorted(set(view.sample_starts[1:]) | {view.sequence_length})
    for p in np.unique(np.searchsorted(pos, np.asarray(edges, dtype=np.int64), side="left")).tolist():
        if 0 < p < size:
            draw.line([x0 + p, y0 - _GAP - _BAR - _TICK, x0 + p, y0 - _GAP - 1], fill=BOUNDARY)
            draw.line([x0 - _GAP - _BAR - _TICK, y0 + p, x0 - _GAP - 1, y0 + p], fill=BOUNDARY)


def _draw_legend(draw: ImageDraw.ImageDraw, font: Any, width: int, ly: int) -> None:
    """The colour legend, four entries a row, from ``ly`` down."""
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


def _draw_thumbnails(canvas: Image.Image, draw: ImageDraw.ImageDraw, font: Any,
                     thumbs: list[tuple[str, np.ndarray]], width: int, ty: int) -> None:
    """The thumbnails in up to ``_THUMB_ROWS`` rows from ``ty`` down; those that do not fit are counted."""
    x, row, shown = _MARGIN, 0, 0
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
