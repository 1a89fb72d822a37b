"""Never hang, never silent: a source that can never yield fails fast and says where and why (issue cases B1-B3),
errors name the dataset and shard, and ignored parts of records are counted.

Each case of ``../shared/cases`` stands for a kind: a DP rank whose share has no usable row (B1), a VLM jsonl in
another chat schema (B2), every sample over the per-sample budget (B3) — in the reader, in the packer, through
Energon workers, through the prefetch producer and under a 2-rank ``torchrun`` job.
"""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image

from _warm_torchrun import warm_torchrun
from bridge.models.bagel.data.build import build_bagel_train_loader
from bridge.models.bagel.data.config import BagelDataConfig, PackerConfig
from bridge.models.bagel.data.converter.convert import ConvertError, convert_t2i, convert_vlm
from bridge.models.bagel.data.stats import DataStallError

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]

SMALL = dict(expected_num_tokens=256, max_num_tokens=384, max_num_tokens_per_sample=256, prefer_buffer_before=128,
             use_flex=True)
T2I_ARGS = {"max_image_size": 64, "min_image_size": 32, "image_stride": 16}


def _png(w: int, h: int, i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (i * 30 % 256, 40, 90)).save(buf, "PNG")
    return buf.getvalue()


def _t2i(root: Path, rows: list, name: str = "t2i") -> str:
    raw = root / "raw" / name
    raw.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema([("image", pa.binary()), ("captions", pa.string())])),
                   raw / "part-0000.parquet")
    return convert_t2i(str(raw), root / "out", progress=False).path


def _config(root: Path, group: str, path: str, transform: dict, *, workers: int = 0, prefetch: int = 0,
            order: str = "elastic", num_used_data: list[int] | None = None, **packer) -> BagelDataConfig:
    used = {"num_used_data": num_used_data} if num_used_data else {}
    (root / "groups.yaml").write_text(yaml.safe_dump({group: {
        "dataset_names": ["d"], "weight": 1, "is_mandatory": True, "image_transform_args": transform, **used}}))
    (root / "dataset_info.yaml").write_text(yaml.safe_dump({group: {"d": {
        "data_dir": "unused", "energon_path": path, **({"jsonl_path": "unused"} if group == "vlm_sft" else {})}}}))
    return BagelDataConfig(groups=str(root / "groups.yaml"), dataset_info=str(root / "dataset_info.yaml"),
                           num_workers=workers, prefetch=prefetch, order=order,
                           packer=PackerConfig(**{**SMALL, **packer}))


@pytest.fixture(scope="module")
def tok():
    from bridge.models.bagel.data.tokenizer import build_qwen2_tokenizer

    return build_qwen2_tokenizer()


@pytest.fixture(scope="module")
def half_broken(tmp_path_factory) -> tuple[Path, str]:
    """B1: 8 rows, rows 4-7 without image. Under the removed contiguous-share order, rank 1 of 2 owned only broken
    rows; the elastic order stripes partitions over epochs, so every rank meets the good rows."""
    root = tmp_path_factory.mktemp("b1")
    rows = [{"image": _png(24, 16, i) if i < 4 else None, "captions": json.dumps({"c": f"photo {i}"})}
            for i in range(8)]
    return root, _t2i(root, rows)


@pytest.fixture(scope="module")
def all_broken(tmp_path_factory) -> tuple[Path, str]:
    """B1 at its limit: the selection (``num_used_data: [1]``: the first parquet file) holds 8 rows, none with an
    image (the second file's good rows let the converter accept the dataset): no rank can ever yield."""
    root = tmp_path_factory.mktemp("b1_all")
    raw = root / "raw" / "t2i"
    raw.mkdir(parents=True)
    schema = pa.schema([("image", pa.binary()), ("captions", pa.string())])
    for k, image in enumerate((None, _png(24, 16, 1))):
        rows = [{"image": image, "captions": json.dumps({"c": f"photo {k} {i}"})} for i in range(8)]
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), raw / f"part-{k:04d}.parquet")
    return root, convert_t2i(str(raw), root / "out", progress=False).path


def test_b1_every_rank_trains_on_a_half_broken_dataset(half_broken, tok):
    """Both ranks of DP 2 yield; the broken rows are counted as drops by reason on the rank that met them."""
    root, path = half_broken
    cfg = _config(root, "t2i_pretrain", path, T2I_ARGS)
    drops = {}
    for rank in (0, 1):
        with build_bagel_train_loader(cfg, tok, (rank, 2), length=4) as loader:
            assert next(loader)["sequence_length"] > 0
            drops[rank] = loader.stats()["drops"]
    assert any("missing_image" in str(d) for d in drops.values()), drops


def _first_batch_error(cfg: BagelDataConfig, tok, dp: tuple[int, int]) -> tuple[BaseException, float]:
    t0 = time.perf_counter()
    with build_bagel_train_loader(cfg, tok, dp, length=4) as loader:
        with pytest.raises(DataStallError) as err:
            next(loader)
    return err.value, time.perf_counter() - t0


@pytest.mark.parametrize("workers, prefetch", [(0, 0), (0, 2), pytest.param(2, 0, marks=pytest.mark.slow)],
                         ids=["inline", "prefetch-producer", "energon-workers"])
def test_b1_rank_without_usable_rows_fails_fast_naming_dataset_rank_reason(all_broken, tok, workers, prefetch):
    root, path = all_broken
    cfg = _config(root, "t2i_pretrain", path, T2I_ARGS, workers=workers, prefetch=prefetch, num_used_data=[1])
    err, seconds = _first_batch_error(cfg, tok, (1, 2))
    msg = str(err)
    assert "reader 't2i_pretrain'" in msg and "dataset 't2i'" in msg and "DP rank 1/2" in msg
    assert "missing_image" in msg and "image 0 is null" in msg
    assert seconds < 60


def test_b2_vlm_in_another_chat_schema_is_refused_by_the_converter_and_the_reader(tmp_path, tok):
    images = tmp_path / "images"
    images.mkdir()
    (images / "i.png").write_bytes(_png(32, 32, 1))
    jsonl = tmp_path / "chat.jsonl"
    lines = [{"image": "i.png", "messages": [{"role": "user", "content": f"<image> what is {i}?"},
                                             {"role": "assistant", "content": "a square"}]} for i in range(6)]
    jsonl.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(ConvertError, match=r"none of the 6 records .* no `conversations` list \(keys: image, "
                                           r"messages\).*`conversations` list"):
        convert_vlm(str(jsonl), str(images), tmp_path / "out", progress=False)
    # mixed: converted with a loud warning, and the reader's drops say why
    good = {"image": "i.png", "conversations": [{"from": "human", "value": "<image> hi"}, {"from": "gpt", "value": "ok"}]}
    jsonl.write_text("".join(json.dumps(x) + "\n" for x in [good, *lines]))
    summary = convert_vlm(str(jsonl), str(images), tmp_path / "out", progress=False, overwrite=True)
    assert any("6 of 7 records can never become a training sample" in w for w in summary.warnings)


def test_b3_every_sample_over_the_per_sample_budget_fails_fast(tmp_path, tok):
    rows = [{"image": _png(256, 256, i), "captions": json.dumps({"c": f"big {i}"})} for i in range(6)]
    path = _t2i(tmp_path, rows)
    big = {"max_image_size": 256, "min_image_size": 128, "image_stride": 16}  # 16x16 latents = 256 tokens + 8
    for mandatory in (True, False):
        cfg = _config(tmp_path, "t2i_pretrain", path, big, max_latent_size=64, max_consecutive_drops=20)
        if not mandatory:
            groups = yaml.safe_load(Path(cfg.groups).read_text())
            groups["t2i_pretrain"]["is_mandatory"] = False
            Path(cfg.groups).write_text(yaml.safe_dump(groups))
        err, seconds = _first_batch_error(cfg, tok, (0, 1))
        msg = str(err)
        reason = "overlength_mandatory" if mandatory else "overlength"
        assert "BagelPacker: group 't2i_pretrain' (dataset 't2i')" in msg and f"Dominant reason: {reason}" in msg
        assert "21 samples in a row" in msg and "max_num_tokens_per_sample" in msg and seconds < 60


def test_errors_name_the_dataset_shard_and_sample(half_broken, tok, tmp_path):
    from bridge.models.bagel.data.energon.readers.core import DataReadError

    root, path = half_broken
    broken = copy.deepcopy(tok)

    def explode(*_a, **_k):
        raise RuntimeError("tokenizer exploded")

    broken.encode = explode
    cfg = _config(root, "t2i_pretrain", path, T2I_ARGS)
    with build_bagel_train_loader(cfg, broken, (0, 1), length=4) as loader:
        with pytest.raises(DataReadError) as err:
            next(loader)
    msg = str(err.value)
    assert "reader 't2i_pretrain' (DP rank 0/1" in msg and path in msg
    assert "SampleCookError" in msg and "shard" in msg and "part-0000.parquet row group 0 row" in msg
    assert "tokenizer exploded" in msg


def test_ignored_parts_of_records_are_counted(tmp_path, tok):
    images = tmp_path / "images"
    images.mkdir()
    for n in ("a.png", "b.png"):
        (images / n).write_bytes(_png(32, 32, 3))
    rec = {"image": ["a.png", "b.png"], "conversations": [
        {"from": "human", "value": "<image> one picture tag, two images"}, {"from": "gpt", "value": "fine"},
        {"from": "system", "value": "ignored role"}]}
    jsonl = tmp_path / "v.jsonl"
    jsonl.write_text("".join(json.dumps(rec) + "\n" for _ in range(4)))
    path = convert_vlm(str(jsonl), str(images), tmp_path / "out", progress=False).path
    vit = {"max_image_size": 56, "min_image_size": 28, "image_stride": 14}
    cfg = _config(tmp_path, "vlm_sft", path, vit)
    with build_bagel_train_loader(cfg, tok, (0, 1), length=4) as loader:
        next(loader)
        stats = loader.stats()
    consumed = stats["consumed"]["vlm_sft"]
    assert stats["unused"] == {"image_without_placeholder": consumed, "turn_of_other_role": consumed}


@pytest.mark.slow
def test_b1_under_a_two_rank_job_every_rank_stops_with_one_line(all_broken, tmp_path):
    root, path = all_broken
    cfg = _config(root, "t2i_pretrain", path, T2I_ARGS, num_used_data=[1])
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        warm_torchrun(2, [f"data.groups={cfg.groups}", f"data.dataset_info={cfg.dataset_info}", "data.prefetch=2",
                          *(f"data.packer.{k}={v}" for k, v in SMALL.items()), "train.train_iters=3",
                          "train.progress=false", "demo_data=null"],
                      options=("--log-dir", str(Path(cfg.groups).parent / "torchelastic"))),
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error [rank")]
    assert sorted(x.split("]")[0] for x in lines) == ["error [rank 0", "error [rank 1"], proc.stderr[-3000:]
    # both ranks stall: every rank's one line is a DataStallError naming a stalled DP rank and the reason
    for line in lines:
        assert "DataStallError" in line and "missing_image" in line, line
        assert "DP rank 0/2" in line or "DP rank 1/2" in line, line
