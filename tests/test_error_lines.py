"""The first line of an error the job prints is at most 300 characters; the detail follows on the next lines.

One test per case that used to end in one long line: a mistyped key among many overrides, a changed seed on
resume, a refused state file (and no advice to allow the refused type). The stuck shard's line is checked where
a real stuck read is made (tests/test_watchdog.py). ``errors.error_lines`` is what scripts/pretrain_bagel.py
prints; ``errors.shorten`` is the other ranks' short form (``job.topology.agree``).
"""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest
import torch

from bridge.models.bagel.data.config import ConfigError
from bridge.models.bagel.data.errors import FIRST_LINE_LIMIT, error_lines, shorten, split_first_line

REPO = Path(__file__).resolve().parents[1]


def _first(kind: str, exc: BaseException) -> tuple[str, list[str]]:
    first, *rest = error_lines(1, kind, str(exc))
    assert len(first) <= FIRST_LINE_LIMIT, (len(first), first)
    return first, rest


def test_a_typo_key_among_many_overrides_names_only_its_override():
    from bridge.models.bagel.data.job.config import load_job_config

    overrides = [f"train.train_iters={i + 1}" for i in range(40)] + ["data.packer.max_num_tokns=9"]
    with pytest.raises(ConfigError) as info:
        load_job_config(REPO / "configs" / "demo.yaml", overrides)
    first, _ = _first("ConfigError", info.value)
    assert "override 'data.packer.max_num_tokns=9'" in first and "train_iters=1" not in first, first


def test_a_changed_seed_on_resume(demo_setup):
    from _external_common import demo_config
    from bridge.models.bagel.data.build import build_bagel_train_loader
    from bridge.models.bagel.data.state import ResumeMismatchError

    out, tok = demo_setup
    loader = build_bagel_train_loader(demo_config(out, 0, True, seed=42), tok, (0, 1))
    try:
        next(loader)
        state = loader.save_state()
    finally:
        loader.close()
    other = build_bagel_train_loader(demo_config(out, 0, True, seed=43), tok, (0, 1))
    try:
        with pytest.raises(ResumeMismatchError) as info:
            other.restore_state(state)
    finally:
        other.close()
    first, rest = _first("ResumeMismatchError", info.value)
    detail = "\n".join(rest)
    assert "loader.seed: saved=42 current=43" in detail and "data.fresh_stream=true" in detail, detail


def test_a_refused_state_file_gives_no_advice_to_allow_the_type(tmp_path):
    """A state file holding a reference to ``os.system`` (``posix.system``): refused by Bridge's restricted loader;
    our error names the file and the cause, and does not pass on Bridge's "file a bug so it can be added"."""
    from megatron.core.rerun_state_machine import RerunDataIterator

    from _external_common import golden_loader, single_process_pg_collection
    from bridge.models.bagel.data.job.checkpoint import rank_state_file, restore_loader

    pgs = single_process_pg_collection()
    path = rank_state_file(str(tmp_path / "energon"), 4, 0)
    os.makedirs(os.path.dirname(path))
    torch.save({"dataloader_state_dict": {"version": 4, "hook": os.system}}, path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    fresh = RerunDataIterator(golden_loader())
    with pytest.raises(ConfigError) as info:
        restore_loader(str(tmp_path), 4, fresh, types.SimpleNamespace(tp=pgs.tp, pp=pgs.pp, cp=pgs.cp, dp=pgs.dp))
    first, rest = _first("ConfigError", info.value)
    text = str(info.value)
    assert "cannot be read" in first and f"  file: {path}" in rest and "system" in text, text
    assert "file a bug" not in text.lower() and "so it can be added" not in text, text
    assert "do not add the type" in text
    fresh.iterable.close()


def test_long_first_lines_break_between_words_and_briefs_keep_whole_words():
    words = "the storage under it does not answer; check the mount of the shard file " * 8
    lines = split_first_line(words.strip(), prefix=30)
    assert len(lines[0]) <= FIRST_LINE_LIMIT - 30 and lines[0].endswith(";") and " ".join(lines) == " ".join(words.split())
    brief = shorten("DataReadError in group 't2i_pretrain': " + words, 120)
    assert len(brief) <= 120 and brief.endswith("…")
    assert (brief[:-1].rstrip() + " ") in ("DataReadError in group 't2i_pretrain': " + words)  # whole words only
