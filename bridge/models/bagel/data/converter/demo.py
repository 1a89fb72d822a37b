"""Embedded demo dataset: procedural raw data in the three official BAGEL formats, converted to Energon.

``make_demo_data(out, seed)`` writes ``out/raw/`` (t2i parquet, unified_edit parquet + parquet_info, vlm jsonl +
images), converts it into ``out/energon/<group>/<name>/`` and writes ``out/dataset_info.yaml`` (official dataset_info
layout + ``energon_path``) and ``out/groups.yaml`` (official grouped format), so a training config can point at them.
Deterministic (seeded ``numpy.random.Generator``), a few MB, a few seconds; idempotent via a stamp file.

Video: the vlm jsonl ends with a few short procedural clips (a square sliding over a colour-cycling gradient), half
as frame folders (JPEGs, PIL only) and half as H.264 mp4s. The mp4s are written with PyAV and read with decord (both
the ``video`` extra): without them installed the demo writes frame folders in their place (one INFO line), so the
base install still runs the demo end to end, with the same number of lines.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from . import demo_scenes as ds
from .convert import ConvertSummary, convert_from_config
from ..energon.layout import EDIT, T2I, VLM

logger = logging.getLogger(__name__)

__all__ = ["SCALES", "DEMO_NAMES", "clip_frames", "generate_demo_raw", "make_demo_data", "write_frame_folder",
           "write_mp4"]

DEMO_VERSION = 3  # 2: converted with checksums; 3: video lines (an older demo_data/ is regenerated)
STAMP = ".bagel_demo_stamp.json"
#: rows per group: t2i (files, rows per file), edit (files, row groups per file, rows per row group), vlm lines
SCALES: dict[str, dict[str, Any]] = {
    "small": {"t2i": (8, 8), "edit": (4, 2, 4), "vlm": 48, "video": 6},
    "medium": {"t2i": (16, 16), "edit": (8, 2, 8), "vlm": 192, "video": 12},
}
DEMO_NAMES = {T2I: "demo_t2i", EDIT: "demo_edit", VLM: "demo_vlm"}


def _fmt(rng: np.random.Generator) -> tuple[str, bool]:
    """(format, transparent background): mostly JPEG, some PNG, some RGBA PNG."""
    u = rng.random()
    return ("JPEG", False) if u < 0.55 else ("PNG", False) if u < 0.8 else ("PNG", True)


def _random_image(rng: np.random.Generator) -> tuple[ds.Scene, str, bytes]:
    """A random scene (transparent background in some PNGs), its format (:func:`_fmt`) and its encoded bytes."""
    fmt, transparent = _fmt(rng)
    scene = ds.random_scene(rng, transparent=transparent)
    return scene, fmt, ds.encode(ds.render(scene), fmt)


def _write_parquet(path: str, schema: pa.Schema, groups: list[dict[str, list]]) -> None:
    with pq.ParquetWriter(path, schema) as w:
        for cols in groups:
            tbl = pa.Table.from_arrays([pa.array(cols[f.name], type=f.type) for f in schema], schema=schema)
            w.write_table(tbl, row_group_size=len(tbl))


def _gen_t2i(rng: np.random.Generator, d: str, n_files: int, rows: int) -> int:
    schema = pa.schema([("image", pa.binary()), ("captions", pa.string())])
    os.makedirs(d)
    for f in range(n_files):
        cuts = sorted(rng.choice(np.arange(1, rows), size=int(rng.integers(0, 3)), replace=False).tolist())
        bounds = [0, *cuts, rows]
        groups = []
        for a, b in zip(bounds, bounds[1:]):
            imgs, caps = [], []
            for _ in range(b - a):
                scene, _, data = _random_image(rng)
                imgs.append(data)
                caps.append(json.dumps(ds.captions(rng, scene)))
            groups.append({"image": imgs, "captions": caps})
        _write_parquet(os.path.join(d, f"part-{f:04d}.parquet"), schema, groups)
    return n_files * rows


def _gen_edit(rng: np.random.Generator, d: str, info_path: str, n_files: int, n_groups: int, rows: int) -> int:
    schema = pa.schema([("image_list", pa.list_(pa.binary())), ("instruction_list", pa.list_(pa.list_(pa.string())))])
    os.makedirs(d)
    info = {}
    for f in range(n_files):
        groups = []
        for _ in range(n_groups):
            imgs, instrs = [], []
            for _ in range(rows):
                fmt, _t = _fmt(rng)
                scene = ds.random_scene(rng, size=ds.random_size(rng, 128, 512))
                chain, steps = [ds.encode(ds.render(scene), fmt)], []
                for _ in range(int(rng.integers(1, 4))):  # 2-4 images
                    scene, phrasings = ds.edit_step(rng, scene)
                    chain.append(ds.encode(ds.render(scene), fmt))
                    steps.append(phrasings)
                imgs.append(chain)
                instrs.append(steps)
            groups.append({"image_list": imgs, "instruction_list": instrs})
        name = f"edit-{f:04d}.parquet"
        _write_parquet(os.path.join(d, name), schema, groups)
        info[os.path.join(d, name)] = {"num_row_groups": n_groups}  # keys as the official reader joins them
    os.makedirs(os.path.dirname(info_path), exist_ok=True)
    with open(info_path, "w", encoding="utf-8") as fh:
        json.dump(info, fh, indent=1)
    return n_files * n_groups * rows


def clip_frames(rng: np.random.Generator, n: int, width: int, height: int) -> list[np.ndarray]:
    """``n`` procedural RGB frames ``(height, width, 3)`` uint8: a square sliding over a colour-cycling gradient."""
    base = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
    tint = rng.integers(0, 256, size=3).astype(np.float32)
    side = max(4, min(width, height) // 4)
    out = []
    for k in range(n):
        img = np.broadcast_to((base + tint + 8.0 * k) % 256, (height, width, 3)).astype(np.uint8).copy()
        x = (k * max(1, (width - side) // max(1, n - 1))) % max(1, width - side)
        y = (k * max(1, (height - side) // max(1, n - 1))) % max(1, height - side)
        img[y:y + side, x:x + side] = (255, 255, 255) if k % 2 else (20, 20, 160)
        out.append(img)
    return out


def write_mp4(path: str, frames: list[np.ndarray], fps: int = 8) -> None:
    """An H.264 mp4 of ``frames`` (even width and height) written with PyAV (the ``video`` extra)."""
    import av

    with av.open(path, "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def write_frame_folder(path: str, frames: list[np.ndarray]) -> None:
    """A frame folder as the official reader reads it: ``frame_1.jpg`` .. ``frame_<n>.jpg`` (numbered from 1)."""
    from PIL import Image

    os.makedirs(path, exist_ok=True)
    for k, f in enumerate(frames, start=1):
        Image.fromarray(f).save(os.path.join(path, f"frame_{k}.jpg"), quality=90)


def _vlm_qa(rng: np.random.Generator, scene: ds.Scene) -> list[tuple[str, str]]:
    """Question/answer pairs about one scene (shuffled; the caller takes a prefix)."""
    s = scene.shapes[int(rng.integers(len(scene.shapes)))]
    n = len(scene.shapes)
    qa = [
        ("What shapes do you see?", ds.captions(rng, scene)["caption"]),
        (f"What colour is the {s.kind}?", f"The {s.kind} is {s.colour}."),
        ("How many shapes are there?", f"There {'is one shape' if n == 1 else f'are {n} shapes'}."),
        ("Describe the background.", f"It is {scene.background_words()}."),
        (f"Where is the {s.describe()}?", f"It is {ds.position_words(s)}."),
        ("Is the image wider than it is tall?", "Yes." if scene.width > scene.height else
         "No, it is taller than it is wide." if scene.height > scene.width else "No, it is square."),
    ]
    return [qa[i] for i in rng.permutation(len(qa))]


def _gen_vlm(rng: np.random.Generator, img_dir: str, jsonl: str, n_lines: int) -> int:
    os.makedirs(img_dir)
    lines, n_img = [], 0
    for i in range(n_lines):
        u = rng.random()
        k = 0 if u < 0.06 else 1 if u < 0.7 else int(rng.integers(2, 4))  # text-only / single / multi-image
        images = [_random_image(rng) for _ in range(k)]
        scenes, names = [sc for sc, _, _ in images], []
        for _, fmt, data in images:
            names.append(f"img_{n_img:05d}.{'jpg' if fmt == 'JPEG' else 'png'}")
            with open(os.path.join(img_dir, names[-1]), "wb") as fh:
                fh.write(data)
            n_img += 1
        if k == 0:
            a, b = ds.pick(rng, ["blue", "red"]), "yellow"
            conv = [("human", f"What colour do you get by mixing {a} and {b}?"),
                    ("gpt", "Green." if a == "blue" else "Orange.")]
        elif k == 1:
            qa = _vlm_qa(rng, scenes[0])[: int(rng.integers(1, 4))]  # 1-3 rounds
            conv = []
            for j, (q, a) in enumerate(qa):
                conv += [("human", ("<image>\n" if j == 0 else "") + q), ("gpt", a)]
        else:
            counts = [len(sc.shapes) for sc in scenes]
            per = "; ".join(f"image {j + 1}: {', '.join(sh.describe() for sh in sc.shapes)}"
                            for j, sc in enumerate(scenes))
            most = int(np.argmax(counts))
            conv = [("human", "<image>\n" * k + "List the shapes in each image."), ("gpt", per.capitalize() + ".")]
            if rng.random() < 0.5:
                conv += [("human", "Which image has the most shapes?"),
                         ("gpt", "They have the same number." if counts.count(counts[most]) > 1
                          else f"Image {most + 1}, with {counts[most]}.")]
        rec: dict[str, Any] = {"id": f"demo-{i:05d}"}
        if names:
            rec["image"] = names[0] if len(names) == 1 and rng.random() < 0.5 else names
        rec["conversations"] = [{"from": f, "value": v} for f, v in conv]
        lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
    with open(jsonl, "w", encoding="utf-8") as fh:
        fh.writelines(lines)
    return n_lines


def _video_lines(rng: np.random.Generator, root: str, n: int) -> list[str]:
    """``n`` video records under ``root/clips`` (frame folders; every other one an mp4 when PyAV and decord are
    installed), their ``video`` paths relative to ``root`` (the image dir)."""
    try:
        import av  # noqa: F401
        import decord  # noqa: F401
        mp4 = True
    except ImportError:
        mp4 = False
        logger.info("demo: PyAV / decord (the `video` extra) not installed: the demo's videos are frame folders only")
    lines = []
    for i in range(n):
        frames = clip_frames(rng, int(rng.integers(3, 10)), 64, 48)
        if mp4 and i % 2:
            name = f"clips/clip_{i:02d}.mp4"
            os.makedirs(os.path.join(root, "clips"), exist_ok=True)
            write_mp4(os.path.join(root, name), frames)
        else:
            name = f"clips/clip_{i:02d}/"
            write_frame_folder(os.path.join(root, name), frames)
        q, a = ds.pick(rng, [("What moves in this clip?", "A square slides across a changing gradient."),
                             ("Describe the video.", "A small square moves over a colourful background."),
                             ("How many squares move?", "One square moves.")])
        rec = {"id": f"demo-video-{i:02d}", "video": name,
               "conversations": [{"from": "human", "value": f"<video>\n{q}"}, {"from": "gpt", "value": a}]}
        lines.append(json.dumps(rec) + "\n")
    return lines


def generate_demo_raw(out_raw: str, seed: int = 0, scale: str = "small") -> dict[str, dict[str, Any]]:
    """Write the raw demo data into ``out_raw`` (must not exist); return the official dataset_info entries."""
    if scale not in SCALES:
        raise ValueError(f"unknown demo scale {scale!r} (expected one of {sorted(SCALES)})")
    out_raw = os.path.abspath(out_raw)
    os.makedirs(out_raw)
    cfg = SCALES[scale]
    rngs = [np.random.default_rng([seed, i]) for i in range(3)]  # one stream per group: independent sizes
    t2i_dir, edit_dir = os.path.join(out_raw, "t2i"), os.path.join(out_raw, "unified_edit")
    info_path = os.path.join(out_raw, "parquet_info", f"{DEMO_NAMES[EDIT]}.json")
    img_dir, jsonl = os.path.join(out_raw, "vlm", "images"), os.path.join(out_raw, "vlm", f"{DEMO_NAMES[VLM]}.jsonl")
    n_t2i = _gen_t2i(rngs[0], t2i_dir, *cfg["t2i"])
    n_edit = _gen_edit(rngs[1], edit_dir, info_path, *cfg["edit"])
    n_vlm = _gen_vlm(rngs[2], img_dir, jsonl, cfg["vlm"])
    with open(jsonl, "a", encoding="utf-8") as fh:  # the video lines last: the image lines stay as they were
        fh.writelines(_video_lines(np.random.default_rng([seed, 3]), img_dir, cfg["video"]))
    n_vlm += cfg["video"]
    return {
        T2I: {DEMO_NAMES[T2I]: {"data_dir": t2i_dir, "num_files": cfg["t2i"][0], "num_total_samples": n_t2i}},
        EDIT: {DEMO_NAMES[EDIT]: {"data_dir": edit_dir, "parquet_info_path": info_path, "num_files": cfg["edit"][0],
                                  "num_total_samples": n_edit}},
        VLM: {DEMO_NAMES[VLM]: {"data_dir": img_dir, "jsonl_path": jsonl, "num_total_samples": n_vlm}},
    }


def demo_groups(scale: str = "small") -> dict[str, Any]:
    """The grouped YAML (official example.yaml format): t2i and vlm mandatory, edit weight 1."""
    cfg = SCALES[scale]
    return {
        T2I: {"dataset_names": [DEMO_NAMES[T2I]],
              "image_transform_args": {"image_stride": 16, "max_image_size": 1024, "min_image_size": 512},
              "is_mandatory": True, "num_used_data": [cfg["t2i"][0]], "weight": 1},
        EDIT: {"dataset_names": [DEMO_NAMES[EDIT]],
               "image_transform_args": {"image_stride": 16, "max_image_size": 1024, "min_image_size": 512},
               "vit_image_transform_args": {"image_stride": 14, "max_image_size": 518, "min_image_size": 224},
               "is_mandatory": False, "num_used_data": [cfg["edit"][0]], "weight": 1},
        VLM: {"dataset_names": [DEMO_NAMES[VLM]],
              "image_transform_args": {"image_stride": 14, "max_image_size": 980, "min_image_size": 378,
                                       "max_pixels": 2007040},
              # the official example.yaml samples 8-12 frames; within the demo's budgets (10240 tokens a sample) a
              # video of the largest frames this transform makes fits at up to 2 frames (config.budgets.video_bounds)
              "frame_sampler_args": {"max_num_frames": 2, "min_num_frames": 1},
              "is_mandatory": True, "shuffle_lines": True, "shuffle_seed": 0,
              "num_used_data": [cfg["vlm"] + cfg["video"]],
              "weight": 1},
    }


def _write_yaml(path: str, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(data, fh, sort_keys=False, allow_unicode=True)


def make_demo_data(out: str, seed: int = 0, scale: str = "small") -> list[ConvertSummary]:
    """Generate + convert the demo set into ``out``; a no-op (returns ``[]``) if ``out`` already holds it."""
    out = os.path.abspath(out)
    stamp_path = os.path.join(out, STAMP)
    want = {"version": DEMO_VERSION, "seed": seed, "scale": scale}
    if os.path.isfile(stamp_path):
        with open(stamp_path, encoding="utf-8") as fh:
            if json.load(fh) == want:
                logger.info("demo data in %s is complete (seed %d, scale %s); nothing to do", out, seed, scale)
                return []
        os.remove(stamp_path)
    for sub in ("raw", "energon"):  # only what this generator owns
        shutil.rmtree(os.path.join(out, sub), ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    info = generate_demo_raw(os.path.join(out, "raw"), seed, scale)
    info_path, groups_path = os.path.join(out, "dataset_info.yaml"), os.path.join(out, "groups.yaml")
    _write_yaml(info_path, info)
    _write_yaml(groups_path, demo_groups(scale))
    summaries = convert_from_config(info_path, groups_path, os.path.join(out, "energon"),
                                    source_root=os.path.join(out, "raw"), progress=False, overwrite=True)
    for s in summaries:
        info[s.group][s.dataset_name]["energon_path"] = os.path.abspath(s.path)
    _write_yaml(info_path, info)
    with open(stamp_path, "w", encoding="utf-8") as fh:
        json.dump(want, fh)
    logger.info("demo data written to %s: %s", out, {f"{s.group}/{s.dataset_name}": s.samples for s in summaries})
    return summaries
