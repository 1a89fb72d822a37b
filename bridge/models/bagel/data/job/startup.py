"""Where a rank's start-up goes: seconds per phase from the process's start to its first training step.

A training team restarts jobs often (preemption, node failures, resizes); the minutes before the first step are
paid on every rank at every restart. ``StartupClock`` splits them into named phases, the job logs them once at the
first step (rank 0, with the slowest rank's total) and puts them in the summary (``startup_s``). Most of the time
on a CPU machine is imports the job's path needs (torch, Megatron-Core, Megatron-Bridge with Megatron-LM's
training package and nvidia-modelopt, which Bridge's data and checkpoint modules import): docs/monitoring.md.
``pause_gc`` / ``resume_gc`` keep Python's cyclic collector out of those imports (docs/performance.md).
"""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import Any

__all__ = ["StartupClock", "pause_gc", "process_start_time", "reduce_startup", "resume_gc"]

logger = logging.getLogger(__name__)

_gc_paused = False


def _enable_gc_in_child() -> None:
    """After a fork while paused: the child's collector is on (its start-up is not this process's)."""
    global _gc_paused
    if _gc_paused:
        _gc_paused = False
        gc.enable()


os.register_at_fork(after_in_child=_enable_gc_in_child)


def pause_gc() -> None:
    """Switch Python's cyclic garbage collector off for this rank's start-up, until ``resume_gc``.

    The start-up's imports create ~700k long-lived objects (torch, Megatron-Core, Megatron-Bridge, transformers),
    and the collector runs full (generation 2) passes over them while they are created: ~1.5 CPU s of a CPU rank's
    ~10 s start-up (docs/performance.md). This is the pattern of Python's ``gc.freeze`` documentation: disable
    early, freeze right before forking, enable again; a process forked while paused enables the collector in
    the child (``os.register_at_fork``). Nothing happens when the collector was already off (the caller's choice).
    """
    global _gc_paused
    if _gc_paused or not gc.isenabled():
        return
    gc.disable()
    _gc_paused = True


def resume_gc() -> None:
    """End ``pause_gc``: move what start-up created into the permanent generation (``gc.freeze``: never scanned
    again, and left out of the object walk every forked Energon worker does at its start) and enable the collector.
    Call it once the loader is built and before it forks (its workers and prefetch producer start at the first
    batch). A no-op when the collector was not paused by ``pause_gc``."""
    global _gc_paused
    if _gc_paused:
        _gc_paused = False
        gc.freeze()
        gc.enable()


def process_start_time() -> float | None:
    """Wall-clock time (``time.time()`` seconds) at which this process started, from Linux's ``/proc`` (10 ms
    resolution: the process's age is ``/proc/uptime`` minus its start tick in ``/proc/self/stat``); None where
    ``/proc`` cannot tell (not Linux)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime", encoding="ascii") as fh:
            uptime = float(fh.read().split()[0])
        now = time.time()
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat(5): starttime
    except (OSError, ValueError, IndexError):
        return None
    return now - max(0.0, uptime - started_after_boot)


class StartupClock:
    """Named phases of one rank's start-up, in seconds of wall-clock time, in the order they were marked.

    ``origin``: when the start-up began (``time.time()`` seconds); default the process's start
    (``process_start_time``), else the moment the clock is made. ``mark(phase)`` books the time since the previous
    mark (or the origin) to ``phase`` (added up when a phase is marked twice). ``seconds()``: ``{phase: s}``;
    ``total()``: origin to the last mark.
    """

    def __init__(self, origin: float | None = None) -> None:
        now = time.time()
        if origin is None:
            origin = process_start_time()
        self.origin = now if origin is None or origin > now else origin
        self._last = self.origin
        self._phases: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = time.time()
        self._phases[phase] = self._phases.get(phase, 0.0) + max(0.0, now - self._last)
        self._last = max(now, self._last)

    def seconds(self) -> dict[str, float]:
        return dict(self._phases)

    def total(self) -> float:
        return self._last - self.origin

    def report(self, slowest: tuple[int, float] | None = None) -> dict[str, Any]:
        """``{"total", "slowest_rank": {"rank", "ready"} (when given), "phases": {phase: s}}``, seconds rounded to
        10 ms (the summary's ``startup_s``)."""
        out: dict[str, Any] = {"total": round(self.total(), 2)}
        if slowest is not None:
            out["slowest_rank"] = {"rank": slowest[0], "ready": round(slowest[1], 2)}
        out["phases"] = {k: round(v, 2) for k, v in self._phases.items()}
        return out

    def line(self, slowest: tuple[int, float] | None = None) -> str:
        """One log line: total, the slowest rank and when it was ready, then every phase (seconds, one decimal)."""
        note = f" (slowest: rank {slowest[0]}, ready at {slowest[1]:.1f} s)" if slowest is not None else ""
        parts = ", ".join(f"{k} {v:.1f}" for k, v in self._phases.items())
        return f"start-up: {self.total():.1f} s from process start to the first step{note}: {parts} (s)"


def reduce_startup(clock: StartupClock, wait_phase: str = "waiting for the other ranks") -> tuple[int, float]:
    """The world's slowest start-up: ``(rank, seconds)`` of the rank that was ready last, where a rank's ready time
    is its start-up up to its last mark (``clock.total()``), before any wait for the others. Then marks
    ``wait_phase``: the time since that last mark, spent waiting for the other ranks (in the caller's collective
    before this call and in the two all-reduces here). Collective over the world: two all-reduces of one float64
    (the maximum, then the lowest rank that holds it); without an initialized process group ``(0, own)``."""
    import torch
    import torch.distributed as dist

    from .topology import collective_device

    ready = clock.total()
    if not (dist.is_available() and dist.is_initialized()):
        clock.mark(wait_phase)
        return 0, ready
    device = collective_device()
    slowest = torch.tensor([ready], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    mine = dist.get_rank() if ready == float(slowest.item()) else dist.get_world_size()
    who = torch.tensor([float(mine)], dtype=torch.float64, device=device)
    dist.all_reduce(who, op=dist.ReduceOp.MIN)
    clock.mark(wait_phase)
    return int(who.item()), float(slowest.item())
