"""Packer budgets against the groups' transforms: one place for token estimates and config-time checks.

The official packer estimates a sample as ``num_tokens + 2 * len(sequence_plan)`` (spec §5: the +2 per
plan item are bos/eos or start/end-of-image), where an image contributes ``H * W // stride**2`` tokens
after the group's :class:`~.transforms.ImageTransform`. Everything here derives from that rule: the per-image and
per-sample estimates and a group's bounds (which items a sample lays out is :mod:`.outcomes`; ``estimate``,
``is_overlength`` and ``mandatory_tokens`` live in :mod:`.lengths`, shared with the packer, and are re-exported
here), what a transform can produce and which position table it indexes, and :func:`budget_issues`: the rules
:data:`GROUP_RULES` and :data:`PACKER_RULES` (cases B3, B4, B6), one list read by config validation (an error is
raised by ``validate.validate_data`` with the other config problems) and ``bagel-data stats`` (a warning, what may
drop much, is logged once by :func:`log_warnings`).

Units: "tokens" are packed sequence positions; sides are in pixels (``*_px``) or patches/latents.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .grouped_yaml import GroupConfig
from .packer import PackerConfig
from .registry import ResolvedGroup
from .lengths import estimate, is_overlength, mandatory_tokens  # re-exported: the packer's own rules
from .outcomes import Text, edit_outcomes, t2i_outcomes, vlm_outcome
from ..transforms import ImageTransform

__all__ = [
    "BudgetIssue", "FLEX_BLOCK", "GROUP_RULES", "GroupBounds", "ImageGrid", "PACKER_RULES", "TransformExtremes",
    "VAE_GROUPS", "budget_issues", "estimate", "group_bounds", "image_grids", "image_tokens", "is_overlength",
    "log_warnings", "loop_refuses_overflow", "mandatory_overflow", "mandatory_tokens", "table_side",
    "transform_extremes",
]

logger = logging.getLogger(__name__)

#: FlexAttention block size: a padded length that is not a multiple of it costs a partial block per pack.
FLEX_BLOCK = 128
#: Groups whose ``image_transform_args`` feed the VAE (latent position ids); vlm feeds the ViT.
VAE_GROUPS = ("t2i_pretrain", "unified_edit")

_warned: set[str] = set()


# --------------------------------------------------------------------------------------------------
# Estimates (the packer's rule)


def image_tokens(transform: ImageTransform, width: int, height: int, img_num: int = 1) -> int:
    """Tokens of one image of ``width`` x ``height`` input pixels after ``transform``: ``H*W // stride**2``.

    ``img_num`` divides the pixel budget (vlm records with several images). Raises ValueError for a non-positive size.
    """
    h, w = transform.target_size(width, height, img_num)
    return h * w // transform.stride ** 2


@dataclass(frozen=True)
class TransformExtremes:
    """What a transform can produce over all input sizes (for ``img_num`` images per record)."""

    max_side: int            # the largest output side in patches (px // stride)
    max_side_px: int         # the same in pixels
    max_tokens: int          # the largest H*W // stride**2
    min_tokens: int          # the smallest
    max_hw: tuple[int, int]  # an output (H, W) in pixels reaching max_tokens


def _probe_sides(max_size: float, min_size: float, stride: int) -> list[int]:
    """Input sides to evaluate: a geometric ladder 1 .. 16*max plus the values around the thresholds."""
    sides = {1, 2, 3}
    s = 4.0
    while s <= 16 * max(max_size, min_size):
        sides.add(int(s))
        s *= 1.15
    for base in (max_size, min_size, stride):
        for k in (0.5, 1, 2, 3, 4):
            for d in (-1, 0, 1):
                v = int(round(base * k)) + d
                if v > 0:
                    sides.add(v)
    return sorted(sides)


@functools.lru_cache(maxsize=64)
def _extremes(max_size: float, min_size: float, stride: int, max_pixels: float, img_num: int) -> TransformExtremes:
    t = ImageTransform(max_size, min_size, stride, max_pixels)
    sides = _probe_sides(max_size, min_size, stride)
    best_side = best_tok = 0
    min_tok = math.inf
    best_hw = (0, 0)
    for w in sides:
        for h in sides:
            oh, ow = t.target_size(w, h, img_num)
            tok = oh * ow // stride ** 2
            best_side = max(best_side, oh, ow)
            if tok > best_tok:
                best_tok, best_hw = tok, (oh, ow)
            min_tok = min(min_tok, tok)
    return TransformExtremes(max_side=best_side // stride, max_side_px=best_side, max_tokens=best_tok,
                             min_tokens=int(min_tok), max_hw=best_hw)


def transform_extremes(transform: ImageTransform, img_num: int = 1) -> TransformExtremes:
    """Largest / smallest output of ``transform`` over input sizes 1 px .. 16 x ``max_image_size`` (cached).

    The resize rule (spec §9.1) bounds the long side by ``max_image_size`` (snapped to the stride) and scales the short
    side up to ``min_image_size``; the probe grid includes the inputs that reach those bounds (squares at
    max_image_size, extreme aspect ratios), so ``max_side`` / ``max_tokens`` are reached by real inputs.
    """
    return _extremes(transform.max_size, transform.min_size, transform.stride, transform.max_pixels, img_num)


@dataclass(frozen=True)
class ImageGrid:
    """One transform of a group (``args_key`` in the grouped YAML) and the position table its images index: ``kind``
    "latent" (VAE images of t2i / edit; packer knobs ``vae_image_downsample`` px per latent, ``max_latent_size`` latents
    per side) or "ViT" (vlm, the edit ViT copy; ``vit_patch_size``, ``max_num_patch_per_side``)."""

    args_key: str
    transform: ImageTransform
    kind: str
    patch_knob: str
    table_knob: str


_LATENT_GRID = ("latent", "vae_image_downsample", "max_latent_size")
_VIT_GRID = ("ViT", "vit_patch_size", "max_num_patch_per_side")


def image_grids(group: GroupConfig) -> list[ImageGrid]:
    """The group's transforms with the table each feeds ([] without ``image_transform_args``)."""
    t = group.transform()
    if t is None:
        return []
    grids = [ImageGrid("image_transform_args", t, *(_LATENT_GRID if group.name in VAE_GROUPS else _VIT_GRID))]
    vt = group.vit_transform() if group.name == "unified_edit" else None
    if vt is not None:
        grids.append(ImageGrid("vit_image_transform_args", vt, *_VIT_GRID))
    return grids


def table_side(transform: ImageTransform, patch: int) -> int:
    """Position-table side (patches of ``patch`` px) that holds the largest image ``transform`` produces."""
    return math.ceil(transform_extremes(transform).max_side_px / patch)


@dataclass(frozen=True)
class GroupBounds:
    """Transform-derived bounds of one group's sample estimates (tokens, including the +2 per plan item)."""

    #: The smallest estimate any sample can have (smallest images, empty texts where the reader allows them).
    smallest: int
    #: The estimate of the simplest sample built from the largest images the transform can produce (longer texts and
    #: more images only add to it), and how it is made up.
    largest_image: int
    detail: str


def group_bounds(group: GroupConfig) -> GroupBounds | None:
    """Bounds of ``group``'s estimates from its transforms, or None without ``image_transform_args``.

    t2i: 1 text + 1 VAE image (2 items); unified_edit: context VAE + ViT copy, 1 text, target VAE (4 items, the shortest
    edit); vlm_sft: 1 ViT image + 1 answer text (the smallest sample is text only, at least one token: 3).
    """
    t = group.transform()
    if t is None:
        return None
    ex = transform_extremes(t)
    if group.name == "t2i_pretrain":
        return GroupBounds(t2i_outcomes(ex.min_tokens, [0])[0].lo, t2i_outcomes(ex.max_tokens, [0])[0].lo,
                           f"largest image {ex.max_hw[1]}x{ex.max_hw[0]} px = {ex.max_tokens} latent tokens + 2 x 2")
    if group.name == "unified_edit":
        vt = group.vit_transform()
        vex = transform_extremes(vt) if vt is not None else None
        vmax, vmin = (vex.max_tokens, vex.min_tokens) if vex else (0, 0)
        no_text = lambda *_: Text(0, 0, 0.0)  # noqa: E731 - an empty instruction (encodes to nothing)
        small = edit_outcomes([ex.min_tokens] * 2, [vmin] * 2, no_text, no_text)[0].lo
        large = edit_outcomes([ex.max_tokens] * 2, [vmax] * 2, no_text, no_text)[0].lo
        return GroupBounds(small, large, f"largest edit step: 2 x {ex.max_tokens} latent + {vmax} ViT tokens + 4 x 2")
    return GroupBounds(vlm_outcome([("text", 1)], []).lo, vlm_outcome([("image", 0), ("text", 1)], [ex.max_tokens]).lo,
                       f"largest image {ex.max_hw[1]}x{ex.max_hw[0]} px = {ex.max_tokens} ViT tokens + a 1-token "
                       "answer + 2 x 2")


def video_bounds(group: GroupConfig) -> tuple[int, str] | None:
    """Video records (issue 40): the estimate of the largest video sample a vlm group's ``frame_sampler_args`` and
    transform allow — ``n`` frames (``min_num_frames <= n <= max_num_frames``), each the largest frame the transform
    produces at ``img_num = n``, and a 1-token answer — with its description; None without video settings."""
    args, t = group.frame_sampler_args, group.transform()
    if group.name != "vlm_sft" or not args or t is None:
        return None
    lo, hi = int(args.get("min_num_frames", 1)), int(args.get("max_num_frames", 0))
    best = None
    for n in range(max(1, lo), hi + 1):
        ex = transform_extremes(t, img_num=n)
        est = vlm_outcome([("image", 0)] * n + [("text", 1)], [ex.max_tokens] * n).lo
        if best is None or est > best[0]:
            best = (est, f"{n} frames of {ex.max_hw[1]}x{ex.max_hw[0]} px = {n} x {ex.max_tokens} ViT tokens + a "
                         f"1-token answer + {n + 1} x 2")
    return best


# --------------------------------------------------------------------------------------------------
# Config-time checks


@dataclass(frozen=True)
class BudgetIssue:
    """One finding of the budget checks."""

    level: str    # "error" (cannot work) or "warning" (may drop much / waste)
    key: str      # the config key to change
    message: str  # what happens and what to change

    def __str__(self) -> str:
        return f"{self.level}: {self.message}"


def mandatory_overflow(packer: PackerConfig, mandatory_groups: int) -> int:
    """The tokens ``mandatory_groups`` mandatory samples alone can put into one pack (``lengths.mandatory_tokens``)
    when that exceeds ``packer.max_num_tokens`` (case B6), else 0."""
    worst = mandatory_tokens(mandatory_groups, packer.max_num_tokens_per_sample)
    return worst if worst > packer.max_num_tokens else 0


def loop_refuses_overflow(packer: PackerConfig) -> bool:
    """Whether ``packer``'s loop refuses budgets with a :func:`mandatory_overflow` (``packer.lossless`` and
    ``packer.strategy: balanced`` promise that every pack obeys ``max_num_tokens``; the official loop does not)."""
    return packer.lossless or packer.strategy == "balanced"


@dataclass(frozen=True)
class _Check:
    """What a rule reads: the packer, the groups, where messages point (``source``: the grouped YAML, ``pw``: the
    packer's key prefix) and whether the order is ``official``."""

    packer: PackerConfig
    groups: list[GroupConfig]
    source: str
    pw: str
    official: bool


def _grid_rule(c: _Check, g: GroupConfig) -> list[BudgetIssue]:
    """Each transform of ``g`` against the position table it indexes (case B4)."""
    issues: list[BudgetIssue] = []
    where = f"{c.source}: group {g.name!r}"
    for grid in image_grids(g):
        key, t, kind = grid.args_key, grid.transform, grid.kind
        patch, table = getattr(c.packer, grid.patch_knob), getattr(c.packer, grid.table_knob)
        patch_key, table_key = f"{c.pw}.{grid.patch_knob}", f"{c.pw}.{grid.table_knob}"
        if t.stride % patch:
            issues.append(BudgetIssue("error", key, f"{where}: {key}.image_stride {t.stride} is not a multiple of "
                                      f"{patch_key} {patch}: image sides would not split into whole {kind} patches; "
                                      f"set image_stride to {patch}"))
            continue
        if t.stride != patch:
            issues.append(BudgetIssue("warning", key, f"{where}: {key}.image_stride {t.stride} differs from "
                                      f"{patch_key} {patch}: the packer's token estimates (H*W/stride^2) undercount "
                                      f"the {kind} tokens by {(t.stride // patch) ** 2}x"))
        side = table_side(t, patch)  # exact: the stride is a multiple of the patch
        if side > table and not c.packer.interpolate_pos:
            issues.append(BudgetIssue("error", table_key, (
                f"{where}: {key} (max_image_size {t.max_size}, stride {t.stride}) produces images up to "
                f"{transform_extremes(t).max_side_px} px = {side} {kind} patches per side, but {table_key} is "
                f"{table}: {kind} position ids reach {(side - 1) * table + side - 1} in a {table}x{table} = "
                f"{table * table}-entry table (out of range / aliased rows). Set {table_key} >= {side}, or "
                f"max_image_size <= {table * patch}, or interpolate_pos: true")))
    return issues


def _sample_limit_rule(c: _Check, g: GroupConfig) -> list[BudgetIssue]:
    """``g``'s smallest sample over ``max_num_tokens_per_sample`` (error) or its largest image (warning, B3)."""
    b = group_bounds(g)
    if b is None:
        return []
    pw, limit, where = c.pw, c.packer.max_num_tokens_per_sample, f"{c.source}: group {g.name!r}"
    too_big = functools.partial(is_overlength, limit=limit, mandatory=g.is_mandatory)
    bound = f"< {limit}" if g.is_mandatory else f"<= {limit}"
    kind = "mandatory group" if g.is_mandatory else "group"
    if too_big(b.smallest):
        return [BudgetIssue("error", f"{pw}.max_num_tokens_per_sample", (
            f"{where}: even the smallest sample this {kind} can produce is estimated at {b.smallest} tokens, "
            f"but {pw}.max_num_tokens_per_sample {limit} keeps only estimates {bound}: every sample is "
            f"dropped{' and the packer never yields a batch' if g.is_mandatory else ''}. Raise "
            f"{pw}.max_num_tokens_per_sample above {b.smallest} or lower image_transform_args.min_image_size"))]
    if not too_big(b.largest_image):
        return []
    side = transform_extremes(g.transform()).max_side_px
    return [BudgetIssue("warning", f"{pw}.max_num_tokens_per_sample", (
        f"{where}: a sample with the largest image this transform produces ({b.detail}) is estimated at "
        f">= {b.largest_image} tokens, over {pw}.max_num_tokens_per_sample {limit} (kept: {bound}); such "
        f"samples are dropped"
        + (" - if most images of this mandatory group are that large (e.g. all at least "
           f"{side}x{side} px), the packer drops them one after another and never yields a batch"
           if g.is_mandatory else "")
        + f". Raise {pw}.max_num_tokens_per_sample to >= {b.largest_image + (1 if g.is_mandatory else 0)} "
        f"(and max_num_tokens accordingly) or lower image_transform_args.max_image_size; "
        f"`bagel-data stats` counts the affected samples"))]


def _mandatory_overflow_rule(c: _Check) -> list[BudgetIssue]:
    """Mandatory samples alone overflowing ``max_num_tokens`` (case B6): an error where the loop refuses it or the
    order is elastic; a warning for ``data.order: official`` with the official loop, which reproduces the
    official stream, whose configs may carry this risk (it only bites when large mandatory samples meet)."""
    p, pw, limit = c.packer, c.pw, c.packer.max_num_tokens_per_sample
    mandatory = [g.name for g in c.groups if g.is_mandatory]
    worst = mandatory_overflow(p, len(mandatory))
    if not worst:
        return []
    fit = p.max_num_tokens // len(mandatory) + 1
    return [BudgetIssue("warning" if c.official and not loop_refuses_overflow(p) else "error",
                        f"{pw}.max_num_tokens_per_sample", (
        f"{c.source}: {len(mandatory)} mandatory groups {mandatory} each put one sample of up to "
        f"{pw}.max_num_tokens_per_sample - 1 = {limit - 1} tokens into every pack, and mandatory samples are "
        f"not checked against {pw}.max_num_tokens (official behaviour): one pack can reach "
        f"{worst} > max_num_tokens {p.max_num_tokens} (negative flex padding; the job's "
        f"batch-contract check stops the run at the first such pack). Set {pw}.max_num_tokens_per_sample "
        f"<= {fit}, or {pw}.max_num_tokens >= {worst}, or make fewer groups is_mandatory"))]


def _flex_block_rule(c: _Check) -> list[BudgetIssue]:
    """``max_num_tokens`` not a multiple of the FlexAttention block (warning)."""
    p, pw = c.packer, c.pw
    if not p.use_flex or not p.max_num_tokens % FLEX_BLOCK:
        return []
    up = -(-p.max_num_tokens // FLEX_BLOCK) * FLEX_BLOCK
    return [BudgetIssue("warning", f"{pw}.max_num_tokens", (
        f"{pw}.max_num_tokens {p.max_num_tokens} is not a multiple of {FLEX_BLOCK} with use_flex: every pack is "
        f"padded to it and FlexAttention works in {FLEX_BLOCK}-token blocks; use {up} or {up - FLEX_BLOCK}"))]


def _video_rule(c: _Check, g: GroupConfig) -> list[BudgetIssue]:
    """A video record of ``g`` (issue 40: its largest frame count at its largest frames) over
    ``max_num_tokens_per_sample`` (warning: such samples are dropped)."""
    video, pw, limit = video_bounds(g), c.pw, c.packer.max_num_tokens_per_sample
    if video is None or not is_overlength(video[0], limit=limit, mandatory=g.is_mandatory):
        return []
    return [BudgetIssue("warning", f"{pw}.max_num_tokens_per_sample", (
        f"{c.source}: group {g.name!r}: a video record of {video[1]} is estimated at >= {video[0]} tokens, over "
        f"{pw}.max_num_tokens_per_sample {limit} (kept: {'<' if g.is_mandatory else '<='} {limit}); such samples "
        f"are dropped. Raise {pw}.max_num_tokens_per_sample or lower frame_sampler_args.max_num_frames; "
        "`bagel-data stats` counts the affected samples"))]


#: The budget rules, in message order: per group, then for the whole packer. ``budget_issues`` (config validation,
#: ``bagel-data stats``' findings and advice) runs them all; the simulators of ``bagel-data stats`` refuse budgets
#: by the same :func:`mandatory_overflow` / :func:`loop_refuses_overflow`.
GROUP_RULES = (_grid_rule, _sample_limit_rule, _video_rule)
PACKER_RULES = (_mandatory_overflow_rule, _flex_block_rule)


def budget_issues(packer: PackerConfig, groups: Sequence[GroupConfig | ResolvedGroup], *,
                  source: str = "groups", packer_where: str = "packer", official: bool = False) -> list[BudgetIssue]:
    """Every budget finding for ``packer`` and ``groups`` (errors first), without logging or raising.

    ``source`` names the grouped YAML in messages, ``packer_where`` the packer's key prefix (``packer`` in a
    data config, ``data.packer`` in a job config). ``packer`` is assumed valid (``PackerConfig.validate``).
    """
    c = _Check(packer, [g.group if isinstance(g, ResolvedGroup) else g for g in groups], source, packer_where,
               official)
    issues = [i for g in c.groups for rule in GROUP_RULES for i in rule(c, g)]
    issues += [i for rule in PACKER_RULES for i in rule(c)]
    issues.sort(key=lambda i: i.level != "error")
    return issues


def log_warnings(issues: Sequence[BudgetIssue]) -> list[BudgetIssue]:
    """Log each warning of ``issues`` once per process (validating the same config twice warns once); return them."""
    warnings = [i for i in issues if i.level == "warning"]
    for w in warnings:
        if w.message not in _warned:
            _warned.add(w.message)
            logger.warning("%s", w.message)
    return warnings

