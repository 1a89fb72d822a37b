"""The balanced pack loop on lengths and costs (``packer.strategy: balanced``): every pack close to one compute
target, so that no data-parallel rank waits for another at the gradient all-reduce; the official loop
(:mod:`.step`) fills packs by tokens only, and attention grows with the square of a sample's length.

One definition for ``BalancedPacker`` and the ``bagel-data stats`` / ``scripts/bench_balance.py`` simulator, as
:class:`.step.PackLoop` is for the official loop: :meth:`BalancedLoop.fill` builds one pack from a
:class:`BalanceTarget` (samples, their estimates and costs, the group draws) and a look-ahead *pool* the caller
keeps (``BagelPacker.buffer``: (group, sample) pairs, oldest first) with its :class:`PoolBook`.

**Design.** Each rank packs on its own; no rank talks to another. What makes their packs equal is that all of
them aim at the same target with the same rule:

1. **Refill** (the official draw, unchanged in kind): one fresh sample per mandatory group (samples estimated
   at ``>= max_num_tokens_per_sample`` dropped, ``overlength_mandatory``, as in the official mandatory fill),
   then weighted group draws (:class:`.step.GroupDraw`, one uniform per draw; ``overlength`` drops as
   officially) until the pool holds ``lookahead`` packs' worth of cost (``balance.lookahead`` x the target
   below) or ``max_buffer_size`` samples. Samples enter the pool in the proportions the official loop draws
   them (one per mandatory group per pack plus weighted draws) and, as every one of them is packed within a
   bounded number of packs, they leave it in the same proportions. Holding a few packs' worth of cost rather
   than a fixed number of samples keeps the choice wide and the waits short whatever the sample sizes (by
   Little's law a sample waits about ``lookahead - 1`` packs).
2. **Target.** ``T = rho * target_tokens``: ``rho`` is the mean cost per token of every sample this rank has
   drawn (:attr:`PoolBook.cost_per_token`, exact sums kept in the state), ``target_tokens`` a knob
   (``balance.target_tokens``, default the midpoint of ``expected_num_tokens`` and ``max_num_tokens``). Every
   rank draws from the same distribution, so every rank's ``rho`` converges to the same value (its error
   falls as one over the square root of the samples drawn; a resize gives every new rank the world's sums),
   and packs average ``target_tokens`` real tokens.
3. **Select** from the pool, oldest first: one sample per mandatory group (its oldest that fits, else its
   cheapest), then every other sample in age order that fits both the token cap ``max_num_tokens`` and the
   cost target ``T`` (first fit in age order; a sample that has waited ``max_wait`` packs or more only needs
   to fit the token cap). Small samples that arrived last complete the pack: what is left of the target is
   smaller than any sample left in the pool that fits the token cap.
4. **Complete** (bin completion, one exchange): when the pack ends more than ``COMPLETION_GAP`` of ``T``
   short, the single exchange of a packed sample (not a mandatory pick, not an overdue one) for a waiting
   one that brings the pack closest to ``T`` (within both limits) is made.

A sample's length and cost are exact: what must be drawn for a sample when it is packed officially (its CFG
dropout coins) is drawn when it enters the pool and kept with it (:meth:`BalanceTarget.enter`, the note), so
the loop plans with the packed length and the cost after dropout. (``vit_cond_dropout_prob`` is 0.4: planning
with the pre-dropout cost would scatter the packs' real costs by several per cent.)

What it keeps of the official loop: never over ``max_num_tokens`` (exact packed lengths; mandatory samples
together must fit it, as in lossless mode), lossless (no flush: nothing is ever discarded, only over-length
samples are dropped, by the official rule on the official estimate, and counted as officially), mandatory
groups in every pack (packed first, in group order), determinism (the pool, the entry pack and note of each
pooled sample and the sums are the state; samples are rebuilt from restore keys), bounded waiting (age order
puts the oldest sample first; an overdue one is taken whenever the tokens allow: with ``(mandatory groups + 1)
x (max_num_tokens_per_sample - 1) <= max_num_tokens`` that is the pack where it becomes overdue, otherwise the
first pack whose mandatory picks leave room). What it changes: which pack a sample lands in, hence pack
lengths and the order of samples, and when the CFG coins are drawn.

Pure Python, no torch; units: tokens (packed sequence positions) and FLOPs (``cost.CostModel.cost``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from ..config.lengths import is_overlength
from .step import GroupDraw, LoopTarget, PackBudgets, draw_mandatory

__all__ = ["COMPLETION_GAP", "BalanceTarget", "BalancedLoop", "PoolBook"]

S = TypeVar("S")

#: A pack this far (share of the target) or further below the target tries one exchange (design step 4).
COMPLETION_GAP = 0.004


class BalanceTarget(LoopTarget[S], Protocol[S]):
    """What :meth:`BalancedLoop.fill` needs from its caller (``drop`` reasons: ``overlength`` /
    ``overlength_mandatory``).

    A sample that enters the pool gets a *note* (a small int, saved with the pool) from :meth:`enter`: what
    the caller must draw when a sample is drawn rather than when it is packed (the packer: its CFG dropout
    coins, so that the loop knows the sample's exact packed length and cost). :meth:`measure` must be a pure
    function of (sample, note)."""

    def enter(self, sample: S) -> int:
        """The note of a sample entering the pool (draws what must be drawn now; 0 if nothing)."""

    def measure(self, sample: S, note: int) -> tuple[int, float]:
        """(packed length in tokens, never above :meth:`estimate`; cost in FLOPs, ``cost.CostModel.cost``)."""

    def add(self, group: int, sample: S, length: int, note: int) -> None:
        """Pack ``sample`` into the current pack."""


@dataclass
class PoolBook:
    """The loop's record beside the pool (``BalancedPacker``'s state ``balance``).

    ``since[i]`` / ``notes[i]``: the pack number at which pool entry ``i`` entered (``packs`` then) and its note
    (:meth:`BalanceTarget.enter`); ``packs``: packs built by this rank; ``seen_cost`` / ``seen_tokens``: sums of
    cost (FLOPs) and packed length (tokens) over every sample that entered the pool. ``metrics`` caches
    (length, cost) per entry (rebuilt with :meth:`BalanceTarget.measure` after a restore).
    """

    since: list[int] = field(default_factory=list)
    notes: list[int] = field(default_factory=list)
    packs: int = 0
    seen_cost: float = 0.0
    seen_tokens: int = 0
    metrics: list[tuple[int, float]] | None = None

    @property
    def cost_per_token(self) -> float:
        """Mean cost per token of the samples drawn so far (0.0 before the first)."""
        return self.seen_cost / self.seen_tokens if self.seen_tokens else 0.0

    def state(self) -> dict[str, Any]:
        """The storable form (builtins only)."""
        return {"since": list(self.since), "notes": list(self.notes), "packs": self.packs,
                "seen_cost": self.seen_cost, "seen_tokens": self.seen_tokens}

    @classmethod
    def of_state(cls, state: dict[str, Any]) -> "PoolBook":
        """Inverse of :meth:`state` (the metrics are rebuilt by the next :meth:`BalancedLoop.fill`)."""
        return cls(since=[int(s) for s in state["since"]], notes=[int(n) for n in state["notes"]],
                   packs=int(state["packs"]), seen_cost=float(state["seen_cost"]),
                   seen_tokens=int(state["seen_tokens"]))


class BalancedLoop(Generic[S]):
    """The balanced pack loop (module docstring) for groups of ``weights`` / ``mandatory`` flags.

    ``target_tokens``: mean real tokens per pack aimed at; ``max_wait``: packs after which a waiting sample
    only needs to fit the token cap; ``lookahead``: packs' worth of cost the pool is refilled to. The budgets are
    trusted (``config.validate.validate_data`` checks them: a pool of at least one sample, mandatory samples that
    fit ``max_num_tokens`` together); raises ValueError only for mismatched per-group lengths.
    """

    def __init__(self, budgets: PackBudgets, weights: Sequence[float], mandatory: Sequence[bool], *,
                 target_tokens: int, max_wait: int, lookahead: float) -> None:
        if len(weights) != len(mandatory):
            raise ValueError(f"{len(weights)} group weights but {len(mandatory)} mandatory flags")
        self.budgets = budgets
        self.draw_group = GroupDraw(weights)
        self.mandatory = [g for g, m in enumerate(mandatory) if m]
        self.target_tokens = int(target_tokens)
        self.max_wait = int(max_wait)
        self.lookahead = float(lookahead)

    # -- 1. refill -----------------------------------------------------------------------------------------
    def _enter(self, target: BalanceTarget[S], pool: list[tuple[int, S]], book: PoolBook, group: int,
               sample: S) -> float:
        note = int(target.enter(sample))
        length, c = target.measure(sample, note)
        c = float(c)
        pool.append((group, sample))
        book.since.append(book.packs)
        book.notes.append(note)
        book.metrics.append((int(length), c))
        book.seen_cost += c
        book.seen_tokens += int(length)
        return c

    def _refill(self, target: BalanceTarget[S], pool: list[tuple[int, S]], book: PoolBook) -> None:
        limit = self.budgets.max_num_tokens_per_sample
        for group in self.mandatory:
            self._enter(target, pool, book, group, draw_mandatory(target, group, limit, 0)[0])
        held = sum(c for _, c in book.metrics)
        while len(pool) < self.budgets.max_buffer_size and (
                not book.seen_tokens or held < self.lookahead * self.target_cost(book)):
            group = self.draw_group(target.random())
            sample = target.next_sample(group)
            est = target.estimate(sample)
            if is_overlength(est, limit, mandatory=False):
                target.drop("overlength", group, sample, est, 0)
                continue
            held += self._enter(target, pool, book, group, sample)

    # -- 2.-4. select --------------------------------------------------------------------------------------
    def target_cost(self, book: PoolBook) -> float:
        """The cost every pack aims at: ``book.cost_per_token * target_tokens`` (FLOPs)."""
        return book.cost_per_token * self.target_tokens

    def _select(self, pool: list[tuple[int, S]], book: PoolBook) -> tuple[list[int], list[int]]:
        """(mandatory picks in group order, the other picks in pool order): indexes into ``pool``."""
        cap, limit = self.budgets.max_num_tokens, self.target_cost(book)
        metrics, since, packs = book.metrics, book.since, book.packs
        n = len(pool)
        chosen = [False] * n
        tok, cst = 0, 0.0
        firsts: list[int] = []
        for group in self.mandatory:  # its oldest sample that fits, else its cheapest
            mine = [i for i in range(n) if pool[i][0] == group and not chosen[i]]
            pick = next((i for i in mine if tok + metrics[i][0] <= cap and cst + metrics[i][1] <= limit),
                        min(mine, key=lambda i: metrics[i][1]))
            chosen[pick] = True
            firsts.append(pick)
            tok += metrics[pick][0]
            cst += metrics[pick][1]
        overdue_before = packs - self.max_wait
        rest: list[int] = []
        for i, (e, c) in enumerate(metrics):
            if not chosen[i] and tok + e <= cap and (cst + c <= limit or since[i] <= overdue_before):
                chosen[i] = True
                rest.append(i)
                tok += e
                cst += c
        gap = limit - cst
        if gap > COMPLETION_GAP * limit:
            self._exchange(rest, chosen, metrics, since, overdue_before, cap - tok, gap)
            rest.sort()
        return firsts, rest

    @staticmethod
    def _exchange(rest: list[int], chosen: list[bool], metrics: list[tuple[int, float]], since: list[int],
                  overdue_before: int, tok_room: int, gap: float) -> None:
        """Design step 4: the one exchange (packed ``j`` out, waiting ``k`` in) that brings the cost closest to
        the target without passing it or the token cap; ``rest`` / ``chosen`` updated in place."""
        best, best_gain = None, 0.0
        waiting = [k for k in range(len(chosen)) if not chosen[k]]
        for j in rest:
            if since[j] <= overdue_before:
                continue
            ej, cj = metrics[j]
            for k in waiting:
                ek, ck = metrics[k]
                gain = ck - cj
                if best_gain < gain <= gap and ek - ej <= tok_room:
                    best, best_gain = (j, k), gain
        if best is not None:
            j, k = best
            chosen[j], chosen[k] = False, True
            rest[rest.index(j)] = k

    def fill(self, target: BalanceTarget[S], pool: list[tuple[int, S]], book: PoolBook) -> tuple[int, float]:
        """Build one pack into ``target`` (``target.add`` per sample: mandatory picks first in group order, then
        pool order) from ``pool`` (updated in place, oldest first) after refilling it; ``book`` updated.
        Returns the pack's (tokens, cost) as planned (exact: :meth:`BalanceTarget.measure` of its samples).

        Propagates StopIteration from ``target.next_sample`` (the pool keeps what was drawn; nothing was
        packed)."""
        if len(book.since) != len(pool) or len(book.notes) != len(pool):
            raise ValueError(f"BalancedLoop: {len(book.since)} entry packs and {len(book.notes)} notes for "
                             f"{len(pool)} pooled samples")
        if book.metrics is None or len(book.metrics) != len(pool):  # after a restore: rebuilt from the samples
            book.metrics = [target.measure(s, n) for (_, s), n in zip(pool, book.notes)]
        self._refill(target, pool, book)
        firsts, rest = self._select(pool, book)
        tokens, cost = 0, 0.0
        for i in (*firsts, *rest):
            group, sample = pool[i]
            target.add(group, sample, book.metrics[i][0], book.notes[i])
            tokens += book.metrics[i][0]
            cost += book.metrics[i][1]
        taken = set(firsts) | set(rest)
        keep = [i for i in range(len(pool)) if i not in taken]
        pool[:] = [pool[i] for i in keep]
        book.since, book.notes, book.metrics = ([xs[i] for i in keep] for xs in (book.since, book.notes, book.metrics))
        book.packs += 1
        return tokens, cost
