"""Drop accounting: every sample the pipeline discards is counted by reason, never lost silently."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping

from .state import Savable

__all__ = ["DropCounter", "merge_counts"]


class DropCounter(Savable):
    """Counts dropped samples by reason and logs them through ``logging`` with a rate limit.

    The first drop of each reason is logged at WARNING; afterwards at most one summary line per
    ``warn_interval_s`` seconds. The counts are part of the stage's saved state.
    """

    _savable_fields = ("counts",)

    def __init__(self, name: str, logger: logging.Logger | None = None, warn_interval_s: float = 60.0) -> None:
        self.name = name
        self.logger = logger or logging.getLogger(__name__)
        self.warn_interval_s = warn_interval_s
        self._last_summary = 0.0
        self.reset_state()

    def reset_state(self) -> None:
        self.counts: dict[str, int] = {}

    def drop(self, reason: str, detail: str = "", n: int = 1) -> None:
        """Record ``n`` dropped samples for ``reason``; ``detail`` names the sample and what was wrong."""
        first = reason not in self.counts
        self.counts[reason] = self.counts.get(reason, 0) + n
        now = time.monotonic()
        if first:
            self.logger.warning("%s: dropped a sample (%s)%s", self.name, reason, f": {detail}" if detail else "")
        elif now - self._last_summary >= self.warn_interval_s:
            self._last_summary = now
            self.logger.warning("%s: dropped samples so far by reason: %s%s", self.name, dict(self.counts),
                                f" (latest: {detail})" if detail else "")
        else:
            self.logger.debug("%s: dropped a sample (%s): %s", self.name, reason, detail)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def merge_counts(counts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Sum several reason → count mappings (e.g. the packer's and every reader's)."""
    out: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + int(v)
    return dict(sorted(out.items()))
