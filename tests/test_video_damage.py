"""Damaged video never crashes or hangs a reader: truncated and byte-flipped mp4s, a zero-frame mp4 and a frame with
an unreadable header are counted ``video_decode_error`` drops, a missing folder and an empty file are counted at
conversion and dropped as ``missing_video``; video bytes damaged after conversion take the checksum path
(``checksum_mismatch``). Each drop is one line naming the dataset file, the line and the video.
"""

from __future__ import annotations

import collections
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from bridge.models.bagel.data.converter.convert import convert_vlm
from bridge.models.bagel.data.energon.cooking import make_cook_context
from bridge.models.bagel.data.energon.readers import open_group_reader

pytest.importorskip("decord", reason="video records need decord (the `video` extra)")
av = pytest.importorskip("av", reason="the test videos are written with PyAV")

SMALL_T = {"max_image_size": 56, "min_image_size": 28, "image_stride": 14}
FRAMES = {"max_num_frames": 4, "min_num_frames": 2}

#: line -> (video name, what is wrong with it, expected drop reason or None for a kept sample)
CASES = [
    ("good.mp4", "a clean clip", None),
    ("trunc.mp4", "the first half of the clip's bytes", "video_decode_error"),
    ("flip.mp4", "200 bytes flipped in the middle", "video_decode_error"),
    ("zero.mp4", "an mp4 with a stream and no frame", "video_decode_error"),
    ("badframe/", "a folder whose second frame is not an image", "video_decode_error"),
    ("nothere/", "a folder that does not exist", "missing_video"),
    ("empty.mp4", "a file of 0 bytes", "missing_video"),
    ("folder/", "a clean frame folder", None),
]


def _raw(root: Path) -> Path:
    from bridge.models.bagel.data.converter.demo import clip_frames, write_frame_folder, write_mp4

    frames = clip_frames(np.random.default_rng(1), 10, 64, 48)
    write_mp4(str(root / "good.mp4"), frames)
    good = (root / "good.mp4").read_bytes()
    (root / "trunc.mp4").write_bytes(good[: len(good) // 2])
    flipped = bytearray(good)
    mid = len(good) // 3
    flipped[mid:mid + 200] = bytes(b ^ 0xFF for b in flipped[mid:mid + 200])
    (root / "flip.mp4").write_bytes(bytes(flipped))
    container = av.open(str(root / "zero.mp4"), "w")
    stream = container.add_stream("libx264", rate=8)
    stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
    container.start_encoding()
    container.close()
    write_frame_folder(str(root / "badframe"), frames[:6])
    (root / "badframe" / "frame_2.jpg").write_bytes(b"not a jpeg at all")
    (root / "empty.mp4").write_bytes(b"")
    write_frame_folder(str(root / "folder"), frames[:7])
    lines = [json.dumps({"video": name, "conversations": [{"from": "human", "value": f"<video> {what}?"},
                                                          {"from": "gpt", "value": "Yes."}]}) + "\n"
             for name, what, _ in CASES]
    (root / "v.jsonl").write_text("".join(lines))
    return root / "v.jsonl"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("video_damage")
    jsonl = _raw(root)
    return convert_vlm(str(jsonl), str(root), root / "out", progress=False)


def _one_pass(path: str, tokenizer) -> tuple[list, object]:
    ctx = make_cook_context("vlm_sft", tokenizer, SMALL_T, frame_sampler_args=FRAMES)
    reader = open_group_reader("official", [path], ctx, num_used_data=[len(CASES)], seed=0, repeat=False)
    try:
        return list(reader), reader
    finally:
        reader.close()


@pytest.mark.timeout(300)
def test_each_damage_is_one_counted_drop(converted, tokenizer):
    warned = " ".join(converted.warnings)
    assert "missing video" in warned and "nothere" in warned and "empty.mp4" in warned, converted.warnings
    kept, reader = _one_pass(converted.path, tokenizer)
    want = collections.Counter(r for _, _, r in CASES if r is not None)
    assert reader.drops.counts == dict(want)
    assert len(kept) == sum(r is None for _, _, r in CASES)
    assert all(2 <= len(s.image_tensor_list) <= 4 for s in kept)
    for skip in reader.skipped:
        (name, _, reason), = [c for c in CASES if f"video {c[0]!r}" in skip["detail"]]
        assert skip["reason"] == reason, skip
        assert "\n" not in skip["detail"] and "v.jsonl line" in skip["detail"] and name in skip["detail"], skip


@pytest.mark.timeout(300)
def test_video_bytes_damaged_after_conversion_take_the_checksum_path(converted, tokenizer, tmp_path):
    import shutil

    ds = tmp_path / "ds"
    shutil.copytree(converted.path, ds)
    shard = ds / "shards" / "shard-000000.tar"
    with tarfile.open(shard) as tf:
        m = next(x for x in tf.getmembers() if x.name == "00000000.img0")  # line 0: the clean clip
    with open(shard, "r+b") as f:
        f.seek(m.offset_data + m.size // 2)
        b = f.read(16)
        f.seek(m.offset_data + m.size // 2)
        f.write(bytes(x ^ 0xFF for x in b))
    _, reader = _one_pass(str(ds), tokenizer)
    assert reader.drops.counts.get("checksum_mismatch") == 1, reader.drops.counts
    detail = next(s["detail"] for s in reader.skipped if s["reason"] == "checksum_mismatch")
    assert "\n" not in detail and "00000000" in detail, detail
