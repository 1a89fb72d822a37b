"""Parallel, partitioned, resumable conversion: same bytes for any workers/parts, after a kill, after a full disk.

Everything is compared file by file (shards, ``.tar.idx``, manifest, every ``.nv-meta`` file including
``index.sqlite``) against the serial run; the Energon index is also checked against what Energon's own
``prepare_dataset`` writes for the same shards.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import tarfile
import time
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bridge.models.bagel.data.converter.convert import (
    ConvertError, ConvertWriteError, convert_edit, convert_t2i, convert_vlm, merge_all, part_units,
)
from bridge.models.bagel.data.converter import units
from bridge.models.bagel.data.converter.units import IMAGE_EMPTY, IMAGE_OVER_LIMIT, IMAGE_UNREADABLE, tar_header
from bridge.models.bagel.data.energon.layout import EDIT, META_PART, T2I, VLM, load_manifest

pytestmark = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")

RAW = Path(__file__).parent / "fixtures" / "bagel_readers" / "raw"
REPO = Path(__file__).parent.parent


def tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` -> sha256 of its bytes."""
    out = {}
    for dp, _, fns in os.walk(root):
        for fn in fns:
            p = os.path.join(dp, fn)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _png(w: int, h: int, seed: int = 0) -> bytes:
    """A real (tiny, or header-declared huge) PNG: signature, IHDR, one IDAT, IEND."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    raw = b"".join(b"\0" + bytes([(seed + x) % 256 for x in range(w)]) for _ in range(h)) if w * h <= 4096 else b""
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def make_corpus(root: Path, files: int = 12, rows: int = 250, lines: int = 600) -> dict[str, Path]:
    """A few thousand t2i rows (2 row groups per file), an edit folder + parquet_info, a vlm jsonl + images."""
    t2i = root / "raw" / "t2i"
    t2i.mkdir(parents=True)
    imgs = [_png(8, 8, i) for i in range(7)]
    for fi in range(files):
        n = rows + fi % 3
        tbl = pa.table({"image": pa.array([imgs[(fi + r) % 7] for r in range(n)], pa.binary()),
                        "captions": pa.array([json.dumps({"c": f"file {fi} row {r}"}) for r in range(n)])})
        pq.write_table(tbl, t2i / f"part-{fi:04d}.parquet", row_group_size=(n + 1) // 2)
    edit = root / "raw" / "edit"
    edit.mkdir()
    info = {}
    for fi in range(4):
        tbl = pa.table({"image_list": pa.array([[imgs[r % 7], imgs[(r + 1) % 7]] for r in range(40)],
                                               pa.list_(pa.binary())),
                        "instruction_list": pa.array([[[f"do {r}"]] for r in range(40)],
                                                     pa.list_(pa.list_(pa.string())))})
        pq.write_table(tbl, edit / f"e-{fi}.parquet", row_group_size=10)
        info[str(edit / f"e-{fi}.parquet")] = {"num_row_groups": 3}
    (root / "raw" / "info.json").write_text(json.dumps(info))
    images = root / "raw" / "vlm" / "images"
    images.mkdir(parents=True)
    for i in range(7):
        (images / f"{i}.png").write_bytes(imgs[i])
    conv = [{"from": "human", "value": "<image> what?"}, {"from": "gpt", "value": "a square"}]
    (root / "raw" / "vlm" / "sft.jsonl").write_text(
        "".join(json.dumps({"image": f"{i % 7}.png", "conversations": conv}) + "\n" for i in range(lines)))
    return {"t2i": t2i, "edit": edit, "info": root / "raw" / "info.json",
            "jsonl": root / "raw" / "vlm" / "sft.jsonl", "images": images}


def convert_all(src: dict[str, Path], out: Path, **kw) -> None:
    convert_t2i(str(src["t2i"]), out, samples_per_shard=kw.pop("sps_t2i", 100), progress=False, **kw)
    convert_edit(str(src["edit"]), str(src["info"]), out, samples_per_shard=7, progress=False, **kw)
    convert_vlm(str(src["jsonl"]), str(src["images"]), out, samples_per_shard=64, progress=False, **kw)


GOLDEN = {"t2i": RAW / "t2i", "edit": RAW / "unified_edit", "info": RAW / "parquet_info" / "unified_edit.json",
          "jsonl": RAW / "vlm" / "vlm_sft.jsonl", "images": RAW / "vlm" / "images"}


def test_tar_header_is_what_tarfile_writes():
    for name, size in [("00000000.meta.json", 0), ("00000001.img0", 1), ("12345678.img12", 511),
                       ("99999999.meta.json", 512), ("x" * 99, 10 ** 9), ("x" * 120, 5), ("é.img0", 3)]:
        ti = tarfile.TarInfo(name)
        ti.size, ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = size, 0, 0o644, 0, 0, "", ""
        assert tar_header(name, size) == ti.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape"), name


def test_jpeg_header_fast_path_agrees_with_pil(monkeypatch):
    """The converter's own JPEG header walk (``units._jpeg_size``) gives PIL's verdict on every JPEG: PIL-written ones
    of every kind (baseline, progressive, grey, CMYK, Exif, ICC, comment, restart markers) and the same headers with
    1-3 bytes overwritten at random (it answers, or hands the image to PIL)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    kinds = [("RGB", {}), ("RGB", {"progressive": True}), ("L", {}), ("CMYK", {}), ("RGB", {"exif": Image.Exif()}),
             ("RGB", {"icc_profile": b"x" * 200}), ("RGB", {"comment": b"hi", "dpi": (300, 300)}),
             ("RGB", {"restart_marker_blocks": 2, "subsampling": 0})]
    cases = []
    for mode, kw in kinds:
        px = rng.integers(0, 255, (37, 53, {"L": 1, "CMYK": 4}.get(mode, 3)), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(px[..., 0] if mode == "L" else px, mode).save(buf, "JPEG", **kw)
        data = buf.getvalue()
        cases += [data, data[:2], data[:200], data[:600]]
        for _ in range(120):
            bad = bytearray(data[:700])
            for _ in range(int(rng.integers(1, 4))):
                bad[int(rng.integers(0, len(bad)))] = int(rng.integers(0, 256))
            cases.append(bytes(bad))
    fast = [units._jpeg_size(c) is not None for c in cases]
    got = [(units.image_problem(c, 10 ** 9), units.image_problem(c, 1000)) for c in cases]
    # t2i images reach the check as views into Arrow's buffers (formats.binary_values): the same verdicts
    views = [memoryview(pa.array([c]).buffers()[2] or b"").cast("B") for c in cases]
    assert [units._jpeg_size(v) for v in views] == [units._jpeg_size(c) for c in cases]
    assert [(units.image_problem(v, 10 ** 9), units.image_problem(v, 1000)) for v in views] == got
    monkeypatch.setattr(units, "_jpeg_size", lambda data: None)  # PIL alone
    want = [(units.image_problem(c, 10 ** 9), units.image_problem(c, 1000)) for c in cases]
    assert got == want
    assert sum(fast) > len(cases) // 2 and all(fast[i * 124] for i in range(len(kinds)) if i != 4)  # Exif: PIL's


def test_binary_values_are_the_column_values_without_copies():
    """``formats.binary_values`` gives what ``to_pylist`` gives (nulls, empty values, sliced and multi-chunk columns,
    32- and 64-bit offsets), as unsigned-byte views sharing Arrow's memory; other types fall back to ``to_pylist``."""
    from bridge.models.bagel.data.converter.formats import binary_values

    vals = [b"\xff\xd8\xffabc", None, b"", b"x" * 1000, None, b"\x00\x80"]
    for typ in (pa.binary(), pa.large_binary()):
        arr = pa.array(vals, typ)
        for col in (arr, arr.slice(1, 4), arr.slice(3), pa.chunked_array([arr.slice(0, 2), arr.slice(2)], typ)):
            got = binary_values(col)
            assert [None if v is None else bytes(v) for v in got] == col.to_pylist()
            views = [v for v in got if v is not None]
            assert views and all(isinstance(v, memoryview) and v.format == "B" for v in views)
        assert binary_values(arr)[0][0] == 0xFF  # indexes like bytes (Arrow's own buffer view is signed)
    for col in (pa.array(vals, pa.binary_view()), pa.nulls(3)):
        assert binary_values(col) == col.to_pylist()


def test_gathered_writes_hash_and_write_every_piece(tmp_path):
    """``units._Out.gather``: pieces of any size and kind (bytes, views, more than one ``writev`` takes), written in
    order with their sha256, the count of bytes written right."""
    import numpy as np

    rng = np.random.default_rng(1)
    pieces = [rng.bytes(int(rng.integers(0, 3000))) for _ in range(2000)] + [rng.bytes(700_000)]
    pieces = [memoryview(p) if i % 3 == 0 else p for i, p in enumerate(pieces)]
    out = units._Out(str(tmp_path / "f"), hashed=True)
    for i in range(0, len(pieces), 7):
        out.gather(pieces[i:i + 7])
    out.write(b"end")
    out.close()
    want = b"".join(bytes(p) for p in pieces) + b"end"
    assert (tmp_path / "f.tmp").read_bytes() == want and out.written == len(want)
    assert out.sha256.hexdigest() == hashlib.sha256(want).hexdigest()


def test_energon_index_is_what_prepare_dataset_writes(tmp_path):
    """.tar.idx, .info.json, split.yaml and the sqlite `samples` table equal Energon's own indexing."""
    from megatron.energon.flavors import BaseWebdatasetFactory

    s = convert_t2i(str(RAW / "t2i"), tmp_path / "out", samples_per_shard=4, progress=False)
    ref = tmp_path / "ref"
    shutil.copytree(s.path, ref)
    shutil.rmtree(ref / ".nv-meta")
    for p in ref.glob("shards/*.idx"):
        p.unlink()
    shards = [sh["path"] for sh in load_manifest(s.path)["shards"]]
    with contextlib.redirect_stdout(io.StringIO()):
        BaseWebdatasetFactory.prepare_dataset(ref, shards, split_parts_ratio=[("train", 1.0)], shuffle_seed=None,
                                              workers=1)
    mine = Path(s.path)
    for rel in [".nv-meta/.info.json", ".nv-meta/split.yaml"] + [p + ".idx" for p in shards]:
        assert (mine / rel).read_bytes() == (ref / rel).read_bytes(), rel
    q = "SELECT tar_file_id, sample_key, sample_index, byte_offset, byte_size FROM samples ORDER BY rowid"
    schema = "SELECT type, name, sql FROM sqlite_master WHERE tbl_name = 'samples' ORDER BY name"
    a, b = sqlite3.connect(mine / ".nv-meta" / "index.sqlite"), sqlite3.connect(ref / ".nv-meta" / "index.sqlite")
    assert a.execute(q).fetchall() == b.execute(q).fetchall() and len(a.execute(q).fetchall()) == 21
    assert a.execute(schema).fetchall() == b.execute(schema).fetchall()
    # only the index our readers use: no sample_parts table (lookups by full entry name)
    assert [r[0] for r in a.execute("SELECT name FROM sqlite_master WHERE type = 'table'")] == ["samples"]


def test_parts_are_disjoint_balanced_and_cover_everything(tmp_path):
    src = make_corpus(tmp_path, files=10, rows=50, lines=10)
    s = convert_t2i(str(src["t2i"]), tmp_path / "o", progress=False, part=0, num_parts=3)
    plan = json.loads((Path(s.path + ".partial") / ".convert" / "plan.json").read_text())
    parts = [part_units(plan, i, 3) for i in range(3)]
    assert sorted(sum(parts, [])) == list(range(10)) and all(parts)
    assert all(a[-1] < b[0] for a, b in zip(parts, parts[1:]))  # contiguous ranges
    with pytest.raises(ConvertError, match=rf"{10 - len(parts[0])} of 10 work units are not converted yet.*--part"):
        merge_all(tmp_path / "o")  # part 0 only
    with pytest.raises(ConvertError, match="--part 3 --num-parts 3"):
        convert_t2i(str(src["t2i"]), tmp_path / "o", progress=False, part=3, num_parts=3)


@pytest.mark.slow
@pytest.mark.parametrize("corpus", ["golden", "generated"])
def test_any_workers_or_parts_give_the_serial_bytes(tmp_path, corpus):
    src = GOLDEN if corpus == "golden" else make_corpus(tmp_path)
    kw = {"sps_t2i": 4} if corpus == "golden" else {}
    convert_all(src, tmp_path / "serial", **kw)
    ref = tree(tmp_path / "serial")
    assert len([p for p in ref if p.endswith(".tar")]) > 8 and all(".partial" not in p for p in ref)
    assert sum(p.endswith("/manifest.checksums.npy") for p in ref) == 3  # the checksums are among the bytes compared
    for workers in (2, 3):
        convert_all(src, tmp_path / f"w{workers}", workers=workers, **kw)
        assert tree(tmp_path / f"w{workers}") == ref, f"--workers {workers}"
    for k in (2, 3):
        out = tmp_path / f"parts{k}"
        for i in range(k):
            convert_all(src, out, part=i, num_parts=k, workers=2 if i == 0 else 1, **kw)
        assert all(p.name.endswith(".partial") for g in (T2I, EDIT, VLM) for p in (out / g).iterdir())  # unpublished
        merge_all(out)
        assert tree(out) == ref, f"{k} parts"


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "bridge.models.bagel.data.tools.cli", "convert", *args]


def _signal_after_first_unit(tmp_path: Path, sig: int) -> tuple[list[str], Path, Path, int, str, float]:
    """A 2-worker CLI conversion of a 6,000-row corpus (and its uninterrupted reference in ``tmp_path/ref``),
    sent ``sig`` (to its process group) once its first unit is done. Returns the CLI args, the output and work
    dirs, the exit code, stderr, and the seconds from the signal to the exit."""
    src = make_corpus(tmp_path, files=40, rows=150, lines=10)
    args = ["t2i", "--data-dir", str(src["t2i"]), "--samples-per-shard", "50", "--no-progress"]
    subprocess.run(_cli(*args, "--out", str(tmp_path / "ref")), check=True, cwd=REPO, capture_output=True)
    out = tmp_path / "out"
    work = out / T2I / "t2i.partial" / ".convert"
    proc = subprocess.Popen(_cli(*args, "--out", str(out), "--workers", "2"), cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (work.is_dir() and any(work.glob("unit-*.json"))):
        assert proc.poll() is None and time.monotonic() < deadline, "conversion ended before the first unit"
        time.sleep(0.002)
    os.killpg(proc.pid, sig)  # the CLI and its worker processes
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=120)
    return args, out, work, proc.returncode, err, time.monotonic() - t0


@pytest.mark.slow
def test_killed_conversion_resumes_with_the_same_bytes(tmp_path):
    args, out, work, _, _, _ = _signal_after_first_unit(tmp_path, signal.SIGKILL)
    done = len(list(work.glob("unit-*.json")))
    assert 0 < done < 40 and not (out / T2I / "t2i").exists()
    r = subprocess.run(_cli(*args, "--out", str(out), "--workers", "2"), cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "resuming" in r.stderr
    assert tree(out) == tree(tmp_path / "ref")


@pytest.fixture
def small_disk(tmp_path):
    """A 192 KiB tmpfs (needs root); yields (mount point, grow()) where grow() remounts it at 64 MiB."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mnt, lambda: subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True)
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


@pytest.mark.slow
def test_full_disk_stops_with_one_line_and_a_rerun_resumes(tmp_path, small_disk):
    mnt, grow = small_disk
    src = make_corpus(tmp_path, files=12, rows=250, lines=10)  # ~1.4 MB of shards
    args = ["t2i", "--data-dir", str(src["t2i"]), "--samples-per-shard", "100", "--no-progress", "--workers", "2"]
    subprocess.run(_cli(*args, "--out", str(tmp_path / "ref")), check=True, cwd=REPO, capture_output=True)
    r = subprocess.run(_cli(*args, "--out", str(mnt)), cwd=REPO, capture_output=True, text=True)
    errors = [ln for ln in r.stderr.splitlines() if " ERROR " in ln]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "No space left on device" in errors[0] and str(mnt / T2I / "t2i.partial") in errors[0]
    assert "bytes of that file" in errors[0] and "rerun the same command to resume" in errors[0]
    assert not (mnt / T2I / "t2i").exists()  # nothing published
    staged = mnt / T2I / "t2i.partial"
    assert not list(staged.rglob("*.tmp"))  # no half-written file left behind
    done = len(list((staged / ".convert").glob("unit-*.json")))
    grow()
    r = subprocess.run(_cli(*args, "--out", str(mnt)), cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert tree(mnt) == tree(tmp_path / "ref") and done < 12


def test_full_disk_in_process_raises_convert_write_error(tmp_path, small_disk):
    mnt, grow = small_disk
    src = make_corpus(tmp_path, files=12, rows=250, lines=10)
    with pytest.raises(ConvertWriteError) as e:
        convert_t2i(str(src["t2i"]), mnt, progress=False)
    assert "\n" not in str(e.value) and "No space left on device" in str(e.value)
    grow()
    s = convert_t2i(str(src["t2i"]), mnt, progress=False)
    ref = convert_t2i(str(src["t2i"]), tmp_path / "ref", progress=False)
    assert tree(Path(s.path)) == tree(Path(ref.path))


def test_bad_images_are_counted_by_reason_and_kept(tmp_path, capsys):
    from bridge.models.bagel.data.tools.cli import main

    d = tmp_path / "in"
    d.mkdir()
    images = [_png(8, 8), b"", _png(100_000, 100_000), b"not an image", _png(300, 300), None]
    pq.write_table(pa.table({"image": pa.array(images, pa.binary()),
                             "captions": pa.array([json.dumps({"c": str(i)}) for i in range(6)])}), d / "p.parquet")
    rc = main(["convert", "t2i", "--data-dir", str(d), "--out", str(tmp_path / "out"), "--no-progress",
               "--max-image-pixels", "50000"])
    table = capsys.readouterr().out
    assert rc == 0
    assert f"{IMAGE_EMPTY}: 1, {IMAGE_OVER_LIMIT}: 2, {IMAGE_UNREADABLE}: 1" in table.splitlines()[2]
    man = load_manifest(tmp_path / "out" / T2I / "in")
    assert man["image_checks"] == {"max_image_pixels": 50000, "problems": {
        IMAGE_EMPTY: 1, IMAGE_OVER_LIMIT: 2, IMAGE_UNREADABLE: 1}}
    with tarfile.open(tmp_path / "out" / T2I / "in" / man["shards"][0]["path"]) as tf:
        stored = {m.name: tf.extractfile(m).read() for m in tf.getmembers()}
    assert [stored.get(f"{i:08d}.img0") for i in range(6)] == images  # every sample, bytes unchanged
    assert all(f"{i:08d}.{META_PART}" in stored for i in range(6))
    # the default limit (PIL's MAX_IMAGE_PIXELS) counts only the 10^10-pixel header
    s = convert_t2i(str(d), tmp_path / "out2", progress=False)
    assert s.bad_images == {IMAGE_EMPTY: 1, IMAGE_OVER_LIMIT: 1, IMAGE_UNREADABLE: 1}


def test_a_run_killed_between_merge_and_publish_only_publishes(tmp_path):
    """The state a kill leaves after the merge dropped the work dir but before the rename: a rerun publishes it."""
    s = convert_t2i(str(RAW / "t2i"), tmp_path / "out", samples_per_shard=4, progress=False)
    ref = tree(Path(s.path))
    os.replace(s.path, s.path + ".partial")  # merged staging dir: manifest, no .convert
    again = convert_t2i(str(RAW / "t2i"), tmp_path / "out", samples_per_shard=4, progress=False)
    assert tree(Path(again.path)) == ref and not Path(s.path + ".partial").exists()
    assert (again.samples, again.shards) == (s.samples, s.shards)


def _mtimes(root: Path) -> dict[str, int]:
    return {os.path.relpath(os.path.join(dp, f), root): os.stat(os.path.join(dp, f)).st_mtime_ns
            for dp, _, fns in os.walk(root) for f in fns}


def test_a_finished_conversion_run_again_is_done_not_refused(tmp_path, capsys):
    """A rerun of a conversion that was published (a requeued array job, `convert config` resumed after a kill
    in a later group): nothing is rewritten and it exits 0, for any workers or part; changed sources or options
    are still refused without --overwrite."""
    from bridge.models.bagel.data.tools.cli import main

    src = make_corpus(tmp_path, files=6, rows=40, lines=10)
    out = tmp_path / "o"
    first = convert_t2i(str(src["t2i"]), out, samples_per_shard=50, progress=False)
    ref, stamps = tree(Path(first.path)), _mtimes(Path(first.path))
    for kw in ({}, {"workers": 2}, {"part": 1, "num_parts": 2}):
        again = convert_t2i(str(src["t2i"]), out, samples_per_shard=50, progress=False, **kw)
        assert again.status == "already converted", kw
        assert (again.samples, again.shards, again.bytes) == (first.samples, first.shards, first.bytes)
        assert tree(Path(first.path)) == ref and _mtimes(Path(first.path)) == stamps, kw  # nothing rewritten
    args = ["convert", "t2i", "--data-dir", str(src["t2i"]), "--out", str(out), "--samples-per-shard", "50",
            "--no-progress"]
    capsys.readouterr()
    assert main(args) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "t2i_pretrain/t2i: already converted"
    with pytest.raises(ConvertError, match="not empty and holds another conversion.*--overwrite"):
        convert_t2i(str(src["t2i"]), out, samples_per_shard=20, progress=False)  # other options
    part = src["t2i"] / "part-0000.parquet"
    os.utime(part, ns=(part.stat().st_atime_ns, part.stat().st_mtime_ns + 10**9))  # a source rewritten
    with pytest.raises(ConvertError, match="not empty and holds another conversion"):
        convert_t2i(str(src["t2i"]), out, samples_per_shard=50, progress=False)
    assert tree(Path(first.path)) == ref


def _as_published_by_an_earlier_release(ds: Path, plan: dict, release: str) -> None:
    """Rewrite the published dataset ``ds`` as an earlier release wrote it: no checksums (no
    ``manifest.checksums.npy``, no shard ``bytes`` / ``sha256``), plan format 1; ``format-2``: also the whole manifest
    as one JSON (no columns sidecar). Its ``.plan.sha256`` is of that release's plan."""
    from bridge.models.bagel.data.converter.formats import dumps_json
    from bridge.models.bagel.data.energon.layout import CHECKSUMS_KEY, CHECKSUMS_NAME, write_manifest

    man = {k: v for k, v in load_manifest(ds).items() if k != CHECKSUMS_KEY}
    man["shards"] = [{"path": sh["path"], "count": sh["count"]} for sh in man["shards"]]
    (ds / CHECKSUMS_NAME).unlink()
    old = {k: v for k, v in plan.items() if k != "checksums"}
    old["plan_format"] = 1
    if release == "format-2":
        (ds / "manifest.columns.npy").unlink()
        (ds / "manifest.json").write_bytes(dumps_json(dict(man, format=2)) + b"\n")
        old["manifest_format"] = 2
    else:
        write_manifest(ds, man)
    (ds / ".plan.sha256").write_text(hashlib.sha256(dumps_json(old)).hexdigest() + "\n")


@pytest.mark.parametrize("release, lacks", [("format-2", "manifest format 2"), ("format-3", "without checksums")])
def test_the_same_conversion_published_by_an_earlier_release_is_done_with_a_warning(tmp_path, caplog, release, lacks):
    """A dataset converted by an earlier release (manifest format 2, or format 3 before checksums; its plan recorded
    as that release made it): rerunning the same command after the upgrade (a requeued job) is done, exit 0, with a
    warning that says what it lacks and how to get it; nothing is rewritten. Other sources or options are still
    refused."""
    import logging

    src = make_corpus(tmp_path, files=4, rows=30, lines=10)
    out = tmp_path / "o"
    for part in range(2):  # a part conversion keeps its plan in the staging dir until the merge
        convert_t2i(str(src["t2i"]), out, samples_per_shard=50, progress=False, part=part, num_parts=2)
    staging = next((out / "t2i_pretrain").glob("*.partial"))
    plan = json.loads((staging / ".convert" / "plan.json").read_text())
    merge_all(str(out))
    ds = out / "t2i_pretrain" / staging.name.removesuffix(".partial")
    _as_published_by_an_earlier_release(ds, plan, release)
    ref = tree(ds)
    with caplog.at_level(logging.WARNING, logger="bridge.models.bagel.data.converter"):
        again = convert_t2i(str(src["t2i"]), out, samples_per_shard=50, progress=False)
    assert again.status == "already converted" and tree(ds) == ref
    warned = [r.getMessage() for r in caplog.records if "already converted" in r.getMessage()]
    assert len(warned) == 1 and lacks in warned[0] and "not verified" in warned[0] and "--overwrite" in warned[0]
    with pytest.raises(ConvertError, match="not empty and holds another conversion"):
        convert_t2i(str(src["t2i"]), out, samples_per_shard=20, progress=False)


def test_a_part_run_with_other_options_refuses_to_discard_the_other_parts_work(tmp_path):
    """Parts must share one plan: a part started with other options (or, for `convert config`, another working
    directory) is refused with the keys that differ, and the other parts' finished units stay; with
    --overwrite it starts over."""
    src = make_corpus(tmp_path, files=6, rows=40, lines=10)
    convert_t2i(str(src["t2i"]), tmp_path / "serial", samples_per_shard=50, progress=False)
    out = tmp_path / "o"
    s0 = convert_t2i(str(src["t2i"]), out, samples_per_shard=50, progress=False, part=0, num_parts=2)
    work = Path(s0.path + ".partial") / ".convert"
    units = sorted(p.name for p in work.glob("unit-*.json"))
    assert units
    with pytest.raises(ConvertError, match=r"staged work of a different conversion \(differs in: samples_per_shard\)"
                                           r".*every --part must use the same sources and options"):
        convert_t2i(str(src["t2i"]), out, samples_per_shard=20, progress=False, part=1, num_parts=2)
    assert sorted(p.name for p in work.glob("unit-*.json")) == units  # part 0's work kept
    convert_t2i(str(src["t2i"]), out, samples_per_shard=50, progress=False, part=1, num_parts=2)
    merge_all(out)
    assert tree(out) == tree(tmp_path / "serial")
    assert merge_all(out) == []  # a requeued merge job: nothing to do, not an error
    with pytest.raises(ConvertError, match="no staged conversion"):
        merge_all(tmp_path / "empty")
    shutil.rmtree(out)
    convert_t2i(str(src["t2i"]), out, samples_per_shard=50, progress=False, part=0, num_parts=2)
    s = convert_t2i(str(src["t2i"]), out, samples_per_shard=20, progress=False, part=1, num_parts=2, overwrite=True)
    assert s.status.startswith("part 1/2 done") and not [p for p in work.glob("unit-*.json") if p.name in units[:1]]


@pytest.mark.slow
def test_ctrl_c_stops_a_conversion_with_one_line_and_a_rerun_resumes(tmp_path):
    """SIGINT to the process group (Ctrl-C) during a 2-worker conversion: the workers stop at once, exit 130 and
    one error line, no traceback from the CLI or its workers; the rerun resumes and gives the bytes of an
    uninterrupted run."""
    args, out, _, rc, err, took = _signal_after_first_unit(tmp_path, signal.SIGINT)
    assert rc == 130, err[-3000:]
    assert "interrupted: stopping 2 converter worker processes" in err and took < 30, (took, err[-3000:])
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    [line] = [x for x in err.splitlines() if " ERROR " in x]
    assert line.endswith("interrupted; run the same command again: the conversion resumes where it stopped"), line
    assert not (out / T2I / "t2i").exists()
    r = subprocess.run(_cli(*args, "--out", str(out), "--workers", "2"), cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0 and "resuming" in r.stderr, r.stderr
    assert tree(out) == tree(tmp_path / "ref")


def test_a_rerun_is_done_only_for_an_intact_dataset_of_the_same_plan(tmp_path):
    """"Already converted" needs the same plan AND an intact dataset: a shard cut short or deleted since is
    refused with --overwrite as the remedy (not reported done); a vlm image added to the folder changes the plan;
    a merged-but-unpublished staging dir of another plan is converted again, not published as it is."""
    src = make_corpus(tmp_path, files=4, rows=30, lines=20)
    out = tmp_path / "o"
    s = convert_t2i(str(src["t2i"]), out, samples_per_shard=25, progress=False)
    shard = Path(s.path) / load_manifest(s.path)["shards"][0]["path"]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 3])  # inside the samples (a cut in the end padding loses nothing)
    with pytest.raises(ConvertError, match=r"the published dataset of this conversion is damaged \(shards/.*shorter "
                                           r"than its index .*\): pass --overwrite"):
        convert_t2i(str(src["t2i"]), out, samples_per_shard=25, progress=False)
    shard.unlink()
    with pytest.raises(ConvertError, match="is damaged .*No such file.*--overwrite"):
        convert_t2i(str(src["t2i"]), out, samples_per_shard=25, progress=False)
    again = convert_t2i(str(src["t2i"]), out, samples_per_shard=25, progress=False, overwrite=True)
    assert again.status == "published" and shard.read_bytes() == data
    v = convert_vlm(str(src["jsonl"]), str(src["images"]), out, samples_per_shard=8, progress=False)
    assert convert_vlm(str(src["jsonl"]), str(src["images"]), out, samples_per_shard=8,
                       progress=False).status == "already converted"
    (src["images"] / "new.png").write_bytes(_png(8, 8, 99))
    with pytest.raises(ConvertError, match="holds another conversion"):
        convert_vlm(str(src["jsonl"]), str(src["images"]), out, samples_per_shard=8, progress=False)
    # a merged staging dir (the publish was cut off) of another plan: redone with this plan, not published as is
    os.replace(v.path, v.path + ".partial")
    redone = convert_vlm(str(src["jsonl"]), str(src["images"]), out, samples_per_shard=5, progress=False)
    assert load_manifest(redone.path)["samples_per_shard"] == 5 and not Path(v.path + ".partial").exists()
