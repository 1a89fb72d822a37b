"""The straggler line of the main job: how long the data-parallel ranks wait for the slowest one.

In a data-parallel step every rank waits at the gradient all-reduce for the rank with the most compute. Each rank
records the estimated compute of its micro-batches per step (``packing.cost.CostModel.cost`` of
``packing.cost.batch_work``; FLOPs, from ``packer.cost``); the job's world reduce (``world.reduce_world``, whose
two all-reduces carry one float64 per step not yet reduced) takes their max and mean over the DP group, and
every logging interval the meter gives the **straggler ratio** (the slowest rank's compute over the mean, averaged
over the interval's steps; 1.0 = no rank waits) and the **lost share** (``sum(max - mean) / sum(max)``: the share
of step time the average rank spends waiting, if step time is proportional to compute). Whatever
``packer.strategy``: it measures what ``strategy: balanced`` removes. Estimated compute, not measured time (see
``packing/cost.py`` for what the model leaves out).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..config.schema import CostConfig
from ..packing.cost import CostModel, batch_work, straggler_ratio

__all__ = ["StragglerMeter", "StragglerStats"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StragglerStats:
    """One interval's compute per step over ``dp_size`` DP ranks (FLOPs): ``step_max[i]`` / ``step_mean[i]`` the
    slowest rank's and the mean rank's compute of the interval's ``i``-th step."""

    dp_size: int
    step_max: tuple[float, ...]
    step_mean: tuple[float, ...]

    @property
    def ratio(self) -> float:
        """Mean over the steps of max / mean (1.0 = no rank waits; ``packing.cost.straggler_ratio``)."""
        return straggler_ratio(self.step_max, self.step_mean)[0]

    @property
    def lost(self) -> float:
        """Share of step time the ranks spend waiting for the slowest: ``sum(max - mean) / sum(max)``."""
        return straggler_ratio(self.step_max, self.step_mean)[1]

    def scalars(self) -> dict[str, float]:
        """``straggler_ratio``, ``straggler_lost`` and ``tflops_per_step`` (the mean rank's, TFLOPs) for the
        interval's log and TensorBoard (``data/<name>``)."""
        mean = sum(self.step_mean) / len(self.step_mean) if self.step_mean else 0.0
        return {"straggler_ratio": self.ratio, "straggler_lost": self.lost, "tflops_per_step": mean / 1e12}


class StragglerMeter:
    """This rank's compute per training step; the world's figures booked as the job reduces them, logged every
    logging interval.

    ``cost``: the model the batches' compute is estimated for (``packer.cost``; default BAGEL-7B); ``enabled``:
    this rank logs the line (rank 0). Usage per step: :meth:`record` each micro-batch; whenever the job reduces
    over the DP group (every rank at the same step): :meth:`local` into ``world.reduce_world``, its result into
    :meth:`book`; per interval: :meth:`log` of :meth:`interval`.
    """

    def __init__(self, cost: CostConfig | None = None, *, enabled: bool = True) -> None:
        self.model = CostModel.of(cost)
        self.enabled = enabled
        self._steps: dict[int, float] = {}  # this rank's FLOPs per step not yet reduced
        self._max: list[float] = []   # the interval's reduced steps: the slowest rank's FLOPs ...
        self._mean: list[float] = []  # ... and the mean rank's
        self._dp_size = 1
        self._run_max: list[float] = []  # the run's logged steps: the slowest and the mean rank's FLOPs
        self._run_mean: list[float] = []

    def record(self, step: int, batch: Mapping[str, Any]) -> float:
        """Add one micro-batch of training step ``step`` (a packed batch, flex or dense); returns its FLOPs."""
        flops = self.model.cost(batch_work(batch))
        self._steps[step] = self._steps.get(step, 0.0) + flops
        return flops

    def local(self) -> list[float]:
        """This rank's FLOPs per step recorded since the last call, in step order: the vector the job's world
        reduce carries (every rank of the DP group recorded the same steps)."""
        out = [self._steps[s] for s in sorted(self._steps)]
        self._steps = {}
        return out

    def book(self, step_max: Sequence[float], step_mean: Sequence[float], dp_size: int) -> None:
        """Add the world's figures of :meth:`local`'s steps (``reduce_world``'s ``step_compute_max`` /
        ``step_compute_mean`` over ``dp_size`` DP ranks) to the current interval."""
        self._max += step_max
        self._mean += step_mean
        self._dp_size = dp_size

    def interval(self) -> StragglerStats:
        """The steps booked since the last call (one logging interval), and a new interval."""
        stats = StragglerStats(self._dp_size, tuple(self._max), tuple(self._mean))
        self._max, self._mean = [], []
        return stats

    def log(self, step: int, stats: StragglerStats) -> dict[str, float]:
        """Add the interval to the run's totals and log its line (when ``enabled``); returns ``stats.scalars()``
        (empty for an interval without steps)."""
        if not stats.step_max:
            return {}
        self._run_max += stats.step_max
        self._run_mean += stats.step_mean
        out = stats.scalars()
        if self.enabled:
            logger.info("step %d | straggler: compute max/mean over %d DP ranks %.4f, %.1f%% of step time waiting "
                        "for the slowest rank | %.1f TFLOPs per rank and step (estimated, packer.cost)", step,
                        stats.dp_size, out["straggler_ratio"], 100 * out["straggler_lost"], out["tflops_per_step"])
        return out

    def summary(self) -> dict[str, float | None]:
        """The run's ``straggler_ratio`` (mean over its steps) and ``straggler_lost``; None before any interval."""
        ratio, lost = straggler_ratio(self._run_max, self._run_mean)
        return {"straggler_ratio": ratio if self._run_max else None,
                "straggler_lost": lost if sum(self._run_max) > 0 else None}
