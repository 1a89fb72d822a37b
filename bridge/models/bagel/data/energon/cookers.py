"""Energon cookers for the BAGEL groups and the task encoder that selects them by subflavor.

A cooker turns a crude converted sample (raw bytes, ``decoder = None``) into a :class:`BagelSample`
with the official per-sample processing (see ``cook_t2i`` / ``cook_edit`` / ``cook_vlm``).

Randomness: the official datasets draw from the global ``random`` module of the worker. Inside
Energon each sample instead draws from a private ``random.Random`` seeded by (group, Energon worker
seed, sample index): the same kind of calls, but deterministic per sample, so save/restore is exact
with and without worker processes and the trainer's global RNG streams are never touched. Under
:func:`replaying` (what ``restore_sample`` uses) the recorded choices are replayed and nothing is drawn.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Mapping
from typing import Any

from megatron.energon import Cooker, DefaultTaskEncoder, WorkerConfig

from ..transforms import ImageTransform
from .cook_common import CookContext, Draws, cook_with, current_draw, current_replay
from .cook_edit import cook_edit_core
from .cook_t2i import cook_t2i_core
from .cook_vlm import cook_vlm_core
from .layout import EDIT, GROUPS, SUBFLAVOR_KEY, T2I, VLM
from .sample import BagelSample

__all__ = ["BagelTaskEncoder", "GroupCooker", "CORES", "make_cook_context", "make_cooker", "energon_worker_id"]

#: The cooker core of each group: ``core(crude, meta, ctx, draws) -> official fields`` (or DropSample).
CORES: dict[str, Callable[..., dict]] = {T2I: cook_t2i_core, EDIT: cook_edit_core, VLM: cook_vlm_core}


def make_cook_context(group: str, tokenizer: Any, image_transform_args: Mapping[str, Any],
                      vit_image_transform_args: Mapping[str, Any] | None = None, *,
                      verify_checksums: bool = True) -> CookContext:
    """Build a group's context from the official YAML ``image_transform_args`` / ``vit_image_transform_args``;
    ``verify_checksums``: ``data.verify_checksums`` (``CookContext.verify_checksums``)."""
    if group not in CORES:
        raise ValueError(f"unknown BAGEL group {group!r}; expected one of {GROUPS}")
    if group == EDIT and vit_image_transform_args is None:
        raise ValueError(f"group {group!r} needs vit_image_transform_args (its ViT transform)")
    vit = ImageTransform(**vit_image_transform_args) if vit_image_transform_args is not None else None
    return CookContext(group=group, tokenizer=tokenizer, transform=ImageTransform(**image_transform_args),
                       vit_transform=vit, verify_checksums=verify_checksums)


def energon_worker_id(wc: WorkerConfig | None) -> int:
    """The rank-local Energon worker id of the sample being cooked (0 without worker processes)."""
    if wc is None or wc.num_workers == 0:
        return 0
    return wc.global_worker_id() - wc.rank * wc.num_workers


def _sample_rng(group: str, wc: WorkerConfig) -> random.Random:
    """Private generator of the sample being cooked: seeded by group, worker seed and sample index."""
    key = f"bagel-cook|{group}|{wc.worker_seed()}|{wc.active_worker_sample_index}".encode()
    return random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))


class GroupCooker:
    """Stateless Energon cook function of one group (see the module docstring for its randomness)."""

    __stateless__ = True  # what energon's ``@stateless`` marks; checked by ``cook_crude_sample``

    def __init__(self, ctx: CookContext) -> None:
        self.ctx = ctx
        self.core = CORES[ctx.group]
        self.__qualname__ = f"GroupCooker[{ctx.group}]"  # shows up in ``loader.config()``

    def __call__(self, crude: Mapping[str, Any]) -> BagelSample:
        wc = WorkerConfig.active_worker_config
        replay = current_replay()
        if replay is not None:
            draws = Draws(replay=replay)
        elif current_draw() is not None:  # the elastic reader's per-position generator
            draws = Draws(rng=current_draw())
        elif wc is None:
            raise RuntimeError(f"{self.__qualname__} called outside an Energon worker context without replay; "
                               "use cook_with(...) with explicit Draws instead")
        else:
            draws = Draws(rng=_sample_rng(self.ctx.group, wc))
        return cook_with(self.core, crude, self.ctx, draws, energon_worker_id(wc))


def make_cooker(group: str, tokenizer: Any, image_transform_args: Mapping[str, Any],
                vit_image_transform_args: Mapping[str, Any] | None = None, *, verify_checksums: bool = True) -> Cooker:
    """Energon ``Cooker`` for ``group``, matched on subflavor ``bagel_group: <group>``."""
    ctx = make_cook_context(group, tokenizer, image_transform_args, vit_image_transform_args,
                            verify_checksums=verify_checksums)
    return Cooker(GroupCooker(ctx), has_subflavors={SUBFLAVOR_KEY: group})


class BagelTaskEncoder(DefaultTaskEncoder):
    """Task encoder of the BAGEL readers: raw bytes in (``decoder = None``), one cooker per group.

    ``groups`` maps group name → ``{"image_transform_args": ..., "vit_image_transform_args": ...}``.
    Samples pass through unbatched (the reader is used with ``batch_size=None``). Raw bytes are also what the
    checksums cover: ``verify_checksums`` checks every crude sample against them before cooking.
    """

    decoder = None

    def __init__(self, tokenizer: Any, groups: Mapping[str, Mapping[str, Any]], *,
                 verify_checksums: bool = True) -> None:
        super().__init__()
        if not groups:
            raise ValueError("BagelTaskEncoder needs at least one group")
        self.cookers = [
            make_cooker(g, tokenizer, args["image_transform_args"], args.get("vit_image_transform_args"),
                        verify_checksums=verify_checksums)
            for g, args in groups.items()
        ]
