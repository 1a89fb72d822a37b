"""The group readers: one reader core (``core.GroupReader``; ``plan``: what it asks of an order) and the orders as
plans: ``elastic.ElasticPlan`` (the default; ``partitions``) and ``official.OfficialPlan`` (the parity order), over
``datasets.GroupDatasets`` (``selection``: the official selection; ``access``: random access through Energon;
``pool``: one read worker pool per rank; ``workers``: stopping worker processes, closing shard files).
:func:`open_group_reader` builds a group's reader for either order with one signature (the builder's entry).
"""

from __future__ import annotations

from collections.abc import Sequence

from ...config.schema import ORDERS
from ...watchdog import DEFAULT_STALL_WARN_S, DEFAULT_TIMEOUT_S
from ..cooking import CookContext
from ..layout import load_manifest
from .core import DataReadError, GroupReader, read_error
from .datasets import GroupDatasets
from .elastic import DEFAULT_PARTITIONS, ElasticPlan
from .official import OfficialPlan
from .plan import Plan, Read, Skip
from .pool import ReadPool

__all__ = ["DEFAULT_PARTITIONS", "ORDERS", "DataReadError", "GroupDatasets", "GroupReader", "Plan", "ReadPool",
           "Read", "Skip", "open_group_reader", "read_error"]


def open_group_reader(order: str, datasets: GroupDatasets | str | Sequence[str], ctx: CookContext, *,
                      num_used_data: Sequence[int] | None = None, shuffle_lines: bool = False, shuffle_seed: int = 0,
                      seed: int = 0, dp_rank: int = 0, dp_size: int = 1, partitions: int = DEFAULT_PARTITIONS,
                      num_workers: int = 0, worker_id: int = 0, repeat: bool = True, pool: ReadPool | None = None,
                      stall_warn_s: float = DEFAULT_STALL_WARN_S, timeout_s: float = DEFAULT_TIMEOUT_S
                      ) -> GroupReader:
    """One group's reader on DP rank ``dp_rank`` of ``dp_size`` in ``order`` (``"elastic"`` or ``"official"``).

    ``datasets``: the group's ``GroupDatasets`` or its converted dataset paths; ``ctx``: its cooking context;
    ``num_used_data`` / ``shuffle_lines`` / ``shuffle_seed``: the official selection; ``seed``: the data seed.
    Elastic: ``partitions`` (``data.partitions``); its reads may run ahead in ``pool``. Official: emulated
    DataLoader worker ``worker_id`` of ``num_workers``; ``repeat=False`` reads one pass. Raises ValueError naming
    the problem (an empty dataset or selection, an official worker without units).
    """
    group_datasets = datasets if isinstance(datasets, GroupDatasets) else GroupDatasets(datasets, ctx.group)
    if order == "elastic":
        runs = group_datasets.selection(num_used_data, shuffle_lines, shuffle_seed)
        plan: Plan = ElasticPlan.of(runs, group=group_datasets.group, seed=seed, partitions=partitions,
                                   dp_rank=dp_rank, dp_size=dp_size)
    elif order == "official":
        if num_used_data is None:
            raise ValueError(f"{group_datasets.group}: the official order needs num_used_data")
        manifests = [load_manifest(p) for p in group_datasets.paths]
        plan = OfficialPlan(group_datasets.group, manifests, group_datasets.accesses(), num_used_data, seed=seed,
                            rank=dp_rank, world_size=dp_size, num_workers=num_workers, worker_id=worker_id,
                            shuffle_lines=shuffle_lines, shuffle_seed=shuffle_seed, repeat=repeat)
    else:
        raise ValueError(f"unknown order {order!r}; expected one of {list(ORDERS)}")
    return GroupReader(group_datasets, plan, ctx, dp_rank=dp_rank, dp_size=dp_size, pool=pool, timeout_s=timeout_s,
                       stall_warn_s=stall_warn_s, worker_id=worker_id if order == "official" and num_workers > 0 else 0)
