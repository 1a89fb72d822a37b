"""Paths in a config file resolve against that file's directory, and one validation pass reports every problem.

The job, ``bagel-data inspect`` and ``bagel-data stats`` load the job config the same way (``load_job_config``)
and go through the same validation pass (``job.config.validate_job`` → ``config.validate_data``), so they see the
same files and say the same thing about them, from any working directory.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bridge.models.bagel.data.config import ConfigError, load_config
from bridge.models.bagel.data.job.config import load_job_config, validate_job
from bridge.models.bagel.data.tools import cli
from _relative_project import project as _project

REPO = Path(__file__).resolve().parents[1]


def test_relative_paths_resolve_against_the_config_file(demo_setup, tmp_path, monkeypatch):
    job_yaml = _project(demo_setup, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_job_config("../project/configs/job.yaml")
    assert cfg.data.groups == str(tmp_path / "project" / "data" / "groups.yaml")
    assert cfg.data.dataset_info == str(tmp_path / "project" / "data" / "dataset_info.yaml")
    data = validate_job(cfg)  # the registry's relative energon_path entries: relative to data/
    out, _ = demo_setup
    for group in data.groups:
        for entry in group.datasets:
            assert os.path.isabs(entry.energon_path) and os.path.isdir(entry.energon_path), entry.energon_path
            assert os.path.samefile(entry.energon_path, out / "energon" / group.group.name / Path(entry.energon_path).name)
    # an override is typed in a shell: relative to the working directory
    cfg = load_job_config(job_yaml, ["data.groups=../project/data/groups.yaml"])
    assert cfg.data.groups == "../project/data/groups.yaml"
    assert validate_job(cfg).group_configs
    # the data-only loader of the Python API follows the same rule
    data_yaml = tmp_path / "project" / "configs" / "data.yaml"
    data_yaml.write_text(yaml.safe_dump({"groups": "../data/groups.yaml", "dataset_info": "../data/dataset_info.yaml"}))
    assert load_config("../project/configs/data.yaml").groups == cfg.data.groups.replace(
        "../project", str(tmp_path / "project"))
    # the CLI builds the job's real loader from there and packs a batch
    assert cli.main(["inspect", "--config", "../project/configs/job.yaml", "--batches", "1", "--out", "pics",
                     "--no-progress"]) == 0
    assert (elsewhere / "pics" / "batch_0000.png").is_file()


def _typo_and_bad_num_used(groups: dict) -> None:
    t2i = groups["t2i_pretrain"]
    t2i["image_transform_args"]["max_image_sise"] = t2i["image_transform_args"].pop("max_image_size")
    t2i["num_used_data"] = [1, 2]  # one dataset name, two counts
    groups["vlm_sft"]["num_used_dat"] = [3]  # a mistyped key in another group


def test_every_problem_in_one_config_error(demo_setup, tmp_path):
    job_yaml = _project(demo_setup, tmp_path, groups_edit=_typo_and_bad_num_used)
    cfg = load_job_config(job_yaml, ["train.train_iters=0", "data.packer.max_num_tokens=-1"])
    with pytest.raises(ConfigError) as info:
        validate_job(cfg)
    problems = info.value.problems
    text = str(info.value)
    for needle in ("train.train_iters: must be a positive integer", "packer.max_num_tokens: must be a positive",
                   "unknown ImageTransform argument(s) ['max_image_sise']",
                   "key 'num_used_data' has 2 entries but 'dataset_names' has 1", "key 'num_used_dat' is not"):
        assert sum(needle in p for p in problems) == 1, (needle, problems)
        assert needle in text
    assert len(text.splitlines()[0]) <= 300 and "5 problem(s)" in text.splitlines()[0], text


def _misspelt_energon_path(info: dict) -> None:
    entry = next(iter(info["vlm_sft"].values()))
    entry["energon_path"] += "_typo"


@pytest.mark.slow
def test_mistyped_energon_path_same_message_in_job_and_stats(demo_setup, tmp_path, caplog):
    job_yaml = _project(demo_setup, tmp_path, info_edit=_misspelt_energon_path)
    with pytest.raises(ConfigError) as info:
        validate_job(load_job_config(job_yaml))
    (message,) = info.value.problems
    assert "energon_path" in message and "_typo does not exist" in message and "dataset_info.yaml" in message
    with caplog.at_level(logging.ERROR):
        assert cli.main(["stats", "--config", str(job_yaml), "--histogram", "", "--no-progress"]) == 2
    assert message in caplog.text
    # the job itself (a world of one, no torchrun): the same message on its error line
    env = {**os.environ, "MASTER_PORT": "29617"}
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "pretrain_bagel.py"), "--config", str(job_yaml)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"error [rank 0]: ConfigError: {message}" in proc.stderr.replace("\n  ", " "), proc.stderr[-2000:]


def test_loader_from_mappings_equals_loader_from_files(demo_setup):
    """A training script's own config: the groups and the registry as mappings, no file written."""
    from bridge.models.bagel.data.build import build_bagel_train_loader
    from bridge.models.bagel.data.config import BagelDataConfig, PackerConfig, validate_data
    from bridge.models.bagel.data.packing import batch_digest

    out, tokenizer = demo_setup
    demo = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())["data"]
    packer = PackerConfig(**demo["packer"])
    groups = yaml.safe_load((out / "groups.yaml").read_text())
    info = yaml.safe_load((out / "dataset_info.yaml").read_text())
    from_files = BagelDataConfig(groups=str(out / "groups.yaml"), dataset_info=str(out / "dataset_info.yaml"),
                                 packer=packer)
    from_maps = BagelDataConfig(groups=groups, dataset_info=info, packer=packer)
    via_omegaconf = BagelDataConfig.from_omegaconf({"groups": groups, "dataset_info": info, "packer": demo["packer"]})
    assert via_omegaconf.groups == groups and via_omegaconf.dataset_info == info
    digests = []
    for cfg in (from_files, from_maps, via_omegaconf):
        loader = build_bagel_train_loader(cfg, tokenizer, (0, 1))
        try:
            digests.append([batch_digest(next(loader)) for _ in range(2)])
        finally:
            loader.close()
    assert digests[0] == digests[1] == digests[2]
    # a mapping's problems are named as such
    bad = {**groups, "t2i_pretrain": {**groups["t2i_pretrain"], "weight": -1}}
    with pytest.raises(ConfigError, match=r"^data\.groups \(mapping\): group 't2i_pretrain': key 'weight'"):
        validate_data(BagelDataConfig(groups=bad, dataset_info=info, packer=packer))
    with pytest.raises(ConfigError, match=r"groups: must be a path to a YAML/JSON file or a mapping, got int"):
        validate_data(BagelDataConfig(groups=3, dataset_info=info, packer=packer))
