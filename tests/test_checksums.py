"""Never train on silently corrupted data (issue 31): checksums from conversion to the packer.

Real converted datasets in a temp dir, read through the public builder (``build_bagel_train_loader``) in both
orders: ``elastic`` (the default) inline, in the rank's read pool (``num_workers``), with the prefetch producer and
with both; ``official`` with its emulated DataLoader workers:

- 16 bytes flipped inside a JPEG member (it still decodes, to wrong pixels) or one letter of a caption inside
  ``meta.json`` (still valid JSON): the sample is dropped as ``checksum_mismatch`` with one warning naming dataset,
  shard file and sample key; with ``data.verify_checksums: false`` it goes into the packs unnoticed (what the
  checksums are for);
- a byte flipped in the tar padding: harmless, nothing reported, the same batches as the undamaged dataset;
- too many damaged samples in one shard: the reader stops with one line naming the shard and the remedy;
- the elastic ledger counts the drop (exactly once holds) and resume stays exact;
- a dataset converted before checksums still loads, unverified, said once; a missing checksums file is one line;
- the recorded checksums are those of the bytes Energon reads; ``bagel-data verify`` names shards and samples and
  exits by outcome (parts and workers included).
The 2-rank ``torchrun`` job (every rank stops) is ``test_two_rank_job_stops_on_every_rank_naming_the_shard``.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image

from _warm_torchrun import warm_torchrun
from bridge.models.bagel.data.build import build_bagel_train_loader
from bridge.models.bagel.data.config import BagelDataConfig, PackerConfig
from bridge.models.bagel.data.converter.convert import convert_t2i
from bridge.models.bagel.data.energon.layout.checksums import ChecksumTable
from bridge.models.bagel.data.energon.readers.access import DatasetAccess
from bridge.models.bagel.data.energon.layout import (
    CHECKSUMS_KEY, CHECKSUMS_NAME, ManifestError, load_manifest, sample_checksum, write_manifest,
)
from bridge.models.bagel.data.errors import CorruptShardError
from bridge.models.bagel.data.packing.digest import batch_digest
from bridge.models.bagel.data.tools.cli import main

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]

SMALL = dict(expected_num_tokens=256, max_num_tokens=384, max_num_tokens_per_sample=256, prefer_buffer_before=128,
             use_flex=True)
T2I_ARGS = {"max_image_size": 256, "min_image_size": 32, "image_stride": 16}  # ~200 tokens: ~1 sample per pack
N = 8  # samples per test dataset, one shard


def _jpeg(i: int) -> bytes:
    """A small photo-like JPEG (smooth gradients + noise): 16 flipped bytes in its middle still decode."""
    rng = np.random.default_rng(i)
    arr = np.clip(np.cumsum(rng.random((176, 240, 3)) * 255, axis=1) // 24, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _dataset(root: Path, n: int = N, name: str = "t2i") -> Path:
    raw = root / "raw" / name
    raw.mkdir(parents=True)
    rows = [{"image": _jpeg(i), "captions": json.dumps({"c": f"a photo number {i}"})} for i in range(n)]
    pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema([("image", pa.binary()), ("captions", pa.string())])),
                   raw / "part-0000.parquet")
    return Path(convert_t2i(str(raw), root / "out", progress=False).path)


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    """One converted t2i dataset (8 samples in one shard); tests damage copies of it."""
    return _dataset(tmp_path_factory.mktemp("checksums"))


def _copy(clean: Path, root: Path) -> Path:
    ds = root / "out" / "t2i_pretrain" / "t2i"
    shutil.copytree(clean, ds)
    return ds


SHARD = "shards/shard-000000.tar"


def _member(ds: Path, key: str, part: str) -> tarfile.TarInfo:
    with tarfile.open(ds / SHARD) as tf:
        return next(m for m in tf.getmembers() if m.name == f"{key}.{part}")


def _damage(ds: Path, key: str, kind: str) -> None:
    """``image``: 16 bytes of the JPEG flipped; ``caption``: one letter of the caption in meta.json changed (valid
    JSON still); ``padding``: a byte of the tar padding after the sample's meta.json."""
    part = "img0" if kind == "image" else "meta.json"
    m = _member(ds, key, part)
    with open(ds / SHARD, "r+b") as f:
        f.seek(m.offset_data)
        data = bytearray(f.read(m.size))
        if kind == "image":
            mid = len(data) // 2
            data[mid:mid + 16] = bytes(b ^ 0xFF for b in data[mid:mid + 16])
        elif kind == "caption":
            at = data.index(b"photo")
            data[at:at + 5] = b"phOto"
            json.loads(bytes(data))  # still JSON: only a checksum can tell
        else:
            assert m.size % 512, "no padding after this member"
            f.seek(m.offset_data + m.size + 7)
            f.write(b"\xa5")
            return
        f.seek(m.offset_data)
        f.write(bytes(data))


def _config(root: Path, ds: Path, *, order: str = "elastic", workers: int = 0, prefetch: int = 0,
            verify: bool = True, **extra) -> BagelDataConfig:
    """The test dataset as group ``t2i_pretrain``; ``order``: ``data.order`` (official: at least 1 worker)."""
    official = {"num_used_data": [N]} if order == "official" else {}
    (root / "groups.yaml").write_text(yaml.safe_dump({"t2i_pretrain": {
        "dataset_names": ["d"], "weight": 1, "is_mandatory": True, "image_transform_args": T2I_ARGS, **official}}))
    (root / "dataset_info.yaml").write_text(yaml.safe_dump({"t2i_pretrain": {"d": {
        "data_dir": "unused", "energon_path": str(ds)}}}))
    return BagelDataConfig(groups=str(root / "groups.yaml"), dataset_info=str(root / "dataset_info.yaml"),
                           order=order, num_workers=max(workers, 1) if order == "official" else workers,
                           prefetch=prefetch, partitions=4, verify_checksums=verify,
                           packer=PackerConfig(**SMALL), **extra)


def _read_one_pass(cfg: BagelDataConfig, tok, dp: tuple[int, int] = (0, 1), n: int = N) -> tuple[dict, list[str]]:
    """Batches until every sample of this rank's share was read once: (the loader's stats, the batch digests)."""
    digests = []
    with build_bagel_train_loader(cfg, tok, dp, length=4) as loader:
        for _ in range(80):
            digests.append(batch_digest(next(loader)))
            stats = loader.stats()
            read = stats["consumed"]["t2i_pretrain"] + sum(stats["source_drops"]["t2i_pretrain"].values())
            if read >= n // dp[1]:
                break
    return stats, digests


#: (order, num_workers, prefetch): the elastic order inline, in the read pool, under the prefetch producer; the
#: official order (its emulated DataLoader workers read in the process that packs). Read pool and prefetch together:
#: the shard test below (a loader with both takes 10 s to close today: its producer does not stop in time).
MODES = [pytest.param("elastic", 0, 0, id="elastic-inline"),
         pytest.param("elastic", 2, 0, id="elastic-pool", marks=pytest.mark.slow),
         pytest.param("elastic", 0, 2, id="elastic-prefetch", marks=pytest.mark.slow),
         pytest.param("official", 1, 0, id="official")]


@pytest.mark.parametrize("order, workers, prefetch", MODES)
@pytest.mark.parametrize("kind", ["image", "caption"])
def test_a_damaged_member_is_dropped_and_named(clean, tmp_path, tokenizer, caplog, kind, order, workers, prefetch):
    ds = _copy(clean, tmp_path)
    _damage(ds, "00000003", kind)
    cfg = _config(tmp_path, ds, order=order, workers=workers, prefetch=prefetch)
    with caplog.at_level(logging.WARNING, logger="bridge.models.bagel.data"):
        stats, _ = _read_one_pass(cfg, tok=tokenizer)
    drops = stats["source_drops"]["t2i_pretrain"]  # every read of sample 3 (a pass may run into the next epoch)
    assert set(drops) == {"checksum_mismatch"} and drops == {r: n for r, n in stats["drops"].items()}, stats
    assert stats["consumed"]["t2i_pretrain"] >= N - 1
    if prefetch == 0:  # (with prefetch the reader, and its log lines, live in the producer process)
        lines = [r.getMessage() for r in caplog.records if "checksum_mismatch" in r.getMessage()]
        assert len(lines) == drops["checksum_mismatch"], lines  # one warning per dropped read
        for line in lines:
            assert "sample 00000003" in line and f"shard file {ds / SHARD}" in line and "dataset 't2i'" in line, line
            assert "re-copy the shard" in line and f"bagel-data verify {ds}" in line, line


@pytest.mark.parametrize("kind", ["image", "caption"])
def test_without_verification_the_damage_goes_into_the_packs_unnoticed(clean, tmp_path, tokenizer, kind):
    """What the checksums are for: the damaged JPEG still decodes and the changed caption is still JSON."""
    ds = _copy(clean, tmp_path)
    _damage(ds, "00000003", kind)
    stats, damaged = _read_one_pass(_config(tmp_path, ds, verify=False), tokenizer)
    assert stats["drops"] == {} and stats["consumed"]["t2i_pretrain"] == N
    (tmp_path / "good").mkdir()
    _, good = _read_one_pass(_config(tmp_path / "good", clean, verify=False), tokenizer)
    assert damaged != good  # the damaged bytes reached the batches


@pytest.mark.parametrize("order, workers, prefetch", MODES)
def test_a_flipped_byte_in_tar_padding_is_harmless(clean, tmp_path, tokenizer, order, workers, prefetch):
    ds = _copy(clean, tmp_path)
    _damage(ds, "00000003", "padding")
    stats, damaged = _read_one_pass(_config(tmp_path, ds, order=order, workers=workers, prefetch=prefetch), tokenizer)
    (tmp_path / "good").mkdir()
    _, good = _read_one_pass(_config(tmp_path / "good", clean, order=order, workers=workers, prefetch=prefetch),
                             tokenizer)
    assert stats["drops"] == {} and damaged == good


@pytest.mark.parametrize("order, workers, prefetch", [
    pytest.param("elastic", 0, 0, id="elastic-inline"),
    pytest.param("elastic", 2, 2, id="elastic-pool-prefetch", marks=pytest.mark.slow),
    pytest.param("official", 1, 0, id="official")])
def test_a_damaged_shard_stops_the_reader_naming_the_shard_and_the_remedy(clean, tmp_path, tokenizer, order,
                                                                          workers, prefetch):
    """More than 1 % of a shard's samples (at least 1: here the 2nd of 8) failing: the shard itself is damaged."""
    ds = _copy(clean, tmp_path)
    for key in ("00000002", "00000005", "00000006"):
        _damage(ds, key, "image")
    with pytest.raises(CorruptShardError) as err:
        _read_one_pass(_config(tmp_path, ds, order=order, workers=workers, prefetch=prefetch), tokenizer)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"damaged shard {ds / SHARD} (dataset 't2i'): 2 of its 8 samples "
                                                "failed their checksums on DP rank 0/1"), line
    assert "re-copy the shard" in line and "--overwrite" in line and f"bagel-data verify {ds}" in line, line
    assert err.value.brief.startswith(f"damaged shard {ds / SHARD}: 2 of its 8 samples"), err.value.brief


def test_elastic_drop_is_in_the_ledger_and_resume_is_exact(clean, tmp_path, tokenizer):
    from bridge.models.bagel.data.tools.ledger import check_exactly_once

    ds = _copy(clean, tmp_path)
    _damage(ds, "00000001", "caption")
    cfg = _config(tmp_path, ds, order="elastic")
    reads: list[dict] = []
    loaders = [build_bagel_train_loader(cfg, tokenizer, (r, 2), length=4) for r in range(2)]
    for ld in loaders:
        reads += [d for _ in range(3) for d in next(ld)["batch_data_indexes"]]
    states = [ld.save_state() for ld in loaders]
    after = [[batch_digest(next(ld)) for _ in range(3)] for ld in loaders]
    for ld in loaders:
        ld.close()
    again = [build_bagel_train_loader(cfg, tokenizer, (r, 2), length=4) for r in range(2)]
    for ld, st in zip(again, states):
        ld.restore_state(st)
    assert [[batch_digest(next(ld)) for _ in range(3)] for ld in again] == after  # resume is exact
    for ld in again:
        ld.close()
    one = build_bagel_train_loader(cfg, tokenizer, (0, 1), length=4)  # resized 2 -> 1
    one.restore_state(one.resize_states(states, 0, 1))
    for _ in range(6):
        reads += next(one)["batch_data_indexes"]
    report = check_exactly_once(reads, [one.save_state()])
    assert one.stats()["drops"].get("checksum_mismatch", 0) >= 1  # every read of sample 1, carried by new rank 0
    one.close()
    assert report.ok and report.epoch_complete and report.dropped >= 1, report


def _strip_checksums(ds: Path) -> None:
    """The dataset as the release before checksums wrote it (format 3, no checksums)."""
    man = {k: v for k, v in load_manifest(ds).items() if k != CHECKSUMS_KEY}
    man["shards"] = [{"path": sh["path"], "count": sh["count"]} for sh in man["shards"]]
    (ds / CHECKSUMS_NAME).unlink()
    write_manifest(ds, man)


def test_a_dataset_without_checksums_loads_unverified_said_once(clean, tmp_path, tokenizer, caplog):
    ds = _copy(clean, tmp_path)
    _strip_checksums(ds)
    _damage(ds, "00000003", "caption")
    with caplog.at_level(logging.WARNING, logger="bridge.models.bagel.data"):
        stats, _ = _read_one_pass(_config(tmp_path, ds), tokenizer)
    assert stats["drops"] == {} and stats["consumed"]["t2i_pretrain"] == N
    said = [r.getMessage() for r in caplog.records if "no checksums" in r.getMessage()]
    assert len(said) == 1 and str(ds) in said[0] and "not verified" in said[0] and "--overwrite" in said[0], said


def test_a_missing_checksums_file_is_one_line_at_build(clean, tmp_path, tokenizer):
    ds = _copy(clean, tmp_path)
    (ds / CHECKSUMS_NAME).unlink()
    with pytest.raises(ManifestError) as err:
        build_bagel_train_loader(_config(tmp_path, ds), tokenizer, (0, 1), length=4)
    line = str(err.value)
    assert "\n" not in line and f"{ds / 'manifest.json'}" in line and f"{CHECKSUMS_NAME}: no such file" in line, line
    assert "convert it again" in line, line


def test_recorded_checksums_are_those_of_the_bytes_energon_reads(converted):
    """Every shard's size and sha256, and every sample's checksum over the parts the readers hand ``cook_with``
    (``DatasetAccess``: Energon's random access, raw bytes), as recorded by the converter, for the three groups;
    a crude sample of another index is named as such."""
    import hashlib

    for ds in sorted(p for g in converted.iterdir() if g.is_dir() for p in g.iterdir()):
        man = load_manifest(ds)
        table = ChecksumTable.open(str(ds))
        assert table is not None and len(table.sums) == man["num_samples"] > 0
        for sh in man["shards"]:
            data = (ds / sh["path"]).read_bytes()
            assert (len(data), hashlib.sha256(data).hexdigest()) == (sh["bytes"], sh["sha256"])
        access = DatasetAccess(str(ds))
        try:
            for i in range(man["num_samples"]):
                crude = access.crude(i)
                parts = [(k, v) for k, v in crude.items() if not k.startswith("__")]
                assert parts and all(isinstance(v, bytes) for _, v in parts)
                assert sample_checksum(parts) == int(table.sums[i]), (ds.name, i)
                assert table.check(i, crude) is None
            other = table.check(0, access.crude(1))
            assert other is not None and "sample '00000001' read as sample 0" in other, other
        finally:
            access.close_files()


# -- bagel-data verify ----------------------------------------------------------------------------------------


def _verify(capsys, *args: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = main(["verify", "--no-progress", *args])
    return code, capsys.readouterr().out.splitlines()


def test_verify_names_shards_and_samples_and_exits_by_outcome(clean, tmp_path, capsys):
    out = tmp_path / "out"
    ds = _copy(clean, tmp_path)
    code, lines = _verify(capsys, str(out))
    assert code == 0 and lines[-1].endswith("bad_samples=0 harmless_shards=0 unverified_datasets=0 part=0/1 exit=0")
    _damage(ds, "00000002", "image")
    _damage(ds, "00000005", "caption")
    _damage(ds, "00000006", "padding")
    code, lines = _verify(capsys, str(ds))
    assert code == 1, lines
    bad = [x for x in lines if x.startswith("DAMAGED t2i_pretrain/t2i: shard")]
    assert [x.split(": sample ")[1][:8] for x in bad] == ["00000002", "00000005"], lines
    assert all(str(ds / SHARD) in x and "differ from the checksum" in x for x in bad), bad
    assert any(x.startswith(f"  remedy: re-copy {ds / SHARD}") for x in lines), lines
    assert "bad_samples=2" in lines[-1] and "damaged_shards=1" in lines[-1] and lines[-1].endswith("exit=1")

    pad = _copy(clean, tmp_path / "p")  # padding only: harmless
    _damage(pad, "00000006", "padding")
    code, lines = _verify(capsys, str(pad))
    assert code == 0 and "harmless_shards=1" in lines[-1] and not any(x.startswith("DAMAGED") for x in lines), lines
    assert any(x.startswith("note t2i_pretrain/t2i: shard") and "harmless" in x for x in lines), lines

    old = _copy(clean, tmp_path / "o")  # converted before checksums: only the damage checks, exit 3
    _strip_checksums(old)
    code, lines = _verify(capsys, str(old))
    assert code == 3 and any(x.startswith("NOT VERIFIED t2i_pretrain/t2i") for x in lines), lines
    code, lines = _verify(capsys, str(tmp_path / "nothing"))
    assert code == 2 and lines == []


@pytest.mark.parametrize("damage", ["missing", "short", "stale-index", "checksums-file"])
def test_verify_reports_what_the_damage_checks_find(clean, tmp_path, capsys, damage):
    ds = _copy(clean, tmp_path)
    tar = ds / SHARD
    if damage == "missing":
        tar.unlink()
    elif damage == "short":
        data = tar.read_bytes()
        tar.write_bytes(data[: len(data) // 2])
    elif damage == "stale-index":
        idx = np.fromfile(str(tar) + ".idx", dtype="<u8")
        idx[1:-1] += 512
        idx.tofile(str(tar) + ".idx")
    else:
        arr = np.load(ds / CHECKSUMS_NAME)
        arr[0] ^= 1
        np.save(ds / CHECKSUMS_NAME, arr)
    code, lines = _verify(capsys, str(ds))
    damaged = [x for x in lines if x.startswith("DAMAGED")]
    assert code == 1 and damaged, lines
    want = {"missing": f"shard {tar} of dataset {ds} is missing", "short": f"damaged shard {tar}: cut",
            "stale-index": f"damaged shard index {tar}.idx", "checksums-file": f"{ds / CHECKSUMS_NAME}: its sha256"}
    assert want[damage] in damaged[0], damaged


def test_verify_parts_and_workers_cover_every_shard_once(tmp_path, capsys):
    """Three datasets of 4 shards; 2 parts x 2 workers check every shard exactly once, and find the damage."""
    roots = []
    for k in range(3):
        raw = tmp_path / "raw" / f"d{k}"
        raw.mkdir(parents=True)
        rows = [{"image": _jpeg(i), "captions": json.dumps({"c": f"photo {i}"})} for i in range(8)]
        pq.write_table(pa.Table.from_pylist(rows), raw / "part-0000.parquet")
        roots.append(Path(convert_t2i(str(raw), tmp_path / "out", samples_per_shard=2, progress=False).path))
    m = [x for x in tarfile.open(roots[2] / "shards/shard-000003.tar").getmembers() if x.name.endswith("img0")][0]
    with open(roots[2] / "shards/shard-000003.tar", "r+b") as f:
        f.seek(m.offset_data + m.size // 2)
        f.write(b"\0" * 16)
    seen, codes = [], []
    for part in range(2):
        code, lines = _verify(capsys, str(tmp_path / "out"), "--workers", "2", "--part", str(part), "--num-parts", "2")
        codes.append(code)
        seen += [int(x.split("shards=")[1].split()[0]) for x in lines[-1:]]
        assert f"part={part}/2" in lines[-1]
    assert sum(seen) == 12 and 0 < seen[0] < 12 and sorted(codes) == [0, 1], (seen, codes)
    code, lines = _verify(capsys, str(tmp_path / "out"), "--workers", "2")
    assert code == 1 and "shards=12" in lines[-1] and "bad_samples=1" in lines[-1], lines
    assert any(f"{roots[2] / 'shards/shard-000003.tar'}: sample 00000006" in x for x in lines), lines


# -- the job ------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_rank_job_stops_on_every_rank_naming_the_shard(clean):
    """The job script under a 2-rank torchrun world (gloo), the default (elastic) order (the official order's stop
    is the same reader hook, tested in process above): every image of the shard damaged, so each rank meets more
    than its shard's limit; every rank ends with one line naming the shard and the remedy (each its own, or the
    other rank's through the job's agreement), after one warning per damaged sample read naming it."""
    root = Path(tempfile.mkdtemp(prefix="bagel-ck-"))  # a short path, as a user's
    try:
        ds = _copy(clean, root)
        for i in range(N):
            _damage(ds, f"{i:08d}", "image")
        cfg = _config(root, ds)
        proc = subprocess.run(
            warm_torchrun(2, [f"data.groups={cfg.groups}", f"data.dataset_info={cfg.dataset_info}",
                              *(f"data.packer.{k}={v}" for k, v in SMALL.items()),
                              "train.train_iters=12", "train.progress=false", "demo_data=null", "train.save=null"],
                          options=("--log-dir", str(root / "torchelastic"))),
            cwd=REPO, capture_output=True, text=True, timeout=240, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert proc.returncode != 0, proc.stderr[-3000:]
    lines = {x.split("]")[0]: x for x in proc.stderr.replace("\n  ", " ").splitlines() if x.startswith("error [rank")}
    assert sorted(lines) == ["error [rank 0", "error [rank 1"], proc.stderr[-3000:]
    for line in lines.values():
        assert "CorruptShardError" in line and f"damaged shard {ds / SHARD}" in line, line
    own = [x for x in lines.values() if "this rank was fine" not in x]
    assert own and all("re-copy the shard" in x and "failed their checksums" in x for x in own), own
    warned = [x for x in proc.stderr.splitlines() if "checksum_mismatch" in x and "WARNING" in x]
    assert warned and all(f"shard file {ds / SHARD}" in x and "sample 0000000" in x for x in warned), warned[:3]
