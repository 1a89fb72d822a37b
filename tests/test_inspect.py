"""``bagel-data inspect``: the per-batch report matches the batches' own tensors, and the attention picture is
the same whether a pack carries flex split metadata or dense masks. Plus ``energon info`` on converted data."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from _external_common import DEMO_MAX_TOKENS, demo_loader
from bridge.models.bagel.data.tools import cli
from bridge.models.bagel.data.tools.inspection import (
    attention_allowed,
    canvas_size,
    pack_view,
    render_pack,
    sampled_positions,
    summarize_batch,
)
from packer_golden import load_case

REPO = Path(__file__).resolve().parents[1]

# The same budgets as _external_common.demo_loader, so a loader built there yields the same batches.
JOB_YAML = """\
demo_data: null
data:
  groups: {out}/groups.yaml
  dataset_info: {out}/dataset_info.yaml
  seed: 42
  num_workers: 0
  prefetch: 0
  tokenizer: null
  packer:
    expected_num_tokens: 7168
    max_num_tokens: 8192
    max_num_tokens_per_sample: 4096
    prefer_buffer_before: 2048
    max_latent_size: 64
    use_flex: {flex}
"""

HEAD = re.compile(r"^batch (\d+): tokens (\d+)/(\d+) fill [\d.]+% padding (\d+) \| text (\d+) vit (\d+) vae (\d+) \| "
                  r"ce (\d+) mse (\d+) \| samples (\d+)")
ROW = re.compile(r"^  sample +(\d+) (\S+) +tokens +(\d+) text +(\d+) vit +(\d+) vae +(\d+) ce +(\d+) mse +(\d+)  "
                 r"data_indexes (.*)$")


def _count(batch: dict, key: str, lo: int = 0, hi: int | None = None) -> int:
    """Independent count of positions of ``batch[key]`` in [lo, hi) (whole tensor when hi is None)."""
    if key not in batch:
        return 0
    t = batch[key]
    if hi is None:
        return int(t.numel())
    return int(((t >= lo) & (t < hi)).sum())


def _expected(batch: dict, max_num_tokens: int) -> tuple[tuple, list[tuple]]:
    seq = int(batch["sequence_length"])
    head = (seq, max_num_tokens, max_num_tokens - seq, _count(batch, "packed_text_indexes"),
            _count(batch, "packed_vit_token_indexes"), _count(batch, "packed_vae_token_indexes"),
            _count(batch, "ce_loss_indexes"), _count(batch, "mse_loss_indexes"), len(batch["batch_data_indexes"]))
    rows, start = [], 0
    for d, n in zip(batch["batch_data_indexes"], batch["sample_lens"]):
        end = start + int(n)
        rows.append((d["dataset_name"], int(n), *(_count(batch, k, start, end) for k in (
            "packed_text_indexes", "packed_vit_token_indexes", "packed_vae_token_indexes", "ce_loss_indexes",
            "mse_loss_indexes")), str(d["data_indexes"])))
        start = end
    return head, rows


def _parse(stdout: str) -> list[tuple[tuple, list[tuple]]]:
    out: list[tuple[tuple, list[tuple]]] = []
    for line in stdout.splitlines():
        m = HEAD.match(line)
        if m:
            v = [int(x) for x in m.groups()]
            assert v[0] == len(out)
            out.append((tuple(v[1:]), []))
            continue
        m = ROW.match(line)
        if m:
            g = m.groups()
            assert int(g[0]) == len(out[-1][1])
            out[-1][1].append((g[1], *(int(x) for x in g[2:8]), g[8]))
    return out


def test_inspect_demo_pictures_and_counts(demo_setup, tmp_path, capsys):
    """The command on the demo data: N pictures of the documented size, and printed counts = the tensors'."""
    out, tok = demo_setup
    job = tmp_path / "job.yaml"
    job.write_text(JOB_YAML.format(out=out, flex="true"))
    pics = tmp_path / "pics"
    n = 2
    rc = cli.main(["inspect", "--config", str(job), "--batches", str(n), "--out", str(pics), "--size", "256",
                   "--no-progress"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    files = sorted(os.listdir(pics))
    assert files == [f"batch_{i:04d}.png" for i in range(n)]
    for f in files:
        with Image.open(pics / f) as im:
            assert im.size == canvas_size(256) and im.mode == "RGB"
    report = _parse(printed)
    assert len(report) == n
    pipeline = [line for line in printed.splitlines() if line.startswith("  buffer ")]
    assert len(pipeline) == n
    with demo_loader(out, tok, 0, True) as loader:  # built the same way, counted independently
        for i in range(n):
            batch = next(loader)
            head, rows = _expected(batch, 8192)
            assert report[i][0] == head
            assert report[i][1] == rows
            st = loader.stats()  # the pipeline counters after this batch, as the report shows them
            assert pipeline[i].startswith(f"  buffer {st['buffer_len']} | consumed {st['consumed']} | drops so far ")


def _sibling_batches(dense_case: str, flex_case: str, limit: int):
    """(dense batch, flex batch, max_num_tokens) for golden batches that hold the same pack in both modes."""
    dense, flex = load_case(dense_case), load_case(flex_case)
    mx = dense["config"]["max_num_tokens"]
    assert flex["config"]["max_num_tokens"] == mx and flex["config"]["seed"] == dense["config"]["seed"]
    pairs = []
    for bd, bf in zip(dense["batches"], flex["batches"]):
        # the same pack: same samples and token content (only the mask representation differs) ...
        assert bd["sample_lens"] == bf["sample_lens"][:-1]
        assert torch.equal(bd["packed_text_ids"], bf["packed_text_ids"])
        assert torch.equal(bd["packed_position_ids"], bf["packed_position_ids"])
        # ... skipping the official unclosed-split quirk, where the two representations genuinely disagree
        if len(bd["packed_position_ids"]) == bd["sequence_length"]:
            pairs.append((bd, bf, mx))
        if len(pairs) == limit:
            break
    return pairs


@pytest.mark.parametrize("dense_case,flex_case", [("c01_dense_extrap_3g2m_s14", "c02_flex_extrap_3g2m_s14"),
                                                  ("c03_dense_interp_4g1m_s4", "c04_flex_interp_4g1m_s4")])
def test_flex_and_dense_draw_the_same_picture(dense_case, flex_case):
    """Golden sibling cases (same seed and streams, dense vs flex): same view, same pixels, official masks."""
    for bd, bf, mx in _sibling_batches(dense_case, flex_case, limit=6):
        ld, lf = pack_view(bd, mx), pack_view(bf)
        assert (ld.source, lf.source) == ("dense", "flex")
        assert ld.same_attention(lf)
        # the rule reproduces the official dense masks exactly, at full resolution
        pos = np.arange(ld.tokens)
        official = torch.block_diag(*[m == 0 for m in bd["nested_attention_masks"]]).numpy()
        assert np.array_equal(attention_allowed(ld, pos, pos), official)
        assert np.array_equal(attention_allowed(lf, pos, pos), official)
        a = np.asarray(render_pack(bd, max_num_tokens=mx, size=320, title="t"))
        b = np.asarray(render_pack(bf, size=320, title="t"))
        assert a.shape == (canvas_size(320)[1], canvas_size(320)[0], 3)
        assert np.array_equal(a, b)


def test_flex_and_dense_real_packer_same_picture(demo_setup):
    """The real stack on demo data, use_flex True vs False at the same seed: identical pictures."""
    out, tok = demo_setup
    with demo_loader(out, tok, 0, True) as lf, demo_loader(out, tok, 0, False) as ld:
        bf, bd = next(lf), next(ld)
    assert "split_lens" in bf and "nested_attention_masks" in bd
    assert pack_view(bd, DEMO_MAX_TOKENS).same_attention(pack_view(bf))
    assert np.array_equal(np.asarray(render_pack(bd, max_num_tokens=DEMO_MAX_TOKENS, size=256)),
                          np.asarray(render_pack(bf, size=256)))
    s = summarize_batch(bf, DEMO_MAX_TOKENS)
    assert s.totals["tokens"] == sum(x["tokens"] for x in s.samples) == bf["sequence_length"]


def test_render_is_deterministic():
    batch = load_case("c02_flex_extrap_3g2m_s14")["batches"][3]
    blobs = []
    for _ in range(2):
        buf = io.BytesIO()
        render_pack(batch, size=200, title="x").save(buf, format="PNG")
        blobs.append(buf.getvalue())
    assert blobs[0] == blobs[1]
    with Image.open(io.BytesIO(blobs[0])) as im:
        assert im.size == canvas_size(200)
    # one real position per pixel, inside that pixel's span of the axis
    view = pack_view(batch)
    pos = sampled_positions(view, 200)
    p = np.arange(200)
    assert ((pos >= p * view.length // 200) & (pos < np.maximum(p * view.length // 200 + 1,
                                                                  (p + 1) * view.length // 200))).all()


def test_energon_info_offline_on_converted_demo(demo_setup):
    """Megatron-Energon's own ``energon info`` reads a converted dataset offline (crude datasets need the
    ``--dataset-config`` that names a sample type; see README)."""
    energon = Path(sys.executable).with_name("energon")
    if not energon.exists():
        pytest.skip("energon CLI not installed next to this Python")
    out, _ = demo_setup
    ds = out / "energon" / "vlm_sft" / "demo_vlm"
    total = sum(json.loads((ds / ".nv-meta" / ".info.json").read_text())["shard_counts"].values())
    env = {k: v for k, v in os.environ.items() if not k.endswith("_PROXY") and not k.endswith("_proxy")}
    env.update(HF_HUB_OFFLINE="1", NO_PROXY="*")
    proc = subprocess.run([str(energon), "info", str(ds), "--dataset-config",
                           str(REPO / "configs" / "energon_crude_info.yaml")],
                          capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"({total:,} samples" in proc.stdout and "CrudeSample" in proc.stdout


def test_inspect_refuses_bad_input(tmp_path, caplog):
    """A missing config or a non-positive batch count is one clear error (exit status 2), nothing built."""
    assert cli.main(["inspect", "--config", str(tmp_path / "missing.yaml"), "--no-progress"]) == 2
    assert "does not exist" in caplog.text
    job = tmp_path / "job.yaml"
    job.write_text("demo_data: null\n")
    assert cli.main(["inspect", "--config", str(job), "--batches", "0", "--out", str(tmp_path / "o")]) == 2
    assert "--batches must be >= 1" in caplog.text
    assert not (tmp_path / "o").exists()
    # a job YAML that does not parse: one line naming file, line and column, for inspect and stats alike
    broken = tmp_path / "broken.yaml"
    broken.write_text("train:\n  train_iters: 3\n  bad: x: y\n")
    for cmd in (["inspect", "--no-progress"], ["stats", "--no-progress"]):
        caplog.clear()
        assert cli.main([*cmd, "--config", str(broken)]) == 2
        [line] = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert line == f"{broken}: not valid YAML: mapping values are not allowed here (line 3, column 9)"


def test_stats_and_inspect_on_a_damaged_dataset_are_one_line(demo_setup, tmp_path, caplog):
    """A shard cut short or deleted after conversion: ``stats`` and ``inspect`` exit 2 with one error line that
    names the shard and the remedy (not tarfile's / the OS's traceback)."""
    import shutil

    out, _ = demo_setup
    copy = tmp_path / "d"
    shutil.copytree(out / "energon", copy / "energon")
    for name in ("groups.yaml", "dataset_info.yaml"):
        (copy / name).write_text((out / name).read_text().replace(str(out), str(copy)))
    job = tmp_path / "job.yaml"
    job.write_text(JOB_YAML.format(out=copy, flex="true"))
    shard = copy / "energon" / "t2i_pretrain" / "demo_t2i" / "shards" / "shard-000000.tar"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 8])  # the first batch already reads past it
    runs = {"stats": ["stats", "--config", str(job), "--no-progress", "--histogram", ""],
            "inspect": ["inspect", "--config", str(job), "--no-progress", "--batches", "2",
                        "--out", str(tmp_path / "pictures")]}
    for what, argv in runs.items():
        caplog.clear()
        assert cli.main(argv) == 2, what
        [line] = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert line.startswith(f"damaged shard {shard}: cut at byte"), (what, line)
        assert "convert" in line and "\n" not in line, line
    whole = (out / "energon" / "t2i_pretrain" / "demo_t2i" / "shards" / "shard-000000.tar").read_bytes()
    shard.write_bytes(whole[:1024])  # cut at a tar block boundary, after the first member: tarfile sees an end
    caplog.clear()
    assert cli.main(runs["stats"]) == 2
    [line] = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert line.startswith(f"damaged shard {shard}: cut short at byte 1024, its index"), line  # not "re-index"
    shard.unlink()
    caplog.clear()
    assert cli.main(runs["stats"]) == 2
    [line] = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert line.startswith(f"shard {shard} of dataset") and "is missing" in line, line


def test_convert_refuses_bad_numbers_before_reading_anything(tmp_path, capsys, caplog):
    """Counts below their minimum are argparse's one-line usage error (exit 2); --num-parts > 1 needs --part."""
    base = ["convert", "t2i", "--data-dir", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]
    for flag, value, low in (("--samples-per-shard", "0", 1), ("--workers", "-3", 1), ("--num-parts", "0", 1),
                             ("--part", "-1", 0), ("--max-image-pixels", "0", 1)):
        with pytest.raises(SystemExit) as exc:
            cli.main([*base, flag, value])
        assert exc.value.code == 2
        assert f"argument {flag}: must be >= {low}, got {int(value)}" in capsys.readouterr().err
    assert cli.main([*base, "--num-parts", "3"]) == 2
    assert "--num-parts 3 needs --part (0 .. 2)" in caplog.text
    assert not (tmp_path / "o").exists()
