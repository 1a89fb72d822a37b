"""An in-memory group source: a list of sample dicts with restore keys and declared state.

Useful for tests, benchmarks and small datasets held in memory; the Energon readers play the same role
for real data.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..state import Savable

__all__ = ["ListGroupSource"]

logger = logging.getLogger(__name__)


class ListGroupSource(Savable):
    """Iterates ``samples`` in order (optionally cycling), yielding shallow copies tagged with ``restore_key``.

    The restore key is the sample's list index, so ``restore_sample(key)`` rebuilds it exactly; the
    list's per-sample lists are copied so that consumers mutating them cannot corrupt the source.
    """

    _savable_fields = ("position",)

    def __init__(self, samples: Sequence[dict[str, Any]], *, cycle: bool = False, name: str = "list") -> None:
        if cycle and not samples:
            raise ValueError(f"ListGroupSource {name!r}: cannot cycle over an empty sample list")
        self.samples = samples
        self.cycle = cycle
        self.name = name
        self.reset_state()

    def reset_state(self) -> None:
        self.position = 0

    def identity(self) -> dict[str, Any]:
        return {"name": self.name, "num_samples": len(self.samples), "cycle": self.cycle}

    def __iter__(self) -> "ListGroupSource":
        return self

    def __next__(self) -> dict[str, Any]:
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
