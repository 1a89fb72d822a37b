"""Every flag of ``bagel-data`` and of the job script has help text, and the help names its default."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from bridge.models.bagel.data.tools.cli import _parser

REPO = Path(__file__).resolve().parents[1]


def _parsers(parser: argparse.ArgumentParser, name: str = "bagel-data"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def _check(name: str, parser: argparse.ArgumentParser) -> list[str]:
    problems = []
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        flag = "/".join(action.option_strings) or action.dest
        if not action.help:
            problems.append(f"{name} {flag}: no help")
            continue
        shown = formatter._get_help_string(action) if hasattr(formatter, "_get_help_string") else action.help
        if action.default not in (None, False, argparse.SUPPRESS) and not action.required and "default" not in shown:
            problems.append(f"{name} {flag}: help does not name the default {action.default!r}")
    return problems


def test_every_bagel_data_flag_has_help_with_its_default():
    problems = [p for name, parser in _parsers(_parser()) for p in _check(name, parser)]
    assert not problems, problems


def test_every_job_flag_has_help(capsys):
    spec = importlib.util.spec_from_file_location("pretrain_bagel", REPO / "scripts" / "pretrain_bagel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit):
        module.main(["--help"])
    text = capsys.readouterr().out
    for flag in ("--config", "--digest-log", "--recipe", "--forward-step", "--debug"):
        line = text.split(flag, 1)[1].split("\n  -", 1)[0]
        assert len(line.split()) > 1, (flag, line)  # help text after the flag
    assert "configs/demo.yaml" in text  # --config's default
