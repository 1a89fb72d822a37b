"""The launcher (``bridge.models.bagel.launch``): the ``model:`` section's checks, and ``--recipe``, which takes
train_iters / batch sizes / the parallel layout from a real Megatron-Bridge ``ConfigContainer`` (this package's
``bagel_recipe``) or refuses a disagreeing command-line override in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bridge.models.bagel.data.config import ConfigError
from bridge.models.bagel.data.job.config import TrainConfig, load_job_config
from bridge.models.bagel.launch import RECIPE_KEYS, model_config, reconcile_recipe
from bridge.models.bagel.model.config import BagelModelConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def recipe(demo_setup):
    from bridge.models.bagel.model.provider import bagel_recipe

    out = demo_setup[0]
    data = load_job_config(str(REPO / "configs" / "demo.yaml"),
                           [f"data.groups={out}/groups.yaml", f"data.dataset_info={out}/dataset_info.yaml"])
    return bagel_recipe(data.data, BagelModelConfig(name="bagel-tiny"), tokenizer=demo_setup[1], train_iters=12,
                        global_batch_size=4)


def test_model_section_is_checked():
    cfg = model_config({"name": "bagel-tiny", "optimizer": {"lr": 0.05}})
    assert cfg.enabled and cfg.optimizer.lr == 0.05
    assert not model_config({}).enabled and not model_config({"name": None}).enabled
    with pytest.raises(ConfigError, match="hiden_size"):
        model_config({"name": "bagel-tiny", "hiden_size": 8})
    with pytest.raises(ConfigError, match="unknown model 'bagel-13b'"):
        model_config({"name": "bagel-13b"}).resolved(vocab_size=100, max_latent_size=64)
    with pytest.raises(ConfigError, match="not divisible by num_query_groups"):
        model_config({"name": "bagel-tiny", "num_query_groups": 3}).resolved(vocab_size=100, max_latent_size=64)
    seven = BagelModelConfig(name="bagel-7b").resolved(vocab_size=151_670, max_latent_size=64)
    assert (seven.hidden_size, seven.num_layers, seven.head_dim, seven.vocab_size) == (3584, 28, 128, 152064)
    tiny = BagelModelConfig(name="bagel-tiny").resolved(vocab_size=151_670, max_latent_size=64)
    assert tiny.vocab_size == 151_680 and tiny.vocab_size % 128 == 0


def test_recipe_owns_train_iters_batch_sizes_and_layout(recipe):
    from bridge.models.bagel.data._bridge import import_bridge_training

    assert isinstance(recipe, import_bridge_training().ConfigContainer)
    assert type(recipe.model).__name__ == "BagelModelProvider" and recipe.model.bagel.name == "bagel-tiny"
    train = TrainConfig(train_iters=8, global_batch_size=2)
    changed = reconcile_recipe(recipe, train, explicit=set())
    assert (train.train_iters, train.global_batch_size, train.micro_batch_size) == (12, 4, 1)
    assert train.tensor_model_parallel_size == 1 and train.virtual_pipeline_model_parallel_size is None
    assert set(changed) == {"train_iters", "global_batch_size"}
    # an explicit override that agrees with the recipe passes
    assert reconcile_recipe(recipe, TrainConfig(train_iters=12, global_batch_size=4), {"train_iters"}) == []


def test_recipe_refuses_a_disagreeing_override_and_validation(recipe):
    with pytest.raises(ConfigError) as err:
        reconcile_recipe(recipe, TrainConfig(train_iters=3), explicit={"train_iters"})
    assert str(err.value) == ("--recipe: train.train_iters=3 but the recipe has 12: the recipe owns these keys; drop "
                              "the override or change the recipe")
    recipe.validation.eval_iters, recipe.validation.eval_interval = 5, 10
    try:
        with pytest.raises(ConfigError, match="no validation split"):
            reconcile_recipe(recipe, TrainConfig(), explicit=set())
        train = TrainConfig()  # with data.valid the recipe's validation is kept, and copied to train.eval_*
        reconcile_recipe(recipe, train, explicit=set(), has_valid=True)
        assert (train.eval_interval, train.eval_iters) == (10, 5)
        with pytest.raises(ConfigError, match=r"train.eval_iters=2 but the recipe has 5"):
            reconcile_recipe(recipe, TrainConfig(eval_iters=2), explicit={"eval_iters"}, has_valid=True)
    finally:
        recipe.validation.eval_iters, recipe.validation.eval_interval = 0, None
    assert set(RECIPE_KEYS) >= {"train_iters", "global_batch_size", "tensor_model_parallel_size",
                                "virtual_pipeline_model_parallel_size"}


@pytest.mark.slow
def test_cli_refuses_a_recipe_mismatch_in_one_line():
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "bridge.models.bagel.launch", "--recipe",
                           "bridge.models.bagel.model.provider:bagel_tiny_recipe", "train.global_batch_size=8"],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert lines == ["error [rank 0]: ConfigError: --recipe: train.global_batch_size=8 but the recipe has 1: the "
                     "recipe owns these keys; drop the override or change the recipe"], proc.stderr[-3000:]


def test_three_mistakes_of_one_launch_are_one_error_before_the_heavy_imports(demo_setup, tmp_path):
    """A typo'd key, a wrong ``dataset_info`` path and a global batch size DP 2 does not divide, in one 2-rank
    ``torchrun`` launch: one error per rank naming all three (the path by its key and the config file that set it,
    once), over before Megatron-Core / Megatron-Bridge are imported (wall time well under what importing them alone
    takes, measured here on the same machine)."""
    import time

    import yaml

    out = demo_setup[0]
    job = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    job["demo_data"] = None
    job["data"].update(groups=str(out / "groups.yaml"), dataset_info=str(out / "dataset_info_typo.yaml"),
                       prefetch=0)
    job["data"]["packer"]["max_buffer_sise"] = 50
    job["train"]["global_batch_size"] = 3
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job))
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "-m", "bridge.models.bagel.launch", "--config", str(config)],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    launch = time.monotonic() - start
    assert proc.returncode != 0
    errors = [chunk for chunk in proc.stderr.split("error [rank ")[1:]]
    # one per rank that got to print it: torchrun stops the other rank (SIGTERM) as soon as the first one fails
    assert 1 <= len(errors) <= 2, proc.stderr[-3000:]
    for error in errors:
        assert "'data.packer.max_buffer_sise' is not a config key (did you mean 'max_buffer_size'" in error
        assert error.count("dataset_info_typo.yaml") == 1, error  # once: not again for the validation split
        assert f"data.dataset_info (set in {config}): {out / 'dataset_info_typo.yaml'} does not exist" in error
        assert "train.global_batch_size 3 is not divisible by micro_batch_size 1 x data-parallel size 2" in error
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", "import megatron.core.parallel_state; from bridge.models.bagel.data._bridge "
                    "import import_bridge; import_bridge()"], cwd=REPO, check=True, capture_output=True, timeout=600,
                   env=env)
    heavy = time.monotonic() - start
    assert launch < heavy, (launch, heavy)  # torchrun + 2 ranks' whole launch vs. one process's imports
