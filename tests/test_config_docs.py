"""docs/configuration.md documents every config key with its real default, and names no key that does not exist;
configs/real_data.yaml is a valid job config naming every key.

The keys are the fields of ``BagelDataConfig`` (``data.*``), ``PackerConfig`` (``data.packer.*``), the job's
``TrainConfig`` (``train.*``) and the rest of ``JobConfig``; the page's tables are parsed (first column: the
backticked keys of a row, the second: their defaults, comma-separated when a row holds several).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import yaml

from bridge.models.bagel.data.config import BagelDataConfig, PackerConfig
from bridge.models.bagel.data.job.config import JobConfig, TrainConfig, load_job_config

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "configuration.md"


def _fields(cls: type) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
    return out


def _expected() -> dict[str, Any]:
    """Every documented key (as the page writes it) and its default."""
    keys: dict[str, Any] = {}
    for name, default in _fields(BagelDataConfig).items():
        if name != "packer":
            keys[f"data.{name}"] = default
    for name, default in _fields(PackerConfig).items():  # the packer table names knobs bare
        if dataclasses.is_dataclass(default):  # a nested section (balance, cost): its keys as section.key
            keys.update({f"{name}.{k}": v for k, v in _fields(type(default)).items()})
        else:
            keys[name] = default
    keys.update({f"train.{k}": v for k, v in _fields(TrainConfig).items() if not k.startswith("_")})
    # model.* is the model package's schema (documented in its own section, checked by the launcher)
    keys.update({k: v for k, v in _fields(JobConfig).items() if k not in ("data", "train", "model")})
    return keys


def _rows(section: str) -> list[tuple[list[str], list[str]]]:
    """(keys, default cells) of each table row of the page's section ``## {section}``."""
    text = PAGE.read_text(encoding="utf-8")
    body = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        keys = re.findall(r"`([^`]+)`", cells[0])
        defaults = [d.strip() for d in cells[1].split(",")] if len(keys) > 1 else [cells[1]]
        rows.append((keys, defaults))
    return rows


def _render(value: Any) -> str:
    if value is None:
        return "null"
    if value == "???":
        return "required"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def test_every_config_key_is_documented_with_its_default():
    expected = _expected()
    documented: dict[str, str] = {}
    for section in ("`data.*` (the loader)", "`data.packer.*`", "`train.*` (the job) and the rest"):
        for keys, defaults in _rows(section):
            assert len(defaults) == len(keys), (keys, defaults)
            for key, default in zip(keys, defaults):
                assert key not in documented, f"{key} documented twice"
                documented[key] = default.replace("`", "")
    missing = sorted(set(expected) - set(documented))
    unknown = sorted(set(documented) - set(expected))
    assert not missing, f"config keys without a row in docs/configuration.md: {missing}"
    assert not unknown, f"docs/configuration.md documents keys that do not exist: {unknown}"
    wrong = {k: (documented[k], _render(v)) for k, v in expected.items() if not documented[k].startswith(_render(v))}
    assert not wrong, f"documented default differs from the dataclass (page, code): {wrong}"


def test_real_data_template_is_a_valid_job_config_with_every_key():
    path = REPO / "configs" / "real_data.yaml"
    cfg = load_job_config(path)  # the schema accepts it (unknown keys would be refused)
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    packer = raw["data"]["packer"]
    named = {f"data.{k}" for k in raw["data"] if k != "packer"}
    named |= {f"{k}.{sub}" if isinstance(v, dict) else k for k, v in packer.items()
              for sub in (v if isinstance(v, dict) else [None])}
    named |= {f"train.{k}" for k in raw["train"]} | {k for k in raw if k not in ("data", "train")}
    always_defaulted = {"train.digest_log", "train.exit_after_step", "train.progress", "demo_seed"}  # test / demo knobs
    assert set(_expected()) - named <= always_defaulted, sorted(set(_expected()) - named - always_defaulted)
    assert cfg.data.packer.max_latent_size == 64 and cfg.data.order == "elastic"
    assert cfg.data.groups == str(path.parent / "groups.yaml")  # relative to the template's directory
