"""Video frames in the cost: every frame is a ViT image in the cooked sample's ``num_tokens`` (the packer's length),
in ``packing.cost.sample_work`` (what the balanced strategy and the straggler meter weigh), and in ``bagel-data
stats``' per-sample estimate (frame count over ``[min_num_frames, max_num_frames]``, ``img_num`` = frame count)."""

from __future__ import annotations

import pytest

from _video_common import FRAME_ARGS, SMALL_T, write_video_raw
from bridge.models.bagel.data.config import GroupConfig
from bridge.models.bagel.data.converter.convert import convert_vlm
from bridge.models.bagel.data.energon.cooking import make_cook_context
from bridge.models.bagel.data.energon.readers import open_group_reader
from bridge.models.bagel.data.packing.cost import sample_work
from bridge.models.bagel.data.tools.budget_stats.estimate import dataset_stats

pytest.importorskip("decord", reason="video records need decord (the `video` extra)")
pytest.importorskip("av", reason="the test videos are written with PyAV")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("video_cost")
    jsonl, media = write_video_raw(root, n_lines=12)
    return convert_vlm(str(jsonl), str(media), root / "out", progress=False).path


def test_frames_are_vit_work_and_tokens(converted, tokenizer):
    ctx = make_cook_context("vlm_sft", tokenizer, SMALL_T, frame_sampler_args=FRAME_ARGS)
    reader = open_group_reader("official", [converted], ctx, num_used_data=[12], seed=0, repeat=False)
    try:
        samples = [s for s in reader if s.image_tensor_list]
    finally:
        reader.close()
    assert samples
    for s in samples:
        per_frame = [t.shape[1] * t.shape[2] // 14 ** 2 for t in s.image_tensor_list]
        assert FRAME_ARGS["min_num_frames"] <= len(per_frame) <= FRAME_ARGS["max_num_frames"]
        work = sample_work(s, vit_patch_size=14, vae_image_downsample=16)
        assert work.vit_tokens == sum(per_frame) and work.vit_pairs == sum(n * n for n in per_frame)
        assert s.num_tokens >= sum(per_frame)


def test_stats_estimate_video_samples(converted, tokenizer):
    group = GroupConfig(name="vlm_sft", dataset_names=["videos"], weight=1.0, image_transform_args=SMALL_T,
                        frame_sampler_args=FRAME_ARGS)
    st = dataset_stats(group, "videos", converted, tokenizer, progress=False)
    assert not st.unusable, st.unusable
    assert st.samples == st.read == len(st.estimates) == 12
    spread = [e for e in st.estimates if e.hi > e.lo]  # 2..4 frames drawn: more frames, more tokens
    assert len(spread) >= 5 and all(e.work.vit_tokens > 0 and e.vit_side > 0 for e in spread)
    no_sampler = GroupConfig(name="vlm_sft", dataset_names=["videos"], weight=1.0, image_transform_args=SMALL_T)
    assert dataset_stats(no_sampler, "videos", converted, tokenizer, progress=False).unusable.get(
        "no_frame_sampler") == 10
