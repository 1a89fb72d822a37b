"""Validation data (issue 33): ``data.valid`` checked by the one validation pass with training's keys, and the
validation stream (``build_bagel_valid_loader``) restarting at every evaluation with the same batches.

The torchrun job with evaluations (two in one run, and after a restart from a checkpoint) is in
``tests/test_train_job.py`` (it shares that test's runs: no extra launches).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from _train_common import SMALL_BUDGETS, small_image_groups, valid_groups

from bridge.models.bagel.data.config import ConfigError
from bridge.models.bagel.data.job.config import load_job_config, validate_job


def test_valid_split_problems_are_reported_with_the_training_problems(demo_setup, tmp_path: Path) -> None:
    """A validation group naming an unregistered dataset, a missing validation registry and a bad training key:
    one ConfigError listing all three; relative paths in the file resolve against the file's directory."""
    out = demo_setup[0]
    (tmp_path / "valid.yaml").write_text(
        "t2i_pretrain:\n  dataset_names: [demo_t2i, not_registered]\n  weight: 1\n  is_mandatory: true\n"
        "  image_transform_args: {image_stride: 16, max_image_size: 256, min_image_size: 128}\n")
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"data": {"groups": f"{out}/groups.yaml", "dataset_info": f"{out}/dataset_info.yaml",
                                               "valid": {"groups": "valid.yaml"}}}))
    cfg = load_job_config(config, ["data.packer.max_buffer_size=-3", "train.eval_interval=2"])
    assert cfg.data.valid.groups == str(tmp_path / "valid.yaml") and cfg.data.valid.dataset_info is None
    with pytest.raises(ConfigError) as err:
        validate_job(cfg)
    problems = err.value.problems
    assert len(problems) == 2, problems
    assert problems[0].startswith("packer.max_buffer_size")
    assert problems[1].startswith("data.valid: ") and "not_registered" in problems[1]

    cfg = load_job_config(config, ["data.packer.max_buffer_size=-3", "data.valid.dataset_info=missing.yaml"])
    with pytest.raises(ConfigError) as err:
        validate_job(cfg)
    problems = err.value.problems  # the path by its key first (launch validation), then the packer's
    assert len(problems) == 2 and any(p.startswith("data.valid.dataset_info") and "missing.yaml" in p
                                      for p in problems), problems

    cfg = load_job_config(config, ["data.valid=null", "train.eval_interval=2"])  # nothing to evaluate on
    with pytest.raises(ConfigError, match="train.eval_interval: 2 .* data.valid is not set"):
        validate_job(cfg)


def test_the_validation_stream_restarts_at_every_evaluation(demo_setup, tmp_path: Path) -> None:
    """``build_bagel_valid_loader`` serves ``batches_per_eval`` batches, then starts again from the first: the
    training builder's stream over the validation groups (DP rank 1 of 2), built afresh; no state. Handed to the
    MIMO provider as its valid split next to the train loader (a public contract: still buildable from
    ``train_loader`` alone)."""
    from types import SimpleNamespace

    from bridge.models.bagel.data.build import build_bagel_train_loader, build_bagel_valid_loader
    from bridge.models.bagel.data.external import BagelMegatronMIMODatasetProvider
    from bridge.models.bagel.data.packing import batch_digest

    out, tokenizer = demo_setup
    cfg = load_job_config(None, [f"data.groups={small_image_groups(out, tmp_path / 'groups.yaml')}",
                                 f"data.dataset_info={out}/dataset_info.yaml", "data.partitions=8",
                                 f"data.valid.groups={valid_groups(out, tmp_path / 'valid.yaml')}", *SMALL_BUDGETS])
    data = validate_job(cfg)
    with build_bagel_valid_loader(data, tokenizer, (1, 2), batches_per_eval=2) as valid:
        digests = [batch_digest(next(valid)) for _ in range(6)]
        assert len(valid) == 2 and valid.evaluations_started == 3 and valid.seq_length == 2048
        with build_bagel_train_loader(data.valid_data(), tokenizer, (1, 2), length=2) as same_builder:
            assert [batch_digest(next(same_builder)) for _ in range(2)] == digests[:2]
        assert digests[:2] == digests[2:4] == digests[4:] and digests[0] != digests[1]
        with build_bagel_train_loader(data, tokenizer, (1, 2), length=2) as train:
            provider = BagelMegatronMIMODatasetProvider(train_loader=train, valid_loader=valid)
            assert provider.build_datasets(SimpleNamespace(train_samples=4, valid_samples=4, test_samples=4)) == (
                train, valid, None)
            alone = BagelMegatronMIMODatasetProvider(train_loader=train)
            assert alone.build_datasets(SimpleNamespace(train_samples=4, valid_samples=4, test_samples=4)) == (
                train, None, None)
    # Bridge's standard path: BagelDatasetProvider builds the valid split itself, one evaluation's micro-batches per
    # rank taken from the build context (test_samples = eval_iters x eval_global_batch_size; DP 1 here)
    from megatron.core.rerun_state_machine import RerunDataIterator

    from bridge.models.bagel.data.providers import BagelDatasetProvider

    provider = BagelDatasetProvider(data=cfg.data, tokenizer=tokenizer)
    train, valid, test = provider.build_datasets(SimpleNamespace(train_samples=4, valid_samples=6, test_samples=3))
    try:
        assert test is None and valid.batches_per_eval == 3
        it = RerunDataIterator(valid)  # what Bridge's external path makes of it, once
        one, two = ([batch_digest(next(it)) for _ in range(3)] for _evaluation in range(2))
        assert one == two
    finally:
        train.close()
        valid.close()
    cfg.data.valid = None
    with pytest.raises(ValueError, match="data.valid is not set"):
        build_bagel_valid_loader(validate_job(cfg), tokenizer, batches_per_eval=1)
