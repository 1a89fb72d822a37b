"""Energon's per-rank loader state compacted losslessly (``energon.compact_state``) — issue 13's state budget.

Real Energon state classes; the reader-level resume with 2 workers (through ``torch.save`` and Bridge's restricted
unpickler) is in ``test_reader.py::test_worker_state_is_compact_and_resumes``.
"""

from __future__ import annotations

import pickle
import random

import numpy as np
import torch
from megatron.energon.rng import SystemRngState
from megatron.energon.savable_loader import SavableDataLoaderState, SavableDatasetCheckpoint, SavableDatasetState
from megatron.energon.state import FlexState

from bridge.models.bagel.data.energon.compact_state import compact, expand


def _system(seed: int, draws: int = 0) -> SystemRngState:
    t = torch.Generator().manual_seed(seed)
    torch.rand(draws, generator=t)
    n = np.random.RandomState(seed)
    n.rand(draws)
    p = random.Random(seed)
    for _ in range(draws):
        p.random()
    return SystemRngState(torch=t.get_state(), numpy=n.get_state(), random=p.getstate())


def _worker_rng(seed: int, draws: int) -> FlexState:
    g = torch.Generator().manual_seed(seed)
    torch.rand(draws, generator=g)
    return FlexState(rng=bytes(g.get_state().tolist()))


def _state(seeds, draws) -> SavableDataLoaderState:
    workers = [SavableDatasetCheckpoint(state=SavableDatasetState(
        rng=_system(s, d), sample_index=7 + i,
        dataset_state=FlexState(datasets=[FlexState(_worker_rng=_worker_rng(s, d), _sample_count=3)])), offset=i)
        for i, (s, d) in enumerate(zip(seeds, draws))]
    return SavableDataLoaderState(worker_states=workers, next_worker_id=1, micro_batch_size=None)


def _inner(ws):
    return ws.state.dataset_state["datasets"][0]


def test_seeded_rngs_become_none_and_drawn_ones_are_kept_exactly():
    seeds = [11, 12]
    full = _state(seeds, draws=[0, 5])
    small = compact(full, seeds)
    assert small.worker_states[0].state.rng is None                       # freshly seeded: Energon re-seeds it
    assert _inner(small.worker_states[0])["_worker_rng"] == FlexState(rng=None)
    assert small.worker_states[1].state.rng is full.worker_states[1].state.rng  # drawn from: kept whole
    assert set(_inner(small.worker_states[1])["_worker_rng"]) == {"rng_zlib"}
    assert len(pickle.dumps(small)) < len(pickle.dumps(full)) / 2      # one worker seeded, one drawn from
    back = expand(small)
    assert back.worker_states[1].state.rng is full.worker_states[1].state.rng
    assert _inner(back.worker_states[1])["_worker_rng"]["rng"] == _inner(full.worker_states[1])["_worker_rng"]["rng"]
    assert _inner(back.worker_states[1])["_sample_count"] == 3 and back.worker_states[1].state.sample_index == 8
    assert (back.next_worker_id, back.worker_states[1].offset) == (1, 1)
    assert _inner(full.worker_states[1])["_worker_rng"]["rng"]  # the input is not modified


def test_a_seed_that_does_not_match_keeps_the_state():
    full = _state([11], draws=[0])
    small = compact(full, [99])
    assert small.worker_states[0].state.rng is full.worker_states[0].state.rng
    assert set(_inner(small.worker_states[0])["_worker_rng"]) == {"rng_zlib"}


def test_anything_else_passes_through():
    full = _state([1, 2], draws=[0, 0])
    assert compact(full, [1]) is full                  # seeds do not fit the workers: nothing is guessed
    assert compact(None, []) is None and expand(None) is None
