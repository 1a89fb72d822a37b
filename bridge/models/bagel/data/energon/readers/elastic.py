"""``data.order: elastic`` (the default): the plan of a group reader whose stream survives any change of DP size or
``num_workers``, and small groups on large worlds.

What is read is :mod:`.partitions`'s: blocks ``v = 0, 1, 2, ...`` (partition ``v mod P`` in epoch ``v // P``). Every
block is read by exactly one rank, whole, so every sample is read exactly once per epoch across the world.

Which blocks a rank reads — the stripes. In the first world of a run (DP size ``W``), DP rank ``r`` reads the blocks
``v ≡ r (mod W)`` in increasing order: with ``P >= W`` that is partitions ``p ≡ r (mod W)`` epoch after epoch (when
``W`` divides ``P``, the same partitions every epoch), with ``P < W`` (a small curated group on a large world) a rank
reads one block now and then, while the other ranks read the other epochs' blocks: no rank is left without data, and
a group of 50 samples trains at DP 4096. A rank keeps ``L = max(1, |{v < P : v ≡ r}|)`` blocks *open* and reads them
round robin, one sample each (locality in the shards, mixing across the group's datasets); a finished block is
replaced by the rank's next one. Each read's random choices are seeded by (group, data seed, selection position,
epoch) (``cooking.common.Draws`` on a private generator), so a sample is the same whichever rank or worker cooks it.

State (:class:`ElasticPlan`, ``_savable_fields``; the table in ``docs/elastic.md``): ``open`` (block and cursor of
each open slot), ``turn`` (the slot read next), ``queue`` (blocks handed over by a resize, opened before the tail),
``tail`` (``[base, stride]``), ``pending`` (handed-over restore keys, read first). ``open`` and ``queue`` are
zlib-packed int64 deltas (<= 64 KiB per rank at DP 1 and DP 8192 with the default ``data.partitions``).

A resize (:meth:`ElasticPlan.resize_state`, pure data over every old rank's state): ``B`` = the largest old tail base;
every block below ``B`` that no old rank finished (open with its cursor, queued, or an old tail's block below ``B``)
is dealt round robin, in block order, to the new ranks; the blocks from ``B`` on are the new tails (``B + r', W'``);
handed-over keys are dealt round robin too. Every unfinished block stays owned by exactly one rank, with its cursor.
A budget change (``data.resume_budget_change``) goes through the same method on one rank's own state.
:func:`reads_taken` recovers, from the final states of every rank, exactly which (position, epoch) reads were taken:
``tools.ledger`` proves exactly-once from it.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from ...config.schema import DEFAULT_PARTITIONS
from ...state import ResizeContext, Savable, StateError, check_fields
from .partitions import DEFAULT_CHUNK, GroupLayout, PartitionOrder, block
from .plan import Read

__all__ = ["DEFAULT_PARTITIONS", "ElasticPlan", "KEY_TAG", "reads_taken"]

#: First element of an elastic read's key: ``(KEY_TAG, dataset, index, position, epoch, partition)``; a sample's
#: ``restore_key`` pairs it with the recorded random choices.
KEY_TAG = "Elastic"


def _pack(rows: Sequence[Sequence[int]]) -> bytes:
    """``[[v, cursor], ...]`` (v ascending or in slot order) as zlib-packed int64 deltas."""
    arr = np.asarray(rows, dtype=np.int64).reshape(-1, 2)
    arr[1:] -= arr[:-1].copy()  # deltas: lock-step blocks compress to almost nothing
    return zlib.compress(arr.tobytes(), 6)


def _unpack(blob: Any, where: str) -> list[list[int]]:
    try:
        rows = np.frombuffer(zlib.decompress(blob), dtype=np.int64).reshape(-1, 2).cumsum(axis=0)
    except (TypeError, ValueError, zlib.error) as exc:
        raise StateError(f"{where}: unreadable block list ({exc})") from None
    return rows.tolist()


def _read(key: tuple, replay: tuple | None = None, handover: bool = False) -> Read:
    """The read of an elastic key ``(KEY_TAG, d, i, j, e, p)``; ``data_indexes`` carry ``position`` / ``epoch`` /
    ``partition`` (the ledger's identity of a read)."""
    _, d, i, j, e, p = key
    return Read(d, i, key, [j, e], {"position": j, "epoch": e, "partition": p}, replay, handover)


def _checked_keys(keys: Sequence[Any], where: str) -> list[list]:
    """``keys`` as lists, each a restore key ``((KEY_TAG, d, i, j, e, p), choices)`` with int parts, else
    ``StateError`` naming ``where``."""
    for key in keys:
        try:
            (tag, *parts), _choices = key
            if tag != KEY_TAG or len(parts) != 5:
                raise ValueError(tag)
            list(map(int, parts))  # every part an int (else TypeError / ValueError)
        except (TypeError, ValueError):
            raise StateError(f"{where}: not an elastic restore key: {key!r:.120}") from None
    return [list(k) for k in keys]


class ElasticPlan(Savable):
    """The elastic order of one group on DP rank ``dp_rank`` of ``dp_size`` (module docstring).

    ``layout``: the group's selection positions; ``order``: its partitions (``PartitionOrder``); ``group`` and ``seed``
    (the data seed) seed each read's random choices. A read's key: ``(KEY_TAG, d, i, j, e, p)`` (dataset ``d``, sample
    ``i``, selection position ``j``, epoch ``e``, partition ``p``).
    """

    prefetch: ClassVar[bool] = True  # a read is a pure function of its ``Read``: workers may read ahead
    _savable_fields = ("open", "turn", "queue", "tail", "pending")

    def __init__(self, layout: GroupLayout, order: PartitionOrder, *, group: str, seed: int, dp_rank: int,
                 dp_size: int) -> None:
        self.layout, self.order, self.group, self.seed = layout, order, group, int(seed)
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self.reset_state()

    @classmethod
    def of(cls, runs: Sequence[Sequence[tuple[int, int, int]]], *, group: str, seed: int, partitions: int,
           dp_rank: int, dp_size: int, chunk: int = DEFAULT_CHUNK) -> "ElasticPlan":
        """The plan over a group's selection ``runs`` (per dataset, ``(start, end, repetitions)``)."""
        layout = GroupLayout(runs)
        return cls(layout, PartitionOrder(layout.num_positions, partitions, seed, group, chunk), group=group,
                   seed=seed, dp_rank=dp_rank, dp_size=dp_size)

    # -- state ---------------------------------------------------------------------------------------
    def reset_state(self) -> None:
        """The first world's stripes: blocks ``v ≡ dp_rank (mod dp_size)``, the first ``L`` of them open."""
        r, w, n = self.dp_rank, self.dp_size, self.order.num_partitions
        slots = max(1, len(range(r, n, w)))
        self._open, self.turn = [[r + k * w, 0] for k in range(slots)], 0
        self._queue: list[list[int]] = []
        self.tail = [r + slots * w, w]
        self.pending: list[tuple[tuple, tuple]] = []  # (read key, choices), oldest first

    def state_dict(self) -> dict[str, Any]:
        return {"open": _pack(self._open), "turn": int(self.turn), "queue": _pack(self._queue),
                "tail": [int(x) for x in self.tail], "pending": [list(k) for k in self.pending]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_fields(self, state, "ElasticPlan")
        where = f"ElasticPlan {self.group!r}"
        opened, queue = _unpack(state["open"], where), _unpack(state["queue"], where)
        tail = state["tail"]
        if not opened or not (isinstance(tail, (list, tuple)) and len(tail) == 2 and int(tail[1]) > 0):
            raise StateError(f"{where}: malformed state (open {len(opened)} blocks, tail {tail!r})")
        if not 0 <= int(state["turn"]) < len(opened):
            raise StateError(f"{where}: turn {state['turn']!r} out of range for {len(opened)} open blocks")
        _checked_keys(state["pending"], where)
        self._open, self._queue = opened, queue
        self.turn, self.tail = int(state["turn"]), [int(tail[0]), int(tail[1])]
        self.pending = [(tuple(k[0]), tuple(k[1])) for k in state["pending"]]

    def identity(self) -> dict[str, Any]:
        """What a saved state must match: the order's parameters and the selection (never the topology)."""
        selection = json.dumps([[list(r) for r in runs] for runs in self.layout.runs]).encode()
        return {"seed": self.seed, "partitions": self.order.num_partitions, "chunk": self.order.chunk,
                "num_positions": self.order.num_positions, "selection_sha256": hashlib.sha256(selection).hexdigest()}

    # -- reading -------------------------------------------------------------------------------------
    def copy(self) -> "ElasticPlan":
        """A copy at the same point (the look-ahead of the read workers advances it, not this plan)."""
        twin = ElasticPlan(self.layout, self.order, group=self.group, seed=self.seed, dp_rank=self.dp_rank,
                           dp_size=self.dp_size)
        twin._open, twin._queue = [list(s) for s in self._open], [list(s) for s in self._queue]
        twin.turn, twin.tail, twin.pending = self.turn, list(self.tail), list(self.pending)
        return twin

    def next_read(self) -> Read:
        """The next read: a handed-over key first, else the next sample of the open block whose turn it is."""
        if self.pending:
            return self.read_of(self.pending.pop(0), handover=True)
        slot = self._open[self.turn]
        v, cursor = slot
        e, p = block(v, self.order.num_partitions)
        j = self.order.position(p, e, cursor)
        d, i = self.layout.coordinate(j)
        if cursor + 1 == self.order.size(p):  # the block is done: the first queued block opens, else the tail's next
            if self._queue:
                self._open[self.turn] = self._queue.pop(0)
            else:
                self._open[self.turn] = [self.tail[0], 0]
                self.tail[0] += self.tail[1]
        else:
            slot[1] = cursor + 1
        self.turn = (self.turn + 1) % len(self._open)
        return _read((KEY_TAG, d, i, j, e, p))

    def rng(self, read: Read) -> random.Random:
        """The read's own generator, seeded by (group, data seed, selection position, epoch)."""
        j, e = read.data_indexes["position"], read.data_indexes["epoch"]
        key = f"bagel-elastic-cook|{self.group}|{self.seed}|{j}|{e}".encode()
        return random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))

    def read_of(self, restore_key: Any, handover: bool = False) -> Read:
        """The read that rebuilds the sample of ``restore_key`` (its recorded choices replayed)."""
        _checked_keys([restore_key], f"ElasticPlan {self.group!r}")
        return _read(tuple(restore_key[0]), tuple(restore_key[1]), handover)

    def stall_limit(self, dataset: int) -> int:
        """Drops in a row from one dataset after which it can never yield on this rank: twice the positions of the
        dataset the rank reads before it has seen every partition it will ever read (``N / gcd(P, W)``), plus the
        open blocks."""
        cycle = -(-self.layout.positions_of(dataset) // math.gcd(self.order.num_partitions, self.dp_size))
        return 2 * cycle + 2 * len(self._open) + 2

    def stall_source(self, dataset: int) -> str | None:
        """Drops are counted per dataset (None: the reader names the dataset)."""
        return None

    def stats(self) -> dict[str, Any]:
        """``epoch``: the oldest epoch this rank is reading (its blocks of every earlier epoch are read, so the
        minimum over the DP world is the group's count of completed epochs); ``epoch_size``: the group's selected
        samples per epoch over the whole world; ``blocks_open`` / ``blocks_queued``; ``pending``."""
        n = self.order.num_partitions
        return {"epoch": min(v // n for v, _ in (*self._open, *self._queue)) if (self._open or self._queue) else 0,
                "epoch_size": self.layout.num_positions, "blocks_open": len(self._open),
                "blocks_queued": len(self._queue), "pending": len(self.pending)}

    # -- resize (pure data) --------------------------------------------------------------------------
    def resize_state(self, olds: Sequence[Mapping[str, Any]], ctx: ResizeContext,
                     handover: Sequence[Any] = ()) -> dict[str, Any]:
        """This plan's state on new DP rank ``ctx.dp_rank`` of ``ctx.dp_size`` from every old rank's (module
        docstring). Raises ``StateError`` when the old states are not one world's (a block owned twice, tails that
        do not cover every block from the largest base on).

        A budget change (``ctx.same_world``: ``olds`` is this rank's own state alone) keeps every block, cursor, turn
        and the tail as they are, and appends the handed-over keys (the samples that waited in this rank's packer) to
        ``pending``, read first: every read stays owned by this rank, exactly once."""
        where = "elastic resize"
        if ctx.same_world:
            if len(olds) != 1:
                raise StateError(f"{where}: a budget change rebuilds a rank from its own state only, got {len(olds)}")
            old = olds[0]
            check_fields(self, old, f"{where}: DP rank {ctx.dp_rank}")
            pending = _checked_keys([*old["pending"], *handover], where)
            return {"open": old["open"], "turn": int(old["turn"]), "queue": old["queue"],
                    "tail": [int(x) for x in old["tail"]], "pending": pending}
        bases, strides, explicit = [], set(), []
        for k, old in enumerate(olds):
            check_fields(self, old, f"{where}: old rank {k}")
            explicit += _unpack(old["open"], f"{where}: old rank {k}") + _unpack(old["queue"], f"{where}: old rank {k}")
            bases.append(int(old["tail"][0]))
            strides.add(int(old["tail"][1]))
        if strides != {len(olds)} or sorted(b % len(olds) for b in bases) != list(range(len(olds))):
            raise StateError(f"{where}: the {len(olds)} old states' tails (bases {bases[:8]}, strides "
                             f"{sorted(strides)}) are not one world's: give every old rank's file of one checkpoint")
        top = max(bases)
        for b in bases:  # an old rank's blocks below the largest base: unread, now explicit
            explicit += [[v, 0] for v in range(b, top, len(olds))]
        explicit.sort()
        blocks = [v for v, _ in explicit]
        if len(set(blocks)) != len(blocks):
            raise StateError(f"{where}: a block is owned by two old ranks (the state files are from different "
                             "checkpoints)")
        r, w, n = ctx.dp_rank, ctx.dp_size, self.order.num_partitions
        mine = explicit[r::w]
        slots = max(1, len(range(r, n, w)))
        tail = [top + r, w]
        opened, queue = mine[:slots], mine[slots:]
        while len(opened) < slots:
            opened.append([tail[0], 0])
            tail[0] += w
        keys = _checked_keys([*(k for old in olds for k in old["pending"]), *handover], where)
        return {"open": _pack(opened), "turn": 0, "queue": _pack(queue), "tail": tail, "pending": keys[r::w]}


def reads_taken(states: Sequence[Mapping[str, Any]], order: PartitionOrder) -> tuple[set[tuple[int, int]], bool]:
    """Every ``(selection position, epoch)`` read taken so far, from the plan states of every rank of one world, and
    whether epoch 0 is complete (every block of it finished): the blocks below the largest tail base that no rank
    still holds are finished; an open or queued block is taken up to its cursor."""
    n, w = order.num_partitions, len(states)
    held = {int(v): int(c) for s in states for key in ("open", "queue") for v, c in _unpack(s[key], "reads_taken")}
    bases = [int(s["tail"][0]) for s in states]
    top = max(bases)
    unread = {v for b in bases for v in range(b, top, w)}
    taken: set[tuple[int, int]] = set()
    for v in range(top):
        if v in unread:
            continue
        e, p = block(v, n)
        count = held.get(v, order.size(p))
        taken.update((int(j), e) for j in order.positions(p, e, count))
    complete = all(v not in unread and v not in held for v in range(n)) and top >= n
    return taken, complete
