"""One pack under construction: ``pack_sample`` lays samples out exactly like the official
``PackedDataset.pack_sequence`` and ``to_batch`` produces the official ``to_tensor`` dict.

Per-token work is kept out of Python: positions are recorded as (start, length) runs and expanded
with NumPy once per batch; images are patchified with tensor ops.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..transforms import get_flattened_position_ids_extrapolate, get_flattened_position_ids_interpolate, len2weight
from . import memory
from .masks import dense_attention_mask
from ..config.schema import PackerConfig

__all__ = ["PackLayout", "SequenceBuilder", "sample_field"]


def sample_field(sample: Any, name: str) -> Any:
    """Read a field from a sample dict or a sample object (Energon ``Sample`` subclasses)."""
    return sample[name] if isinstance(sample, dict) else getattr(sample, name)


@dataclass(frozen=True)
class PackLayout:
    """What ``pack_sequence`` / ``to_tensor`` read: the packer knobs (``PackerConfig``) + special token ids."""

    config: PackerConfig
    bos_token_id: int
    eos_token_id: int
    start_of_image: int
    end_of_image: int


def _runs(starts: list[int], lengths: list[int], steps: list[int] | None = None) -> np.ndarray:
    """Concatenate ``range(s, s + n)`` for every run, vectorised; with ``steps`` (0 or 1 per run) a run of step 0
    repeats ``s`` ``n`` times (int64)."""
    ln = np.asarray(lengths, dtype=np.int64)
    within = np.arange(int(ln.sum()), dtype=np.int64) - np.repeat(np.cumsum(ln) - ln, ln)
    if steps is not None:
        within *= np.repeat(np.asarray(steps, dtype=np.int64), ln)
    return np.repeat(np.asarray(starts, dtype=np.int64), ln) + within


def _repeat(values: list, lengths: list[int], dtype) -> np.ndarray:
    return np.repeat(np.asarray(values, dtype=dtype), np.asarray(lengths, dtype=np.int64))


def _patchify_into(out: torch.Tensor, image: torch.Tensor, p: int) -> None:
    """Write ``transforms.patchify(image, p)`` into ``out`` (N, p*p*C) float32 without intermediates.

    ``image`` is (C, H, W); token (i, j) holds its p x p patch channel-last. One strided copy per channel
    writes every output element once (measured faster than a copy through an HWC intermediate).
    """
    c, h, w = image.shape
    dst = out.view(h // p, w // p, p, p, c)
    for k in range(c):
        dst[..., k].copy_(image[k].view(h // p, p, w // p, p).permute(0, 2, 1, 3))


def _pad_stack(images: list[torch.Tensor]) -> torch.Tensor:
    """Official ``padded_images``: zero-padded bottom/right to the per-dim maximum, float32.

    Allocated uninitialised and written once (image + padding strips) instead of zeros-then-copy.
    """
    dims = [max(sizes) for sizes in zip(*(img.shape for img in images))]
    out = memory.empty((len(images), *dims), torch.float32)
    for i, img in enumerate(images):
        c, h, w = img.shape
        out[i, :c, :h, :w] = img
        out[i, :c, :h, w:] = 0.0
        out[i, :c, h:, :] = 0.0
        out[i, c:] = 0.0
    return out


def _tensor(arr: np.ndarray | list, dtype: torch.dtype) -> torch.Tensor:
    """``torch.tensor(list)`` semantics: an empty list becomes float32, otherwise ``dtype``."""
    if len(arr) == 0:
        return torch.zeros(0, dtype=torch.float32)
    if isinstance(arr, list):
        return torch.tensor(arr, dtype=dtype)
    return torch.from_numpy(np.ascontiguousarray(arr)).to(dtype)


class _SampleCursor:
    """Where ``pack_sample`` is within one sample: packed position ``curr``, RoPE id ``rope``, the open split's
    length, the last noised timestep, and the sample's finished splits (lengths, attention modes)."""

    __slots__ = ("curr", "rope", "split_len", "sample_len", "timestep", "split_lens", "attn_modes", "sample")

    def __init__(self, curr: int, sample: Any) -> None:
        self.curr, self.sample = curr, sample
        self.rope = self.split_len = self.sample_len = 0
        self.timestep: float | None = None
        self.split_lens: list[int] = []
        self.attn_modes: list[str] = []

    def where(self) -> Any:
        """The sample's ``data_indexes``, for error messages."""
        return sample_field(self.sample, "data_indexes")


class SequenceBuilder:
    """Accumulates the ``sequence_status`` of one pack; see spec §6 for the layout rules."""

    def __init__(self, layout: PackLayout) -> None:
        self.layout = layout
        self._pos_fn = (get_flattened_position_ids_interpolate if layout.config.interpolate_pos
                        else get_flattened_position_ids_extrapolate)
        self.curr = 0
        self.sample_lens: list[int] = []
        self.text_ids: list[int] = []
        self.text_idx_runs: tuple[list[int], list[int]] = ([], [])
        self.rope_runs: tuple[list[int], list[int], list[int]] = ([], [], [])  # start, length, step: 0 repeats start
        self.label_ids: list[int] = []
        self.ce_runs: tuple[list[int], list[int]] = ([], [])
        self.ce_weight_runs: tuple[list[float], list[int]] = ([], [])
        self.vae_images: list[torch.Tensor] = []
        self.latent_pos: list[torch.Tensor] = []
        self.vae_shapes: list[tuple[int, int]] = []
        self.vae_idx_runs: tuple[list[int], list[int]] = ([], [])
        self.timestep_runs: tuple[list[float], list[int]] = ([], [])
        self.mse_runs: tuple[list[int], list[int]] = ([], [])
        self.vit_images: list[torch.Tensor] = []
        self.vit_pos: list[torch.Tensor] = []
        self.vit_idx_runs: tuple[list[int], list[int]] = ([], [])
        self.vit_seqlens: list[int] = []
        self.split_lens: list[int] = []
        self.attn_modes: list[str] = []
        self.masks: list[torch.Tensor] = []

    # -- helpers -----------------------------------------------------------------------------------
    @staticmethod
    def _add_run(runs: tuple[list, ...], *values: Any) -> None:
        """Append one run: (start or value, length), for ``rope_runs`` also the step."""
        for run, value in zip(runs, values, strict=True):
            run.append(value)

    @staticmethod
    def _cfg_dropped(item: dict, prob: float) -> bool:
        """Official CFG dropout: one ``random.random()`` draw, only for items with ``enable_cfg == 1``."""
        return item["enable_cfg"] == 1 and random.random() < prob

    def _add_ce(self, position: int, label: int) -> None:
        self._add_run(self.ce_runs, position, 1)
        self._add_run(self.ce_weight_runs, 1.0, 1)
        self.label_ids.append(label)

    def _image_tokens(self, cur: "_SampleCursor", n: int, item: dict, idx_runs: tuple[list[int], list[int]]) -> None:
        """Record <soi> at ``cur.curr``, ``n`` image tokens in ``idx_runs`` and <eoi>; advance ``cur`` past them."""
        lay = self.layout
        eoi = cur.curr + 1 + n
        self.text_ids += [lay.start_of_image, lay.end_of_image]
        self._add_run(self.text_idx_runs, cur.curr, 1)
        self._add_run(idx_runs, cur.curr + 1, n)
        self._add_run(self.text_idx_runs, eoi, 1)
        if item["special_token_loss"] == 1:
            self._add_ce(eoi, item["special_token_label"])
        cur.curr = eoi + 1
        cur.split_len += n + 2

    # -- the official pack_sequence ---------------------------------------------------------------
    def pack_sample(self, sample: Any) -> None:
        """Append one sample; draws CFG dropout from global ``random`` and timesteps from ``np.random``.

        The plan items are laid out in order by :meth:`_pack_text`, :meth:`_pack_vit` and :meth:`_pack_vae`
        (each draws its own CFG dropout, the VAE part also the timestep), then the sample's splits become
        attention modes (flex) or one dense mask. Raises ValueError for an unknown item type or a malformed
        image (names the sample's ``data_indexes``).
        """
        cur = _SampleCursor(self.curr, sample)
        texts, images = sample_field(sample, "text_ids_list"), sample_field(sample, "image_tensor_list")
        text_i = image_i = 0
        for item in sample_field(sample, "sequence_plan"):
            split_start = item.get("split_start", True)
            if split_start:
                cur.split_len = 0
            kind = item["type"]
            if kind == "text":
                text_i += 1
                packed = self._pack_text(item, texts[text_i - 1], cur)
            elif kind == "vit_image":
                image_i += 1
                packed = self._pack_vit(item, images[image_i - 1], cur)
            elif kind == "vae_image":
                image_i += 1
                packed = self._pack_vae(item, images[image_i - 1], split_start, cur)
            else:
                raise ValueError(f"unknown sequence_plan item type {kind!r} in sample {cur.where()}")
            if packed and item.get("split_end", True):  # a CFG-dropped item ends no split (official)
                cur.split_lens.append(cur.split_len)
                cur.sample_len += cur.split_len
        self.curr = cur.curr
        self.sample_lens.append(cur.sample_len)
        if self.layout.config.use_flex:
            self.split_lens.extend(cur.split_lens)
            self.attn_modes.extend(cur.attn_modes)
        else:
            self.masks.append(dense_attention_mask(cur.split_lens, cur.attn_modes))

    def _pack_text(self, item: dict, ids: list[int], cur: "_SampleCursor") -> bool:
        """A text item: bos + ids + eos, causal, RoPE counting up; False when CFG dropped it (RoPE unchanged)."""
        lay = self.layout
        if self._cfg_dropped(item, lay.config.text_cond_dropout_prob):
            return False
        curr = cur.curr
        n = len(ids) + 1  # bos + ids
        self.text_ids += [lay.bos_token_id, *ids, lay.eos_token_id]
        self._add_run(self.text_idx_runs, curr, n + 1)
        if item["loss"] == 1:
            self._add_run(self.ce_runs, curr, n)
            self._add_run(self.ce_weight_runs, len2weight(n), n)
            self.label_ids += [*ids, lay.eos_token_id]
        if item["special_token_loss"] == 1:
            self._add_ce(curr + n, item["special_token_label"])
        cur.curr = curr + n + 1
        cur.split_len += n + 1
        cur.attn_modes.append("causal")
        self._add_run(self.rope_runs, cur.rope, cur.split_len, 1)
        cur.rope += cur.split_len
        return True

    def _pack_vit(self, item: dict, image: torch.Tensor, cur: "_SampleCursor") -> bool:
        """A ViT image (C, H, W): <soi> + H/p * W/p patch tokens + <eoi>, full attention, one RoPE id; False when
        CFG dropped it (RoPE still advances by 1)."""
        cfg = self.layout.config
        if self._cfg_dropped(item, cfg.vit_cond_dropout_prob):
            cur.rope += 1
            return False
        p = cfg.vit_patch_size
        if image.dim() != 3 or image.shape[1] % p or image.shape[2] % p:
            raise ValueError(f"vit_image of shape {tuple(image.shape)} is not a (C, H, W) tensor divisible by the "
                             f"patch size {p} (sample {cur.where()})")
        n = (image.shape[1] // p) * (image.shape[2] // p)
        self.vit_images.append(image)
        self.vit_seqlens.append(n)
        self.vit_pos.append(self._pos_fn(image.size(1), image.size(2), p, cfg.max_num_patch_per_side))
        self._image_tokens(cur, n, item, self.vit_idx_runs)
        cur.attn_modes.append("full")
        self._add_run(self.rope_runs, cur.rope, cur.split_len, 0)
        cur.rope += 1
        return True

    def _pack_vae(self, item: dict, image: torch.Tensor, split_start: bool, cur: "_SampleCursor") -> bool:
        """A VAE image (C, H, W): <soi> + latent tokens + <eoi>; a noised one (``loss`` 1) draws its timestep
        from ``np.random`` when it starts a split, a clean one gets -inf. False when CFG dropped it (RoPE +1)."""
        cfg = self.layout.config
        if self._cfg_dropped(item, cfg.vae_cond_dropout_prob):
            cur.rope += 1
            return False
        self.vae_images.append(image)
        H, W = image.shape[1], image.shape[2]
        self.latent_pos.append(self._pos_fn(H, W, cfg.vae_image_downsample, cfg.max_latent_size))
        h, w = H // cfg.vae_image_downsample, W // cfg.vae_image_downsample
        self.vae_shapes.append((h, w))
        n = h * w
        if item["loss"] == 1:
            self._add_run(self.mse_runs, cur.curr + 1, n)
            if split_start:
                cur.timestep = np.random.randn()
            elif cur.timestep is None:
                raise ValueError("a noised vae_image that does not start a split must follow one that does "
                                 f"(sample {cur.where()})")
        else:
            cur.timestep = float("-inf")
        self._add_run(self.timestep_runs, cur.timestep, n)
        self._image_tokens(cur, n, item, self.vae_idx_runs)
        if split_start:
            cur.attn_modes.append("noise" if item["loss"] == 1 and "frame_delta" not in item else "full")
        self._add_run(self.rope_runs, cur.rope, n + 2, 0)
        cur.rope += item["frame_delta"] if "frame_delta" in item else int(item["loss"] == 0)  # a clean image: +1
        return True

    # -- the official to_tensor -------------------------------------------------------------------
    def to_batch(self) -> dict[str, Any]:
        """The official batch dict (without ``batch_data_indexes``, which the packer adds)."""
        lay = self.layout
        sequence_length = sum(self.sample_lens)
        data: dict[str, Any] = {"sequence_length": sequence_length, "sample_lens": self.sample_lens,
                                "packed_text_ids": _tensor(self.text_ids, torch.int64),
                                "packed_text_indexes": _tensor(_runs(*self.text_idx_runs), torch.int64),
                                "packed_position_ids": _tensor(_runs(*self.rope_runs), torch.int64)}
        if lay.config.use_flex:
            pad_len = lay.config.max_num_tokens - sequence_length
            data["split_lens"] = self.split_lens + [pad_len]
            data["attn_modes"] = self.attn_modes + ["causal"]
            data["sample_lens"] = self.sample_lens + [pad_len]
        else:
            data["nested_attention_masks"] = self.masks
        if self.vae_images:
            data["padded_images"] = _pad_stack(self.vae_images)
            data["patchified_vae_latent_shapes"] = self.vae_shapes
            data["packed_latent_position_ids"] = torch.cat(self.latent_pos, dim=0)
            data["packed_vae_token_indexes"] = _tensor(_runs(*self.vae_idx_runs), torch.int64)
        if self.vit_images:
            p = lay.config.vit_patch_size
            tokens = memory.empty((sum(self.vit_seqlens), p * p * self.vit_images[0].shape[0]), torch.float32)
            for out, image in zip(tokens.split(self.vit_seqlens), self.vit_images):
                _patchify_into(out, image, p)
            data["packed_vit_tokens"] = tokens
            data["packed_vit_position_ids"] = torch.cat(self.vit_pos, dim=0)
            data["packed_vit_token_indexes"] = _tensor(_runs(*self.vit_idx_runs), torch.int64)
            data["vit_token_seqlens"] = _tensor(self.vit_seqlens, torch.int64)
        if sum(self.timestep_runs[1]) > 0:
            data["packed_timesteps"] = _tensor(_repeat(*self.timestep_runs, dtype=np.float64), torch.float32)
            data["mse_loss_indexes"] = _tensor(_runs(*self.mse_runs), torch.int64)
        if self.label_ids:
            data["packed_label_ids"] = _tensor(self.label_ids, torch.int64)
            data["ce_loss_indexes"] = _tensor(_runs(*self.ce_runs), torch.int64)
            data["ce_loss_weights"] = _tensor(_repeat(*self.ce_weight_runs, dtype=np.float64), torch.float32)
        return data
