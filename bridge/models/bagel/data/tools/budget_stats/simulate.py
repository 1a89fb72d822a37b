"""Budget advisor: the official pack loop replayed on estimated token counts, for candidate budgets.

:func:`simulate_packing` gives, for one :class:`~..config.PackerConfig`, the fill ratio
(``sequence_length / max_num_tokens``), samples per pack and the share of consumed samples dropped;
:func:`candidate_budgets` lists the budgets worth comparing (configured, half, double, the official
defaults, "fits all").
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ...config.budgets import FLEX_BLOCK, image_grids, loop_refuses_overflow, mandatory_overflow, table_side
from ...config import PackerConfig
from ...config.lengths import is_overlength, mandatory_tokens
from .estimate import GroupStats
from .straggler import simulate_ranks

__all__ = ["Candidate", "SimResult", "candidate_budgets", "simulate_packing"]


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


def simulate_packing(streams: Sequence[Sequence[int]], weights: Sequence[float], mandatory: Sequence[bool],
                     names: Sequence[str], packer: PackerConfig, *, packs: int = 200, seed: int = 0,
                     max_draws: int = 200_000) -> SimResult:
    """Replay the official loop on per-group length streams (tokens, cycled) for ``packs`` packs.

    The length-level simulator (:func:`.straggler.simulate_ranks`) at DP 1 with ``packer.strategy: official``:
    ``BagelPacker``'s own loop (``packing.step.PackLoop``, spec §5), one sample per mandatory group first, weighted
    group draws (``random.Random(seed)``), the overflow buffer, the flush; only lengths are packed and CFG dropout
    is left out (packed length = estimate). A group with an empty stream is never drawn (weight 0). A mandatory
    group with no sample under the limit, or ``max_draws`` samples drawn without the packs, gives ``impossible``
    (so do lossless budgets the packer refuses, ``config.budgets.loop_refuses_overflow``). ``packer.lossless`` is
    honoured (the flush's candidate is carried, not dropped).
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
    official = replace(packer, strategy="official")
    worst = mandatory_overflow(official, sum(map(bool, mandatory)))
    if worst and loop_refuses_overflow(official):  # what config.budgets refuses for a job
        return SimResult(impossible=f"packer.lossless: {sum(map(bool, mandatory))} mandatory groups x "
                                    f"(max_num_tokens_per_sample {limit} - 1) = {worst} tokens > max_num_tokens "
                                    f"{packer.max_num_tokens}: mandatory samples alone could overflow a pack")
    sources = [itertools.cycle([(x, 0.0) for x in s]) for s in streams]
    sim = simulate_ranks(lambda _: sources, draw_weights, mandatory, official, dp=1, packs=packs,
                         rank_rng=lambda _: random.Random(seed), max_draws=max_draws)
    run, drops, n = sim.ranks[0], sim.drops, len(sim.ranks[0].tokens)
    over_limit = drops.get("overlength", 0) + drops.get("overlength_mandatory", 0)
    flushed = drops.get("flush_drop", 0) + drops.get("flush_drop_buffered", 0)
    return SimResult(packs=n, fill=sum(run.tokens) / n / packer.max_num_tokens if n else 0.0,
                     samples_per_pack=sum(run.samples) / n if n else 0.0, over_limit=over_limit, flushed=flushed,
                     dropped_share=(over_limit + flushed) / max(run.consumed, 1), consumed=run.consumed,
                     impossible=None if n and n == packs else sim.stopped, drops=drops, pack_lengths=run.tokens)


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
    uniq: dict[tuple[int, int, int], Candidate] = {}  # the first candidate of each budget triple
    for c in out:
        uniq.setdefault((c.packer.expected_num_tokens, c.packer.max_num_tokens, c.packer.max_num_tokens_per_sample), c)
    return list(uniq.values())
