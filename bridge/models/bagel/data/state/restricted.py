"""What a saved state may hold: the types Megatron-Bridge's restricted unpickler accepts.

Bridge loads ``train_dataloader_dprankNNN.pt`` with a restricted unpickler (spec ``megatron_contracts.md`` §3):
builtins, tensors and NumPy values, plus the Energon state classes it allows explicitly. ``check_restricted`` walks a
state and names the first value that unpickler would refuse, so a bad state fails at save time, not at resume.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from .protocol import StateError

__all__ = ["check_restricted", "energon_state_classes"]

_PLAIN = (bool, int, float, complex, str, bytes, bytearray, type(None), slice, range)


def check_restricted(obj: Any, path: str = "state", *, allow: tuple[type, ...] = ()) -> None:
    """Raise ``StateError`` naming the first value that a builtins/tensor/NumPy-only unpickler refuses.

    ``allow`` adds extra permitted classes (e.g. Energon's own state classes, which Bridge allows)."""
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
    raise StateError(f"{path}: {type(obj).__module__}.{type(obj).__qualname__} is not allowed in loader state "
                     "(only builtins, tensors and NumPy values survive Megatron's restricted unpickler)")


def energon_state_classes() -> tuple[type, ...]:
    """The Energon state classes Bridge's restricted unpickler accepts (hand-wired Energon loaders in a loader's
    ``stateful_loaders`` save them)."""
    from megatron.energon.flavors.webdataset.sample_loader import SliceState
    from megatron.energon.rng import SystemRngState
    from megatron.energon.savable_loader import (SavableCheckpoint, SavableDataLoaderState, SavableDatasetCheckpoint,
                                                 SavableDatasetState)
    from megatron.energon.state import FlexState

    return (FlexState, SystemRngState, SavableCheckpoint, SavableDataLoaderState, SavableDatasetCheckpoint,
            SavableDatasetState, SliceState)
