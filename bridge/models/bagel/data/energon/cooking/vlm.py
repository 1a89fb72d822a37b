"""vlm_sft cooker core: one JSONL conversation as the official ``SftJSONLIterableDataset`` yields it.

Per line: parse the JSON, load every referenced image (``pil_img2rgb``), transform each with the
pixel budget divided by the number of images (also images without a placeholder), turn the
conversation into text / image elements (``change_format`` rules: human turns split on ``<image>``,
pieces stripped, extra placeholders dropped; gpt turns carry the loss; other roles ignored), tokenize
with ``tokenizer.encode`` (no chat template), drop empty texts, and skip when nothing has a loss.

A ``video`` record (no ``image`` key; a row with both is an image row) samples its frames first (:mod:`.video`:
numpy's and Python's RNG, recorded in ``draws``), then requires ``<video>`` in the FIRST turn, replaced there by one
``<image>`` per frame (else ``video_tag_missing``, after the draws, as official); every frame is transformed with
``img_num`` = the frame count. The only random path of this group.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .common import UNUSED_REASONS, CookContext, Draws, DropSample, decode_image, plan_item, transform_image
from .video import VIDEO_TAG, sample_file_frames, sample_folder_frames
from ..layout import VIDEO_ERROR_KEY, image_part

__all__ = ["cook_vlm_core", "conversation_elements"]

IMAGE_TOKEN = "<image>"


def _video_frames(crude: Mapping[str, Any], rec: dict, meta: dict, ctx: CookContext, draws: Draws) -> list:
    """The sampled frames of a video record (PIL RGB), its ``<video>`` tag replaced in ``rec["conversations"]``."""
    what = f"video {rec['video']!r}"
    err = (meta.get("image_errors") or {}).get(VIDEO_ERROR_KEY)
    if err is not None:  # recorded at conversion: nothing was opened, nothing drawn (official: open fails first)
        reason = ("missing_video" if err.startswith(("FileNotFoundError", "empty")) else
                  "bad_record" if err.startswith("TypeError") else "video_decode_error")
        raise DropSample(reason, f"{what}: {err}")
    if ctx.frame_sampler is None:
        raise DropSample("no_frame_sampler", f"{what}: the group has no frame_sampler_args")
    info = meta.get("video") if isinstance(meta.get("video"), dict) else {}
    if info.get("folder"):
        parts = [crude.get(image_part(k)) for k in range(int(info.get("num_frames", 0)))]
        if any(p is None for p in parts):
            raise DropSample("missing_video", f"{what}: a frame part is absent")
        frames = sample_folder_frames(parts, ctx.frame_sampler, draws, what)
    else:
        data = crude.get(image_part(0))
        if data is None:
            raise DropSample("missing_video", f"{what}: the video part is absent")
        frames = sample_file_frames(data, ctx.frame_sampler, draws, what)
    turns = rec.get("conversations")
    for turn in turns if isinstance(turns, list) else ():  # official: only the first turn is looked at
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise DropSample("bad_record", "conversation turn 0 is not {'from': ..., 'value': str}")
        if VIDEO_TAG not in turn["value"]:
            raise DropSample("video_tag_missing", "Cannot find <video> in the conversation! (first turn)")
        turn["value"] = turn["value"].replace(VIDEO_TAG, IMAGE_TOKEN * len(frames))
        break
    return frames


def conversation_elements(conversations: Any, num_images: int) -> list[tuple[str, str | None, int]]:
    """``(kind, text, has_loss)`` elements of a conversation, per the official ``change_format`` rules.

    Parts the official rules ignore are not lost silently: see ``ignored_parts``.
    """
    if not isinstance(conversations, list):
        raise DropSample("bad_record", f"conversations is {type(conversations).__name__}, not a list")
    out: list[tuple[str, str | None, int]] = []
    for t, turn in enumerate(conversations):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise DropSample("bad_record", f"conversation turn {t} is not {{'from': ..., 'value': str}}")
        role, value = turn.get("from"), turn["value"]
        if role == "human":
            if IMAGE_TOKEN not in value:
                out.append(("text", value, 0))
                continue
            pieces = value.split(IMAGE_TOKEN)
            for idx, piece in enumerate(pieces):
                if piece.strip() != "":
                    out.append(("text", piece.strip(), 0))
                if idx != len(pieces) - 1 and idx < num_images:
                    out.append(("image", None, 0))
        elif role == "gpt":
            out.append(("text", value, 1))
    return out


def ignored_parts(conversations: list, elements: list[tuple[str, str | None, int]], num_images: int) -> dict[str, int]:
    """What of a (valid) conversation the official rules ignore: {reason: count}, reasons
    ``image_without_placeholder`` (images beyond the ``<image>`` tags: loaded and counted in ``num_tokens``,
    never packed), ``placeholder_without_image`` (tags beyond the images) and ``turn_of_other_role`` (turns
    neither ``human`` nor ``gpt``)."""
    used = sum(1 for kind, _, _ in elements if kind == "image")
    tags = sum(turn["value"].count(IMAGE_TOKEN) for turn in conversations if turn.get("from") == "human")
    other = sum(1 for turn in conversations if turn.get("from") not in ("human", "gpt"))
    counts = {"image_without_placeholder": num_images - used, "placeholder_without_image": tags - used,
              "turn_of_other_role": other}
    assert tuple(counts) == UNUSED_REASONS[:3]  # the record-part reasons (the fourth: truncated_image, cook_with)
    return {k: v for k, v in counts.items() if v > 0}


def cook_vlm_core(crude: Mapping[str, Any], meta: dict, ctx: CookContext, draws: Draws) -> dict:
    """Official fields of a vlm sample; raises ``DropSample`` where the official loader skips the line."""
    raw_line = meta.get("raw_line")
    if not isinstance(raw_line, str):
        raise DropSample("bad_meta", "raw_line missing")
    try:
        rec = json.loads(raw_line)
    except ValueError as e:
        raise DropSample("bad_json", f"{type(e).__name__}: {e}") from None
    if not isinstance(rec, dict):
        raise DropSample("bad_record", f"the line is a JSON {type(rec).__name__}, not an object")
    errors, names = meta.get("image_errors") or {}, rec.get("image", [])
    names = names if isinstance(names, list) else [names]
    for i, name in enumerate(names):
        if not isinstance(name, str):
            raise DropSample("bad_record", f"image entry {i} is {type(name).__name__}, not a path string")
    images = _video_frames(crude, rec, meta, ctx, draws) if "image" not in rec and "video" in rec else []
    for i, name in enumerate(names):
        err = errors.get(str(i))
        if err is not None:
            reason = ("missing_image" if err.startswith("FileNotFoundError") else
                      "bad_record" if err.startswith("TypeError") else "image_decode_error")
            raise DropSample(reason, f"image {i} ({name}): {err}")
        images.append(decode_image(crude, i, f"image {i} ({name})"))
    done: dict[int, Any] = {}  # a padded video repeats a frame: transformed once, the repeats are copies
    tensors = []
    for i, img in enumerate(images):
        t = done.get(id(img))
        tensors.append(t.clone() if t is not None else transform_image(ctx.transform, img, f"image {i}",
                                                                       img_num=len(images)))
        done.setdefault(id(img), tensors[-1])
    num_tokens = sum(t.shape[1] * t.shape[2] // ctx.transform.stride ** 2 for t in tensors)

    plan: list[dict] = []
    texts: list[list[int]] = []
    elements = conversation_elements(rec.get("conversations"), len(images))
    for kind, text, has_loss in elements:
        if kind == "text":
            ids = ctx.encode(text)
            if len(ids) == 0:
                continue
            texts.append(ids)
            num_tokens += len(ids)
            plan.append(plan_item("text", 0, has_loss))
        else:
            plan.append(plan_item("vit_image", 0, 0))
    if not any(item["loss"] for item in plan):
        raise DropSample("no_loss_item", "No loss defined, skipped.")
    unused = ignored_parts(rec["conversations"], elements, len(images))
    return {"sequence_plan": plan, "text_ids_list": texts, "image_tensor_list": tensors, "num_tokens": num_tokens,
            "unused": unused or None}
