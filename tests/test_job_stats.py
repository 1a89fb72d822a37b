"""The job's summary and telemetry read the loader's ``stats()``: the same with prefetch on and off.

The demo job with ``data.prefetch=2`` packs in a producer process; its summary and every telemetry line must
still report the consumption and drops of the batches the trainer received — including a forced drop (a
sample whose image is missing) — exactly as with ``data.prefetch=0``.
"""

from __future__ import annotations

import io
import json
import logging
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image

from _external_common import single_process_pg_collection
from bridge.models.bagel.data.converter.convert import convert_t2i
from bridge.models.bagel.data.energon.layout import load_manifest
from bridge.models.bagel.data.job.config import load_job_config
from bridge.models.bagel.data.job.runner import run_job

pytestmark = [pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]

STEPS = 4


def _truncated_jpeg(i: int) -> bytes:
    """A JPEG of noise cut short (its last third and end marker gone): its header opens, and it decodes grey where
    the data ends."""
    import random

    size = (64, 64 + 16 * (i % 3))
    buf = io.BytesIO()
    Image.frombytes("RGB", size, random.Random(i).randbytes(size[0] * size[1] * 3)).save(buf, "JPEG")
    data = buf.getvalue()
    return data[:len(data) * 2 // 3]


def _png(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64 + 16 * (i % 3), 64), (40 * i % 256, 90, 140)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def job_files(demo_setup, tmp_path_factory):
    """The demo groups, with a t2i dataset whose every other row has no image (dropped by the reader) and two rows
    with a truncated JPEG (rows 2 and 6: counted by the converter, trained on and counted by the reader)."""
    out, _ = demo_setup
    root = tmp_path_factory.mktemp("job_stats")
    raw = root / "raw" / "broken_t2i"
    raw.mkdir(parents=True)
    rows = [{"image": None if i % 2 else _truncated_jpeg(i) if i % 4 == 2 else _png(i),
             "captions": json.dumps({"c": f"picture {i}"})} for i in range(8)]
    pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema([("image", pa.binary()), ("captions", pa.string())])),
                   raw / "part-0000.parquet")
    converted = convert_t2i(str(raw), root / "converted", progress=False)
    assert converted.bad_images == {"truncated_image": 2}, converted  # found at conversion, by reason
    manifest = load_manifest(converted.path)
    assert manifest["image_checks"]["problems"] == {"truncated_image": 2}, manifest.get("image_checks")
    broken = converted.path
    groups = yaml.safe_load((out / "groups.yaml").read_text())
    info = yaml.safe_load((out / "dataset_info.yaml").read_text())
    groups["t2i_pretrain"]["dataset_names"] = ["broken_t2i"]
    groups["t2i_pretrain"].pop("num_used_data", None)
    info["t2i_pretrain"]["broken_t2i"] = {"data_dir": str(raw), "energon_path": str(broken)}
    (root / "groups.yaml").write_text(yaml.safe_dump(groups))
    (root / "dataset_info.yaml").write_text(yaml.safe_dump(info))
    return root


def _run(root, prefetch: int, caplog, *extra: str) -> tuple[dict, list[str]]:
    from megatron.core import num_microbatches_calculator as nmc

    cfg = load_job_config(None, [
        f"data.groups={root / 'groups.yaml'}", f"data.dataset_info={root / 'dataset_info.yaml'}",
        f"data.prefetch={prefetch}", "data.packer.expected_num_tokens=7168", "data.packer.max_num_tokens=8192",
        "data.packer.max_num_tokens_per_sample=4096", "data.packer.prefer_buffer_before=2048",
        "data.packer.use_flex=true", "data.packer.max_latent_size=64", f"train.train_iters={STEPS}",
        "train.global_batch_size=1", "train.log_interval=1", "train.progress=false", *extra])
    from bridge.models.bagel.data.tokenizer import build_qwen2_tokenizer

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="bridge.models.bagel.data.job.telemetry"):
        try:
            summary = run_job(cfg, single_process_pg_collection(), build_qwen2_tokenizer())
        finally:
            nmc.destroy_num_microbatches_calculator()
    lines = [r.getMessage() for r in caplog.records if r.name.endswith("telemetry") and "drops" in r.getMessage()]
    return summary, lines


def test_summary_and_telemetry_equal_with_and_without_prefetch(job_files, caplog):
    sync, sync_lines = _run(job_files, 0, caplog)
    ahead, ahead_lines = _run(job_files, 2, caplog)
    assert sync["pipeline"]["num_batches"] == STEPS and sync["pipeline"]["position"] == STEPS
    assert sync["pipeline"] == ahead["pipeline"], (sync["pipeline"], ahead["pipeline"])
    assert sum(sync["pipeline"]["consumed"].values()) > 0
    # the forced drop shows up, with its reason, in the summary and in the telemetry of both runs
    assert sync["pipeline"]["drops"].get("missing_image", 0) > 0, sync["pipeline"]
    assert sync["pipeline"]["source_drops"]["t2i_pretrain"]["missing_image"] > 0
    assert len(sync_lines) == len(ahead_lines) == STEPS

    def drops_part(line: str) -> str:
        return re.sub(r".*\| drops ", "", line)

    assert [drops_part(x) for x in sync_lines] == [drops_part(x) for x in ahead_lines]
    assert "missing_image" in drops_part(sync_lines[-1])
    # the truncated JPEGs: trained on (not dropped), counted by reason in the loader's stats, the summary, telemetry
    kept = sync["pipeline"]["unused"].get("truncated_image", 0)
    assert kept > 0 and "truncated_image" not in sync["pipeline"]["drops"], sync["pipeline"]
    assert ahead["pipeline"]["unused"]["truncated_image"] == kept
    assert f"'truncated_image': {kept}" in sync_lines[-1], sync_lines[-1]


def test_truncated_images_drop_drops_them(job_files, caplog):
    """``data.truncated_images: drop``: every truncated JPEG read is a ``truncated_image`` drop instead."""
    summary, lines = _run(job_files, 0, caplog, "data.truncated_images=drop")
    dropped = summary["pipeline"]["drops"].get("truncated_image", 0)
    assert dropped > 0 and "truncated_image" not in summary["pipeline"]["unused"], summary["pipeline"]
    assert "truncated_image" in re.sub(r".*\| drops ", "", lines[-1]), lines[-1]


def test_a_resume_at_or_past_train_iters_runs_no_step_and_says_so(job_files, tmp_path, caplog):
    """train.train_iters not above the checkpoint's step: like Megatron, no step and no error; a warning says
    why and the summary counts 0 steps (not a negative number)."""
    ckpt = tmp_path / "ckpt"
    first, _ = _run(job_files, 0, caplog, f"train.save={ckpt}")
    assert first["steps"] == STEPS
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="bridge.models.bagel.data.job.runner"):
        again, _ = _run(job_files, 0, caplog, f"train.load={ckpt}", "train.train_iters=2")
    assert (again["start_step"], again["steps"], again["batches"]) == (STEPS, 0, 0), again
    assert any(f"train.train_iters 2 is not above the checkpoint's step {STEPS}: no step to run" in r.getMessage()
               for r in caplog.records), caplog.text
