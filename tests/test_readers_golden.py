"""Golden: converter + cookers + official-order reader reproduce the official BAGEL source datasets bit for bit.

The raw golden data is converted with the real converter, read in the official unit order under the golden
conditions (README of the golden data: set_epoch 42, seed S reseeded per group, rank 0 of 1, num_workers=0
semantics) and compared with the official samples via the golden ``decode.compare_pass``: same samples in the
same order, bit-exact tensors, the same global-RNG state after every sample, and exactly the official skipped
rows dropped (with our reason names).
"""

from __future__ import annotations

import collections
import hashlib
import importlib.util
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from bridge.models.bagel.data.converter.convert import convert_group
from bridge.models.bagel.data.energon.cooking import make_cook_context
from bridge.models.bagel.data.energon.readers import open_group_reader

pytestmark = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")

FIX = Path(__file__).parent / "fixtures" / "bagel_readers"
RAW = FIX / "raw"
SEED = 20260417

_spec = importlib.util.spec_from_file_location("bagel_readers_decode", FIX / "decode.py")
decode = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(decode)

VAE = dict(max_image_size=1024, min_image_size=512, image_stride=16)
VIT = dict(max_image_size=518, min_image_size=224, image_stride=14)
VLM_T = dict(max_image_size=980, min_image_size=378, image_stride=14, max_pixels=2_007_040)

# group -> (converted dataset dir, transform args, num_used_data, reader kwargs, expected drop reasons)
GROUPS = {
    "t2i_pretrain": ("t2i_pretrain/t2i", dict(image_transform_args=VAE), [4], {},
                     {"missing_image": 1, "bad_captions_json": 2, "image_decode_error": 1}),
    "unified_edit": ("unified_edit/unified_edit", dict(image_transform_args=VAE, vit_image_transform_args=VIT), [4], {},
                     {"image_decode_error": 3, "empty_alternatives": 1, "too_few_images": 1}),
    "vlm_sft": ("vlm_sft/vlm_sft", dict(image_transform_args=VLM_T), [1000],
                dict(shuffle_lines=True, shuffle_seed=0),
                {"image_decode_error": 2, "missing_image": 1, "bad_json": 2, "no_loss_item": 2}),
}



def OfficialOrderReader(paths, ctx, num_used, *, seed, rank=0, world_size=1, num_workers=0, worker_id=0, **kw):
    """One pass of the official order (the reader core with the official plan)."""
    return open_group_reader("official", paths, ctx, num_used_data=num_used, seed=seed, dp_rank=rank,
                             dp_size=world_size, num_workers=num_workers, worker_id=worker_id, repeat=False, **kw)


def _rng_sha() -> str:
    return hashlib.sha256(repr(random.getstate()).encode()).hexdigest()[:16]


@pytest.mark.parity
@pytest.mark.parametrize("group", list(GROUPS))
def test_official_pass_bit_exact(group, converted, tokenizer):
    rel, targs, num_used, kw, reasons = GROUPS[group]
    case = decode.load(str(FIX / f"{group}.pt"))
    reader = OfficialOrderReader([str(converted / rel)], make_cook_context(group, tokenizer, **targs), num_used,
                                 seed=42, rank=0, world_size=1, num_workers=0, **kw)
    try:
        random.seed(SEED)
        np.random.seed(SEED)
        torch.manual_seed(SEED)
        np_state, torch_state = np.random.get_state()[1].copy(), torch.get_rng_state()
        samples, shas = [], []
        for s in reader:
            samples.append(s.to_official())
            shas.append(_rng_sha())  # the golden records the global RNG state right after each yield
    finally:
        reader.close()

    assert decode.compare_pass(case, samples) == []
    assert shas == [s["meta"]["rng_state_sha_after"] for s in case["samples"]]
    # the official classes never touch numpy / torch RNGs; neither do we
    assert (np.random.get_state()[1] == np_state).all() and torch.equal(torch.get_rng_state(), torch_state)
    # exactly the official skipped rows, every one counted by reason
    assert [x["row_id"] for x in reader.skipped] == [x["row_id"] for x in case["skipped"]]
    assert reader.drops.counts == reasons
    assert collections.Counter(x["reason"] for x in reader.skipped) == reasons
    for s in samples:
        assert all(t.dtype == torch.float32 and t.dim() == 3 and t.shape[0] == 3 for t in s["image_tensor_list"])


def test_rank_slices_partition_units(converted, tokenizer):
    """Two ranks take disjoint contiguous halves of the shuffled unit list (remainder dropped, as official)."""
    rel, targs, num_used, kw, _ = GROUPS["vlm_sft"]
    ctx = make_cook_context("vlm_sft", tokenizer, **targs)
    path = [str(converted / rel)]
    full = OfficialOrderReader(path, ctx, num_used, seed=42, **kw)
    r0 = OfficialOrderReader(path, ctx, num_used, seed=42, rank=0, world_size=2, **kw)
    r1 = OfficialOrderReader(path, ctx, num_used, seed=42, rank=1, world_size=2, **kw)
    w1 = OfficialOrderReader(path, ctx, num_used, seed=42, rank=0, world_size=2, num_workers=2, worker_id=1, **kw)
    try:
        assert len(full.source.units) == 25 and len(r0.source.units) == len(r1.source.units) == 12
        assert r0.source.units + r1.source.units == full.source.units[:24]
        assert w1.source.units == r0.source.units[6:12][::-1]  # a worker's slice is reversed
        assert w1.worker_id == 1
        with pytest.raises(ValueError, match="no units"):
            OfficialOrderReader(path, ctx, [1], seed=42, rank=0, world_size=2)
    finally:
        for r in (full, r0, r1, w1):
            r.close()


def test_declared_missing_row_groups(tmp_path, tokenizer):
    """Declared-but-absent row groups are units that yield nothing (their positions are still used), as official."""
    d = tmp_path / "edit"
    d.mkdir()
    for f in ("shard-b.parquet", "shard-c.parquet"):
        shutil.copy(RAW / "unified_edit" / f, d / f)
    info = tmp_path / "info.json"
    info.write_text(json.dumps({"shard-b.parquet": {"num_row_groups": 3}, "shard-c.parquet": {"num_row_groups": 5}}))
    s = convert_group("unified_edit", tmp_path / "out", data_dir=str(d), parquet_info_path=str(info),
                      parquet_info_root=str(d), dataset_name="x", progress=False)
    ctx = make_cook_context("unified_edit", tokenizer, image_transform_args=VAE, vit_image_transform_args=VIT)
    r = OfficialOrderReader([s.path], ctx, [2], seed=42)
    try:
        assert len(r.source.units) == 8 and sum(u.rows is None for u in r.source.units) == 2  # shard-c row groups 3 and 4
        random.seed(SEED)
        got = [x.data_indexes["data_indexes"] for x in r]
        missing = [x["row_id"][0] for x in r.skipped if x["reason"] == "missing_row_group"]
        assert sorted(missing) == sorted(i for i, u in enumerate(r.source.units) if u.rows is None)
        rows = {tuple(x) for x in got} | {tuple(x["row_id"]) for x in r.skipped if x["reason"] != "missing_row_group"}
        assert rows == {(i, k) for i, u in enumerate(r.source.units) if u.rows for k in range(len(u.rows))}
    finally:
        r.close()


def test_unit_selection(converted, tokenizer):
    """t2i: num_used_data > #files repeats the listing; vlm: the first n lines (after the optional line shuffle)."""
    ctx = make_cook_context("t2i_pretrain", tokenizer, image_transform_args=VAE)
    r = OfficialOrderReader([str(converted / "t2i_pretrain/t2i")], ctx, [6], seed=42)
    keys = sorted(u.sort_key for u in r.source.units)
    assert keys == sorted(["t2i/part-0000.parquet", "t2i/part-0001.parquet", "t2i/part-0002.parquet",
                           "t2i/part-0003.parquet", "t2i/part-0000.parquet", "t2i/part-0001.parquet"])
    r.close()
    vctx = make_cook_context("vlm_sft", tokenizer, image_transform_args=VLM_T)
    path = [str(converted / "vlm_sft/vlm_sft")]
    plain = OfficialOrderReader(path, vctx, [5], seed=42)
    assert sorted(u.label for u in plain.source.units) == sorted(f"vlm/vlm_sft.jsonl line {i}" for i in range(5))
    shuffled = OfficialOrderReader(path, vctx, [5], seed=42, shuffle_lines=True, shuffle_seed=0)
    order = list(range(25))
    random.Random(0).shuffle(order)
    assert sorted(u.label for u in shuffled.source.units) == sorted(f"vlm/vlm_sft.jsonl line {i}" for i in order[:5])
    plain.close()
    shuffled.close()
