"""``data.order: official`` built by the production builder reproduces the official PackedDataset + DataLoader stream.

Golden: ``fixtures/bagel_e2e`` (the first 12 batches of each case of /work/shared/golden/bagel_e2e, trace kept for
those batches; see the README there), produced by the unmodified official code in ONE DataLoader worker on the raw
data of ``fixtures/bagel_readers/raw``. Multi-worker / multi-rank streams are checked against the official sharding
rules (spec bagel_packer.md §4.1, §11.1): worker w of rank r is a one-worker run over its own unit slice with RNG
seeded ``base_seed + w``, and the DataLoader yields worker ``k % W``'s batches in turn.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
from pathlib import Path

import pytest
import yaml

from bridge.models.bagel.data.build import build_bagel_train_loader
from bridge.models.bagel.data.config import OFFICIAL_NON_PACKER_KEYS, BagelDataConfig, ConfigError, PackerConfig
from bridge.models.bagel.data.energon.cooking.groups import make_cook_context
from bridge.models.bagel.data.energon.readers import open_group_reader
from bridge.models.bagel.data.external import ResumeMismatchError
from bridge.models.bagel.data.pipeline.official_mode import OfficialWorkers
from bridge.models.bagel.data.packing import BagelPacker
from bridge.models.bagel.data.pipeline.rng import BagelRNGIterator

pytestmark = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")

FIX = Path(__file__).parent / "fixtures"
RAW = FIX / "bagel_readers" / "raw"
E2E = FIX / "bagel_e2e"
CASES = ["d01_flex_extrap_edit_first", "d02_dense_interp_t2i_mand", "d03_flex_interp_no_mandatory"]

_spec = importlib.util.spec_from_file_location("bagel_compare_e2e", E2E / "compare_e2e.py")
ce = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ce)



def _config(case: dict, converted: Path, tmp_path: Path, **overrides) -> BagelDataConfig:
    cfg = case["config"]
    energon = {"t2i": converted / "t2i_pretrain" / "t2i", "edit": converted / "unified_edit" / "unified_edit",
               "vlm": converted / "vlm_sft" / "vlm_sft"}
    info = {group: {name: {**entry, "energon_path": str(energon[name])} for name, entry in names.items()}
            for group, names in cfg["dataset_info"].items()}
    (tmp_path / "groups.yaml").write_text(yaml.safe_dump(cfg["grouped_datasets"], sort_keys=False))
    (tmp_path / "info.yaml").write_text(yaml.safe_dump(info, sort_keys=False))
    packer = PackerConfig.from_mapping({**cfg["packed_dataset_args"], **cfg["data_config"]}, ignore=OFFICIAL_NON_PACKER_KEYS)
    kw = dict(groups=str(tmp_path / "groups.yaml"), dataset_info=str(tmp_path / "info.yaml"), packer=packer,
              seed=cfg["seed"], data_seed=cfg["data_seed"], order="official", num_workers=1)
    kw.update(overrides)
    return BagelDataConfig(**kw)


def _load(name: str) -> dict:
    return ce.load_case(str(E2E / f"{name}.pt"))


@pytest.mark.parity
@pytest.mark.parametrize("name", CASES)
def test_production_builder_official_order_is_bit_exact(name, converted, tokenizer, tmp_path):
    case = _load(name)
    loader = build_bagel_train_loader(_config(case, converted, tmp_path), tokenizer, (0, 1))
    try:
        assert isinstance(loader.source, OfficialWorkers)
        got = [ce.stored_batch(next(loader)) for _ in range(len(case["batches"]))]
    finally:
        loader.close()
    assert ce.compare_batches(case, got) is None


FULL = os.environ.get("BAGEL_E2E_GOLDEN_DIR")  # the untrimmed golden directory (e.g. /work/shared/golden/bagel_e2e)


@pytest.mark.parity
@pytest.mark.skipif(not FULL, reason="set BAGEL_E2E_GOLDEN_DIR to check all 34-36 batches of the full golden cases")
@pytest.mark.parametrize("name", CASES)
def test_full_golden_cases_when_available(name, converted, tokenizer, tmp_path):
    case = ce.load_case(os.path.join(FULL, f"{name}.pt"))
    with build_bagel_train_loader(_config(case, converted, tmp_path), tokenizer, (0, 1)) as loader:
        got = [ce.stored_batch(next(loader)) for _ in range(len(case["batches"]))]
    assert ce.compare_batches(case, got) is None


@pytest.mark.parametrize("cut", [1, 3, 7])
def test_official_order_resume_is_bit_exact(cut, converted, tokenizer, tmp_path):
    case = _load("d02_dense_interp_t2i_mand")
    n = 10
    with build_bagel_train_loader(_config(case, converted, tmp_path, num_workers=2), tokenizer, (0, 1)) as ref:
        expected = [ce.stored_batch(next(ref)) for _ in range(n)]
    with build_bagel_train_loader(_config(case, converted, tmp_path, num_workers=2), tokenizer, (0, 1)) as first:
        for _ in range(cut):
            next(first)
        state = first.save_state()
    # small: per worker the RNG streams, the buffer as restore keys and one [unit, row] cursor per group
    assert len(pickle.dumps(state)) < 64_000
    workers = state["source"]["state"]["source"]
    plans = [w["state"]["source"]["state"]["source"][0]["state"]["source"] for w in workers]
    assert all(p["stage"] == "OfficialPlan" and p["state"]["cursor"][0] >= 0 for p in plans)
    with build_bagel_train_loader(_config(case, converted, tmp_path, num_workers=2), tokenizer, (0, 1)) as resumed:
        resumed.restore_state(state)
        got = [ce.stored_batch(next(resumed)) for _ in range(n - cut)]
    assert ce.compare_batches({"batches": expected[cut:]}, got) is None


def _official_worker_stream(case, converted, tokenizer, *, rank, world, workers, worker, n):
    """One official DataLoader worker, written out by hand from the official rules: its own unit slice
    (``shard_units``), its own packer, its RNG seeded as torch seeds worker ``worker`` of the rank's loader."""
    cfg = case["config"]
    paths = {"t2i_pretrain": converted / "t2i_pretrain" / "t2i",
             "unified_edit": converted / "unified_edit" / "unified_edit", "vlm_sft": converted / "vlm_sft" / "vlm_sft"}
    readers = []
    for group, g in cfg["grouped_datasets"].items():
        ctx = make_cook_context(group, tokenizer, g["image_transform_args"], g.get("vit_image_transform_args"))
        readers.append(open_group_reader("official", [str(paths[group])], ctx, num_used_data=g["num_used_data"],
                                         seed=cfg["data_seed"], dp_rank=rank, dp_size=world, num_workers=workers,
                                         worker_id=worker, shuffle_lines=g.get("shuffle_lines", False),
                                         shuffle_seed=g.get("shuffle_seed", 0), repeat=True))
    special = cfg["special_tokens"]
    packer = BagelPacker(readers, cfg["group_weights"], cfg["is_mandatory"], special,
                         PackerConfig.from_mapping({**cfg["packed_dataset_args"], **cfg["data_config"]}, ignore=OFFICIAL_NON_PACKER_KEYS),
                         group_names=cfg["group_names"])
    it = BagelRNGIterator(packer, cfg["seed"] * world + rank, worker_id=worker)
    try:
        return [ce.stored_batch(next(it)) for _ in range(n)]
    finally:
        it.close()


@pytest.mark.parametrize("world,workers", [(2, 1), (1, 2)])
def test_dp2_and_two_workers_are_the_union_of_official_streams(world, workers, converted, tokenizer, tmp_path):
    case = _load("d03_flex_interp_no_mandatory")
    per = 3
    for rank in range(world):
        streams = [_official_worker_stream(case, converted, tokenizer, rank=rank, world=world, workers=workers,
                                           worker=w, n=per) for w in range(workers)]
        expected = [streams[k % workers][k // workers] for k in range(per * workers)]  # DataLoader round robin
        with build_bagel_train_loader(_config(case, converted, tmp_path, num_workers=workers), tokenizer,
                                      (rank, world)) as loader:
            got = [ce.stored_batch(next(loader)) for _ in range(per * workers)]
            stats = loader.stats()
        assert stats["num_batches"] == per * workers and len(stats["workers"]) == workers
        assert ce.compare_batches({"batches": expected}, got) is None
        for k, b in enumerate(got):  # every sample carries its worker's id
            assert {d["worker_id"] for d in b["batch_data_indexes"]} == {k % workers}


@pytest.mark.parity
def test_official_order_with_prefetch_process(converted, tokenizer, tmp_path):
    case = _load("d01_flex_extrap_edit_first")
    with build_bagel_train_loader(_config(case, converted, tmp_path, prefetch=2), tokenizer, (0, 1)) as loader:
        got = [ce.stored_batch(next(loader)) for _ in range(4)]
    assert ce.compare_batches(case, got, allow_prefix=True) is None


def test_fingerprint_covers_num_used_data_and_frame_sampler(converted, tokenizer, tmp_path):
    case = _load("d01_flex_extrap_edit_first")
    with build_bagel_train_loader(_config(case, converted, tmp_path), tokenizer, (0, 1)) as loader:
        next(loader)
        state = loader.save_state()
    case["config"]["grouped_datasets"]["vlm_sft"]["frame_sampler_args"] = {"max_num_frames": 4, "min_num_frames": 2}
    with build_bagel_train_loader(_config(case, converted, tmp_path), tokenizer, (0, 1)) as other_frames:
        with pytest.raises(ResumeMismatchError, match="frame_sampler_args"):  # video records draw frames with it
            other_frames.restore_state(state)
    del case["config"]["grouped_datasets"]["vlm_sft"]["frame_sampler_args"]
    case["config"]["grouped_datasets"]["t2i_pretrain"]["num_used_data"] = [5]
    with build_bagel_train_loader(_config(case, converted, tmp_path), tokenizer, (0, 1)) as other:
        with pytest.raises(ResumeMismatchError, match="num_used_data"):
            other.restore_state(state)


def test_official_order_needs_workers_and_num_used_data(converted, tokenizer, tmp_path):
    case = _load("d01_flex_extrap_edit_first")
    with pytest.raises(ConfigError, match="num_workers: order 'official' needs num_workers >= 1"):
        build_bagel_train_loader(_config(case, converted, tmp_path, num_workers=0), tokenizer, (0, 1))
    with pytest.raises(ConfigError, match="order: must be one of"):
        _config(case, converted, tmp_path, order="random").validate()
    del case["config"]["grouped_datasets"]["t2i_pretrain"]["num_used_data"]
    with pytest.raises(ConfigError, match=r"groups.yaml: group 't2i_pretrain': order 'official' needs 'num_used_data'"):
        build_bagel_train_loader(_config(case, converted, tmp_path), tokenizer, (0, 1))
