"""The warm-memory pool (packing/memory.py) never hands out memory that a live tensor still uses."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch

from bridge.models.bagel.data.config import PackerConfig
from bridge.models.bagel.data.packing import BagelPacker, ListGroupSource, memory

SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "start_of_image": 3, "end_of_image": 4}


def _plan(kind: str, loss: int) -> dict:
    return {"type": kind, "enable_cfg": 0, "loss": loss, "special_token_loss": 0, "special_token_label": None}


def _stream(n: int, seed: int) -> list[dict]:
    """Samples of one VAE image (448-512 px: ~3 MB, pooled) and one ViT image (392 px), distinct pixels."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        side = 448 + 16 * (i % 5)
        vae = torch.rand((3, side, side), generator=g)
        vit = torch.rand((3, 392, 392), generator=g)
        text = list(range(5, 5 + 10 + i % 7))
        out.append(dict(
            sequence_plan=[_plan("vit_image", 0), _plan("text", 1), _plan("vae_image", 1)],
            text_ids_list=[text], image_tensor_list=[vit, vae],
            num_tokens=len(text) + (side // 16) ** 2 + (392 // 14) ** 2,
            data_indexes={"data_indexes": i, "worker_id": 0, "dataset_name": "t"}))
    return out


def _packer(use_flex: bool) -> BagelPacker:
    cfg = PackerConfig(use_flex=use_flex, expected_num_tokens=3000, max_num_tokens=4096,
                       max_num_tokens_per_sample=2000, prefer_buffer_before=1000)
    return BagelPacker([ListGroupSource(_stream(12, 7), cycle=True, name="t")], [1.0], [False], SPECIAL, cfg)


def _snapshot(batch: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else [m.clone() for m in v] if k == "nested_attention_masks"
                else v) for k, v in batch.items()}


def _equal(batch: dict, snap: dict) -> None:
    for k, v in snap.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(batch[k], v), k
        elif k == "nested_attention_masks":
            assert all(torch.equal(a, b) for a, b in zip(batch[k], v)), k


@pytest.mark.parametrize("use_flex", [True, False], ids=["flex", "dense"])
def test_kept_batch_survives_many_later_batches(use_flex: bool) -> None:
    random.seed(0)
    np.random.seed(0)
    packer = _packer(use_flex)
    kept = next(packer)
    snap = _snapshot(kept)
    view = kept["padded_images"][0, :, :8]  # a view alone must keep its whole buffer reserved too
    view_snap = view.clone()
    del kept["padded_images"], snap["padded_images"]
    before = memory.pool_stats()
    for _ in range(12):
        batch = next(packer)
        for v in batch.values():  # scribble over every buffer we are handed
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                v.fill_(7.0)
        for m in batch.get("nested_attention_masks", []):
            m.fill_(7.0)
        del batch
    assert memory.pool_stats()["hits"] > before["hits"], "later batches should have reused warm memory"
    _equal(kept, snap)
    assert torch.equal(view, view_snap)


def test_block_returns_only_after_the_last_view_dies() -> None:
    a = memory.empty((1024, 1024))  # 4 MiB: pooled
    a.fill_(1.0)
    view, arr = a[5:9], a.numpy()
    del a
    others = [memory.empty((1024, 1024)) for _ in range(4)]
    for o in others:
        o.fill_(2.0)
    assert bool((view == 1.0).all()) and bool((arr == 1.0).all())
    hits = memory.pool_stats()["hits"]
    del view, others
    arr = None  # last reference: its block goes back to the pool
    b = memory.empty((1024, 1024))
    assert memory.pool_stats()["hits"] == hits + 1 and b.shape == (1024, 1024) and b.is_contiguous()


def test_release_from_another_thread_and_limit() -> None:
    t = memory.empty((512, 1024), torch.int64)
    assert t.dtype == torch.int64 and t.untyped_storage().nbytes() == 512 * 1024 * 8
    th = threading.Thread(target=lambda: t.__setitem__(0, 1))
    th.start()
    th.join()
    del t
    memory.set_pool_limit(0)
    try:
        assert memory.pool_stats()["free_blocks"] == 0
        assert memory.empty((1024, 1024)).untyped_storage().nbytes() == 4 << 20
    finally:
        memory.set_pool_limit(2 << 30)


def _consumer(inbox, outbox) -> None:
    """Child: keep the first tensor while the parent reuses memory, then check it and drop it."""
    torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork (as in the prefetch producer)
    kept = inbox.get()
    expected = kept.clone()
    outbox.put("holding")
    assert inbox.get() == "check"
    outbox.put(bool(torch.equal(kept, expected)))
    del kept
    outbox.put("dropped")
    inbox.get()


def test_shared_blocks_reused_only_after_the_other_process_drops_them() -> None:
    """Prefetch hand-over: a shared block the trainer (here a child process) still maps is never reused."""
    import torch.multiprocessing as torch_mp

    old = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy("file_system")
    memory.use_shared_memory(True)
    ctx = torch_mp.get_context("fork")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_consumer, args=(inbox, outbox))
    proc.start()
    try:
        if not memory._check_refcount_layout():
            pytest.skip("torch's shared-segment refcount is not readable here: shared buffers are not pooled")
        sent = memory.empty((1024, 1024))
        assert sent.is_shared()
        sent.fill_(3.0)
        inbox.put(sent)
        del sent  # only the child (and the in-flight handle) keeps it now
        assert outbox.get(timeout=60) == "holding"
        before = memory.pool_stats()
        for _ in range(6):
            other = memory.empty((1024, 1024))
            other.fill_(9.0)
            del other
        after = memory.pool_stats()
        assert after["misses"] == before["misses"] + 1, "exactly one new block: the child's block is in use"
        inbox.put("check")
        assert outbox.get(timeout=60) is True
        assert outbox.get(timeout=60) == "dropped"
        hits = memory.pool_stats()["hits"]
        blocks = [memory.empty((1024, 1024)) for _ in range(2)]  # both blocks are free again
        stats = memory.pool_stats()
        assert stats["hits"] == hits + 2 and stats["misses"] == after["misses"]
        del blocks
    finally:
        inbox.put("bye")
        proc.join(30)
        memory.use_shared_memory(False)
        torch_mp.set_sharing_strategy(old)
    assert proc.exitcode == 0


def _forked_allocator(parent_handle, outbox) -> None:
    """Child forked from a process whose pool holds a free shared block: allocate the same size and report."""
    torch.set_num_threads(1)
    memory.use_shared_memory(True)
    t = memory.empty((1024, 1024))
    t.fill_(5.0)
    outbox.put((t.untyped_storage()._share_filename_cpu_()[1] != parent_handle, memory.pool_stats()["shared_blocks"]))


def test_forked_child_never_reuses_the_parents_shared_blocks() -> None:
    """The cause of prefetched batches changing under the trainer: a producer forked from a process whose pool
    held shared blocks reused them (a fork adds no cross-process count), while the parent still used them."""
    import torch.multiprocessing as torch_mp

    old = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy("file_system")
    memory.use_shared_memory(True)
    try:
        if not memory._check_refcount_layout():
            pytest.skip("torch's shared-segment refcount is not readable here: shared buffers are not pooled")
        t = memory.empty((1024, 1024))
        handle = t.untyped_storage()._share_filename_cpu_()[1]
        del t  # the block is free in this process's pool now (a trainer may map it again later)
        ctx = torch_mp.get_context("fork")
        outbox = ctx.Queue()
        proc = ctx.Process(target=_forked_allocator, args=(handle, outbox))
        proc.start()
        fresh, child_blocks = outbox.get(timeout=60)
        proc.join(30)
        assert fresh and child_blocks == 1, "the child must allocate its own block, not the parent's"
        assert proc.exitcode == 0
        hits = memory.pool_stats()["hits"]
        again = memory.empty((1024, 1024))  # the parent's own pool is untouched by the fork
        assert again.untyped_storage()._share_filename_cpu_()[1] == handle and memory.pool_stats()["hits"] == hits + 1
    finally:
        memory.use_shared_memory(False)
        torch_mp.set_sharing_strategy(old)


@pytest.mark.parametrize("use_flex", [True, False], ids=["flex", "dense"])
def test_prefetched_batch_kept_across_many_later_batches(demo_setup, use_flex: bool) -> None:
    """The whole chain with a prefetch producer (shared-memory pool on): a batch the trainer keeps while 10 later
    ones arrive (and are scribbled over and dropped) is bit-for-bit what it was when handed out."""
    import copy

    from _external_common import assert_same, demo_loader

    out, tok = demo_setup
    with demo_loader(out, tok, 0, use_flex, prefetch=2) as loader:
        kept = next(loader)
        snap = copy.deepcopy(kept)
        for _ in range(10):
            batch = next(loader)
            for v in batch.values():
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    v.fill_(7.0)
            for m in batch.get("nested_attention_masks") or []:
                m.fill_(7.0)
            del batch
        assert_same(kept, snap)


def test_producer_pool_leaves_no_segment_behind(demo_setup) -> None:
    """A producer exits with os._exit; its pooled shared blocks must be dropped first, or each one outlives it
    (until the trainer exits): a suite of prefetching loaders filled /dev/shm and was OOM-killed."""
    from _external_common import demo_loader
    from bridge.models.bagel.data.pipeline import shm
    from bridge.models.bagel.data.pipeline.prefetch import live_producers

    out, tok = demo_setup
    loader = demo_loader(out, tok, 0, False, prefetch=2)
    for _ in range(6):
        next(loader)  # dense: blocks are freed by the trainer and reused by the producer
    (producer,) = live_producers()
    kept = next(loader)  # still held by the trainer when the producer stops
    loader.close()
    assert not live_producers()
    del kept
    assert shm.segments_of(producer.pid) == []
