"""Model-parallel layout of the job: Megatron-Core process groups, per-rank coordinates, cross-rank agreement.

The loader is sharded by data parallelism only. Following Megatron-Bridge's standard ``pretrain()`` path:

* every rank builds the loader and reads its own iterator (no broadcast), with DP rank/size taken from
  Megatron's ``dp`` group (``ProcessGroupCollection.dp``: DP *without* CP), never from the world size —
  so all TP/CP peers and all PP stages of one DP replica read byte-identical streams;
* the loader state is written once per DP replica by its ``tp = pp = cp = 0`` rank and restored on every
  rank of the replica (Bridge's ``maybe_save_dataloader_state`` / ``maybe_load_dataloader_state``);
* with a virtual (interleaved) pipeline, Bridge keeps one iterator per rank and hands every model chunk
  a view of one shared per-step cache (``make_data_iterator_list``), so the source still advances once
  per micro-batch and the stream does not depend on the virtual pipeline size.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch.distributed as dist

from ..config import ConfigError
from ..errors import shorten
from .config import TrainConfig

__all__ = ["AgreedError", "agree", "collective_device", "init_model_parallel", "rank_coords"]

logger = logging.getLogger(__name__)


class AgreedError(RuntimeError):
    """A failure every rank raises together (after ``agree``): a failing rank's own message, or on the other
    ranks a line naming the failing rank (``source_rank``).

    ``kind`` is the failing exception's class name; ``all_ranks`` tells launchers that every rank is failing
    at the same point, so a final barrier before exiting is safe.
    """

    all_ranks = True

    def __init__(self, kind: str, message: str, source_rank: int) -> None:
        super().__init__(message)
        self.kind = kind
        self.source_rank = source_rank


def agree(error: BaseException | None, what: str = "setup", warn_s: float = 0.0) -> None:
    """Collective over the world: return iff no rank failed, else raise ``AgreedError`` on every rank.

    Every rank must call this at the same point, so no rank is left waiting in a later collective. A rank that
    failed raises its own message (its own file, its own shard); a rank that did not fail says so in its own
    words and names the lowest failing rank, its error kind and a short form of what failed (the error's
    ``brief`` if it has one): ``another rank failed <what>: rank R (Kind: …); this rank was fine``. The local
    exception (if any) is chained as the cause.

    ``warn_s`` (seconds, 0 = silent; the job passes ``data.stall_warn_s``): a rank that has waited this long for
    the others logs one WARNING saying so (it is not its own data: a slower rank's data watchdog names the shard
    that rank waits on), and one line when they arrive; the same time-out as the collective's own applies.
    """
    t0, waiting = time.monotonic(), threading.Event()
    timer = None
    if warn_s and warn_s > 0:
        def _warn() -> None:
            waiting.set()
            logger.warning("rank %d has waited %.0fs %s for other ranks (data.stall_warn_s=%g): this rank's data is "
                           "ready; a slower rank's data watchdog line names what it waits on", dist.get_rank(),
                           time.monotonic() - t0, what, warn_s)

        timer = threading.Timer(warn_s, _warn)
        timer.daemon = True
        timer.start()
    try:
        _agree(error, what)
    finally:
        if timer is not None:
            timer.cancel()
        if waiting.is_set():
            logger.warning("rank %d: the other ranks arrived %s after %.1fs", dist.get_rank(), what,
                           time.monotonic() - t0)


def _agree(error: BaseException | None, what: str) -> None:
    mine = None
    if error is not None:
        message = "\n".join(" ".join(line.split()) for line in str(error).splitlines() if line.strip())
        kind = error.kind if isinstance(error, AgreedError) else type(error).__name__
        # the error's own short form (DataError, a refused state file), else its first line cut at a whole word
        brief = " ".join(str(getattr(error, "brief", "") or "").split()) or shorten(message, 120)
        mine = (kind, message, brief)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    failed = [(r, e) for r, e in enumerate(gathered) if e is not None]
    if not failed:
        return
    if len(failed) > 1:
        logger.debug("%s failed on ranks %s", what, [r for r, _ in failed])
    if mine is not None:
        raise AgreedError(mine[0], mine[1], dist.get_rank()) from error
    rank, (kind, _message, brief) = failed[0]
    others = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
    raise AgreedError(kind, f"another rank failed {what}: rank {rank}{others} ({kind}: {brief}); this rank was "
                            f"fine, see rank {rank}'s error line", rank)


def init_model_parallel(train: TrainConfig) -> Any:
    """Initialise Megatron-Core's TP/PP/CP/DP groups from ``train`` on the default process group.

    Requires ``torch.distributed`` to be initialised (gloo on CPU, NCCL on GPU). Validates the layout first
    (``TrainConfig.parallel_layout``; a bad one raises ``AgreedError`` of kind ``ConfigError`` on every rank, a
    collective) and returns the ``ProcessGroupCollection`` with ``tp``, ``pp``, ``cp`` and ``dp`` (DP without CP).
    """
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    try:
        layout, error = train.parallel_layout(dist.get_world_size()), None
    except ConfigError as exc:
        error = exc
    agree(error, "the parallel layout")  # identical on every rank; raised together so every rank exits cleanly
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout["tp"], pipeline_model_parallel_size=layout["pp"],
        context_parallel_size=layout["cp"],
        virtual_pipeline_model_parallel_size=train.virtual_pipeline_model_parallel_size)
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "pp", "cp", "dp"])
    if pgs.dp.size() != layout["dp"]:  # guards the config arithmetic against Megatron's own groups
        raise RuntimeError(f"Megatron's data-parallel group has {pgs.dp.size()} ranks, expected {layout['dp']}")
    if dist.get_rank() == 0:
        logger.info("parallel layout: world %d = TP %d x PP %d x CP %d x DP %d%s, %d micro-batches per step",
                    dist.get_world_size(), layout["tp"], layout["pp"], layout["cp"], layout["dp"],
                    f" (VPP {train.virtual_pipeline_model_parallel_size})"
                    if train.virtual_pipeline_model_parallel_size else "", layout["num_microbatches"])
    return pgs


def collective_device(group: Any = None) -> Any:
    """Where a tensor for a collective over ``group`` (None: the world) must live: this rank's current CUDA device
    when the group's backend is NCCL alone (it has no CPU path), else the CPU (gloo, or a ``cpu:gloo,cuda:nccl``
    pair). The job's small all-reduces (``world.reduce_world``, the start-up maximum) build their
    float64 vectors here and read them back with ``.tolist()``."""
    import torch

    if dist.is_available() and dist.is_initialized() and str(dist.get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank_coords(pg_collection: Any) -> dict[str, int]:
    """This rank's ``{"rank", "tp", "pp", "cp", "dp", "dp_size"}`` from Megatron's groups (global rank: the world's)."""
    return {"rank": dist.get_rank(), "tp": pg_collection.tp.rank(), "pp": pg_collection.pp.rank(),
            "cp": pg_collection.cp.rank(), "dp": pg_collection.dp.rank(), "dp_size": pg_collection.dp.size()}
