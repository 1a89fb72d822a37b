"""Budget advisor: the official pack loop replayed on estimated token counts, for candidate budgets.

:func:`simulate_packing` gives, for one :class:`~..config.PackerConfig`, the fill ratio
(``sequence_length / max_num_tokens``), samples per pack and the share of consumed samples dropped;
:func:`candidate_budgets` lists the budgets worth comparing (configured, half, double, the official
defaults, "fits all").
"""

from __future__ import annotations

import logging
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ...config.budgets import FLEX_BLOCK, image_grids, table_side
from ...config import PackerConfig
from ...config.lengths import is_overlength, mandatory_tokens
from ...packing.step import PackBudgets, PackLoop
from .estimate import GroupStats

__all__ = ["Candidate", "SimResult", "candidate_budgets", "simulate_packing"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    """Budgets to try: ``label`` and the packer config (other knobs as configured)."""

    label: str
    packer: PackerConfig


@dataclass
class SimResult:
    """Replay outcome: ``packs`` built, ``fill`` = mean sequence_length / max_num_tokens, ``samples_per_pack``,
    ``dropped_share`` = dropped (over the per-sample limit, or discarded by a flush) / consumed,
    ``impossible`` = why no batch can ever be produced (None when packs were built). ``over_limit``,
    ``flushed`` and ``consumed`` are sample counts; ``drops`` the dropped samples by reason
    (``packing.step.DROP_REASONS``, as ``BagelPacker.drops`` counts them); ``pack_lengths`` the tokens of each
    pack built, in order."""

    packs: int = 0
    fill: float = 0.0
    samples_per_pack: float = 0.0
    dropped_share: float = 0.0
    over_limit: int = 0
    flushed: int = 0
    consumed: int = 0
    impossible: str | None = None
    drops: dict[str, int] = field(default_factory=dict)
    pack_lengths: list[int] = field(default_factory=list)


class _NoPack(Exception):
    """``max_draws`` samples drawn without completing the packs asked for."""


class _Replay:
    """The simulator's ``packing.step.PackTarget``: a sample is its estimate (tokens) from a cycled per-group
    stream, packing it adds the estimate; group draws come from ``rng``."""

    def __init__(self, streams: Sequence[Sequence[int]], rng: random.Random, max_draws: int) -> None:
        self.streams, self.rng, self.max_draws = streams, rng, max_draws
        self.pos = [0] * len(streams)
        self.curr = self.n = self.consumed = 0
        self.drops: Counter[str] = Counter()

    def random(self) -> float:
        return self.rng.random()

    def next_sample(self, group: int) -> int:
        if self.consumed >= self.max_draws:
            raise _NoPack
        s = self.streams[group]
        v = s[self.pos[group] % len(s)]
        self.pos[group] += 1
        self.consumed += 1
        return v

    def estimate(self, sample: int) -> int:
        return sample

    def add(self, group: int, sample: int, est: int) -> None:
        self.curr += est
        self.n += 1

    def drop(self, reason: str, group: int, sample: int, est: int, curr: int) -> None:
        self.drops[reason] += 1


def simulate_packing(streams: Sequence[Sequence[int]], weights: Sequence[float], mandatory: Sequence[bool],
                     names: Sequence[str], packer: PackerConfig, *, packs: int = 200, seed: int = 0,
                     max_draws: int = 200_000) -> SimResult:
    """Replay the official loop on per-group length streams (tokens, cycled) for ``packs`` packs.

    The loop is ``BagelPacker``'s own (``packing.step.PackLoop``, spec §5): one sample per mandatory group
    first, weighted group draws (``random.Random(seed)``), the overflow buffer, the flush; only lengths are
    packed and CFG dropout is left out (packed length = estimate). A group with an empty stream is never drawn
    (weight 0). A mandatory group with no sample under the limit, or ``max_draws`` samples drawn without the
    packs, gives ``impossible`` (so do lossless budgets the packer refuses). ``packer.lossless`` is honoured
    (the flush's candidate is carried, not dropped).
    """
    limit = packer.max_num_tokens_per_sample
    for s, m, n in zip(streams, mandatory, names):
        if m and all(is_overlength(x, limit, True) for x in s):
            return SimResult(impossible=f"mandatory group {n!r}: no sample is estimated under "
                                        f"max_num_tokens_per_sample {limit}: the packer drops every sample and "
                                        "never yields a batch")
    draw_weights = list(weights) if all(streams) else [w if s else 0 for w, s in zip(weights, streams)]
    if not any(s for s in streams) or not sum(draw_weights) > 0:
        return SimResult(impossible="no usable samples")
    worst = mandatory_tokens(sum(map(bool, mandatory)), limit)
    if packer.lossless and worst > packer.max_num_tokens:  # what config.budgets refuses for a job
        return SimResult(impossible=f"packer.lossless: {sum(map(bool, mandatory))} mandatory groups x "
                                    f"(max_num_tokens_per_sample {limit} - 1) = {worst} tokens > max_num_tokens "
                                    f"{packer.max_num_tokens}: mandatory samples alone could overflow a pack")
    loop: PackLoop[int] = PackLoop(PackBudgets.of(packer), draw_weights, mandatory, lossless=packer.lossless)
    replay = _Replay(streams, random.Random(seed), max_draws)
    buffer: list[tuple[int, int]] = []
    carry: list[tuple[int, int]] = []  # packer.lossless: the flushed candidates kept for the next pack
    res = SimResult()
    counts: list[int] = []
    while len(res.pack_lengths) < packs:
        replay.curr = replay.n = 0
        try:
            loop.fill(replay, buffer, carry)
        except _NoPack:
            res.impossible = f"no pack after {max_draws} draws"
            break
        res.pack_lengths.append(replay.curr)
        counts.append(replay.n)
    res.consumed, res.drops = replay.consumed, dict(replay.drops)
    res.over_limit = replay.drops["overlength"] + replay.drops["overlength_mandatory"]
    res.flushed = replay.drops["flush_drop"] + replay.drops["flush_drop_buffered"]
    if res.pack_lengths:
        res.packs = len(res.pack_lengths)
        res.fill = sum(res.pack_lengths) / res.packs / packer.max_num_tokens
        res.samples_per_pack = sum(counts) / len(counts)
        res.impossible = None if res.packs == packs else res.impossible
    res.dropped_share = (res.over_limit + res.flushed) / max(res.consumed, 1)
    return res


def _round_up(x: float, k: int = FLEX_BLOCK) -> int:
    """``x`` tokens rounded up to a multiple of ``k`` (the FlexAttention block)."""
    return int(math.ceil(x / k) * k)


def candidate_budgets(packer: PackerConfig, groups: Sequence[GroupStats]) -> list[Candidate]:
    """The configured budgets, half and double of them, the official default and fine-tuning budgets, and
    "fits all": the smallest 128-multiples keeping every sample (given the number of mandatory groups).

    Candidates other than "configured" also raise ``max_latent_size`` / ``max_num_patch_per_side`` to what
    the groups' transforms need (extrapolated position ids), so they are not refused for that.
    """
    tables = {"max_latent_size": packer.max_latent_size, "max_num_patch_per_side": packer.max_num_patch_per_side}
    if not packer.interpolate_pos:
        for g in groups:
            for grid in image_grids(g.group):
                need = table_side(grid.transform, getattr(packer, grid.patch_knob))
                tables[grid.table_knob] = max(tables[grid.table_knob], need)

    def scaled(label: str, e: int, m: int, s: int) -> Candidate:
        pbb = max(1, min(m - 1, round(packer.prefer_buffer_before * m / packer.max_num_tokens)))
        return Candidate(label, replace(packer, expected_num_tokens=e, max_num_tokens=m,
                                        max_num_tokens_per_sample=min(s, m), prefer_buffer_before=pbb, **tables))

    p = packer
    out = [Candidate("configured", p),
           scaled("half", p.expected_num_tokens // 2, p.max_num_tokens // 2, p.max_num_tokens_per_sample // 2),
           scaled("double", p.expected_num_tokens * 2, p.max_num_tokens * 2, p.max_num_tokens_per_sample * 2),
           scaled("BAGEL default", 32768, 36864, 16384),
           scaled("BAGEL fine-tune", 10240, 11520, 10240)]
    his = [e.hi for g in groups for e in g.estimates]
    if his:
        s = _round_up(max(his) + 1)
        n_mand = max(1, sum(g.group.is_mandatory for g in groups))
        m = _round_up(max(mandatory_tokens(n_mand, s), s, p.max_num_tokens))
        out.append(scaled("fits all", min(p.expected_num_tokens, m), m, s))
    seen, uniq = set(), []
    for c in out:
        key = (c.packer.expected_num_tokens, c.packer.max_num_tokens, c.packer.max_num_tokens_per_sample)
        if key not in seen:
            seen.add(key)
            uniq.append(c)
    return uniq
