"""The plan interface: what the one reader core (``core.GroupReader``) asks of an order, and the read it gets back.

An order decides *which* sample each read of a group is, how its random choices are drawn and what its state is;
the core does everything else. A plan's next read is a :class:`Read` (or a :class:`Skip`), a plain record a pool
worker can be sent; :meth:`Plan.read_of` rebuilds a read from its restore key ``(read.key, rng choices)``, so a
packer's buffer and an elastic hand-over are saved as keys, never samples.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Protocol

__all__ = ["Plan", "Read", "Skip"]


@dataclass(frozen=True)
class Read:
    """One planned read of a group: sample ``index`` of the group's dataset ``dataset``.

    ``key``: the read's key (builtins only), the first half of the cooked sample's ``restore_key`` (the second is
    its recorded choices); ``row_id``: the read in diagnostics (the skipped-rows list); ``data_indexes``: entries
    set over the cooked sample's ``data_indexes`` (the order's identity of the read: elastic ``position`` /
    ``epoch`` / ``partition``, official ``data_indexes`` = its unit position); ``replay``: the recorded random
    choices of a read rebuilt from its restore key (None: drawn fresh from :meth:`Plan.rng`); ``handover``: a
    sample handed to this reader by a resize (counted as ``handed_in``, not ``taken``).
    """

    dataset: int
    index: int
    key: tuple
    row_id: Any
    data_indexes: Mapping[str, Any] = field(default_factory=dict)
    replay: tuple | None = None
    handover: bool = False


class Skip(NamedTuple):
    """A planned unit with nothing to read (the official reader skips it too): diagnostics only."""

    row_id: Any
    reason: str
    detail: str


class Plan(Protocol):
    """An order of one group's reads on one DP rank (or emulated official worker): what ``GroupReader`` calls.

    ``prefetch``: True when a read is a pure function of its :class:`Read` (its choices drawn from a generator
    seeded by the read), so the rank's read pool may run reads ahead on a :meth:`copy`; False when cooking draws
    from a shared generator at the moment of the read (the official order's global ``random``).
    """

    prefetch: ClassVar[bool]

    def next_read(self) -> Read | Skip:
        """The next read, advancing the plan; raises StopIteration at the end of a finite plan."""

    def copy(self) -> "Plan":
        """A copy at the same point, for the read-ahead to advance (``prefetch`` plans only)."""

    def rng(self, read: Read) -> random.Random | Any:
        """The generator a fresh read's random choices are drawn from (``cooking.Draws(rng=...)``)."""

    def read_of(self, restore_key: Any) -> Read:
        """The read that rebuilds the sample of ``restore_key`` (its choices replayed); ``StateError`` for a key of
        another order or out of range."""

    def stall_limit(self, dataset: int) -> int:
        """Drops in a row from ``dataset`` after which the plan can never yield a sample (the liveness rule)."""

    def stall_source(self, dataset: int) -> str | None:
        """What the drops in a row are counted over, in words (None: per dataset, named by the reader)."""

    def stats(self) -> dict[str, Any]:
        """The plan's part of ``GroupReader.stats()``."""

    def identity(self) -> dict[str, Any]:
        """What a saved plan state must match (part of the resume fingerprint)."""

    def state_dict(self) -> dict[str, Any]:
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ...

    # An order that survives a change of DP size also offers ``resize_state(olds, ctx, handover)`` (the elastic
    # one); ``state.ResizeContext.resize`` refuses the others.
