"""Video records through both orders, in one process: the elastic order's stream does not depend on the workers and
resumes exactly; an elastic 2 -> 3 resize over a video group is exactly once (ledger) and deterministic; a sample
rebuilt from its restore key (what a resize hands over) replays its recorded frame draws; the official order resumes
exactly and never touches the process's numpy RNG.
Workers and prefetch on where the order allows them (like ``test_elastic``; ``test_elastic_job`` runs torchrun).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from _external_common import assert_same, elastic_world as _world, run_world as _run
from _video_common import video_config
from bridge.models.bagel.data.build import build_bagel_train_loader
from bridge.models.bagel.data.tools.ledger import check_exactly_once

pytest.importorskip("decord", reason="video records need decord (the `video` extra)")
pytest.importorskip("av", reason="the test videos are written with PyAV")


@pytest.fixture(scope="module")
def video(tmp_path_factory, tokenizer):
    return video_config(tmp_path_factory.mktemp("video_orders")), tokenizer


def test_elastic_stream_independent_of_workers_and_resumes_exactly(video) -> None:
    cfg, tok = video
    inline, _ = _run([build_bagel_train_loader(cfg, tok, (1, 2), length=10)], 4)
    workers, _ = _run([build_bagel_train_loader(dataclasses.replace(cfg, num_workers=2, prefetch=2), tok, (1, 2),
                                                length=10)], 4)
    for a, b in zip(inline[0], workers[0]):
        assert_same(a, b)  # each read's draws are a pure function of the read, whichever worker cooks it
    assert any(v.numel() for b in inline[0] for v in [b["packed_vit_tokens"]]), "no video frame was packed"
    _, states = _run(_world(cfg, tok, 2, num_workers=2, prefetch=2), 2)
    again, _ = _run(_world(cfg, tok, 2, states, num_workers=2, prefetch=2), 2)
    for a, b in zip(inline[0][2:], again[1]):
        assert_same(a, b)


def test_elastic_resize_2_to_3_is_exactly_once_and_deterministic(video) -> None:
    cfg, tok = video
    cfg = dataclasses.replace(cfg, packer=dataclasses.replace(cfg.packer, lossless=True))
    reads: list[dict] = []
    _, s2 = _run(_world(cfg, tok, 2, num_workers=2, prefetch=2), 2, reads)
    batches, s3 = _run(_world(cfg, tok, 3, s2, num_workers=2, prefetch=2), 3, reads)
    report = check_exactly_once(reads, s3)
    assert report.ok, report.problems
    twice, _ = _run(_world(cfg, tok, 3, s2), 3)  # the same restart without workers: the same batches, bit for bit
    for a, b in zip(batches, twice):
        for x, y in zip(a, b):
            assert_same(x, y)


def test_elastic_restore_key_replays_the_frame_draws(video) -> None:
    """What a resize or restart hands over is rebuilt from its restore key: the recorded numpy / Python draws are
    replayed (no RNG touched) and give the same frames, bit for bit."""
    import random

    import torch

    from bridge.models.bagel.data.energon.cooking import make_cook_context
    from bridge.models.bagel.data.energon.readers import open_group_reader
    from _video_common import FRAME_ARGS, SMALL_T

    cfg, tok = video
    path = yaml_path(cfg)
    ctx = make_cook_context("vlm_sft", tok, SMALL_T, frame_sampler_args=FRAME_ARGS)
    reader = open_group_reader("elastic", [path], ctx, seed=3, partitions=4)
    try:
        samples = [next(reader) for _ in range(10)]
        video_samples = [s for s in samples if s.image_tensor_list]
        assert len(video_samples) >= 5
        before = (random.getstate(), np.random.get_state()[1].copy())
        for s in video_samples:
            assert len(s.rng_choices) >= 1  # the frame count at least (numpy), then the frame indices
            again = reader.restore_sample((s.__restore_key__, s.rng_choices))
            assert len(again.image_tensor_list) == len(s.image_tensor_list)
            assert all(torch.equal(x, y) for x, y in zip(s.image_tensor_list, again.image_tensor_list))
        assert random.getstate() == before[0] and (np.random.get_state()[1] == before[1]).all()
    finally:
        reader.close()


def yaml_path(cfg) -> str:
    """The converted dataset path of the config's one vlm_sft dataset."""
    import yaml

    with open(cfg.dataset_info, encoding="utf-8") as f:
        return yaml.safe_load(f)["vlm_sft"]["videos"]["energon_path"]


def test_official_order_resumes_exactly_and_keeps_the_process_numpy_rng(video) -> None:
    cfg, tok = video
    cfg = dataclasses.replace(cfg, order="official", num_workers=2)
    straight = build_bagel_train_loader(cfg, tok, (0, 1), length=10)
    np.random.seed(7)
    before = np.random.get_state()[1].copy()
    full = [next(straight) for _ in range(6)]
    assert (np.random.get_state()[1] == before).all()  # the frame sampler drew from the data-only numpy stream
    straight.close()
    first = build_bagel_train_loader(cfg, tok, (0, 1), length=10)
    for _ in range(3):
        next(first)
    state = first.save_state()
    first.close()
    resumed = build_bagel_train_loader(cfg, tok, (0, 1), length=10)
    resumed.restore_state(state)
    for a in full[3:]:
        assert_same(a, next(resumed))
    resumed.close()


def test_a_video_dataset_without_decord_fails_at_build_in_one_line(video, monkeypatch) -> None:
    import sys

    from bridge.models.bagel.data.config import ConfigError

    cfg, tok = video
    monkeypatch.setitem(sys.modules, "decord", None)  # `import decord` raises ImportError: as if not installed
    with pytest.raises(ConfigError) as err:
        build_bagel_train_loader(cfg, tok, (0, 1), length=10)
    line = str(err.value)
    assert "\n" not in line.strip() and "group 'vlm_sft'" in line and "video files" in line, line
    assert "the `video` extra" in line and "bagel-megatron-data[video]" in line, line
