"""Demo data: deterministic, idempotent, in the official raw formats, converted and wired into the config files."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image

from bridge.models.bagel.data.converter.demo import DEMO_NAMES, STAMP, generate_demo_raw, make_demo_data
from bridge.models.bagel.data.energon.layout import EDIT, META_PART, T2I, VLM, load_manifest

pytestmark = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")


def _files(root: Path) -> dict[str, bytes]:
    """Every file under raw/ and every shard, relative path -> bytes."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and (rel.startswith("raw/") or rel.endswith(".tar")) and "parquet_info" not in rel:
            out[rel] = p.read_bytes()
    return out


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo") / "d"
    assert len(make_demo_data(str(out), seed=7)) == 3
    return out


def test_deterministic_and_seed_dependent(demo, tmp_path):
    again = tmp_path / "again"
    make_demo_data(str(again), seed=7)
    a, b = _files(demo), _files(again)
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a)
    for g, name in DEMO_NAMES.items():
        ma, mb = (load_manifest(r / "energon" / g / name) for r in (demo, again))
        ma.pop("source_root"), mb.pop("source_root")
        assert ma == mb
    other = tmp_path / "other"
    generate_demo_raw(str(other / "raw"), seed=8)
    c = _files(other)
    assert c["raw/vlm/demo_vlm.jsonl"] != a["raw/vlm/demo_vlm.jsonl"]
    assert c["raw/t2i/part-0000.parquet"] != a["raw/t2i/part-0000.parquet"]


def test_idempotent(demo):
    shard = demo / "energon" / T2I / DEMO_NAMES[T2I] / "shards" / "shard-000000.tar"
    before = shard.stat().st_mtime_ns
    assert make_demo_data(str(demo), seed=7) == []
    assert shard.stat().st_mtime_ns == before and (demo / STAMP).is_file()


def test_configs_point_at_converted_datasets(demo):
    info = yaml.safe_load((demo / "dataset_info.yaml").read_text())
    groups = yaml.safe_load((demo / "groups.yaml").read_text())
    assert list(groups) == [T2I, EDIT, VLM]
    assert groups[T2I]["is_mandatory"] and groups[VLM]["is_mandatory"] and not groups[EDIT]["is_mandatory"]
    assert groups[EDIT]["weight"] == 1 and groups[VLM]["shuffle_lines"] is True
    for g, name in DEMO_NAMES.items():
        assert groups[g]["dataset_names"] == [name]
        entry = info[g][name]
        man = load_manifest(entry["energon_path"])
        nv = json.loads((Path(entry["energon_path"]) / ".nv-meta" / ".info.json").read_text())
        assert man["num_samples"] == sum(nv["shard_counts"].values()) == entry["num_total_samples"]
        assert man["skipped"] == [] and os.path.isdir(entry["data_dir"])
    # official parquet_info keys: the joined paths of the declared files
    pinfo = json.loads(Path(info[EDIT][DEMO_NAMES[EDIT]]["parquet_info_path"]).read_text())
    assert sorted(pinfo) == sorted(str(p) for p in Path(info[EDIT][DEMO_NAMES[EDIT]]["data_dir"]).glob("*.parquet"))
    # enough sharding units for 2 DP ranks x 2 workers in every group
    assert groups[T2I]["num_used_data"] == [8] and sum(pinfo[k]["num_row_groups"] for k in pinfo) >= 4


def test_raw_content_is_varied_and_well_formed(demo):
    t2i_sizes, modes, formats = set(), set(), set()
    for p in sorted((demo / "raw" / "t2i").glob("*.parquet")):
        pf = pq.ParquetFile(p)
        assert pf.metadata.num_row_groups >= 1
        for row in pf.read().to_pylist():
            img = Image.open(io.BytesIO(row["image"]))
            t2i_sizes.add(img.size), modes.add(img.mode), formats.add(img.format)
            assert 96 // 2 <= min(img.size) and max(img.size) <= 640
            caps = json.loads(row["captions"])
            assert 1 <= len(caps) <= 3 and all(isinstance(c, str) and c for c in caps.values())
    assert len(t2i_sizes) > 20 and {"RGB", "RGBA"} <= modes and formats == {"JPEG", "PNG"}
    assert any(pq.ParquetFile(p).metadata.num_row_groups > 1 for p in (demo / "raw" / "t2i").glob("*.parquet"))
    for p in sorted((demo / "raw" / "unified_edit").glob("*.parquet")):
        for row in pq.read_table(p).to_pylist():
            n = len(row["image_list"])
            assert 2 <= n <= 4 and len(row["instruction_list"]) == n - 1
            assert all(1 <= len(alts) <= 3 for alts in row["instruction_list"])
            assert len({Image.open(io.BytesIO(b)).size for b in row["image_list"]}) == 1
    lines = (demo / "raw" / "vlm" / "demo_vlm.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    n_imgs = [len(r["image"]) if isinstance(r.get("image"), list) else int("image" in r) for r in recs]
    assert len(recs) == 54 and max(n_imgs) >= 2 and 0 in n_imgs
    videos = [r["video"] for r in recs if "video" in r]  # the last 6 lines: frame folders and mp4s
    assert len(videos) == 6 and all("video" in r for r in recs[48:])
    import importlib.util

    with_mp4 = all(importlib.util.find_spec(m) for m in ("av", "decord"))  # the `video` extra: mp4s, else folders
    assert any(v.endswith("/") for v in videos) and any(v.endswith(".mp4") for v in videos) == with_mp4
    assert any(len(r["conversations"]) >= 4 for r in recs)
    for r in recs:
        names = r.get("image", [])
        for name in names if isinstance(names, list) else [names]:
            Image.open(demo / "raw" / "vlm" / "images" / name).verify()
        assert sum(t["value"].count("<image>") for t in r["conversations"]) == len(
            names if isinstance(names, list) else [names])
        assert r["conversations"][-1]["from"] == "gpt"


def test_converted_vlm_meta(demo):
    root = demo / "energon" / VLM / DEMO_NAMES[VLM]
    man = load_manifest(root)
    assert (man["files"][0]["first_sample"], man["files"][0]["num_samples"]) == (0, 54) and man["image_dir"] == "vlm/images"
    import tarfile

    with tarfile.open(root / man["shards"][0]["path"]) as tf:
        meta = json.loads(tf.extractfile("00000000." + META_PART).read())
    assert meta["source"] == {"file": "vlm/demo_vlm.jsonl", "line": 0} and meta["image_errors"] == {}


def test_config_loaders_accept_demo_files(demo):
    from bridge.models.bagel.data.config import load_dataset_info, load_grouped_yaml, resolve_groups

    groups = load_grouped_yaml(str(demo / "groups.yaml"))
    resolved = resolve_groups(groups, load_dataset_info(str(demo / "dataset_info.yaml")))
    assert [r.group.name for r in resolved] == [T2I, EDIT, VLM]
    assert all(os.path.isdir(d.energon_path) for r in resolved for d in r.datasets)


def test_demo_video_lines_cook_into_frames(demo, tokenizer):
    """The demo's 6 video lines (frame folders and mp4s) are cooked: 1-2 frames each within the demo budgets."""
    pytest.importorskip("decord", reason="the demo's mp4s are read with decord (the `video` extra)")
    from bridge.models.bagel.data.energon.cooking import make_cook_context
    from bridge.models.bagel.data.energon.readers import open_group_reader

    g = yaml.safe_load((demo / "groups.yaml").read_text())[VLM]
    ctx = make_cook_context(VLM, tokenizer, g["image_transform_args"], frame_sampler_args=g["frame_sampler_args"])
    reader = open_group_reader("official", [str(demo / "energon" / VLM / DEMO_NAMES[VLM])], ctx,
                               num_used_data=g["num_used_data"], seed=42, repeat=False)
    try:
        videos = {s.source["line"]: s for s in reader if s.source["line"] >= 48}
    finally:
        reader.close()
    assert sorted(videos) == list(range(48, 54)) and reader.drops.counts == {}
    assert all(1 <= len(s.image_tensor_list) <= 2 and s.num_tokens < 4096 for s in videos.values())
