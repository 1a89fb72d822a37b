"""Job checkpoints: Bridge's own dataloader-state files, the trainer's state, a tiny MLM-compatible step tracker.

Loader state goes through Megatron-Bridge's ``maybe_save_dataloader_state`` /
``maybe_load_dataloader_state`` (``{root}/energon/iter_NNNNNNN/train_dataloader_dprankNNN.pt``, restricted
unpickler on load); a trainer's state (model + optimizer, the same on every DP replica) goes to
``{root}/iter_NNNNNNN/trainer.pt`` (rank 0, loaded with ``weights_only=True``); the step goes to
``{root}/latest_checkpointed_iteration.txt`` like Megatron's tracker, written last: a checkpoint exists once the
tracker names it, so a kill while saving leaves the previous one in force.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import zipfile
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .._bridge import import_bridge
from ..config import ConfigError
from ..energon.layout import write_atomic

__all__ = ["TRACKER", "PackedLedger", "check_resume_dp", "fresh_start_reason", "load_trainer_state",
           "loader_state_files", "rank_state_file", "read_loader_states", "read_run_reads", "read_step",
           "resize_checkpoint", "restore_loader", "save_checkpoint", "trainer_state_file"]

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"


@contextlib.contextmanager
def _bridge_prints() -> Any:
    """Bridge's checkpoint helpers ``print`` their progress unprefixed ("saving dataloader checkpoint at iteration
    …"); they go to this module's logger at DEBUG instead (the job logs its own INFO line)."""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            yield
    finally:
        for line in buf.getvalue().splitlines():
            if line.strip():
                logger.debug("megatron-bridge: %s", line.strip())


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


#: What ``save_checkpoint`` writes under a root before its first tracker exists (a save killed half-way).
_SAVE_PARTS = re.compile(r"energon|iter_\d{7,}|" + re.escape(TRACKER) + r"\.tmp")


def fresh_start_reason(root: str) -> str | None:
    """Whether ``train.load`` = ``root`` starts the job from scratch, as Megatron's ``--load`` does on a directory
    without a checkpoint (the same command starts and resumes a job: requeue scripts, torchrun restarts).

    Returns None when ``root`` holds a checkpoint (its tracker ``latest_checkpointed_iteration.txt``: resume from
    it), else the reason to start fresh: ``root`` does not exist, is empty, or holds only the parts of a first save
    killed before its tracker was written (``energon/``, ``iter_NNNNNNN/``, the tracker's ``.tmp``; the next save
    rewrites them). Raises ``ConfigError`` when ``root`` is a file or holds anything else (it is not a checkpoint
    root: a wrong path must not silently train from scratch).
    """
    if os.path.isfile(os.path.join(root, TRACKER)):
        return None
    if not os.path.exists(root):
        return f"{root} does not exist yet"
    if not os.path.isdir(root):
        raise ConfigError(f"train.load: {root} is a file, not a checkpoint root (a directory holding {TRACKER})")
    names = sorted(os.listdir(root))
    if not names:
        return f"{root} is empty"
    foreign = [n for n in names if not _SAVE_PARTS.fullmatch(n)]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" (+{len(foreign) - 5} more)" if len(foreign) > 5 else "")
        raise ConfigError(f"train.load: {root} holds no checkpoint ({TRACKER} is missing) but is not empty either: "
                          f"{shown}; point train.load at a checkpoint root (train.save of an earlier run) or at an "
                          "empty or new directory to start from scratch")
    return f"{root} holds only an interrupted first save (no {TRACKER})"


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


def trainer_state_file(root: str, step: int) -> str:
    """``{root}/iter_{step:07d}/trainer.pt``: the trainer's state (model + optimizer) at ``step``."""
    return os.path.join(root, f"iter_{step:07d}", "trainer.pt")


def load_trainer_state(root: str, step: int) -> dict[str, Any]:
    """The trainer state saved at ``step`` (``weights_only=True``: tensors and plain containers only, on CPU).

    Raises ``ConfigError`` naming the file when it is missing (a data-only job wrote the checkpoint) or unreadable.
    """
    path = trainer_state_file(root, step)
    if not os.path.isfile(path):
        raise ConfigError(f"train.load: {root} has no model state for step {step} ({path} is missing: the checkpoint "
                          "was written by a data-only job); start the model from scratch with a new train.save, or "
                          "load a checkpoint of a training run")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (*_UNREADABLE, RuntimeError, OSError) as exc:
        raise ConfigError(f"train.load: the model state {path} cannot be read ({type(exc).__name__}: {exc}); resume "
                          "from an earlier checkpoint") from exc


def save_checkpoint(root: str, step: int, iterator: Any, pg_collection: Any,
                    trainer_state: dict[str, Any] | None = None, ledger: "PackedLedger | None" = None) -> None:
    """The trainer's state (rank 0, when given), Bridge's loader-state save, this DP replica's ``ledger`` of packed
    reads (``PackedLedger.write``, when given), then (after a world barrier) the step tracker (rank 0).

    Called on every rank; Bridge lets only the ``tp = pp = cp = 0`` rank of each DP replica write, so the
    step directory holds exactly one ``train_dataloader_dprankNNN.pt`` per DP replica. ``trainer_state`` is the
    same on every rank (replicated model); rank 0 writes it atomically (temporary file, then rename).
    """
    api = _bridge_ckpt()
    if trainer_state is not None and dist.get_rank() == 0:
        path = trainer_state_file(root, step)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(trainer_state, path + ".tmp")
        os.replace(path + ".tmp", path)
    with _bridge_prints():
        api.maybe_save_dataloader_state(None, iterator, step, os.path.join(root, "energon"),
                                        pg_collection=pg_collection)
    if ledger is not None and all(getattr(pg_collection, g).rank() == 0 for g in ("tp", "pp", "cp")):
        ledger.write(root, step, pg_collection.dp.rank(), pg_collection.dp.size())
    dist.barrier()
    if dist.get_rank() == 0:
        write_atomic(os.path.join(root, TRACKER), str(step).encode())
    dist.barrier()


def rank_state_file(state_dir: str, step: int, dp_rank: int) -> str:
    """The file Bridge's ``maybe_load_dataloader_state`` opens for DP rank ``dp_rank`` (same naming)."""
    api = _bridge_ckpt()
    iter_dir = (api.get_checkpoint_name(state_dir, step) if api.get_checkpoint_name is not None
                else os.path.join(state_dir, f"iter_{step:07d}"))
    return os.path.join(iter_dir, f"train_dataloader_dprank{dp_rank:03d}.pt")


#: Advice in Bridge's restricted-unpickler refusal that is wrong for a loader state file: a type outside the
#: allowlist in such a file means the file is not ours (or was tampered with), never that the type should be allowed.
_BRIDGE_ADVICE = ("Please file a bug", "please file a bug", "so it can be added")


def _unreadable(path: str, dp_rank: int, exc: BaseException | str) -> ConfigError:
    detail = " ".join((exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}").split())
    for advice in _BRIDGE_ADVICE:
        at = detail.find(advice)
        if at >= 0:
            detail = detail[:at].rstrip(" .;,")
    error = ConfigError(f"train.load: the loader state file of DP rank {dp_rank} cannot be read: truncated, corrupt "
                        f"or refused by Bridge's restricted loader; resume from an earlier checkpoint or restore the "
                        f"file\nfile: {path}\ncause: {detail}\nA state file written by this package holds only "
                        "types Bridge's restricted loader accepts: any other type means the file is not a loader state "
                        "of this package (or was altered); do not add the type to the allowlist")
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

    With ``data.fresh_stream`` (the loader's ``fresh_stream``) nothing is read: the stream starts fresh.
    Otherwise refuses a changed DP size first (``check_resume_dp``) unless the loader reads the elastic order: then
    every old rank's file is read and resized for this rank (``BagelExternalLoader.resize_states``). Otherwise
    defers to Bridge's ``maybe_load_dataloader_state`` (file ``train_dataloader_dprank{dp:03d}.pt``, ``dp`` = rank
    in ``pg_collection.dp``). A truncated or corrupt state file is reported with its own path (Bridge's loader
    would only say ``BadZipFile: File is not a zip file``, and its log line names rank 0's file).
    """
    loader = iterator.iterable
    if getattr(loader, "fresh_stream", False):  # data.fresh_stream: the model resumes, the data stream starts fresh
        loader.restore_state(None)  # nothing read or restored; the loader says so in one line
        return
    api = _bridge_ckpt()
    state_dir = os.path.join(root, "energon")
    if not os.path.isdir(state_dir):
        raise ConfigError(f"train.load: {root} has no loader state directory ({state_dir})")
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
        with _bridge_prints():
            api.maybe_load_dataloader_state(iterator, step, state_dir, pg_collection=pg_collection)
    except _UNREADABLE as exc:
        raise _unreadable(path, dp_rank, exc) from exc


#: One DP replica's packed reads at a checkpoint (``PackedLedger``), beside its loader state file.
PACKED_FILE = "packed_dprank{:03d}.json"


class PackedLedger:
    """What this DP replica packed since the job started (its ``load`` checkpoint, or nothing): the elastic
    order's identity ``(group, epoch, selection position)`` of every packed sample of every micro-batch, the ledger
    ``tools.ledger.check_exactly_once`` checks, so ``bagel-data ledger --run ROOT`` needs no digest log.

    Written at every checkpoint (``save_checkpoint``) as ``{root}/energon/iter_N/packed_dprankNNN.json``: per group
    and epoch the sorted positions as ``[first, last]`` ranges plus ``[position, extra]`` for any packed more than
    once (a multiset, kept exact: a repeat is what the check looks for), and ``from``: the checkpoint the job
    started from (``{"root", "step"}``, root None for a fresh start), whose own files hold what came before.
    Samples without a ``position`` (the official order) are not recorded.
    """

    def __init__(self, load_root: str | None, start_step: int) -> None:
        self.origin = {"root": os.path.abspath(load_root) if load_root else None, "step": int(start_step)}
        self.reads: Counter = Counter()

    def add(self, batches: Iterable[Mapping[str, Any]]) -> None:
        """Record the packed samples of ``batches`` (``batch_data_indexes`` with a ``position``)."""
        for batch in batches:
            for d in batch.get("batch_data_indexes", ()):
                if "position" in d:
                    self.reads[(str(d["dataset_name"]), int(d["epoch"]), int(d["position"]))] += 1

    def encode(self) -> dict[str, Any]:
        groups: dict[str, dict[str, dict[str, list]]] = {}
        for (g, e, j), n in sorted(self.reads.items()):
            entry = groups.setdefault(g, {}).setdefault(str(e), {"ranges": [], "repeats": []})
            if entry["ranges"] and entry["ranges"][-1][1] == j - 1:
                entry["ranges"][-1][1] = j
            else:
                entry["ranges"].append([j, j])
            if n > 1:
                entry["repeats"].append([j, n - 1])
        return {"format": 1, "from": self.origin, "groups": groups}

    def write(self, root: str, step: int, dp_rank: int, dp_size: int) -> str:
        """Write the ledger of DP rank ``dp_rank`` (of ``dp_size``) at ``step`` (atomically); returns the path."""
        path = os.path.join(root, "energon", f"iter_{step:07d}", PACKED_FILE.format(dp_rank))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_atomic(path, json.dumps({**self.encode(), "step": step, "dp_rank": dp_rank, "dp_size": dp_size},
                                      separators=(",", ":")).encode())
        return path


def _decode_packed(path: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
        reads = []
        for g, epochs in doc["groups"].items():
            for e, entry in epochs.items():
                extra = {int(j): int(n) for j, n in entry["repeats"]}
                for first, last in entry["ranges"]:
                    for j in range(int(first), int(last) + 1):
                        reads += [{"dataset_name": g, "position": j, "epoch": int(e)}] * (1 + extra.get(j, 0))
        return reads, doc["from"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: not a packed-reads ledger of this job ({type(exc).__name__}: {exc})") from None


def read_run_reads(root: str, step: int) -> tuple[list[dict[str, Any]], list[str]]:
    """Every sample a run packed up to ``step`` of checkpoint root ``root``: the ``PackedLedger`` files of every DP
    rank at that step, then those of the checkpoint each launch started from (``from``), back to a fresh start
    (any number of restarts and resizes, same or other roots). Returns the reads (``{"dataset_name", "position",
    "epoch"}``) and the checkpoints read (``root@step``). ``ConfigError`` naming the checkpoint whose files are
    missing (written without the ledger) or unreadable."""
    reads: list[dict[str, Any]] = []
    visited: list[str] = []
    at: tuple[str, int] | None = (os.path.abspath(root), int(step))
    while at is not None:
        r, s = at
        if f"{r}@{s}" in visited:
            raise ConfigError(f"packed-reads ledger: {r} step {s} names itself as its start (a loop)")
        visited.append(f"{r}@{s}")
        if s == 0:
            break
        iter_dir = os.path.join(r, "energon", f"iter_{s:07d}")
        names = sorted(n for n in (os.listdir(iter_dir) if os.path.isdir(iter_dir) else [])
                       if re.fullmatch(r"packed_dprank\d{3,}\.json", n))
        if not names:
            raise ConfigError(f"{iter_dir}: no packed_dprankNNN.json (this checkpoint was written without the "
                              "packed-reads ledger, by an older version): use --digests with the run's digest logs")
        origins = set()
        for name in names:
            part, origin = _decode_packed(os.path.join(iter_dir, name))
            reads += part
            origins.add((origin["root"], int(origin["step"])))
        if len(origins) != 1:
            raise ConfigError(f"{iter_dir}: the ranks' ledgers name different start checkpoints {sorted(origins)}")
        (origin_root, origin_step), = origins
        at = None if origin_root is None else (origin_root, origin_step)
    return reads, visited
