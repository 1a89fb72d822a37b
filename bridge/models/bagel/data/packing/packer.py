"""``BagelPacker``: the official BAGEL ``PackedDataset.__iter__`` loop (spec §5), bit-exact, with state.

Randomness comes from the process-global ``random`` (group choice, CFG dropout) and ``numpy.random``
(timesteps) in exactly the official order; isolating it is ``BagelRNGIterator``'s job. Official quirks are
kept (flush drop, ``<`` vs ``>`` length checks, uncapped mandatory samples) but nothing is silent: every
dropped sample is counted by reason in ``packer.drops``. The loop's decisions live in ``step.PackLoop`` (shared
with the ``bagel-data stats`` simulator); this class supplies the samples and lays them out.

State (taken between batches) is small: the group names, the group sources' own states, the overflow buffer
and the lossless carry as (group, restore key) pairs, the drop counts, the batch count and the per-group ledger
(consumed, packed, dropped by reason). Buffered and carried samples are rebuilt on load through their group
source's ``restore_sample(key)`` (Energon's rule: buffers store restore keys, never samples).

The ledger (``stats()["ledger"]``) accounts for every sample taken from a group's source: per group
``consumed == packed + sum(dropped.values()) + buffered`` at every batch boundary (:func:`ledger_errors`).
``resize_state`` turns the packer states of all old ranks into one new rank's (elastic resize, pure data).
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ..config.schema import PackerConfig
from ..state import ResizeContext, Stage, StateError, check_fields, load_nested, save_value
from ..stats import DropCounter, StallWatch, merge_counts
from ..config.lengths import estimate
from .sequence import PackLayout, SequenceBuilder, sample_field
from .step import PackBudgets, PackLoop

__all__ = ["BagelPacker", "END_OF_STREAM", "SPECIAL_TOKEN_KEYS", "ledger_errors", "restore_key_of"]

logger = logging.getLogger(__name__)

SPECIAL_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "start_of_image", "end_of_image")
#: Drop reason of the samples of a pack left unfinished because a group source ended (StopIteration).
END_OF_STREAM = "end_of_stream"

_STALL_HINT = ("Raise packer.max_num_tokens_per_sample (at most max_num_tokens) or shrink the group's "
               "image_transform_args (max_image_size / max_pixels) so its samples fit; `bagel-data stats` shows "
               "the group's tokens per sample.")


def restore_key_of(sample: Any) -> Any:
    """The small key a group source can rebuild ``sample`` from (``restore_key`` field), or None."""
    return sample.get("restore_key") if isinstance(sample, dict) else getattr(sample, "restore_key", None)


def ledger_errors(ledger: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One message per group of ``stats()["ledger"]`` (or a sum of several) whose counts do not balance:
    ``consumed == packed + sum(dropped.values()) + buffered``; empty when every group balances."""
    out = []
    for name, g in ledger.items():
        dropped = sum(int(v) for v in g["dropped"].values())
        if int(g["consumed"]) != int(g["packed"]) + dropped + int(g["buffered"]):
            out.append(f"group {name!r}: consumed {g['consumed']} != packed {g['packed']} + dropped {dropped} "
                       f"{dict(g['dropped'])} + buffered {g['buffered']}")
    return out


_FIELDS = ("groups", "source", "buffer", "carry", "drops", "num_batches", "consumed", "packed", "group_drops")


def _dataset_part(sample: Any) -> str:
    """`` (dataset NAME)`` for samples that know their Energon dataset (``__sources__``), else empty."""
    paths = (getattr(info, "dataset_path", None) for info in getattr(sample, "__sources__", None) or ())
    path = next((p for p in paths if p is not None), None)
    return "" if path is None else f" (dataset {str(path).rstrip('/').rsplit('/', 1)[-1]!r})"


class _PackFill:
    """One pack under construction as the ``PackLoop``'s target: samples from the packer's sources, laid out by its
    ``_builder_type`` (``curr`` is the real packed length), group draws from the global ``random``."""

    __slots__ = ("packer", "pack", "data_indexes", "groups")

    def __init__(self, packer: BagelPacker) -> None:
        self.packer = packer
        self.pack = packer._builder_type(packer.layout)
        self.data_indexes: list[Any] = []
        self.groups: list[int] = []  # group of each packed sample, in pack order

    @property
    def curr(self) -> int:
        return self.pack.curr

    def random(self) -> float:
        return random.random()

    def next_sample(self, group: int) -> Any:
        packer = self.packer
        try:
            sample = next(packer.source[group])
        except StopIteration:
            logger.warning("BagelPacker: group %r is exhausted; stopping", packer.group_names[group])
            raise
        packer.consumed[group] += 1
        return sample

    def estimate(self, sample: Any) -> int:
        """Official length estimate (``lengths.estimate``: num_tokens + 2 per plan item)."""
        return estimate(sample_field(sample, "num_tokens"), len(sample_field(sample, "sequence_plan")))

    def add(self, group: int, sample: Any, est: int) -> None:
        self.pack.pack_sample(sample)
        self.data_indexes.append(sample_field(sample, "data_indexes"))
        self.groups.append(group)
        self.packer._stall.ok(self.packer.group_names[group])

    def drop(self, reason: str, group: int, sample: Any, est: int, curr: int) -> None:
        """Count a drop of the pack loop; a group that only ever drops over-length samples raises
        ``DataStallError`` (liveness rule)."""
        packer, name = self.packer, self.packer.group_names[group]
        packer.group_drops[group][reason] = packer.group_drops[group].get(reason, 0) + 1
        where = f"group {name!r} sample {sample_field(sample, 'data_indexes')}"
        limit = packer.config.max_num_tokens_per_sample
        if reason in ("overlength_mandatory", "overlength"):
            op = ">=" if reason == "overlength_mandatory" else ">"
            detail = f"{where} estimated {est} tokens {op} max_num_tokens_per_sample {limit}"
            packer.drops.drop(reason, detail)
            packer._stall.drop(name, reason, detail, limit=packer.config.max_consecutive_drops,
                               where=f"group {name!r}{_dataset_part(sample)}")
            return
        why = "after leaving the buffer" if reason == "flush_drop_buffered" else "and the buffer is full"
        packer.drops.drop(reason, f"{where} ({est} tokens) did not fit a pack of {curr} tokens {why} (official flush)")


class BagelPacker(Stage):
    """Packs samples from weighted groups into official BAGEL batches (``next(packer)``).

    ``sources`` are the per-group sample streams (one per group, in group order); the packer owns them as its
    ``source`` list and saves/restores them as part of its own state. ``config`` holds every packing knob
    (``PackerConfig``, official defaults, already validated: ``config.validate_data``; ``config.lossless`` keeps the
    flush's candidate in ``carry`` for the next pack instead of dropping it, see ``step``); ``special_tokens`` the
    four ids of ``SPECIAL_TOKEN_KEYS``. Raises ValueError when the per-group arguments do not line up.
    """

    _savable_fields = _FIELDS
    _fill_type: type[_PackFill] = _PackFill  # the loop's target for one pack
    _builder_type: type[SequenceBuilder] = SequenceBuilder  # a pack's layout (``BalancedPacker``'s replays CFG coins)

    def __init__(self, sources: Sequence[Iterator[Any]], group_weights: Sequence[float],
                 is_mandatory: Sequence[bool], special_tokens: Mapping[str, int], config: PackerConfig | None = None,
                 *, group_names: Sequence[str] | None = None) -> None:
        n = len(sources)
        if n == 0:
            raise ValueError("BagelPacker needs at least one group")
        if len(group_weights) != n or len(is_mandatory) != n or (group_names is not None and len(group_names) != n):
            raise ValueError(f"BagelPacker: {n} groups but {len(group_weights)} weights, {len(is_mandatory)} mandatory "
                             f"flags and {n if group_names is None else len(group_names)} names")
        missing = [k for k in SPECIAL_TOKEN_KEYS if k not in special_tokens]
        if missing:
            raise ValueError(f"BagelPacker: special_tokens lacks {missing}")
        self.config = config if config is not None else PackerConfig()
        self.source = list(sources)
        self.group_names = list(group_names) if group_names is not None else [f"group{i}" for i in range(n)]
        self.group_weights = [float(w) for w in group_weights]
        self.is_mandatory = [bool(m) for m in is_mandatory]
        self._loop: PackLoop[Any] = PackLoop(PackBudgets.of(self.config), list(group_weights), self.is_mandatory,
                                             lossless=self.config.lossless)
        self.layout = PackLayout(self.config, **{k: int(special_tokens[k]) for k in SPECIAL_TOKEN_KEYS})
        self.drops = DropCounter("BagelPacker", logger)
        self._stall = StallWatch("BagelPacker:", _STALL_HINT)
        self.reset_state()

    # -- declared state -----------------------------------------------------------------------------
    def reset_state(self) -> None:
        self.buffer: list[tuple[int, Any]] = []  # (group index, sample), oldest first
        self.carry: list[tuple[int, Any]] = []  # lossless: flushed candidates for the next pack, oldest first
        self.num_batches = 0
        self.consumed = [0] * len(self.source)  # samples read so far from each group's source
        self.packed = [0] * len(self.source)  # samples of each group packed into yielded batches
        self.group_drops: list[dict[str, int]] = [{} for _ in self.source]  # packer drops by group and reason
        self.drops.reset_state()

    def identity(self) -> dict[str, Any]:
        """Packing knobs, groups, weights and special tokens: a saved state applies only to the same packer."""
        return {"config": self.config.stream_identity(), "group_names": list(self.group_names),
                "group_weights": list(self.group_weights), "is_mandatory": list(self.is_mandatory),
                "special_tokens": [getattr(self.layout, k) for k in SPECIAL_TOKEN_KEYS]}

    def _keys_of(self, entries: list[tuple[int, Any]], what: str) -> list[list[Any]]:
        out = []
        for group, sample in entries:
            key = restore_key_of(sample)
            if key is None:
                raise StateError(f"BagelPacker.state_dict: a {what} sample of group {self.group_names[group]!r} "
                                 f"({sample_field(sample, 'data_indexes')}) has no restore_key, so the {what} cannot "
                                 "be saved")
            out.append([group, key])
        return out

    def _rebuild(self, entries: list[list[Any]], what: str) -> list[tuple[int, Any]]:
        out = []
        for group, key in entries:
            if not 0 <= group < len(self.source):
                raise StateError(f"BagelPacker.load_state_dict: {what} entry for unknown group index {group}")
            restore = getattr(self.source[group], "restore_sample", None)
            if restore is None:
                raise StateError(f"BagelPacker.load_state_dict: group {self.group_names[group]!r} has no "
                                 f"restore_sample(key), so its {what} samples cannot be rebuilt")
            out.append((group, restore(key)))
        return out

    def state_dict(self) -> dict[str, Any]:
        """The declared fields; ``buffer`` and ``carry`` as ``[group index, restore key]`` pairs (samples are rebuilt
        on load through their group source's ``restore_sample``, never stored); a subclass's own fields (the
        ``BalancedPacker``'s ``balance``) as its attributes of that name."""
        return {"groups": list(self.group_names), "source": save_value(self.source, "BagelPacker.source"),
                "buffer": self._keys_of(self.buffer, "buffered"), "carry": self._keys_of(self.carry, "carried"),
                "drops": save_value(self.drops, "BagelPacker.drops"), "num_batches": int(self.num_batches),
                "consumed": [int(c) for c in self.consumed], "packed": [int(c) for c in self.packed],
                "group_drops": [dict(d) for d in self.group_drops],
                **{f: save_value(getattr(self, f), f"{type(self).__name__}.{f}") for f in self._savable_fields
                   if f not in _FIELDS}}

    def check_compatible(self, state: dict[str, Any]) -> None:
        """A state applies only to a packer of the same groups, with one entry per group in every per-group field."""
        if list(state["groups"]) != self.group_names:
            raise StateError(f"BagelPacker.load_state_dict: the state is for groups {list(state['groups'])}, this "
                             f"packer has groups {self.group_names}")
        for field in ("source", "consumed", "packed", "group_drops"):
            value = state[field]
            if not isinstance(value, (list, tuple)) or len(value) != len(self.source):
                n = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
                raise StateError(f"BagelPacker.load_state_dict: state has {n} {field} entries, this packer has "
                                 f"{len(self.source)} groups (group or source count differs)")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the sources, then rebuild the buffer and carry from their restore keys."""
        check_fields(self, state)
        self.check_compatible(state)
        for g, (source, saved) in enumerate(zip(self.source, state["source"])):
            load_nested(source, saved, f"BagelPacker.source[{g}]")
        load_nested(self.drops, state["drops"], "BagelPacker.drops")
        self.num_batches = int(state["num_batches"])
        self.consumed = [int(c) for c in state["consumed"]]
        self.packed = [int(c) for c in state["packed"]]
        self.group_drops = [{str(k): int(v) for k, v in dict(d).items()} for d in state["group_drops"]]
        self.buffer = self._rebuild(state["buffer"], "buffer")
        self.carry = self._rebuild(state["carry"], "carry")

    def resize_state(self, olds: list[dict[str, Any]], ctx: ResizeContext, **kw: Any) -> dict[str, Any]:
        """The packer state of new rank ``ctx.dp_rank`` of ``ctx.dp_size`` from the packer states of ALL old
        ranks (``olds``, old-rank order; pure data, elastic resize; docs/packing_ledger.md).

        The new buffer and carry are empty: group ``g``'s waiting samples are handed to its source,
        ``ctx.resize(self.source[g], [old["source"][g] for old in olds], handover=keys)`` (``keys``: old-rank order,
        buffer order, carry last). New rank 0 carries the sums of the old counters, with ``consumed`` less the
        handed-over samples (their new owner consumes them again); other new ranks start at zero, so the world's
        ledger still balances. Raises ``StateError`` (one line) when the olds disagree on groups or sources. A
        subclass checks and fills the fields it adds to ``_FIELDS``.
        """
        cls, fields = type(self).__name__, self._savable_fields
        where = f"{cls}.resize_state"
        if not isinstance(olds, (list, tuple)) or not olds:
            raise StateError(f"{where}: needs the packer states of all old ranks (a non-empty list), got {olds!r:.80}")
        for i, old in enumerate(olds):
            if not isinstance(old, dict) or set(old) != set(fields):
                got = sorted(old) if isinstance(old, dict) else type(old).__name__
                raise StateError(f"{where}: old rank {i}'s state has fields {got}, a {cls} state has {list(fields)} "
                                 "(saved under another packer.strategy or version, or not a packer state)")
        names, n = list(olds[0]["groups"]), len(olds[0]["groups"])
        if n != len(self.source):
            raise StateError(f"{where}: the old ranks' packers have {n} groups {names}, this packer {len(self.source)}")
        tags = [s.get("stage") if isinstance(s, dict) else None for s in olds[0]["source"]]
        for i, old in enumerate(olds):
            if list(old["groups"]) != names:
                raise StateError(f"{where}: old rank {i} has groups {list(old['groups'])}, old rank 0 has {names}: "
                                 "the old ranks ran different configs; resume with the config they were saved with")
            for field in ("source", "consumed", "packed", "group_drops"):
                if not isinstance(old[field], list) or len(old[field]) != n:
                    got = len(old[field]) if isinstance(old[field], list) else type(old[field]).__name__
                    raise StateError(f"{where}: old rank {i} has {got} {field} entries for {n} groups {names}")
            if [s.get("stage") if isinstance(s, dict) else None for s in old["source"]] != tags:
                raise StateError(f"{where}: old rank {i}'s group sources differ from old rank 0's {tags}")
            bad = [e for f in ("buffer", "carry") for e in old[f]
                   if not (isinstance(e, (list, tuple)) and len(e) == 2 and isinstance(e[0], int) and 0 <= e[0] < n)]
            drops = old["drops"]
            if bad or not (isinstance(drops, dict) and drops.get("stage") == "DropCounter"):
                raise StateError(f"{where}: old rank {i}'s buffer/carry entries {bad[:3]} or drops {drops!r:.60} are "
                                 f"malformed for groups {names}")
        if ctx.same_world and len(olds) != 1:
            raise StateError(f"{where}: a budget change rebuilds a rank from its own state only, got {len(olds)} "
                             "states")
        first = ctx.carries_counters
        # old-rank order; within a rank buffer order, carry last
        waiting = [[key for old in olds for f in ("buffer", "carry") for gg, key in old[f] if gg == g]
                   for g in range(n)]
        ctx.note_handover(sum(len(keys) for keys in waiting))
        return {
            "groups": names, "buffer": [], "carry": [],
            "source": [ctx.resize(self.source[g], [old["source"][g] for old in olds], handover=waiting[g])
                       for g in range(n)],
            "drops": {"stage": "DropCounter", "state": {"counts": merge_counts(
                old["drops"]["state"].get("counts", {}) for old in olds) if first else {}}},
            "num_batches": sum(int(old["num_batches"]) for old in olds) if first else 0,
            # the handed-over samples are consumed again by their new owner
            "consumed": [sum(int(old["consumed"][g]) for old in olds) - len(waiting[g]) if first else 0
                         for g in range(n)],
            "packed": [sum(int(old["packed"][g]) for old in olds) if first else 0 for g in range(n)],
            "group_drops": [merge_counts(old["group_drops"][g] for old in olds) if first else {} for g in range(n)],
        }

    def ledger(self) -> dict[str, dict[str, Any]]:
        """Per group: ``consumed`` (taken from its source), ``packed`` (into yielded batches), ``dropped`` (by the
        packer, reason -> count; the source's own drops are in ``source_drops``) and ``buffered`` (waiting in the
        buffer or the carry); ``consumed == packed + sum(dropped) + buffered`` (``ledger_errors``)."""
        waiting = Counter(group for group, _ in (*self.buffer, *self.carry))
        return {name: {"consumed": self.consumed[g], "packed": self.packed[g],
                       "dropped": dict(sorted(self.group_drops[g].items())), "buffered": waiting[g]}
                for g, name in enumerate(self.group_names)}

    @property
    def seq_length(self) -> int:
        """Packed sequence length of every batch: ``config.max_num_tokens``."""
        return self.config.max_num_tokens

    def stats(self) -> dict[str, Any]:
        """Counters: batches, per-group consumption, buffer (and lossless carry) occupancy, drops by reason
        (packer + sources), ``unused`` (parts of kept records the official readers ignore too, from the sources)
        and the per-group ``ledger`` (:meth:`ledger`)."""
        sources = {name: s.stats() for name, s in zip(self.group_names, self.source)
                   if callable(getattr(s, "stats", None))}
        return {"num_batches": self.num_batches, "consumed": dict(zip(self.group_names, self.consumed)),
                "buffer_len": len(self.buffer), "carry_len": len(self.carry),
                "drops": merge_counts([self.drops.counts, *(st.get("drops", {}) for st in sources.values())]),
                "unused": merge_counts(st.get("unused", {}) for st in sources.values()),
                "packer_drops": dict(self.drops.counts),
                "source_drops": {name: st.get("drops", {}) for name, st in sources.items()},
                "sources": sources,  # each group source's own counters (the elastic readers' ledger and cursors)
                "ledger": self.ledger()}

    # -- the official loop (``step.PackLoop``; this class supplies the samples and lays them out) ----------
    def _fill(self, fill: "_PackFill") -> None:
        """Fill one pack through the strategy's loop (the official ``PackLoop`` here; ``BalancedPacker``'s own)."""
        self._loop.fill(fill, self.buffer, self.carry)

    def __next__(self) -> dict[str, Any]:
        fill = self._fill_type(self)
        try:
            self._fill(fill)
        except StopIteration:
            for group, indexes in zip(fill.groups, fill.data_indexes):  # the unfinished pack is never yielded
                self.group_drops[group][END_OF_STREAM] = self.group_drops[group].get(END_OF_STREAM, 0) + 1
                self.drops.drop(END_OF_STREAM, f"group {self.group_names[group]!r} sample {indexes} was in the "
                                               "unfinished pack when a group source ended")
            raise
        batch = {**fill.pack.to_batch(), "batch_data_indexes": fill.data_indexes}
        for group in fill.groups:
            self.packed[group] += 1
        self.num_batches += 1
        return batch
