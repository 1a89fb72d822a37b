"""Helpers shared by the external-loader tests: real packers over golden streams, batch comparison, gloo PGs."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from bridge.models.bagel.data.config import PackerConfig
from bridge.models.bagel.data.external import BagelExternalLoader, BagelRNGIterator
from bridge.models.bagel.data.packing import BagelPacker, ListGroupSource, first_difference
from packer_golden import load_case

FLEX_CASE = "c02_flex_extrap_3g2m_s14"
DENSE_CASE = "c01_dense_extrap_3g2m_s14"
#: demo_loader's max_num_tokens: two mandatory samples of up to 4095 tokens each must fit (budgets.py, case B6);
#: expected 7168 (7/8 of it, like BAGEL's defaults) keeps packs overflowing into the buffer (restore_sample path)
DEMO_MAX_TOKENS = 8192


def golden_loader(case_name: str = FLEX_CASE, *, length: int = 1000, rank_seed: int = 14,
                  fingerprint: dict | None = None, prefetch: int = 0) -> BagelExternalLoader:
    """Real packer over a golden case's sample streams (cycled), RNG-isolated, as an external loader."""
    case = load_case(case_name)
    cfg = case["config"]
    sources = [ListGroupSource(case["groups"][g], cycle=True, name=g) for g in cfg["group_names"]]
    packer = BagelPacker(sources, cfg["group_weights"], cfg["is_mandatory"], cfg["special_tokens"],
                         packer_config(cfg), group_names=cfg["group_names"])
    fp = {"case": case_name, "rank_seed": rank_seed} if fingerprint is None else fingerprint
    batches = BagelRNGIterator(packer, rank_seed)
    if prefetch:
        from bridge.models.bagel.data.pipeline.prefetch import PrefetchStage

        batches = PrefetchStage(batches, depth=prefetch)
    return BagelExternalLoader(batches, length=length, stateful_loaders=sources, fingerprint=fp)


def packer_config(case_config: dict) -> PackerConfig:
    """The packer knobs of a golden case's config (its other keys describe the case, not the packer)."""
    return PackerConfig.from_mapping({k: v for k, v in case_config.items() if k in PackerConfig.keys()})


def demo_config(out: Any, num_workers: int, use_flex: bool, *, seed: int = 42, prefetch: int = 0,
                start: str = "fork") -> Any:
    """The data config of the generated demo dataset at small budgets (all three groups, real Energon readers)."""
    from bridge.models.bagel.data.config import BagelDataConfig, PackerConfig

    return BagelDataConfig(groups=str(out / "groups.yaml"), dataset_info=str(out / "dataset_info.yaml"),
                           num_workers=num_workers, seed=seed, prefetch=prefetch, prefetch_start=start,
                           packer=PackerConfig(expected_num_tokens=7168, max_num_tokens=DEMO_MAX_TOKENS,
                                               max_num_tokens_per_sample=4096, prefer_buffer_before=2048,
                                               use_flex=use_flex, max_latent_size=64))


def demo_loader(out: Any, tok: Any, num_workers: int, use_flex: bool, *, length: int = 100, seed: int = 42,
                prefetch: int = 0, start: str = "fork") -> BagelExternalLoader:
    """The full stack on a generated demo dataset at small budgets (all three groups, real Energon readers)."""
    from bridge.models.bagel.data.build import build_bagel_train_loader

    cfg = demo_config(out, num_workers, use_flex, seed=seed, prefetch=prefetch, start=start)
    return build_bagel_train_loader(cfg, tok, (0, 1), length=length)


def assert_same(a: Any, b: Any, path: str = "batch") -> None:
    """Exact equality under the bit-level rule (dtype, shape, every bit; containers by type, length, items)."""
    diff = first_difference(a, b, path)
    assert diff is None, diff


def single_process_pg_collection():
    """A one-rank gloo world and a ProcessGroupCollection with tp/pp/cp/dp all on it (what Bridge's helpers need)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    if not torch.distributed.is_initialized():
        store = os.path.join(tempfile.mkdtemp(prefix="bagel_pg_"), "store")
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    world = torch.distributed.group.WORLD
    return ProcessGroupCollection(tp=world, pp=world, cp=world, dp=world)


#: Main-job overrides for a quick in-process run on the demo data: small packs, one micro-batch per step, no bar.
SMALL_JOB = ["data.packer.expected_num_tokens=4096", "data.packer.max_num_tokens=8192",
             "data.packer.max_num_tokens_per_sample=4096", "data.packer.prefer_buffer_before=2048",
             "train.global_batch_size=1", "train.progress=false", "train.log_interval=1"]


def run_job_in_process(config: Any, overrides: list[str], tokenizer: Any) -> dict:
    """The main job's ``run_job`` in this process (a one-rank gloo world) on ``load_job_config(config,
    overrides)``; Megatron's global micro-batch calculator is reset afterwards, so the next run may set it again."""
    from megatron.core import num_microbatches_calculator as nmc

    from bridge.models.bagel.data.job.config import load_job_config
    from bridge.models.bagel.data.job.runner import run_job

    cfg = load_job_config(config, overrides)
    try:
        return run_job(cfg, single_process_pg_collection(), tokenizer)
    finally:
        nmc.destroy_num_microbatches_calculator()


def small_selection_config(out: Any, directory: Path) -> Any:
    """The demo data config (``demo_config``, no workers, flex) with a small selection — 16 t2i, 8 edit, 12 vlm reads
    per epoch — and 4 partitions under ``data.order: elastic`` (its groups YAML written to ``directory``)."""
    import yaml

    groups = yaml.safe_load((out / "groups.yaml").read_text())
    groups["t2i_pretrain"]["num_used_data"] = [2]
    groups["unified_edit"]["num_used_data"] = [1]
    groups["vlm_sft"]["num_used_data"] = [12]
    path = Path(directory) / "groups.yaml"
    path.write_text(yaml.safe_dump(groups))
    return dataclasses.replace(demo_config(out, 0, True), groups=str(path), order="elastic", partitions=4)


def elastic_world(cfg: Any, tok: Any, size: int, states: list | None = None, **changes: Any) -> list:
    """The ``size`` loaders of one world (DP ranks built one after another in this process), each restored from its
    own state of ``states`` when there is one per rank, else from the resize of all of them; ``changes``: data
    config keys changed for the new world."""
    from bridge.models.bagel.data.build import build_bagel_train_loader

    cfg = dataclasses.replace(cfg, **changes)
    loaders = [build_bagel_train_loader(cfg, tok, (r, size), length=10) for r in range(size)]
    if states is not None:
        for r, loader in enumerate(loaders):
            loader.restore_state(states[r] if len(states) == size else loader.resize_states(states, r, size))
    return loaders


def run_world(loaders: list, steps: int, reads: list | None = None) -> tuple[list, list]:
    """``steps`` batches of every loader, then their states (the loaders closed): (batches per rank, states). Every
    packed sample's ``data_indexes`` is appended to ``reads``; the packer's ledger balances on every rank."""
    from bridge.models.bagel.data.packing.packer import ledger_errors

    batches = [[next(ld) for _ in range(steps)] for ld in loaders]
    if reads is not None:
        reads += [d for per_rank in batches for b in per_rank for d in b["batch_data_indexes"]]
    states = [ld.save_state() for ld in loaders]
    for ld in loaders:
        stats = ld.stats()  # the ledger balances on every rank; the readers report their part of it
        assert not ledger_errors(stats["ledger"]), stats["ledger"]
        readers = list(stats.get("sources", {}).values())
        assert not readers or sum(st["taken"] + st["handed_in"] for st in readers) > 0, stats["sources"]
        ld.close()
    return batches, states
