"""BagelGroupReader on small converted datasets: exact resume (nw 0 and 2), restore_sample by replay, DP sharding."""

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

from bridge.models.bagel.data.energon.cook_common import ReplayError
from bridge.models.bagel.data.converter.convert import convert_edit, convert_t2i
from bridge.models.bagel.data.energon.reader import BagelGroupReader
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


def make(tok, path, **kw):
    vit = VIT if "edit" in str(path) else None
    return BagelGroupReader(path, tokenizer=tok, image_transform_args=VAE, vit_image_transform_args=vit,
                            max_samples_per_sequence=kw.pop("max_samples_per_sequence", 5), **kw)


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
    cont = take(a, 35)  # crosses the 23-sample epoch boundary
    b = make(tok, data["t2i"], seed=3)
    b.load_state_dict(state)
    assert_same(cont, take(b, 35))
    assert b.drops.counts == a.drops.counts == {"missing_image": 2}  # counts restored, then one more per epoch
    assert {s.__key__ for s in cont} == {f"{i:08d}" for i in range(N_T2I) if i != BAD_ROW}


def test_reading_is_deterministic_and_keeps_global_rng(tok, data):
    a = make(tok, data["t2i"], seed=3)
    first = take(a, 1)
    before = rng_states()
    xs = first + take(a, 30)
    assert_rng_unchanged(before)  # choices come from a private per-sample generator
    assert_same(xs, take(make(tok, data["t2i"], seed=3), 31))
    assert len({s.rng_choices for s in xs}) > 1
    other = take(make(tok, data["t2i"], seed=4), 31)
    assert [s.rng_choices for s in other] != [s.rng_choices for s in xs]
    s = xs[0]
    assert s.data_indexes == {"data_indexes": [s.source["file_index"], s.source["row_group"], s.source["row"]],
                              "worker_id": 0, "dataset_name": "t2i_pretrain"}


@pytest.mark.slow
def test_resume_and_restore_sample_nw2(tok, data):
    a = make(tok, data["t2i"], num_workers=2, seed=5)
    take(a, 9)  # never save between iter() and the first next() with workers
    state = a.state_dict()
    cont = take(a, 35)
    assert {s.data_indexes["worker_id"] for s in cont} == {0, 1}
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


def _worker_rngs(obj):
    """Every ``_worker_rng`` entry in a nested Energon ``FlexState``."""
    if isinstance(obj, dict):
        return ([obj["_worker_rng"]] if "_worker_rng" in obj else []) + [
            g for k, v in obj.items() if k != "_worker_rng" for g in _worker_rngs(v)]
    if isinstance(obj, (list, tuple)):
        return [g for v in obj for g in _worker_rngs(v)]
    return []


def test_worker_state_is_compact_and_resumes(tok, data, tmp_path):
    """Issue 13: with 2 workers the Energon part of the state holds no freshly seeded RNG and no 5 KB generator
    state; it travels through torch.save + Bridge's restricted unpickler and still resumes bit for bit."""
    from bridge.models.bagel.data._bridge import import_bridge

    a = make(tok, data["t2i"], num_workers=2, seed=5)
    take(a, 9)
    state = a.state_dict()
    for ws in state["energon"].worker_states:
        assert ws.state.rng is None  # Energon seeded it at worker start and our cookers never draw from it
        gens = _worker_rngs(ws.state.dataset_state)
        assert gens and all(g == {"rng": None} or set(g) == {"rng_zlib"} for g in gens)
    assert len(pickle.dumps(state["energon"])) < 10_000
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
    with pytest.raises(ValueError, match="bad restore key"):
        r.restore_sample("nope")


def test_dp_sharding_disjoint(tok, data):
    r0 = make(tok, data["t2i"], dp_rank=0, dp_size=2)
    r1 = make(tok, data["t2i"], dp_rank=1, dp_size=2)
    k0 = {s.__key__ for s in take(r0, 11)}  # rank 0 holds samples 0..11, one of them the tombstone
    k1 = {s.__key__ for s in take(r1, 12)}
    assert not k0 & k1 and k0 | k1 == {f"{i:08d}" for i in range(N_T2I) if i != BAD_ROW}
    assert r0.drops.counts == {"missing_image": 1} and r1.drops.total == 0
    assert r0.identity() != r1.identity()


def test_too_small_dataset_and_bad_args(tok, data):
    with pytest.raises(ValueError, match=r"tiny.*3 samples, fewer than dp_size x max\(num_workers, 1\) = 4"):
        make(tok, data["tiny"], dp_size=2, num_workers=2)
    make(tok, data["tiny"], dp_size=1, num_workers=2)  # 3 >= 2: fine
    with pytest.raises(ValueError, match="dp_rank"):
        make(tok, data["t2i"], dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="not all of one group"):
        make(tok, [data["t2i"], data["edit"]])


def test_state_guards(tok, data):
    a = make(tok, data["t2i"], seed=3)
    take(a, 4)
    state = a.state_dict()
    assert set(state) == {"energon", "drops", "unused"} and state["drops"]["stage"] == "DropCounter"
    with pytest.raises(StateError, match="before iterating"):
        a.load_state_dict(state)
    with pytest.raises(StateError, match="fields"):
        make(tok, data["t2i"], seed=3).load_state_dict({"energon": None})
    fp = a.identity()
    assert fp["group"] == "t2i_pretrain" and fp["seed"] == 3 and fp["energon_version"]
    assert str(data["t2i"]) not in json.dumps(fp)  # no absolute paths


def test_blend_of_two_datasets(tok, data):
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
    """Energon's persistent workers stop at once on ``close()`` and when the reader is left to the cyclic
    garbage collector. Before, ``close()`` left them running, and a cyclic collection stopped them only after
    torch's 5 s wait per worker, inside whatever ran next (the queues' finalizers ran first, so the workers
    never got their stop message). The 5 s bound is that wait, not a speed target. No state after close."""
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
        with pytest.raises(StateError, match="closed"):
            reader.state_dict()
    else:
        reader._cycle = reader  # only the cyclic collector can free it now
        del reader
        gc.collect()
    took = time.monotonic() - t0
    assert took < 5.0, f"stopping 2 workers took {took:.1f} s: torch's per-worker join time-out was hit"
    assert not _wait_gone(workers, 2.0), "Energon workers still running 2 s after the reader was closed/collected"


def _open_files_under(root) -> list[str]:
    """Paths under ``root`` this process holds open (``/proc/self/fd``), but the memory-mapped per-sample checksums
    (``mmap`` keeps a duplicate of the file's descriptor; nothing reads through its offset)."""
    import os

    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return [n for n in names if n.startswith(str(root)) and not n.endswith("/manifest.checksums.npy")]


@pytest.mark.parametrize("order", ["default", "default-blend", "elastic"])
def test_restore_sample_in_the_parent_leaves_no_shard_open_for_workers_to_share(tok, data, order):
    """A ``restore_sample`` in the parent (a resumed packer buffer) before 2 workers fork must leave no shard file
    open: forked workers share the parent's file offsets and read each other's positions ("Unexpected end of tar
    file" in CI, on the elastic reader, which lacked the close). The restored reader's stream equals a fresh one's."""
    from bridge.models.bagel.data.energon.elastic_reader import ElasticGroupReader

    def build():
        if order == "default":
            return make(tok, data["t2i"], num_workers=2, seed=4)
        if order == "default-blend":  # an Energon blend of sample ranges of two datasets
            return make(tok, [data["t2i"], data["t2i_b"]], num_workers=2, seed=4, num_used_data=[12, 6])
        return ElasticGroupReader(data["t2i"], tokenizer=tok, image_transform_args=VAE, num_workers=2, seed=4,
                                  partitions=4)

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
