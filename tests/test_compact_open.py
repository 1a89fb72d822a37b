"""The Energon patches (``energon/patches``) against Energon itself: the numpy sharder returns Energon's slice offsets;
a converted dataset opened from its shard table gives Energon's factory (attributes, config), the same samples, restore
keys and loader config as Energon's own ``get_train_dataset``; datasets it does not recognise fall back to Energon; the
readers give the same batches through Energon's public path as through the patches, and an untested Energon version
selects the public path."""

from __future__ import annotations

import json
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset, reraise_exception
from megatron.energon.dataset_config import get_dataset_from_config
from megatron.energon.flavors.webdataset.metadata import WebdatasetMeta
from megatron.energon.flavors.webdataset.sharder import Sharder
from megatron.energon.flavors.webdataset.structs import DatasetSubset, ShardInfo
from megatron.energon.epathlib import EPath

from bridge.models.bagel.data.converter.convert import convert_t2i
from bridge.models.bagel.data.energon import patches
from bridge.models.bagel.data.energon.layout import load_manifest
from bridge.models.bagel.data.energon.patches import compact, sharding
from bridge.models.bagel.data.energon.readers.access import DatasetAccess, _CrudeEncoder

VAE = dict(max_image_size=64, min_image_size=32, image_stride=16)
N_ROWS = 47


@pytest.fixture(scope="module")
def tok(tokenizer):
    return tokenizer  # conftest's session tokenizer (BAGEL's special tokens added)


@pytest.fixture(scope="module")
def t2i(tmp_path_factory):
    """A converted t2i dataset of 47 rows in shards of <= 5 samples (so slices cross shard boundaries)."""
    import io

    from PIL import Image

    root = tmp_path_factory.mktemp("compact")
    raw = root / "raw" / "t2i"
    raw.mkdir(parents=True)
    for f in range(3):
        rows = []
        for i in range(f * 16, min(N_ROWS, (f + 1) * 16)):
            buf = io.BytesIO()
            Image.new("RGB", (20 + i % 7, 18), (i * 5 % 256, 40, 90)).save(buf, "PNG")
            rows.append({"image": buf.getvalue(), "captions": json.dumps({"a": f"caption {i}"})})
        pq.write_table(pa.Table.from_pylist(rows), raw / f"part-{f:04d}.parquet", row_group_size=4)
    return convert_t2i(str(raw), root / "out", samples_per_shard=5, progress=False).path


def _energon_shards(counts):
    return [ShardInfo(name=f"s{i}", path=None, count=c) for i, c in enumerate(counts)]


def test_sharder_equals_energons_on_random_layouts():
    rng = random.Random(0)
    for n in list(range(1, 200)) + [1000, 1023, 8192]:
        assert sharding.generalized_bit_reversal(n).tolist() == list(Sharder._generalized_bit_reversal(n)), n
    for _ in range(1500):
        counts = [rng.choice([0, 0, 1, 2, 3, 7, 50, 100, 149, 150, 151, 1000])
                  for _ in range(rng.choice([1, 2, 3, 5, 40]))]
        counts[0] = counts[0] or 5
        world = rng.choice([1, 2, 3, 4, 7, 16])
        wc = WorkerConfig(rank=rng.randrange(world), world_size=world, num_workers=rng.choice([0, 1, 2, 3]))
        msps, rot = rng.choice([None, 1, 2, 3, 10, 100]), rng.randrange(max(1, wc.num_workers) * world)
        total, r, subset = sum(counts), rng.random(), None
        if r < 0.3:
            a = rng.randrange(total + 1)
            subset = DatasetSubset(absolute_range=(a, rng.randrange(a, total + 1)), range=(0, 1))
        elif r < 0.4:
            subset = DatasetSubset(range=(0.25, 0.8))
        want = Sharder.shard_workers(_energon_shards(counts), wc, max_samples_per_sequence=msps, subset=subset,
                                     rotation_offset=rot)
        cumsum = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        got = sharding.shard_workers(cumsum, wc, max_samples_per_sequence=msps, subset=subset, rotation_offset=rot)
        assert got == tuple(map(tuple, want)), (counts, world, wc.rank, wc.num_workers, msps, rot, subset)
        assert all(type(x) is int for w in got for x in w)


@pytest.mark.parametrize("pattern", ["shards/shard-{000000..000123}.tar", "a{8..11}b", "a{08..11}b", "x{11..8}",
                                     "p{0..3}", "{007..9}", "a{1..3}{x,y}", "plain.tar", "a{b,c}d", "w%{1..2}"])
def test_brace_expansion_equals_braceexpand(pattern):
    import braceexpand

    assert compact.expand_braces(pattern) == list(braceexpand.braceexpand(pattern))


def test_shard_table_is_energons_shard_list(t2i):
    meta = WebdatasetMeta.from_config(path=EPath(t2i), split_part="train")
    table, excludes, split_files, info_files = compact.read_shard_table(t2i)
    assert len(table) == len(meta.shards) > 5 and list(table) == meta.shards
    assert table[-1] == meta.shards[-1] and table[2:4] == meta.shards[2:4]
    assert excludes == meta.sample_excludes and split_files == meta.split_part_files
    assert info_files == meta.info_shard_files and table.num_samples == N_ROWS
    last = meta.shards[-1]
    assert table.shard_of(0) == (0, 0) and table.shard_of(N_ROWS - 1) == (len(table) - 1, last.count - 1)
    for bad in (-1, N_ROWS):
        with pytest.raises(IndexError):
            table.shard_of(bad)


def test_factory_and_config_are_energons(t2i):
    wc = WorkerConfig(rank=1, world_size=3, num_workers=2)
    subset = DatasetSubset(absolute_range=(3, 41), range=(0, 1))
    kw = dict(training=True, split_part="train", worker_config=wc, shuffle_over_epochs=1, subset=subset,
              max_samples_per_sequence=4)
    theirs = get_dataset_from_config(EPath(t2i), **kw)
    yaml_kwargs, table = compact._crude_yaml(str(t2i)), compact.read_shard_table(str(t2i))
    ours = compact.CompactCrudeWebdataset(EPath(t2i), split_config="split.yaml", decoder=theirs._decoder,
                                          shard_table=table, **kw, **yaml_kwargs)
    assert isinstance(ours, type(theirs))
    skip = {"shards", "_sample_loader", "part_filter"}  # lambdas: equal by behaviour, not identity
    assert {k: v for k, v in vars(ours).items() if k not in skip} == {k: v for k, v in vars(theirs).items()
                                                                       if k not in skip}
    assert list(ours.shards) == theirs.shards and len(ours) == len(theirs) == N_ROWS
    assert ours.config() == theirs.config()  # machine paths (``_path``) included
    for rot in (0, 1, 4):
        assert ours.build(rot).config() == theirs.build(rot).config()


def _energon_dataset(root):
    """Energon's own ``get_train_dataset`` of what ``compact.open_dataset`` opens (one dataset whole, by index)."""
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0, global_error_handler=reraise_exception)
    return get_train_dataset(str(root), worker_config=wc, batch_size=None, shuffle_buffer_size=None,
                             max_samples_per_sequence=None, repeat=False, task_encoder=_CrudeEncoder())


def _same_crude(x, y):
    assert x["__key__"] == y["__key__"] and tuple(x["__restore_key__"]) == tuple(y["__restore_key__"])
    assert {k: v for k, v in x.items() if not k.startswith("__")} == {k: v for k, v in y.items()
                                                                      if not k.startswith("__")}


def test_open_dataset_gives_energons_samples_keys_and_config(t2i):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0, global_error_handler=reraise_exception)
    ours = get_savable_loader(compact.open_dataset(str(t2i), worker_config=wc, task_encoder=_CrudeEncoder()),
                              gc_collect_every_n_steps=0, watchdog_timeout_seconds=None)
    theirs = get_savable_loader(_energon_dataset(t2i), gc_collect_every_n_steps=0, watchdog_timeout_seconds=None)
    assert ours.config() == theirs.config()
    a, b = list(ours), list(theirs)  # one pass, Energon's slice order
    assert len(a) == len(b) == N_ROWS
    for x, y in zip(a, b):
        _same_crude(x, y)
    prefix = patches.restore_key_prefix(ours)
    assert prefix == tuple(a[0]["__restore_key__"])[:-1]  # the key the wrapper chain gives is Energon's
    for i in (0, 17, N_ROWS - 1):
        _same_crude(ours.restore_sample((*prefix, i)), theirs.restore_sample((*prefix, i)))


def test_public_path_and_patches_read_the_same_crude_samples(t2i):
    patched, public = DatasetAccess(str(t2i), patched=True), DatasetAccess(str(t2i), patched=False)
    for i in range(N_ROWS):
        _same_crude(patched.crude(i), public.crude(i))


def test_the_index_written_by_the_patches_is_energons_own(t2i, tmp_path):
    """``patches.index.write_index`` (the converter's index, from its own records) writes what Energon's public
    ``prepare_dataset`` writes for the same shards: the same ``.info.json``, ``split.yaml`` and sample rows (the public
    path's output on an untested Energon)."""
    import sqlite3

    from bridge.models.bagel.data.energon.patches.index import write_index

    t2i, public = Path(t2i), tmp_path / "public"
    shutil.copytree(t2i, public)
    shutil.rmtree(public / ".nv-meta")
    shards = [{"path": sh["path"], "count": sh["count"]} for sh in load_manifest(str(t2i))["shards"]]
    with patches.forced(False):
        write_index(str(public), shards, [])

    def rows(root):
        db = sqlite3.connect(root / ".nv-meta" / "index.sqlite")
        try:
            return db.execute("SELECT tar_file_id, sample_key, sample_index, byte_offset, byte_size FROM samples "
                              "ORDER BY rowid").fetchall()
        finally:
            db.close()

    for name in (".info.json", "split.yaml"):
        assert (public / ".nv-meta" / name).read_bytes() == (t2i / ".nv-meta" / name).read_bytes(), name
    assert rows(public) == rows(t2i) and len(rows(t2i)) == N_ROWS


def test_the_watchdog_names_an_energon_shard_through_the_patches(t2i):
    """``patches.shard_in_frame`` reads an Energon tar reader's ``tar_filepaths`` / ``tar_file_id`` (Energon 7.4's
    names), checked name by name, so it also names the shard on an untested Energon (the compatibility part's
    data-watch test on the oldest one); a frame without those names is no reader's: None."""
    shard = EPath(t2i) / "shards" / "shard-000000.tar"
    reader = type("ITarReaderLike", (), {"tar_filepaths": [shard], "base_path": EPath(t2i)})()
    pointer = type("Pointer", (), {"tar_file_id": 0})()
    assert patches.shard_in_frame({"self": reader, "tar_file_id": 0}) == (str(shard), str(EPath(t2i)))
    assert patches.shard_in_frame({"self": reader, "sample_pointer": pointer}) == (str(shard), str(EPath(t2i)))
    assert patches.shard_in_frame({"self": reader, "tar_file_id": 3}) is None
    with patches.forced(False):
        assert patches.shard_in_frame({"self": reader, "tar_file_id": 0}) == (str(shard), str(EPath(t2i)))
    other = type("OtherReader", (), {"paths": [shard]})()
    assert patches.shard_in_frame({"self": other, "tar_file_id": 0}) is None


def test_an_untested_energon_version_selects_the_public_path(monkeypatch, caplog):
    import logging

    import megatron.energon as energon

    assert patches.supported("7.4.1") and patches.supported("7.4") and not patches.supported("7.40.0")
    assert not patches.supported("7.5.0") and not patches.supported("8.0.0")
    monkeypatch.delenv(patches.ENV, raising=False)
    assert patches.active() is patches.supported(energon.__version__)
    monkeypatch.setattr(energon, "__version__", "7.99.0")
    with caplog.at_level(logging.INFO, logger="bridge.models.bagel.data.energon.patches"):
        assert patches.active() is False and patches.active() is False
    lines = [r.message for r in caplog.records if "public path" in r.message]
    assert len(lines) == 1 and "7.99.0" in lines[0] and "7.4.x" in lines[0]  # said once per process
    monkeypatch.setenv(patches.ENV, "1")
    assert patches.active() is True
    with patches.forced(False):
        assert patches.active() is False


@pytest.mark.parametrize("damage", ["excludes: [x]\n", "exclude: null\n", "count as str", "count as float",
                                    "info key", "middle name ./", "brace"])
def test_metadata_energon_refuses_is_left_to_energon(t2i, tmp_path, damage):
    """What Energon's strict parser refuses (or normalises) is not read here either: Energon opens it, and says."""
    import yaml

    other = tmp_path / "other"
    shutil.copytree(t2i, other)
    info_path, split_path = other / ".nv-meta" / ".info.json", other / ".nv-meta" / "split.yaml"
    info = json.loads(info_path.read_text())
    names = list(info["shard_counts"])
    if damage.startswith("exclude"):
        split_path.write_text(split_path.read_text() + damage)
    elif damage.startswith("count"):
        info["shard_counts"][names[1]] = "5" if damage.endswith("str") else 5.0
    elif damage == "info key":
        info["extra"] = 1
    elif damage == "middle name ./":
        info["shard_counts"] = {("./" + n if i == 1 else n): c for i, (n, c) in enumerate(info["shard_counts"].items())}
        split_path.write_text(yaml.safe_dump({"split_parts": {"train": list(info["shard_counts"])}, "exclude": []}))
    else:
        split_path.write_text(yaml.safe_dump({"split_parts": {"train": ["shards/shard-{000000..000003.tar"]}}))
    info_path.write_text(json.dumps(info))
    assert compact.read_shard_table(other) is None


def test_datasets_it_does_not_read_are_left_to_energon(t2i, tmp_path):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    other = tmp_path / "other"
    shutil.copytree(t2i, other)
    yaml_path = other / ".nv-meta" / "dataset.yaml"
    yaml_path.write_text(yaml_path.read_text() + "part_filter: [meta.json, img0]\n")
    assert compact.open_dataset(str(other), worker_config=wc, task_encoder=_CrudeEncoder()) is None
    access = DatasetAccess(str(other), patched=True)  # Energon opens it itself
    assert access.crude(3)["__key__"] == f"{3:08d}"
    (other / ".nv-meta" / ".info.json").unlink()
    assert compact.read_shard_table(other) is None


@pytest.mark.parametrize("edit", ["reversed", "excluded", "twice"])
def test_other_split_orders_and_excludes_read_as_energon_reads_them(t2i, tmp_path, edit):
    import yaml

    other = tmp_path / "other"
    shutil.copytree(t2i, other)
    names = list(json.loads((other / ".nv-meta" / ".info.json").read_text())["shard_counts"])
    split = {"split_parts": {"train": names[::-1]}, "exclude": []}
    if edit == "excluded":
        split = {"split_parts": {"train": names}, "exclude": [names[2], f"{names[0]}/00000001"]}
    elif edit == "twice":
        split = {"split_parts": {"train": names + names[:1]}, "exclude": []}
    (other / ".nv-meta" / "split.yaml").write_text(yaml.safe_dump(split))
    got = compact.read_shard_table(other)
    if edit == "twice":  # one tar id for two entries in Energon's reader: left to Energon
        assert got is None
        return
    meta = WebdatasetMeta.from_config(path=EPath(str(other)), split_part="train")
    table, excludes, split_files, _ = got
    assert list(table) == meta.shards and excludes == meta.sample_excludes and split_files == meta.split_part_files
    assert len(table) == len(names) - (edit == "excluded")


def test_loader_build_memory_is_flat_from_10_4_to_10_6_rows(tok, tmp_path):
    """The whole loader build (``build_bagel_train_loader``, the official YAML's ``num_used_data`` set, DP 1) over a
    10^6-row dataset (1000 shards, 1000 files: format-3 manifest, Energon index) allocates within a small fixed
    budget more than over 10^4 rows: tracemalloc peak growth < 2 bytes per added row, where one Python object per
    row would be >= 28. (Samples repeat one real shard, linked: what is measured only reads the index.)"""
    import sys
    import tracemalloc

    import yaml

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "scripts"))
    import bench_scale

    from bridge.models.bagel.data.build import build_bagel_train_loader
    from bridge.models.bagel.data.config import BagelDataConfig, PackerConfig

    raw = bench_scale.make_raw(str(tmp_path / "raw"), bench_scale.ROWS_PER_FILE)
    base = bench_scale.convert(raw, str(tmp_path / "conv"), workers=1)[0]
    peaks = {}
    for rows in (10**4, 10**6):
        ds = bench_scale.make_scaled(base, str(tmp_path / f"s{rows}" / "t2i_pretrain" / f"s{rows}"), rows)
        groups = {"t2i_pretrain": {"dataset_names": ["ds"], "image_transform_args": bench_scale.VAE,
                                   "is_mandatory": True, "num_used_data": [rows // 1000], "weight": 1}}
        (tmp_path / f"g{rows}.yaml").write_text(yaml.safe_dump(groups))
        (tmp_path / f"i{rows}.yaml").write_text(yaml.safe_dump({"t2i_pretrain": {"ds": {"data_dir": "t2i",
                                                                                         "energon_path": ds}}}))
        cfg = BagelDataConfig(groups=str(tmp_path / f"g{rows}.yaml"), dataset_info=str(tmp_path / f"i{rows}.yaml"),
                              packer=PackerConfig(expected_num_tokens=2048, max_num_tokens=4096,
                                                  max_num_tokens_per_sample=2048, prefer_buffer_before=1024,
                                                  max_latent_size=64))
        build_bagel_train_loader(cfg, tok, (0, 1), length=10).close()  # warm: imports, caches
        tracemalloc.start()
        try:
            loader = build_bagel_train_loader(cfg, tok, (0, 1), length=10)
            peaks[rows] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        loader.close()
    growth = peaks[10**6] - peaks[10**4]
    print(f"loader build tracemalloc peak: {peaks}, growth {growth} B")
    assert growth < 2 * (10**6 - 10**4), (peaks, growth)  # measured: 0.48 MB (0.5 B per row)


@pytest.mark.parametrize("names,plain", [(["shards/shard-000000.tar", "b.tar"], True), (["a/.hidden.tar"], True),
                                         (["/abs.tar"], False), (["a//b.tar"], False), (["a/"], False), ([""], False),
                                         (["./a.tar"], False), (["a/./b"], False), (["a/.."], False), ([".."], False),
                                         (["a\\b"], False), (["a\nb", "c"], False), (["a", "x/../y"], False)])
def test_plain_shard_names(names, plain):
    """Names whose ``EPath`` join is plain string concatenation (config's ``_path``); the rest go to Energon."""
    assert compact._plain_names(names) is plain


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_gives_the_same_batches_through_energons_public_path(demo_setup, workers):
    """Issue 30: the readers step aside for Energon's public path (forced here by the switch an untested Energon
    version throws) and the batches stay bit-identical."""
    from _external_common import assert_same, demo_loader

    out, tok = demo_setup
    batches = {}
    for patched in (True, False):
        with patches.forced(patched):
            with demo_loader(out, tok, workers, True) as loader:
                batches[patched] = [next(loader) for _ in range(3)]
    for a, b in zip(batches[True], batches[False]):
        assert_same(a, b)
