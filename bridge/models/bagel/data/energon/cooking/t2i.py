"""t2i_pretrain cooker core: one image + one caption, as the official ``T2IIterableDataset`` yields it.

Order of work (and of failures) follows the official row loop: decode + convert the image, transform
it, parse the captions JSON, tokenize every caption (dict order), then one ``choice`` over the tokenized
captions (none when there are no captions: the text is ``encode(' ')``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .common import CookContext, Draws, DropSample, decode_image, plan_item, transform_image

__all__ = ["cook_t2i_core"]


def cook_t2i_core(crude: Mapping[str, Any], meta: dict, ctx: CookContext, draws: Draws) -> dict:
    """Official fields of a t2i sample; raises ``DropSample`` where the official loader skips the row."""
    tensor = transform_image(ctx.transform, decode_image(crude, 0, "t2i row"), "t2i row")
    num_tokens = tensor.shape[1] * tensor.shape[2] // ctx.transform.stride ** 2

    raw = meta.get("captions")
    if not isinstance(raw, str):
        raise DropSample("bad_captions_json", f"captions is {type(raw).__name__}, not a JSON string")
    try:
        captions = json.loads(raw)
    except ValueError as e:
        raise DropSample("bad_captions_json", f"captions are not valid JSON: {e}") from None
    if not isinstance(captions, dict) or not all(isinstance(v, str) for v in captions.values()):
        raise DropSample("bad_captions_json", f"captions must be a JSON object of strings, got {raw[:80]!r}")

    tokenized = [ctx.encode(v) for v in captions.values()]
    text_ids = tokenized[draws.choice_index(len(tokenized))] if tokenized else ctx.encode(" ")
    num_tokens += len(text_ids)
    return {"sequence_plan": [plan_item("text", 1, 0), plan_item("vae_image", 0, 1)], "text_ids_list": [text_ids],
            "image_tensor_list": [tensor], "num_tokens": num_tokens}
