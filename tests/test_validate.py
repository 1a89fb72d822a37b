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

    def problems(temp_dir: Path, **kw) -> list[str]:
        monkeypatch.setattr("tempfile.tempdir", str(temp_dir))  # Python's temp dir
        monkeypatch.setenv("TMPDIR", str(temp_dir))               # torch_shm_manager's
        try:
            validate_data(BagelDataConfig(groups=groups, dataset_info=info, **kw))
        except ConfigError as exc:
            return [p for p in exc.problems if "unix socket" in p]
        return []

    def temp_dir(size: int) -> Path:
        path = Path(str(tmp_path / "t") + "x" * (size - len(str(tmp_path / "t"))))
        path.mkdir(exist_ok=True)
        assert len(str(path)) == size
        return path

    long_dir = temp_dir(90)
    for kw, cause in ((dict(num_workers=2), "read worker processes"), (dict(prefetch=2), "torch_shm_manager"),
                      (dict(num_workers=2, prefetch=2), "read worker processes")):
        [p] = problems(long_dir, **kw)  # the socket that is really bound is the one named
        assert p.startswith(f"temp dir {str(long_dir)!r} is 90 bytes long") and "TMPDIR" in p, p
        assert cause in p and ("worker" not in p) == ("num_workers" not in kw), (kw, p)  # remedy included
    assert problems(long_dir) == []
    assert problems(long_dir, num_workers=2, order="official") == []  # its workers are emulated in process
    # 74 bytes: room for the workers' sockets, not for torch_shm_manager's (2 bytes longer below the temp dir)
    assert problems(temp_dir(74), num_workers=2) == []
    [p] = problems(temp_dir(74), prefetch=2)
    assert "torch_shm_manager" in p and "at most 73 bytes" in p, p


_BIND = {
    # the real multiprocessing temp dir and listener address (get_temp_dir, arbitrary_address), bound
    "workers": "from multiprocessing.connection import Listener; Listener(family='AF_UNIX').close()",
    # the prefetch producer's strategy: torch_shm_manager starts and binds its socket
    "prefetch": "import torch, torch.multiprocessing as m; m.set_sharing_strategy('file_system'); "
                "torch.zeros(1).share_memory_()",
}


@pytest.mark.parametrize("kind,extra", [("workers", 0), ("workers", 1), ("prefetch", 0), ("prefetch", 1)])
def test_the_socket_path_limits_are_the_real_ones(kind, extra):
    """At a temp dir exactly as long as ``socket_path_problem`` allows, the real socket binds (a multiprocessing
    listener; torch_shm_manager); one byte longer it fails, and the check says so: the formula, not only the
    kernel's limit, is checked, in a fresh process with that TMPDIR."""
    import subprocess
    import sys

    room = UNIX_PATH_MAX - len("/pymp-XXXXXXXX/listener-XXXXXXXX" if kind == "workers"
                               else "/torch-shm-dir-XXXXXX/manager.sock")
    base = f"/tmp/bagel-test-{os.getpid()}-"
    temp_dir = base + "d" * (room + extra - len(base))
    os.makedirs(temp_dir)
    try:
        assert (socket_path_problem(temp_dir, prefetch=kind == "prefetch") is None) == (extra == 0)
        proc = subprocess.run([sys.executable, "-c", _BIND[kind]], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "TMPDIR": temp_dir})
        assert (proc.returncode == 0) == (extra == 0), proc.stderr[-2000:]
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
