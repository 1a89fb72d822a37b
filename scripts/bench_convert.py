"""Converter throughput against the tar-write floor, measured in the same run on a synthetic t2i corpus.

Builds an official t2i_pretrain corpus (``files`` parquet files of 384-px JPEG rows with JSON captions), then
times, on the same files:

- the floor: one Python thread reads the same parquet columns (``image``, ``captions``) row group by row
  group and writes the same payload bytes into tar members with the standard ``tarfile`` (no meta JSON, no
  image check, no index, no manifest);
- the serial converter (``bagel-data convert t2i``, workers=1), ``--workers N``, and ``--part 0/1
  --num-parts 2`` (run one after the other in this process) + ``convert merge``.

Ratios: ``serial_ratio`` = converter MB/s / floor MB/s (output bytes, wall clock), ``serial_cpu_ratio`` the
same per CPU second (robust when other jobs share the cores), ``checksum_share`` = the seconds the converter's
checksums (every shard's sha256, every sample's XXH3) take on the serial output, measured apart, over the serial
conversion's CPU seconds (what recording them costs the converter), ``workersN_speedup`` = serial time / workers
time (the single-process vs N-worker ratio), ``workersN_superlinear`` = 1 when that speed-up is above what the
cores can give (N, or the core count if smaller, + 5 %): a finding (one process waits on something the workers
overlap), not a win; ``workersN_cpu_overhead`` = CPU seconds with workers / serial CPU seconds; ``load_avg`` says
how busy the machine was (a speed-up needs idle cores). With ``--runs R`` the floor, serial and workers runs are
repeated R times and every ratio is the median of the per-round ratios (a round's runs follow each other, so a
load change between rounds does not skew a ratio). Usage: ``python scripts/bench_convert.py [--quick | --large]
[--rows R] [--files F] [--workers N] [--runs R]`` (``--large``: the issue-size corpus, 20,000 rows of 384-px
JPEG in 40 files); last line ``bench_convert: rows=... runs=... floor_mb_s=... serial_ratio=...
workers2_speedup=... workers2_superlinear=... parts2_merge_s=... identical=...``. ``run(rows, files, workers,
tmp, runs)`` returns the same numbers as a dict (used by other benches).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import logging  # noqa: E402

logging.getLogger("bridge").setLevel(logging.ERROR)


def make_corpus(root: str, rows: int, files: int, px: int = 384, distinct: int = 24) -> str:
    """``files`` parquet files (2 row groups each) holding ``rows`` rows of ``px``-px JPEGs; returns the dir."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rng = np.random.default_rng(0)
    jpegs = []
    yy, xx = np.mgrid[0:px, 0:px]
    for i in range(distinct):
        base = np.stack([(xx * (i + 1)) % 256, (yy * (i + 2)) % 256, ((xx + yy) * (i + 3)) % 256], -1)
        img = np.clip(base + rng.normal(0, 24, base.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=90)
        jpegs.append(buf.getvalue())
    d = os.path.join(root, "t2i")
    os.makedirs(d)
    per = [rows // files + (1 if f < rows % files else 0) for f in range(files)]
    k = 0
    for f, n in enumerate(per):
        caps = [json.dumps({"caption": f"synthetic image {k + r} of the benchmark corpus, file {f}"}) for r in range(n)]
        tbl = pa.table({"image": pa.array([jpegs[(k + r) % distinct] for r in range(n)], pa.binary()),
                        "captions": pa.array(caps)})
        pq.write_table(tbl, os.path.join(d, f"part-{f:05d}.parquet"), row_group_size=max(1, (n + 1) // 2))
        k += n
    return d


def _cpu() -> float:
    """CPU seconds of this process and its reaped children (pool workers), user + system."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def floor(data_dir: str, out: str) -> tuple[float, int]:
    """Seconds and bytes for reading the columns and writing the same payloads as tar members (one thread)."""
    import pyarrow.parquet as pq

    os.makedirs(out)
    t0, total = time.perf_counter(), 0
    for n, name in enumerate(sorted(os.listdir(data_dir))):
        pf = pq.ParquetFile(os.path.join(data_dir, name))
        path = os.path.join(out, f"{n:06d}.tar")
        with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
            k = 0
            for g in range(pf.metadata.num_row_groups):
                tbl = pf.read_row_group(g, columns=["image", "captions"])
                for img, cap in zip(tbl.column("image").to_pylist(), tbl.column("captions").to_pylist()):
                    for part, data in ((f"{k:08d}.meta.json", cap.encode()), (f"{k:08d}.img0", img)):
                        ti = tarfile.TarInfo(part)
                        ti.size = len(data)
                        tf.addfile(ti, io.BytesIO(data))
                    k += 1
        total += os.path.getsize(path)
    return time.perf_counter() - t0, total


def checksum_seconds(root: str) -> float:
    """Seconds the converter's checksums take over a converted tree (measured apart, in this process): the sha256
    of every shard and ``layout.sample_checksum`` of every sample's members, on bytes already in memory."""
    import hashlib

    from bridge.models.bagel.data.energon.layout import sample_checksum

    shards, samples = [], []
    for dp, _, fns in os.walk(root):
        for fn in sorted(fns):
            if fn.endswith(".tar"):
                with open(os.path.join(dp, fn), "rb") as f:
                    shards.append(f.read())
                with tarfile.open(os.path.join(dp, fn)) as tf:
                    parts: dict[str, list] = {}
                    for m in tf.getmembers():
                        key, part = m.name.split(".", 1)
                        parts.setdefault(key, []).append((part, tf.extractfile(m).read()))
                    samples += parts.values()
    t0 = time.perf_counter()
    for data in shards:
        hashlib.sha256(data).hexdigest()
    for parts in samples:
        sample_checksum(parts)
    return time.perf_counter() - t0


def _digest_and_remove(root: str) -> dict[str, str]:
    """sha256 of every file under ``root`` (then ``root`` is removed, to keep the disk/RAM footprint small)."""
    import hashlib

    out = {}
    for dp, _, fns in os.walk(root):
        for fn in fns:
            with open(os.path.join(dp, fn), "rb") as f:
                out[os.path.relpath(os.path.join(dp, fn), root)] = hashlib.sha256(f.read()).hexdigest()
    shutil.rmtree(root)
    return out


def _round(data_dir: str, root: str, workers: int) -> dict[str, Any]:
    """One timed round on ``data_dir``: the floor, the serial conversion, ``--workers N``; byte identity checked.
    Wall seconds and CPU seconds (this process and its workers) of each, and the serial checksums' seconds."""
    from bridge.models.bagel.data.converter.convert import convert_t2i

    load0 = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), _cpu()
    t_floor, floor_bytes = floor(data_dir, os.path.join(root, "floor"))
    c_floor = _cpu() - c0
    shutil.rmtree(os.path.join(root, "floor"))
    t0, c0 = time.perf_counter(), _cpu()
    s = convert_t2i(data_dir, os.path.join(root, "serial"), progress=False)
    t_serial, c_serial = time.perf_counter() - t0, _cpu() - c0
    t_checksums = checksum_seconds(os.path.join(root, "serial"))
    ref = _digest_and_remove(os.path.join(root, "serial"))
    t0, c0 = time.perf_counter(), _cpu()
    convert_t2i(data_dir, os.path.join(root, "workers"), progress=False, workers=workers)
    t_workers, c_workers = time.perf_counter() - t0, _cpu() - c0
    identical = ref == _digest_and_remove(os.path.join(root, "workers"))
    return {"floor_s": t_floor, "floor_bytes": floor_bytes, "floor_cpu": c_floor, "serial_s": t_serial,
            "serial_cpu": c_serial, "serial_bytes": s.bytes, "samples": s.samples, "checksum_s": t_checksums,
            "workers_s": t_workers, "workers_cpu": c_workers, "identical": identical, "ref": ref,
            "load": max(load0, os.getloadavg()[0])}


def run(rows: int = 4000, files: int = 40, workers: int = 2, tmp: str | None = None,
        runs: int = 1) -> dict[str, Any]:
    """Build the corpus and measure floor / serial / workers (``runs`` rounds, medians of the per-round ratios:
    each ratio compares runs of the same round) and parts + merge once; returns the numbers as a dict."""
    from bridge.models.bagel.data.converter.convert import convert_t2i, merge_all

    root = tempfile.mkdtemp(prefix="bench_convert_", dir=tmp)
    try:
        data_dir = make_corpus(os.path.join(root, "raw"), rows, files)
        src_mb = sum(os.path.getsize(os.path.join(data_dir, n)) for n in os.listdir(data_dir)) / 1e6
        floor(data_dir, os.path.join(root, "warm"))  # page cache warm for everyone
        warm = make_corpus(os.path.join(root, "raw_warm"), 8, 1, px=32, distinct=2)
        convert_t2i(warm, os.path.join(root, "warm_conv"), progress=False)  # imports (energon, PIL) warm
        shutil.rmtree(os.path.join(root, "warm"))
        rounds = [_round(data_dir, root, workers) for _ in range(max(1, runs))]
        ref = rounds[0]["ref"]
        t0 = time.perf_counter()
        for part in range(2):
            convert_t2i(data_dir, os.path.join(root, "parts"), progress=False, part=part, num_parts=2)
        t_parts = time.perf_counter() - t0
        t0 = time.perf_counter()
        merge_all(os.path.join(root, "parts"))
        t_merge = time.perf_counter() - t0
        identical = all(r["identical"] and r["ref"] == ref for r in rounds)
        identical = identical and ref == _digest_and_remove(os.path.join(root, "parts"))

        def med(f: Any) -> float:
            return statistics.median(f(r) for r in rounds)

        floor_mb_s = med(lambda r: r["floor_bytes"] / 1e6 / r["floor_s"])
        conv_mb_s = med(lambda r: r["serial_bytes"] / 1e6 / r["serial_s"])
        speedup = med(lambda r: r["serial_s"] / r["workers_s"])
        cores = len(os.sched_getaffinity(0))
        return {"rows": rounds[0]["samples"], "files": files, "runs": len(rounds), "source_mb": round(src_mb, 1),
                "floor_s": round(med(lambda r: r["floor_s"]), 3), "floor_mb_s": round(floor_mb_s, 1),
                "serial_s": round(med(lambda r: r["serial_s"]), 3),
                "serial_rows_s": round(med(lambda r: r["samples"] / r["serial_s"])),
                "serial_mb_s": round(conv_mb_s, 1),
                "serial_ratio": round(med(lambda r: (r["serial_bytes"] / r["serial_s"]) /
                                                    (r["floor_bytes"] / r["floor_s"])), 3),
                "serial_cpu_ratio": round(med(lambda r: (r["serial_bytes"] / r["serial_cpu"]) /
                                                        (r["floor_bytes"] / r["floor_cpu"])), 3),
                "checksum_s": round(med(lambda r: r["checksum_s"]), 3),
                "checksum_share": round(med(lambda r: r["checksum_s"] / r["serial_cpu"]), 3),
                f"workers{workers}_s": round(med(lambda r: r["workers_s"]), 3),
                f"workers{workers}_cpu_overhead": round(med(lambda r: r["workers_cpu"] / r["serial_cpu"]), 3),
                f"workers{workers}_speedup": round(speedup, 3),
                # more than the cores can give (5 % slack): one process waits on something workers overlap
                f"workers{workers}_superlinear": int(speedup > min(workers, cores) * 1.05),
                "parts2_s": round(t_parts, 3), "parts2_merge_s": round(t_merge, 3), "identical": identical,
                "cores": cores, "load_avg": round(max(r["load"] for r in rounds), 1)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


#: The issue's input (``--large``): 20,000 rows of 384-px JPEG in 40 parquet files (~600 MB of shards).
LARGE = (20_000, 40)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny corpus (CI): 480 rows in 8 files, one round")
    p.add_argument("--large", action="store_true",
                   help=f"the issue-size corpus: {LARGE[0]} rows of 384-px JPEG in {LARGE[1]} files")
    p.add_argument("--rows", type=int, default=4000)
    p.add_argument("--files", type=int, default=40)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--runs", type=int, default=1, help="timed rounds (floor, serial, workers each); medians reported")
    p.add_argument("--tmp", help="where to build the corpus (default: the system temp dir)")
    a = p.parse_args()
    rows, files = (480, 8) if a.quick else LARGE if a.large else (a.rows, a.files)
    r = run(rows, files, a.workers, a.tmp, 1 if a.quick else a.runs)
    for k, v in r.items():
        print(f"{k:>22}: {v}")
    w = f"workers{a.workers}"
    print(f"bench_convert: rows={r['rows']} files={r['files']} runs={r['runs']} floor_mb_s={r['floor_mb_s']} "
          f"serial_mb_s={r['serial_mb_s']} serial_ratio={r['serial_ratio']} serial_cpu_ratio={r['serial_cpu_ratio']} "
          f"checksum_share={r['checksum_share']} {w}_speedup={r[w + '_speedup']} "
          f"{w}_superlinear={r[w + '_superlinear']} {w}_cpu_overhead={r[w + '_cpu_overhead']} "
          f"parts2_merge_s={r['parts2_merge_s']} identical={r['identical']} cores={r['cores']} "
          f"load_avg={r['load_avg']}")
    return 0 if r["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
