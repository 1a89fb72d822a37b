"""Attention from flex metadata (``bridge.models.bagel.data.attention``) against the official dense masks.

The flex mask materialised from ``sample_lens`` / ``split_lens`` / ``attn_modes`` must equal, element for
element (``torch.equal``: dtype, shape, values), the block-diagonal of the dense-mode
``nested_attention_masks`` of the same pack, with the trailing pad as a causal document of its own:
- golden flex cases c02/c04 against their official dense siblings c01/c03 (same streams, seed, decisions);
- every golden flex case against our bit-exact packer rerun in dense mode at the same seed;
- demo-data packs through the real builder, flex and dense with the same seed.
The BlockMask built by interval arithmetic equals ``create_block_mask``'s tensors; FlexAttention over it
matches SDPA with the dense mask.
"""

from __future__ import annotations

import copy
import random
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

from _external_common import DEMO_MAX_TOKENS, demo_loader
from bridge.models.bagel.data.attention import (
    block_diagonal_mask,
    block_mask,
    dense_mask,
    flex_metadata,
    make_mask_mod,
    to_device,
)
from packer_golden import CASES, build_packer, load_case, seed_like_official

FLEX_CASES = [c for c in CASES if load_case(c)["config"]["use_flex"]]
DENSE_SIBLING = {"c02_flex_extrap_3g2m_s14": "c01_dense_extrap_3g2m_s14",
                 "c04_flex_interp_4g1m_s4": "c03_dense_interp_4g1m_s4"}
BM_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
             "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def _malformed(batch: dict) -> bool:
    """Official quirks the flex metadata cannot express: unpaired splits/modes, negative pad (over-cap pack), an
    unclosed split (packed tokens not counted in sequence_length; its mode pairs with a later split)."""
    return (len(batch["split_lens"]) != len(batch["attn_modes"]) or batch["sample_lens"][-1] < 0
            or len(batch["packed_position_ids"]) != batch["sequence_length"])


def _assert_flex_equals_dense(flex: dict, dense: dict, where: str) -> None:
    pad = flex["sample_lens"][-1]
    assert flex["sample_lens"][:-1] == dense["sample_lens"], where
    assert flex["sequence_length"] == dense["sequence_length"], where
    ours = dense_mask(flex)
    official = block_diagonal_mask(dense["nested_attention_masks"], pad)
    assert ours.dtype == official.dtype == torch.bool and ours.shape == official.shape, where
    assert torch.equal(ours, official), where
    # the additive form equals the official 0/-inf float32 masks on every sample's diagonal block
    additive = dense_mask(flex, additive=True)
    assert torch.equal(additive, block_diagonal_mask(dense["nested_attention_masks"], pad, additive=True)), where
    off = 0
    for m in dense["nested_attention_masks"]:
        n = m.shape[0]
        assert torch.equal(additive[off:off + n, off:off + n], m), where
        off += n


def _assert_same_block_mask(a, b, where: str) -> None:
    assert a.seq_lengths == b.seq_lengths and a.BLOCK_SIZE == b.BLOCK_SIZE, where
    for name in BM_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), f"{where}: BlockMask.{name} differs"


def _tables(num: torch.Tensor, idx: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.zeros(n, n, dtype=torch.bool)
    for r in range(n):
        out[r, idx[0, 0, r, :num[0, 0, r]].long()] = True
    return out


def _assert_tiles_match_dense(bm, dense: torch.Tensor, where: str) -> None:
    """The BlockMask's partial/full tiles are exactly the mixed/all-True tiles of the (L, L) mask."""
    bs, L = bm.BLOCK_SIZE[0], dense.shape[0]
    n = -(-L // bs)
    padded = torch.nn.functional.pad(dense, (0, n * bs - L, 0, n * bs - L))
    counts = padded.view(n, bs, n, bs).sum(dim=(1, 3))
    assert torch.equal(_tables(bm.full_kv_num_blocks, bm.full_kv_indices, n), counts == bs * bs), where
    assert torch.equal(_tables(bm.kv_num_blocks, bm.kv_indices, n), (counts > 0) & (counts < bs * bs)), where


@pytest.mark.parametrize("name", sorted(DENSE_SIBLING))
def test_golden_flex_equals_official_dense_sibling(name: str) -> None:
    """Official flex batches vs the official dense batches of the same pack (both straight from BAGEL)."""
    flex_case, dense_case = load_case(name), load_case(DENSE_SIBLING[name])
    checked = 0
    for k, (flex, dense) in enumerate(zip(flex_case["batches"], dense_case["batches"])):
        if _malformed(flex):
            with pytest.raises(ValueError):
                flex_metadata(flex)
            continue
        _assert_flex_equals_dense(flex, dense, f"{name}[{k}]")
        checked += 1
    assert checked >= 15


@pytest.mark.parametrize("name", FLEX_CASES)
def test_golden_flex_equals_packer_dense_rerun(name: str) -> None:
    """Every official flex batch vs our bit-exact packer rerun in dense mode on the same samples and RNG."""
    case = load_case(name)
    dense_case = copy.copy(case)
    dense_case["config"] = {**case["config"], "use_flex": False}
    packer, _ = build_packer(dense_case)
    seed_like_official(case["config"]["seed"])
    checked = 0
    for k, flex in enumerate(case["batches"]):
        dense = next(packer)
        if _malformed(flex):
            with pytest.raises(ValueError):
                dense_mask(flex)
            continue
        _assert_flex_equals_dense(flex, dense, f"{name}[{k}]")
        checked += 1
    assert checked >= 20


def test_demo_packs_flex_equals_dense(demo_setup) -> None:
    """Real builder on the demo data (small budgets), flex and dense with the same seed: the same packs."""
    out, tok = demo_setup
    with (demo_loader(out, tok, 0, True, length=3) as flex_loader,
          demo_loader(out, tok, 0, False, length=3) as dense_loader):
        for k in range(3):
            flex, dense = next(flex_loader), next(dense_loader)
            assert sum(flex["sample_lens"]) == DEMO_MAX_TOKENS
            _assert_flex_equals_dense(flex, dense, f"demo[{k}]")
            _assert_tiles_match_dense(block_mask(flex), dense_mask(flex), f"demo[{k}]")


def test_padding_is_an_isolated_causal_block() -> None:
    batch = load_case("c02_flex_extrap_3g2m_s14")["batches"][0]
    pad, real = batch["sample_lens"][-1], batch["sequence_length"]
    assert pad > 0 and real + pad == 320
    m = dense_mask(batch)
    assert m.shape == (320, 320) and m.dtype == torch.bool
    assert torch.equal(m[real:, real:], torch.ones(pad, pad, dtype=torch.bool).tril())
    assert not m[real:, :real].any() and not m[:real, real:].any()
    assert bool(m.diagonal().all())  # every row sees itself: no all-blocked row under softmax


def _random_batch(rng: random.Random, length: int) -> dict:
    """Random flex metadata: documents of random splits (all modes, tiny and zero-length splits), then a pad."""
    sample_lens, split_lens, modes = [], [], []
    used = 0
    while True:
        parts = [rng.choice([0, 1, 2, 3, 7, 20, 64, 130]) for _ in range(rng.randint(1, 5))]
        if sum(parts) == 0 or used + sum(parts) > length:
            break
        split_lens += parts
        modes += [rng.choice(["causal", "full", "noise"]) for _ in parts]
        sample_lens.append(sum(parts))
        used += sum(parts)
    pad = length - used
    return {"sample_lens": sample_lens + [pad], "split_lens": split_lens + [pad], "attn_modes": modes + ["causal"],
            "sequence_length": used}


@pytest.mark.parametrize("block_size", [16, 64, 128])
def test_block_mask_equals_create_block_mask(block_size: int) -> None:
    """Closed-form tiles == torch's create_block_mask over the evaluated mask_mod, on random and golden packs."""
    rng = random.Random(block_size)
    batches = [_random_batch(rng, rng.choice([200, 320, 511, 640])) for _ in range(8)]
    batches.append({"sample_lens": [100, 156, 0], "split_lens": [40, 60, 156, 0],
                    "attn_modes": ["noise", "causal", "full", "causal"]})  # no padding: a zero-length pad split
    for name in FLEX_CASES:
        batches += [b for b in load_case(name)["batches"][:3] if not _malformed(b)][:2]
    for i, batch in enumerate(batches):
        meta = flex_metadata(batch)
        ours = block_mask(meta, block_size=block_size)
        theirs = create_block_mask(make_mask_mod(meta), None, None, meta.length, meta.length, device="cpu",
                                   BLOCK_SIZE=block_size)
        _assert_same_block_mask(ours, theirs, f"batch {i}")
        if block_size == 16:  # the slice-built dense mask == the mask_mod evaluated on every pair
            assert torch.equal(dense_mask(meta), create_mask(make_mask_mod(meta), None, None, meta.length,
                                                             meta.length, device="cpu")[0, 0])


def test_flex_attention_matches_sdpa() -> None:
    """FlexAttention (eager, CPU) with the block mask == SDPA with the dense bool mask, float32, GQA 4:2.

    Tolerance: |flex - sdpa| <= 1e-5 absolute + 1e-5 relative (float32, head_dim 16; observed ~4e-7).
    The masks themselves are compared exactly elsewhere. The first eager flex_attention call in a process
    pays a one-time import/tracing cost (seconds), so this test uses one small golden pack and one random pack.
    """
    g = torch.Generator().manual_seed(0)
    packs = [load_case("c02_flex_extrap_3g2m_s14")["batches"][1], _random_batch(random.Random(7), 256)]
    for i, batch in enumerate(packs):
        L = sum(batch["sample_lens"])
        q = torch.randn(1, 4, L, 16, generator=g)
        k, v = torch.randn(1, 2, L, 16, generator=g), torch.randn(1, 2, L, 16, generator=g)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = flex_attention(q, k, v, block_mask=block_mask(batch, block_size=64), enable_gqa=True)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(batch), enable_gqa=True)
        assert out.shape == ref.shape and out.dtype == ref.dtype == torch.float32
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"pack {i}: {m}")


@pytest.mark.parametrize("change, match", [
    (dict(attn_modes=["causal"]), "split_lens but"),
    (dict(sample_lens=[7, 1026, 291, -3]), "negative"),
    (dict(attn_modes=["causal", "sideways", "causal"]), "unknown attention modes"),
    (dict(sample_lens=[5, 1028, 291]), "inside a split"),
    (dict(sample_lens=[7, 1026, 300]), "sum to"),
    (dict(sequence_length=1324, packed_position_ids=torch.zeros(1330)), "never closed"),
])
def test_invalid_metadata_raises(change: dict, match: str) -> None:
    good = {"sample_lens": [7, 1026, 291], "split_lens": [7, 1026, 291], "attn_modes": ["causal", "noise", "causal"]}
    assert flex_metadata(good).length == 1324
    with pytest.raises(ValueError, match=match):
        flex_metadata({**good, **change})
    with pytest.raises(ValueError, match="dense-mode batch"):
        block_mask({"sample_lens": [3], "nested_attention_masks": [torch.zeros(3, 3)]})
    with pytest.raises(ValueError, match="unknown block mask method"):
        block_mask(good, method="magic")


def test_to_device_moves_tensors_keeps_lists() -> None:
    batch = dict(load_case("c02_flex_extrap_3g2m_s14")["batches"][0])
    batch["nested"] = [torch.arange(3), (torch.ones(2), 5)]
    moved = to_device(batch, "cpu")
    assert moved.keys() == batch.keys()
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            assert moved[key].device.type == "cpu" and moved[key].dtype == value.dtype
            assert torch.equal(moved[key], value)
        elif key != "nested":
            assert moved[key] is value  # lists of ints/strs/dicts, ints: the very same objects
    assert torch.equal(moved["nested"][0], torch.arange(3)) and moved["nested"][1][1] == 5
    assert isinstance(moved["nested"][1], tuple)
    # "meta" proves every tensor (also those nested in lists/tuples) is moved, and nothing else touched
    on_meta = to_device(batch, "meta", non_blocking=False)
    tensors = [v for v in on_meta.values() if isinstance(v, torch.Tensor)]
    assert tensors and all(t.device.type == "meta" for t in tensors)
    assert on_meta["nested"][0].device.type == "meta" and on_meta["nested"][1][0].device.type == "meta"
    assert [t.shape for t in tensors] == [v.shape for v in batch.values() if isinstance(v, torch.Tensor)]
    assert on_meta["split_lens"] is batch["split_lens"] and on_meta["sequence_length"] == batch["sequence_length"]


def _gpu_check_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("bagel_gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_without_cuda_exits_cleanly(monkeypatch, capsys) -> None:
    gpu_check = _gpu_check_module()
    args = gpu_check.parse_args(["--batches", "2", "--heads", "28", "--kv-heads", "4"])
    assert (args.batches, args.expected, args.max, args.head_dim, args.dry_run) == (2, 32768, 36864, 128, False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == gpu_check.SKIP
    assert "CUDA is not available" in capsys.readouterr().err
