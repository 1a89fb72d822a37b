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
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ...config.budgets import FLEX_BLOCK, image_grids, is_overlength, mandatory_tokens, table_side
from ...config import PackerConfig
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
    ``flushed`` and ``consumed`` are sample counts."""

    packs: int = 0
    fill: float = 0.0
    samples_per_pack: float = 0.0
    dropped_share: float = 0.0
    over_limit: int = 0
    flushed: int = 0
    consumed: int = 0
    impossible: str | None = None


def simulate_packing(streams: Sequence[Sequence[int]], weights: Sequence[float], mandatory: Sequence[bool],
                     names: Sequence[str], packer: PackerConfig, *, packs: int = 200, seed: int = 0,
                     max_draws: int = 200_000) -> SimResult:
    """Replay the official loop on per-group length streams (tokens, cycled) for ``packs`` packs.

    Mirrors ``bridge/models/bagel/data/packing/packer.py`` ``BagelPacker.__next__`` (spec §5): one sample per
    mandatory group first, weighted group draws, the overflow buffer, the flush; it leaves out the tensors
    (only lengths are packed) and CFG dropout (packed length = estimate). A mandatory group with no sample
    under the limit, or ``max_draws`` draws without a pack, gives ``impossible``.
    """
    limit, cap = packer.max_num_tokens_per_sample, packer.max_num_tokens
    for s, m, n in zip(streams, mandatory, names):
        if m and all(is_overlength(x, limit, True) for x in s):
            return SimResult(impossible=f"mandatory group {n!r}: no sample is estimated under "
                                        f"max_num_tokens_per_sample {limit}: the packer drops every sample and "
                                        "never yields a batch")
    if not any(s for s in streams):
        return SimResult(impossible="no usable samples")
    rng = random.Random(seed)
    pos = [0] * len(streams)
    total = sum(weights)
    cum = [sum(weights[:i + 1]) / total for i in range(len(weights))]
    res = SimResult()
    lens: list[int] = []
    counts: list[int] = []

    def draw(i: int) -> int | None:
        s = streams[i]
        if not s:
            return None
        v = s[pos[i] % len(s)]
        pos[i] += 1
        res.consumed += 1
        return v

    buffer: list[int] = []
    draws = 0
    while len(lens) < packs:
        curr, n = 0, 0
        for i, m in enumerate(mandatory):
            if not m:
                continue
            while True:
                v = draw(i)
                draws += 1
                if v is not None and not is_overlength(v, limit, True):
                    break
                res.over_limit += 1
            curr, n = curr + v, n + 1
        while True:
            draws += 1
            if draws > max_draws:
                res.impossible = res.impossible or f"no pack after {max_draws} draws"
                break
            if curr < packer.prefer_buffer_before and buffer:
                v, from_buffer = buffer.pop(0), True
            else:
                u = rng.random()
                i = next((k for k, c in enumerate(cum) if u < c), 0)
                v, from_buffer = draw(i), False
                if v is None:
                    continue
            if is_overlength(v, limit, False):
                res.over_limit += 1
                continue
            if curr + v > cap:
                if len(buffer) < packer.max_buffer_size and not from_buffer:
                    buffer.append(v)
                    continue
                res.flushed += 1
                break
            curr, n = curr + v, n + 1
            if curr >= packer.expected_num_tokens:
                break
        if res.impossible:
            break
        lens.append(curr)
        counts.append(n)
    if lens:
        res.packs = len(lens)
        res.fill = sum(lens) / len(lens) / cap
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
