"""BagelRNGIterator: private data RNG initialised like a one-worker torch DataLoader, isolated and resumable."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from bridge.models.bagel.data.external import BagelRNGIterator, initial_worker_rng_states
from bridge.models.bagel.data.state import StateError, check_restricted


class _WorkerRNGProbe(IterableDataset):
    """Yields the process RNG states as seen inside the DataLoader worker (pickled, so nothing converts them)."""

    def __iter__(self):
        yield pickle.dumps((random.getstate(), np.random.get_state(), torch.get_rng_state()))


class _Draws:
    """A stateful iterator that draws from all three process-global RNGs, like the packer does."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.n = 0
        self.fail_at = fail_at

    def __iter__(self):
        return self

    def __next__(self):
        self.n += 1
        if self.n == self.fail_at:
            random.random()
            np.random.randn()
            torch.rand(1)
            raise ValueError("boom inside the packer")
        return {"py": random.random(), "np": float(np.random.randn()), "torch": torch.rand(3), "n": self.n}

    def state_dict(self):
        return {"n": self.n, "peek": random.random()}  # reads RNG on purpose: must be the private stream

    def load_state_dict(self, state):
        self.n = state["n"]


def _process_states():
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _assert_process_unchanged(before):
    py, npy, tch = before
    assert random.getstate() == py
    now = np.random.get_state()
    assert now[0] == npy[0] and np.array_equal(now[1], npy[1]) and now[2:] == npy[2:]
    assert torch.equal(torch.get_rng_state(), tch)


def _same_batch(a, b):
    assert a["py"] == b["py"] and a["np"] == b["np"] and a["n"] == b["n"]
    assert a["torch"].dtype == b["torch"].dtype and a["torch"].shape == b["torch"].shape
    assert torch.equal(a["torch"], b["torch"])


@pytest.mark.parametrize("rank_seed", [0, 42 * 8 + 3])
def test_initial_states_equal_real_one_worker_dataloader(rank_seed):
    loader = DataLoader(_WorkerRNGProbe(), batch_size=None, num_workers=1,
                        generator=torch.Generator().manual_seed(rank_seed))
    py, npy, tch = pickle.loads(next(iter(loader)))
    ours_py, ours_np, ours_torch = initial_worker_rng_states(rank_seed)
    assert ours_py == py
    assert ours_np[0] == npy[0] and np.array_equal(ours_np[1], npy[1]) and ours_np[2:] == npy[2:]
    assert ours_torch.dtype == torch.uint8 and torch.equal(ours_torch, tch)
    state = BagelRNGIterator(_Draws(), rank_seed).state_dict()
    assert state["python_rng"] == [py[0], list(py[1]), py[2]]
    assert state["numpy_rng"]["keys"] == npy[1].tolist() and state["numpy_rng"]["pos"] == npy[2]
    assert torch.equal(state["torch_rng"], tch)


def test_rank_seeds_give_different_streams():
    a = next(BagelRNGIterator(_Draws(), 1))
    b = next(BagelRNGIterator(_Draws(), 2))
    assert a["py"] != b["py"] and not torch.equal(a["torch"], b["torch"])


def test_a_seed_that_is_not_an_integer_is_refused_at_construction():
    """``"42"`` and ``1.5`` were taken (as 42 and 1) and ``2**70`` failed only at the first batch; numpy ints,
    integral floats and the full uint64 range are seeds."""
    for bad, kind in (("42", TypeError), (1.5, TypeError), (True, TypeError), (None, TypeError),
                      (2**64, ValueError), (-(2**63) - 1, ValueError)):
        with pytest.raises(kind, match="BagelRNGIterator: rank_seed"):
            BagelRNGIterator(_Draws(), bad)
    for good in (np.int64(7), 7.0, 2**64 - 1, -(2**63)):
        next(BagelRNGIterator(_Draws(), good))
    assert next(BagelRNGIterator(_Draws(), np.int64(7)))["py"] == next(BagelRNGIterator(_Draws(), 7))["py"]


def test_wrapped_iterator_draws_from_private_streams():
    py, npy, tch = initial_worker_rng_states(7)
    r = random.Random()
    r.setstate(py)
    rs = np.random.RandomState()
    rs.set_state(npy)
    g = torch.Generator()
    g.set_state(tch)
    batch = next(BagelRNGIterator(_Draws(), 7))
    assert batch["py"] == r.random()
    assert batch["np"] == float(rs.randn())
    assert torch.equal(batch["torch"], torch.rand(3, generator=g))


def test_process_rng_unchanged_by_next_state_dict_load_and_errors():
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    before = _process_states()
    it = BagelRNGIterator(_Draws(fail_at=3), 5)
    next(it)
    _assert_process_unchanged(before)
    state = it.state_dict()
    _assert_process_unchanged(before)
    next(it)
    with pytest.raises(ValueError, match="boom"):
        next(it)
    _assert_process_unchanged(before)
    it2 = BagelRNGIterator(_Draws(), 5)
    it2.load_state_dict(state)
    _assert_process_unchanged(before)


def test_model_rng_use_between_batches_does_not_change_data_stream():
    clean = BagelRNGIterator(_Draws(), 11)
    ref = [next(clean) for _ in range(5)]
    noisy = BagelRNGIterator(_Draws(), 11)
    got = []
    for i in range(5):
        random.seed(i)
        np.random.seed(i)
        torch.manual_seed(i)
        random.random()
        np.random.rand(7)
        torch.randn(5)
        got.append(next(noisy))
    for a, b in zip(ref, got):
        _same_batch(a, b)


def test_state_round_trip_continues_exact_stream_and_is_restricted():
    ref_it = BagelRNGIterator(_Draws(), 3)
    ref = [next(ref_it) for _ in range(6)]
    it = BagelRNGIterator(_Draws(), 3)
    for _ in range(2):
        next(it)
    state = it.state_dict()
    assert set(state) == {"source", "python_rng", "numpy_rng", "torch_rng"}
    check_restricted(state)
    assert type(state["numpy_rng"]["keys"]) is list and all(type(k) is int for k in state["numpy_rng"]["keys"])
    assert state["torch_rng"].dtype == torch.uint8
    # the inner state_dict() drew from the private stream: saving must still not change the stream
    resumed = BagelRNGIterator(_Draws(), 999)  # the seed does not matter after a restore
    resumed.load_state_dict(pickle.loads(pickle.dumps(state)))
    for want in ref[2:]:
        _same_batch(next(resumed), want)
    # saving did not disturb the saved iterator's own stream either
    for want in ref[2:]:
        _same_batch(next(it), want)
    # the snapshot is a copy: advancing the source does not mutate it
    assert state["source"]["stage"] == "_Draws" and state["source"]["state"]["n"] == 2


def test_bad_states_raise_clear_errors():
    it = BagelRNGIterator(_Draws(), 0)
    good = it.state_dict()
    with pytest.raises(StateError, match="'source'"):
        it.load_state_dict({"python_rng": good["python_rng"]})
    with pytest.raises(StateError, match="missing"):
        it.load_state_dict({"source": good["source"], "python_rng": good["python_rng"]})
    with pytest.raises(StateError, match="torch_rng"):
        it.load_state_dict({**good, "torch_rng": good["torch_rng"].float()})
    with pytest.raises(StateError, match="numpy_rng"):
        it.load_state_dict({**good, "numpy_rng": {"keys": [1, 2]}})
    with pytest.raises(StateError, match="python_rng"):
        it.load_state_dict({**good, "python_rng": [3, [1], None]})
