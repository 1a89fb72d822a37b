"""Manifest format 3 (issue 19): a small ``manifest.json`` header + the per-file / per-shard tables as numpy
columns in ``manifest.columns.npy``, so that a rank's start-up does not parse O(files) JSON.

* ``load_manifest`` of a freshly converted dataset is exactly the format-2 dict the converter built (the one the
  previous writer dumped as JSON), same keys, values and key order; ``write_manifest`` round-trips any table
  values (absent keys, None, unicode, ragged lists, other JSON) and is byte-deterministic;
* an old format-2 ``manifest.json`` is read identically by ``load_manifest`` and ``load_manifest_index``;
* ``manifest_runs`` of a ``ManifestIndex`` equals ``manifest_runs`` of the dict for t2i / edit / vlm and many n;
* a missing, cut-short or inconsistent sidecar is one ``ManifestError`` line naming the file, the dataset and the
  remedy, from both loaders;
* ``load_manifest_index`` of a 10^6-file manifest keeps O(1) Python objects: tracemalloc counts the same few
  dozen live blocks as at 10^3 files, and its peak is the int64 columns plus numpy temporaries (< 28 B / file).
"""

from __future__ import annotations

import gc
import hashlib
import io
import json
import re
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from bridge.models.bagel.data.converter.convert import (
    convert_edit, convert_t2i, convert_vlm, dumps_json, merge_all,
)
from bridge.models.bagel.data.converter.finalize import build_manifest, load_records
from bridge.models.bagel.data.converter.units import WORK_DIR
from bridge.models.bagel.data.energon.layout import (
    COLUMNS_NAME, EDIT, MANIFEST_FORMAT, MANIFEST_NAME, T2I, VLM, ManifestError, ManifestIndex, encode_manifest,
    load_manifest, load_manifest_index, write_manifest,
)
from bridge.models.bagel.data.energon.layout.columns import dumps_canonical
from bridge.models.bagel.data.energon.readers.selection import manifest_runs

pytestmark = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")

RAW = Path(__file__).parent / "fixtures" / "bagel_readers" / "raw"
RELS = {T2I: "t2i_pretrain/t2i", EDIT: "unified_edit/unified_edit", VLM: "vlm_sft/vlm_sft"}


def _assert_same_index(a: ManifestIndex, b: ManifestIndex) -> None:
    assert (a.group, a.num_samples, a.num_lines) == (b.group, b.num_samples, b.num_lines)
    for x, y in ((a.file_first_sample, b.file_first_sample), (a.file_num_samples, b.file_num_samples)):
        assert x.dtype == y.dtype == np.int64 and x.shape == y.shape and (x == y).all()
        assert not x.flags.writeable and not y.flags.writeable


def _ordered(obj) -> str:
    """The JSON text of ``obj`` in its own key order: equal texts = equal values, types and key order."""
    return json.dumps(obj, ensure_ascii=False)


def test_load_manifest_is_the_dict_the_converter_built(tmp_path):
    """Convert in two parts (the staged plan and unit records stay until the merge), compute the dict
    ``build_manifest`` makes of them, merge: ``load_manifest`` of the published format-3 dataset is that dict, as
    the format-2 writer's JSON would have loaded (same keys, values, key order)."""
    out = tmp_path / "out"
    for part in (0, 1):
        kw = dict(progress=False, part=part, num_parts=2)
        convert_t2i(str(RAW / "t2i"), out, samples_per_shard=4, **kw)
        convert_edit(str(RAW / "unified_edit"), str(RAW / "parquet_info" / "unified_edit.json"), out,
                     samples_per_shard=5, **kw)
        convert_vlm(str(RAW / "vlm" / "vlm_sft.jsonl"), str(RAW / "vlm" / "images"), out, samples_per_shard=10, **kw)
    built = {}
    for group, rel in RELS.items():
        staging = out / (rel + ".partial")
        plan = json.loads((staging / WORK_DIR / "plan.json").read_bytes())
        records, missing = load_records(str(staging), len(plan["units"]))
        assert not missing and len(records) > 1, (group, len(records))
        built[group] = build_manifest(plan, records)
    merge_all(out)
    for group, rel in RELS.items():
        man = load_manifest(out / rel)
        assert man == built[group] and man["format"] == MANIFEST_FORMAT == 3
        assert _ordered(man) == _ordered(json.loads(dumps_json(built[group])))  # what format 2 stored, loaded
        header = (out / rel / MANIFEST_NAME).read_bytes()
        head = json.loads(header)
        assert "files" not in head and "shards" not in head and "parquet_info" not in head
        assert (head["num_files"], head["num_shards"]) == (len(man["files"]), len(man["shards"]))
        assert head["columns"]["file"] == COLUMNS_NAME and len(header) < 2048
        columns = (out / rel / COLUMNS_NAME).read_bytes()
        assert columns.startswith(b"\x93NUMPY") and (header, columns) == encode_manifest(man)
        ix = load_manifest_index(out / rel)
        assert (ix.group, ix.num_samples, ix.num_lines, ix.root) == (group, man["num_samples"],
                                                                     man.get("num_lines", man["num_samples"]),
                                                                     str(out / rel))
        assert ix.file_first_sample.tolist() == [f["first_sample"] for f in man["files"]]
        assert ix.file_num_samples.tolist() == [f["num_samples"] for f in man["files"]]


def _odd_manifest(derivable: bool) -> dict:
    """An edit manifest whose tables hold every kind of value the columns encode: ints, None, absent keys,
    unicode (beyond the BMP, empty), ragged lists (empty too), floats / bools / objects (JSON text)."""
    files = [
        {"file": "d/ü😀.parquet", "file_index": 0, "num_rows": 3, "row_groups": [2, 1], "declared_row_groups": 2,
         "first_sample": 0, "num_samples": 3, "weight": 0.5, "note": None},
        {"file": "d/b.parquet", "file_index": 1, "num_rows": 0, "row_groups": [], "declared_row_groups": None,
         "first_sample": 3, "num_samples": 0, "weight": True, "extra": {"k": [1, "x"]}},
        {"file": "", "file_index": 2, "num_rows": 4, "row_groups": [4, 0, 2 ** 40], "declared_row_groups": 1,
         "first_sample": 3, "num_samples": 4, "weight": 7},
    ]
    info = {f["file"]: f["declared_row_groups"] for f in files if f["declared_row_groups"] is not None}
    return {"format": 3, "group": EDIT, "dataset_name": "odd", "source_root": "/src", "samples_per_shard": 3,
            "num_samples": 7, "files": files, "shards": [{"path": "shards/shard-000000.tar", "count": 7}],
            "skipped": [{"file_index": 1, "row_group": None, "rows": 0, "reason": "file not in parquet_info"},
                        {"file_index": 2, "row_group": 2, "rows": 2 ** 40, "reason": "row group beyond parquet_info"}],
            "missing_row_groups": [], "parquet_info": info if derivable else dict(info, **{"d/gone.parquet": 1}),
            "image_checks": {"max_image_pixels": 10, "problems": {"é": 1}}, "empty": [], "flag": False}


@pytest.mark.parametrize("derivable", [True, False])
def test_write_manifest_round_trips_every_value_kind(tmp_path, derivable):
    man = _odd_manifest(derivable)
    header = write_manifest(tmp_path, man)
    assert json.loads(header)["columns"]["derived"] == (["parquet_info"] if derivable else [])
    back = load_manifest(tmp_path)
    assert back == man and _ordered(back) == _ordered(json.loads(dumps_json(man)))
    # same dict in another key order: the same bytes (canonical header, sorted columns)
    shuffled = {k: ([dict(reversed(list(r.items()))) for r in v] if isinstance(v, list) else v)
                for k, v in reversed(list(man.items()))}
    assert encode_manifest(shuffled) == (header, (tmp_path / COLUMNS_NAME).read_bytes())
    # a format-3 header may hold its tables inline (as the damaged-manifest tests write it): read as format 2
    (tmp_path / MANIFEST_NAME).write_bytes(dumps_json(man))
    assert load_manifest(tmp_path) == man
    assert load_manifest_index(tmp_path).file_first_sample.tolist() == [0, 3, 3]


def test_an_old_format_2_manifest_is_read_identically(converted, tmp_path):
    for group, rel in RELS.items():
        new, ix3 = load_manifest(converted / rel), load_manifest_index(converted / rel)
        old = tmp_path / rel
        shutil.copytree(converted / rel, old)
        (old / COLUMNS_NAME).unlink()
        (old / MANIFEST_NAME).write_bytes(dumps_json({**new, "format": 2}) + b"\n")  # what format 2 wrote
        assert _ordered(load_manifest(old)) == _ordered({**new, "format": 2})
        ix2 = load_manifest_index(old)
        _assert_same_index(ix2, ix3)
        assert ix2.root == str(old) and ix3.root == str(converted / rel)
        for n in (None, 0, 1, 7, 100):
            assert manifest_runs(ix2, n) == manifest_runs(ix3, n) == manifest_runs(new, n)


def _n_values(files: int) -> list:
    return sorted({0, 1, 2, max(files - 1, 0), files, files + 1, 2 * files - 1, 3 * files, 1000 * files + 1,
                   10 ** 7 + 3}) + [None]


def test_runs_of_the_index_equal_runs_of_the_dict(converted):
    for group, rel in RELS.items():
        man, ix = load_manifest(converted / rel), load_manifest_index(converted / rel)
        kws = [{}]
        ns = _n_values(len(man["files"]))
        if group == VLM:
            kws += [dict(shuffle_lines=True, shuffle_seed=s) for s in (0, 3, 2 ** 40 + 7)]
            ns = sorted({0, 1, 5, 10, 24, 25, 26, 1000}) + [None]
        for n in ns:
            for kw in kws:
                runs = manifest_runs(ix, n, **kw)
                assert runs == manifest_runs(man, n, **kw), (group, n, kw)
                assert all(type(x) is int for run in runs for x in run)
                if n and group != VLM:
                    assert sum((e - s) * r for s, e, r in runs) > 0


def _rewrite_columns(ds: Path, replace: dict) -> None:
    """Replace arrays of the sidecar (``{(table, key, part): array}``), keeping the header's offsets, size and
    sha256 true to the new file: a sidecar that is well formed but holds inconsistent content."""
    head = json.loads((ds / MANIFEST_NAME).read_bytes())
    data = io.BytesIO((ds / COLUMNS_NAME).read_bytes())
    out = io.BytesIO()
    for entry in head["columns"]["arrays"]:
        data.seek(entry[3])
        a = np.load(data, allow_pickle=False)
        entry[3] = out.tell()
        np.save(out, replace.get(tuple(entry[:3]), a), allow_pickle=False)
    raw = out.getvalue()
    head["columns"].update(bytes=len(raw), sha256=hashlib.sha256(raw).hexdigest())
    (ds / COLUMNS_NAME).write_bytes(raw)
    (ds / MANIFEST_NAME).write_bytes(dumps_canonical(head) + b"\n")


def _damage(ds: Path, damage: str) -> None:
    side = ds / COLUMNS_NAME
    data = side.read_bytes()
    if damage == "missing":
        side.unlink()
    elif damage == "truncated":
        side.write_bytes(data[: len(data) // 2])
    elif damage == "last_byte_cut":
        side.write_bytes(data[:-1])
    elif damage == "shifted":
        _rewrite_columns(ds, {("files", "first_sample", "int"): np.array([0, 6, 10, 15], dtype="<i8")})
    elif damage == "wrong_dtype":
        _rewrite_columns(ds, {("files", "first_sample", "int"): np.array([0, 5, 10, 15], dtype="<i4")})
    elif damage == "wrong_length":
        _rewrite_columns(ds, {("files", "num_samples", "int"): np.array([5, 5, 5, 6, 0], dtype="<i8")})
    elif damage == "num_samples":
        head = json.loads((ds / MANIFEST_NAME).read_bytes())
        (ds / MANIFEST_NAME).write_bytes(dumps_canonical(dict(head, num_samples=head["num_samples"] + 1)))
    elif damage == "not_npy":  # same size, and the header's sha256 made to match: only the content is wrong
        side.write_bytes(b"x" * len(data))
        head = json.loads((ds / MANIFEST_NAME).read_bytes())
        head["columns"]["sha256"] = hashlib.sha256(b"x" * len(data)).hexdigest()
        (ds / MANIFEST_NAME).write_bytes(dumps_canonical(head))
    else:
        raise AssertionError(damage)


@pytest.mark.parametrize("damage,cause", [
    ("missing", rf"{COLUMNS_NAME}: no such file"),
    ("truncated", rf"{COLUMNS_NAME}: \d+ bytes, the header says \d+"),
    ("last_byte_cut", rf"{COLUMNS_NAME}: \d+ bytes, the header says \d+"),
    ("shifted", r"first_sample 6, .*expected.* 5"),
    ("wrong_dtype", rf"{COLUMNS_NAME}: files\.first_sample: <i4 \[4\], expected <i8 \[4\]"),
    ("wrong_length", rf"{COLUMNS_NAME}: files\.num_samples: <i8 \[5\], expected <i8 \[4\]"),
    ("num_samples", r"files hold 21 samples, num_samples is 22"),
    ("not_npy", rf"{COLUMNS_NAME}: files\.\w+: ValueError"),
])
def test_a_damaged_sidecar_is_one_line_naming_file_and_remedy(converted, tmp_path, damage, cause):
    ds = tmp_path / "energon" / "t2i_pretrain" / "t2i"
    shutil.copytree(converted / RELS[T2I], ds)
    assert load_manifest(ds)["num_samples"] == 21 and len(load_manifest(ds)["files"]) == 4
    _damage(ds, damage)
    for load in (load_manifest, load_manifest_index):
        with pytest.raises(ManifestError) as info:
            load(ds)
        msg = str(info.value)
        assert "\n" not in msg and len(msg) < 300, msg
        assert msg.startswith(f"{ds / MANIFEST_NAME}: dataset t2i_pretrain/t2i: unusable manifest ("), msg
        assert msg.endswith("convert it again: `bagel-data convert t2i ... --overwrite`"), msg
        assert re.search(cause, msg), (load.__name__, msg)
        assert info.value.cause in msg


def test_a_changed_byte_is_caught_by_the_full_load_not_the_index(converted, tmp_path):
    """The index reads two columns and checks their ranges, not the sidecar's hash (that would be O(bytes));
    ``load_manifest`` (converter reruns, stats, official order) checks the sha256 in the header."""
    ds = tmp_path / "energon" / "t2i_pretrain" / "t2i"
    shutil.copytree(converted / RELS[T2I], ds)
    good = load_manifest_index(ds)
    data = bytearray((ds / COLUMNS_NAME).read_bytes())
    head = json.loads((ds / MANIFEST_NAME).read_bytes())
    off = next(o for t, k, p, o in head["columns"]["arrays"] if (t, k, p) == ("files", "file", "str"))
    data[off + 140] ^= 0x01  # a character of a file name (the .npy header is 128 bytes)
    (ds / COLUMNS_NAME).write_bytes(bytes(data))
    with pytest.raises(ManifestError, match=rf"\({COLUMNS_NAME}: sha256 differs from the header's\)"):
        load_manifest(ds)
    _assert_same_index(load_manifest_index(ds), good)


def _files_manifest(files: int) -> dict:
    """A t2i manifest of ``files`` files of 10 rows (2 row groups), one shard per 100 files."""
    entries = [{"file": f"d/part-{fi:07d}.parquet", "file_index": fi, "num_rows": 10, "row_groups": [5, 5],
                "first_sample": 10 * fi, "num_samples": 10} for fi in range(files)]
    return {"format": 3, "group": T2I, "dataset_name": f"syn{files}", "source_root": "/src", "samples_per_shard": 1000,
            "skipped": [], "num_samples": 10 * files, "files": entries,
            "shards": [{"path": f"shards/shard-{i:06d}.tar", "count": 1000} for i in range(files // 100)]}


def _index_cost(d: Path, files: int) -> tuple[int, int]:
    """``(tracemalloc peak bytes, live blocks while the index is held)`` of ``load_manifest_index``."""
    man = _files_manifest(files)
    write_manifest(d, man)
    del man
    gc.collect()
    tracemalloc.start()
    try:
        ix = load_manifest_index(d)
        blocks = sum(s.count for s in tracemalloc.take_snapshot().statistics("filename"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (ix.num_files, ix.num_samples, int(ix.file_first_sample[-1])) == (files, 10 * files, 10 * files - 10)
    return peak, blocks


def test_index_of_a_million_files_holds_no_python_object_per_file(tmp_path):
    (tmp_path / "small").mkdir()
    (tmp_path / "large").mkdir()
    small_peak, small_blocks = _index_cost(tmp_path / "small", 10 ** 3)
    large_peak, large_blocks = _index_cost(tmp_path / "large", 10 ** 6)
    assert (tmp_path / "large" / MANIFEST_NAME).stat().st_size < 2048  # the header: O(1)
    assert small_blocks < 200 and abs(large_blocks - small_blocks) < 20, (small_blocks, large_blocks)
    assert small_peak < 2 ** 20, small_peak
    # two int64 columns (16 B / file) + one int64 and a few bool temporaries of the range check
    assert large_peak < 28 * 10 ** 6 + 2 ** 20, large_peak
