"""The cooker core of each BAGEL group (``t2i`` / ``edit`` / ``vlm``: the official ``T2IIterableDataset``,
``UnifiedEditIterableDataset.parse_row`` and ``SftJSONLIterableDataset``) and its context. The readers call
:func:`.common.cook_with` with the group's core, its :class:`~.common.CookContext` and the draws their order
prescribes (``common.Draws``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ...transforms import ImageTransform
from ..layout import EDIT, GROUPS, T2I, VLM
from .common import CookContext
from .edit import cook_edit_core
from .t2i import cook_t2i_core
from .video import FrameSampler
from .vlm import cook_vlm_core

__all__ = ["CORES", "make_cook_context"]

#: The cooker core of each group: ``core(crude, meta, ctx, draws) -> official fields`` (or DropSample).
CORES: dict[str, Callable[..., dict]] = {T2I: cook_t2i_core, EDIT: cook_edit_core, VLM: cook_vlm_core}


def make_cook_context(group: str, tokenizer: Any, image_transform_args: Mapping[str, Any],
                      vit_image_transform_args: Mapping[str, Any] | None = None, *,
                      verify_checksums: bool = True, truncated_images: str = "keep",
                      frame_sampler_args: Mapping[str, Any] | None = None) -> CookContext:
    """Build a group's context from the official YAML ``image_transform_args`` / ``vit_image_transform_args`` /
    ``frame_sampler_args`` (vlm video records); ``verify_checksums`` / ``truncated_images``: ``data.verify_checksums``
    / ``data.truncated_images`` (the ``CookContext`` fields).

    Raises ValueError for an unknown group, an edit group without its ViT transform (``config.validate_data``
    reports both first for a configured job) or ``frame_sampler_args`` without ``1 <= min <= max`` frames."""
    if group not in CORES:
        raise ValueError(f"unknown BAGEL group {group!r}; expected one of {GROUPS}")
    if group == EDIT and vit_image_transform_args is None:
        raise ValueError(f"group {group!r} needs vit_image_transform_args (its ViT transform)")
    vit = ImageTransform(**vit_image_transform_args) if vit_image_transform_args is not None else None
    return CookContext(group=group, tokenizer=tokenizer, transform=ImageTransform(**image_transform_args),
                       vit_transform=vit, verify_checksums=verify_checksums, truncated_images=truncated_images,
                       frame_sampler=FrameSampler.of(dict(frame_sampler_args) if frame_sampler_args else None))
