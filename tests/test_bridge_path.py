"""The real Megatron-Bridge external-loader path: provider → build_datasets → samplers → RerunDataIterator."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys

import pytest

from _external_common import DENSE_CASE, FLEX_CASE, assert_same, golden_loader
from bridge.models.bagel.data import external
from bridge.models.bagel.data._bridge import import_bridge


@pytest.fixture(scope="module")
def bridge():
    return import_bridge()


def test_cpu_standin_only_for_lora_layers(bridge):
    lora = sys.modules["megatron.bridge.peft.lora_layers"]
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer_engine installed: the real lora_layers module is used")
    assert "transformer_engine" not in sys.modules  # TE itself is never faked
    for name in ("LinearAdapter", "LoRALinear", "LoRATopKRouter", "TEFusedLoRALinear"):
        with pytest.raises(NotImplementedError, match="transformer_engine"):
            getattr(lora, name)()


def test_provider_is_a_real_mimo_provider(bridge):
    cls = external.BagelMegatronMIMODatasetProvider
    assert issubclass(cls, bridge.MegatronMIMODatasetProvider)
    assert cls is external.BagelMegatronMIMODatasetProvider  # created once
    loader = golden_loader(length=5)
    provider = cls(train_loader=loader)
    assert provider.dataloader_type == "external" and provider.num_workers == 0
    assert provider.persistent_workers is False and provider.seq_length == loader.seq_length
    with pytest.raises(TypeError):
        cls(loader)  # keyword-only dataclass
    fields = {f.name for f in dataclasses.fields(cls)}
    assert {"train_loader", "seq_length", "dataloader_type", "num_workers"} <= fields
    provider.finalize()  # Bridge's DataloaderConfig rule (num_workers 0 → persistent_workers False) holds
    assert provider.persistent_workers is False


@pytest.mark.parametrize("case", [FLEX_CASE, DENSE_CASE])
def test_bridge_external_path_yields_the_loader_batches(bridge, case):
    from megatron.core.rerun_state_machine import RerunDataIterator

    loader = golden_loader(case, length=7)
    reference = golden_loader(case, length=7)
    provider = external.BagelMegatronMIMODatasetProvider(train_loader=loader)
    ctx = bridge.DatasetBuildContext(train_samples=8, valid_samples=0, test_samples=4)
    train, valid, test = provider.build_datasets(ctx)
    assert train is loader and valid is None and test is None
    assert len(train) == 7  # MIMO setup prints len(train_ds)
    built = bridge.build_pretraining_data_loader(train, consumed_samples=0, dataloader_type="external",
                                                 micro_batch_size=1, num_workers=0, data_sharding=True,
                                                 collate_fn=provider.get_collate_fn())
    assert built is loader
    rerun = RerunDataIterator(built)
    assert rerun.iterable is loader  # Bridge checkpointing reaches save_state/restore_state through .iterable
    for i in range(4):
        batch = next(rerun)
        assert_same(batch, next(reference), f"batch{i}")
    assert loader.position == 4
    assert bridge.build_pretraining_data_loader(None, 0, "external", 1, 0, True) is None


def test_no_train_samples_gives_no_loader_and_collate_refuses(bridge):
    provider = external.BagelMegatronMIMODatasetProvider(train_loader=golden_loader(length=3))
    ctx = bridge.DatasetBuildContext(train_samples=0, valid_samples=0, test_samples=0)
    assert provider.build_datasets(ctx) == (None, None, None)
    collate = provider.get_collate_fn()
    with pytest.raises(RuntimeError, match="must not be collated"):
        collate([{"a": 1}])


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_dataset_provider_for_pretrain_builds_the_rank_loader(bridge, tmp_path):
    """Bridge's standard path: a plain DatasetProvider, DP rank/size from context.pg_collection.dp."""
    from megatron.core.rerun_state_machine import RerunDataIterator

    from _external_common import single_process_pg_collection
    from bridge.models.bagel.data import build
    from bridge.models.bagel.data import providers
    from bridge.models.bagel.data.config import BagelDataConfig, PackerConfig
    from bridge.models.bagel.data.converter.demo import make_demo_data
    from bridge.models.bagel.data.tokenizer import build_qwen2_tokenizer

    make_demo_data(str(tmp_path / "d"), seed=1)
    tok = build_qwen2_tokenizer()
    cfg = BagelDataConfig(groups=str(tmp_path / "d" / "groups.yaml"),
                          dataset_info=str(tmp_path / "d" / "dataset_info.yaml"), seed=5,
                          packer=PackerConfig(expected_num_tokens=4096, max_num_tokens=8192,
                                              max_num_tokens_per_sample=4096, prefer_buffer_before=2048,
                                              max_latent_size=64))
    cls = providers.BagelDatasetProvider
    assert issubclass(cls, bridge.DatasetProvider) and not issubclass(cls, bridge.MegatronMIMODatasetProvider)
    provider = cls(data=cfg, tokenizer=tok, seq_length=8192)
    assert provider.dataloader_type == "external" and provider.num_workers == 0
    pgs = single_process_pg_collection()
    ctx = bridge.DatasetBuildContext(train_samples=12, valid_samples=0, test_samples=0, pg_collection=pgs)
    assert provider.build_datasets(bridge.DatasetBuildContext(0, 0, 0, pg_collection=pgs)) == (None, None, None)
    train, valid, test = provider.build_datasets(ctx)
    assert valid is None and test is None and len(train) == 12
    fp = train.fingerprint()["loader"]
    assert (fp["dp_rank"], fp["dp_size"], fp["seed"]) == (0, 1, 5)
    assert [g["name"] for g in fp["groups"]] == ["t2i_pretrain", "unified_edit", "vlm_sft"]
    from bridge.models.bagel.data.pipeline.rng import elastic_rank_seed
    assert train.fingerprint()["source"]["rank_seed"] == elastic_rank_seed(5, 0)  # the default (elastic) order
    assert build.rank_seed(5, 3, 8) == 43  # the official order: global_seed * world_size + rank
    with train, build.build_bagel_train_loader(cfg, tok, (0, 1)) as direct:
        it = RerunDataIterator(bridge.build_pretraining_data_loader(train, 0, "external", 1, 0, True))
        for i in range(2):
            assert_same(next(it), next(direct), f"batch{i}")
