"""Shared helpers for tests that replay the official packer's golden cases."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import torch

from bridge.models.bagel.data.config import PackerConfig
from bridge.models.bagel.data.packing import BagelPacker, ListGroupSource

GOLDEN_DIR = Path(__file__).parent / "fixtures" / "bagel_official"
CASES = sorted(json.loads((GOLDEN_DIR / "index.json").read_text())["cases"])

sys.path.insert(0, str(GOLDEN_DIR))
from compare_golden import first_difference  # noqa: E402  (the golden data's own comparator)


_CACHE: dict[str, dict] = {}


def load_case(name: str) -> dict:
    """Load (and memoize) a golden case with the safe loader."""
    if name not in _CACHE:
        _CACHE[name] = torch.load(GOLDEN_DIR / f"{name}.pt", map_location="cpu", weights_only=True)
    return _CACHE[name]


def build_packer(case: dict) -> tuple[BagelPacker, list[ListGroupSource]]:
    """A packer over the case's stored streams, configured exactly like the official run."""
    cfg = case["config"]
    sources = [ListGroupSource(case["groups"][g], name=g) for g in cfg["group_names"]]
    packer = BagelPacker(sources, cfg["group_weights"], cfg["is_mandatory"], cfg["special_tokens"],
                         PackerConfig.from_mapping({k: v for k, v in cfg.items() if k in PackerConfig.keys()}), group_names=cfg["group_names"])
    return packer, sources


def seed_like_official(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

