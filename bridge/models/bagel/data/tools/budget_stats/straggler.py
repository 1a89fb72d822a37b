"""The length-level simulator, and the straggler prediction: data-parallel ranks packing on their own.

:func:`simulate_ranks` (the one simulator of ``bagel-data stats``: the budget advisor,
:func:`.simulate.simulate_packing`, is its DP 1) runs the packer's own loop for ``dp`` ranks
(``packing.step.PackLoop`` for ``packer.strategy: official``, ``packing.balance.BalancedLoop`` for ``balanced``),
each rank on its own streams and its own group draws, where a sample is its estimate (tokens) and its cost (FLOPs,
``packing.cost.CostModel.cost``); step ``s`` is pack ``s`` of every rank. It reports what a step loses to the
slowest rank, tokens per pack, how long samples wait, the group mix against the draw and the loop's CPU time
per pack. ``scripts/bench_balance.py`` calls it; ``bagel-data stats`` through :func:`predict` (both strategies
on a config's datasets, from their metadata).

Known approximations: CFG dropout is ignored (as in :func:`.simulate.simulate_packing`); a step is one pack per
rank (one micro-batch); the cost model is FLOPs, not time (see ``packing.cost``).
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from ...config import PackerConfig
from ...config.budgets import loop_refuses_overflow, mandatory_overflow
from ...config.lengths import is_overlength
from ...packing.balance import BalancedLoop, PoolBook
from ...packing.cost import CostModel, straggler_ratio
from ...packing.step import PackBudgets, PackLoop
from .estimate import GroupStats

__all__ = ["Prediction", "RankRun", "StragglerResult", "cycled", "predict", "simulate_ranks"]

#: A simulated sample: (estimate in tokens, cost in FLOPs), or (estimate, cost, packed length in tokens) when the
#: packed length is shorter than the official estimate (images no plan item uses, quirk §13.14).
Sample = tuple[int, float] | tuple[int, float, int]


def cycled(samples: Sequence[Sample], rng: random.Random) -> Iterator[Sample]:
    """``samples`` in an order shuffled by ``rng``, repeated forever (a rank's view of a group's epoch)."""
    order = list(samples)
    if not order:
        raise ValueError("cycled: a group with no sample cannot be drawn from")
    rng.shuffle(order)
    while True:
        yield from order


def _ratio(costs: Sequence[Sequence[float]]) -> tuple[float, float]:
    """``packing.cost.straggler_ratio`` of a ``[rank][step]`` cost table."""
    steps = list(zip(*costs))
    return straggler_ratio([max(st) for st in steps], [sum(st) / len(st) for st in steps])


class _NoPack(Exception):
    """A rank drew ``max_draws`` samples without completing its packs."""


class _Rank:
    """One simulated rank: ``packing.step.PackTarget`` and ``packing.balance.BalanceTarget`` over its streams
    (the one adapter of the length-level loops); ``max_draws``: samples it may draw (None: no limit);
    ``long_tokens``: the estimate from which a sample's wait also counts in ``waits_long``."""

    def __init__(self, sources: Sequence[Iterator[Sample]], rng: random.Random, max_draws: int | None,
                 long_tokens: int) -> None:
        self.sources, self.random, self.max_draws, self.long_tokens = sources, rng.random, max_draws, long_tokens
        self.curr = self.n = self.consumed = self.pack_index = 0
        self.pack_cost = 0.0
        self.kept = [Counter() for _ in sources]  # per group: samples / tokens drawn and not dropped
        self.packed = [Counter() for _ in sources]
        self.drops: Counter[str] = Counter()
        self.waits: list[int] = []
        self.waits_long: list[int] = []  # waits of samples of at least long_tokens

    def next_sample(self, group: int) -> list:
        if self.max_draws is not None and self.consumed >= self.max_draws:
            raise _NoPack
        est, cost, *length = next(self.sources[group])
        self.consumed += 1
        return [est, cost, self.pack_index, group, length[0] if length else est]

    @staticmethod
    def estimate(sample: list) -> int:
        return sample[0]

    @staticmethod
    def enter(sample: list) -> int:
        return 0

    @staticmethod
    def measure(sample: list, note: int) -> tuple[int, float]:
        return sample[4], sample[1]

    def add(self, group: int, sample: list, est: int, note: int = 0) -> None:
        self.curr += est
        self.n += 1
        self.pack_cost += sample[1]
        self.waits.append(self.pack_index - sample[2])
        if est >= self.long_tokens:
            self.waits_long.append(self.pack_index - sample[2])
        self.packed[group].update(samples=1, tokens=est)

    def drop(self, reason: str, group: int, sample: list, est: int, curr: int) -> None:
        self.drops[reason] += 1
        if reason not in ("overlength", "overlength_mandatory"):  # a flush drops a kept sample
            self.kept[group].update(flushed=1, flushed_tokens=est)


@dataclass
class RankRun:
    """One rank's packs: ``costs`` (FLOPs), ``tokens`` and ``samples`` per pack, warm-up included; ``consumed``:
    samples drawn."""

    costs: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    consumed: int = 0


@dataclass
class StragglerResult:
    """What :func:`simulate_ranks` measured for ``strategy`` on ``dp`` ranks, ``steps`` packs each after the
    warm-up: every rank's packs (``ranks``) and what they show, over the steps after ``warmup`` packs per rank
    except ``cold_*``, the waits, the mix and the drops, which count every pack."""

    strategy: str
    dp: int
    steps: int
    ranks: list[RankRun] = field(default_factory=list)
    #: ``ratio``: mean over steps of the slowest rank's pack cost over the mean; ``lost``: share of step time spent
    #: waiting for the slowest rank; ``cold_ratio`` / ``cold_lost``: the same over the warm-up steps (a fresh start)
    ratio: float = 1.0
    lost: float = 0.0
    cold_ratio: float = 1.0
    cold_lost: float = 0.0
    #: packs each packed sample waited between being drawn and being packed (``waits_long``: those of samples
    #: estimated at half ``max_num_tokens_per_sample`` or more)
    waits: list[int] = field(default_factory=list)
    waits_long: list[int] = field(default_factory=list)
    #: means per pack (tokens, FLOPs)
    tokens_per_pack: float = 0.0
    cost_per_pack: float = 0.0
    #: ``mix_dev``: the largest difference, over groups, between a group's share of the packed samples (or tokens)
    #: and its share of the samples drawn and kept (the weighted draw); ``shares``: per group (packed samples
    #: share, packed tokens share); ``drops``: dropped samples by reason
    mix_dev: float = 0.0
    shares: list[tuple[float, float]] = field(default_factory=list)
    drops: dict[str, int] = field(default_factory=dict)
    #: the loop's CPU time per pack (microseconds; sample streams included)
    cpu_us_per_pack: float = 0.0
    #: why a rank built fewer packs (``max_draws`` reached), None when every rank built them all
    stopped: str | None = None

    def wait_quantile(self, q: float, long: bool = False) -> int:
        """The ``q`` quantile of :attr:`waits` (or :attr:`waits_long`; packs; 0 without samples)."""
        w = sorted(self.waits_long if long else self.waits)
        return w[min(len(w) - 1, int(q * len(w)))] if w else 0


def _loop(packer: PackerConfig, weights: Sequence[float], mandatory: Sequence[bool]) -> PackLoop | BalancedLoop:
    budgets = PackBudgets.of(packer)
    if packer.strategy == "balanced":
        return BalancedLoop(budgets, weights, mandatory, target_tokens=packer.balanced_target_tokens,
                            max_wait=packer.balance.max_wait, lookahead=packer.balance.lookahead)
    return PackLoop(budgets, weights, mandatory, lossless=packer.lossless)


def simulate_ranks(make_sources: Callable[[int], Sequence[Iterator[Sample]]], weights: Sequence[float],
                   mandatory: Sequence[bool], packer: PackerConfig, *, dp: int, packs: int, warmup: int = 0,
                   seed: int = 0, rank_rng: Callable[[int], random.Random] | None = None,
                   max_draws: int | None = None) -> StragglerResult:
    """Simulate ``dp`` ranks building ``warmup + packs`` packs each with ``packer.strategy``'s loop.

    ``make_sources(rank)``: that rank's per-group streams of (estimate, cost) samples (infinite iterators;
    :func:`cycled` over a dataset's estimates). Group draws come from ``rank_rng(rank)`` (default
    ``random.Random(seed * 1_000_003 + rank)``). A rank that draws ``max_draws`` samples stops (``stopped``). The
    budgets are trusted (``config.validate.validate_data`` checks them).
    """
    loop = _loop(packer, weights, mandatory)
    n = len(weights)
    res = StragglerResult(packer.strategy, dp, packs)
    kept = [Counter() for _ in range(n)]
    packed = [Counter() for _ in range(n)]
    cpu = 0.0
    for r in range(dp):
        rng = rank_rng(r) if rank_rng is not None else random.Random(seed * 1_000_003 + r)
        rank = _Rank(make_sources(r), rng, max_draws, packer.max_num_tokens_per_sample // 2)
        buffer: list = []
        carry: list = []  # the official loop's carried candidates (packer.lossless)
        book = PoolBook(metrics=[])
        run = RankRun()
        t0 = time.process_time()
        try:
            for p in range(warmup + packs):
                rank.curr, rank.n, rank.pack_cost, rank.pack_index = 0, 0, 0.0, p
                loop.fill(rank, buffer, book if isinstance(loop, BalancedLoop) else carry)
                run.costs.append(rank.pack_cost)
                run.tokens.append(rank.curr)
                run.samples.append(rank.n)
        except _NoPack:
            res.stopped = f"no pack after {max_draws} draws"
        run.consumed = rank.consumed
        cpu += time.process_time() - t0
        res.ranks.append(run)
        res.waits += rank.waits
        res.waits_long += rank.waits_long
        res.drops = dict(Counter(res.drops) + rank.drops)
        waiting = Counter(g for g, _ in (*buffer, *carry))
        for g in range(n):
            # drawn and kept = packed + flushed + still waiting (each packed or waiting sample was drawn once)
            kept[g]["samples"] += rank.packed[g]["samples"] + rank.kept[g]["flushed"] + waiting[g]
            kept[g]["tokens"] += (rank.packed[g]["tokens"] + rank.kept[g]["flushed_tokens"]
                                  + sum(s[0] for gg, s in (*buffer, *carry) if gg == g))
            packed[g].update(rank.packed[g])
    res.ratio, res.lost = _ratio([run.costs[warmup:] for run in res.ranks])
    if warmup:
        res.cold_ratio, res.cold_lost = _ratio([run.costs[:warmup] for run in res.ranks])
    res.cost_per_pack = statistics.fmean([c for run in res.ranks for c in run.costs[warmup:]] or [0.0])
    res.tokens_per_pack = statistics.fmean([t for run in res.ranks for t in run.tokens[warmup:]] or [0.0])
    res.cpu_us_per_pack = 1e6 * cpu / max(dp * (warmup + packs), 1)
    tot = {k: sum(c[k] for c in packed) or 1 for k in ("samples", "tokens")}
    drawn = {k: sum(c[k] for c in kept) or 1 for k in ("samples", "tokens")}
    res.shares = [(packed[g]["samples"] / tot["samples"], packed[g]["tokens"] / tot["tokens"]) for g in range(n)]
    res.mix_dev = max((abs(packed[g][k] / tot[k] - kept[g][k] / drawn[k]) for g in range(n)
                       for k in ("samples", "tokens")), default=0.0)
    return res


@dataclass
class Prediction:
    """The straggler prediction at one DP size: the official and the balanced strategy on the same streams."""

    dp: int
    official: StragglerResult
    balanced: StragglerResult


def predict(groups: Sequence[GroupStats], packer: PackerConfig, *, dps: Sequence[int] = (8, 64), packs: int = 8,
            warmup: int = 10, seed: int = 0) -> list[Prediction] | str:
    """Both strategies at each DP size in ``dps`` on the groups' estimates (``bagel-data stats``): every rank
    draws from its own shuffle of each group's samples (mean estimate, cost of the expected work,
    ``packing.cost.CostModel.cost`` under ``packer.cost``), those over ``max_num_tokens_per_sample`` left out (the
    loops would drop them; a group left without samples is not drawn). Returns why no prediction can be made instead (a
    mandatory group without a usable sample, budgets a loop refuses)."""
    model = CostModel.of(packer.cost)
    limit = packer.max_num_tokens_per_sample
    # only samples the loops would keep: a group of over-length samples alone would be drawn from forever
    samples = [[(max(1, round(e.mean)), model.cost(e.work)) for e in g.estimates
                if not is_overlength(max(1, round(e.mean)), limit, mandatory=g.group.is_mandatory)] for g in groups]
    empty = [g.group.name for g, s in zip(groups, samples) if not s]
    if any(g.group.is_mandatory for g, s in zip(groups, samples) if not s):
        return (f"mandatory group(s) without a sample under max_num_tokens_per_sample {limit}: {empty} (no pack "
                "would ever be built)")
    weights = [g.group.weight if s else 0.0 for g, s in zip(groups, samples)]
    if not sum(weights) > 0:
        return "no usable samples"
    mandatory = [g.group.is_mandatory for g in groups]
    worst = mandatory_overflow(packer, sum(mandatory))
    if worst and loop_refuses_overflow(dataclasses.replace(packer, strategy="balanced")):  # the budget checks' rule
        return (f"{sum(mandatory)} mandatory samples of up to max_num_tokens_per_sample - 1 tokens ({worst}) could "
                f"overflow max_num_tokens {packer.max_num_tokens}: strategy balanced refuses these budgets")

    def sources(rank: int) -> list[Iterator[Sample]]:
        rng = random.Random(seed * 7919 + rank)
        return [cycled(s, rng) if s else iter(()) for s in samples]

    def run(dp: int, strategy: str) -> StragglerResult:
        return simulate_ranks(sources, weights, mandatory, dataclasses.replace(packer, strategy=strategy), dp=dp,
                              packs=packs, warmup=warmup, seed=seed)

    try:
        return [Prediction(dp, run(dp, "official"), run(dp, "balanced")) for dp in dps]
    except ValueError as exc:
        return str(exc)
