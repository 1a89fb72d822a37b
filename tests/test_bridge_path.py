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
    provider = cls(train_loader=loader, seq_length=256)
    assert provider.dataloader_type == "external" and provider.num_workers == 0
    assert provider.persistent_workers is False and provider.seq_length == 256
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
    provider = external.BagelMegatronMIMODatasetProvider(train_loader=loader, seq_length=256)
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
