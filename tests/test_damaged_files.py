"""Every damaged file is named in one line with its cause and the remedy: a missing .nv-meta, a garbage or stale
.tar.idx, a shard cut inside a member, on a header or in the padding; with and without Energon workers."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

from _warm_torchrun import warm_torchrun
from bridge.models.bagel.data.build import build_bagel_train_loader
from bridge.models.bagel.data.config import ConfigError
from bridge.models.bagel.data.energon.readers.core import DataReadError
from test_liveness import SMALL, T2I_ARGS, _config, _png, _t2i

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]


@pytest.fixture(scope="module")
def tok():
    from bridge.models.bagel.data.tokenizer import build_qwen2_tokenizer

    return build_qwen2_tokenizer()


def _members(tar: str) -> list[tarfile.TarInfo]:
    with tarfile.open(tar) as t:
        return t.getmembers()


def _damage(path: str, kind: str) -> tuple[str, str]:
    """Damage the dataset; returns (the file the line must name, a word of the remedy)."""
    tar = os.path.join(path, "shards", "shard-000000.tar")
    if kind == "nv-meta":
        shutil.rmtree(os.path.join(path, ".nv-meta"))
        return os.path.join(path), "energon prepare"
    if kind == "idx-garbage":
        n = os.path.getsize(tar + ".idx")
        open(tar + ".idx", "wb").write(os.urandom(n))
        return tar + ".idx", "energon prepare"
    if kind == "idx-stale":  # every sample start moved one sample on: "Inconsistent sample base name"
        raw = open(tar + ".idx", "rb").read()
        idx = list(struct.unpack(f"<{len(raw) // 8}Q", raw))
        open(tar + ".idx", "wb").write(struct.pack(f"<{len(idx)}Q", *([0] + [v + 2048 for v in idx[1:-1]] + idx[-1:])))
        return tar + ".idx", "energon prepare"
    m = _members(tar)
    cut = {"cut-in-member": m[-1].offset_data + 10, "cut-in-member-early": m[5].offset_data + 3,
           "cut-on-header": m[-1].offset + 100, "cut-in-padding": m[1].offset_data + m[1].size + 5}[kind]
    with open(tar, "rb") as fh:
        data = fh.read(cut)
    with open(tar, "wb") as fh:
        fh.write(data)
    return tar, "convert it again"


#: A typical cluster dataset root (47 characters): a line's length is checked as if the test's temp dir were this,
#: so it depends on the message, not on where the runner puts temp dirs (60-70 characters under pytest, 10 more
#: under pytest-xdist's ``popen-gwN/``)
TYPICAL_ROOT = "/lustre/projects/bagel/datasets/energon-2026-12"


def _shown(line: str, tmp_path) -> str:
    return line.replace(str(tmp_path), TYPICAL_ROOT)


KINDS = ["nv-meta", "idx-garbage", "idx-stale", "cut-in-member", "cut-in-member-early", "cut-on-header",
         "cut-in-padding"]


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", KINDS)
def test_damaged_file_is_named_with_the_remedy(tmp_path, tok, kind, workers):
    rows = [{"image": _png(24, 16, i), "captions": json.dumps({"c": f"photo {i}"})} for i in range(8)]
    path = _t2i(tmp_path, rows)
    named, remedy = _damage(path, kind)
    cfg = _config(tmp_path, "t2i_pretrain", path, T2I_ARGS, workers=workers)
    with pytest.raises((DataReadError, ConfigError)) as err:
        with build_bagel_train_loader(cfg, tok, (0, 1), length=4) as loader:
            for _ in range(40):  # more than one pass over the 8 samples: every damaged part is reached
                next(loader)
    first = str(err.value).splitlines()[0]
    assert named in first and remedy in first, first
    assert len(_shown(first, tmp_path)) < 300, (len(_shown(first, tmp_path)), first)
    assert "Traceback" not in str(err.value) and "Caught" not in str(err.value), str(err.value)
    if kind.startswith("cut"):
        assert "cut at byte" in first and ("inside member" in first or "header" in first or "padding" in first)
    if kind.startswith("cut-in-member"):
        assert "(sample 0000000" in first, first


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_two_rank_job_only_the_damaged_rank_names_the_file_the_other_names_the_rank(workers):
    """DP 2 over one 8-sample shard: rank 0 reads samples 0-3, rank 1 samples 4-7. The shard is cut inside the
    last member, so only rank 1 meets the damage: its line names the shard and the remedy, rank 0's line says in
    its own words that rank 1 failed (and is not a copy of rank 1's message)."""
    rows = [{"image": _png(24, 16, i), "captions": json.dumps({"c": f"photo {i}"})} for i in range(8)]
    root = Path(tempfile.mkdtemp(prefix="bagel-dmg-"))  # a short path, as a user's: the line's length is checked
    try:
        path = _t2i(root, rows)
        named, remedy = _damage(path, "cut-in-member")
        cfg = _config(root, "t2i_pretrain", path, T2I_ARGS, workers=workers)
        proc = _run_two_ranks(cfg, workers)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert proc.returncode != 0, proc.stderr[-3000:]
    lines = {x.split("]")[0]: x for x in proc.stderr.replace("\n  ", " ").splitlines() if x.startswith("error [rank")}
    assert sorted(lines) == ["error [rank 0", "error [rank 1"], proc.stderr[-3000:]
    failing, other = lines["error [rank 1"], lines["error [rank 0"]
    message = failing.split(": ", 2)[2]  # "error [rank 1]: DataReadError: <message>"
    assert named in message and remedy in message and "cut at byte" in message, failing
    assert len(message) < 300, (len(message), failing)
    assert "Traceback" not in message and "Caught" not in message, failing
    assert "rank 1" in other and "this rank was fine" in other, other
    assert message not in other and other.split(": ", 2)[2] != message, other  # its own words, not a copy


def _run_two_ranks(cfg, workers: int) -> subprocess.CompletedProcess:
    """The real job script under a 2-rank torchrun world on gloo (one launch: ~20 s on an idle 2-core machine)."""
    return subprocess.run(
        warm_torchrun(2, [f"data.groups={cfg.groups}", f"data.dataset_info={cfg.dataset_info}",
                          f"data.num_workers={workers}", *(f"data.packer.{k}={v}" for k, v in SMALL.items()),
                          "train.train_iters=12", "train.progress=false", "demo_data=null", "train.save=null"],
                      options=("--log-dir", str(Path(cfg.groups).parent / "torchelastic"))),
        cwd=REPO, capture_output=True, text=True, timeout=240, env=dict(os.environ, PYTHONWARNINGS="ignore"))
