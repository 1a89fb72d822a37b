"""The elastic order in one process: its partition arithmetic, a stream that does not depend on the workers,
exact same-topology resume, resizes (2 -> 4 -> 3, and the workers changed at one DP size) proven exactly once by
the ledger, the same resize twice giving the same batches, and the refusals (another order, a rank's own file on
another DP size, too few partitions). Ranks of a world are built one after another in this process (what a rank
does is independent of the others until the resize, which reads all their states); ``test_elastic_job`` runs the
same through ``torchrun``.
"""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
import yaml

from _external_common import assert_same, demo_config
from bridge.models.bagel.data.build import build_bagel_train_loader
from bridge.models.bagel.data.config import ConfigError
from bridge.models.bagel.data.energon.elastic_order import GroupLayout, PartitionOrder, owned_partitions
from bridge.models.bagel.data.job.checkpoint import check_resume_dp
from bridge.models.bagel.data.packing.packer import ledger_errors
from bridge.models.bagel.data.pipeline.elastic import resize_loader_states
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
    assert owned_partitions(10, 1, 4) == [1, 5, 9]


def test_layout_counts_repetitions_as_positions() -> None:
    layout = GroupLayout([[(0, 3, 2)], [(5, 7, 1)]])
    assert layout.num_positions == 8
    assert [layout.coordinate(j) for j in range(8)] == [(0, 0), (0, 1), (0, 2), (0, 0), (0, 1), (0, 2), (1, 5), (1, 6)]


# -- the real loader on the demo data -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def small(demo_setup, tmp_path_factory):
    """The demo data with a small selection (16 t2i, 8 edit, 12 vlm reads per epoch) and 4 partitions."""
    out, tok = demo_setup
    groups = yaml.safe_load((out / "groups.yaml").read_text())
    groups["t2i_pretrain"]["num_used_data"] = [2]
    groups["unified_edit"]["num_used_data"] = [1]
    groups["vlm_sft"]["num_used_data"] = [12]
    path = tmp_path_factory.mktemp("elastic") / "groups.yaml"
    path.write_text(yaml.safe_dump(groups))
    cfg = dataclasses.replace(demo_config(out, 0, True), groups=str(path), order="elastic", partitions=4)
    return cfg, tok


def _world(cfg, tok, size, states=None, **changes):
    cfg = dataclasses.replace(cfg, **changes)
    loaders = [build_bagel_train_loader(cfg, tok, (r, size), length=10) for r in range(size)]
    if states is not None:
        for r, loader in enumerate(loaders):
            loader.restore_state(states[r] if len(states) == size else resize_loader_states(states, r, size))
    return loaders


def _run(loaders, steps, reads=None):
    batches = [[next(ld) for _ in range(steps)] for ld in loaders]
    if reads is not None:
        reads += [d for per_rank in batches for b in per_rank for d in b["batch_data_indexes"]]
    states = [ld.save_state() for ld in loaders]
    for ld in loaders:
        stats = ld.stats()  # the ledger balances on every rank; the readers report their part of it
        assert not ledger_errors(stats["ledger"]), stats["ledger"]
        elastic = [st for st in stats["sources"].values() if "taken" in st]  # (test_refusals runs energon too)
        assert not elastic or sum(st["taken"] + st["handed_in"] for st in elastic) > 0, stats["sources"]
        ld.close()
    return batches, states


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
    assert report.ok and report.epoch_complete, report
    assert all(len(pickle.dumps(s)) <= 64 * 1024 for s in s3)
    drops = [r for st in s3 for r in _nodes_counts(st["upstream"])]
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
    fresh.close()
    with pytest.raises(StateError, match="give every old rank's file"):
        resize_loader_states(s2[:1], 0, 3)
    reseeded = build_bagel_train_loader(dataclasses.replace(cfg, seed=7), tok, (0, 3), length=10)
    with pytest.raises(ResumeMismatchError, match="loader.seed: saved=42 current=7"):
        reseeded.restore_state(resize_loader_states(s2, 0, 3))  # a resize does not loosen the fingerprint
    reseeded.close()
    default = dataclasses.replace(cfg, order="energon")
    _, d2 = _run(_world(default, tok, 2), 1)
    with pytest.raises(StateError, match="data.order 'energon'.*need data.order: elastic"):
        resize_loader_states(d2, 0, 3)
    with pytest.raises(ValueError, match="data.partitions 4 is fewer than DP size 5: DP rank 4 and above would read "
                                         "nothing in every group; set data.partitions to at least the largest DP"):
        build_bagel_train_loader(cfg, tok, (0, 5), length=10)
    with pytest.raises(ValueError) as err:  # a group with too few samples for the DP size, whatever partitions
        build_bagel_train_loader(dataclasses.replace(cfg, partitions=16), tok, (0, 10), length=10)
    assert str(err.value).endswith(
        "groups.yaml: group 'unified_edit': 8 selected samples make 8 elastic partitions (data.partitions 16), fewer "
        "than DP size 10: DP rank 8 and above would read nothing: select more samples for this group (num_used_data, "
        "or more data) or use fewer DP ranks"), str(err.value)
    iter_dir = tmp_path / "energon" / "iter_0000002"
    iter_dir.mkdir(parents=True)
    for dp in range(2):
        (iter_dir / f"train_dataloader_dprank{dp:03d}.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match="use data.order: elastic") as info:
        check_resume_dp(str(tmp_path), 2, 3, "official")
    assert "\n" not in str(info.value)
    assert check_resume_dp(str(tmp_path), 2, 3, "elastic") == 2
