"""How a stage saves and restores what it owns: the two state protocols and the tagged nested form.

A stage's declared fields may hold other stateful objects (its ``source``, a ``DropCounter``, a hand-wired Energon
loader). Each is saved through its own state, whichever of the two protocols it speaks:

* ours and torch's: ``state_dict()`` / ``load_state_dict(state)``;
* Energon's per-rank one: ``SavableDataLoader.save_state_rank()`` / ``restore_state_rank(state)`` (the save goes
  through ``energon.patches.energon_rank_state``, which corrects a race of Energon's workers).

Nested, the state travels *tagged* — ``{"stage": tag, "state": ...}`` — and the tag is checked on load, so a state
never lands in a stage of another kind. One of Energon's own objects also records the Energon version that saved
it (``"energon"``): its state is Energon's classes, and a restore under another Energon version is refused in one
line (the stages' own states hold no Energon classes and restore under any supported Energon). A stage's tag is its
``state_tag()`` (the class name by default; a stage that does not change the stream, like prefetch, answers with its
source's tag and so may be added or removed between a save and a restore).
"""

from __future__ import annotations

import copy
from typing import Any

from ..energon.patches import energon_rank_state

__all__ = ["STATE_PROTOCOLS", "StateError", "energon_rank_state", "is_stateful", "is_stateful_list", "load_nested",
           "load_value", "restore_of", "save_nested", "save_of", "save_value", "state_protocol", "tag_of",
           "unsavable_entries"]


class StateError(ValueError):
    """A state dict does not fit the stage it is loaded into (one line naming the stage and field)."""


#: The two save/restore protocols a stateful object may speak: ours and torch's, and Energon's per-rank one.
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
    """``obj``'s own state through the protocol it speaks (Energon's through ``energon.patches.energon_rank_state``)."""
    save = _protocol(obj)[0]
    return energon_rank_state(obj) if save == "save_state_rank" else getattr(obj, save)()


def restore_of(obj: Any, state: Any) -> None:
    """Restore ``obj`` in place from ``save_of(obj)`` output, through the same protocol."""
    getattr(obj, _protocol(obj)[1])(state)


def tag_of(obj: Any) -> str:
    """The tag of ``obj``'s saved form: its ``state_tag()`` if it has one, else its class name."""
    tag = getattr(obj, "state_tag", None)
    return tag() if callable(tag) else type(obj).__name__


def _energon_version(obj: Any) -> str | None:
    """The installed Energon's version when ``obj`` is one of Energon's own objects (its state holds Energon's
    classes), else None."""
    if not type(obj).__module__.startswith("megatron.energon"):
        return None
    import megatron.energon as energon

    return str(getattr(energon, "__version__", "unknown"))


def save_nested(obj: Any) -> dict[str, Any]:
    """``{"stage": tag_of(obj), "state": save_of(obj)}``: a nested object's saved form; for one of Energon's own
    objects (a hand-wired ``SavableDataLoader``) also ``"energon": <its version>``, because its state is Energon's
    own classes, which Energon does not promise to read across its versions (``load_nested`` refuses then)."""
    version = _energon_version(obj)
    return {"stage": tag_of(obj), "state": save_of(obj), **({"energon": version} if version is not None else {})}


def load_nested(obj: Any, saved: Any, where: str) -> None:
    """Restore ``obj`` in place from ``save_nested`` output; the tag must be ``tag_of(obj)``."""
    if not isinstance(saved, dict) or not {"stage", "state"} <= set(saved) <= {"stage", "state", "energon"}:
        got = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
        raise StateError(f"{where}: expected a nested stage state {{'stage', 'state'}}, got {got}")
    if saved["stage"] != tag_of(obj):
        raise StateError(f"{where}: the saved state belongs to a {saved['stage']}, but this pipeline has a "
                         f"{tag_of(obj)} here (the pipeline was built differently)")
    here, then = _energon_version(obj), saved.get("energon")
    if here is not None and then is not None and then != here:
        raise StateError(f"{where}: this {saved['stage']}'s state is Energon {then}'s own loader state and this is "
                         f"Energon {here}, which is not promised to read it: resume under Energon {then}, or start "
                         "this loader fresh (the readers build_bagel_train_loader wires save no Energon state and "
                         "resume across Energon versions)")
    restore_of(obj, saved["state"])


def is_stateful_list(value: Any) -> bool:
    """A non-empty list or tuple whose every entry is stateful (a stage's list of sources)."""
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(is_stateful(v) for v in value)


def unsavable_entries(value: Any) -> list[str]:
    """``"Type (entry i)"`` for each entry of a field value that is an iterator without a state protocol: a stage
    holding one cannot be saved (its state would be incomplete)."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return [f"{type(v).__name__} (entry {i})" for i, v in enumerate(items) if hasattr(v, "__next__")
            and not is_stateful(v)]


def save_value(value: Any, where: str) -> Any:
    """A declared field's saved form: nested objects tagged, lists of them as lists, other values deep-copied.
    Raises ``StateError`` for an iterator that speaks no state protocol (the state would be incomplete)."""
    if is_stateful(value):
        return save_nested(value)
    if is_stateful_list(value):
        return [save_nested(v) for v in value]
    bad = unsavable_entries(value)
    if bad:
        raise StateError(f"{where}: {bad[0]} has no state_dict() / load_state_dict(), so this stage's state cannot "
                         "be saved")
    return copy.deepcopy(value)


def load_value(owner: Any, name: str, saved: Any, where: str) -> None:
    """Restore declared field ``name`` of ``owner`` from ``save_value`` output: nested objects in place (tags
    checked), other values as deep copies."""
    value = getattr(owner, name, None)
    if is_stateful(value):
        load_nested(value, saved, where)
    elif is_stateful_list(value):
        if not isinstance(saved, list) or len(saved) != len(value):
            n = len(saved) if isinstance(saved, list) else type(saved).__name__
            raise StateError(f"{where}: the state has {n} entries, this pipeline {len(value)} (group or source count "
                             "differs)")
        for i, (obj, s) in enumerate(zip(value, saved)):
            load_nested(obj, s, f"{where}[{i}]")
    else:
        setattr(owner, name, copy.deepcopy(saved))
