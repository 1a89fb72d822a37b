"""``packer.strategy: balanced`` and the cost model (issue 34).

The cost model against the attention masks themselves (``attention.mask_rule``, the golden cases' dense masks);
``BalancedPacker`` over the golden streams and over the demo data through the real Energon readers and the
Qwen2 tokenizer: budgets, the batch contract, mandatory groups first, no flush drop, the planned cost equal to
the packed batch's, the simulator replaying it pack for pack, exact resume, an elastic resize proven exactly
once; the group mix and the waits on a long run; the telemetry's straggler figures; ``bagel-data stats``'
prediction (the job's straggler line under ``torchrun``, DP 2: ``test_world_telemetry.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from _external_common import assert_same, demo_config
from bridge.models.bagel.data.attention import flex_metadata, mask_rule
from bridge.models.bagel.data.build import build_bagel_train_loader
from bridge.models.bagel.data.config import BalanceConfig, ConfigError, CostConfig, PackerConfig, validate_data
from bridge.models.bagel.data.config.validate import strategy_problems
from bridge.models.bagel.data.external import ResumeMismatchError
from bridge.models.bagel.data.job.batch_check import check_batch
from bridge.models.bagel.data.job.straggler import StragglerMeter, StragglerStats
from bridge.models.bagel.data.job.telemetry import Telemetry
from bridge.models.bagel.data.job.world import reduce_world
from bridge.models.bagel.data.packing import ListGroupSource
from bridge.models.bagel.data.packing.balanced_packer import BalancedPacker
from bridge.models.bagel.data.packing.cost import CostModel, Work, batch_work, sample_work, split_pairs, straggler_ratio
from bridge.models.bagel.data.packing.packer import ledger_errors
from bridge.models.bagel.data.state import ResizeContext, StateError
from bridge.models.bagel.data.tools.budget_stats.straggler import simulate_ranks
from bridge.models.bagel.data.tools.ledger import check_exactly_once
from packer_golden import load_case

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import bench_balance  # noqa: E402  (the bench's synthetic mixes)

FLEX, DENSE = "c02_flex_extrap_3g2m_s14", "c01_dense_extrap_3g2m_s14"


# -- the cost model -------------------------------------------------------------------------------------------

def test_cost_model_derives_bagel_7b() -> None:
    m = CostModel.of()
    per_layer = 4 * 3584 ** 2 + 4 * 3584 * 4 * 128 + 6 * 3584 * 18944
    assert per_layer == 466_092_032
    assert m.token_flops == 3 * 28 * per_layer == 39_151_730_688
    assert m.pair_flops == 3 * 28 * 4 * 3584 == 1_204_224
    assert m.vit_token_flops == 3 * 26 * (8 * 1152 ** 2 + 4 * 1152 * 4304)
    assert m.vit_pair_flops == 3 * 26 * 4 * 1152 and m.vae_token_flops == 0
    # attention equals the linear work of a causal sample at ~65K tokens (docstring)
    assert 64_000 < 2 * m.token_flops / m.pair_flops < 66_000
    work = Work(tokens=10, attn_pairs=55, vit_tokens=4, vit_pairs=16, vae_tokens=3)
    small = CostModel.of(CostConfig(hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                                    ffn_hidden_size=128, vit_num_layers=0, vae_flops_per_token=5.0))
    assert small.cost(work) == 10 * 3 * 2 * (4 * 64 * 64 + 4 * 64 * 2 * 16 + 6 * 64 * 128) + 55 * 3 * 2 * 4 * 64 + 15
    assert work.plus(work) == Work(20, 110, 8, 32, 6)


def _pairs_by_mask(split_lens: list[int], modes: list[str]) -> int:
    batch = {"sample_lens": [sum(split_lens)], "split_lens": split_lens, "attn_modes": modes}
    meta = flex_metadata(batch)
    q = torch.arange(meta.length)
    return int(mask_rule(meta.document_id, meta.full_id, meta.noise_id, q[:, None], q[None, :]).sum())


def test_split_pairs_counts_what_the_mask_rule_allows() -> None:
    rng = random.Random(3)
    for _ in range(60):
        n = rng.randint(1, 6)
        lens = [rng.randint(1, 40) for _ in range(n)]
        modes = [rng.choice(["causal", "full", "noise"]) for _ in range(n)]
        assert split_pairs(lens, modes) == _pairs_by_mask(lens, modes), (lens, modes)


@pytest.mark.parametrize("case", ["c01_dense_extrap_3g2m_s14", "c03_dense_interp_4g1m_s4"])
def test_batch_work_reads_dense_masks_exactly(case: str) -> None:
    for batch in load_case(case)["batches"]:
        work = batch_work(batch)
        assert work.attn_pairs == sum(int((m == 0).sum()) for m in batch["nested_attention_masks"])
        assert work.tokens == batch["sequence_length"]
        assert work.vit_tokens == int(batch["vit_token_seqlens"].sum()) if "vit_token_seqlens" in batch else True


@pytest.mark.parametrize("case", ["c02_flex_extrap_3g2m_s14", "c04_flex_interp_4g1m_s4", "c05_flex_extrap_nomand_s2"])
def test_batch_work_reads_flex_splits_exactly(case: str) -> None:
    checked = 0
    for batch in load_case(case)["batches"]:
        if len(batch["split_lens"]) != len(batch["attn_modes"]):
            continue  # an official quirk's pack (a split never closed): no mask is built for it (attention.py)
        seq = batch["sequence_length"]
        real = {"sample_lens": batch["sample_lens"][:-1], "split_lens": batch["split_lens"][:-1],
                "attn_modes": batch["attn_modes"][:-1]}
        if not real["sample_lens"]:
            continue
        meta = flex_metadata(real)
        q = torch.arange(seq)
        allowed = int(mask_rule(meta.document_id, meta.full_id, meta.noise_id, q[:, None], q[None, :]).sum())
        assert batch_work(batch).attn_pairs == allowed and batch_work(batch).tokens == seq
        checked += 1
    assert checked >= 10


def test_dense_and_flex_packs_of_one_case_cost_the_same() -> None:
    dense, flex = load_case(DENSE)["batches"], load_case(FLEX)["batches"]  # same streams, seed and draws
    assert [batch_work(b) for b in dense] == [batch_work(b) for b in flex[:len(dense)]]


# -- BalancedPacker over the golden streams --------------------------------------------------------------------

def _golden_balanced(case: str = FLEX, groups: list[list[dict]] | None = None, **knobs) -> BalancedPacker:
    cfg = load_case(case)["config"]
    config = PackerConfig.from_mapping({k: v for k, v in cfg.items() if k in PackerConfig.keys()})
    config = dataclasses.replace(config, strategy="balanced", **knobs)
    groups = groups if groups is not None else [load_case(case)["groups"][g] for g in cfg["group_names"]]
    sources = [ListGroupSource(g, cycle=True, name=n) for g, n in zip(groups, cfg["group_names"])]
    return BalancedPacker(sources, cfg["group_weights"], cfg["is_mandatory"], cfg["special_tokens"], config,
                          group_names=cfg["group_names"])


def _seeded(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@pytest.mark.parametrize("case", [FLEX, DENSE])
def test_balanced_packs_obey_every_budget_and_the_contract(case: str) -> None:
    packer = _golden_balanced(case)
    cfg = packer.config
    model = CostModel.of(cfg.cost)
    mandatory = [n for n, m in zip(packer.group_names, packer.is_mandatory) if m]
    _seeded(5)
    for _ in range(40):
        batch = next(packer)
        assert check_batch(batch, max_num_tokens=cfg.max_num_tokens, use_flex=cfg.use_flex,
                           max_latent_size=cfg.max_latent_size, max_num_patch_per_side=cfg.max_num_patch_per_side) == []
        assert batch["sequence_length"] <= cfg.max_num_tokens
        assert [d["dataset_name"] for d in batch["batch_data_indexes"][:len(mandatory)]] == mandatory
        planned = packer.stats()["balance"]
        # the loop planned with the packed batch's exact length and cost (CFG coins drawn at pool entry)
        assert planned["last_pack_tokens"] == batch["sequence_length"]
        assert planned["last_pack_flops"] == pytest.approx(model.cost(batch_work(batch)), rel=1e-12)
        assert ledger_errors(packer.stats()["ledger"]) == []
    drops = packer.stats()["packer_drops"]
    assert drops and set(drops) <= {"overlength", "overlength_mandatory"}, drops  # lossless: no flush drop


def test_simulator_replays_the_balanced_packer_pack_for_pack() -> None:
    """The straggler simulator runs the packer's own loop: on the same (length, cost) streams and uniform draws
    it builds the same packs (CFG flags cleared: the simulator has no dropout)."""
    case = load_case(FLEX)
    cfg = case["config"]
    groups = [[dict(s, sequence_plan=[dict(i, enable_cfg=0) for i in s["sequence_plan"]]) for s in case["groups"][g]]
              for g in cfg["group_names"]]
    packer = _golden_balanced(groups=groups)
    model = CostModel.of()
    # (official estimate, cost, packed length): shorter than the estimate for vlm samples with unused images
    streams = [[(s["num_tokens"] + 2 * len(s["sequence_plan"]), model.cost(packer.sample_work(s)),
                 int(packer.sample_work(s).tokens)) for s in g] for g in groups]
    assert any(x[0] != x[2] for g in streams for x in g)  # the quirk-14 path is taken
    random.seed(0)  # simulate_ranks draws rank 0's groups from random.Random(0)
    tokens, costs = [], []
    for _ in range(25):
        batch = next(packer)
        tokens.append(batch["sequence_length"])
        costs.append(model.cost(batch_work(batch)))
    sim = simulate_ranks(lambda r: [itertools.cycle(s) for s in streams], cfg["group_weights"], cfg["is_mandatory"],
                         packer.config, dp=1, packs=25, seed=0)
    assert sim.ranks[0].tokens == tokens
    assert sim.ranks[0].costs == pytest.approx(costs, rel=1e-12)  # float sums in another order
    assert sim.drops == packer.stats()["packer_drops"]


def test_state_round_trip_and_refusals() -> None:
    packer = _golden_balanced()
    _seeded(9)
    for _ in range(6):
        next(packer)
    state = packer.state_dict()
    assert state["balance"]["since"] and len(state["balance"]["since"]) == len(state["buffer"])
    rng = random.getstate(), np.random.get_state()
    expected = [next(packer) for _ in range(6)]
    fresh = _golden_balanced()
    fresh.load_state_dict(state)
    random.setstate(rng[0]), np.random.set_state(rng[1])
    for exp in expected:
        assert_same(next(fresh), exp)
    bad = dict(state, balance=dict(state["balance"], notes=[]))
    with pytest.raises(StateError, match="not a balanced packer's"):
        _golden_balanced().load_state_dict(bad)


# -- the group mix and the waits on a long run (the packer's loop at the length level) ------------------------

@pytest.mark.parametrize("mix", ["bagel", "longtail"])
def test_long_run_keeps_the_group_mix_and_bounds_the_waits(mix: str) -> None:
    gens, weights, mandatory = bench_balance.MIXES[mix]
    make = bench_balance.synthetic(gens, 1)
    config = PackerConfig(strategy="balanced")
    bal = simulate_ranks(make, weights, mandatory, config, dp=1, packs=1500, seed=1)
    off = simulate_ranks(make, weights, mandatory, PackerConfig(), dp=1, packs=1500, seed=1)
    assert bal.mix_dev <= 0.02, bal.shares  # packed shares vs the weighted draw, samples and tokens
    assert max(abs(b[0] - o[0]) for b, o in zip(bal.shares, off.shares)) <= 0.02  # and vs the official loop
    assert not any(k.startswith("flush") for k in bal.drops), bal.drops
    assert bal.wait_quantile(0.99) <= 8 and max(bal.waits) <= config.balance.max_wait + 2, max(bal.waits)
    assert bal.waits_long and max(bal.waits_long) <= config.balance.max_wait + 2  # long samples are not starved
    assert bal.tokens_per_pack >= off.tokens_per_pack


def test_straggler_ratio_at_dp64_official_vs_balanced() -> None:
    gens, weights, mandatory = bench_balance.MIXES["bagel"]
    make = bench_balance.synthetic(gens, 2)
    off = simulate_ranks(make, weights, mandatory, PackerConfig(), dp=64, packs=6, warmup=10, seed=2)
    bal = simulate_ranks(make, weights, mandatory, PackerConfig(strategy="balanced"), dp=64, packs=6, warmup=10,
                         seed=2)
    assert off.ratio > 1.05 and bal.ratio < 1.03, (off.ratio, bal.ratio)
    # ranks' costs [[1, 2], [3, 2]]: per step max (3, 2), mean (2, 2)
    assert straggler_ratio([3.0, 2.0], [2.0, 2.0]) == (pytest.approx((1.5 + 1.0) / 2), pytest.approx(1 / 5))


# -- configuration ----------------------------------------------------------------------------------------------

def test_config_keys_are_checked() -> None:
    def problems(**kw) -> str:
        return "\n".join(strategy_problems(PackerConfig(**kw)))

    assert problems() == "" and problems(strategy="balanced") == ""
    assert "packer.strategy: must be one of ['official', 'balanced'], got 'greedy'" in problems(strategy="greedy")
    with pytest.raises(ConfigError, match=r"packer.balance: unknown key\(s\) \['maxwait'\]"):
        PackerConfig.from_mapping({"strategy": "balanced", "balance": {"maxwait": 3}})
    assert "packer.balance.lookahead: must be a number of packs >= 1" in problems(balance=BalanceConfig(lookahead=0.5))
    assert "packer.cost.hidden_size (100) must be a multiple of num_attention_heads" in problems(
        cost=CostConfig(hidden_size=100))
    assert "balance.target_tokens (40000) exceeds max_num_tokens" in problems(
        strategy="balanced", balance=BalanceConfig(target_tokens=40000))
    assert "max_buffer_size: strategy 'balanced' packs from a look-ahead buffer" in problems(
        strategy="balanced", max_buffer_size=0)
    assert PackerConfig(strategy="balanced").balanced_target_tokens == (32768 + 36864) // 2
    # the official stream's identity does not name the new keys (states saved before them still resume)
    assert set(PackerConfig().stream_identity()) == set(PackerConfig.keys()) - {"strategy", "balance", "cost"}
    assert PackerConfig(cost=CostConfig(num_layers=2)).stream_identity() == PackerConfig().stream_identity()


def test_mandatory_groups_that_could_overflow_are_refused(demo_setup) -> None:
    out, _ = demo_setup
    cfg = demo_config(out, 0, True)
    cfg = dataclasses.replace(cfg, order="official", packer=dataclasses.replace(
        cfg.packer, strategy="balanced", max_num_tokens_per_sample=8000))
    with pytest.raises(ConfigError, match="2 mandatory groups .* each put one sample"):
        validate_data(cfg)
    # the one validation pass collects the strategy's key problems with the others
    bad = dataclasses.replace(cfg, packer=dataclasses.replace(cfg.packer, strategy="greedy"))
    with pytest.raises(ConfigError, match="packer.strategy: must be one of"):
        validate_data(bad)


# -- the real loader: Energon readers, the Qwen2 tokenizer ---------------------------------------------------

def _balanced_cfg(out, use_flex: bool = True, **changes):
    cfg = demo_config(out, 0, use_flex)
    return dataclasses.replace(cfg, packer=dataclasses.replace(cfg.packer, strategy="balanced"), **changes)


@pytest.mark.parametrize("use_flex", [True, False])
def test_real_loader_batches_and_exact_resume(demo_setup, use_flex: bool) -> None:
    out, tok = demo_setup
    cfg = _balanced_cfg(out, use_flex)
    loader = build_bagel_train_loader(cfg, tok, (0, 1), length=20)
    p = cfg.packer
    batches = []
    for i in range(8):
        batches.append(next(loader))
        assert check_batch(batches[-1], max_num_tokens=p.max_num_tokens, use_flex=use_flex,
                           max_latent_size=p.max_latent_size, max_num_patch_per_side=p.max_num_patch_per_side) == []
        if i == 3:
            state = loader.save_state()
    stats = loader.stats()
    assert not ledger_errors(stats["ledger"]) and stats["buffer_len"] > 0
    assert not any(r.startswith("flush") for r in stats["packer_drops"]), stats["packer_drops"]
    loader.close()
    again = build_bagel_train_loader(cfg, tok, (0, 1), length=20)
    again.restore_state(state)
    for expected in batches[4:]:
        assert_same(next(again), expected)
    again.close()
    official = build_bagel_train_loader(demo_config(out, 0, use_flex), tok, (0, 1), length=20)
    with pytest.raises(ResumeMismatchError, match=r"data\.packer\.(balance|cost|strategy)\.\w+"):
        official.restore_state(state)
    official.close()


@pytest.fixture(scope="module")
def small_elastic(demo_setup, tmp_path_factory):
    """The demo data with a small selection (16 t2i, 8 edit, 12 vlm reads per epoch), elastic order, balanced."""
    out, tok = demo_setup
    groups = yaml.safe_load((out / "groups.yaml").read_text())
    groups["t2i_pretrain"]["num_used_data"] = [2]
    groups["unified_edit"]["num_used_data"] = [1]
    groups["vlm_sft"]["num_used_data"] = [12]
    path = tmp_path_factory.mktemp("balance_elastic") / "groups.yaml"
    path.write_text(yaml.safe_dump(groups))
    return _balanced_cfg(out, groups=str(path), order="elastic", partitions=4), tok


def _world(cfg, tok, size, states=None):
    loaders = [build_bagel_train_loader(cfg, tok, (r, size), length=10) for r in range(size)]
    if states is not None:
        for r, loader in enumerate(loaders):
            loader.restore_state(states[r] if len(states) == size else loader.resize_states(states, r, size))
    return loaders


def _run(loaders, steps, reads=None):
    batches = [[next(ld) for _ in range(steps)] for ld in loaders]
    if reads is not None:
        reads += [d for per_rank in batches for b in per_rank for d in b["batch_data_indexes"]]
    states = [ld.save_state() for ld in loaders]
    for ld in loaders:
        assert not ledger_errors(ld.stats()["ledger"])
        ld.close()
    return batches, states


def test_elastic_resize_is_exactly_once_with_the_balanced_pool(small_elastic) -> None:
    cfg, tok = small_elastic
    reads: list[dict] = []
    _, s2 = _run(_world(cfg, tok, 2), 3, reads)
    assert all(_packer_state(s)["balance"]["since"] for s in s2)  # the pool is handed over with entries in it
    _, s3 = _run(_world(cfg, tok, 3, s2), 2, reads)
    batches, s1 = _run(_world(cfg, tok, 1, s3), 6, reads)
    report = check_exactly_once(reads, s1)
    assert report.ok and report.epoch_complete, report
    twice, _ = _run(_world(cfg, tok, 1, s3), 6)  # the same resize again: the same batches
    for a, b in zip(batches[0], twice[0]):
        assert_same(a, b)
    live = build_bagel_train_loader(cfg, tok, (0, 3), length=10)
    packer = _packer_stage(live)
    olds = [_packer_state(s) for s in s2]
    for rank in range(3):
        new = packer.resize_state(olds, ResizeContext(rank, 3, 1, cfg.seed))
        assert new["balance"]["since"] == [] and new["balance"]["packs"] == 0 and new["buffer"] == []
        assert new["balance"]["seen_tokens"] == sum(o["balance"]["seen_tokens"] for o in olds)  # one common target
    official = [dict((k, v) for k, v in o.items() if k != "balance") for o in olds]
    with pytest.raises(StateError, match="saved under another packer.strategy"):
        packer.resize_state(official, ResizeContext(0, 3, 1, cfg.seed))
    live.close()


def _packer_stage(loader) -> BalancedPacker:
    """The live BalancedPacker of a built loader (through the chain's ``source``)."""
    stage = loader
    while not isinstance(stage, BalancedPacker):
        stage = stage.source
    return stage


def _packer_state(loader_state: dict) -> dict:
    """The BalancedPacker's state inside a saved loader state (depth-first search by stage tag)."""
    stack = [loader_state]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("stage") == "BalancedPacker":
                return node["state"]
            stack += list(node.values())
        elif isinstance(node, list):
            stack += node
    raise AssertionError("no BalancedPacker state")


# -- telemetry, bagel-data stats, the job ----------------------------------------------------------------------

def test_straggler_meter_reports_the_ratio_and_the_lost_share(caplog) -> None:
    stats = StragglerStats(2, (3.0, 4.0), (2.0, 4.0))
    assert stats.ratio == pytest.approx((1.5 + 1.0) / 2) and stats.lost == pytest.approx(1 / 7)
    meter = StragglerMeter(enabled=True)
    batch = load_case(FLEX)["batches"][0]
    assert meter.record(1, batch) == CostModel.of().cost(batch_work(batch))
    meter.record(1, batch)
    world = reduce_world({}, {}, [], step_compute=meter.local())  # no process group: this rank alone
    meter.book(world["step_compute_max"], world["step_compute_mean"], world["dp_size"])
    single = meter.interval()
    assert single.step_max == (2 * CostModel.of().cost(batch_work(batch)),) and single.ratio == 1.0
    assert meter.local() == [] and meter.interval().step_max == ()  # a new interval
    with caplog.at_level("INFO", logger="bridge.models.bagel.data.job.straggler"):
        out = meter.log(1, stats)
    assert out["straggler_ratio"] == stats.ratio and out["tflops_per_step"] == pytest.approx(3e-12)
    assert "straggler: compute max/mean over 2 DP ranks 1.2500, 14.3% of step time waiting" in caplog.text
    assert meter.summary()["straggler_lost"] == pytest.approx(1 / 7)
    # the telemetry carries the figures to TensorBoard and its return value
    tele = Telemetry(max_num_tokens=320, group_weights={"a": 1.0}, enabled=False)
    assert tele.log(1, {}, extra=out)["straggler_lost"] == stats.lost


def test_stats_prints_both_predictions(demo_setup) -> None:
    from bridge.models.bagel.data.tools.budget_stats import collect_stats

    out, tok = demo_setup
    data = validate_data(_balanced_cfg(out), budgets="report")
    report = collect_stats(data.groups, data.config.packer, tok, progress=False, sim_packs=20, straggler_dp=(8, 64))
    text = report.format()
    assert "straggler prediction, data.packer.strategy official vs balanced (configured: balanced)" in text
    (dp8, dp64) = report.straggler
    assert dp64.dp == 64 and dp64.official.ratio > dp64.balanced.ratio >= 1.0
    assert dp8.official.tokens_per_pack > 0 and dp8.balanced.tokens_per_pack > 0
    assert all(e.work.tokens > 0 for g in report.groups for e in g.estimates)
