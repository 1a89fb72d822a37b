"""The official length rules of one sample (spec §5 / §13.1, §13.3): a leaf module, no imports of ours.

The packer (``packing.packer``, through ``packing.step``), the config-time budget checks (``config.budgets``,
which re-exports these names) and ``bagel-data stats`` (``tools.budget_stats``) all use these three functions, so
an estimate means the same thing everywhere; they live in ``config`` because the packing layer may import the
configuration layer and not the other way round. Units: tokens = packed sequence positions.
"""

from __future__ import annotations

__all__ = ["estimate", "is_overlength", "mandatory_tokens"]


def estimate(num_tokens: int, plan_items: int) -> int:
    """The packer's length estimate of one sample: ``num_tokens + 2 * plan_items`` (spec §5: the +2 per plan
    item are bos/eos of a text or start/end-of-image of an image)."""
    return int(num_tokens) + 2 * int(plan_items)


def is_overlength(est: float, limit: int, mandatory: bool) -> bool:
    """The packer's per-sample drop rule (spec §5 / §13.1): a sample estimated at ``est`` tokens is dropped
    when ``est >= limit`` in a mandatory group, ``est > limit`` otherwise (``limit`` =
    ``max_num_tokens_per_sample``)."""
    return est >= limit if mandatory else est > limit


def mandatory_tokens(mandatory_groups: int, limit: int) -> int:
    """The most tokens the mandatory samples alone can put into one pack: one sample ``< limit`` per mandatory
    group; they are never checked against ``max_num_tokens`` (official quirk §13.3, case B6)."""
    return mandatory_groups * (limit - 1)
