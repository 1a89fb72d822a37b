"""Declared, restricted-type state for the stateful pipeline stages (Energon's savable-wrapper rule).

Every stateful stage lists the attributes that make up its *whole* state once, in ``_savable_fields``, in
restore order. ``state_dict()`` / ``load_state_dict()`` follow from that declaration, so save and restore
cannot drift apart:

* a field whose value is itself stateful (a ``Savable``, any object with ``state_dict`` /
  ``load_state_dict``, or an Energon ``SavableDataLoader`` with ``save_state_rank`` / ``restore_state_rank``)
  — or a list of such objects — is saved through its own state, as
  ``{"stage": <class name>, "state": {...}}``; the class tag is checked on load, and the live object is
  restored in place (a stage owns its upstream and restores it; nothing else reaches into it);
* any other field is deep-copied out and back in. A field whose live form is not storable (a buffer of
  samples, an RNG state tuple) is declared as a property whose getter returns the storable form and whose
  setter rebuilds the live form (property fields are always treated as plain values).

State must survive Megatron-Bridge's restricted unpickler, so ``check_restricted`` verifies that a state
holds only builtins, tensors, NumPy values (and explicitly allowed classes).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = ["RESIZABLE", "ResizeContext", "STATE_PROTOCOLS", "Savable", "register_resizable", "Stage", "StateError", "chain_fingerprint", "check_restricted", "is_stateful",
           "energon_rank_state", "load_tagged", "restore_of", "save_of", "state_protocol", "tagged_state",
           "unsavable_fields", "walk_stages"]

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


#: The two save/restore protocols a stage may speak: ours and torch's (``state_dict`` / ``load_state_dict``),
#: and Energon's per-rank one (``SavableDataLoader.save_state_rank`` / ``restore_state_rank``).
STATE_PROTOCOLS: tuple[tuple[str, str], ...] = (("state_dict", "load_state_dict"),
                                                ("save_state_rank", "restore_state_rank"))


def state_protocol(obj: Any) -> tuple[str, str] | None:
    """The ``(save, restore)`` method names ``obj`` speaks (first of ``STATE_PROTOCOLS``), or None."""
    for save, restore in STATE_PROTOCOLS:
        if callable(getattr(obj, save, None)) and callable(getattr(obj, restore, None)):
            return save, restore
    return None


def is_stateful(obj: Any) -> bool:
    """True for objects that save and restore themselves (either protocol of ``STATE_PROTOCOLS``)."""
    return state_protocol(obj) is not None


def _protocol(obj: Any) -> tuple[str, str]:
    protocol = state_protocol(obj)
    if protocol is None:
        raise StateError(f"{type(obj).__name__} has neither state_dict()/load_state_dict() nor "
                         "save_state_rank()/restore_state_rank()")
    return protocol


def save_of(obj: Any) -> Any:
    """``obj``'s own state through the protocol it speaks (``state_dict()`` or Energon's ``save_state_rank()``,
    the latter through :func:`energon_rank_state`)."""
    save = _protocol(obj)[0]
    return energon_rank_state(obj) if save == "save_state_rank" else getattr(obj, save)()


def energon_rank_state(loader: Any) -> Any:
    """``loader.save_state_rank()`` of an Energon ``SavableDataLoader``, with a race of its workers corrected.

    Energon (checked: 7.x, ``savable_loader.SavableDatasetWrapper``) answers a save from each worker's command
    thread, which the worker starts inside its ``__iter__`` just before taking the command lock. A worker that
    has not stored its first checkpoint yet (slow to start; a save right after the first sample, ~1 in 10 under
    CPU load) can answer from its construction-time sentinel ``(state=None, sample_index=-1)``, giving
    ``offset = last + 1 - (-1)``: one sample more than it emitted, so the resumed loader skips that worker's
    first sample (after a restore it would also drop the restored state). No started worker answers
    ``state=None``: the sentinel is the only checkpoint without a state, and every later one is preferred to it.
    Such a worker has emitted nothing since the loader (re)started, so its true checkpoint is its initial one:
    the restored state and skip count (``dataset.get_initial_checkpoint()``), or ``state=None, offset=0``
    (a fresh start). Other answers, and loaders without workers, are returned unchanged.
    """
    state = loader.save_state_rank()
    workers = getattr(state, "worker_states", None)
    if not workers or not getattr(loader, "num_workers", 0):
        return state
    stale = [i for i, ws in enumerate(workers) if hasattr(ws, "offset") and ws.state is None and ws.offset != 0]
    if stale:
        from megatron.energon.savable_loader import SavableDatasetCheckpoint

        initial = loader.dataset.get_initial_checkpoint()
        for i in stale:
            workers[i] = initial[i] if initial is not None else SavableDatasetCheckpoint(state=None, offset=0)
        logger.debug("Energon loader state: worker(s) %s had not started iterating; their initial checkpoint "
                     "is saved instead of Energon's off-by-one answer", stale)
    return state


def restore_of(obj: Any, state: Any) -> None:
    """Restore ``obj`` in place from ``save_of(obj)`` output, through the same protocol."""
    getattr(obj, _protocol(obj)[1])(state)


def _nested(obj: Any, name: str) -> Any:
    """The value of a declared field if it may hold nested stages; None for property fields (always plain)."""
    if isinstance(getattr(type(obj), name, None), property):
        return None
    return getattr(obj, name, None)


def _is_stage_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(is_stateful(v) for v in value)


def _transparent(stage: Any) -> bool:
    return bool(getattr(stage, "_transparent", False))


def tagged_state(stage: Any) -> dict[str, Any]:
    """``{"stage": class name, "state": save_of(stage)}``: a nested stage's saved form.

    A transparent stage (one that does not change the stream, like prefetch) saves as its upstream does, so
    it may be added or removed between a save and a restore.
    """
    if _transparent(stage):
        return stage.state_dict()[stage._upstream_field]
    return {"stage": type(stage).__name__, "state": save_of(stage)}


def load_tagged(stage: Any, saved: Any, where: str) -> None:
    """Restore ``stage`` in place from ``tagged_state`` output; the class tag must match."""
    if _transparent(stage):
        stage.load_state_dict({stage._upstream_field: saved})
        return
    if not isinstance(saved, dict) or set(saved) != {"stage", "state"}:
        got = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
        raise StateError(f"{where}: expected a nested stage state {{'stage', 'state'}}, got {got}")
    if saved["stage"] != type(stage).__name__:
        raise StateError(f"{where}: the saved state belongs to a {saved['stage']}, but this pipeline has a "
                         f"{type(stage).__name__} here (the pipeline was built differently)")
    restore_of(stage, saved["state"])


def walk_stages(stage: Any) -> Iterator[Any]:
    """``stage`` and every stateful stage nested in its declared fields, depth first."""
    yield stage
    for name in getattr(stage, "_savable_fields", ()):
        value = _nested(stage, name)
        if is_stateful(value):
            yield from walk_stages(value)
        elif _is_stage_list(value):
            for v in value:
                yield from walk_stages(v)


def _cannot_save(item: Any) -> bool:
    """An entry of a declared field that is neither a stage nor a list of stages, and is an iterator (an
    upstream stage with no state protocol): the stage holding it cannot be saved (``Savable._save_field``)."""
    return hasattr(item, "__next__")


def unsavable_fields(stage: Any) -> list[str]:
    """``"Stage.field: Type"`` for every declared field under ``stage`` holding an iterator that speaks no state
    protocol: ``state_dict()`` would raise ``StateError`` there (the chain cannot be checkpointed)."""
    out = []
    for s in walk_stages(stage):
        for name in getattr(s, "_savable_fields", ()):
            value = _nested(s, name)
            if is_stateful(value) or _is_stage_list(value):
                continue
            items = value if isinstance(value, (list, tuple)) else [value]
            out += [f"{type(s).__name__}.{name}: {type(v).__name__}" for v in items if _cannot_save(v)]
    return out


def chain_fingerprint(stage: Any) -> dict[str, Any]:
    """What must match to resume ``stage`` and everything nested in it: each stage's ``identity()``.

    ``{"stage": class name, **stage.identity(), <field>: nested fingerprint, …}`` (JSON-like, no paths).
    """
    if _transparent(stage):
        return chain_fingerprint(getattr(stage, stage._upstream_field))
    identity = getattr(stage, "identity", None)
    out: dict[str, Any] = {"stage": type(stage).__name__, **(identity() if callable(identity) else {})}
    for name in getattr(stage, "_savable_fields", ()):
        value = _nested(stage, name)
        if is_stateful(value):
            out[name] = chain_fingerprint(value)
        elif _is_stage_list(value):
            out[name] = [chain_fingerprint(v) for v in value]
    return out


class Savable:
    """Mixin: state = the attributes named in ``_savable_fields`` (nested stages through their own state).

    A stage that does not change the stream and wraps exactly one upstream (the field named by
    ``_upstream_field``) may set ``_transparent = True``: its saved form and fingerprint are then its
    upstream's (see ``tagged_state``).

    Subclasses may implement ``reset_state()`` (every plain field back to its initial value),
    ``identity()`` (the configuration that must match for a saved state to apply; see ``chain_fingerprint``)
    and ``_state_context()`` (a context entered around saving/restoring, e.g. to protect process RNG).
    """

    _savable_fields: ClassVar[tuple[str, ...]] = ()
    _transparent: ClassVar[bool] = False
    #: The declared field holding the upstream stage (a transparent stage saves as that field's state).
    _upstream_field: ClassVar[str] = "upstream"

    def reset_state(self) -> None:  # pragma: no cover - optional
        raise NotImplementedError

    def identity(self) -> dict[str, Any]:
        """Configuration of this stage alone that a saved state must match (default: none)."""
        return {}

    def _state_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    # Per-field hooks, used only where a stage hands its nested state over differently (the prefetch stage,
    # whose upstream lives in another process).
    def _save_field(self, name: str, value: Any) -> Any:
        if is_stateful(value):
            return tagged_state(value)
        if _is_stage_list(value):
            return [tagged_state(v) for v in value]
        items = value if isinstance(value, (list, tuple)) else [value]
        for i, item in enumerate(items):
            if _cannot_save(item):  # an upstream stage that cannot save itself: the state would be incomplete
                raise StateError(f"{type(self).__name__}.{name}: {type(item).__name__} (entry {i}) has no "
                                 "state_dict() / load_state_dict(), so this stage's state cannot be saved")
        return copy.deepcopy(value)

    def _load_field(self, name: str, value: Any, saved: Any) -> None:
        where = f"{type(self).__name__}.{name}"
        if is_stateful(value):
            load_tagged(value, saved, where)
        elif _is_stage_list(value):
            if not isinstance(saved, list) or len(saved) != len(value):
                n = len(saved) if isinstance(saved, list) else type(saved).__name__
                raise StateError(f"{where}: the state has {n} entries, this pipeline {len(value)} "
                                 "(group or source count differs)")
            for i, (stage, s) in enumerate(zip(value, saved)):
                load_tagged(stage, s, f"{where}[{i}]")
        else:
            setattr(self, name, copy.deepcopy(saved))

    def state_dict(self) -> dict[str, Any]:
        """The declared fields, as restricted-type values (copies: later steps never mutate them)."""
        with self._state_context():
            return {name: self._save_field(name, getattr(self, name)) for name in self._savable_fields}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore every declared field in declaration order; a missing or unknown field is a ``StateError``."""
        if not isinstance(state, dict):
            raise StateError(f"{type(self).__name__}: state must be a dict, got {type(state).__name__}")
        missing = [f for f in self._savable_fields if f not in state]
        extra = [k for k in state if k not in self._savable_fields]
        if missing or extra:
            raise StateError(
                f"{type(self).__name__}: state fields do not match (missing {missing}, unexpected {extra})"
            )
        with self._state_context():
            for name in self._savable_fields:
                self._load_field(name, _nested(self, name), state[name])


class Stage(Savable):
    """A pipeline stage: owns its upstream (one stage, or a list of stages) under the declared field
    ``_upstream_field`` and inherits the delegation every stage needs, as Energon's ``BaseWrapperDataset`` and
    torchdata's ``BaseNode`` do:

    * ``upstream_stages()``: the upstream as a list;
    * ``close()``: closes every upstream stage that can be closed (idempotent where they are);
    * ``seq_length``: the first upstream's packed sequence length (``max_num_tokens``), or None;
    * ``stats()``: the only upstream's counters (``{}`` when it has none); a stage over several upstreams
      (``OfficialWorkers``) or with counters of its own overrides it.

    State is still declared in ``_savable_fields`` (see ``Savable``); inside the package every stage saves with
    ``state_dict()`` / ``load_state_dict()``, and only the loader Megatron receives adds Bridge's
    ``save_state()`` / ``restore_state()``.
    """

    def upstream_stages(self) -> list[Any]:
        value = getattr(self, self._upstream_field)
        return list(value) if isinstance(value, (list, tuple)) else [value]

    def __iter__(self) -> "Stage":
        return self

    @property
    def seq_length(self) -> int | None:
        """Packed sequence length of every batch (the packer's ``max_num_tokens``), or None if unknown."""
        stages = self.upstream_stages()
        return getattr(stages[0], "seq_length", None) if stages else None

    def stats(self) -> dict[str, Any]:
        """The upstream's counters (``{}`` when it has none)."""
        stages = self.upstream_stages()
        stats = getattr(stages[0], "stats", None) if len(stages) == 1 else None
        return dict(stats()) if callable(stats) else {}

    def close(self) -> None:
        for stage in self.upstream_stages():
            close = getattr(stage, "close", None)
            if callable(close):
                close()


# -- elastic resize: turning every old rank's saved state into one new rank's (pure data) ---------------------

#: Stage class name -> class with a ``resize_state(olds, ctx, **kw) -> state`` classmethod (``register_resizable``).
RESIZABLE: dict[str, type] = {}


def register_resizable(cls: type) -> type:
    """Declare that ``cls``'s saved state can be resized to another DP size (``cls.resize_state``)."""
    if not callable(getattr(cls, "resize_state", None)):
        raise TypeError(f"{cls.__name__} has no resize_state classmethod")
    RESIZABLE[cls.__name__] = cls
    return cls


class ResizeContext:
    """The new rank a resize builds a state for: ``dp_rank`` of ``dp_size``, resize ``generation`` (the old one
    + 1), the run's ``seed``. ``resize(tagged_olds, **kw)`` resizes one nested stage's saved forms (one per old
    rank, ``{"stage", "state"}``) through that stage class's own ``resize_state``."""

    def __init__(self, dp_rank: int, dp_size: int, generation: int, seed: int) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"resize: DP rank {dp_rank} out of range for DP size {dp_size}")
        self.dp_rank, self.dp_size, self.generation, self.seed = int(dp_rank), int(dp_size), int(generation), int(seed)

    def resize(self, tagged_olds: list[Any], **kw: Any) -> dict[str, Any]:
        names = {t.get("stage") if isinstance(t, dict) else None for t in tagged_olds}
        if len(names) != 1 or None in names:
            raise StateError(f"resize: the old ranks' states hold different stages here ({sorted(map(str, names))})")
        name = names.pop()
        cls = RESIZABLE.get(name)
        if cls is None:
            raise StateError(f"resize: the {name} stage cannot be resized to another DP size (its stream depends on "
                             "the DP size); restarts on another DP size need data.order: elastic")
        return {"stage": name, "state": cls.resize_state([t["state"] for t in tagged_olds], self, **kw)}
