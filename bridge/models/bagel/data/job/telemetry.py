"""Training-side telemetry for the data pipeline: what a user watches while BAGEL trains.

Per log interval, over every DP rank (``world.reduce_world``): step, tokens/s, fill ratio (real tokens /
max_num_tokens), samples per pack, the time spent waiting in ``next()`` (mean and the worst rank's), buffer
occupancy, completed epochs and epochs read per group (elastic order), group mix against the configured weights,
ignored record parts and drops by reason (and on how many ranks); when a model trains, its loss (mean over the
interval's steps). Written by rank 0 through ``logging`` and, when a directory is given, as TensorBoard scalars.
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
        counts = {k: account[k] for k in ("tokens", "padding", "ce_tokens", "mse_tokens", "samples", "images")}
        for counter in (self.total, self.interval):
            counter.update(counts, batches=1)
        self.groups_total.update(account["groups"])
        self.waits.append(wait_s)
        self.interval_waits.append(wait_s)

    def record_step(self, step: int, metrics: Mapping[str, float]) -> None:
        """Add one trained step's scalars (``loss`` and whatever else the trainer reports)."""
        self.losses.append((step, float(metrics["loss"])))
        for key, value in metrics.items():
            self.interval_metrics.setdefault(key, []).append(float(value))

    def local(self, *, p95: bool = False) -> dict[str, Any]:
        """This rank's counters for ``world.reduce_world``: the interval's (``interval_*``) and the run's tokens,
        samples, batches, CE / MSE tokens, wait seconds and count and samples per group; with ``p95`` also the
        run's p95 wait (s: a sort of every wait so far, so only for the summary, not every interval)."""
        out = {"interval_tokens": self.interval["tokens"], "interval_samples": self.interval["samples"],
               "interval_batches": self.interval["batches"], "interval_wait_s": sum(self.interval_waits),
               "interval_waits": len(self.interval_waits), "tokens": self.total["tokens"],
               "samples": self.total["samples"], "batches": self.total["batches"],
               "ce_tokens": self.total["ce_tokens"], "mse_tokens": self.total["mse_tokens"],
               "wait_s": sum(self.waits), "waits": len(self.waits), "group_samples": dict(self.groups_total)}
        if p95:
            waits = sorted(self.waits)
            out["wait_p95_s"] = waits[min(len(waits) - 1, int(0.95 * len(waits)))] if waits else 0.0
        return out

    def log(self, step: int, world: Mapping[str, Any], extra: Mapping[str, float] | None = None) -> dict[str, float]:
        """Emit and reset the interval. ``world``: ``world.reduce_world`` over the DP ranks (every rank's tokens,
        samples, waits, drops, epochs; an empty mapping: this rank's own counters); ``extra``: more scalars of the
        interval for TensorBoard and the return value (the straggler figures, ``job.straggler``)."""
        now = time.perf_counter()
        dt = max(now - self._tint, 1e-9)
        counts = world or self.local()  # reduce_world's keys are local()'s, summed over the ranks
        tokens = counts["interval_tokens"]
        b = max(counts["interval_batches"], 1)
        group_samples = counts["group_samples"]
        n_samples = max(sum(group_samples.values()), 1)
        mix = {g: group_samples.get(g, 0) / n_samples for g in self.weight_share}
        wait_mean = 1000 * counts["interval_wait_s"] / max(counts["interval_waits"], 1)
        stats = {
            "tokens_per_s": tokens / dt,
            "fill_ratio": tokens / (b * self.max_num_tokens),
            "samples_per_pack": counts["interval_samples"] / b,
            "wait_ms_mean": wait_mean,
            "wait_ms_worst": counts.get("wait_ms_worst", wait_mean),
            "buffer_len": float(world.get("buffer_len", 0)),
            **(extra or {}),
        }
        groups = world.get("groups", {})
        epochs = {g: (v["epoch"], v["epochs_read"]) for g, v in groups.items() if v.get("epoch") is not None}
        train = {f"train/{k}": sum(v) / len(v) for k, v in self.interval_metrics.items() if v}
        drops = dict(world.get("drops", {}))
        unused = dict(world.get("unused", {}))
        dp = world.get("dp_size", 1)
        if self.enabled:
            epoch_part = (" | epochs " + ", ".join(f"{g} {e} ({r:.2f})" for g, (e, r) in epochs.items())
                          if epochs else "")
            drop_part = (f"{drops} on {world.get('drop_ranks', 0)} of {dp} ranks" if drops else "none")
            logger.info(
                "step %d | %.0f tokens/s | fill %.3f | %.1f samples/pack | wait %.1f ms/batch (worst rank %.1f) | "
                "buffer %d%s | group mix %s (weights %s) | ignored record parts %s | drops %s", step,
                stats["tokens_per_s"], stats["fill_ratio"], stats["samples_per_pack"], stats["wait_ms_mean"],
                stats["wait_ms_worst"], int(stats["buffer_len"]), epoch_part,
                {g: round(v, 3) for g, v in mix.items()}, {g: round(v, 3) for g, v in self.weight_share.items()},
                unused or "none", drop_part)
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
                for g, (e, r) in epochs.items():
                    self._writer.add_scalar(f"data/epoch/{g}", e, step)
                    self._writer.add_scalar(f"data/epochs_read/{g}", r, step)
                for reason, count in drops.items():
                    self._writer.add_scalar(f"data/drops/{reason}", count, step)
                self._writer.flush()
        self.interval = Counter()
        self.interval_waits = []
        self.interval_metrics = {}
        self._tint = now
        return {**stats, **train}

    def summary(self, world: Mapping[str, Any]) -> dict[str, Any]:
        """The run in a few hundred bytes at any world size or partition count: ``world`` (``reduce_world`` at
        the end) gives every rank's tokens, fill, samples, waits (mean; the worst rank's p95), the group mix,
        ``drops`` / ``unused`` by reason and ``groups`` (per group: completed ``epoch``, ``epochs_read``,
        ``consumed``, ``packed``, ``buffered``, ``dropped`` by reason); ``wait_share`` (rank 0: time in ``next()``
        over the steps' wall time); with a trainer, ``loss_first`` / ``loss_last`` (first and last step of this
        run)."""
        b = max(world["batches"], 1)
        n = max(sum(world["group_samples"].values()), 1)
        return {
            "dp_size": world["dp_size"],
            "batches": world["batches"],
            "tokens": world["tokens"],
            "fill_ratio": round(world["tokens"] / (b * self.max_num_tokens), 4),
            "ce_tokens": world["ce_tokens"],
            "mse_tokens": world["mse_tokens"],
            "samples": world["samples"],
            "wait_ms_mean": round(1000 * world["wait_s"] / max(world["waits"], 1), 2),
            "wait_ms_p95_worst": round(world["wait_ms_p95_worst"], 2),
            "group_mix": {g: round(world["group_samples"].get(g, 0) / n, 4) for g in self.weight_share},
            "seconds": round(time.perf_counter() - self._t0, 2),
            "wait_share": round(sum(self.waits) / self.step_seconds, 4) if self.step_seconds else 0.0,
            **({"loss_first": self.losses[0][1], "loss_last": self.losses[-1][1]} if self.losses else {}),
            "drops": world["drops"],
            "unused": world["unused"],
            "groups": world["groups"],
        }

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
