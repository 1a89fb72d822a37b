"""The one validation pass (issue 18): every problem of a config and its files in one ConfigError, each
naming its file and key; every entry point (builder, job, stats) goes through it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml

from bridge.models.bagel.data.config import BagelDataConfig, ConfigError, PackerConfig, load_config
from bridge.models.bagel.data.config.validate import UNIX_PATH_MAX, socket_path_problem, validate_data

T2I_ARGS = {"max_image_size": 256, "min_image_size": 64, "image_stride": 16}


def _files(tmp_path: Path, groups: dict, info: dict) -> tuple[str, str]:
    g, i = tmp_path / "groups.yaml", tmp_path / "dataset_info.yaml"
    g.write_text(yaml.safe_dump(groups, sort_keys=False))
    i.write_text(yaml.safe_dump(info, sort_keys=False))
    return str(g), str(i)


def test_every_problem_in_every_file_is_reported_at_once(tmp_path):
    groups, info = _files(tmp_path, {
        "t2i_pretrain": {"dataset_names": ["t2i"], "weight": 1, "image_transform_args": T2I_ARGS,
                         "num_used_dat": [1]},                                   # misspelt key
        "vlm_sft": {"dataset_names": ["sft"], "weight": -2, "image_transform_args": T2I_ARGS},  # bad weight
    }, {
        "t2i_pretrain": {"t2i": {"data_dir": "raw/t2i", "energon_pth": "/x"}},    # unknown registry key
        "vlm_sft": {"sft": {"data_dir": "raw/vlm"}},                             # missing jsonl_path
    })
    cfg = BagelDataConfig(groups=groups, dataset_info=info, seed=-1, packer=PackerConfig(max_buffer_size=-3))
    with pytest.raises(ConfigError) as exc:
        validate_data(cfg)
    problems = exc.value.problems
    text = str(exc.value)
    expected = [
        ("packer.max_buffer_size", None),
        ("seed: must be", None),
        (f"{groups}: group 't2i_pretrain'", "'num_used_dat'"),
        (f"{groups}: group 'vlm_sft'", "'weight'"),
        (f"{info}: t2i_pretrain.t2i", "energon_pth"),
        (f"{info}: vlm_sft.sft", "'jsonl_path'"),
    ]
    for where, key in expected:
        hits = [p for p in problems if where in p and (key is None or key in p)]
        assert len(hits) == 1, (where, key, problems)
        assert hits[0] in text
    assert len(problems) == len(expected), problems


def test_reader_needs_and_budgets_are_problems_of_the_same_pass(tmp_path):
    groups, info = _files(tmp_path, {
        "t2i_pretrain": {"dataset_names": ["t2i"], "weight": 1, "is_mandatory": True,
                         "image_transform_args": {"max_image_size": 1024, "min_image_size": 512, "image_stride": 16}},
        "vlm_sft": {"dataset_names": ["sft"], "weight": 1},                       # no image_transform_args
    }, {
        "t2i_pretrain": {"t2i": {"data_dir": "raw/t2i"}},                          # no energon_path
        "vlm_sft": {"sft": {"data_dir": "raw/vlm", "jsonl_path": "x.jsonl", "energon_path": "/e"}},
    })
    cfg = BagelDataConfig(groups=groups, dataset_info=info, order="official", num_workers=1,
                          packer=PackerConfig(expected_num_tokens=4096, max_num_tokens=5120,
                                              max_num_tokens_per_sample=4096, prefer_buffer_before=1024))
    with pytest.raises(ConfigError) as exc:
        validate_data(cfg)
    problems = exc.value.problems
    assert any(f"{info}: t2i_pretrain.t2i: no 'energon_path'" in p for p in problems), problems
    assert any(f"{groups}: group 'vlm_sft': key 'image_transform_args' is required" in p for p in problems)
    assert sum("order 'official' needs 'num_used_data'" in p for p in problems) == 2
    assert any("packer.max_latent_size is 32" in p for p in problems), problems  # case B4, same pass
    # the report mode (bagel-data stats) keeps budget findings out of the error
    with pytest.raises(ConfigError) as exc2:
        validate_data(cfg, budgets="report")
    assert not any("max_latent_size" in p for p in exc2.value.problems)


def test_unknown_packer_key_in_a_config_file_is_an_error(tmp_path):
    data = tmp_path / "data.yaml"
    data.write_text(yaml.safe_dump({"groups": "g.yaml", "dataset_info": "i.yaml",
                                    "packer": {"max_num_tokes": 4096}}))
    with pytest.raises(ConfigError, match=r"max_num_tokes"):
        load_config(data)
    with pytest.raises(ConfigError, match=r"unknown packer key\(s\) \['max_num_tokes'\]"):
        PackerConfig.from_mapping({"max_num_tokes": 4096})


def test_the_builder_validates_once_and_accepts_validated_data(demo_setup, caplog):
    """``build_bagel_train_loader`` over ``ValidatedData`` reads no file again (the job passes it on)."""
    from _external_common import demo_config
    from bridge.models.bagel.data.build import build_bagel_train_loader

    out, tok = demo_setup
    cfg = demo_config(out, 0, True)
    data = validate_data(cfg)
    Path(cfg.groups).rename(Path(cfg.groups).with_suffix(".moved"))  # a second read would now fail
    try:
        with build_bagel_train_loader(data, tok, (0, 1)) as loader:
            assert "packed_text_ids" in next(loader)
        with pytest.raises(ConfigError, match="cannot read"):
            build_bagel_train_loader(cfg, tok, (0, 1))
    finally:
        Path(cfg.groups).with_suffix(".moved").rename(cfg.groups)


def test_a_temp_dir_too_long_for_worker_sockets_is_a_problem_of_the_pass(tmp_path, monkeypatch):
    """Under a long TMPDIR (cluster schedulers set per-job ones) an Energon worker cannot send a sample's tensors:
    the socket bind fails in its queue thread, which only prints, and the reader waited for its watchdog's
    time-out (a bench sat 240 s). With worker processes configured, the validation pass names the temp dir."""
    groups, info = _files(tmp_path, {"t2i_pretrain": {"dataset_names": ["t2i"], "weight": 1,
                                                      "image_transform_args": T2I_ARGS}},
                          {"t2i_pretrain": {"t2i": {"data_dir": "raw/t2i", "energon_path": str(tmp_path)}}})
    long_dir = tmp_path / ("scheduler-job-tmp-" + "x" * max(1, 90 - len(str(tmp_path))))
    long_dir.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(long_dir))
    def problems(**kw) -> list[str]:
        try:
            validate_data(BagelDataConfig(groups=groups, dataset_info=info, **kw))
        except ConfigError as exc:
            return exc.problems
        return []

    assert socket_path_problem() is not None
    for kw in (dict(num_workers=2), dict(prefetch=2)):
        [p] = problems(**kw)
        assert p.startswith(f"temp dir {str(long_dir)!r} is {len(str(long_dir))} bytes long") and "TMPDIR" in p, p
    assert problems() == []
    # the official order's workers are emulated in process: only its own missing num_used_data is reported
    assert [p for p in problems(num_workers=2, order="official") if "unix sockets" in p] == []


@pytest.mark.parametrize("extra", [0, 1])
def test_the_unix_socket_path_limit_is_the_kernels(tmp_path, extra):
    """``UNIX_PATH_MAX`` and the path below the temp dir are the real ones: a multiprocessing listener binds at a
    temp dir exactly as long as ``socket_path_problem`` allows, and fails one byte longer."""
    from multiprocessing.connection import Listener

    room = UNIX_PATH_MAX - len("/pymp-XXXXXXXX/listener-XXXXXXXX")
    base = Path("/tmp") / f"bagel-test-{os.getpid()}"
    temp_dir = str(base) + "d" * (room + extra - len(str(base)))
    assert len(temp_dir) == room + extra
    sock_dir = os.path.join(temp_dir, "pymp-abcdefgh")
    os.makedirs(sock_dir)
    try:
        assert (socket_path_problem(temp_dir) is None) == (extra == 0)
        address = os.path.join(sock_dir, "listener-abcdefgh")
        if extra == 0:
            Listener(address, family="AF_UNIX").close()
        else:
            with pytest.raises(OSError, match="AF_UNIX path too long"):
                Listener(address, family="AF_UNIX")
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
