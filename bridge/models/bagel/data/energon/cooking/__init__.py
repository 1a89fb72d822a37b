"""Cooking: a crude converted sample into the official per-sample dict (``sample.BagelSample``). ``common``:
recorded / replayed random choices (``Draws``), tombstones (``DropSample``, ``DROP_REASONS``), image decoding,
``cook_with`` (run a group core on a crude sample); ``t2i`` / ``edit`` / ``vlm``: the group cores (official
``parse_row`` semantics, quirks kept); ``groups``: ``CORES`` and ``make_cook_context``.
"""

from .common import (DROP_REASONS, UNUSED_REASONS, CookContext, Draws, DropSample, ReplayError, SampleCookError,
                     cook_with)
from .groups import CORES, make_cook_context
from .sample import PLAN_KEYS, BagelSample

__all__ = ["CORES", "DROP_REASONS", "UNUSED_REASONS", "PLAN_KEYS", "BagelSample", "CookContext", "Draws",
           "DropSample", "ReplayError", "SampleCookError", "cook_with", "make_cook_context"]
