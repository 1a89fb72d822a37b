"""Energon side of the BAGEL runtime: the crude WebDataset layout, cookers and readers.

The converter from the official raw formats lives in the separate ``converter`` wing. The reader names
below are resolved lazily (PEP 562), so importing ``layout`` does not pull in torch / megatron-energon.
``BagelGroupReader`` is the per-group reader of the default ``data.order: energon``; ``OfficialOrderReader``
reproduces the official unit order, for the parity tests and as the per-group reader the builder
(``build.py``) gives each emulated official worker under ``data.order: official`` (``official_mode``).
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
