"""The reader core (``GroupReader``, elastic order) on small converted datasets: exact resume (0 and 2 read workers),
restore_sample by replay, DP sharding, small datasets on more ranks, workers stopped on close."""

from __future__ import annotations

import io
import json
import pickle
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from bridge.models.bagel.data.converter.convert import convert_edit, convert_t2i
from bridge.models.bagel.data.energon.cooking import ReplayError, make_cook_context
from bridge.models.bagel.data.energon.readers import ReadPool, open_group_reader
from bridge.models.bagel.data.state import StateError
from bridge.models.bagel.data.tokenizer import add_special_tokens, build_qwen2_tokenizer

pytestmark = [pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]

VAE = dict(max_image_size=64, min_image_size=32, image_stride=16)
VIT = dict(max_image_size=56, min_image_size=28, image_stride=14)
N_T2I = 24
BAD_ROW = 5  # null image: a tombstone


def _png(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (24 + 4 * (i % 5), 16 + 2 * (i % 7)), (i * 37 % 256, i * 11 % 256, 90)).save(buf, "PNG")
    return buf.getvalue()


def _write_t2i(d, n, offset=0):
    d.mkdir(parents=True)
    rows = [{"image": None if i == BAD_ROW else _png(i + offset),
             "captions": json.dumps({"a": f"caption {i + offset} a", "b": f"number {i + offset}", "c": "third"})}
            for i in range(n)]
    half = n // 2
    for f, part in enumerate((rows[:half], rows[half:])):
        pq.write_table(pa.Table.from_pylist(part, schema=pa.schema([("image", pa.binary()), ("captions", pa.string())])),
                       d / f"part-{f:04d}.parquet", row_group_size=5)


@pytest.fixture(scope="module")
def tok():
    return add_special_tokens(build_qwen2_tokenizer())[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("reader_data")
    out = root / "converted"
    _write_t2i(root / "raw" / "t2i", N_T2I)
    _write_t2i(root / "raw2" / "t2i_b", 6, offset=100)
    _write_t2i(root / "raw3" / "tiny", 3, offset=200)
    ed = root / "raw" / "edit"
    ed.mkdir(parents=True)
    rows = [{"image_list": [_png(i + k) for k in range(4)],
             "instruction_list": [[f"step {k} v{j}" for j in range(3)] for k in range(3)]} for i in range(10)]
    pq.write_table(pa.Table.from_pylist(rows), ed / "e.parquet", row_group_size=5)
    (root / "raw" / "info.json").write_text(json.dumps({str(ed / "e.parquet"): {"num_row_groups": 2}}))
    paths = {
        "t2i": convert_t2i(str(root / "raw" / "t2i"), out, samples_per_shard=8, progress=False).path,
        "t2i_b": convert_t2i(str(root / "raw2" / "t2i_b"), out, progress=False).path,
        "tiny": convert_t2i(str(root / "raw3" / "tiny"), out, progress=False).path,
        "edit": convert_edit(str(ed), str(root / "raw" / "info.json"), out, progress=False).path,
    }
    return paths


def make(tok, path, *, num_workers=0, seed=0, dp_rank=0, dp_size=1, partitions=8, num_used_data=None):
    vit = VIT if "edit" in str(path) else None
    group = "unified_edit" if "edit" in str(path) else "t2i_pretrain"
    ctx = make_cook_context(group, tok, VAE, vit)
    return open_group_reader("elastic", path, ctx, seed=seed, dp_rank=dp_rank, dp_size=dp_size, partitions=partitions,
                             num_used_data=num_used_data, pool=ReadPool(num_workers) if num_workers else None)


def take(reader, n):
    return [next(reader) for _ in range(n)]


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.__key__ == y.__key__ and x.restore_key == y.restore_key
        assert x.data_indexes == y.data_indexes and x.rng_choices == y.rng_choices and x.source == y.source
        assert x.sequence_plan == y.sequence_plan and x.text_ids_list == y.text_ids_list
        assert x.num_tokens == y.num_tokens and len(x.image_tensor_list) == len(y.image_tensor_list)
        for p, q in zip(x.image_tensor_list, y.image_tensor_list):
            assert p.dtype == q.dtype == torch.float32 and p.shape == q.shape and torch.equal(p, q)


def rng_states():
    return random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()


def assert_rng_unchanged(before, torch_too=True):
    after = rng_states()
    assert after[0] == before[0] and (after[1] == before[1]).all()
    if torch_too:
        assert torch.equal(after[2], before[2])


@pytest.mark.parametrize("k", [0, 7, 20])
def test_resume_nw0(tok, data, k):
    a = make(tok, data["t2i"], seed=3)
    take(a, k)
    state = a.state_dict()
    cont = take(a, 35)  # crosses the 24-position epoch boundary
    b = make(tok, data["t2i"], seed=3)
    b.load_state_dict(state)
    assert_same(cont, take(b, 35))
    assert b.drops.counts == a.drops.counts and a.drops.counts["missing_image"] >= 1  # counts restored
    assert {s.__key__ for s in cont} == {f"{i:08d}" for i in range(N_T2I) if i != BAD_ROW}


def test_reading_is_deterministic_and_keeps_global_rng(tok, data):
    a = make(tok, data["t2i"], seed=3)
    first = take(a, 1)
    before = rng_states()
    xs = first + take(a, 30)
    assert_rng_unchanged(before)  # choices come from a private generator per (position, epoch)
    assert_same(xs, take(make(tok, data["t2i"], seed=3), 31))
    assert len({s.rng_choices for s in xs}) > 1
    other = take(make(tok, data["t2i"], seed=4), 31)
    assert [s.rng_choices for s in other] != [s.rng_choices for s in xs]
    s = xs[0]
    assert s.data_indexes == {"data_indexes": [s.source["file_index"], s.source["row_group"], s.source["row"]],
                              "worker_id": 0, "dataset_name": "t2i_pretrain", "position": s.data_indexes["position"],
                              "epoch": 0, "partition": s.data_indexes["partition"]}


@pytest.mark.slow
def test_resume_and_restore_sample_with_read_workers(tok, data):
    a = make(tok, data["t2i"], num_workers=2, seed=5)
    take(a, 9)
    state = a.state_dict()
    cont = take(a, 35)
    assert_same(cont, take(make(tok, data["t2i"], seed=5), 44)[9:])  # the workers change nothing in the stream
    b = make(tok, data["t2i"], num_workers=2, seed=5)
    b.load_state_dict(state)
    assert_same(cont, take(b, 35))
    before = rng_states()
    assert_same(cont[:6], [a.restore_sample(s.restore_key) for s in cont[:6]])  # in the main process
    assert_rng_unchanged(before)
    for r in (a, b):
        r.close()  # workers exit at once
    with pytest.raises(RuntimeError, match="closed"):
        next(a)


def test_state_is_small_and_survives_bridges_restricted_unpickler(tok, data, tmp_path):
    """The reader's state is a few hundred bytes (the plan's blocks as packed deltas, counters) and travels through
    torch.save + Bridge's restricted unpickler, resuming bit for bit with 2 read workers."""
    from bridge.models.bagel.data._bridge import import_bridge

    a = make(tok, data["t2i"], num_workers=2, seed=5)
    take(a, 9)
    state = a.state_dict()
    assert len(pickle.dumps(state)) < 2_000
    path = tmp_path / "reader.pt"
    torch.save(state, path)
    cont = take(a, 20)
    b = make(tok, data["t2i"], num_workers=2, seed=5)
    b.load_state_dict(import_bridge().energon_torch_load(str(path)))
    assert_same(cont, take(b, 20))
    for r in (a, b):
        r.close()


def test_restore_sample_replays_without_rng(tok, data):
    r = make(tok, data["edit"], seed=1)
    xs = take(r, 20)
    assert any(len(s.rng_choices) >= 4 for s in xs)
    before = rng_states()
    assert_same(xs, [r.restore_sample(s.restore_key) for s in xs])
    fresh = make(tok, data["edit"], seed=1)  # a reader that never iterated restores too
    assert_same(xs[:5], [fresh.restore_sample(s.restore_key) for s in xs[:5]])
    assert_rng_unchanged(before)
    # the recorded choices really drive the rebuild: other instruction choices give other texts
    s = next(x for x in xs if len(x.rng_choices) == 3)  # start, end, one instruction (stepwise, one step)
    k, ch = s.restore_key
    alt = r.restore_sample((k, ch[:2] + ((ch[2] + 1) % 3,)))
    assert alt.text_ids_list != s.text_ids_list and torch.equal(alt.image_tensor_list[0], s.image_tensor_list[0])
    with pytest.raises(ReplayError):
        r.restore_sample((k, ch + (0,)))
    with pytest.raises(StateError, match="not an elastic restore key"):
        r.restore_sample("nope")


def _epoch0(reader, n):
    """The keys of the epoch-0 samples among the next ``n`` of ``reader``."""
    return {s.__key__ for s in take(reader, n) if s.data_indexes["epoch"] == 0}


def test_dp_ranks_read_disjoint_parts_of_every_epoch(tok, data):
    r0 = make(tok, data["t2i"], dp_rank=0, dp_size=2)
    r1 = make(tok, data["t2i"], dp_rank=1, dp_size=2)
    k0, k1 = _epoch0(r0, 20), _epoch0(r1, 20)
    assert not k0 & k1 and k0 | k1 == {f"{i:08d}" for i in range(N_T2I) if i != BAD_ROW}
    bad = sorted(r.drops.counts.get("missing_image", 0) for r in (r0, r1))
    assert bad[0] == 0 and bad[1] >= 1  # the bad row's partition is one rank's, epoch after epoch (W divides P)
    assert r0.identity() == r1.identity()  # the order does not depend on the DP rank


def test_a_dataset_smaller_than_the_world_is_read_exactly_once_per_epoch(tok, data):
    """3 samples on 4 DP ranks: every rank gets data (striped over epochs), every sample once per epoch."""
    readers = [make(tok, data["tiny"], dp_rank=r, dp_size=4, partitions=64) for r in range(4)]
    reads = [(s.__key__, s.data_indexes["epoch"]) for r in readers for s in take(r, 3)]
    assert len(reads) == len(set(reads)) == 12  # no (sample, epoch) twice, on any rank
    for e in range(2):  # 12 reads over 4 ranks in lock-step cover epochs 0..3; the first two completely
        assert {k for k, ep in reads if ep == e} == {f"{i:08d}" for i in range(3)}
    with pytest.raises(ValueError, match="not all of one group"):
        make(tok, [data["t2i"], data["edit"]])


def test_state_guards(tok, data):
    a = make(tok, data["t2i"], seed=3)
    take(a, 4)
    state = a.state_dict()
    assert set(state) == {"source", "taken", "handed_in", "drops", "unused"} and state["drops"]["stage"] == "DropCounter"
    assert state["source"]["stage"] == "ElasticPlan"
    with pytest.raises(StateError, match="before iterating"):
        a.load_state_dict(state)
    with pytest.raises(StateError, match="fields"):
        make(tok, data["t2i"], seed=3).load_state_dict({"energon": None})
    fp = a.identity()
    assert fp["group"] == "t2i_pretrain"
    assert str(data["t2i"]) not in json.dumps(fp)  # no absolute paths


def test_two_datasets_in_a_group(tok, data):
    a = make(tok, [data["t2i"], data["t2i_b"]], seed=2)
    xs = take(a, 10)
    state = a.state_dict()
    cont = take(a, 40)
    files = {s.source["file"] for s in xs + cont}
    assert any(f.startswith("t2i/") for f in files) and any(f.startswith("t2i_b/") for f in files)
    b = make(tok, [data["t2i"], data["t2i_b"]], seed=2)
    b.load_state_dict(state)
    assert_same(cont, take(b, 40))
    assert_same(cont[:3], [b.restore_sample(s.restore_key) for s in cont[:3]])
    a.close()
    b.close()


def _children() -> set[int]:
    import os

    from test_shm import _descendants

    return set(_descendants(os.getpid())) - {os.getpid()}


def _wait_gone(pids: set[int], seconds: float) -> set[int]:
    """The pids of ``pids`` still running (not zombies) after up to ``seconds``."""
    import time

    def running(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + seconds
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = {p for p in alive if running(p)}
    return alive


@pytest.mark.parametrize("how", ["close", "cyclic_gc"])
def test_workers_stop_at_once_when_the_reader_is_closed_or_collected(tok, data, how):
    """The read pool's workers stop at once on ``close()`` and when the reader is left to the cyclic garbage
    collector (its finalizer releases the pool). The 5 s bound is torch's old per-worker wait, not a speed target."""
    import gc
    import time

    before = _children()
    reader = make(tok, data["t2i"], num_workers=2, seed=1)
    take(reader, 3)
    workers = _children() - before
    assert len(workers) >= 2, workers
    t0 = time.monotonic()
    if how == "close":
        reader.close()
        with pytest.raises(RuntimeError, match="closed"):
            next(reader)
    else:
        reader._cycle = reader  # only the cyclic collector can free it now
        del reader
        gc.collect()
    took = time.monotonic() - t0
    assert took < 5.0, f"stopping 2 workers took {took:.1f} s"
    assert not _wait_gone(workers, 2.0), "read workers still running 2 s after the reader was closed/collected"


def _open_files_under(root) -> list[str]:
    """Paths under ``root`` this process holds open (``/proc/self/fd``)."""
    import os

    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return [n for n in names if n.startswith(str(root))]


@pytest.mark.parametrize("datasets", ["one", "two"])
def test_restore_sample_in_the_parent_leaves_no_shard_open_for_workers_to_share(tok, data, datasets):
    """A ``restore_sample`` in the parent (a resumed packer buffer) before 2 workers fork must leave no shard file
    open: forked workers share the parent's file offsets and read each other's positions ("Unexpected end of tar
    file" in CI). The restored reader's stream equals a fresh one's."""
    paths = data["t2i"] if datasets == "one" else [data["t2i"], data["t2i_b"]]

    def build():
        return make(tok, paths, num_workers=2, seed=4, num_used_data=None if datasets == "one" else [12, 6])

    first = build()
    expected = take(first, 8)  # read in the workers: the parent opens no shard
    first.close()
    root = data["t2i"]
    assert _open_files_under(root) == [] and _open_files_under(data["t2i_b"]) == []
    second = build()
    assert_same(expected[:2], [second.restore_sample(s.restore_key) for s in expected[:2]])
    assert _open_files_under(root) == [] and _open_files_under(data["t2i_b"]) == [], \
        "restore_sample left shard files open in the parent"
    assert_same(expected, take(second, 8))  # the workers forked after the restore read their own files
    second.close()
