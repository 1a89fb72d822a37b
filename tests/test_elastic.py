"""The elastic order in one process: its partition arithmetic, a stream that does not depend on the workers,
exact same-topology resume, resizes (2 -> 4 -> 3, and the workers changed at one DP size) proven exactly once by
the ledger, the same resize twice giving the same batches, a world larger than a group (DP 64 over 50 samples, then
64 -> 24), state sizes at DP 1 and 8192, and the refusals (another order, a rank's own file on another DP size).
Ranks of a world are built one after another in this process (what a rank does is independent of the others until
the resize, which reads all their states); ``test_elastic_job`` runs the same through ``torchrun``.
"""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
import yaml

from _external_common import assert_same, elastic_world as _world, run_world as _run, small_selection_config
from bridge.models.bagel.data.build import build_bagel_train_loader
from bridge.models.bagel.data.config import ConfigError
from bridge.models.bagel.data.energon.readers.partitions import GroupLayout, PartitionOrder, block
from bridge.models.bagel.data.job.checkpoint import check_resume_dp
from bridge.models.bagel.data.state import StateError
from bridge.models.bagel.data.external import ResumeMismatchError
from bridge.models.bagel.data.tools.ledger import check_exactly_once


# -- the order's arithmetic ---------------------------------------------------------------------------------


def test_partitions_cover_each_position_once_per_epoch() -> None:
    order = PartitionOrder(1037, 16, seed=3, group="t2i_pretrain", chunk=10)
    for epoch in (0, 1):
        seen = np.concatenate([order.positions(p, epoch) for p in range(16)])
        assert sorted(seen.tolist()) == list(range(1037))
        for p in (0, 7, 15):
            assert order.positions(p, epoch).tolist() == [order.position(p, epoch, c) for c in range(order.size(p))]
    assert order.positions(3, 0).tolist() != order.positions(3, 1).tolist()  # chunks reshuffled per epoch
    assert PartitionOrder(5, 16, 0, "g").num_partitions == 5  # never an empty partition
    assert [block(v, 16) for v in (0, 15, 16, 33)] == [(0, 0), (0, 15), (1, 0), (2, 1)]  # (epoch, partition)


def test_layout_counts_repetitions_as_positions() -> None:
    layout = GroupLayout([[(0, 3, 2)], [(5, 7, 1)]])
    assert layout.num_positions == 8
    assert [layout.coordinate(j) for j in range(8)] == [(0, 0), (0, 1), (0, 2), (0, 0), (0, 1), (0, 2), (1, 5), (1, 6)]


# -- the real loader on the demo data -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def small(demo_setup, tmp_path_factory):
    """The demo data with a small selection (16 t2i, 8 edit, 12 vlm reads per epoch) and 4 partitions."""
    out, tok = demo_setup
    return small_selection_config(out, tmp_path_factory.mktemp("elastic")), tok


def test_stream_does_not_depend_on_workers_and_resumes_exactly(small) -> None:
    cfg, tok = small
    rank1 = [build_bagel_train_loader(cfg, tok, (1, 2), length=10)]
    inline, _ = _run(rank1, 4)
    rank1 = [build_bagel_train_loader(dataclasses.replace(cfg, num_workers=2, prefetch=2), tok, (1, 2), length=10)]
    workers, _ = _run(rank1, 4)
    for a, b in zip(inline[0], workers[0]):
        assert_same(a, b)
    _, states = _run(_world(cfg, tok, 2), 2)
    again, _ = _run(_world(cfg, tok, 2, states, num_workers=2), 2)  # workers changed at the same DP size
    for a, b in zip(inline[0][2:], again[1]):
        assert_same(a, b)
    assert all(len(pickle.dumps(s)) < 64 * 1024 for s in states)


def test_resize_2_4_3_is_exactly_once_and_deterministic(small) -> None:
    """In lossless packing (``test_elastic_job`` runs the official flush): no flush drop at all either."""
    cfg, tok = small
    cfg = dataclasses.replace(cfg, packer=dataclasses.replace(cfg.packer, lossless=True))
    reads: list[dict] = []
    _, s2 = _run(_world(cfg, tok, 2, num_workers=2), 3, reads)
    _, s4 = _run(_world(cfg, tok, 4, s2), 2, reads)
    batches, s3 = _run(_world(cfg, tok, 3, s4, num_workers=2), 8, reads)
    report = check_exactly_once(reads, s3)
    assert report.ok and {"t2i_pretrain", "vlm_sft"} <= set(report.complete_groups), report  # the mandatory groups
    assert all(len(pickle.dumps(s)) <= 64 * 1024 for s in s3)
    drops = [r for st in s3 for r in _nodes_counts(st["source"])]
    assert drops and not any(r.startswith("flush_drop") for r in drops), drops
    twice, _ = _run(_world(cfg, tok, 3, s4), 8)  # the same restart again, without workers: the same batches
    for a, b in zip(batches, twice):
        for x, y in zip(a, b):
            assert_same(x, y)


def _nodes_counts(state) -> list[str]:
    """Every drop reason counted anywhere in a saved loader state."""
    out: list[str] = []
    if isinstance(state, dict):
        if state.get("stage") == "DropCounter":
            out += list(state["state"]["counts"])
        for v in state.values():
            out += _nodes_counts(v)
    elif isinstance(state, list):
        for v in state:
            out += _nodes_counts(v)
    return out


def test_refusals(small, tmp_path) -> None:
    cfg, tok = small
    _, s2 = _run(_world(cfg, tok, 2), 1)
    fresh = build_bagel_train_loader(cfg, tok, (0, 3), length=10)
    with pytest.raises(StateError, match="saved by DP rank 0 of 2, this is DP rank 0 of 3"):
        fresh.restore_state(s2[0])  # Bridge's pretrain() would do this: its own rank's file only
    with pytest.raises(StateError, match="give every old rank's file"):
        fresh.resize_states(s2[:1], 0, 3)
    fresh.close()
    reseeded = build_bagel_train_loader(dataclasses.replace(cfg, seed=7), tok, (0, 3), length=10)
    with pytest.raises(ResumeMismatchError, match="loader.seed: saved=42 current=7"):
        reseeded.resize_states(s2, 0, 3)  # a resize does not loosen the fingerprint
    reseeded.close()
    official = dataclasses.replace(cfg, order="official", num_workers=1)
    _, d2 = _run(_world(official, tok, 2), 1)
    grown = build_bagel_train_loader(cfg, tok, (0, 3), length=10)
    with pytest.raises(StateError, match="data.order 'official'.*need data.order: elastic"):
        grown.resize_states(d2, 0, 3)
    grown.close()
    with pytest.raises(ConfigError, match="'energon' is not an order any more: the DP-dependent 'energon' order was "
                                          "removed: 'elastic' .*the default"):
        build_bagel_train_loader(dataclasses.replace(cfg, order="energon"), tok, (0, 2), length=10)
    iter_dir = tmp_path / "energon" / "iter_0000002"
    iter_dir.mkdir(parents=True)
    for dp in range(2):
        (iter_dir / f"train_dataloader_dprank{dp:03d}.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match="use data.order: elastic") as info:
        check_resume_dp(str(tmp_path), 2, 3, "official")
    assert "\n" not in str(info.value)
    assert check_resume_dp(str(tmp_path), 2, 3, "elastic") == 2


def test_a_state_of_the_removed_energon_order_is_refused_in_one_line(small) -> None:
    cfg, tok = small
    loader = build_bagel_train_loader(cfg, tok, (0, 1), length=10)
    old = {"version": 3, "fingerprint": {"loader": {"order": "energon", "dp_rank": 0, "dp_size": 1}}, "position": 4,
           "upstream": {}, "stateful_loaders": []}
    with pytest.raises(StateError) as err:
        loader.restore_state(old)
    assert "\n" not in str(err.value) and "written with data.order 'energon'" in str(err.value)
    assert "start the data stream fresh" in str(err.value).lower()
    loader.close()


# -- a world larger than a group ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def curated(tmp_path_factory, tokenizer):
    """A curated t2i group of 50 samples (tiny images, mandatory) beside a large text-only vlm group (2,000 lines)."""
    import io
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    from bridge.models.bagel.data.config import BagelDataConfig, PackerConfig
    from bridge.models.bagel.data.converter.convert import convert_t2i, convert_vlm

    root = tmp_path_factory.mktemp("curated")
    (root / "t2i").mkdir()
    rows = []
    for i in range(50):
        buf = io.BytesIO()
        Image.new("RGB", (32 + i % 3 * 16, 32), (i * 5, 80, 200 - i)).save(buf, "PNG")
        rows.append({"image": buf.getvalue(), "captions": json.dumps({"a": f"curated picture {i}"})})
    pq.write_table(pa.Table.from_pylist(rows), root / "t2i" / "part-0000.parquet", row_group_size=10)
    (root / "img").mkdir()
    with open(root / "chat.jsonl", "w") as f:
        for i in range(2000):
            f.write(json.dumps({"conversations": [{"from": "human", "value": f"question {i}"},
                                                  {"from": "gpt", "value": f"answer {i % 97}"}]}) + "\n")
    t2i = convert_t2i(str(root / "t2i"), root / "out", progress=False).path
    vlm = convert_vlm(str(root / "chat.jsonl"), str(root / "img"), root / "out", progress=False).path
    small = dict(max_image_size=64, min_image_size=32, image_stride=16)
    (root / "groups.yaml").write_text(yaml.safe_dump({
        "t2i_pretrain": {"dataset_names": ["curated"], "weight": 1, "is_mandatory": True,
                         "image_transform_args": small},
        "vlm_sft": {"dataset_names": ["chat"], "weight": 3, "is_mandatory": False,
                    "image_transform_args": dict(max_image_size=56, min_image_size=28, image_stride=14)}}))
    (root / "info.yaml").write_text(yaml.safe_dump({
        "t2i_pretrain": {"curated": {"data_dir": str(root / "t2i"), "energon_path": t2i}},
        "vlm_sft": {"chat": {"data_dir": str(root / "img"), "jsonl_path": str(root / "chat.jsonl"),
                             "energon_path": vlm}}}))
    cfg = BagelDataConfig(groups=str(root / "groups.yaml"), dataset_info=str(root / "info.yaml"),
                          packer=PackerConfig(expected_num_tokens=160, max_num_tokens=256,
                                              max_num_tokens_per_sample=128, prefer_buffer_before=64, lossless=True))
    return cfg, tokenizer


def _small_group_reads(reads, states):
    """(position, epoch) -> times packed or waiting, for the curated group."""
    from collections import Counter

    from bridge.models.bagel.data.tools.ledger import _identity, _nodes

    seen = Counter((int(d["position"]), int(d["epoch"])) for d in reads if d["dataset_name"] == "t2i_pretrain")
    for state in states:
        packer = _nodes(state["source"], "BagelPacker")[0]["state"]
        waiting = [key for g, key in packer["buffer"] + packer["carry"] if g == 0]
        waiting += packer["source"][0]["state"]["source"]["state"]["pending"]  # handed over by the resize
        for key in waiting:
            seen[_identity(key)] += 1
    return seen


def test_dp64_reads_a_50_sample_group_exactly_once_per_epoch_then_resizes_to_24(curated) -> None:
    """Issue 29: a group with fewer selected samples than DP ranks trains (each rank reads blocks striped over the
    epochs): every sample of the 50-sample group is read exactly once per epoch across DP 64, and again after a
    resize 64 -> 24; the large group beside it stays exactly once too (the ledger over every read)."""
    cfg, tok = curated
    reads: list[dict] = []
    _, s64 = _run(_world(cfg, tok, 64), 2, reads)
    assert all(len(pickle.dumps(s)) <= 64 * 1024 for s in s64)
    _, s24 = _run(_world(cfg, tok, 24, s64), 3, reads)
    report = check_exactly_once(reads, s24)
    assert report.ok, report.problems
    assert "t2i_pretrain" in report.complete_groups, report
    seen = _small_group_reads(reads, s24)
    assert max(seen.values()) == 1  # no (sample, epoch) twice, in any world
    epochs = sorted({e for _, e in seen})
    assert len(epochs) >= 3, epochs  # 64 ranks x 2 packs + 24 x 3, each with a curated sample: several epochs
    assert report.dropped == 0  # lossless packing, clean data: every read is packed or waiting
    for e in epochs[:2]:  # the first epochs are complete: each of the 50 samples exactly once
        assert sorted(j for j, ep in seen if ep == e) == list(range(50)), e
    assert report.groups["t2i_pretrain"]["selection"] == 50


def test_state_per_rank_is_small_at_dp1_and_dp8192_with_the_default_partitions(curated) -> None:
    """Issue 29: the loader state of a rank stays <= 64 KiB at DP 1 (8192 partitions of the large group open on one
    rank) and at DP 8192, with ``data.partitions`` at its default."""
    from bridge.models.bagel.data.config import DEFAULT_PARTITIONS

    cfg, tok = curated
    assert cfg.partitions == DEFAULT_PARTITIONS == 8192
    for rank, size in ((0, 1), (8191, 8192)):
        loader = build_bagel_train_loader(cfg, tok, (rank, size), length=10)
        for _ in range(3):
            next(loader)
        state = loader.save_state()
        assert len(pickle.dumps(state)) <= 64 * 1024, (size, len(pickle.dumps(state)))
        again = build_bagel_train_loader(cfg, tok, (rank, size), length=10)
        again.restore_state(state)
        assert_same(next(loader), next(again))
        loader.close()
        again.close()
