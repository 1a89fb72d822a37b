#!/usr/bin/env python3
"""What video records cost: frame decode per sample, and the reader's overhead over bare decode on a video-heavy mix.

Writes a vlm_sft corpus of procedural clips (``--lines`` lines: 5 of 6 video, half H.264 mp4s written with PyAV,
half frame folders of JPEGs; 1 of 6 text only), converts it, then measures in the same run:

* ``decode_ms_per_sample``: bare decode, no reader — per video line, the file's bytes (or the folder's frame files)
  read from disk, the official frame sampling (``cooking.video``: decord for files, PIL for the sampled frames of a
  folder) and the ViT transform of every frame (``img_num`` = frame count); ``decode_ms_per_frame`` the same per
  frame returned;
* ``reader_ms_per_sample``: one pass of the group reader (official order, inline, checksums verified) over the same
  lines: the shard read, checksum, meta, decode, transform and tokenization of each sample, per video line;
* ``overhead`` = reader / bare - 1 (text lines are cheap; they are in the reader's pass, not in the bare one);
* ``folder_all_ms_per_sample``: what the official folder path pays, every frame of a folder decoded, against
  ``folder_sampled_ms_per_sample`` (only the sampled frames, what the reader does).

Torch runs one intra-op thread, as in a read worker. The best of ``--repeats`` rounds counts, after one uncounted warm-up round (the least disturbed on a shared machine). Usage: ``python
scripts/bench_video.py [--quick] [--lines N] [--repeats K] [--tmp DIR]``; last line ``bench_video: samples=...
frames=... decode_ms_per_sample=... decode_ms_per_frame=... reader_ms_per_sample=... overhead=...
folder_all_ms_per_sample=... folder_sampled_ms_per_sample=...``. ``--quick`` is the CI smoke run
(``tests/test_benches.py``): it proves the bench works; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from typing import Any

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

logging.getLogger("bridge").setLevel(logging.ERROR)

FRAME_ARGS = {"max_num_frames": 12, "min_num_frames": 8}  # the official example.yaml's
VLM_T = {"max_image_size": 980, "min_image_size": 378, "image_stride": 14, "max_pixels": 2_007_040}


def make_corpus(root: str, lines: int, frames: int, width: int, height: int) -> tuple[str, list[dict]]:
    """The raw corpus under ``root``: ``v.jsonl`` and its clips; returns (jsonl path, records)."""
    import numpy as np

    from bridge.models.bagel.data.converter.demo import clip_frames, write_frame_folder, write_mp4

    rng = np.random.default_rng(0)
    recs = []
    for i in range(lines):
        rec: dict[str, Any] = {"id": i}
        if i % 6 == 5:
            rec["conversations"] = [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hi."}]
        else:
            clip = clip_frames(rng, frames, width, height)
            if i % 2:
                write_mp4(os.path.join(root, f"c{i}.mp4"), clip)
                rec["video"] = f"c{i}.mp4"
            else:
                write_frame_folder(os.path.join(root, f"f{i}"), clip)
                rec["video"] = f"f{i}/"
            rec["conversations"] = [{"from": "human", "value": "<video>\nWhat moves?"},
                                    {"from": "gpt", "value": "A square slides over a gradient."}]
        recs.append(rec)
    path = os.path.join(root, "v.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    return path, recs


def bare_decode(root: str, recs: list[dict], transform: Any, sampler: Any) -> tuple[float, int]:
    """Seconds and frames of the bare decode of every video line (module docstring)."""
    from bridge.models.bagel.data.converter.formats import frame_sort_key
    from bridge.models.bagel.data.energon.cooking import Draws
    from bridge.models.bagel.data.energon.cooking.video import sample_file_frames, sample_folder_frames

    n_frames = 0
    t0 = time.perf_counter()
    for rec in recs:
        name = rec.get("video")
        if name is None:
            continue
        path = os.path.join(root, name)
        draws = Draws(rng=random)
        if name.endswith("/"):
            files = sorted(sorted(os.listdir(path)), key=frame_sort_key)
            parts = [open(os.path.join(path, f), "rb").read() for f in files]
            frames = sample_folder_frames(parts, sampler, draws, name)
        else:
            frames = sample_file_frames(open(path, "rb").read(), sampler, draws, name)
        for img in frames:
            transform(img, img_num=len(frames))
        n_frames += len(frames)
    return time.perf_counter() - t0, n_frames


def folder_decode(root: str, recs: list[dict], sampler: Any, every: bool) -> float:
    """Seconds to decode the folders' frames: all of them (official) or only the sampled ones."""
    from PIL import Image

    from bridge.models.bagel.data.energon.cooking import Draws
    from bridge.models.bagel.data.energon.cooking.video import sample_folder_frames

    t0 = time.perf_counter()
    for rec in recs:
        name = rec.get("video")
        if name is None or not name.endswith("/"):
            continue
        path = os.path.join(root, name)
        parts = [open(os.path.join(path, f), "rb").read() for f in sorted(os.listdir(path))]
        if every:
            [Image.open(io.BytesIO(p)).convert("RGB") for p in parts]
        else:
            sample_folder_frames(parts, sampler, Draws(rng=random), name)
    return time.perf_counter() - t0


def reader_pass(path: str, tokenizer: Any, lines: int) -> tuple[float, int]:
    """Seconds of one reader pass over every line, and the samples it yielded."""
    from bridge.models.bagel.data.energon.cooking import make_cook_context
    from bridge.models.bagel.data.energon.readers import open_group_reader

    ctx = make_cook_context("vlm_sft", tokenizer, VLM_T, frame_sampler_args=FRAME_ARGS)
    reader = open_group_reader("official", [path], ctx, num_used_data=[lines], seed=0, repeat=False)
    try:
        t0 = time.perf_counter()
        n = sum(1 for _ in reader)
        return time.perf_counter() - t0, n
    finally:
        reader.close()


def run(lines: int, frames: int, size: tuple[int, int], repeats: int, tmp: str | None) -> dict[str, Any]:
    from bridge.models.bagel.data.converter.convert import convert_vlm
    from bridge.models.bagel.data.energon.cooking.video import FrameSampler
    from bridge.models.bagel.data.tokenizer import add_special_tokens, build_qwen2_tokenizer
    from bridge.models.bagel.data.transforms import ImageTransform

    import torch

    torch.set_num_threads(1)  # as in a read worker (energon.readers.pool): one intra-op thread, both paths alike
    root = tempfile.mkdtemp(prefix="bench_video_", dir=tmp)
    try:
        jsonl, recs = make_corpus(root, lines, frames, *size)
        ds = convert_vlm(jsonl, root, os.path.join(root, "out"), progress=False).path
        tok, _, _ = add_special_tokens(build_qwen2_tokenizer())
        transform, sampler = ImageTransform(**VLM_T), FrameSampler.of(FRAME_ARGS)
        videos = sum("video" in r for r in recs)
        folders = sum(r.get("video", "").endswith("/") for r in recs)
        bare, reader, all_f, sampled_f, n_frames, kept = [], [], [], [], 0, 0
        for k in range(repeats + 1):  # round 0 warms up (imports, decord, torch kernels) and is not counted
            random.seed(0)
            s, n_frames = bare_decode(root, recs, transform, sampler)
            bare.append(s)
            s, kept = reader_pass(ds, tok, lines)
            reader.append(s)
            all_f.append(folder_decode(root, recs, sampler, every=True))
            sampled_f.append(folder_decode(root, recs, sampler, every=False))
            if k == 0:
                bare, reader, all_f, sampled_f = [], [], [], []
        if kept != lines:
            raise SystemExit(f"bench_video: the reader yielded {kept} of {lines} samples")
        b, r = min(bare), min(reader)
        return {"samples": lines, "video_samples": videos, "frames": n_frames,
                "decode_ms_per_sample": round(b / videos * 1e3, 2), "decode_ms_per_frame": round(b / n_frames * 1e3, 3),
                "reader_ms_per_sample": round(r / videos * 1e3, 2), "overhead": round(r / b - 1, 4),
                "folder_all_ms_per_sample": round(min(all_f) / max(1, folders) * 1e3, 2),
                "folder_sampled_ms_per_sample": round(min(sampled_f) / max(1, folders) * 1e3, 2),
                "load_avg": round(os.getloadavg()[0], 1)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CI smoke run: 6 lines of 12-frame 64x48 clips, one round")
    p.add_argument("--lines", type=int, default=48, help="JSONL lines (5 of 6 are video)")
    p.add_argument("--frames", type=int, default=48, help="frames per clip")
    p.add_argument("--repeats", type=int, default=3, help="rounds; the best counts")
    p.add_argument("--tmp", help="where to build the corpus (default: the system temp dir)")
    a = p.parse_args()
    lines, frames, size, repeats = (6, 12, (64, 48), 1) if a.quick else (a.lines, a.frames, (320, 240), a.repeats)
    r = run(lines, frames, size, repeats, a.tmp)
    for k, v in r.items():
        print(f"{k:>28}: {v}")
    print("bench_video: " + " ".join(f"{k}={v}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
