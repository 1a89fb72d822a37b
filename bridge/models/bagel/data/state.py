"""Declared, restricted-type state for the stateful pipeline stages.

Every stateful stage lists the attributes that make up its state once, in ``_savable_fields``, and
resets them in ``reset_state()``; ``state_dict()`` / ``load_state_dict()`` then follow from that
declaration, so save and restore cannot drift apart (the pattern of Energon's savable wrappers).
State must survive Megatron-Bridge's restricted unpickler, so ``check_restricted`` can verify that a
state holds only builtins, tensors and NumPy scalars/arrays.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, ClassVar

import numpy as np
import torch

__all__ = ["Savable", "StateError", "check_restricted"]

_PLAIN = (bool, int, float, complex, str, bytes, bytearray, type(None), slice, range)


class StateError(ValueError):
    """A state dict does not fit the stage it is loaded into."""


def check_restricted(obj: Any, path: str = "state", *, allow: tuple[type, ...] = ()) -> None:
    """Raise ``StateError`` naming the first value that a builtins/tensor/NumPy-only unpickler refuses.

    ``allow`` adds extra permitted classes (e.g. Energon's own state classes, which Bridge allows).
    """
    if isinstance(obj, _PLAIN) or isinstance(obj, (torch.Tensor, np.ndarray, np.generic, np.dtype)):
        if type(obj) in (torch.nn.Parameter,):
            raise StateError(f"{path}: nn.Parameter is not allowed in loader state")
        return
    if allow and isinstance(obj, allow):
        return
    if type(obj) in (dict, OrderedDict):
        for k, v in obj.items():
            check_restricted(k, f"{path}[key {k!r}]", allow=allow)
            check_restricted(v, f"{path}[{k!r}]", allow=allow)
        return
    if type(obj) in (list, tuple, set, frozenset):
        for i, v in enumerate(obj):
            check_restricted(v, f"{path}[{i}]", allow=allow)
        return
    raise StateError(
        f"{path}: {type(obj).__module__}.{type(obj).__qualname__} is not allowed in loader state "
        "(only builtins, tensors and NumPy values survive Megatron's restricted unpickler)"
    )


class Savable:
    """Mixin: state = the attributes named in ``_savable_fields``.

    Subclasses implement ``reset_state()`` (sets every declared field to its initial value) and may
    override ``_save_field`` / ``_load_field`` for fields whose live value is not itself storable
    (e.g. a buffer of samples that is stored as restore keys).
    """

    _savable_fields: ClassVar[tuple[str, ...]] = ()

    def reset_state(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _save_field(self, name: str, value: Any) -> Any:
        return copy.deepcopy(value)

    def _load_field(self, name: str, value: Any) -> Any:
        return copy.deepcopy(value)

    def state_dict(self) -> dict[str, Any]:
        """The declared fields, as restricted-type values (deep copies: later steps never mutate them)."""
        return {name: self._save_field(name, getattr(self, name)) for name in self._savable_fields}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore every declared field; a missing or unknown field is a ``StateError`` naming it."""
        if not isinstance(state, dict):
            raise StateError(f"{type(self).__name__}: state must be a dict, got {type(state).__name__}")
        missing = [f for f in self._savable_fields if f not in state]
        extra = [k for k in state if k not in self._savable_fields]
        if missing or extra:
            raise StateError(
                f"{type(self).__name__}: state fields do not match (missing {missing}, unexpected {extra})"
            )
        values = {name: self._load_field(name, state[name]) for name in self._savable_fields}
        for name, value in values.items():
            setattr(self, name, value)
