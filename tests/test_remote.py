"""Datasets in object storage (issue 41): the demo datasets uploaded to a real S3-compatible server (moto's server
mode, a process started here on 127.0.0.1 with IAM authentication on) and named by ``msc://`` URLs in ``dataset_info``, read
through Energon's ``EPath`` / the Multi-Storage Client with an ``MSC_CONFIG`` file written here.

Shown: the same batches over ``msc://`` as over the local copy (workers and prefetch on, ``torch.equal``), exact
resume and an elastic resize (2 -> 3) over remote data, ``bagel-data verify`` on a remote dataset, and the refusals
as one line naming the URL and the remedy: bad credentials, a missing bucket, a store that does not answer (the test
profile's timeouts and retries small), a shard that vanished, an unknown profile.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from _external_common import (assert_same, demo_config, elastic_world as _world, run_world as _run,
                              small_selection_config)
from bridge.models.bagel.data.build import build_bagel_train_loader
from bridge.models.bagel.data.errors import DataError
from bridge.models.bagel.data.tools.verify import format_report, verify

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from bench_remote import start_moto  # noqa: E402  (the bench's moto server on 127.0.0.1)

BUCKET = "bagel-data"
PROFILE = "bagel-s3"
_ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class Store:
    """The test's S3 server: its endpoint, a boto3 client with the good credentials, the uploaded demo tree."""

    endpoint: str
    s3: Any
    prefix: str  # the demo's energon/ tree is at s3://BUCKET/<prefix>/<group>/<name>/
    config: str  # the MSC_CONFIG file


def _profile(endpoint: str, bucket: str, key: str, secret: str, *, timeout: float = 5.0) -> dict:
    """An MSC profile on ``bucket`` of the S3 server at ``endpoint``: path-style addressing (an IP endpoint),
    static credentials, small timeouts and retries (MSC's, so a fault surfaces in seconds, not minutes)."""
    return {"storage_provider": {"type": "s3", "options": {
                "base_path": bucket, "endpoint_url": endpoint, "region_name": "us-east-1",
                "connect_timeout": timeout, "read_timeout": timeout, "retries": {"max_attempts": 1}}},
            "credentials_provider": {"type": "S3Credentials", "options": {"access_key": key, "secret_key": secret}},
            "retry": {"attempts": 2, "delay": 0.05}}


@pytest.fixture(scope="session")
def silent_port():
    """A TCP port on 127.0.0.1 that accepts connections and never answers (a store that times out)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield sock.getsockname()[1]
    sock.close()


@pytest.fixture(scope="session")
def store(demo_setup, tmp_path_factory, silent_port):
    """moto's S3 server on 127.0.0.1 (a process of its own, stopped at the end), IAM authentication on after the
    setup: one user allowed ``s3:*``, the demo's converted datasets uploaded, ``MSC_CONFIG`` set to profiles
    ``bagel-s3`` (good), ``bagel-badkey`` (a wrong secret), ``bagel-nobucket`` (a bucket that does not exist) and
    ``bagel-silent`` (an endpoint that never answers)."""
    import urllib.request

    import boto3

    out, _ = demo_setup
    proc, endpoint = start_moto()
    old_env = os.environ.get("MSC_CONFIG")
    try:
        setup = {"endpoint_url": endpoint, "region_name": "us-east-1", "aws_access_key_id": "setup",
                 "aws_secret_access_key": "setup"}
        iam = boto3.client("iam", **setup)
        iam.create_user(UserName="trainer")
        iam.put_user_policy(UserName="trainer", PolicyName="s3", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        good = (key["AccessKeyId"], key["SecretAccessKey"])
        s3 = boto3.client("s3", **{**setup, "aws_access_key_id": good[0], "aws_secret_access_key": good[1]})
        s3.create_bucket(Bucket=BUCKET)
        energon = out / "energon"
        for path in sorted(energon.rglob("*")):
            if path.is_file():
                s3.upload_file(str(path), BUCKET, f"demo/{path.relative_to(energon).as_posix()}")
        config = tmp_path_factory.mktemp("msc") / "msc_config.yaml"
        config.write_text(yaml.safe_dump({"profiles": {
            PROFILE: _profile(endpoint, BUCKET, *good),
            "bagel-badkey": _profile(endpoint, BUCKET, good[0], "not-the-secret"),
            "bagel-nobucket": _profile(endpoint, "no-such-bucket", *good),
            "bagel-silent": _profile(f"http://127.0.0.1:{silent_port}", BUCKET, *good, timeout=0.5)}}))
        os.environ["MSC_CONFIG"] = str(config)
        # from now on every request is checked against IAM (moto's own switch)
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=b"0", method="POST",
                                                      headers={"Content-Type": "text/plain"}), timeout=10).read()
        yield Store(endpoint, s3, "demo", str(config))
    finally:
        if old_env is None:
            os.environ.pop("MSC_CONFIG", None)
        else:
            os.environ["MSC_CONFIG"] = old_env
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _url(group: str, name: str, profile: str = PROFILE, prefix: str = "demo") -> str:
    return f"msc://{profile}/{prefix}/{group}/{name}"


def _remote_registry(out: Path, directory: Path, profile: str = PROFILE, prefix: str = "demo") -> Path:
    """The demo's dataset_info with every energon_path the dataset's URL in the store."""
    info = yaml.safe_load((out / "dataset_info.yaml").read_text())
    for group, entries in info.items():
        for name, entry in entries.items():
            entry["energon_path"] = _url(group, name, profile, prefix)
    path = Path(directory) / "dataset_info.yaml"
    path.write_text(yaml.safe_dump(info))
    return path


def _batches(cfg: Any, tok: Any, n: int, rank: tuple[int, int] = (0, 1)) -> list:
    loader = build_bagel_train_loader(cfg, tok, rank, length=100)
    try:
        return [next(loader) for _ in range(n)]
    finally:
        loader.close()


def test_same_batches_over_msc_as_over_the_local_copy(store, demo_setup, tmp_path) -> None:
    out, tok = demo_setup
    local = demo_config(out, 2, True, prefetch=2)
    remote = dataclasses.replace(local, dataset_info=str(_remote_registry(out, tmp_path)))
    want, got = _batches(local, tok, 6), _batches(remote, tok, 6)
    for a, b in zip(want, got, strict=True):
        assert_same(a, b)


def test_exact_resume_and_elastic_resize_over_remote_data(store, demo_setup, tmp_path) -> None:
    out, tok = demo_setup
    cfg = small_selection_config(out, tmp_path)
    cfg = dataclasses.replace(cfg, dataset_info=str(_remote_registry(out, tmp_path)))
    inline, _ = _run([build_bagel_train_loader(cfg, tok, (1, 2), length=10)], 4)
    _, states = _run(_world(cfg, tok, 2, num_workers=2), 2)
    again, _ = _run(_world(cfg, tok, 2, states), 2)  # resumed over remote data: the stream goes on exactly
    for a, b in zip(inline[0][2:], again[1], strict=True):
        assert_same(a, b)
    (tmp_path / "local").mkdir()
    local = small_selection_config(out, tmp_path / "local")
    _, local_states = _run(_world(local, tok, 2), 2)
    want, _ = _run(_world(local, tok, 3, local_states), 2)  # 2 -> 3 over the local copy
    got, _ = _run(_world(cfg, tok, 3, states), 2)  # the same resize over the store
    for per_want, per_got in zip(want, got, strict=True):
        for a, b in zip(per_want, per_got, strict=True):
            assert_same(a, b)


def test_verify_reads_a_remote_dataset(store, demo_setup) -> None:
    url = _url("t2i_pretrain", "demo_t2i")
    report = verify([url])
    assert report.exit_code == 0, format_report(report)
    assert [d.root for d in report.datasets] == [url] and report.datasets[0].verified
    assert sum(s.bytes_read for d in report.datasets for s in d.shards) > 0


def _first_line_of_build(cfg: Any, tok: Any) -> str:
    with pytest.raises((DataError, ValueError)) as err:
        loader = build_bagel_train_loader(cfg, tok, (0, 1), length=10)
        try:
            next(loader)
        finally:
            loader.close()
    text = str(err.value)
    assert "\n" not in text.strip(), text
    return text


@pytest.mark.parametrize(("profile", "cause", "remedy"), [
    ("bagel-badkey", "access refused", "fix the credentials of the profile"),
    ("bagel-nobucket", "no such bucket", "create the bucket or fix the bucket"),
    ("bagel-silent", "the store did not answer", "read_timeout / retry settings"),
])
def test_a_store_that_refuses_is_one_line(store, demo_setup, tmp_path, profile, cause, remedy) -> None:
    out, tok = demo_setup
    cfg = dataclasses.replace(demo_config(out, 0, True), dataset_info=str(_remote_registry(out, tmp_path, profile)))
    line = _first_line_of_build(cfg, tok)
    assert f"msc://{profile}/demo/" in line and cause in line and remedy in line, line


def test_a_vanished_shard_is_one_line_through_the_data_watch(store, demo_setup, tmp_path) -> None:
    out, tok = demo_setup
    energon = out / "energon"
    for path in sorted(energon.rglob("*")):  # a copy of the demo tree, then one t2i shard deleted from it
        if path.is_file():
            store.s3.upload_file(str(path), BUCKET, f"vanish/{path.relative_to(energon).as_posix()}")
    shard = "vanish/t2i_pretrain/demo_t2i/shards/shard-000000.tar"
    store.s3.delete_object(Bucket=BUCKET, Key=shard)
    cfg = dataclasses.replace(demo_config(out, 1, True), timeout_s=60,
                              dataset_info=str(_remote_registry(out, tmp_path, prefix="vanish")))
    line = _first_line_of_build(cfg, tok)
    assert f"msc://{PROFILE}/{shard}" in line and "no such object" in line and "upload" in line, line


def test_unknown_profile_and_missing_client_fail_at_build_in_one_line(store, demo_setup, tmp_path) -> None:
    out, tok = demo_setup
    cfg = dataclasses.replace(demo_config(out, 0, True),
                              dataset_info=str(_remote_registry(out, tmp_path, "no-such-profile")))
    line = _first_line_of_build(cfg, tok)
    assert "msc://no-such-profile/demo/" in line and "MSC_CONFIG" in line, line
    # without the S3 client (boto3 not importable): the build names the extra that brings it
    code = ("import sys, dataclasses; sys.modules['boto3'] = None; sys.path.insert(0, 'tests')\n"
            "from _external_common import demo_config\n"
            "from bridge.models.bagel.data.build import build_bagel_train_loader\n"
            "from bridge.models.bagel.data.tokenizer import build_qwen2_tokenizer\n"
            "from pathlib import Path\n"
            f"cfg = dataclasses.replace(demo_config(Path({str(out)!r}), 0, True), dataset_info={str(tmp_path / 'r')!r})\n"
            "try:\n    build_bagel_train_loader(cfg, build_qwen2_tokenizer(), (0, 1), length=10)\n"
            "except Exception as e:\n    print('ERR', e)\n")
    (tmp_path / "r").write_text((tmp_path / "dataset_info.yaml").read_text().replace("no-such-profile", PROFILE))
    res = subprocess.run([sys.executable, "-c", code], cwd=_ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MSC_CONFIG": store.config})
    err = [x for x in res.stdout.splitlines() if x.startswith("ERR")]
    assert err and "bagel-megatron-data[s3]" in err[0] and f"msc://{PROFILE}/demo/" in err[0], res.stdout + res.stderr
