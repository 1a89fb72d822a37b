"""Manifest format 2: O(files) on disk and in memory, format 1 still read, damaged manifests named clearly.

* the exact vlm shuffle over a numpy array equals ``random.Random(seed).shuffle``;
* the selection runs computed from files equal a per-sample oracle written from the official rules;
* a format-1 manifest (one ``samples`` coordinate per row) is upgraded in memory to exactly the format 2 the
  converter writes, and a reader built on it selects the same ranges;
* a damaged manifest (invalid JSON, a missing key) gives one line naming the file, the dataset and the remedy,
  through the real loader builder (the groups YAML is not blamed);
* manifest load + selection runs of every group (default order) and the official units of t2i / edit stay
  within a fixed memory budget measured by tracemalloc: the same at 10^4 and 10^6 rows (no per-row objects).
"""

from __future__ import annotations

import collections
import json
import random
import shutil
import tracemalloc
from pathlib import Path

import pytest
import yaml

from bridge.models.bagel.data.build import build_bagel_train_loader
from bridge.models.bagel.data.config import BagelDataConfig, PackerConfig
from bridge.models.bagel.data.converter.convert import dumps_json
from bridge.models.bagel.data.energon.layout import (
    EDIT, MANIFEST_NAME, T2I, VLM, ManifestError, load_manifest, sample_of,
)
from bridge.models.bagel.data.energon.readers.official import official_units, shard_units
from bridge.models.bagel.data.energon.readers import GroupDatasets
from bridge.models.bagel.data.energon.readers.selection import manifest_runs, select_files, selection_runs, shuffled_range

pytestmark = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")

VAE = dict(max_image_size=1024, min_image_size=512, image_stride=16)
VIT = dict(max_image_size=518, min_image_size=224, image_stride=14)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 17, 1000, 65537])
def test_shuffled_range_is_the_official_shuffle(n):
    for seed in (0, 3, 42, 2**40 + 7):
        lines = list(range(n))
        random.Random(seed).shuffle(lines)
        assert shuffled_range(n, seed).tolist() == lines


def _synthetic(group: str, files: int, rows_per_file: int, row_groups: int = 2) -> dict:
    """A format-2 manifest as the converter writes it (no shards behind it: selection needs none)."""
    rg = [rows_per_file // row_groups] * (row_groups - 1)
    rg.append(rows_per_file - sum(rg))
    man = {"format": 2, "group": group, "dataset_name": f"syn_{group}", "source_root": "/src",
           "samples_per_shard": 1000, "skipped": []}
    if group == VLM:
        n = files * rows_per_file
        man.update(files=[{"file": "vlm/x.jsonl", "num_lines": n, "first_sample": 0, "num_samples": n}],
                   num_lines=n, num_samples=n, image_dir="vlm/images")
    else:
        entries, pos = [], 0
        for fi in range(files):
            e = {"file": f"d/part-{fi:05d}.parquet", "file_index": fi, "num_rows": rows_per_file, "row_groups": rg,
                 "first_sample": pos, "num_samples": rows_per_file}
            if group == EDIT:
                e["declared_row_groups"] = row_groups
            entries.append(e)
            pos += rows_per_file
        man.update(files=entries, num_samples=pos)
    shards, left = [], man["num_samples"]
    while left:
        shards.append({"path": f"shards/shard-{len(shards):06d}.tar", "count": min(left, 1000)})
        left -= shards[-1]["count"]
    man["shards"] = shards if len(shards) < 5000 else shards[:1]  # shard list: O(shards), not what is measured
    return man


def _oracle_runs(man: dict, n, shuffle_lines=False, seed=0):
    """Per-sample counts from the official rules (file repetition / first-n shuffled lines), as runs."""
    if man["group"] == VLM:
        lines = list(range(man["num_lines"]))
        if shuffle_lines:
            random.Random(seed).shuffle(lines)
        return selection_runs({i: 1 for i in (lines if n is None else lines[:n])})
    counts = collections.Counter()
    for f in (man["files"] if n is None else select_files(man["files"], n)):
        counts.update(range(f["first_sample"], f["first_sample"] + f["num_samples"]))
    return selection_runs(counts)


def test_runs_from_files_equal_the_per_sample_oracle():
    for group in (T2I, EDIT):
        man = _synthetic(group, 7, 5)
        man["files"][3]["num_samples"] = 0  # an edit file outside parquet_info stores nothing
        for f in man["files"][4:]:
            f["first_sample"] -= 5
        for n in (None, 0, 1, 3, 7, 8, 15, 22):
            assert manifest_runs(man, n) == _oracle_runs(man, n), (group, n)
    vlm = _synthetic(VLM, 1, 300)
    for n in (None, 0, 1, 150, 299, 300, 1000):
        for kw in ({}, dict(shuffle_lines=True, seed=5)):
            got = manifest_runs(vlm, n, shuffle_lines=bool(kw), shuffle_seed=kw.get("seed", 0))
            assert got == _oracle_runs(vlm, n, **kw), (n, kw)


def _as_format_1(man: dict) -> dict:
    """What the previous converter wrote for the same dataset: one coordinate per sample, one skip per row."""
    old = {k: v for k, v in man.items() if k != "files"}
    old["format"] = 1
    old["files"] = [{k: v for k, v in f.items() if k not in ("first_sample", "num_samples")} for f in man["files"]]
    if man["group"] == VLM:
        old["samples"] = [[i] for i in range(man["num_samples"])]
    else:
        old["samples"] = [[f["file_index"], g, r] for f in man["files"] for g, n in enumerate(f["row_groups"])
                          for r in range(n) if sample_of(f, g, r) < f["first_sample"] + f["num_samples"]]
    old["skipped"] = [{"coordinate": [x["file_index"], x["row_group"], r], "reason": x["reason"]}
                      for x in man["skipped"] for r in range(x["rows"])]
    return old


def test_format_1_manifest_is_upgraded_in_memory(converted, tmp_path, tokenizer, caplog):
    for rel, group in (("t2i_pretrain/t2i", T2I), ("unified_edit/unified_edit", EDIT), ("vlm_sft/vlm_sft", VLM)):
        new = load_manifest(converted / rel)
        old_dir = tmp_path / rel
        shutil.copytree(converted / rel, old_dir)
        (old_dir / MANIFEST_NAME).write_bytes(dumps_json(_as_format_1(new)) + b"\n")
        with caplog.at_level("WARNING"):
            assert load_manifest(old_dir) == new
        assert any("format 1 manifest" in r.getMessage() and str(old_dir) in r.getMessage() for r in caplog.records)
        if group == EDIT:
            assert new["skipped"] and all(x["rows"] == 1 for x in new["skipped"])
        runs = [GroupDatasets([str(p)], group).selection([3], group == VLM, 0) for p in (converted / rel, old_dir)]
        assert runs[0] == runs[1]


def test_format_1_with_unexpected_sample_order_is_refused(converted, tmp_path):
    d = tmp_path / "t2i"
    shutil.copytree(converted / "t2i_pretrain/t2i", d)
    old = _as_format_1(load_manifest(d))
    old["samples"][0], old["samples"][1] = old["samples"][1], old["samples"][0]
    (d / MANIFEST_NAME).write_bytes(dumps_json(old))
    with pytest.raises(ManifestError, match=r"not its rows in order.*bagel-data convert t2i"):
        load_manifest(d)


def _damaged_config(converted: Path, tmp_path: Path, text: str) -> tuple[BagelDataConfig, Path]:
    ds = tmp_path / "energon" / "t2i_pretrain" / "t2i"
    shutil.copytree(converted / "t2i_pretrain/t2i", ds)
    (ds / MANIFEST_NAME).write_text(text)
    groups = {T2I: {"dataset_names": ["t2i"], "image_transform_args": VAE, "is_mandatory": True,
                    "num_used_data": [4], "weight": 1}}
    (tmp_path / "groups.yaml").write_text(yaml.safe_dump(groups))
    (tmp_path / "info.yaml").write_text(yaml.safe_dump({T2I: {"t2i": {"data_dir": "t2i", "energon_path": str(ds)}}}))
    packer = PackerConfig(max_latent_size=64)
    return BagelDataConfig(groups=str(tmp_path / "groups.yaml"), dataset_info=str(tmp_path / "info.yaml"),
                           packer=packer), ds


@pytest.mark.parametrize("order", ["elastic", "official"])
@pytest.mark.parametrize("damage,cause", [
    ("invalid", r"invalid JSON: Expecting value: line 2 column 1"),
    ("no_files", r"missing key 'files'"),
    ("no_first_sample", r"missing key 'first_sample'"),
])
def test_damaged_manifest_is_one_line_naming_file_and_remedy(converted, tmp_path, tokenizer, order, damage, cause):
    good = load_manifest(converted / "t2i_pretrain/t2i")
    if damage == "invalid":
        text = "\n"  # a manifest cut short (e.g. a copy interrupted)
    elif damage == "no_files":
        text = json.dumps({k: v for k, v in good.items() if k != "files"})
    else:
        text = json.dumps(dict(good, files=[{k: v for k, v in f.items() if k != "first_sample"}
                                            for f in good["files"]]))
    config, ds = _damaged_config(converted, tmp_path, text)
    config.order, config.num_workers = order, 1
    with pytest.raises(ManifestError) as info:
        build_bagel_train_loader(config, tokenizer, (0, 1))
    msg = str(info.value)
    assert "\n" not in msg and len(msg) < 300, msg
    assert msg.startswith(f"{ds / MANIFEST_NAME}: dataset t2i_pretrain/t2i: unusable manifest ("), msg
    assert msg.endswith("convert it again: `bagel-data convert t2i ... --overwrite`") and "groups.yaml" not in msg
    import re

    assert re.search(cause, msg), msg


def _selection_peak(tmp_path: Path, files: int, rows_per_file: int) -> tuple[int, int]:
    """tracemalloc peak (bytes) of manifest load + selection runs of all three groups (default order, with and
    without num_used_data; vlm: the first 1000 lines, every line shuffled) + official units of t2i / edit, rank
    8191 of 8192. (A shuffled strict vlm subset is the one O(lines) case: see the next test.)"""
    paths = {}
    for group in (T2I, EDIT, VLM):
        d = tmp_path / f"{group}_{rows_per_file}"
        d.mkdir()
        (d / MANIFEST_NAME).write_bytes(dumps_json(_synthetic(group, files, rows_per_file)))
        paths[group] = d
    tracemalloc.start()
    try:
        rows = 0
        for group, d in paths.items():
            man = load_manifest(d)
            rows += man["num_samples"]
            used = (3 * files // 2, 10 * files) if group != VLM else (1000, man["num_samples"])
            for n in (None, *used):
                runs = manifest_runs(man, n, shuffle_lines=group == VLM and n != 1000, shuffle_seed=3)
                assert sum((e - s) * r for s, e, r in runs) > 0
            if group != VLM:
                units = official_units(group, [man], [None], [3 * files // 2])
                mine = shard_units(units, seed=42, rank=8191, world_size=8192, num_workers=1, worker_id=0)
                assert all(len(u.rows) for u in mine)
            del man
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, rows


@pytest.mark.serial  # tracemalloc counts every thread's allocations: threads left by other tests would count
def test_selection_memory_does_not_grow_with_rows(tmp_path):
    small, rows_small = _selection_peak(tmp_path, 1000, 10)        # 3 x 10^4 rows
    large, rows_large = _selection_peak(tmp_path, 1000, 1000)      # 3 x 10^6 rows
    assert rows_large == 100 * rows_small == 3_000_000
    assert large < 4 * 2**20, large                  # a few MB for 3 x 10^6 rows (format 1 needed > 300 MB)
    assert large < 1.2 * small + 64 * 2**10, (small, large)


def test_shuffled_vlm_subset_costs_four_bytes_per_line():
    """The one selection that needs every line: first n of the shuffled lines. It is one int32 numpy permutation
    (4 bytes per line, then freed), never a Python object per line."""
    peaks = {}
    for lines in (10**4, 10**6):
        man = _synthetic(VLM, 1, lines)
        tracemalloc.start()
        runs = manifest_runs(man, 1000, shuffle_lines=True, shuffle_seed=3)
        peaks[lines] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert sum(e - s for s, e, _ in runs) == 1000
    assert peaks[10**6] < 4 * 10**6 + 512 * 2**10, peaks


def test_a_dataset_staged_but_not_published_says_to_resume_or_merge(tmp_path):
    """No manifest yet, but the conversion's ``<name>.partial`` is there (a --part run without its merge, or a
    killed run): the remedy is to resume or merge, not to convert again with --overwrite."""
    ds = tmp_path / "energon" / "t2i_pretrain" / "t2i"
    (tmp_path / "energon" / "t2i_pretrain" / "t2i.partial" / ".convert").mkdir(parents=True)
    with pytest.raises(ManifestError) as info:
        load_manifest(ds)
    msg = str(info.value)
    assert msg == (f"{ds / MANIFEST_NAME}: dataset t2i_pretrain/t2i: unusable manifest (no such file); its "
                   f"conversion is staged in {ds}.partial, not published yet: rerun the conversion to resume it (a "
                   f"--part conversion: run every part, then `bagel-data convert merge --out {tmp_path / 'energon'}`)")
