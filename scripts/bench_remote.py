#!/usr/bin/env python3
"""Benchmark training from object storage: the demo datasets in an S3-compatible server (moto's server mode, a
process on 127.0.0.1) read over ``msc://`` URLs through a small proxy on 127.0.0.1 that adds ``--latency-ms``
(default 50 ms) to every request, against the local copy, in the same run.

For each source (the local copy; the store through the proxy) and each read-pool size of ``--workers``, with
prefetch ``--prefetch``: a simulated training loop (``--step-ms`` of "GPU" per batch, the trainer not using the CPU)
measures the time the trainer waits in ``next()`` and its share of the wall time, and tokens/s. The proxy counts
the requests and bytes of the remote runs' timed batches: requests and KiB per sample packed (reads ahead
included) show ranged reads (no shard is downloaded whole). Start-up (build to first batch) is reported apart.

Last line: ``remote: wait_share_local=<w> wait_share_msc=<w> tokens_per_s_local=<t> tokens_per_s_msc=<t>
requests_per_sample=<r> kib_per_sample=<k> first_batch_s_local=<s> first_batch_s_msc=<s>`` (the largest read pool
of ``--workers``). ``--quick`` is the CI smoke run (tests/test_benches.py): 2 batches, small packs; its numbers mean
nothing.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import warnings
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bridge.models.bagel.data.build import build_bagel_train_loader  # noqa: E402
from bridge.models.bagel.data.config import load_config  # noqa: E402
from bridge.models.bagel.data.converter.demo import make_demo_data  # noqa: E402
from bridge.models.bagel.data.tokenizer import load_tokenizer  # noqa: E402

BUCKET = "bagel-bench"
PROFILE = "bagel-bench"
#: ``--quick`` packs (the tests' demo budgets)
QUICK_BUDGETS = ("packer.expected_num_tokens=4096", "packer.max_num_tokens=8192",
                 "packer.max_num_tokens_per_sample=4096", "packer.prefer_buffer_before=2048")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_moto(timeout: float = 60.0) -> tuple[subprocess.Popen, str]:
    """moto's S3 server on a free port of 127.0.0.1, answering: (process, endpoint)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).read()
            return proc, endpoint
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"moto's server did not start on {endpoint}") from None
            time.sleep(0.2)


class LatencyProxy(http.server.ThreadingHTTPServer):
    """An HTTP proxy on 127.0.0.1 in front of ``upstream`` (host, port): every request waits ``latency_s`` first,
    then goes through unchanged (headers, body, the signature's Host); counts requests and response bytes."""

    daemon_threads = True

    def __init__(self, upstream: tuple[str, int], latency_s: float) -> None:
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.upstream, self.latency_s = upstream, latency_s
        self.requests = self.bytes = 0
        self.lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _forward(self) -> None:
        server: LatencyProxy = self.server  # type: ignore[assignment]
        time.sleep(server.latency_s)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        conn = getattr(self, "_conn", None)
        if conn is None:
            conn = self._conn = http.client.HTTPConnection(*server.upstream, timeout=60)
        conn.request(self.command, self.path, body=body or None, headers=dict(self.headers))
        resp = conn.getresponse()
        data = resp.read()
        with server.lock:
            server.requests += 1
            server.bytes += len(data)
        self.send_response_only(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data) if self.command != "HEAD" else
                                               resp.getheader("Content-Length") or 0))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward


def upload(endpoint: str, energon: Path) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="bench",
                      aws_secret_access_key="bench")
    s3.create_bucket(Bucket=BUCKET)
    for path in sorted(energon.rglob("*")):
        if path.is_file():
            s3.upload_file(str(path), BUCKET, f"demo/{path.relative_to(energon).as_posix()}")


def msc_config(path: Path, endpoint: str) -> None:
    """An MSC config with profile ``bagel-bench`` on ``endpoint`` (path-style, static credentials)."""
    path.write_text(yaml.safe_dump({"profiles": {PROFILE: {
        "storage_provider": {"type": "s3", "options": {"base_path": BUCKET, "endpoint_url": endpoint,
                                                       "region_name": "us-east-1"}},
        "credentials_provider": {"type": "S3Credentials", "options": {"access_key": "bench",
                                                                      "secret_key": "bench"}}}}}))


def remote_registry(data: Path, out: Path) -> Path:
    info = yaml.safe_load((data / "dataset_info.yaml").read_text())
    for group, entries in info.items():
        for name, entry in entries.items():
            entry["energon_path"] = f"msc://{PROFILE}/demo/{group}/{name}"
    out.write_text(yaml.safe_dump(info))
    return out


def run(data: Path, registry: Path, workers: int, prefetch: int, batches: int, step_ms: float, tokenizer,
        budgets: tuple[str, ...], proxy: LatencyProxy | None = None) -> dict:
    """A simulated training loop: time waited in ``next()`` (mean, share of the wall time), tokens/s, samples
    packed; with ``proxy``, the requests and bytes it served during the timed loop (build and first batch not
    counted)."""
    cfg = load_config(None, [f"groups={data / 'groups.yaml'}", f"dataset_info={registry}", f"num_workers={workers}",
                             f"prefetch={prefetch}", "packer.use_flex=true", "packer.max_latent_size=64", *budgets])
    t0 = time.perf_counter()
    loader = build_bagel_train_loader(cfg, tokenizer, (0, 1), length=1000)
    waited = tokens = samples = 0.0
    with loader:
        batch = next(loader)
        first_s = time.perf_counter() - t0
        time.sleep(step_ms / 1000)
        before = (proxy.requests, proxy.bytes) if proxy is not None else (0, 0)
        t_start = time.perf_counter()
        for _ in range(batches):
            t0 = time.perf_counter()
            batch = next(loader)
            waited += time.perf_counter() - t0
            tokens += batch["sequence_length"]
            samples += len(batch["batch_data_indexes"])
            time.sleep(step_ms / 1000)
        wall = time.perf_counter() - t_start
        after = (proxy.requests, proxy.bytes) if proxy is not None else (0, 0)
    return {"wait_ms_mean": 1000 * waited / batches, "wait_share": waited / wall, "tokens_per_s": tokens / wall,
            "samples": samples, "first_batch_s": first_s, "requests": after[0] - before[0],
            "bytes": after[1] - before[1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(REPO / "demo_data"), help="demo data dir (generated if missing)")
    ap.add_argument("--latency-ms", type=float, default=50.0, help="added to every request by the proxy")
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 4], help="read-pool sizes (num_workers)")
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--step-ms", type=float, default=1000.0, help="simulated training step in ms")
    ap.add_argument("--quick", action="store_true", help="CI smoke run: 2 batches, read pool 2, 100 ms step, "
                    "4K/8K-token packs")
    args = ap.parse_args()
    budgets: tuple[str, ...] = ()
    if args.quick:
        args.batches, args.workers, args.step_ms, budgets = 2, [2], 100.0, QUICK_BUDGETS
    logging.basicConfig(level=logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    data = Path(args.data)
    make_demo_data(str(data))
    tokenizer = load_tokenizer(None)
    proc, endpoint = start_moto()
    proxy = None
    try:
        upload(endpoint, data / "energon")
        host, port = endpoint.rsplit("//", 1)[1].split(":")
        proxy = LatencyProxy((host, int(port)), args.latency_ms / 1000)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp:
            msc_config(Path(tmp) / "msc.yaml", proxy.endpoint)
            os.environ["MSC_CONFIG"] = str(Path(tmp) / "msc.yaml")
            registry = remote_registry(data, Path(tmp) / "dataset_info.yaml")
            rows = []
            for workers in args.workers:
                local = run(data, data / "dataset_info.yaml", workers, args.prefetch, args.batches, args.step_ms,
                            tokenizer, budgets)
                before = proxy.requests
                remote = run(data, registry, workers, args.prefetch, args.batches, args.step_ms, tokenizer, budgets,
                             proxy)
                rows.append((workers, local, remote, proxy.requests - before))
                print(f"num_workers={workers} prefetch={args.prefetch} step={args.step_ms:.0f}ms "
                      f"latency={args.latency_ms:.0f}ms/request: local wait {local['wait_ms_mean']:.0f} ms/batch "
                      f"(share {local['wait_share']:.3f}), {local['tokens_per_s']:.0f} tok/s, first batch "
                      f"{local['first_batch_s']:.2f}s | msc:// wait {remote['wait_ms_mean']:.0f} ms/batch (share "
                      f"{remote['wait_share']:.3f}), {remote['tokens_per_s']:.0f} tok/s, first batch "
                      f"{remote['first_batch_s']:.2f}s; {remote['requests']} requests, {remote['bytes'] / 2**20:.1f} MiB "
                      f"in the timed batches ({rows[-1][3]} requests in all, build included)", flush=True)
    finally:
        if proxy is not None:
            proxy.shutdown()
        proc.terminate()
        proc.wait(timeout=30)
    workers, local, remote, _ = rows[-1]
    samples = max(remote["samples"], 1)
    req, nbytes = remote["requests"], remote["bytes"]
    print(json.dumps({"workers": workers, "local": local, "msc": remote}))
    print(f"remote: wait_share_local={local['wait_share']:.4f} wait_share_msc={remote['wait_share']:.4f} "
          f"tokens_per_s_local={local['tokens_per_s']:.1f} tokens_per_s_msc={remote['tokens_per_s']:.1f} "
          f"requests_per_sample={req / samples:.2f} kib_per_sample={nbytes / 1024 / samples:.1f} "
          f"first_batch_s_local={local['first_batch_s']:.2f} first_batch_s_msc={remote['first_batch_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
