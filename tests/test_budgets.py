"""Packer budgets vs the groups' transforms (issue 10 kind 2: cases B3, B4, B6) and ``bagel-data stats``."""

from __future__ import annotations

import dataclasses
import logging
import random
import re
import tarfile
from pathlib import Path

import pytest
import torch
import yaml

from bridge.models.bagel.data.config import budgets
from bridge.models.bagel.data.config.budgets import budget_issues, group_bounds, transform_extremes
from bridge.models.bagel.data.config.validate import validate_data
from bridge.models.bagel.data.config import BagelDataConfig, ConfigError, PackerConfig, load_grouped_yaml
from bridge.models.bagel.data.job.batch_check import check_batch
from packer_golden import load_case

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "configs" / "example.yaml"
T2I_1024 = {"max_image_size": 1024, "min_image_size": 512, "image_stride": 16}
REPORT_BUDGETS = dict(expected_num_tokens=4096, max_num_tokens=5120, max_num_tokens_per_sample=4096,
                      prefer_buffer_before=1024, use_flex=True)  # Bagel #157: lowered to avoid OOM


def _write_config(tmp_path: Path, groups: dict, packer: PackerConfig) -> BagelDataConfig:
    """A BagelDataConfig over ``groups`` (registry entries need not exist on disk: validate_data(readers=False))."""
    (tmp_path / "groups.yaml").write_text(yaml.safe_dump(groups, sort_keys=False))
    info = {g: {n: {"data_dir": "raw", "energon_path": str(tmp_path / n)} for n in v["dataset_names"]}
            for g, v in groups.items()}
    info["vlm_sft"] = {n: dict(e, jsonl_path="x.jsonl") for n, e in info.get("vlm_sft", {}).items()}
    info = {k: v for k, v in info.items() if v}
    (tmp_path / "dataset_info.yaml").write_text(yaml.safe_dump(info))
    return BagelDataConfig(groups=str(tmp_path / "groups.yaml"), dataset_info=str(tmp_path / "dataset_info.yaml"),
                           packer=packer)


@pytest.fixture(autouse=True)
def _fresh_warnings():
    budgets._warned.clear()
    yield
    budgets._warned.clear()


# --------------------------------------------------------------------------------------------------
# B4, B6, B3 at config time


def test_b4_default_max_latent_size_with_1024px_t2i_is_refused_by_load_groups(tmp_path: Path) -> None:
    cfg = _write_config(tmp_path, {"t2i_pretrain": {"dataset_names": ["t2i"], "weight": 1, "is_mandatory": True,
                                                    "image_transform_args": T2I_1024}},
                        PackerConfig(**REPORT_BUDGETS))  # max_latent_size left at its default 32
    with pytest.raises(ConfigError) as exc:
        validate_data(cfg, readers=False).groups
    msg = str(exc.value)
    assert f"{tmp_path / 'groups.yaml'}: group 't2i_pretrain'" in msg
    assert "64 latent patches per side" in msg and "packer.max_latent_size is 32" in msg
    assert "Set packer.max_latent_size >= 64" in msg and "max_image_size <= 512" in msg
    cfg.packer.max_latent_size = 64
    assert [g.group.name for g in validate_data(cfg, readers=False).groups] == ["t2i_pretrain"]
    cfg.packer.max_latent_size, cfg.packer.interpolate_pos = 32, True  # interpolated ids always stay in the table
    validate_data(cfg, readers=False).groups


def test_b6_two_mandatory_groups_over_max_num_tokens_are_refused(tmp_path: Path) -> None:
    groups = {"t2i_pretrain": {"dataset_names": ["t2i"], "weight": 1, "is_mandatory": True,
                               "image_transform_args": {"max_image_size": 192, "min_image_size": 32,
                                                        "image_stride": 16}},
              "vlm_sft": {"dataset_names": ["sft"], "weight": 1, "is_mandatory": True,
                          "image_transform_args": {"max_image_size": 56, "min_image_size": 28, "image_stride": 14}}}
    packer = PackerConfig(expected_num_tokens=256, max_num_tokens=320, max_num_tokens_per_sample=256,
                          prefer_buffer_before=64, use_flex=True, max_latent_size=64)
    cfg = _write_config(tmp_path, groups, packer)
    with pytest.raises(ConfigError) as exc:
        validate_data(cfg, readers=False).groups
    msg = str(exc.value)
    assert "2 mandatory groups ['t2i_pretrain', 'vlm_sft']" in msg and "510 > max_num_tokens 320" in msg
    assert "packer.max_num_tokens_per_sample <= 161" in msg and "packer.max_num_tokens >= 510" in msg
    cfg.packer.max_num_tokens_per_sample = 161  # 2 x 160 = 320 fits
    validate_data(cfg, readers=False).groups
    groups["vlm_sft"]["is_mandatory"] = False
    validate_data(_write_config(tmp_path, groups, dataclasses.replace(packer)), readers=False)


def test_b3_largest_image_over_the_per_sample_limit_warns_at_config_time(tmp_path: Path, caplog) -> None:
    cfg = _write_config(tmp_path, {"t2i_pretrain": {"dataset_names": ["t2i"], "weight": 1, "is_mandatory": True,
                                                    "image_transform_args": T2I_1024}},
                        PackerConfig(**REPORT_BUDGETS, max_latent_size=64))
    with caplog.at_level(logging.WARNING, logger="bridge.models.bagel.data.config.budgets"):
        validate_data(cfg, readers=False).groups
        validate_data(cfg, readers=False).groups  # the builder and the job both load the groups: one warning, not two
    warn = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warn) == 1, warn
    assert "group 't2i_pretrain'" in warn[0] and "1024x1024 px = 4096 latent tokens" in warn[0]
    assert ">= 4100 tokens, over packer.max_num_tokens_per_sample 4096 (kept: < 4096)" in warn[0]
    assert "never yields a batch" in warn[0] and "to >= 4101" in warn[0]


def test_b3_no_sample_can_fit_is_refused(tmp_path: Path) -> None:
    """When even the smallest image the transform can produce is over the limit, nothing can ever be packed."""
    cfg = _write_config(tmp_path, {"t2i_pretrain": {"dataset_names": ["t2i"], "weight": 1, "is_mandatory": True,
                                                    "image_transform_args": T2I_1024}},
                        PackerConfig(expected_num_tokens=60, max_num_tokens=64, max_num_tokens_per_sample=60,
                                     prefer_buffer_before=30, max_latent_size=64))
    with pytest.raises(ConfigError, match=r"even the smallest sample .* estimated at 68 tokens.*never yields a batch"):
        validate_data(cfg, readers=False).groups


# --------------------------------------------------------------------------------------------------
# configs/example.yaml transforms: which budgets pass, warn, fail


def test_example_transform_extremes() -> None:
    t2i, edit, vlm = load_grouped_yaml(EXAMPLE)
    ex = transform_extremes(t2i.transform())
    assert (ex.max_side, ex.max_side_px, ex.max_tokens, ex.max_hw) == (64, 1024, 4096, (1024, 1024))
    assert transform_extremes(edit.vit_transform()).max_side == 37          # 518 / 14
    assert transform_extremes(vlm.transform()).max_side == 70               # 980 / 14 = the ViT table side
    assert (group_bounds(t2i).largest_image, group_bounds(edit).largest_image, group_bounds(vlm).largest_image) == (
        4100, 2 * 4096 + 1369 + 8, 4900 + 1 + 4)
    # the probe grid reaches the analytic maximum: no input gives a larger output
    t = t2i.transform()
    assert max(max(t.target_size(w, h)) for w in range(1, 3000, 37) for h in range(1, 3000, 41)) <= 1024


BAGEL = dict(expected_num_tokens=32768, max_num_tokens=36864, max_num_tokens_per_sample=16384)


@pytest.mark.parametrize("knobs, errors, warnings", [
    (dict(BAGEL, max_latent_size=64), [], []),
    (dict(BAGEL, max_latent_size=64, use_flex=True), [], []),
    (dict(expected_num_tokens=16384, max_num_tokens=20480, max_num_tokens_per_sample=10240, prefer_buffer_before=4096,
          max_latent_size=64, use_flex=True), [], ["max_num_tokens_per_sample"]),  # 12-frame videos: >= 10395
    (dict(BAGEL), ["max_latent_size", "max_latent_size"], []),                       # B4: official DataConfig default
    (dict(BAGEL, max_latent_size=32, interpolate_pos=True), [], []),
    (dict(BAGEL, max_latent_size=64, max_num_patch_per_side=64), ["max_num_patch_per_side"], []),
    (dict(expected_num_tokens=10240, max_num_tokens=11520, max_num_tokens_per_sample=10240, prefer_buffer_before=4096,
          max_latent_size=64), ["max_num_tokens_per_sample"], ["max_num_tokens_per_sample"]),  # TRAIN.md: B6, video
    (dict(REPORT_BUDGETS, max_latent_size=64), ["max_num_tokens_per_sample"],       # Bagel #157: B6 + B3
     ["max_num_tokens_per_sample"] * 4),
    (dict(BAGEL, max_num_tokens=36800, max_latent_size=64, use_flex=True), [], ["max_num_tokens"]),
    (dict(BAGEL, max_num_tokens=36800, max_latent_size=64), [], []),               # dense: no flex blocks
])
def test_example_yaml_budgets(knobs: dict, errors: list, warnings: list) -> None:
    packer = PackerConfig(**knobs)
    packer.validate()
    issues = budget_issues(packer, load_grouped_yaml(EXAMPLE), source=str(EXAMPLE))
    assert [i.key.split(".")[-1] for i in issues if i.level == "error"] == errors, issues
    assert [i.key.split(".")[-1] for i in issues if i.level == "warning"] == warnings, issues
    assert all(str(EXAMPLE) in i.message or i.key == "packer.max_num_tokens" for i in issues)


def test_stride_not_a_multiple_of_the_patch_is_refused() -> None:
    groups = load_grouped_yaml({"t2i_pretrain": {"dataset_names": ["t"], "weight": 1,
                                                 "image_transform_args": dict(T2I_1024, image_stride=24)}})
    issues = budget_issues(PackerConfig(max_latent_size=64), groups)
    assert issues[0].level == "error" and "image_stride 24 is not a multiple of packer.vae_image_downsample 16" in str(
        issues[0])


# --------------------------------------------------------------------------------------------------
# check_batch: position ids past the tables


def test_check_batch_flags_out_of_range_position_ids() -> None:
    case = load_case("c02_flex_extrap_3g2m_s14")
    batch, cfg = dict(case["batches"][0]), case["config"]
    kw = dict(max_num_tokens=cfg["max_num_tokens"], use_flex=True)
    sides = dict(max_latent_size=cfg["max_latent_size"], max_num_patch_per_side=cfg["max_num_patch_per_side"])
    assert check_batch(batch, **kw, **sides) == []
    lat_max = int(batch["packed_latent_position_ids"].max())
    small = int(lat_max ** 0.5)  # a table whose side squared does not cover the largest id
    problems = check_batch(batch, **kw, max_latent_size=small)
    assert len(problems) == 1 and "latent position ids outside [0, " in problems[0] and "max_latent_size" in problems[0]
    vit = dict(batch, packed_vit_position_ids=batch["packed_vit_position_ids"].clone())
    vit["packed_vit_position_ids"][0] = cfg["max_num_patch_per_side"] ** 2
    problems = check_batch(vit, **kw, **sides)
    assert problems == [f"1 ViT position ids outside [0, {cfg['max_num_patch_per_side'] ** 2}) (max "
                        f"{cfg['max_num_patch_per_side'] ** 2}; the table is max_num_patch_per_side "
                        f"{cfg['max_num_patch_per_side']} squared): raise max_num_patch_per_side or lower the "
                        "group's max_image_size"]
    assert check_batch(vit, **kw) == []  # without the table sides nothing is checked (old callers)


# --------------------------------------------------------------------------------------------------
# bagel-data stats


def _brute_force(ds_root: Path, group: str, tok, ctx_args: dict) -> tuple[int, list[tuple[int, list]]]:
    """Count the samples in the shards and cook each one with the real cooker core (pixel decode, the transform's
    size rule) for several random choices: the packer's estimate of each draw."""
    from bridge.models.bagel.data.energon.cooking.common import CookContext, Draws, DropSample, load_meta
    from bridge.models.bagel.data.energon.cooking.edit import cook_edit_core
    from bridge.models.bagel.data.energon.cooking.t2i import cook_t2i_core
    from bridge.models.bagel.data.energon.cooking.vlm import cook_vlm_core
    from bridge.models.bagel.data.transforms import ImageTransform

    class ShapeOnly(ImageTransform):
        """The real size rule on the really decoded image; skips only the bicubic resample (output (3, h, w))."""

        def __call__(self, img, img_num=1):
            h, w = self.target_size(img.width, img.height, img_num)
            return torch.empty(3, h, w)

    core = {"t2i_pretrain": cook_t2i_core, "unified_edit": cook_edit_core, "vlm_sft": cook_vlm_core}[group]
    from bridge.models.bagel.data.energon.cooking.video import FrameSampler

    ctx = CookContext(group, tok, ShapeOnly(**ctx_args["image_transform_args"]),
                      ShapeOnly(**ctx_args["vit_image_transform_args"])
                      if ctx_args.get("vit_image_transform_args") else None,
                      frame_sampler=FrameSampler.of(ctx_args.get("frame_sampler_args")))  # the demo's video lines
    crude: dict[str, dict] = {}
    for shard in sorted((ds_root / "shards").glob("*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                key, _, part = m.name.partition(".")
                crude.setdefault(key, {"__key__": key})[part] = tar.extractfile(m).read()
    cooked = []
    for key in sorted(crude):
        ests = []
        for seed in range(6):  # several random choices (caption, edit start/end/variant/instructions)
            try:
                f = core(crude[key], load_meta(crude[key], group), ctx, Draws(rng=random.Random(seed)))
                ests.append(f["num_tokens"] + 2 * len(f["sequence_plan"]))
            except DropSample:
                ests.append(None)
        cooked.append((key, ests))
    return len(crude), cooked


def test_stats_counts_equal_a_brute_force_count_over_the_demo_data(demo_setup, tmp_path: Path) -> None:
    from bridge.models.bagel.data.tools.budget_stats import collect_stats
    from bridge.models.bagel.data.config import load_dataset_info, resolve_groups
    from bridge.models.bagel.data.energon.layout import load_manifest

    out, tok = demo_setup
    groups = resolve_groups(load_grouped_yaml(out / "groups.yaml"), load_dataset_info(out / "dataset_info.yaml"))
    limit = 2048
    packer = PackerConfig(expected_num_tokens=8192, max_num_tokens=10240, max_num_tokens_per_sample=limit,
                          prefer_buffer_before=2048, max_latent_size=64, use_flex=True)
    report = collect_stats(groups, packer, tok, progress=False, histogram=str(tmp_path / "h.png"), sim_packs=50)
    raw = yaml.safe_load((out / "groups.yaml").read_text())
    for g in report.groups:
        (ds,) = g.datasets
        n, cooked = _brute_force(Path(ds.path), g.group.name, tok, raw[g.group.name])
        assert ds.samples == ds.read == n == load_manifest(ds.path)["num_samples"]
        usable = [(k, e) for k, e in cooked if all(x is not None for x in e)]
        assert sum(ds.unusable.values()) == n - len(usable) and len(ds.estimates) == len(usable)
        over_always = over_some = 0
        for (key, real), est in zip(usable, ds.estimates):
            assert all(est.lo <= r <= est.hi for r in real), (g.group.name, key, real, est)
            if g.group.name == "vlm_sft" and int(key) < 48:  # image records: no random choice
                assert real[0] == est.lo == est.hi
            elif g.group.name == "vlm_sft":  # the demo's video lines: the frame count is drawn
                assert est.lo < est.hi, (key, est)
            is_over = (lambda r: r >= limit) if g.group.is_mandatory else (lambda r: r > limit)  # noqa: E731
            over = [is_over(r) for r in real]
            if all(over) and not is_over(est.lo):  # a video's six draws missed its shortest frame count
                over_some += 1
                continue
            over_always += all(over)
            over_some += any(over) and not all(over)
        always, some = g.over(limit)
        assert always >= over_always and always + some >= over_always + over_some  # lo/hi bound every draw
        assert always + some > 0 or g.group.name == "t2i_pretrain"  # the limit bites in the demo's edit/vlm data
    text = report.format()
    assert "no pixel decode" in text and "budget advisor" in text and "t2i_pretrain/demo_t2i" in text
    assert (tmp_path / "h.png").stat().st_size > 0 and not report.impossible


def test_stats_advisor_flags_an_impossible_configuration(demo_setup, tmp_path: Path) -> None:
    """B3 on real data: every demo t2i image is >= 1376 latent tokens, a 1024-token per-sample limit fits none."""
    from bridge.models.bagel.data.tools.budget_stats import collect_stats
    from bridge.models.bagel.data.config import load_dataset_info, resolve_groups

    out, tok = demo_setup
    groups = resolve_groups(load_grouped_yaml(out / "groups.yaml"), load_dataset_info(out / "dataset_info.yaml"))
    packer = PackerConfig(expected_num_tokens=2048, max_num_tokens=2048, max_num_tokens_per_sample=1024,
                          prefer_buffer_before=512, max_latent_size=32, use_flex=True)
    report = collect_stats(groups, packer, tok, progress=False, sim_packs=20)
    assert report.impossible
    text = report.format()
    assert "mandatory group 't2i_pretrain': every one of its 64 samples" in text and "never yields a batch" in text
    assert "max_latent_size x vae_image_downsample = 32 x 16 = 512 px" in text   # largest VAE image over the table
    configured = report.advice[0]
    assert configured[0].label == "configured" and configured[1].impossible and "never" in text
    assert any(r.impossible is None and not [i for i in issues if i.level == "error"] for _, r, issues in report.advice)


def test_simulate_packing_replays_the_official_loop() -> None:
    from bridge.models.bagel.data.tools.budget_stats import simulate_packing

    packer = PackerConfig(expected_num_tokens=900, max_num_tokens=1000, max_num_tokens_per_sample=500,
                          prefer_buffer_before=100)
    r = simulate_packing([[300] * 5, [200, 600] * 5], [0, 1], [True, False], ["a", "b"], packer, packs=10)
    # every pack: mandatory 300, then draws from b only (weight 0 for a): 200s (600s dropped) until >= 900
    assert r.impossible is None and r.packs == 10 and r.fill == pytest.approx(0.9) and r.samples_per_pack == 4
    assert r.over_limit > 0 and r.flushed == 0
    r = simulate_packing([[600] * 5], [1], [True], ["a"], packer)
    assert r.impossible and "never yields a batch" in r.impossible


def test_stats_cli_on_a_job_config(demo_setup, tmp_path: Path, monkeypatch, capsys) -> None:
    """``bagel-data stats --config JOB.yaml [overrides]``: report on stdout, PNG written, exit 3 when impossible, 1
    when it reports an ERROR."""
    from bridge.models.bagel.data.tools import cli
    from bridge.models.bagel.data import tokenizer

    out, tok = demo_setup
    monkeypatch.setattr(tokenizer, "load_tokenizer", lambda *_: tok)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"data": {
        "groups": str(out / "groups.yaml"), "dataset_info": str(out / "dataset_info.yaml"),
        "packer": {"expected_num_tokens": 16384, "max_num_tokens": 20480, "max_num_tokens_per_sample": 10240,
                   "prefer_buffer_before": 4096, "use_flex": True, "max_latent_size": 64}}}))
    png = tmp_path / "h.png"
    assert cli.main(["stats", "--config", str(job), "--histogram", str(png), "--no-progress",
                     "--max-samples", "5"]) == 0
    text = capsys.readouterr().out
    assert "SAMPLED" in text and f"histogram: {png}" in text and png.exists()
    assert re.search(r"\nunified_edit/demo_edit +32 +5 ", text), text
    assert "findings: none" in text and "configured" in text
    rc = cli.main(["stats", "--config", str(job), "--histogram", "", "--no-progress",
                   "data.packer.max_num_tokens_per_sample=1024", "data.packer.expected_num_tokens=2048",
                   "data.packer.max_num_tokens=2048", "data.packer.prefer_buffer_before=512"])
    text = capsys.readouterr().out
    assert rc == 3 and "ERROR: mandatory group 't2i_pretrain': every one of its 64 samples" in text
    assert "histogram:" not in text
    # an ERROR the job refuses at start, though batches could be packed: not exit 0 either
    rc = cli.main(["stats", "--config", str(job), "--histogram", "", "--no-progress", "--max-samples", "5",
                   "data.packer.max_latent_size=32"])
    text = capsys.readouterr().out
    assert rc == 1 and "ERROR: " in text and "packer.max_latent_size is 32" in text, (rc, text[-2000:])
