"""Drop accounting: every sample the pipeline discards is counted by reason, never lost silently."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping

from .errors import DataStallError
from .state import Savable

__all__ = ["ALWAYS_WARN", "DataStallError", "DropCounter", "StallWatch", "merge_counts"]

#: Drop reasons logged at WARNING every time (each names a damaged file a person must act on, and they are rare:
#: a damaged shard stops the job past a threshold), not rate-limited like the others.
ALWAYS_WARN: frozenset[str] = frozenset({"checksum_mismatch"})


class DropCounter(Savable):
    """Counts dropped samples (or unused parts of samples, ``what=``) by reason, logged with a rate limit.

    The first drop of each reason is logged at WARNING; afterwards at most one summary line per
    ``warn_interval_s`` seconds, except for the reasons in ``ALWAYS_WARN`` (one WARNING line each). The counts are
    part of the stage's saved state.
    """

    _savable_fields = ("counts",)
    warn_interval_s = 60.0

    def __init__(self, name: str, logger: logging.Logger | None = None, *, what: str = "dropped a sample") -> None:
        self.name, self.what = name, what
        self.logger = logger or logging.getLogger(__name__)
        self._last_summary = 0.0
        self.reset_state()

    def reset_state(self) -> None:
        self.counts: dict[str, int] = {}

    def drop(self, reason: str, detail: str = "", n: int = 1) -> None:
        """Record ``n`` dropped samples for ``reason``; ``detail`` names the sample and what was wrong."""
        first = reason not in self.counts
        self.counts[reason] = self.counts.get(reason, 0) + n
        now = time.monotonic()
        if first or reason in ALWAYS_WARN:
            self.logger.warning("%s: %s (%s)%s", self.name, self.what, reason, f": {detail}" if detail else "")
        elif now - self._last_summary >= self.warn_interval_s:
            self._last_summary = now
            self.logger.warning("%s: %s — counts so far by reason: %s%s", self.name, self.what, dict(self.counts),
                                f" (latest: {detail})" if detail else "")
        else:
            self.logger.debug("%s: %s (%s): %s", self.name, self.what, reason, detail)

    @property
    def total(self) -> int:
        """All drops counted, over every reason."""
        return sum(self.counts.values())


def merge_counts(counts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Sum several reason → count mappings (e.g. the packer's and every reader's)."""
    out: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + int(v)
    return dict(sorted(out.items()))


class StallWatch:
    """The liveness rule: ``limit`` consecutive drops from one source without a usable sample is an error.

    ``drop(source, reason, detail)`` counts a drop in ``source``'s current streak (and keeps the first detail of
    each reason as an example); ``ok(source)`` ends the streak. When a streak exceeds ``limit``,
    ``DataStallError`` is raised with ``describe(source)`` (where) + the dominant reason + an example + ``hint``.
    Streaks are diagnostics, not stream state: they restart at zero after a restore.
    """

    def __init__(self, what: str, hint: str) -> None:
        self.what, self.hint = what, hint
        self._streaks: dict[str, dict[str, int]] = {}
        self._examples: dict[str, dict[str, str]] = {}

    def ok(self, source: str) -> None:
        """A usable sample came from ``source``: its streak ends."""
        self._streaks.pop(source, None)
        self._examples.pop(source, None)

    def drop(self, source: str, reason: str, detail: str, *, limit: int, where: str) -> None:
        """Count one drop; raise ``DataStallError`` once ``source`` dropped more than ``limit`` in a row."""
        streak = self._streaks.setdefault(source, {})
        streak[reason] = streak.get(reason, 0) + 1
        self._examples.setdefault(source, {}).setdefault(reason, detail)
        total = sum(streak.values())
        if total > limit:
            reason, count = max(streak.items(), key=lambda kv: kv[1])
            raise DataStallError(
                f"{self.what} {where}: {total} samples in a row were dropped and none was usable (limit {limit}), "
                f"so this source can never yield a sample. Dominant reason: {reason} ({count} of {total}), e.g. "
                f"{self._examples[source][reason]}. All reasons: {dict(sorted(streak.items()))}. {self.hint}")
