"""Job checkpoints: Bridge's own dataloader-state files plus a tiny MLM-compatible step tracker.

Loader state goes through Megatron-Bridge's ``maybe_save_dataloader_state`` /
``maybe_load_dataloader_state`` (``{root}/energon/iter_NNNNNNN/train_dataloader_dprankNNN.pt``, restricted
unpickler on load); the step goes to ``{root}/latest_checkpointed_iteration.txt`` like Megatron's tracker.
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile
import zlib
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from .._bridge import import_bridge
from ..config import ConfigError

__all__ = ["TRACKER", "check_resume_dp", "loader_state_files", "rank_state_file", "read_loader_states", "read_step",
           "resize_checkpoint", "restore_loader", "save_checkpoint"]

TRACKER = "latest_checkpointed_iteration.txt"
# What reading a damaged torch.save zip raises inside Bridge's loader (energon_torch_load parses the zip itself).
_UNREADABLE = (zipfile.BadZipFile, zlib.error, EOFError, pickle.UnpicklingError)


def read_step(root: str) -> int:
    """The step recorded in ``root``'s tracker (clear error when there is no checkpoint)."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        raise ConfigError(f"train.load: no checkpoint in {root} (missing {TRACKER})")
    text = open(path, encoding="utf-8").read().strip()
    if not text.isdigit():
        raise ConfigError(f"train.load: {path} does not hold a step number (got {text[:40]!r})")
    return int(text)


def loader_state_files(root: str, step: int) -> list[str]:
    """Sorted ``train_dataloader_dprankNNN.pt`` names under ``{root}/energon/iter_{step:07d}/`` (one per DP replica)."""
    iter_dir = os.path.join(root, "energon", f"iter_{step:07d}")
    if not os.path.isdir(iter_dir):
        return []
    return sorted(n for n in os.listdir(iter_dir) if re.fullmatch(r"train_dataloader_dprank\d{3,}\.pt", n))


def check_resume_dp(root: str, step: int, dp_size: int, order: str = "elastic") -> int:
    """Refuse to resume under a different data-parallel size unless ``order`` is ``"elastic"`` (``ConfigError``,
    the same line on every rank); returns the checkpoint's DP size.

    Bridge writes one state file per DP replica, so the checkpoint's DP size is the number of files.
    Bridge itself would refuse too, but differently per rank (a missing file on the new DP ranks, a
    fingerprint mismatch on the old ones); this check says what happened once, before anything is built.
    A changed TP/PP/CP with the same DP passes: the stream depends only on the DP rank and size.
    """
    files = loader_state_files(root, step)
    if not files:
        raise ConfigError(f"train.load: {root} has no loader state for step {step} "
                          f"({os.path.join(root, 'energon', f'iter_{step:07d}')} is missing or empty)")
    if len(files) != dp_size and order != "elastic":
        raise ConfigError(f"train.load: the checkpoint at step {step} was written with data-parallel size "
                          f"{len(files)} ({len(files)} loader state files), this run has DP {dp_size}; "
                          f"data.order {order!r} is a stream of the DP size, so resuming under another DP size is "
                          "refused (keep DP, or use data.order: elastic for restarts on another number of nodes)")
    return len(files)


def _bridge_ckpt() -> Any:
    api = import_bridge()
    if api.maybe_save_dataloader_state is None:
        raise RuntimeError(f"loader checkpoints need Megatron-Bridge's checkpointing module: {api.checkpointing_error}")
    return api


def save_checkpoint(root: str, step: int, iterator: Any, pg_collection: Any) -> None:
    """Bridge's loader-state save, then (after a world barrier) the step tracker (rank 0).

    Called on every rank; Bridge lets only the ``tp = pp = cp = 0`` rank of each DP replica write, so the
    step directory holds exactly one ``train_dataloader_dprankNNN.pt`` per DP replica.
    """
    api = _bridge_ckpt()
    api.maybe_save_dataloader_state(None, iterator, step, os.path.join(root, "energon"), pg_collection=pg_collection)
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(str(step))
        os.replace(tmp, os.path.join(root, TRACKER))
    dist.barrier()


def rank_state_file(state_dir: str, step: int, dp_rank: int) -> str:
    """The file Bridge's ``maybe_load_dataloader_state`` opens for DP rank ``dp_rank`` (same naming)."""
    api = _bridge_ckpt()
    iter_dir = (api.get_checkpoint_name(state_dir, step) if api.get_checkpoint_name is not None
                else os.path.join(state_dir, f"iter_{step:07d}"))
    return os.path.join(iter_dir, f"train_dataloader_dprank{dp_rank:03d}.pt")


def _unreadable(path: str, dp_rank: int, exc: BaseException | str) -> ConfigError:
    detail = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    error = ConfigError(f"train.load: the loader state file {path} of DP rank {dp_rank} cannot be read: "
                        f"truncated, corrupt or refused by Bridge's restricted loader ({detail}); resume from an "
                        "earlier checkpoint or restore the file")
    error.brief = f"its loader state file {os.path.basename(path)} cannot be read"  # the other ranks' line
    return error


def read_loader_states(root: str, step: int) -> list[dict[str, Any]]:
    """Every DP rank's loader state at ``step`` (rank order), read through Bridge's restricted unpickler."""
    api = _bridge_ckpt()
    iter_dir = os.path.dirname(rank_state_file(os.path.join(root, "energon"), step, 0))
    states = []
    for name in loader_state_files(root, step):
        path = os.path.join(iter_dir, name)
        try:
            states.append(api.energon_torch_load(path)["dataloader_state_dict"])
        except (*_UNREADABLE, KeyError, OSError) as exc:
            raise _unreadable(path, int(name[len("train_dataloader_dprank"):-3]), exc) from exc
    return states


def resize_checkpoint(root: str, step: int, dp_size: int, open_loader: Callable[[], Any]) -> list[str]:
    """Rewrite ``step``'s loader state files for ``dp_size`` DP ranks (elastic order), for Bridge's ``pretrain()``
    (which opens only its own rank's file): the old files move to ``iter_N/resized_from_dpW/``; returns the new
    paths. ``open_loader()``: a context manager giving a ``BagelExternalLoader`` built from the run's data
    configuration (any DP rank of the new size), called only once the old files have been read and need resizing:
    its live chain resizes each stage's part (``BagelExternalLoader.resize_states``). Idempotent on a checkpoint
    already of that size (nothing is written, no loader built). A damaged state file raises ``ConfigError`` naming
    it before anything is built."""
    import shutil

    import torch

    olds = read_loader_states(root, step)
    if len(olds) == dp_size:
        return []
    with open_loader() as loader:
        new = [loader.resize_states(olds, r, dp_size) for r in range(dp_size)]
    iter_dir = os.path.dirname(rank_state_file(os.path.join(root, "energon"), step, 0))
    backup = os.path.join(iter_dir, f"resized_from_dp{len(olds)}")
    os.makedirs(backup, exist_ok=False)
    for name in loader_state_files(root, step):
        shutil.move(os.path.join(iter_dir, name), os.path.join(backup, name))
    paths = []
    for r, state in enumerate(new):
        path = os.path.join(iter_dir, f"train_dataloader_dprank{r:03d}.pt")
        torch.save({"dataloader_state_dict": state}, path + ".tmp")
        os.replace(path + ".tmp", path)
        paths.append(path)
    return paths


def restore_loader(root: str, step: int, iterator: Any, pg_collection: Any) -> None:
    """Restore this rank's loader from its DP replica's file at ``step`` through Bridge (every rank restores).

    Refuses a changed DP size first (``check_resume_dp``) unless the loader reads the elastic order: then every
    old rank's file is read and resized for this rank (``BagelExternalLoader.resize_states``). Otherwise
    defers to Bridge's
    ``maybe_load_dataloader_state`` (file ``train_dataloader_dprank{dp:03d}.pt``, ``dp`` = rank in
    ``pg_collection.dp``). A truncated or corrupt state file is reported with its own path (Bridge's loader
    would only say ``BadZipFile: File is not a zip file``, and its log line names rank 0's file).
    """
    api = _bridge_ckpt()
    state_dir = os.path.join(root, "energon")
    if not os.path.isdir(state_dir):
        raise ConfigError(f"train.load: {root} has no loader state directory ({state_dir})")
    loader = iterator.iterable
    old_size = check_resume_dp(root, step, pg_collection.dp.size(), loader.order or "elastic")
    dp_rank = pg_collection.dp.rank()
    if old_size != pg_collection.dp.size():  # elastic order: every old rank's state, resized for this rank
        loader.restore_state(loader.resize_states(read_loader_states(root, step), dp_rank, pg_collection.dp.size()))
        return
    path = rank_state_file(state_dir, step, dp_rank)
    if os.path.isfile(path):  # a missing file (changed DP size) is Bridge's own, clear error
        try:
            with zipfile.ZipFile(path) as archive:  # torch.save's format; every member's CRC is checked
                bad = archive.testzip()
        except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as exc:
            raise _unreadable(path, dp_rank, exc) from exc
        if bad is not None:
            raise _unreadable(path, dp_rank, f"CRC mismatch in member {bad}")
    try:
        api.maybe_load_dataloader_state(iterator, step, state_dir, pg_collection=pg_collection)
    except _UNREADABLE as exc:
        raise _unreadable(path, dp_rank, exc) from exc
