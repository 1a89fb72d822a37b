"""Job checkpoints: Bridge's own dataloader-state files plus a tiny MLM-compatible step tracker.

Loader state goes through Megatron-Bridge's ``maybe_save_dataloader_state`` /
``maybe_load_dataloader_state`` (``{root}/energon/iter_NNNNNNN/train_dataloader_dprankNNN.pt``, restricted
unpickler on load); the step goes to ``{root}/latest_checkpointed_iteration.txt`` like Megatron's tracker.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from .._bridge import import_bridge
from ..config import ConfigError

__all__ = ["TRACKER", "read_step", "restore_loader", "save_checkpoint"]

TRACKER = "latest_checkpointed_iteration.txt"


def read_step(root: str) -> int:
    """The step recorded in ``root``'s tracker (clear error when there is no checkpoint)."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        raise ConfigError(f"train.load: no checkpoint in {root} (missing {TRACKER})")
    text = open(path, encoding="utf-8").read().strip()
    if not text.isdigit():
        raise ConfigError(f"train.load: {path} does not hold a step number (got {text[:40]!r})")
    return int(text)


def _bridge_ckpt() -> Any:
    api = import_bridge()
    if api.maybe_save_dataloader_state is None:
        raise RuntimeError(f"loader checkpoints need Megatron-Bridge's checkpointing module: {api.checkpointing_error}")
    return api


def save_checkpoint(root: str, step: int, iterator: Any, pg_collection: Any) -> None:
    """Write this rank's loader state (Bridge) and, after all ranks wrote, the step tracker (rank 0)."""
    api = _bridge_ckpt()
    api.maybe_save_dataloader_state(None, iterator, step, os.path.join(root, "energon"), pg_collection=pg_collection)
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(str(step))
        os.replace(tmp, os.path.join(root, TRACKER))
    dist.barrier()


def restore_loader(root: str, step: int, iterator: Any, pg_collection: Any) -> None:
    """Restore this rank's loader from ``root`` at ``step`` through Bridge (refuses a changed DP size)."""
    api = _bridge_ckpt()
    state_dir = os.path.join(root, "energon")
    if not os.path.isdir(state_dir):
        raise ConfigError(f"train.load: {root} has no loader state directory ({state_dir})")
    api.maybe_load_dataloader_state(iterator, step, state_dir, pg_collection=pg_collection)
