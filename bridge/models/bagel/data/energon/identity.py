"""A reader's resume fingerprint of bounded size: Energon's loader ``config()`` without machine paths, its long
lists (per shard, per worker slice) kept as length + sha256 so the identity stays O(1) per list in every
checkpoint and every restore's diff, while refusing exactly what the full config refuses."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["IDENTITY_INLINE_ITEMS", "canonical_digest", "loader_identity", "strip_paths"]

_SCALARS = (int, float, bool, type(None))
_SCALAR_TYPES = frozenset(_SCALARS)
#: Lists longer than this are kept in a reader's identity as ``{"items", "sha256"}`` (Energon's per-shard and
#: per-slice lists: O(shards) / O(samples / max_samples_per_sequence) entries otherwise, in every checkpoint).
IDENTITY_INLINE_ITEMS = 16


def _is_abs(v: Any) -> bool:
    return type(v) is str and os.path.isabs(v)


def strip_paths(obj: Any) -> Any:
    """``obj`` without machine-specific values: keys starting with ``_`` (energon's convention for paths)
    and absolute path strings are dropped, so fingerprints compare across mount points."""
    if isinstance(obj, Mapping):  # leaves are kept without a call (Energon's per-shard dicts: O(shards) of them)
        return {k: v if type(v) in _SCALAR_TYPES or (type(v) is str and not os.path.isabs(v)) else strip_paths(v)
                for k, v in obj.items()
                if not (isinstance(k, str) and k.startswith("_")) and not (isinstance(v, str) and os.path.isabs(v))}
    if isinstance(obj, (list, tuple)):
        if set(map(type, obj)) <= _SCALAR_TYPES:  # e.g. Energon's slice offsets: nothing to strip (a C loop)
            return list(obj)
        return [strip_paths(v) for v in obj if not (isinstance(v, str) and os.path.isabs(v))]
    return obj


def canonical_digest(obj: Any) -> str:
    """sha256 (hex) of the canonical JSON of ``obj`` (sorted keys, no spaces; non-JSON values as ``str``)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _digest_payload(items: Sequence[Any]) -> Any:
    """What :func:`loader_identity` hashes for a long list: the list itself when it holds only scalars; a list of
    dicts with one key set (Energon's shards) column by column, ``_`` keys dropped, absolute paths as None (C-speed
    comprehensions instead of a walk per entry); anything else :func:`strip_paths`."""
    if set(map(type, items)) <= _SCALAR_TYPES:
        return list(items)
    first = items[0]
    if type(first) is dict and all(type(d) is dict and d.keys() == first.keys() for d in items):
        columns = {}
        for k in first:
            if isinstance(k, str) and k.startswith("_"):
                continue
            col = [d[k] for d in items]
            types = set(map(type, col))
            if types <= _SCALAR_TYPES | {str} and os.sep == "/":  # names / counts: no call per entry
                col = [None if type(v) is str and v.startswith("/") else v for v in col] if str in types else col
            elif not types <= _SCALAR_TYPES:
                col = [None if _is_abs(v) else strip_paths(v) for v in col]
            columns[k] = col
        return {"columns": columns}
    return strip_paths(items)


def loader_identity(config: Any, inline_items: int = IDENTITY_INLINE_ITEMS) -> Any:
    """An Energon loader ``config()`` as a resume fingerprint of bounded size: :func:`strip_paths`, with every list
    longer than ``inline_items`` replaced by ``{"items": len, "sha256": canonical_digest(...)}`` of its path-free
    content (:func:`_digest_payload`).

    Exactly as refusing as the full config (a changed shard list, count, worker slice or worker config changes a
    digest, and the fingerprint diff names its key under ``loader``), but O(1) per list in the saved state and the
    diff, instead of O(shards) and O(samples / max_samples_per_sequence) entries.
    """
    if isinstance(config, Mapping):
        return {k: loader_identity(v, inline_items) for k, v in config.items()
                if not (isinstance(k, str) and k.startswith("_")) and not _is_abs(v)}
    if isinstance(config, (list, tuple)):
        if len(config) > inline_items:
            return {"items": len(config), "sha256": canonical_digest(_digest_payload(config))}
        return [loader_identity(v, inline_items) for v in config if not _is_abs(v)]
    return config
