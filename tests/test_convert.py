"""Converter round trip on the golden raw data: one sample per readable row, exact bytes, valid Energon dataset."""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from megatron.energon import (
    Cooker, DefaultTaskEncoder, Sample, WorkerConfig, basic_sample_keys, edataclass, get_loader, get_val_dataset,
    reraise_exception, stateless,
)

from bridge.models.bagel.data.converter.convert import ConvertError, convert_edit, convert_group, convert_t2i, convert_vlm
from bridge.models.bagel.data.energon.layout import (
    EDIT, META_PART, SKIP_NOT_IN_PARQUET_INFO, SKIP_ROW_GROUP_BEYOND_INFO, SUBFLAVOR_KEY, T2I, VLM, image_index,
    load_manifest, sample_key,
)

# energon's prepare forks its indexing pool while pyarrow threads exist; harmless here
pytestmark = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")

RAW = Path(__file__).parent / "fixtures" / "bagel_readers" / "raw"
RAW_MANIFEST = json.loads((RAW / "manifest.json").read_text())


@edataclass
class PartsSample(Sample):
    """Test-local sample: the crude parts as raw bytes."""

    parts: dict


@stateless
def _cook(crude: dict) -> PartsSample:
    return PartsSample(**basic_sample_keys(crude), parts={k: v for k, v in crude.items() if not k.startswith("__")})


class PartsEncoder(DefaultTaskEncoder):
    decoder = None
    cookers = [Cooker(_cook)]


def read_energon(root: str) -> list[PartsSample]:
    """Read one sequential pass of a converted dataset through Energon's public API."""
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0, global_error_handler=reraise_exception)
    ds = get_val_dataset(root, split_part="train", worker_config=wc, batch_size=None, task_encoder=PartsEncoder())
    return list(get_loader(ds, watchdog_timeout_seconds=None))


def read_tars(root: str) -> dict[str, dict[str, bytes]]:
    """All samples of the shards, key -> {part: bytes}, in tar order (checked ascending)."""
    out: dict[str, dict[str, bytes]] = {}
    man = load_manifest(root)
    for sh in man["shards"]:
        with tarfile.open(os.path.join(root, sh["path"])) as tf:
            keys = set()
            for m in tf.getmembers():
                assert (m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) == (0, 0, 0, "", "", 0o644)
                key, part = m.name.split(".", 1)
                keys.add(key)
                out.setdefault(key, {})[part] = tf.extractfile(m).read()
            assert len(keys) == sh["count"]
    assert list(out) == [sample_key(i) for i in range(len(out))]
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("conv")
    s1 = convert_t2i(str(RAW / "t2i"), out, samples_per_shard=4, progress=False)
    s2 = convert_edit(str(RAW / "unified_edit"), str(RAW / "parquet_info" / "unified_edit.json"), out,
                      samples_per_shard=5, progress=False)
    s3 = convert_vlm(str(RAW / "vlm" / "vlm_sft.jsonl"), str(RAW / "vlm" / "images"), out, progress=False)
    return {T2I: s1, EDIT: s2, VLM: s3, "out": out}


def coordinate(man: dict, i: int) -> list[int]:
    """Official coordinate of sample ``i`` from the format-2 manifest arithmetic (files' first_sample/row_groups)."""
    if man["group"] == VLM:
        return [i]
    for f in man["files"]:
        if f["first_sample"] <= i < f["first_sample"] + f["num_samples"]:
            k = i - f["first_sample"]
            for g, n in enumerate(f["row_groups"]):
                if k < n:
                    return [f["file_index"], g, k]
                k -= n
    raise IndexError(i)


def _rows(group: str) -> list[dict]:
    return RAW_MANIFEST[group]["rows"]


def test_t2i_every_row_once_with_exact_bytes(converted):
    s = converted[T2I]
    assert (s.samples, s.shards, s.skipped) == (21, 8, {})  # shards per source file: 4+4 / 2 / 4+4 / 2+1
    tars = read_tars(s.path)
    man = load_manifest(s.path)
    assert man["num_samples"] == 21 and sum(f["num_samples"] for f in man["files"]) == 21
    assert [f["file"] for f in man["files"]] == [f"t2i/part-000{i}.parquet" for i in range(4)]  # .crc ignored
    seen = set()
    for i, (key, parts) in enumerate(tars.items()):
        meta = json.loads(parts[META_PART])
        src = meta["source"]
        assert meta["group"] == T2I and coordinate(man, i) == [src["file_index"], src["row_group"], src["row"]]
        pf = pq.ParquetFile(RAW / src["file"])
        row = pf.read_row_group(src["row_group"]).to_pylist()[src["row"]]
        assert pf.read().to_pylist()[src["file_row"]] == row
        assert meta["captions"] == row["captions"] and meta["image_null"] == (row["image"] is None)
        if row["image"] is None:
            assert set(parts) == {META_PART}
        else:
            assert set(parts) == {META_PART, "img0"} and parts["img0"] == row["image"]
        seen.add((src["file"], src["file_row"]))
    assert seen == {(r["file"], r["row_in_file"]) for r in _rows(T2I)}
    assert len(tars["00000003"]["img0"]) == 0  # empty bytes stay a zero-length member


def test_edit_official_rows_only(converted):
    s = converted[EDIT]
    assert s.samples == 13 and s.shards == 4  # shards per source file
    assert s.skipped == {SKIP_NOT_IN_PARQUET_INFO: 1, SKIP_ROW_GROUP_BEYOND_INFO: 1}
    man = load_manifest(s.path)
    assert man["parquet_info"] == {"unified_edit/shard-a.parquet": 2, "unified_edit/shard-b.parquet": 3,
                                   "unified_edit/shard-c.parquet": 2}
    assert sorted((x["file_index"], x["row_group"], x["rows"], x["reason"]) for x in man["skipped"]) == [
        (2, 2, 1, SKIP_ROW_GROUP_BEYOND_INFO), (3, 0, 1, SKIP_NOT_IN_PARQUET_INFO)]
    assert man["missing_row_groups"] == []
    tars = read_tars(s.path)
    for i, parts in enumerate(tars.values()):
        meta = json.loads(parts[META_PART])
        src = meta["source"]
        assert coordinate(man, i) == [src["file_index"], src["row_group"], src["row"]]
        row = pq.ParquetFile(RAW / src["file"]).read_row_group(src["row_group"]).to_pylist()[src["row"]]
        assert meta["instruction_list"] == row["instruction_list"] and meta["num_images"] == len(row["image_list"])
        imgs = {image_index(p): b for p, b in parts.items() if p != META_PART}
        assert imgs == {j: b for j, b in enumerate(row["image_list"]) if b is not None}
        assert meta["null_images"] == [j for j, b in enumerate(row["image_list"]) if b is None]
    # every declared, existing (file, row group) unit is covered
    units = {tuple(coordinate(man, i)[:2]) for i in range(man["num_samples"])}
    assert units == {(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1)}


def test_vlm_every_line_once(converted):
    s = converted[VLM]
    assert s.samples == 25 and s.skipped == {}
    assert any("missing/none.png" in w for w in s.warnings)
    # warnings number lines as editors do (1-based): the missing image is on line 18 of the jsonl
    assert [w.split(": image")[0] for w in s.warnings if "missing/none.png" in w] == ["vlm/vlm_sft.jsonl line 18"]
    man = load_manifest(s.path)
    assert man["files"][0]["first_sample"] == 0 and man["files"][0]["num_samples"] == 25 and man["num_lines"] == 25
    lines = (RAW / "vlm" / "vlm_sft.jsonl").open(encoding="utf-8").readlines()
    for i, parts in enumerate(read_tars(s.path).values()):
        meta = json.loads(parts[META_PART])
        assert meta["source"] == {"file": "vlm/vlm_sft.jsonl", "line": i} and meta["raw_line"] == lines[i]
        assert meta["image_dir"] == "vlm/images"
        try:
            rec = json.loads(lines[i])
        except ValueError:
            assert meta["image_names"] is None and set(parts) == {META_PART}
            continue
        names = rec.get("image", [])
        names = names if isinstance(names, list) else [names]
        assert meta["image_names"] == names
        for j, n in enumerate(names):
            p = RAW / "vlm" / "images" / n
            if p.exists():
                assert parts[f"img{j}"] == p.read_bytes()
            else:
                assert f"img{j}" not in parts
                assert meta["image_errors"][str(j)] == (
                    f"FileNotFoundError: [Errno 2] No such file or directory: 'vlm/images/{n}'")


def test_energon_reads_back_everything(converted):
    for group in (T2I, EDIT, VLM):
        root = converted[group].path
        tars = read_tars(root)
        got = read_energon(root)
        assert [x.__key__ for x in got] == list(tars)
        for x in got:
            assert x.__subflavors__ == {SUBFLAVOR_KEY: group}
            assert x.parts == tars[x.__key__]


def test_deterministic_bytes(converted, tmp_path):
    s = convert_t2i(str(RAW / "t2i"), tmp_path, samples_per_shard=4, progress=False)
    s2 = convert_vlm(str(RAW / "vlm" / "vlm_sft.jsonl"), str(RAW / "vlm" / "images"), tmp_path, progress=False)
    s3 = convert_edit(str(RAW / "unified_edit"), str(RAW / "parquet_info" / "unified_edit.json"), tmp_path,
                      samples_per_shard=5, progress=False)
    for new, old in ((s, converted[T2I]), (s2, converted[VLM]), (s3, converted[EDIT])):
        names = ["manifest.json"] + [sh["path"] for sh in load_manifest(new.path)["shards"]]
        match, mismatch, errors = filecmp.cmpfiles(new.path, old.path, names, shallow=False)
        assert mismatch == [] and errors == [] and len(match) == len(names)


def test_output_dir_not_empty(tmp_path, converted):
    (tmp_path / T2I / "t2i").mkdir(parents=True)
    (tmp_path / T2I / "t2i" / "junk").write_text("x")
    with pytest.raises(ConvertError, match="t2i.*not empty"):
        convert_t2i(str(RAW / "t2i"), tmp_path, progress=False)
    s = convert_t2i(str(RAW / "t2i"), tmp_path, progress=False, overwrite=True)
    assert s.samples == 21 and not (tmp_path / T2I / "t2i" / "junk").exists()
    assert not (tmp_path / T2I / "t2i.partial").exists()


def _t2i_dir(tmp_path: Path, table: pa.Table, name: str = "part.parquet") -> Path:
    d = tmp_path / "in"
    d.mkdir(exist_ok=True)
    pq.write_table(table, d / name)
    return d


def test_missing_column(tmp_path):
    d = _t2i_dir(tmp_path, pa.table({"image": pa.array([b"x"], pa.binary())}))
    with pytest.raises(ConvertError, match=r"part\.parquet.*missing required column 'captions'"):
        convert_t2i(str(d), tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / T2I / "in").exists()


def test_captions_the_reader_cannot_use_are_counted_at_conversion(tmp_path):
    """t2i rows whose captions are not a JSON object of strings are stored as they are (the reader drops them as
    ``bad_captions_json``) and now also counted, by reason, in the conversion's warnings."""
    good = (RAW / "t2i" / "part-0000.parquet")
    img = pq.read_table(good).column("image")[0].as_py()
    caps = [json.dumps({"a": "a red square"}), "plain text caption not json", json.dumps(["a list"])]
    d = _t2i_dir(tmp_path, pa.table({"image": pa.array([img] * 3, pa.binary()), "captions": pa.array(caps)}))
    s = convert_t2i(str(d), tmp_path / "out", progress=False)
    assert s.samples == 3
    [w] = [w for w in s.warnings if "can never become a training sample" in w]
    assert w.startswith("t2i_pretrain/in: 2 of 3 records can never become a training sample"), w
    assert "captions not JSON: 1" in w and "captions not a JSON object of strings: 1" in w, w
    (tmp_path / "b").mkdir()
    bad = _t2i_dir(tmp_path / "b", pa.table({"image": pa.array([img], pa.binary()), "captions": pa.array(["x"])}))
    with pytest.raises(ConvertError, match="none of the 1 records can become a training sample — captions not JSON"):
        convert_t2i(str(bad), tmp_path / "out2", progress=False)


def test_corrupt_parquet(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    good = (RAW / "t2i" / "part-0000.parquet").read_bytes()
    (d / "bad.parquet").write_bytes(good[: len(good) // 2])
    with pytest.raises(ConvertError, match=r"bad\.parquet.*unreadable parquet"):
        convert_t2i(str(d), tmp_path / "out", progress=False)


def test_missing_jsonl_and_missing_edit_column(tmp_path):
    with pytest.raises(ConvertError, match=r"nope\.jsonl.*does not exist"):
        convert_vlm(str(tmp_path / "nope.jsonl"), str(tmp_path), tmp_path / "out", progress=False)
    d = _t2i_dir(tmp_path, pa.table({"image_list": pa.array([[b"a", b"b"]], pa.list_(pa.binary()))}), "e.parquet")
    info = tmp_path / "info.json"
    info.write_text(json.dumps({"e.parquet": {"num_row_groups": 1}}))
    with pytest.raises(ConvertError, match=r"e\.parquet.*missing required column 'instruction_list'"):
        convert_edit(str(d), str(info), tmp_path / "out", parquet_info_root=str(d), progress=False)


def test_edit_missing_declared_row_group_and_info_root(tmp_path):
    """Keys relative to parquet_info_root match; a declared row group the file lacks is recorded, not fatal."""
    d = tmp_path / "edit"
    d.mkdir()
    shutil.copy(RAW / "unified_edit" / "shard-c.parquet", d / "c.parquet")
    info = tmp_path / "info.json"
    info.write_text(json.dumps({"c.parquet": {"num_row_groups": 5}}))
    s = convert_group(EDIT, tmp_path / "out", data_dir=str(d), parquet_info_path=str(info), parquet_info_root=str(d),
                      dataset_name="x", progress=False)
    man = load_manifest(s.path)
    assert s.samples == 3 and s.skipped == {}
    assert man["missing_row_groups"] == [{"file": "edit/c.parquet", "file_index": 0, "row_group": g} for g in (3, 4)]
    assert any("row group 3 does not exist" in w for w in s.warnings)


def test_convert_from_config_and_cli(tmp_path, monkeypatch, capsys):
    """Official dataset_info (paths relative to the working directory) + grouped YAML -> all groups, CLI table."""
    from bridge.models.bagel.data.tools.cli import main

    info = {T2I: {"golden_t2i": {"data_dir": "t2i", "num_files": 4}},
            EDIT: {"golden_edit": {"data_dir": "unified_edit", "parquet_info_path": "parquet_info/unified_edit.json"}},
            VLM: {"golden_vlm": {"data_dir": "vlm/images", "jsonl_path": "vlm/vlm_sft.jsonl"}}}
    groups = {g: {"dataset_names": list(info[g]), "weight": 1} for g in info}
    (tmp_path / "info.yaml").write_text(json.dumps(info))
    (tmp_path / "groups.yaml").write_text(json.dumps(groups))
    monkeypatch.chdir(RAW)  # like the official run: relative paths against the working directory
    rc = main(["convert", "config", "--dataset-info", str(tmp_path / "info.yaml"), "--groups",
               str(tmp_path / "groups.yaml"), "--out", str(tmp_path / "out"), "--no-progress"])
    table = capsys.readouterr().out
    assert rc == 0
    assert "unified_edit/golden_edit" in table and "file not in parquet_info: 1" in table
    assert table.splitlines()[-1].split()[:3] == ["TOTAL", "59", "8"]  # 4 t2i files + 3 edit files + 1 jsonl
    written = json.loads((tmp_path / "out" / "dataset_info.json").read_text())
    for g, names in info.items():
        for name in names:
            path = written[g][name]["energon_path"]
            assert path == str(tmp_path / "out" / g / name) and load_manifest(path)["dataset_name"] == name
    edit_man = load_manifest(written[EDIT]["golden_edit"]["energon_path"])
    assert edit_man["files"][0]["file"] == "unified_edit/shard-a.parquet" and edit_man["skipped"]
    # same conversion again: refused (exit 2, the path named), then accepted with --overwrite
    args = ["convert", "t2i", "--data-dir", "t2i", "--out", str(tmp_path / "out"), "--name", "golden_t2i"]
    assert main(args) == 2
    assert main(args + ["--overwrite", "--samples-per-shard", "10"]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines()]
    assert ["t2i_pretrain/golden_t2i", "21", "4"] in [r[:3] for r in rows]  # one shard per file (<= 10 rows)


def test_a_name_that_is_a_path_and_a_missing_image_dir_are_refused(tmp_path):
    """``--name ../x`` (or ``a/b``, ``.``) would write outside OUT/<group>/; a vlm ``--image-dir`` that does not
    exist would make every sample an error at read time: both are refused before anything is written."""
    for name in ("../evil", "a/b", ".", ".."):
        with pytest.raises(ConvertError, match=rf"dataset name {re.escape(repr(name))} is not a folder name"):
            convert_t2i(str(RAW / "t2i"), tmp_path / "out", dataset_name=name, progress=False)
    with pytest.raises(ConvertError, match=r"nope: image directory does not exist, and the jsonl names images below "
                                           r"it \(e.g. line \d+\): check --image-dir"):
        convert_vlm(str(RAW / "vlm" / "vlm_sft.jsonl"), str(tmp_path / "nope"), tmp_path / "out", progress=False)
    assert sorted(os.listdir(tmp_path)) == []
    text_only = tmp_path / "text.jsonl"  # nothing is read below the image dir: converted, with a warning
    turn = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    text_only.write_text(json.dumps({"conversations": turn}) + "\n")
    s = convert_vlm(str(text_only), str(tmp_path / "nope"), tmp_path / "out", progress=False)
    assert s.samples == 1 and any("no line names an image below it" in w for w in s.warnings), s.warnings


def test_verbose_after_the_subcommand_without_a_line_per_image(tmp_path, caplog):
    """``convert t2i ... -v`` is accepted (it was refused after the subcommand) and debug logging does not
    include PIL's lines for every image header the converter checks."""
    import logging

    from bridge.models.bagel.data.tools.cli import main

    logging.getLogger("PIL").setLevel(logging.NOTSET)  # as in a fresh process: PIL's DEBUG would pass
    with caplog.at_level(logging.DEBUG):
        assert main(["convert", "t2i", "--data-dir", str(RAW / "t2i"), "--out", str(tmp_path / "o"), "--no-progress",
                     "-v"]) == 0
    assert not [r for r in caplog.records if r.name.startswith("PIL")], caplog.text[-2000:]
    assert logging.getLogger("PIL").level == logging.NOTSET  # restored for an in-process caller


def test_convert_config_with_a_broken_yaml_is_one_line(tmp_path, caplog):
    """``convert config`` on a grouped YAML / dataset_info that does not parse: exit 2 and one error line naming
    the file, what it is, and line and column (not PyYAML's multi-line snippet); nothing is written."""
    from bridge.models.bagel.data.tools.cli import main

    good = tmp_path / "good.yaml"
    good.write_text(json.dumps({T2I: {"golden_t2i": {"data_dir": "t2i"}}}))
    broken = tmp_path / "broken.yaml"
    broken.write_text("t2i_pretrain:\n  dataset_names: [golden_t2i\n  weight: 1\n")
    for info, groups, what in ((good, broken, "grouped dataset YAML"), (broken, good, "dataset_info")):
        caplog.clear()
        rc = main(["convert", "config", "--dataset-info", str(info), "--groups", str(groups),
                   "--out", str(tmp_path / "out"), "--no-progress"])
        assert rc == 2
        [line] = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert line == (f"{broken}: {what} is not valid YAML: while parsing a flow sequence; expected ',' or ']', "
                        "but got ':' (line 3, column 9)"), line
        assert not (tmp_path / "out").exists()


def test_vlm_edge_records(tmp_path):
    """video, non-string names, a directory as image, CRLF line endings and a blank last line: one sample each."""
    img_dir = tmp_path / "imgs"
    (img_dir / "sub").mkdir(parents=True)
    (img_dir / "a.png").write_bytes(b"not really a png")
    recs = [{"id": 0, "video": "clip.mp4", "conversations": []},
            {"id": 1, "image": ["a.png", 7, "sub"], "conversations": []},
            {"id": 2, "image": "a.png", "conversations": []}]
    data = "\r\n".join(json.dumps(r) for r in recs) + "\r\n\n"
    (tmp_path / "x.jsonl").write_bytes(data.encode())
    s = convert_vlm(str(tmp_path / "x.jsonl"), str(img_dir), tmp_path / "out", source_root=str(tmp_path), progress=False)
    metas = [json.loads(p[META_PART]) for p in read_tars(s.path).values()]
    assert s.samples == 4 and [m["source"]["line"] for m in metas] == [0, 1, 2, 3]
    assert all(m["raw_line"].endswith("\n") and "\r" not in m["raw_line"] for m in metas)
    assert metas[0]["video"] == {"name": "clip.mp4", "folder": False, "num_frames": 0}  # missing: counted, no member
    assert metas[0]["image_errors"] == {"video": "FileNotFoundError: [Errno 2] No such file or directory: 'imgs/clip.mp4'"}
    assert metas[1]["image_names"] == ["a.png", 7, "sub"]
    assert metas[1]["image_errors"] == {
        "1": "TypeError: expected str, bytes or os.PathLike object, not int",
        "2": "IsADirectoryError: [Errno 21] Is a directory: 'imgs/sub'"}
    assert metas[2]["image_names"] == ["a.png"] and metas[3]["image_names"] is None and metas[3]["raw_line"] == "\n"
    parts = list(read_tars(s.path).values())
    assert parts[1]["img0"] == parts[2]["img0"] == b"not really a png" and "img1" not in parts[1]


def test_edit_null_entries(tmp_path):
    d = tmp_path / "e"
    d.mkdir()
    tbl = pa.table({"image_list": pa.array([[b"a", None, b"c"], None], pa.list_(pa.binary())),
                    "instruction_list": pa.array([[["x"], ["y", "z"]], None], pa.list_(pa.list_(pa.string())))})
    pq.write_table(tbl, d / "p.parquet")
    s = convert_group(EDIT, tmp_path / "out", data_dir=str(d), parquet_info={str(d / "p.parquet"): {"num_row_groups": 1}},
                      progress=False)
    parts = list(read_tars(s.path).values())
    m0, m1 = (json.loads(p[META_PART]) for p in parts)
    assert (m0["num_images"], m0["null_images"], m0["instruction_list"]) == (3, [1], [["x"], ["y", "z"]])
    assert set(parts[0]) == {META_PART, "img0", "img2"} and parts[0]["img2"] == b"c"
    assert (m1["num_images"], m1["null_images"], m1["instruction_list"], set(parts[1])) == (0, [], None, {META_PART})
