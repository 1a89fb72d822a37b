"""A small vlm_sft video dataset for the video tests: mp4 clips (PyAV), frame folders, a few text lines, converted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import yaml

FRAME_ARGS = {"max_num_frames": 4, "min_num_frames": 2}
SMALL_T = {"max_image_size": 56, "min_image_size": 28, "image_stride": 14}


def write_video_raw(root: Path, n_lines: int = 24, seed: int = 0) -> tuple[Path, Path]:
    """``root/raw``: ``videos.jsonl`` (mp4 clips of 3-14 frames, frame folders of 2-9 frames, every 6th line text
    only) and its media; returns (jsonl, media dir)."""
    from bridge.models.bagel.data.converter.demo import clip_frames, write_frame_folder, write_mp4

    rng = np.random.default_rng(seed)
    media = root / "raw"
    (media / "clips").mkdir(parents=True)
    lines = []
    for i in range(n_lines):
        rec: dict[str, Any] = {"id": i}
        if i % 6 == 5:
            conv = [("human", f"Say {i}."), ("gpt", f"{i}.")]
        else:
            frames = clip_frames(rng, int(rng.integers(3, 15)) if i % 2 else int(rng.integers(2, 10)), 64, 48)
            if i % 2:
                write_mp4(str(media / "clips" / f"c{i}.mp4"), frames)
                rec["video"] = f"clips/c{i}.mp4"
            else:
                write_frame_folder(str(media / "clips" / f"f{i}"), frames)
                rec["video"] = f"clips/f{i}/"
            conv = [("human", f"<video>\nWhat moves in clip {i}?"), ("gpt", f"A square, {len(frames)} frames.")]
        rec["conversations"] = [{"from": f, "value": v} for f, v in conv]
        lines.append(json.dumps(rec) + "\n")
    jsonl = media / "videos.jsonl"
    jsonl.write_text("".join(lines))
    return jsonl, media


def video_config(root: Path, *, order: str = "elastic", **changes: Any) -> Any:
    """Convert ``write_video_raw``'s data and return a data config with one vlm_sft group over it (small budgets)."""
    from bridge.models.bagel.data.config import BagelDataConfig, PackerConfig
    from bridge.models.bagel.data.converter.convert import convert_vlm

    jsonl, media = write_video_raw(root)
    path = convert_vlm(str(jsonl), str(media), root / "out", progress=False).path
    (root / "groups.yaml").write_text(yaml.safe_dump({
        "vlm_sft": {"dataset_names": ["videos"], "weight": 1, "is_mandatory": True, "image_transform_args": SMALL_T,
                    "frame_sampler_args": FRAME_ARGS, "num_used_data": [24]}}))
    (root / "info.yaml").write_text(yaml.safe_dump({
        "vlm_sft": {"videos": {"data_dir": str(media), "jsonl_path": str(jsonl), "energon_path": path}}}))
    return BagelDataConfig(groups=str(root / "groups.yaml"), dataset_info=str(root / "info.yaml"), order=order,
                           partitions=4, packer=PackerConfig(expected_num_tokens=160, max_num_tokens=256,
                                                             max_num_tokens_per_sample=200, prefer_buffer_before=64),
                           **changes)
