"""Exact batch comparison and digests: the bit-level equality rule used for parity and resume checks.

Tensors are equal when dtype, shape and every bit match (floats compared as integers, so -inf == -inf and
+0.0 != -0.0); containers compare by type, length/keys and items. ``batch_digest`` hashes the same
information, so two batches with equal digests are equal under this rule (up to sha256 collisions).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import torch

__all__ = ["batch_digest", "first_difference"]

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(_INT_VIEW[t.element_size()]) if t.is_floating_point() else t


def first_difference(expected: Any, actual: Any, path: str = "batch") -> str | None:
    """None when equal under the bit-exact rule, else a one-line description of the first difference."""
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        if not (isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor)):
            return f"{path}: {type(expected).__name__} vs {type(actual).__name__}"
        if expected.dtype != actual.dtype:
            return f"{path}: dtype {expected.dtype} != {actual.dtype}"
        if expected.shape != actual.shape:
            return f"{path}: shape {tuple(expected.shape)} != {tuple(actual.shape)}"
        return None if torch.equal(_bits(expected), _bits(actual)) else f"{path}: values differ"
    if type(expected) is not type(actual):
        return f"{path}: type {type(expected).__name__} != {type(actual).__name__}"
    items: Any = ()
    if isinstance(expected, dict):
        if set(expected) != set(actual):
            return f"{path}: keys differ ({sorted(map(str, set(expected) ^ set(actual)))})"
        items = ((f"{path}.{k}", expected[k], actual[k]) for k in expected)
    elif isinstance(expected, (list, tuple)):
        if len(expected) != len(actual):
            return f"{path}: length {len(expected)} != {len(actual)}"
        items = ((f"{path}[{i}]", x, y) for i, (x, y) in enumerate(zip(expected, actual)))
    elif expected != actual and not (isinstance(expected, float) and expected != expected and actual != actual):
        return f"{path}: {expected!r} != {actual!r}"
    return next(filter(None, (first_difference(x, y, where) for where, x, y in items)), None)


def _feed(h: "hashlib._Hash", value: Any) -> None:
    if isinstance(value, torch.Tensor):
        h.update(f"T{value.dtype}{tuple(value.shape)}".encode())
        h.update(_bits(value).numpy().tobytes())
    elif isinstance(value, dict):
        h.update(b"D%d" % len(value))
        for k in sorted(value, key=str):
            _feed(h, k)
            _feed(h, value[k])
    elif isinstance(value, (list, tuple)):
        h.update((b"L" if isinstance(value, list) else b"U") + b"%d" % len(value))
        for v in value:
            _feed(h, v)
    elif isinstance(value, float):
        h.update(b"F" + struct.pack("<d", value))
    else:
        h.update(f"{type(value).__name__}:{value!r}".encode())


def batch_digest(batch: Any) -> str:
    """sha256 (hex) over dtypes, shapes, bits and structure of a batch (key order does not matter)."""
    h = hashlib.sha256()
    _feed(h, batch)
    return h.hexdigest()
