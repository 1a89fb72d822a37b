"""Image conversion, resize and position-id utilities with the official BAGEL semantics, bit for bit.

Every function here reproduces the behaviour described in spec ``bagel_packer.md`` §9 (including its
quirks: half-to-even rounding, the area ratio used as a linear factor, LA images not composited), so
that re-implemented readers yield image tensors equal (``torch.equal``) to the official ones.
Nothing is changed globally at import; readers call :func:`configure_pil` once.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image, ImageFile, PngImagePlugin

__all__ = ["DEFAULT_MAX_PIXELS", "ImageTransform", "configure_pil", "get_flattened_position_ids_extrapolate",
           "get_flattened_position_ids_interpolate", "len2weight", "patchify", "pil_img2rgb", "target_size",
           "uint8_to_float"]

#: Official default pixel budget of ``ImageTransform`` (14 * 14 * 9 * 1024).
DEFAULT_MAX_PIXELS = 14 * 14 * 9 * 1024

#: PIL globals the official dataset modules leave behind after import (registry import order).
PIL_MAX_IMAGE_PIXELS = 200_000_000
PIL_MAX_TEXT_CHUNK = 1024 * 1024 * 1024


def configure_pil() -> None:
    """Set PIL's globals to what the official BAGEL modules leave them at.

    ``MAX_IMAGE_PIXELS`` = 2e8 (the vlm/edit modules win over t2i's 2e7), truncated images load
    (the missing part is filled, needed to reproduce e.g. truncated JPEGs), PNG text chunks up to 1 GiB.
    """
    Image.MAX_IMAGE_PIXELS = PIL_MAX_IMAGE_PIXELS
    ImageFile.LOAD_TRUNCATED_IMAGES = True
    PngImagePlugin.MAX_TEXT_CHUNK = PIL_MAX_TEXT_CHUNK


def pil_img2rgb(image: Image.Image) -> Image.Image:
    """Convert to RGB like the official loader: RGBA or ``info['transparency']`` → composite on white.

    Everything else (L, 1, LA, CMYK, P without transparency, ...) is a plain ``convert('RGB')``; in
    particular LA keeps its gray values under fully transparent pixels.
    """
    if image.mode == "RGBA" or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _apply_scale(width: int, height: int, scale: float, stride: int) -> tuple[int, ...]:
    """Scale both sides (Python ``round``) and snap each to the nearest stride multiple (``round`` again: halves
    to even), at least one stride; returns (w, h)."""
    return tuple(max(stride, int(round(round(side * scale) / stride) * stride)) for side in (width, height))


def target_size(width: int, height: int, *, max_size: int, min_size: int, stride: int,
                max_pixels: int | float = DEFAULT_MAX_PIXELS, img_num: int = 1) -> tuple[int, int]:
    """The official ``MaxLongEdgeMinShortEdgeResize`` size rule; returns (height, width).

    1. scale = max(min(max/long, 1), min/short) (the short edge may push the long edge over max);
    2. if w*h exceeds max_pixels/img_num, scale by that *area* ratio as a linear factor (quirk);
    3. if the long edge exceeds max, scale it down to max. Each step rounds and snaps to the stride.
    """
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height} (WxH)")
    if img_num <= 0:
        raise ValueError(f"img_num must be positive, got {img_num}")
    scale = max(min(max_size / max(width, height), 1.0), min_size / min(width, height))
    w, h = _apply_scale(width, height, scale, stride)
    if w * h > max_pixels / img_num:
        w, h = _apply_scale(w, h, max_pixels / img_num / (w * h), stride)
    if max(w, h) > max_size:
        w, h = _apply_scale(w, h, max_size / max(w, h), stride)
    return h, w


def uint8_to_float(u8: torch.Tensor, mean: float = 0.5, std: float = 0.5) -> torch.Tensor:
    """uint8 (3, H, W) → float32 (3, H, W): torchvision ToTensor + Normalize(inplace) replayed op by op."""
    x = u8.to(torch.float32).div(255)
    m, s = (torch.as_tensor([v] * x.shape[0], dtype=torch.float32).view(-1, 1, 1) for v in (mean, std))
    return x.sub_(m).div_(s)


class ImageTransform:
    """Official BAGEL ``ImageTransform``: deterministic resize (see :func:`target_size`), then [-1, 1].

    ``stride`` is exposed for token counting. Input must already be RGB (use :func:`pil_img2rgb`).
    """

    def __init__(self, max_image_size: int, min_image_size: int, image_stride: int,
                 max_pixels: int | float = DEFAULT_MAX_PIXELS, image_mean: float = 0.5, image_std: float = 0.5) -> None:
        for name, v in (("max_image_size", max_image_size), ("min_image_size", min_image_size),
                        ("image_stride", image_stride), ("max_pixels", max_pixels)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"ImageTransform: {name} must be a positive number, got {v!r}")
        self.max_size, self.min_size = max_image_size, min_image_size
        self.stride, self.max_pixels = image_stride, max_pixels
        self.image_mean = float(_scalar(image_mean, "image_mean"))
        self.image_std = float(_scalar(image_std, "image_std"))

    def __repr__(self) -> str:
        return (f"ImageTransform(max_image_size={self.max_size}, min_image_size={self.min_size}, "
                f"image_stride={self.stride}, max_pixels={self.max_pixels})")

    def target_size(self, width: int, height: int, img_num: int = 1) -> tuple[int, int]:
        """Output (height, width) for an input of ``width`` x ``height``."""
        return target_size(width, height, max_size=self.max_size, min_size=self.min_size,
                           stride=self.stride, max_pixels=self.max_pixels, img_num=img_num)

    def resize(self, img: Image.Image, img_num: int = 1) -> Image.Image:
        """PIL bicubic resize to the target size (== torchvision F.resize on PIL, antialias)."""
        if img.mode != "RGB":
            raise ValueError(f"ImageTransform expects an RGB image (apply pil_img2rgb first), got mode {img.mode!r}")
        h, w = self.target_size(img.width, img.height, img_num)
        return img.resize((w, h), Image.BICUBIC)

    def to_uint8(self, img: Image.Image, img_num: int = 1) -> torch.Tensor:
        """Resized pixels as a contiguous uint8 tensor (3, H, W); ``__call__`` = normalize(this)."""
        arr = np.asarray(self.resize(img, img_num), dtype=np.uint8)
        return torch.from_numpy(arr.copy()).permute(2, 0, 1).contiguous()

    def normalize(self, u8: torch.Tensor) -> torch.Tensor:
        """uint8 (3, H, W) → float32 in [-1, 1], bit-exact with ToTensor + Normalize."""
        return uint8_to_float(u8, self.image_mean, self.image_std)

    def __call__(self, img: Image.Image, img_num: int = 1) -> torch.Tensor:
        """Resize and normalize: float32 (3, H, W)."""
        return self.normalize(self.to_uint8(img, img_num))


def _scalar(v: float | list | tuple, name: str) -> float:
    """Accept a scalar or a per-channel triple with equal entries (the official configs use 0.5 x 3)."""
    if isinstance(v, (list, tuple)):
        if len(set(float(x) for x in v)) != 1:
            raise ValueError(f"ImageTransform: per-channel {name} must be equal across channels, got {v!r}")
        return float(v[0])
    return float(v)


def patchify(image: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(C, H, W) → (H/p * W/p, p*p*C): row-major patch grid, inside a patch (row, col, channel)."""
    if image.dim() != 3:
        raise ValueError(f"patchify expects a (C, H, W) tensor, got shape {tuple(image.shape)}")
    c, h, w = image.shape
    p = patch_size
    if h % p or w % p:
        raise ValueError(f"patchify: image size {h}x{w} (HxW) is not divisible by patch size {p}")
    x = image.reshape(c, h // p, p, w // p, p).permute(1, 3, 2, 4, 0)
    return x.reshape(-1, p * p * c)


def get_flattened_position_ids_extrapolate(img_h: int, img_w: int, patch_size: int,
                                           max_num_patches_per_side: int) -> torch.Tensor:
    """Row-major ids ``row * M + col`` of the (H//p) x (W//p) patch grid (no bounds check, as official)."""
    rows = torch.arange(0, img_h // patch_size)
    cols = torch.arange(0, img_w // patch_size)
    return (rows[:, None] * max_num_patches_per_side + cols).flatten()


def get_flattened_position_ids_interpolate(img_h: int, img_w: int, patch_size: int,
                                           max_num_patches_per_side: int) -> torch.Tensor:
    """Map the patch grid proportionally onto the M x M table via float32 bucketize (official rule)."""
    m = max_num_patches_per_side
    boundaries = torch.arange(1 / m, 1.0, 1 / m, dtype=torch.float32)
    bh, bw = (torch.bucketize(torch.arange(0, 1 - 1e-6, 1 / (side // patch_size), dtype=torch.float32), boundaries,
                              right=True) for side in (img_h, img_w))
    return (bh[:, None] * m + bw).flatten()


def len2weight(x: int, mode: str = "square") -> float:
    """Per-token CE weight of a loss span of length ``x``: 0 if empty, else 1 / 1/x / 1/sqrt(x)."""
    if x == 0:
        return 0
    if mode == "token":
        return 1
    if mode == "sample":
        return 1 / x
    if mode == "square":
        return 1 / (x ** 0.5)
    raise ValueError(f"len2weight: unknown mode {mode!r} (expected 'token', 'sample' or 'square')")
