"""unified_edit cooker core: an editing step (or chain) as ``UnifiedEditIterableDataset.parse_row`` builds it.

Random choices, in the official order: ``start`` over ``range(n-1)``, ``end`` over
``range(start+1, min(start+3, n))``, then (decode image ``start``) ``u = random()`` only when
``end - start > 1``; ``u < 0.5`` takes the concatenated variant (``end`` is pulled back by one when it is
the last image), else the stepwise one. Instruction choices and image decodes interleave exactly as
official, so a row that fails half-way has made the same draws as the official reader before skipping.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .common import CookContext, Draws, DropSample, decode_image, plan_item, transform_image

__all__ = ["cook_edit_core"]


class _Builder:
    """Accumulates plan / texts / images / tokens like the official ``_add_text`` / ``_add_image``."""

    def __init__(self, ctx: CookContext) -> None:
        if ctx.vit_transform is None:
            raise ValueError("unified_edit cooker needs vit_image_transform_args (the ViT transform)")
        self.ctx = ctx
        self.plan: list[dict] = []
        self.texts: list[list[int]] = []
        self.images: list = []
        self.num_tokens = 0

    def add_text(self, text: str) -> None:
        ids = self.ctx.encode(text)
        self.plan.append(plan_item("text", 1, 0))
        self.texts.append(ids)
        self.num_tokens += len(ids)

    def add_image(self, image, what: str, *, need_loss: bool, need_vae: bool, need_vit: bool) -> None:
        vae_stride2 = self.ctx.transform.stride ** 2
        if need_loss or need_vae:
            vae = transform_image(self.ctx.transform, image, what)
            tokens = vae.shape[1] * vae.shape[2] // vae_stride2
            if need_loss:
                self.plan.append(plan_item("vae_image", 0, 1))
                self.images.append(vae)
                self.num_tokens += tokens
            if need_vae:
                self.plan.append(plan_item("vae_image", 1, 0))
                self.images.append(vae.clone() if need_loss else vae)
                self.num_tokens += tokens
        if need_vit:
            vit = transform_image(self.ctx.vit_transform, image, what)
            self.plan.append(plan_item("vit_image", 1, 0))
            self.images.append(vit)
            self.num_tokens += vit.shape[1] * vit.shape[2] // self.ctx.vit_transform.stride ** 2


def _alternatives(instructions: Any, step: int) -> list:
    """``instruction_list[step]`` (the alternatives for image step -> step+1), validated."""
    if not isinstance(instructions, list):
        raise DropSample("bad_instructions", f"instruction_list is {type(instructions).__name__}, not a list")
    if step >= len(instructions):
        raise DropSample("bad_instructions", f"instruction_list has {len(instructions)} steps, step {step} needed")
    alts = instructions[step]
    if not isinstance(alts, list):
        raise DropSample("bad_instructions", f"instruction_list[{step}] is {type(alts).__name__}, not a list")
    if not alts:
        raise DropSample("empty_alternatives", f"instruction_list[{step}] is empty")
    return alts


def _choose(alts: list, step: int, draws: Draws) -> str:
    text = alts[draws.choice_index(len(alts))]
    if not isinstance(text, str):
        raise DropSample("bad_instructions", f"instruction_list[{step}] holds a {type(text).__name__}, not str")
    return text


def cook_edit_core(crude: Mapping[str, Any], meta: dict, ctx: CookContext, draws: Draws) -> dict:
    """Official fields of an edit sample; raises ``DropSample`` where the official ``parse_row`` fails."""
    n = meta.get("num_images")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise DropSample("bad_meta", f"num_images is {n!r}")
    if n < 2:
        raise DropSample("too_few_images", f"{n} image(s): an edit needs at least 2")
    instructions = meta.get("instruction_list")
    b = _Builder(ctx)

    start = draws.choice_index(n - 1)
    end = start + 1 + draws.choice_index(min(start + 3, n) - (start + 1))
    b.add_image(decode_image(crude, start, "edit row"), f"edit image {start}",
                need_loss=False, need_vae=True, need_vit=True)

    if end - start > 1 and draws.random() < 0.5:
        if end == n - 1:
            end -= 1
        pieces = []
        for i in range(start + 1, end + 1):
            pieces.append(_choose(_alternatives(instructions, i - 1), i - 1, draws) + ". ")
        b.add_text("".join(pieces).rstrip())
        b.add_image(decode_image(crude, end, "edit row"), f"edit image {end}",
                    need_loss=True, need_vae=False, need_vit=False)
    else:
        for i in range(start + 1, end + 1):
            b.add_text(_choose(_alternatives(instructions, i - 1), i - 1, draws))
            last = i == end
            b.add_image(decode_image(crude, i, "edit row"), f"edit image {i}",
                        need_loss=True, need_vae=not last, need_vit=not last)
    return {"sequence_plan": b.plan, "text_ids_list": b.texts, "image_tensor_list": b.images,
            "num_tokens": b.num_tokens}
