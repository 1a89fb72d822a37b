"""``data.resume_budget_change``: a deliberate change of packer budgets on resume, under the elastic order.

Real Energon readers on the demo data (the small selection of ``test_elastic``), ranks of a DP-2 world built one
after another in this process. A world runs with budget A and saves (``save_state()``); a new world with budget B
and the key restores each rank's own state: the packer's waiting samples go back to the readers (read again first),
the readers keep their cursors, and over the epoch every read is packed, dropped (counted) or still waiting exactly
once, identified by (group, selection position, epoch) (``tools.ledger.check_exactly_once``). Without the key the
same restore is refused naming the budget and the key; a seed change, or a budget change under ``data.order:
official``, stays refused with the key. Also: a budget change with a resize (2 -> 1), under ``packer.strategy:
balanced``, through the main job's restore (Bridge's ``maybe_load_dataloader_state``) and through ``bagel-data
resize-state``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections import Counter

import pytest

from _external_common import assert_same, elastic_world, run_world, small_selection_config
from bridge.models.bagel.data.build import build_bagel_train_loader
from bridge.models.bagel.data.external import ResumeMismatchError
from bridge.models.bagel.data.tools.ledger import check_exactly_once

#: Budget B: larger packs, a smaller overflow buffer (budget A is ``demo_config``'s: 7168 / 8192, buffer 50).
BIGGER = dict(expected_num_tokens=10240, max_num_tokens=12288, max_buffer_size=20)


@pytest.fixture(scope="module")
def small(demo_setup, tmp_path_factory):
    out, tok = demo_setup
    return small_selection_config(out, tmp_path_factory.mktemp("budget")), tok


def _budget(cfg, **budgets):
    return dataclasses.replace(cfg, packer=dataclasses.replace(cfg.packer, **budgets))


def _waiting(report) -> int:
    return sum(g["waiting"] for g in report.groups.values())


def _buffered_ids(state: dict) -> list[tuple[str, int, int]]:
    """(group, selection position, epoch) of every sample waiting in a saved loader state's packer."""
    from bridge.models.bagel.data.tools.ledger import _identity, _packer_nodes

    packer = _packer_nodes(state["source"])[0]["state"]
    return [(packer["groups"][g], *_identity(key)) for g, key in packer["buffer"] + packer["carry"]]


def test_a_budget_change_hands_the_buffer_back_and_the_epoch_stays_exactly_once(small, caplog) -> None:
    cfg, tok = small
    reads: list[dict] = []
    _, saved = run_world(elastic_world(cfg, tok, 2), 3, reads)
    before = check_exactly_once(reads, saved)
    handed = [_buffered_ids(state) for state in saved]
    assert before.ok and _waiting(before) == sum(map(len, handed)) > 0, before  # samples to hand back

    changed = _budget(cfg, **BIGGER)
    caplog.set_level(logging.DEBUG, logger="bridge.models.bagel.data.pipeline.loader")
    world = elastic_world(changed, tok, 2, saved, resume_budget_change=True)
    lines = [r for r in caplog.records if "data.resume_budget_change=true: packer budgets changed" in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.INFO, logging.DEBUG], lines  # one clear line, on rank 0
    said = lines[0].getMessage()
    assert "max_num_tokens 8192 -> 12288" in said and "expected_num_tokens 7168 -> 10240" in said, said
    assert "max_buffer_size 50 -> 20" in said, said
    assert f"{len(handed[0])} buffered sample(s) handed back to the readers" in said, said
    for ld, mine in zip(world, handed):  # the new packer starts empty; its samples wait in its readers, read first
        stats = ld.stats()
        assert stats["buffer_len"] == 0 and stats["carry_len"] == 0, stats
        assert not any(g["buffered"] for g in stats["ledger"].values()), stats["ledger"]
        assert sum(st["pending"] for st in stats["sources"].values()) == len(mine), stats["sources"]

    first = len(reads)
    batches, final = run_world(world, 3, reads)
    assert all(b["sequence_length"] <= 12288 for per_rank in batches for b in per_rank)
    assert any(b["sequence_length"] > 8192 for per_rank in batches for b in per_rank)  # budget B is in force
    report = check_exactly_once(reads, final)
    assert report.ok, report.problems
    assert report.epoch_complete, report  # every group's epoch-0 selection is covered, across the change
    # every handed-back sample, by identity: packed once after the change, or waiting again at the end
    after = Counter((d["dataset_name"], int(d["position"]), int(d["epoch"])) for d in reads[first:])
    still = Counter(i for state in final for i in _buffered_ids(state))
    assert all(after[i] + still[i] == 1 for mine in handed for i in mine), (handed, after, still)
    assert any(after[i] for mine in handed for i in mine)

    # the same restore again gives the same batches, bit for bit (pure data, deterministic)
    again = build_bagel_train_loader(dataclasses.replace(changed, resume_budget_change=True), tok, (0, 2), length=10)
    again.restore_state(saved[0])
    for expected in batches[0][:2]:
        assert_same(next(again), expected)
    again.close()


@pytest.fixture(scope="module")
def one_step(small):
    """Every packed sample's ``data_indexes`` and the states of a DP-2 world after one batch under budget A."""
    cfg, tok = small
    reads: list[dict] = []
    _, saved = run_world(elastic_world(cfg, tok, 2), 1, reads)
    return reads, saved


def test_a_budget_change_with_a_resize_is_exactly_once(small, one_step) -> None:
    """DP 2 -> 1 and budget A -> B in one restart: ``resize_states`` accepts the budget change under the key, and
    ``restore_state`` applies it to the resized state."""
    cfg, tok = small
    reads, saved = list(one_step[0]), one_step[1]
    _, final = run_world(elastic_world(_budget(cfg, **BIGGER), tok, 1, saved, resume_budget_change=True), 3, reads)
    report = check_exactly_once(reads, final)
    assert report.ok, report.problems
    grown = build_bagel_train_loader(_budget(cfg, **BIGGER), tok, (0, 1), length=10)
    with pytest.raises(ResumeMismatchError, match="data.resume_budget_change=true"):
        grown.resize_states(saved, 0, 1)  # without the key, a resize does not loosen the fingerprint
    grown.close()


def _refusal(cfg, tok, dp: tuple[int, int], state: dict) -> str:
    """The ``ResumeMismatchError`` text of restoring ``state`` into a loader built from ``cfg`` on ``dp``."""
    loader = build_bagel_train_loader(cfg, tok, dp, length=10)
    try:
        with pytest.raises(ResumeMismatchError) as refused:
            loader.restore_state(state)
    finally:
        loader.close()
    return str(refused.value)


def test_without_the_key_a_budget_change_is_refused_and_the_key_allows_budgets_only(small, one_step) -> None:
    cfg, tok = small
    saved = one_step[1]
    text = _refusal(_budget(cfg, max_num_tokens=12288), tok, (0, 2), saved[0])
    assert "packer.max_num_tokens: saved=8192 current=12288" in text, text
    assert "data.resume_budget_change=true" in text and "only packer budgets differ" in text, text

    both = dataclasses.replace(_budget(cfg, max_num_tokens=12288), seed=7, resume_budget_change=True)
    text = _refusal(both, tok, (0, 2), saved[0])
    assert "loader.seed: saved=42 current=7" in text and "lets only the packer budgets change" in text, text
    text = _refusal(dataclasses.replace(_budget(cfg, lossless=True), resume_budget_change=True), tok, (0, 2), saved[0])
    assert "packer.lossless: saved=False current=True" in text, text  # not a budget: it changes what the loop drops


def test_a_state_that_also_records_the_knobs_under_loader_packer_still_resumes(small, one_step) -> None:
    """States saved before the packer stage's identity became the one record of the packer knobs (issue 39) carry
    them twice, also under ``loader.packer``: they restore, and a budget change is named once."""
    cfg, tok = small
    saved = copy.deepcopy(one_step[1][0])
    saved["fingerprint"]["loader"]["packer"] = cfg.packer.stream_identity()  # as those versions wrote it
    loader = build_bagel_train_loader(cfg, tok, (0, 2), length=10)
    try:
        loader.restore_state(saved)
        assert isinstance(next(iter(loader)), dict)
    finally:
        loader.close()
    text = _refusal(_budget(cfg, max_num_tokens=12288), tok, (0, 2), saved)
    assert text.count("max_num_tokens: saved=8192 current=12288") == 1, text
    assert "data.packer.max_num_tokens: saved=8192 current=12288" in text, text


def test_under_the_official_order_a_budget_change_stays_refused(small) -> None:
    cfg, tok = small
    official = dataclasses.replace(cfg, order="official", num_workers=1)
    _, saved = run_world(elastic_world(official, tok, 1), 1)
    changed = dataclasses.replace(_budget(official, max_num_tokens=12288), resume_budget_change=True)
    text = _refusal(changed, tok, (0, 1), saved[0])
    assert "packer.max_num_tokens: saved=8192 current=12288" in text, text
    assert "data.order: official cannot change them" in text and "function of the packer state" in text, text


def test_the_budget_keys_are_packer_knobs_and_the_balanced_pool_is_handed_back_too(small) -> None:
    """``PACKER_BUDGET_KEYS`` names real ``data.packer`` knobs; under ``packer.strategy: balanced`` a change of
    ``max_num_tokens`` and ``balance.target_tokens`` hands the look-ahead pool back and stays exactly once."""
    from bridge.models.bagel.data.config import PACKER_BUDGET_KEYS, PackerConfig

    knobs = PackerConfig()
    for key in PACKER_BUDGET_KEYS:
        section, _, name = key.rpartition(".")
        assert hasattr(getattr(knobs, section) if section else knobs, name), key
    cfg, tok = small
    cfg = _budget(cfg, strategy="balanced")
    reads: list[dict] = []
    _, saved = run_world(elastic_world(cfg, tok, 1), 2, reads)
    assert _waiting(check_exactly_once(reads, saved)) > 0  # the pool holds samples to hand back
    changed = _budget(cfg, max_num_tokens=12288, expected_num_tokens=10240,
                      balance=dataclasses.replace(cfg.packer.balance, target_tokens=9000))
    world = elastic_world(changed, tok, 1, saved, resume_budget_change=True)
    assert world[0].stats()["buffer_len"] == 0
    _, final = run_world(world, 2, reads)
    report = check_exactly_once(reads, final)
    assert report.ok, report.problems


def test_the_job_resumes_a_budget_change_through_bridge_restore(demo_setup, tmp_path, caplog) -> None:
    """The main job (one rank, in this process): a checkpoint at step 2 under ``max_num_tokens`` 8192, resumed with
    9216 — refused without the key (naming it), continued at batch 2 with it (Bridge's ``maybe_load_dataloader_state``
    calls ``restore_state``), the change said in one line."""
    from _external_common import SMALL_JOB, run_job_in_process
    from _relative_project import project
    from bridge.models.bagel.data.job.topology import AgreedError

    job_yaml = project(demo_setup, tmp_path)
    _, tokenizer = demo_setup
    ckpt = tmp_path / "ckpt"

    def run(*overrides: str) -> dict:
        return run_job_in_process(job_yaml, [*SMALL_JOB, *overrides], tokenizer)

    assert run("train.train_iters=2", f"train.save={ckpt}")["pipeline"]["position"] == 2
    changed = ["train.train_iters=3", f"train.load={ckpt}", "data.packer.max_num_tokens=9216"]
    with pytest.raises(AgreedError) as refused:
        run(*changed)
    assert "data.resume_budget_change=true" in str(refused.value), str(refused.value)
    caplog.set_level(logging.INFO, logger="bridge.models.bagel.data.pipeline.loader")
    summary = run(*changed, "data.resume_budget_change=true")
    assert summary["pipeline"]["position"] == 3  # batch 2 of the same stream, then one more
    said = [r.getMessage() for r in caplog.records if "packer budgets changed at batch 2" in r.getMessage()]
    assert len(said) == 1 and "max_num_tokens 8192 -> 9216" in said[0], said


def test_resize_state_cli_applies_a_budget_change_only_with_the_key(small, one_step, tmp_path, caplog) -> None:
    """``bagel-data resize-state`` (DP 2 -> 1) on a checkpoint written under budget A, with the run's config at budget
    B: refused in one line naming the key and nothing rewritten; with ``data.resume_budget_change=true`` it writes one
    state file that resumes under budget B, and the epoch stays exactly once over the old world and the new."""
    import torch
    import yaml

    from bridge.models.bagel.data.job.checkpoint import TRACKER, loader_state_files, read_loader_states
    from bridge.models.bagel.data.tools.cli import main

    cfg, tok = small
    reads, saved = list(one_step[0]), one_step[1]
    root = tmp_path / "ckpt"
    step_dir = root / "energon" / "iter_0000001"
    step_dir.mkdir(parents=True)
    for r, state in enumerate(saved):  # what Bridge's maybe_save_dataloader_state writes per DP rank
        torch.save({"dataloader_state_dict": state}, step_dir / f"train_dataloader_dprank{r:03d}.pt")
    (root / TRACKER).write_text("1")
    packer = {k: getattr(cfg.packer, k) for k in ("expected_num_tokens", "max_num_tokens", "max_num_tokens_per_sample",
                                                  "prefer_buffer_before", "use_flex", "max_latent_size")}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"data": {"groups": cfg.groups, "dataset_info": cfg.dataset_info, "order": "elastic",
                                            "partitions": cfg.partitions, "seed": cfg.seed, "num_workers": 0,
                                            "prefetch": 0, "packer": {**packer, **BIGGER}}}))
    command = ["resize-state", str(root), "--dp-size", "1", "--config", str(job)]

    with caplog.at_level(logging.ERROR):
        assert main(command) == 2
    refusals = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(refusals) == 1 and "data.resume_budget_change=true" in refusals[0], refusals
    assert len(loader_state_files(str(root), 1)) == 2  # nothing rewritten

    assert main([*command, "data.resume_budget_change=true"]) == 0
    new = read_loader_states(str(root), 1)
    assert len(new) == 1 and (step_dir / "resized_from_dp2").is_dir()
    batches, final = run_world(elastic_world(_budget(cfg, **BIGGER), tok, 1, new, resume_budget_change=True), 3,
                               reads)
    assert any(b["sequence_length"] > 8192 for b in batches[0])  # budget B is in force
    report = check_exactly_once(reads, final)
    assert report.ok, report.problems
