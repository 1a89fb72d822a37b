"""An in-memory group source: a list of sample dicts with restore keys and declared state.

Useful for tests, benchmarks and small datasets held in memory; the Energon readers play the same role
for real data.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..state import Savable, StateError

__all__ = ["ListGroupSource"]

logger = logging.getLogger(__name__)


class ListGroupSource(Savable):
    """Iterates ``samples`` in order (optionally cycling), yielding shallow copies tagged with ``restore_key``.

    The restore key is the sample's list index, so ``restore_sample(key)`` rebuilds it exactly; the
    list's per-sample lists are copied so that consumers mutating them cannot corrupt the source.

    State: ``position`` (list entries read) and ``handover`` (restore keys handed over by an elastic resize,
    yielded first, in order; see ``resize_state``).
    """

    _savable_fields = ("position", "handover")

    def __init__(self, samples: Sequence[dict[str, Any]], *, cycle: bool = False, name: str = "list") -> None:
        if cycle and not samples:
            raise ValueError(f"ListGroupSource {name!r}: cannot cycle over an empty sample list")
        self.samples = samples
        self.cycle = cycle
        self.name = name
        self.reset_state()

    def reset_state(self) -> None:
        self.position = 0
        self.handover: list[int] = []

    def resize_state(self, olds: list[dict[str, Any]], ctx: Any, handover: Sequence[Any] = ()) -> dict[str, Any]:
        """The state of new rank ``ctx.dp_rank`` of ``ctx.dp_size`` from every old rank's state (old-rank order).

        An in-memory list has no shards: every rank holds its own copy, so new rank ``r`` continues old rank
        ``r``'s position (0 for a rank the old world did not have; the positions of ranks a shrunk world drops
        end with them). ``handover`` (restore keys = list indices of samples that were waiting in the old
        ranks' packers) is dealt round-robin, ``handover[dp_rank::dp_size]``, and yielded first, in order,
        after any handover the old rank ``r`` had not yielded yet. In a budget change (``ctx.same_world``)
        ``olds`` is this rank's own state alone: its position is kept and the whole handover appended. Raises
        ``StateError`` for malformed states.
        """
        rank, size = int(ctx.dp_rank), int(ctx.dp_size)
        if ctx.same_world:  # a budget change: this rank's own state alone, the handover appended
            olds, rank, size = list(olds)[:1], 0, 1
        for i, old in enumerate(olds):
            if not isinstance(old, dict) or set(old) != set(self._savable_fields):
                raise StateError(f"ListGroupSource.resize_state: old rank {i}'s state {old!r:.80} is not a "
                                 f"ListGroupSource state (fields {list(self._savable_fields)})")
        bad = [k for k in handover if not isinstance(k, int) or isinstance(k, bool)]
        if bad:
            raise StateError(f"ListGroupSource.resize_state: handover keys must be list indices, got {bad[:3]}")
        mine = olds[rank] if rank < len(olds) else {"position": 0, "handover": []}
        # the pending handover of old ranks that the new world lacks is dealt like the fresh one
        dealt = [*handover, *(k for old in olds[size:] for k in old["handover"])][rank::size]
        return {"position": int(mine["position"]), "handover": [int(k) for k in (*mine["handover"], *dealt)]}

    def identity(self) -> dict[str, Any]:
        return {"name": self.name, "num_samples": len(self.samples), "cycle": self.cycle}

    def __iter__(self) -> "ListGroupSource":
        return self

    def __next__(self) -> dict[str, Any]:
        if self.handover:
            return self.restore_sample(self.handover.pop(0))
        if self.position >= len(self.samples):
            if not self.cycle:
                raise StopIteration
            logger.info("ListGroupSource %r: starting over after %d samples", self.name, self.position)
        key = self.position % len(self.samples)
        self.position += 1
        return self.restore_sample(key)

    def restore_sample(self, key: int) -> dict[str, Any]:
        """Rebuild the sample at list index ``key``."""
        if not isinstance(key, int) or not 0 <= key < len(self.samples):
            raise KeyError(f"ListGroupSource {self.name!r}: no sample with restore key {key!r}")
        sample = dict(self.samples[key])
        sample["text_ids_list"] = [list(t) for t in sample["text_ids_list"]]
        sample["image_tensor_list"] = list(sample["image_tensor_list"])
        sample["restore_key"] = key
        return sample
