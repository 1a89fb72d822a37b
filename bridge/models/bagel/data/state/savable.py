"""``Savable`` (declared state) and ``Stage`` (an element of the chain that owns its source).

Every stateful object lists the attributes that make up its *whole* state once, in ``_savable_fields``, in
restore order (Energon's wrapper rule). The generic ``state_dict()`` / ``load_state_dict()`` follow from that
declaration: a field holding a stateful object (or a list of them) is saved through that object's own state,
tagged (``protocol.save_nested``), and restored in place; any other field is deep-copied out and back in. A stage
whose live form is not storable as it is (RNG state tuples, a buffer of samples saved as restore keys) overrides
``state_dict`` / ``load_state_dict`` — still for exactly the declared fields — rather than hooking into the base.
Before any field is restored, ``check_compatible(state)`` may refuse a state that belongs to another configuration;
no restore happens as a side effect of setting an attribute. ``Stage`` adds what every element of the chain shares.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from .protocol import StateError, is_stateful, is_stateful_list, load_value, save_value, unsavable_entries

if TYPE_CHECKING:
    from .resize import ResizeContext

__all__ = ["Savable", "Stage", "check_fields", "unsavable_fields", "walk"]


def check_fields(obj: Any, state: Any, where: str | None = None) -> None:
    """Raise ``StateError`` unless ``state`` is a dict with exactly ``obj``'s declared fields."""
    where = where or type(obj).__name__
    if not isinstance(state, dict):
        raise StateError(f"{where}: state must be a dict, got {type(state).__name__}")
    fields = obj._savable_fields
    missing, extra = [f for f in fields if f not in state], [k for k in state if k not in fields]
    if missing or extra:
        raise StateError(f"{where}: state fields do not match (missing {missing}, unexpected {extra})")


class Savable:
    """State = the attributes named in ``_savable_fields`` (nested stateful objects through their own state).
    Subclasses may implement ``reset_state()`` (every field back to its initial value) and ``check_compatible``."""

    _savable_fields: ClassVar[tuple[str, ...]] = ()

    def state_tag(self) -> str:
        """The tag of this object's nested saved form (``{"stage": tag, "state": ...}``): the class name."""
        return type(self).__name__

    def reset_state(self) -> None:  # pragma: no cover - optional
        raise NotImplementedError

    def check_compatible(self, state: dict[str, Any]) -> None:
        """Refuse (``StateError``) a state saved under another configuration; the default accepts any."""

    def state_dict(self) -> dict[str, Any]:
        """The declared fields, as restricted-type values (copies: later steps never mutate them)."""
        name = type(self).__name__
        return {f: save_value(getattr(self, f), f"{name}.{f}") for f in self._savable_fields}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore every declared field in declaration order after ``check_compatible``; a missing or unknown
        field is a ``StateError``."""
        check_fields(self, state)
        self.check_compatible(state)
        name = type(self).__name__
        for f in self._savable_fields:
            load_value(self, f, state[f], f"{name}.{f}")


class Stage(Savable):
    """An element of the chain, as Energon's ``BaseWrapperDataset`` and torchdata's ``BaseNode``: owns its input as
    ``self.source`` (one upstream, or a list of them for a stage over several, like the packer's group readers) and
    inherits the delegation every stage needs (``sources``,
    ``identity``: walked through ``source`` by ``state.fingerprint.fingerprint_of``, ``stats``, ``seq_length``,
    ``close``, ``resize_state``; a stage over several sources or with counters of its own overrides ``stats``).

    Inside the package every stage saves with ``state_dict()`` / ``load_state_dict()``; only the loader Megatron
    receives adds Bridge's ``save_state()`` / ``restore_state()``.
    """

    source: Any

    def sources(self) -> list[Any]:
        """The source as a list (one entry for a single upstream)."""
        value = self.source
        return list(value) if isinstance(value, (list, tuple)) else [value]

    def __iter__(self) -> "Stage":
        return self

    def identity(self) -> dict[str, Any]:
        """Configuration of this stage alone that a saved state must match (default: none)."""
        return {}

    @property
    def seq_length(self) -> int | None:
        """Packed sequence length of every batch (the packer's ``max_num_tokens``), or None if unknown."""
        stages = self.sources()
        return getattr(stages[0], "seq_length", None) if stages else None

    def stats(self) -> dict[str, Any]:
        """The source's counters (``{}`` when it has none or there are several)."""
        stages = self.sources()
        stats = getattr(stages[0], "stats", None) if len(stages) == 1 else None
        return dict(stats()) if callable(stats) else {}

    def close(self) -> None:
        """Close every source that can be closed."""
        for stage in self.sources():
            close = getattr(stage, "close", None)
            if callable(close):
                close()

    def resize_state(self, olds: list[dict[str, Any]], ctx: "ResizeContext", **kw: Any) -> dict[str, Any]:
        """This stage's state on new DP rank ``ctx.dp_rank`` of ``ctx.dp_size`` from every old rank's state of it
        (old-rank order; pure data: the live stage is not changed). The default refuses (``StateError``): the
        stream of a stage that does not override this depends on the DP size."""
        raise StateError(f"resize: the {self.state_tag()} stage cannot be resized to another DP size (its stream "
                         "depends on the DP size); restarts on another DP size need data.order: elastic")


def walk(obj: Any) -> Iterator[Any]:
    """``obj`` and every stateful object nested in its declared fields, depth first."""
    yield obj
    for name in getattr(obj, "_savable_fields", ()):
        value = getattr(obj, name, None)
        if is_stateful(value):
            yield from walk(value)
        elif is_stateful_list(value):
            for v in value:
                yield from walk(v)


def unsavable_fields(obj: Any) -> list[str]:
    """``"Class.field: Type"`` for every declared field under ``obj`` holding an iterator that speaks no state
    protocol: ``state_dict()`` would raise ``StateError`` there (the chain cannot be checkpointed)."""
    return [f"{type(s).__name__}.{name}: {t.split(' (entry')[0]}" for s in walk(obj)
            for name in getattr(s, "_savable_fields", ()) for t in unsavable_entries(getattr(s, name, None))]
