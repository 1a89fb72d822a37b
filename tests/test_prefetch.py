"""Pack-ahead prefetch: same stream, exact resume from the trainer's position, RNG isolation, errors, shutdown."""

from __future__ import annotations

import copy
import multiprocessing as mp
import random
import threading

import numpy as np
import pytest
import torch

from _external_common import FLEX_CASE, assert_same, demo_loader, golden_loader
from bridge.models.bagel.data.config import PackerConfig
from bridge.models.bagel.data.external import BagelExternalLoader, BagelRNGIterator
from bridge.models.bagel.data.pipeline.prefetch import PrefetchStage
from bridge.models.bagel.data.packing import BagelPacker, ListGroupSource
from bridge.models.bagel.data.pipeline.prefetch import PrefetchError, RemoteTraceback, live_producers
from packer_golden import load_case

pytestmark = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")


def _no_producers_left() -> bool:
    return not live_producers()


def test_prefetch_yields_the_synchronous_stream() -> None:
    threads_before = {t.ident for t in threading.enumerate()}
    with golden_loader(FLEX_CASE) as sync, golden_loader(FLEX_CASE, prefetch=3) as ahead:
        for i in range(15):
            assert_same(next(ahead), next(sync), f"batch[{i}]")
        assert live_producers()
    assert _no_producers_left()
    assert {t.ident for t in threading.enumerate() if t.is_alive()} <= threads_before, "leftover threads"


@pytest.mark.parametrize("save_after", [1, 3, 7])
def test_resume_describes_the_next_batch_the_trainer_receives(save_after: int) -> None:
    with golden_loader(FLEX_CASE) as sync:
        stream = [next(sync) for _ in range(save_after + 10)]
    with golden_loader(FLEX_CASE, prefetch=2) as ahead:
        for i in range(save_after):
            assert_same(next(ahead), stream[i])
        state = ahead.save_state()  # the producer is batches ahead by now; the state must not be
        assert state["position"] == save_after
    with golden_loader(FLEX_CASE, prefetch=2, length=3) as fresh:
        fresh.restore_state(state)
        for i in range(10):
            assert_same(next(fresh), stream[save_after + i], f"resumed[{i}]")
    with golden_loader(FLEX_CASE) as fresh_sync:  # a prefetch state also restores a synchronous loader
        fresh_sync.restore_state(state)
        assert_same(next(fresh_sync), stream[save_after])
        sync_state = fresh_sync.save_state()
    with golden_loader(FLEX_CASE, prefetch=2) as fresh_ahead:  # and back
        fresh_ahead.restore_state(sync_state)
        assert_same(next(fresh_ahead), stream[save_after + 1])
    assert _no_producers_left()


def test_save_before_first_batch_and_restore_before_start() -> None:
    with golden_loader(FLEX_CASE) as sync:
        first = [next(sync) for _ in range(3)]
    with golden_loader(FLEX_CASE, prefetch=2) as ahead:
        state = ahead.save_state()
    with golden_loader(FLEX_CASE, prefetch=2) as fresh:
        fresh.restore_state(state)
        for i in range(3):
            assert_same(next(fresh), first[i])


def test_process_rng_untouched_with_prefetch() -> None:
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    before = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    with golden_loader(FLEX_CASE, prefetch=2) as ahead:
        for _ in range(4):
            next(ahead)
        state = ahead.save_state()
    with golden_loader(FLEX_CASE, prefetch=2) as fresh:
        fresh.restore_state(state)
        next(fresh)
    after = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    assert after[0] == before[0]
    assert all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a, b in zip(after[1], before[1]))
    assert torch.equal(after[2], before[2])


def _poisoned_loader(after: int) -> BagelExternalLoader:
    case = load_case(FLEX_CASE)
    cfg = case["config"]
    groups = {g: list(case["groups"][g]) for g in cfg["group_names"]}
    t2i = cfg["group_names"][0]
    bad = dict(groups[t2i][after], sequence_plan=[{**groups[t2i][after]["sequence_plan"][0], "type": "hologram"}])
    groups[t2i][after] = bad
    sources = [ListGroupSource(groups[g], name=g) for g in cfg["group_names"]]
    packer = BagelPacker(sources, cfg["group_weights"], cfg["is_mandatory"], cfg["special_tokens"],
                         PackerConfig.from_mapping({k: v for k, v in cfg.items() if k in PackerConfig.keys()}), group_names=cfg["group_names"])
    return BagelExternalLoader(PrefetchStage(BagelRNGIterator(packer, 1), depth=2), length=10,
                               stateful_loaders=sources)


def test_packer_exception_reaches_the_trainer_with_its_traceback() -> None:
    with _poisoned_loader(after=3) as loader:
        with pytest.raises(ValueError, match="hologram") as info:
            for _ in range(10):
                next(loader)
        assert isinstance(info.value.__cause__, RemoteTraceback)
        assert "pack_sample" in info.value.__cause__.tb
        with pytest.raises(RuntimeError, match="failed earlier"):
            next(loader)
    assert _no_producers_left()


def test_cooker_exception_reaches_the_trainer(demo_setup) -> None:
    out, tok = demo_setup
    broken = copy.deepcopy(tok)

    def explode(*_a, **_k):
        raise RuntimeError("tokenizer exploded inside the cooker")

    broken.encode = explode
    with demo_loader(out, broken, 0, True, prefetch=2) as loader:
        with pytest.raises(RuntimeError, match="exploded") as info:
            next(loader)
        assert "cook" in info.value.__cause__.tb
    assert _no_producers_left()


# Workers 2, dense and saves after 0/1/3/7 with prefetch run in test_stage_round_trip.py.
# "forkserver": the producer starts clean and rebuilds the pipeline from the config (torch may use threads); each
# such producer is a fresh interpreter (~5 s of imports), so the 2-worker case restores one save (after 1 batch)
# and the save after 3 is nw0-save3-forkserver's: where the save falls does not change the forkserver path.
DEMO = [
    pytest.param(0, (3,), "fork", id="nw0-save3"),
    pytest.param(0, (3,), "forkserver", id="nw0-save3-forkserver"),
    pytest.param(2, (1,), "forkserver", id="nw2-save1-forkserver", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("num_workers, save_points, start", DEMO)
def test_demo_resume_with_prefetch_is_exact(demo_setup, num_workers: int, save_points: tuple, start: str) -> None:
    out, tok = demo_setup
    n_after = 10
    with demo_loader(out, tok, num_workers, True) as sync:
        stream = [next(sync) for _ in range(max(save_points) + n_after)]
    states = {}
    with demo_loader(out, tok, num_workers, True, prefetch=2, start=start) as ahead:
        for step in range(1, max(save_points) + 1):
            assert_same(next(ahead), stream[step - 1], f"prefetched[{step - 1}]")
            if step in save_points:
                states[step] = ahead.save_state()
    for step, state in states.items():
        with demo_loader(out, tok, num_workers, True, prefetch=2, length=5, start=start) as fresh:
            fresh.restore_state(state)
            for i in range(n_after):
                assert_same(next(fresh), stream[step + i], f"save@{step} resumed[{i}]")
    assert _no_producers_left()
    assert not [p for p in mp.active_children() if p.name.startswith("bagel")]


def test_forkserver_needs_a_picklable_recipe(demo_setup) -> None:
    """A tokenizer that cannot travel to a clean producer is refused at start with a message naming the knob."""
    out, tok = demo_setup
    broken = copy.deepcopy(tok)
    broken.encode = lambda *_a, **_k: []  # a local lambda: not picklable
    with demo_loader(out, broken, 0, True, prefetch=2, start="forkserver") as loader:
        with pytest.raises(PrefetchError, match="prefetch_start 'forkserver'.*picklable.*'fork'"):
            next(loader)
    assert _no_producers_left()


def test_shared_memory_allocation_for_the_producer() -> None:
    """In a producer the big batch tensors are allocated in shared memory (hand-over without copies)."""
    from bridge.models.bagel.data.packing import memory

    memory.use_shared_memory(True)
    try:
        with golden_loader(FLEX_CASE) as loader:
            batch = next(loader)
    finally:
        memory.use_shared_memory(False)
    assert batch["padded_images"].is_shared() and batch["packed_vit_tokens"].is_shared()
    with golden_loader(FLEX_CASE) as loader:
        plain = next(loader)
    assert not plain["padded_images"].is_shared()
    assert_same(batch, plain)


def test_mid_size_tensors_travel_in_one_shared_block() -> None:
    """The producer copies a batch's mid-size tensors (position ids, indexes, timesteps) into one pooled shared
    block instead of one new segment each: same dtype, shape and values; tensors that share storage, are not
    contiguous, are tiny or already shared travel as before (issue 43)."""
    from bridge.models.bagel.data.packing import memory
    from bridge.models.bagel.data.pipeline.prefetch import _Inline, _gather_shared, _to_wire

    base = torch.arange(5000, dtype=torch.int64)
    batch = {"ids": torch.arange(30000, dtype=torch.int64), "t": [torch.rand(7001), torch.rand(3, 2000).half()],
             "alias_a": base, "alias_b": base.view(50, 100), "strided": torch.rand(100, 200).t(),
             "tiny": torch.arange(10), "n": 3}
    memory.use_shared_memory(True)
    try:
        shared = memory.empty((1 << 20,), torch.float32)
        batch["shared"] = shared
        gathered = _gather_shared(batch)
        wire = _to_wire(batch, gathered)
    finally:
        memory.use_shared_memory(False)
    for got, want in ((wire["ids"], batch["ids"]), (wire["t"][0], batch["t"][0]), (wire["t"][1], batch["t"][1])):
        assert got.is_shared() and got.is_contiguous() and got.data_ptr() % 64 == 0
        assert got.dtype == want.dtype and torch.equal(got, want)
    storages = {t.untyped_storage().data_ptr() for t in (wire["ids"], *wire["t"])}
    assert len(storages) == 1, "one block for the three"
    assert wire["alias_a"] is base and wire["alias_b"] is batch["alias_b"], "aliased tensors keep their storage"
    assert wire["strided"] is batch["strided"] and wire["shared"] is shared and wire["n"] == 3
    assert isinstance(wire["tiny"], _Inline)
