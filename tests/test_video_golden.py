"""Golden: video records converted and cooked reproduce the official vlm_sft reader with decord 0.6.0 bit for bit.

``fixtures/bagel_video`` (its README) holds what the unmodified official ``SftJSONLIterableDataset`` with
``FrameSampler(max_num_frames=5, min_num_frames=2)`` yielded for ``raw/sft_video.jsonl`` (mp4 files, frame folders,
a corrupt and a missing file, a clip decord fails on, a row with image and video, tags outside the first turn) after
``set_epoch(42)`` and ``random.seed(20261205)``, ``np.random.seed(1205)``. The raw data is converted with the real
converter and read in the official order: the same samples in the same order, bit-exact frame tensors
(``torch.equal``), the same skipped rows, and the same Python and numpy global RNG states after every sample.
"""

from __future__ import annotations

import collections
import hashlib
import importlib.util
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from bridge.models.bagel.data.converter.convert import convert_vlm
from bridge.models.bagel.data.energon.cooking import make_cook_context
from bridge.models.bagel.data.energon.readers import open_group_reader

pytest.importorskip("decord", reason="the video golden test needs decord (the `video` extra)")
pytestmark = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")

FIX = Path(__file__).parent / "fixtures" / "bagel_video"
RAW = FIX / "raw"
FRAMES = dict(max_num_frames=5, min_num_frames=2)
VLM_T = dict(max_image_size=980, min_image_size=378, image_stride=14, max_pixels=2_007_040)

_spec = importlib.util.spec_from_file_location("bagel_readers_decode",
                                               Path(__file__).parent / "fixtures" / "bagel_readers" / "decode.py")
decode = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(decode)

#: what each skipped row is dropped as (the official messages: RuntimeError / ValueError / DECORDError / no loss)
REASONS = {"video_decode_error": 2, "video_tag_missing": 1, "missing_video": 1, "no_loss_item": 1}


def _shas() -> tuple[str, str]:
    """The golden's python / numpy global RNG digests (README: ``python_rng_sha_after`` / ``numpy_rng_sha_after``)."""
    return (hashlib.sha256(repr(random.getstate()).encode()).hexdigest()[:16],
            hashlib.sha256(np.random.get_state()[1].tobytes()).hexdigest())


@pytest.fixture(scope="module")
def video_converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("video_converted")
    s = convert_vlm(str(RAW / "sft_video.jsonl"), str(RAW), out, progress=False)
    return s


@pytest.mark.parity
def test_official_video_pass_bit_exact(video_converted, tokenizer):
    case = decode.load(str(FIX / "vlm_video.pt"))
    cfg = case["config"]
    assert cfg["frame_sampler_args"] == FRAMES and cfg["transform"] == VLM_T and cfg["decord"] == "0.6.0"
    ctx = make_cook_context("vlm_sft", tokenizer, VLM_T, frame_sampler_args=FRAMES)
    reader = open_group_reader("official", [video_converted.path], ctx, num_used_data=[1000], seed=42, repeat=False)
    try:
        random.seed(cfg["random_seed"])
        np.random.seed(cfg["numpy_seed"])
        torch.manual_seed(cfg["torch_seed"])
        assert list(_shas()) == cfg["rng_sha_before"]
        samples, shas = [], []
        for s in reader:
            samples.append(s.to_official())
            shas.append(_shas())  # right after each yield, as the golden records them
    finally:
        reader.close()

    exp = case["samples"]
    assert len(samples) == len(exp)
    for e, g in zip(exp, samples):
        assert decode.compare_sample(e, g) == [], e["meta"]["line_id"]
        for x, y in zip(e["image_tensor_list"], g["image_tensor_list"]):
            assert torch.equal(x, y)  # bit-exact frames
    assert shas == [(e["meta"]["python_rng_sha_after"], e["meta"]["numpy_rng_sha_after"]) for e in exp]
    assert [x["row_id"] for x in reader.skipped] == [x["row_idx"] for x in case["skipped"]]
    assert reader.drops.counts == REASONS
    assert collections.Counter(x["reason"] for x in reader.skipped) == REASONS


def test_conversion_counts_missing_video_and_stores_frames(video_converted):
    """The missing file is counted by reason at conversion; the folder's frames are members in the official order."""
    assert any("missing video" in w and "nowhere.mp4" in w for w in video_converted.warnings)
