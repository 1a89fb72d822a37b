"""Elastic resize as pure data, dispatched by walking the live chain.

A restart on another DP size (``data.order: elastic``) turns every old rank's saved state into one new rank's. The
live loader of the new rank walks its chain: each stage's ``resize_state(olds, ctx)`` turns the old ranks' states of
*that* stage into its new state and hands its source's part on through ``ctx.resize(stage.source, ...)``. No
registry of stage names is involved: the live stages say how they resize.
"""

from __future__ import annotations

from typing import Any

from .protocol import StateError, tag_of

__all__ = ["ResizeContext"]


class ResizeContext:
    """The new rank a resize builds a state for: ``dp_rank`` of ``dp_size``, resize ``generation`` (the old one + 1),
    the run's ``seed``.

    ``same_world``: a budget change (``data.resume_budget_change``), not a resize: the world and this rank are
    unchanged and the olds handed to each stage are this rank's own old state only (one entry). Every stage keeps
    its counters (``carries_counters``) and the readers keep their blocks and cursors; the packer still hands its
    waiting samples to the readers, as in a resize. ``handed_over`` counts the samples the stages handed on to
    their sources (``note_handover``), for the caller's log line.
    """

    def __init__(self, dp_rank: int, dp_size: int, generation: int, seed: int, *, same_world: bool = False) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"resize: DP rank {dp_rank} out of range for DP size {dp_size}")
        self.dp_rank, self.dp_size, self.generation, self.seed = int(dp_rank), int(dp_size), int(generation), int(seed)
        self.same_world = bool(same_world)
        self.handed_over = 0

    @property
    def carries_counters(self) -> bool:
        """Whether this new rank carries the old counters (ledger, drops): new rank 0 of a resize (the world's sums),
        every rank in a ``same_world`` change (its own)."""
        return self.same_world or self.dp_rank == 0

    def note_handover(self, count: int) -> None:
        """Record that a stage handed ``count`` waiting samples back to its sources (``handed_over``)."""
        self.handed_over += int(count)

    def resize(self, stage: Any, tagged_olds: list[Any], **kw: Any) -> dict[str, Any]:
        """The new tagged state of the live ``stage`` from its tagged saved forms on every old rank
        (``{"stage", "state"}``, old-rank order), through ``stage.resize_state``. Raises ``StateError`` when the
        old ranks' states are of another stage than ``stage`` or of different stages."""
        tag = tag_of(stage)
        names = {t.get("stage") if isinstance(t, dict) else None for t in tagged_olds}
        if names != {tag}:
            raise StateError(f"resize: the old ranks' states hold {sorted(map(str, names))} where this pipeline has a "
                             f"{tag} (the pipeline was built differently)")
        resize = getattr(stage, "resize_state", None)
        if not callable(resize):
            raise StateError(f"resize: the {tag} stage cannot be resized to another DP size (its stream depends on the "
                             "DP size); restarts on another DP size need data.order: elastic")
        return {"stage": tag, "state": resize([t["state"] for t in tagged_olds], self, **kw)}
