"""Config loading: official grouped YAML, dataset registry, packer knobs, OmegaConf top config."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from bridge.models.bagel.data.config import (
    KNOWN_GROUPS,
    BagelDataConfig,
    ConfigError,
    DatasetInfoEntry,
    PackerConfig,
    load_config,
    load_dataset_info,
    load_grouped_yaml,
    resolve_groups,
)
from bridge.models.bagel.data.config.validate import validate_data

EXAMPLE = Path(__file__).resolve().parents[1] / "configs" / "example.yaml"

INFO = {
    "t2i_pretrain": {"t2i": {"data_dir": "bagel_example/t2i", "num_files": 10, "num_total_samples": 1000}},
    "unified_edit": {"seedxedit_multi": {"data_dir": "bagel_example/editing/seedxedit_multi",
                                         "parquet_info_path": "bagel_example/editing/parquet_info/x.json",
                                         "num_files": 10, "num_total_samples": 1000}},
    "vlm_sft": {"llava_ov": {"data_dir": "bagel_example/vlm/images",
                             "jsonl_path": "bagel_example/vlm/llava_ov_si.jsonl", "num_total_samples": 1000,
                             "energon_path": "/data/energon/llava_ov"}},
}


def _example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


# --- grouped YAML -----------------------------------------------------------------------------------

def test_example_yaml_matches_official_table():
    groups = load_grouped_yaml(EXAMPLE)
    assert [g.name for g in groups] == list(KNOWN_GROUPS) == ["t2i_pretrain", "unified_edit", "vlm_sft"]
    t2i, edit, vlm = groups
    assert (t2i.dataset_names, t2i.is_mandatory, t2i.weight, t2i.num_used_data) == (["t2i"], True, 1.0, [10])
    assert t2i.image_transform_args == {"image_stride": 16, "max_image_size": 1024, "min_image_size": 512}
    assert t2i.transform().target_size(640, 480) == (512, 688)
    assert (edit.dataset_names, edit.is_mandatory, edit.num_used_data) == (["seedxedit_multi"], False, [10])
    assert edit.vit_transform().stride == 14 and edit.vit_transform().max_size == 518
    assert t2i.vit_transform() is None
    assert (vlm.dataset_names, vlm.is_mandatory, vlm.num_used_data) == (["llava_ov"], True, [1000])
    assert vlm.transform().max_pixels == 2_007_040
    assert vlm.frame_sampler_args == {"max_num_frames": 12, "min_num_frames": 8}
    assert (vlm.shuffle_lines, vlm.shuffle_seed) == (True, 0)
    assert all(g.resume_data_status for g in groups)


def test_input_dict_not_mutated():
    data = _example()
    before = copy.deepcopy(data)
    groups = load_grouped_yaml(data)
    assert data == before
    groups[2].frame_sampler_args["max_num_frames"] = 99
    groups[0].image_transform_args["image_stride"] = 8
    assert data == before
    assert [g.name for g in load_grouped_yaml(data)] == list(KNOWN_GROUPS)   # loadable twice


def test_defaults_for_optional_keys():
    (g,) = load_grouped_yaml({"t2i_pretrain": {"dataset_names": ["a"], "weight": 2}})
    assert (g.is_mandatory, g.resume_data_status, g.num_used_data, g.image_transform_args, g.shuffle_lines) == (
        False, True, None, None, False)


def _write(tmp_path: Path, data, name="groups.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d.update(bogus_group={"dataset_names": ["x"]}), r"group 'bogus_group': unknown group"),
        (lambda d: d["t2i_pretrain"].pop("dataset_names"), r"group 't2i_pretrain': missing required key 'dataset_names'"),
        (lambda d: d["vlm_sft"].update(dataset_names="llava_ov"), r"group 'vlm_sft': key 'dataset_names'"),
        (lambda d: d["vlm_sft"].update(num_used_data=[1, 2]), r"group 'vlm_sft': key 'num_used_data' has 2 entries"),
        (lambda d: d["vlm_sft"].update(num_used_data=[-1]), r"group 'vlm_sft': key 'num_used_data'"),
        (lambda d: [g.update(weight=0) for g in d.values()], r"weights sum to 0"),
        (lambda d: d["unified_edit"].update(weight=-1), r"group 'unified_edit': key 'weight'"),
        (lambda d: d["unified_edit"].update(weight="heavy"), r"group 'unified_edit': key 'weight'"),
        (lambda d: d["t2i_pretrain"].update(is_mandatory="yes please"), r"group 't2i_pretrain': key 'is_mandatory'"),
        (lambda d: d["t2i_pretrain"].update(resume_data_status=1), r"key 'resume_data_status'"),
        (lambda d: d["vlm_sft"].update(shuffle_lines="true"), r"group 'vlm_sft': key 'shuffle_lines' must be of type bool"),
        (lambda d: d["vlm_sft"].update(shuffle_seed=1.5), r"group 'vlm_sft': key 'shuffle_seed' must be of type int"),
        (lambda d: d["vlm_sft"].update(frame_sampler_args=[12, 8]), r"key 'frame_sampler_args' must be a mapping"),
        (lambda d: d["vlm_sft"].update(frame_sampler_args={"fps": 2}), r"group 'vlm_sft': key 'frame_sampler_args'"),
        (lambda d: d["vlm_sft"].update(json_dir_list=["x"]), r"group 'vlm_sft': key 'json_dir_list' is not an official"),
        (lambda d: d["t2i_pretrain"].update(shuffle_lines=True), r"group 't2i_pretrain': key 'shuffle_lines' applies only"),
        (lambda d: d["unified_edit"].update(frame_sampler_args={"max_num_frames": 2}),
         r"group 'unified_edit': key 'frame_sampler_args' applies only"),
        (lambda d: d["vlm_sft"].update(resume_data_status=False), r"group 'vlm_sft': key 'resume_data_status': false"),
        (lambda d: d["t2i_pretrain"].update(num_used_data=[0]), r"group 't2i_pretrain': key 'num_used_data' selects no"),
        (lambda d: d["t2i_pretrain"]["image_transform_args"].update(stride=16),
         r"group 't2i_pretrain': key 'image_transform_args': unknown ImageTransform argument\(s\) \['stride'\]"),
        (lambda d: d["unified_edit"]["vit_image_transform_args"].update(image_stride=0),
         r"group 'unified_edit': key 'vit_image_transform_args': .*image_stride"),
        (lambda d: d.update(vlm_sft=["not", "a", "mapping"]), r"group 'vlm_sft': must be a mapping"),
    ],
)
def test_grouped_yaml_errors_name_file_and_key(tmp_path, mutate, match):
    data = _example()
    mutate(data)
    path = _write(tmp_path, data)
    with pytest.raises(ConfigError, match=match) as info:
        load_grouped_yaml(path)
    assert str(path) in str(info.value)
    with pytest.raises(ConfigError, match=match) as info:          # dict input: named by `source`
        load_grouped_yaml(data, source="my-groups")
    assert str(info.value).startswith("my-groups: ")


def test_grouped_yaml_file_level_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_grouped_yaml(tmp_path / "missing.yaml")
    dup = tmp_path / "dup.yaml"
    dup.write_text("vlm_sft:\n  dataset_names: [a]\n  weight: 1\nvlm_sft:\n  dataset_names: [b]\n")
    with pytest.raises(ConfigError, match=rf"{dup}: duplicate key 'vlm_sft' \(line 4\)"):
        load_grouped_yaml(dup)
    bad = tmp_path / "bad.yaml"
    bad.write_text("t2i_pretrain:\n  dataset_names: [a\n  weight: 1\n")
    with pytest.raises(ConfigError) as exc:
        load_grouped_yaml(bad)
    # one line: the file, what and where (not PyYAML's snippet naming "<unicode string>")
    assert str(exc.value) == (f"{bad}: not valid YAML: while parsing a flow sequence; expected ',' or ']', but "
                              "got ':' (line 3, column 9)")
    lst = _write(tmp_path, ["t2i_pretrain"], "list.yaml")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_grouped_yaml(lst)
    with pytest.raises(ConfigError, match="no groups defined"):
        load_grouped_yaml({})


def test_unknown_group_key_is_refused_naming_file_group_key(tmp_path, caplog):
    data = _example()
    data["vlm_sft"]["max_video_len"] = 5
    path = _write(tmp_path, data)
    with pytest.raises(ConfigError, match=r"group 'vlm_sft': key 'max_video_len' is not an official") as info:
        load_grouped_yaml(path)
    assert str(path) in str(info.value)
    assert "passing" not in caplog.text      # never a "passed through" warning


# --- dataset registry ---------------------------------------------------------------------------------

def test_dataset_info_yaml_and_json_and_resolve(tmp_path):
    ypath = _write(tmp_path, INFO, "info.yaml")
    jpath = tmp_path / "info.json"
    jpath.write_text(json.dumps(INFO))
    before = copy.deepcopy(INFO)
    for src in (ypath, jpath, INFO):
        info = load_dataset_info(src)
        assert info["vlm_sft"]["llava_ov"] == DatasetInfoEntry(
            data_dir="bagel_example/vlm/images", jsonl_path="bagel_example/vlm/llava_ov_si.jsonl",
            num_total_samples=1000, energon_path="/data/energon/llava_ov")
        assert info["t2i_pretrain"]["t2i"].energon_path is None
    assert INFO == before
    resolved = resolve_groups(load_grouped_yaml(EXAMPLE), load_dataset_info(INFO))
    assert [(r.group.name, [d.data_dir for d in r.datasets]) for r in resolved] == [
        ("t2i_pretrain", ["bagel_example/t2i"]),
        ("unified_edit", ["bagel_example/editing/seedxedit_multi"]),
        ("vlm_sft", ["bagel_example/vlm/images"]),
    ]


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d["vlm_sft"]["llava_ov"].pop("data_dir"), r"vlm_sft\.llava_ov: missing required key 'data_dir'"),
        (lambda d: d["vlm_sft"]["llava_ov"].pop("jsonl_path"), r"vlm_sft\.llava_ov: missing required key 'jsonl_path'"),
        (lambda d: d["unified_edit"]["seedxedit_multi"].pop("parquet_info_path"),
         r"unified_edit\.seedxedit_multi: missing required key 'parquet_info_path'"),
        (lambda d: d["t2i_pretrain"]["t2i"].update(data_path="x"), r"t2i_pretrain\.t2i: unknown key\(s\) \['data_path'\]"),
        (lambda d: d["t2i_pretrain"]["t2i"].update(num_files="ten"), r"t2i_pretrain\.t2i: key 'num_files'"),
        (lambda d: d["t2i_pretrain"]["t2i"].update(data_dir=["a"]), r"t2i_pretrain\.t2i: key 'data_dir'"),
        (lambda d: d.update(t2i={"t2i": {"data_dir": "x"}}), r"unknown group 't2i'"),
        (lambda d: d.update(vlm_sft=["llava_ov"]), r"group 'vlm_sft' must map dataset names"),
    ],
)
def test_dataset_info_errors_name_file_group_and_key(tmp_path, mutate, match):
    data = copy.deepcopy(INFO)
    mutate(data)
    path = _write(tmp_path, data, "info.yaml")
    with pytest.raises(ConfigError, match=match) as info:
        load_dataset_info(path)
    assert str(info.value).startswith(f"{path}: ")


def test_resolve_groups_errors():
    groups = load_grouped_yaml(EXAMPLE)
    info = load_dataset_info(INFO)
    del info["unified_edit"]
    with pytest.raises(ConfigError, match=r"info\.yaml: no entries for group 'unified_edit'"):
        resolve_groups(groups, info, source="info.yaml")
    info = load_dataset_info(INFO)
    groups[2].dataset_names.append("sharegpt4v")
    with pytest.raises(ConfigError, match=r"group 'vlm_sft': dataset name\(s\) \['sharegpt4v'\] not registered"):
        resolve_groups(groups, info)


# --- packer -------------------------------------------------------------------------------------------

def test_packer_defaults_and_from_mapping():
    p = PackerConfig()
    assert dataclasses.asdict(p) == {
        "expected_num_tokens": 32768, "max_num_tokens_per_sample": 16384, "max_num_tokens": 36864,
        "prefer_buffer_before": 16384, "max_buffer_size": 50, "interpolate_pos": False, "use_flex": False,
        "text_cond_dropout_prob": 0.1, "vit_cond_dropout_prob": 0.4, "vae_cond_dropout_prob": 0.1,
        "vae_image_downsample": 16, "max_latent_size": 32, "vit_patch_size": 14, "max_num_patch_per_side": 70,
        "max_consecutive_drops": 100, "lossless": False, "strategy": "official",
        "balance": {"target_tokens": None, "lookahead": 3.0, "max_wait": 8},
        "cost": {"hidden_size": 3584, "num_layers": 28, "num_attention_heads": 28, "num_query_groups": 4,
                 "ffn_hidden_size": 18944, "vit_hidden_size": 1152, "vit_num_layers": 26, "vit_ffn_hidden_size": 4304,
                 "vae_flops_per_token": 0.0},
    }
    assert PackerConfig.from_mapping({"use_flex": True}) == PackerConfig(use_flex=True)
    with pytest.raises(ConfigError, match=r"unknown packer key\(s\) \['seed'\]"):
        PackerConfig.from_mapping({"use_flex": True, "seed": 3})  # a misspelt or foreign key is never dropped
    assert PackerConfig.from_mapping({"use_flex": True, "seed": 3}, ignore=("seed",)) == PackerConfig(use_flex=True)
    PackerConfig(expected_num_tokens=10240, max_num_tokens=11520, max_num_tokens_per_sample=10240,
                 prefer_buffer_before=10240).validate()            # TRAIN.md fine-tuning recipe


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"prefer_buffer_before": 36864}, "packer.prefer_buffer_before .* must be smaller than max_num_tokens"),
        ({"max_num_tokens": 0}, "packer.max_num_tokens: must be a positive integer"),
        ({"expected_num_tokens": -5}, "packer.expected_num_tokens: must be a positive integer"),
        ({"max_buffer_size": -1}, "packer.max_buffer_size"),
        ({"vit_cond_dropout_prob": 1.5}, r"packer.vit_cond_dropout_prob: must be a probability in \[0, 1\]"),
        ({"text_cond_dropout_prob": -0.1}, "packer.text_cond_dropout_prob"),
        ({"expected_num_tokens": 40000}, "expected_num_tokens .* exceeds max_num_tokens"),
        ({"max_num_tokens_per_sample": 40000}, "max_num_tokens_per_sample .* exceeds max_num_tokens"),
        ({"use_flex": "yes"}, "packer.use_flex: must be a bool"),
        ({"vit_patch_size": True}, "packer.vit_patch_size"),
    ],
)
def test_packer_validation(changes, match):
    with pytest.raises(ConfigError, match=match):
        dataclasses.replace(PackerConfig(), **changes).validate()


# --- top-level config ---------------------------------------------------------------------------------

def test_load_config_yaml_and_overrides(tmp_path):
    path = _write(tmp_path, {"groups": str(EXAMPLE), "dataset_info": "info.yaml", "seed": 7,
                             "packer": {"use_flex": True, "max_latent_size": 64}}, "data.yaml")
    cfg = load_config(path, ["packer.expected_num_tokens=20000", "num_workers=2", "tokenizer=qwen2-offline"])
    assert isinstance(cfg, BagelDataConfig) and isinstance(cfg.packer, PackerConfig)
    assert (cfg.seed, cfg.num_workers, cfg.tokenizer) == (7, 2, "qwen2-offline")
    assert (cfg.packer.use_flex, cfg.packer.max_latent_size, cfg.packer.expected_num_tokens) == (True, 64, 20000)
    assert cfg.packer.max_num_tokens == 36864
    info = _write(tmp_path, INFO, "info.yaml")
    cfg = load_config(path, [f"dataset_info={info}"])
    assert [r.group.name for r in validate_data(cfg, readers=False).groups] == list(KNOWN_GROUPS)
    assert BagelDataConfig.from_omegaconf({"groups": "g", "dataset_info": "i"}).seed == 42


def test_load_config_errors_name_key_and_file(tmp_path):
    base = {"groups": "g.yaml", "dataset_info": "i.yaml"}
    path = _write(tmp_path, {**base, "packer": {"max_tokens": 5}}, "data.yaml")
    with pytest.raises(ConfigError, match=rf"{path}: key 'packer.max_tokens': Key 'max_tokens' not in 'PackerConfig'"):
        load_config(path)
    path = _write(tmp_path, base, "ok.yaml")
    with pytest.raises(ConfigError, match=r"key 'sed'"):
        load_config(path, ["sed=3"])
    with pytest.raises(ConfigError, match=r"key 'packer.max_num_tokens': .*could not be converted"):
        load_config(path, ["packer.max_num_tokens=lots"])
    with pytest.raises(ConfigError, match=r"packer.prefer_buffer_before"):
        load_config(path, ["packer.prefer_buffer_before=99999"])
    with pytest.raises(ConfigError, match=r"num_workers"):
        load_config(path, ["num_workers=-1"])
    with pytest.raises(ConfigError, match=r"prefetch_start: must be one of \['fork', 'forkserver'\], got 'spawn'"):
        load_config(path, ["prefetch_start=spawn"])
    assert load_config(path, ["prefetch_start=forkserver"]).prefetch_start == "forkserver"
    with pytest.raises(ConfigError, match=r"required key 'dataset_info' is not set"):
        load_config(None, ["groups=g.yaml"])
    with pytest.raises(ConfigError, match=r"expected key=value"):
        load_config(path, ["seed"])
