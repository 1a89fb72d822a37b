"""The official pack loop on lengths (spec §5; quirks §13.1-§13.3 kept): one definition for ``BagelPacker`` and
the budget simulator of ``bagel-data stats``.

:func:`step` is the fate of one candidate sample (drop / buffer / flush / add), :class:`GroupDraw` the weighted
group choice from one uniform draw, and :meth:`PackLoop.fill` the loop around them (mandatory fill while the
pack is empty, buffer preference, group draws) up to the end of one pack. What a pack *is* stays with the
caller, a :class:`PackTarget`: the packer lays out tensors (its ``curr`` is the real packed length, shorter
than the estimate after CFG dropout), the simulator only adds estimates. Both therefore make the same
decisions on the same lengths and uniform draws; ``tests/test_pack_step.py`` checks that on real data.

Lossless mode (``PackLoop(..., lossless=True)``, the ``packer.lossless`` knob; off by default, and off the loop is
the official one unchanged): a candidate the official flush would discard (``flush_drop`` /
``flush_drop_buffered``) ends the pack and waits in the *carry* (a FIFO the caller keeps next to the buffer) for
the next pack, which takes it right after its mandatory samples. Mandatory samples cannot overflow
``max_num_tokens`` there: ``config.validate_data`` refuses budgets where ``mandatory groups x
(max_num_tokens_per_sample - 1) > max_num_tokens``. Over-length samples are still dropped (they can never fit).

Pure Python, no torch; of the configuration only the length rules (``config.lengths``); units are tokens (packed
sequence positions).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Generic, Protocol, TypeVar

from ..config.lengths import is_overlength

__all__ = ["ADD", "BUFFER", "CARRY", "DROP_REASONS", "GroupDraw", "LoopTarget", "PackBudgets", "PackLoop",
           "PackTarget", "draw_mandatory", "step"]

S = TypeVar("S")

#: :func:`step` outcomes that keep the candidate.
ADD, BUFFER = "add", "buffer"
#: Lossless mode's outcome where the official loop flushes and discards: the pack ends, the candidate is carried.
CARRY = "carry"
#: Every reason the loop drops a sample for, as counted by ``BagelPacker.drops`` and ``SimResult.drops``:
#: over ``max_num_tokens_per_sample`` in a mandatory group (``>=``) or another group (``>``); discarded by the
#: official flush (fresh from a group with the buffer full, or just popped from the buffer).
DROP_REASONS = ("overlength_mandatory", "overlength", "flush_drop", "flush_drop_buffered")


@dataclass(frozen=True)
class PackBudgets:
    """The five length knobs of the loop (tokens; buffer in samples), as in ``PackerConfig``."""

    expected_num_tokens: int
    max_num_tokens: int
    max_num_tokens_per_sample: int
    prefer_buffer_before: int
    max_buffer_size: int

    @classmethod
    def of(cls, config: Any) -> "PackBudgets":
        """The budgets of ``config`` (a ``PackerConfig`` or anything with these attributes)."""
        return cls(*(int(getattr(config, f.name)) for f in fields(cls)))


def step(budgets: PackBudgets, curr: int, est: int, *, from_buffer: bool, buffer_len: int,
         lossless: bool = False) -> str:
    """The fate of one non-mandatory candidate estimated at ``est`` tokens for a pack of ``curr`` tokens (spec
    §5 steps 2.3-2.5): ``"overlength"`` (drop, ``est > max_num_tokens_per_sample``), ``BUFFER`` (it overflows
    ``max_num_tokens`` and fits the buffer; never for a sample just popped from it), ``"flush_drop"`` /
    ``"flush_drop_buffered"`` (it overflows: the pack ends and the candidate is discarded, official quirk
    §13.2) — ``CARRY`` instead of those two when ``lossless`` (the pack ends, the candidate waits for the next
    pack) — or ``ADD``. ``buffer_len``: samples in the buffer now."""
    if is_overlength(est, budgets.max_num_tokens_per_sample, mandatory=False):
        return "overlength"
    if curr + est > budgets.max_num_tokens:
        if buffer_len < budgets.max_buffer_size and not from_buffer:
            return BUFFER
        if lossless:
            return CARRY
        return "flush_drop_buffered" if from_buffer else "flush_drop"
    return ADD


def draw_mandatory(target: LoopTarget[S], group: int, limit: int, curr: int) -> tuple[S, int]:
    """The next sample of mandatory ``group`` under ``limit`` = ``max_num_tokens_per_sample`` and its estimate, the
    ones at or over it dropped (``overlength_mandatory`` at a pack of ``curr`` tokens; strict, quirk §13.1): the
    mandatory draw of both loops."""
    while True:
        sample = target.next_sample(group)
        est = target.estimate(sample)
        if not is_overlength(est, limit, mandatory=True):
            return sample, est
        target.drop("overlength_mandatory", group, sample, est, curr)


class GroupDraw:
    """Official weighted group choice: ``cum_i = sum(w_0..w_i) / sum(w)``; a uniform ``u`` picks the first
    ``i`` with ``u < cum_i``, else group 0. The weights are validated (``grouped_yaml``: >= 0, sum > 0)."""

    def __init__(self, weights: Sequence[float]) -> None:
        total = float(sum(weights))
        self.cum = [acc / total for acc in itertools.accumulate(float(w) for w in weights)]

    def __call__(self, u: float) -> int:
        i = bisect.bisect_right(self.cum, u)  # first i with u < cum_i
        return i if i < len(self.cum) else 0


class LoopTarget(Protocol[S]):
    """What both pack loops (:class:`PackLoop`, ``balance.BalancedLoop``) need from their caller (``S``: the
    caller's sample type)."""

    def random(self) -> float:
        """One uniform draw in [0, 1) for the group choice (the packer: the global ``random``)."""

    def next_sample(self, group: int) -> S:
        """The next sample of group ``group`` (may raise StopIteration)."""

    def estimate(self, sample: S) -> int:
        """The sample's official length estimate (tokens, ``config.lengths.estimate``; the over-length rule)."""

    def drop(self, reason: str, group: int, sample: S, est: int, curr: int) -> None:
        """Count ``sample`` as dropped for ``reason`` (one of ``DROP_REASONS``) at a pack of ``curr`` tokens."""


class PackTarget(LoopTarget[S], Protocol[S]):
    """What :meth:`PackLoop.fill` needs from its caller for one pack."""

    @property
    def curr(self) -> int:
        """Tokens packed so far into the current pack."""

    def add(self, group: int, sample: S, est: int) -> None:
        """Pack ``sample`` (``curr`` grows)."""


class PackLoop(Generic[S]):
    """The official ``PackedDataset.__iter__`` loop for groups of ``weights`` / ``mandatory`` flags; with
    ``lossless`` the flush keeps its candidate for the next pack (module docstring).

    The budgets are a validated configuration (``config.validate_data``: in lossless mode it refuses budgets where
    the mandatory samples alone could exceed ``max_num_tokens``, ``budgets.budget_issues``). Raises ValueError for
    mismatched lengths.
    """

    def __init__(self, budgets: PackBudgets, weights: Sequence[float], mandatory: Sequence[bool], *,
                 lossless: bool = False) -> None:
        if len(weights) != len(mandatory):
            raise ValueError(f"{len(weights)} group weights but {len(mandatory)} mandatory flags")
        self.budgets = budgets
        self.draw_group = GroupDraw(weights)
        self.mandatory = [g for g, m in enumerate(mandatory) if m]  # mandatory group indexes, in group order
        self.lossless = bool(lossless)

    def _mandatory_fill(self, target: PackTarget[S]) -> None:
        """One sample per mandatory group, in group order; samples with ``est >= max_num_tokens_per_sample`` are
        dropped (strict, quirk §13.1) and none is checked against ``max_num_tokens`` (quirk §13.3; in lossless
        mode the validated budgets make an overflow impossible, and it is asserted)."""
        for group in self.mandatory:
            sample, est = draw_mandatory(target, group, self.budgets.max_num_tokens_per_sample, target.curr)
            if self.lossless and target.curr + est > self.budgets.max_num_tokens:
                raise AssertionError(f"lossless pack loop: mandatory group {group} sample of {est} tokens overflows a "
                                     f"pack of {target.curr} (the constructor's budget rule should exclude this)")
            target.add(group, sample, est)

    def _take_carry(self, target: PackTarget[S], carry: list[tuple[int, S]]) -> bool:
        """Pack the carried samples that fit (oldest first; one that does not fit stays, in order); True when
        the pack reached ``expected_num_tokens``."""
        b = self.budgets
        kept: list[tuple[int, S]] = []
        done = False
        for group, sample in carry:
            est = target.estimate(sample)
            if done or target.curr + est > b.max_num_tokens:
                kept.append((group, sample))
                continue
            target.add(group, sample, est)
            done = target.curr >= b.expected_num_tokens
        carry[:] = kept
        return done

    def fill(self, target: PackTarget[S], buffer: list[tuple[int, S]],
             carry: list[tuple[int, S]] | None = None) -> str | None:
        """Fill ``target``'s pack until it ends: returns None when it reached ``expected_num_tokens``, the flush
        reason (``"flush_drop"`` / ``"flush_drop_buffered"``) when an overflowing candidate ended it, ``CARRY``
        when that candidate was carried instead (lossless).

        ``buffer``: the overflow buffer, (group, sample) pairs oldest first, updated in place (it outlives
        the pack). ``carry`` (lossless mode; required there, ignored otherwise): the samples kept from earlier
        flushes, oldest first, updated in place; they are packed right after the mandatory samples (one that
        does not fit yet stays, so normally the carry holds at most one sample). Propagates StopIteration
        from ``target.next_sample``.
        """
        b = self.budgets
        if self.lossless and carry is None:
            raise ValueError("PackLoop.fill: lossless mode needs the carry list")
        carry_open = self.lossless and bool(carry)
        while True:
            if target.curr == 0:
                self._mandatory_fill(target)
            if carry_open:
                carry_open = False
                if self._take_carry(target, carry):
                    return None
            curr = target.curr
            from_buffer = curr < b.prefer_buffer_before and bool(buffer)
            if from_buffer:
                group, sample = buffer.pop(0)
            else:
                group = self.draw_group(target.random())
                sample = target.next_sample(group)
            est = target.estimate(sample)
            fate = step(b, curr, est, from_buffer=from_buffer, buffer_len=len(buffer), lossless=self.lossless)
            if fate == ADD:
                target.add(group, sample, est)
                if target.curr >= b.expected_num_tokens:
                    return None
            elif fate == BUFFER:
                buffer.append((group, sample))
            elif fate == CARRY:
                carry.append((group, sample))
                return CARRY
            else:
                target.drop(fate, group, sample, est, curr)
                if fate != "overlength":
                    return fate
