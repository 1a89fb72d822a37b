"""Energon side of the BAGEL pipeline: crude WebDataset layout, converter from the official raw formats, readers.

The reader names below are resolved lazily (PEP 562), so importing the light modules of this package
(``layout``, ``convert``) does not pull in torch / megatron-energon.
"""

from __future__ import annotations

import importlib
from typing import Any

#: public name -> defining submodule (readers / cookers / sample class / official-order reproduction)
_LAZY = {
    "BagelSample": "sample",
    "PLAN_KEYS": "sample",
    "BagelTaskEncoder": "cookers",
    "GroupCooker": "cookers",
    "make_cooker": "cookers",
    "make_cook_context": "cookers",
    "CookContext": "cook_common",
    "Draws": "cook_common",
    "DROP_REASONS": "cook_common",
    "ReplayError": "cook_common",
    "cook_with": "cook_common",
    "replaying": "cook_common",
    "BagelGroupReader": "reader",
    "dataset_num_samples": "reader",
    "OfficialOrderReader": "official_order",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
