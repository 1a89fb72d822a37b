"""Lossless compaction of Energon's per-rank loader state (what ``SavableDataLoader.save_state_rank`` returns).

Energon stores, per worker, three things that restore can rebuild or that are mostly padding:

* ``SavableDatasetState.rng``: the worker's *global* Python / NumPy / torch RNG states (≈12 KB pickled per
  worker). Energon's worker start seeds them with ``worker_config.worker_seed(i)``
  (``savable_loader._init_worker``), and on restore a ``rng`` of ``None`` re-seeds them with
  ``torch.initial_seed() & 0xFFFFFFFF`` — the same worker seed. Our cookers draw nothing from the global RNGs
  (their choices come from the packer's own streams), so the saved state is normally the freshly seeded one;
  then it is stored as ``None``. A state that differs is kept whole: nothing is ever guessed.
* ``_worker_rng`` (``WorkerRng``, a torch CPU generator state, 5056 bytes): its Mersenne-Twister words are
  stored as 64-bit integers with zero upper halves. Stored as ``None`` when it equals the seeded generator
  (Energon's restore re-seeds it with the worker seed), otherwise zlib-compressed under the key ``rng_zlib``
  (≈3.2 KB) and decompressed before Energon sees it.

The result holds only Energon's own state classes, ``None``, ``int`` and ``bytes``, so Bridge's stock restricted
unpickler loads it. ``expand(compact(s, seeds))`` restores exactly what ``s`` restores (tested through a resume
with 0 and 2 workers).
"""

from __future__ import annotations

import dataclasses
import random
import zlib
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from megatron.energon.rng import SystemRngState
from megatron.energon.savable_loader import SavableDatasetCheckpoint, SavableDatasetState
from megatron.energon.state import FlexState

__all__ = ["compact", "expand", "worker_seeds"]

_ZLIB_KEY = "rng_zlib"


def worker_seeds(worker_config: Any) -> list[int]:
    """Energon's seed of each worker of ``worker_config`` (one entry, the rank's seed, without workers)."""
    if worker_config.num_workers == 0:
        return [worker_config.worker_seed()]
    return [worker_config.worker_seed(i) for i in range(worker_config.num_workers)]


@lru_cache(maxsize=64)
def _seeded_torch(seed: int) -> bytes:
    return bytes(torch.Generator().manual_seed(seed).get_state().tolist())


@lru_cache(maxsize=64)
def _seeded_system(seed: int) -> tuple[bytes, tuple, tuple]:
    """(torch bytes, numpy state, python state) right after Energon's ``SystemRng.seed(seed)``, computed on
    private generators (the process RNG is not touched)."""
    return _seeded_torch(seed), np.random.RandomState(seed).get_state(), random.Random(seed).getstate()


def _is_seeded_system(rng: Any, seed: int) -> bool:
    if not isinstance(rng, SystemRngState) or not isinstance(rng.torch, torch.Tensor):
        return False
    t, n, p = _seeded_system(seed)
    try:
        return (bytes(rng.torch.tolist()) == t and rng.random == p and len(rng.numpy) == len(n)
                and all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a, b in zip(rng.numpy, n)))
    except (TypeError, ValueError):
        return False


def _map_flex(obj: Any, fn) -> Any:
    """``obj`` with every ``FlexState`` rebuilt by ``fn`` (children first); lists/tuples walked, the rest kept."""
    if isinstance(obj, FlexState):
        return fn(FlexState({k: _map_flex(v, fn) for k, v in obj.items()}))
    if isinstance(obj, list):
        return [_map_flex(v, fn) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_map_flex(v, fn) for v in obj)
    return obj


def _compact_worker_rng(seed: int):
    def fn(flex: FlexState) -> FlexState:
        rng = flex.get("_worker_rng")
        if isinstance(rng, FlexState) and set(rng) == {"rng"} and isinstance(rng["rng"], bytes):
            flex["_worker_rng"] = (FlexState(rng=None) if rng["rng"] == _seeded_torch(seed)
                                   else FlexState({_ZLIB_KEY: zlib.compress(rng["rng"], 9)}))
        return flex
    return fn


def _expand_worker_rng(flex: FlexState) -> FlexState:
    if set(flex) == {_ZLIB_KEY}:
        return FlexState(rng=zlib.decompress(flex[_ZLIB_KEY]))
    return flex


def compact(state: Any, seeds: Sequence[int]) -> Any:
    """The smallest state that restores like ``state`` (a ``SavableDataLoaderState``; anything else unchanged).

    ``seeds``: ``worker_seeds(worker_config)`` of the loader that saved it, one per entry of
    ``state.worker_states``.
    """
    workers = getattr(state, "worker_states", None)
    if not isinstance(workers, list) or len(workers) != len(seeds):
        return state
    out = []
    for seed, ws in zip(seeds, workers):
        if isinstance(ws, SavableDatasetCheckpoint) and isinstance(ws.state, SavableDatasetState):
            inner = ws.state
            rng = None if _is_seeded_system(inner.rng, seed) else inner.rng
            inner = dataclasses.replace(inner, rng=rng,
                                        dataset_state=_map_flex(inner.dataset_state, _compact_worker_rng(seed)))
            ws = dataclasses.replace(ws, state=inner)
        else:
            ws = _map_flex(ws, _compact_worker_rng(seed))
        out.append(ws)
    return dataclasses.replace(state, worker_states=out)


def expand(state: Any) -> Any:
    """Undo ``compact`` where Energon cannot read it itself (``rng_zlib``); ``None`` RNGs are Energon's own form."""
    workers = getattr(state, "worker_states", None)
    if not isinstance(workers, list):
        return state
    out = []
    for ws in workers:
        if isinstance(ws, SavableDatasetCheckpoint) and isinstance(ws.state, SavableDatasetState):
            ws = dataclasses.replace(ws, state=dataclasses.replace(
                ws.state, dataset_state=_map_flex(ws.state.dataset_state, _expand_worker_rng)))
        else:
            ws = _map_flex(ws, _expand_worker_rng)
        out.append(ws)
    return dataclasses.replace(state, worker_states=out)
