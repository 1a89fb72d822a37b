"""unified_edit cooker core: an editing step (or chain) as ``UnifiedEditIterableDataset.parse_row`` builds it.

Random choices, in the official order: ``start`` over ``range(n-1)``, ``end`` over
``range(start+1, min(start+3, n))``, then (decode image ``start``) ``u = random()`` only when
``end - start > 1``; ``u < 0.5`` takes the concatenated variant, else the stepwise one. The layout of a draw is
``config.outcomes.edit_parts`` (the rule ``bagel-data stats`` and the budget checks enumerate). Instruction choices
and image decodes interleave exactly as official, so a row that fails half-way has made the same draws as the
official reader before skipping.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...config.outcomes import CONCAT_P, EditImage, EditText, edit_end_choices, edit_parts, may_concat
from .common import CookContext, Draws, DropSample, decode_image, plan_item, transform_image

__all__ = ["cook_edit_core"]


class _Builder:
    """Accumulates plan / texts / images / tokens like the official ``_add_text`` / ``_add_image``."""

    def __init__(self, ctx: CookContext) -> None:
        if ctx.vit_transform is None:
            raise ValueError("unified_edit cooker needs vit_image_transform_args (the ViT transform)")
        self.ctx, self.num_tokens = ctx, 0
        self.plan: list[dict] = []
        self.texts: list[list[int]] = []
        self.images: list = []

    def add_text(self, text: str) -> None:
        ids = self.ctx.encode(text)
        self.plan.append(plan_item("text", 1, 0))
        self.texts.append(ids)
        self.num_tokens += len(ids)

    def add_image(self, image, what: str, *, need_loss: bool, need_vae: bool, need_vit: bool) -> None:
        if need_loss or need_vae:
            vae = transform_image(self.ctx.transform, image, what)
            tokens = vae.shape[1] * vae.shape[2] // self.ctx.transform.stride ** 2
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


def _instruction(instructions: Any, step: int, draws: Draws) -> str:
    """One of the alternatives ``instruction_list[step]`` (for image step -> step+1), validated, drawn."""
    if not isinstance(instructions, list):
        raise DropSample("bad_instructions", f"instruction_list is {type(instructions).__name__}, not a list")
    if step >= len(instructions):
        raise DropSample("bad_instructions", f"instruction_list has {len(instructions)} steps, step {step} needed")
    alts = instructions[step]
    if not isinstance(alts, list):
        raise DropSample("bad_instructions", f"instruction_list[{step}] is {type(alts).__name__}, not a list")
    if not alts:
        raise DropSample("empty_alternatives", f"instruction_list[{step}] is empty")
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
    instructions, b = meta.get("instruction_list"), _Builder(ctx)

    start = draws.choice_index(n - 1)
    end = start + 1 + draws.choice_index(edit_end_choices(n, start))
    parts = edit_parts(n, start, end, False)  # its first part, the context, is the same in both variants
    _place(b, parts[0], crude, instructions, draws)  # cooked before the variant is drawn, as officially
    if may_concat(start, end) and draws.random() < CONCAT_P:
        parts = edit_parts(n, start, end, True)
    for part in parts[1:]:
        _place(b, part, crude, instructions, draws)
    return {"sequence_plan": b.plan, "text_ids_list": b.texts, "image_tensor_list": b.images,
            "num_tokens": b.num_tokens}


def _place(b: _Builder, part: EditImage | EditText, crude: Mapping[str, Any], instructions: Any, draws: Draws) -> None:
    """One part of the row's layout (``config.outcomes.edit_parts``): its instruction (drawn) or its image."""
    if isinstance(part, EditText):
        texts = [_instruction(instructions, st, draws) for st in part.steps]
        b.add_text("".join(t + ". " for t in texts).rstrip() if part.joined else texts[0])
        return
    b.add_image(decode_image(crude, part.image, "edit row"), f"edit image {part.image}", need_loss=part.loss,
                need_vae=part.clean, need_vit=part.clean)
