"""Training-side telemetry for the data pipeline: what a user watches while BAGEL trains.

Per log interval: step, tokens/s, fill ratio (real tokens / max_num_tokens), samples per pack, group mix
against the configured weights, buffer occupancy, drops by reason and the time spent waiting in
``next()``; when a model trains, its loss (mean over the interval's steps) and the share of the step time spent
waiting for data. Written through ``logging`` and, when a directory is given, as TensorBoard scalars.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, Mapping

__all__ = ["Telemetry"]

logger = logging.getLogger(__name__)


class Telemetry:
    """Accumulates per-batch accounts and wait times; ``log`` emits one interval, ``summary`` the run."""

    def __init__(self, *, max_num_tokens: int, group_weights: Mapping[str, float], tensorboard_dir: str | None = None,
                 enabled: bool = True) -> None:
        self.max_num_tokens = max_num_tokens
        total = sum(group_weights.values()) or 1.0
        self.weight_share = {g: w / total for g, w in group_weights.items()}
        self.enabled = enabled
        self._writer = None
        if tensorboard_dir and enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(tensorboard_dir)
        self._t0 = self._tint = time.perf_counter()
        self.total = Counter()
        self.interval = Counter()
        self.groups_total: Counter = Counter()
        self.waits: list[float] = []
        self.interval_waits: list[float] = []
        self.step_seconds = 0.0                      # wall time of the steps (data + training), for the wait share
        self.losses: list[tuple[int, float]] = []    # (step, loss) of every trained step
        self.interval_metrics: dict[str, list[float]] = {}

    def record(self, account: Mapping[str, Any], wait_s: float) -> None:
        """Add one batch's account (``batch_check.account_batch``) and the time ``next()`` took."""
        for key in ("tokens", "padding", "ce_tokens", "mse_tokens", "samples", "images"):
            self.total[key] += account[key]
            self.interval[key] += account[key]
        self.total["batches"] += 1
        self.interval["batches"] += 1
        self.groups_total.update(account["groups"])
        self.waits.append(wait_s)
        self.interval_waits.append(wait_s)

    def record_step(self, step: int, metrics: Mapping[str, float]) -> None:
        """Add one trained step's scalars (``loss`` and whatever else the trainer reports)."""
        self.losses.append((step, float(metrics["loss"])))
        for key, value in metrics.items():
            self.interval_metrics.setdefault(key, []).append(float(value))

    def record_step_time(self, seconds: float) -> None:
        """Add one step's wall time (pulling its micro-batches and training on them)."""
        self.step_seconds += seconds

    def log(self, step: int, pipeline: Mapping[str, Any], global_tokens: int | None = None,
            extra: Mapping[str, float] | None = None) -> dict[str, float]:
        """Emit and reset the interval; ``pipeline`` holds buffer_len and drops (packer + readers); ``extra``: more
        scalars of the interval for TensorBoard and the return value (the straggler figures, ``job.straggler``)."""
        now = time.perf_counter()
        dt = max(now - self._tint, 1e-9)
        b = max(self.interval["batches"], 1)
        n_samples = max(sum(self.groups_total.values()), 1)
        mix = {g: self.groups_total.get(g, 0) / n_samples for g in self.weight_share}
        stats = {
            "tokens_per_s": (global_tokens if global_tokens is not None else self.interval["tokens"]) / dt,
            "fill_ratio": self.interval["tokens"] / (b * self.max_num_tokens),
            "samples_per_pack": self.interval["samples"] / b,
            "wait_ms_mean": 1000 * sum(self.interval_waits) / max(len(self.interval_waits), 1),
            "buffer_len": float(pipeline.get("buffer_len", 0)),
            **(extra or {}),
        }
        train = {f"train/{k}": sum(v) / len(v) for k, v in self.interval_metrics.items() if v}
        drops = dict(pipeline.get("drops", {}))
        unused = dict(pipeline.get("unused", {}))
        if self.enabled:
            logger.info(
                "step %d | %.0f tokens/s | fill %.3f | %.1f samples/pack | wait %.1f ms/batch | buffer %d | "
                "group mix %s (weights %s) | ignored record parts %s | drops %s", step, stats["tokens_per_s"], stats["fill_ratio"],
                stats["samples_per_pack"], stats["wait_ms_mean"], int(stats["buffer_len"]),
                {g: round(v, 3) for g, v in mix.items()}, {g: round(v, 3) for g, v in self.weight_share.items()},
                unused or "none", drops or "none")
            if train:
                logger.info("step %d | loss %.4f | %s", step, train["train/loss"],
                            " | ".join(f"{k[6:]} {v:.4g}" for k, v in train.items() if k != "train/loss"))
            if self._writer is not None:
                for key, value in train.items():
                    self._writer.add_scalar(key, value, step)
                for key, value in stats.items():
                    self._writer.add_scalar(f"data/{key}", value, step)
                for g, v in mix.items():
                    self._writer.add_scalar(f"data/group_mix/{g}", v, step)
                for reason, count in drops.items():
                    self._writer.add_scalar(f"data/drops/{reason}", count, step)
                self._writer.flush()
        self.interval = Counter()
        self.interval_waits = []
        self.interval_metrics = {}
        self._tint = now
        return {**stats, **train}

    def summary(self) -> dict[str, Any]:
        """Totals of the whole run (tokens, fill, wait mean/p95, group mix); ``wait_share``: time in ``next()`` over
        the steps' wall time; with a trainer, ``loss_first`` / ``loss_last`` (first and last step of this run)."""
        waits = sorted(self.waits)
        p95 = waits[min(len(waits) - 1, int(0.95 * len(waits)))] if waits else 0.0
        b = max(self.total["batches"], 1)
        n = max(sum(self.groups_total.values()), 1)
        return {
            "batches": self.total["batches"],
            "tokens": self.total["tokens"],
            "fill_ratio": self.total["tokens"] / (b * self.max_num_tokens),
            "ce_tokens": self.total["ce_tokens"],
            "mse_tokens": self.total["mse_tokens"],
            "samples": self.total["samples"],
            "wait_ms_mean": 1000 * sum(waits) / max(len(waits), 1),
            "wait_ms_p95": 1000 * p95,
            "group_mix": {g: self.groups_total.get(g, 0) / n for g in self.weight_share},
            "seconds": time.perf_counter() - self._t0,
            "wait_share": sum(waits) / self.step_seconds if self.step_seconds else 0.0,
            **({"loss_first": self.losses[0][1], "loss_last": self.losses[-1][1]} if self.losses else {}),
        }

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
