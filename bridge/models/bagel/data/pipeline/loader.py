"""The loader Megatron receives: ``BagelExternalLoader`` (length hint, exact resume, fingerprint, stats).

Megatron's ``dataloader_type="external"`` hands the object returned by ``build_datasets`` straight to
``RerunDataIterator``: no sampler, no collation, no workers, no fast-forward. ``BagelExternalLoader`` is that
object; its ``save_state()`` / ``restore_state()`` (the names Bridge's ``maybe_save/load_dataloader_state`` call,
used nowhere else: inside the package every stage speaks ``state_dict`` / ``load_state_dict``) save the whole chain
it owns, each stage through its own declared state, plus the fingerprint (``state.fingerprint``). Public through
``external`` (the seed import path).
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from ..config.schema import PACKER_BUDGET_KEYS, REMOVED_ORDERS
from ..energon.readers.workers import shutdown_workers
from ..state import (BUDGET_CHANGE_KEY, ELASTIC_TOPOLOGY_KEYS, FRESH_STREAM_KEY, ResizeContext, ResumeMismatchError,
                     Stage, StateError, check_fields, check_restricted, energon_state_classes, fingerprint_changes,
                     fingerprint_diff, fingerprint_of, is_stateful, load_value, mismatch_message, save_value,
                     unsavable_fields, walk)
from ..watchdog import batch_call

__all__ = ["BagelExternalLoader", "ResumeMismatchError", "STATE_VERSION", "budget_of", "energon_state_classes",
           "fingerprint_diff", "saved_world"]

logger = logging.getLogger(__name__)

#: The loader state layout this package reads and writes. 4: every stage saves its input as ``source``, the loader
#: records its resize ``generation``, the ``energon`` order is gone (its states are refused naming it).
STATE_VERSION = 4


def saved_world(state: Mapping[str, Any]) -> tuple[str, int, int]:
    """``(order, dp_rank, dp_size)`` a loader state was saved under (from its fingerprint; ``"?"`` / -1 unknown)."""
    fp = state.get("fingerprint", {}) if isinstance(state, Mapping) else {}
    loader = fp.get("loader", {}) if isinstance(fp, Mapping) else {}
    return str(loader.get("order", "?")), int(loader.get("dp_rank", -1)), int(loader.get("dp_size", -1))


#: A fingerprint key holding a packer knob: the packer stage's identity, its ``config`` (``source….config.K``, with
#: ``[i]`` steps under the emulated official workers; K as ``PackerConfig.stream_identity`` writes it), the one record
#: of the packer's knobs in a fingerprint.
_PACKER_KEY = re.compile(r"source(?:\.source|\[\d+\])*\.config\.(?P<knob>.+)")
#: ``PackerConfig.stream_identity`` path of each budget -> the ``data.packer.*`` name it is documented under (the
#: balanced strategy's knobs sit under ``strategy.balance``).
_BUDGET_PATHS = {("strategy." + k if k.startswith("balance.") else k): k for k in PACKER_BUDGET_KEYS}


def budget_of(key: str) -> str | None:
    """The packer budget (a ``PACKER_BUDGET_KEYS`` name) a fingerprint key (dotted path) holds, or None."""
    m = _PACKER_KEY.fullmatch(key)
    return _BUDGET_PATHS.get(m.group("knob")) if m else None


def _shown_key(key: str) -> str:
    """A fingerprint key as a refusal names it: a packer knob by its ``data.packer.*`` name, others as they are."""
    m = _PACKER_KEY.fullmatch(key)
    if m is None:
        return key
    knob = m.group("knob")
    return "data.packer.strategy" if knob == "strategy.name" else f"data.packer.{knob.removeprefix('strategy.')}"


def _comparable(fingerprint: Mapping[str, Any]) -> Mapping[str, Any]:
    """A saved fingerprint as this version compares it: states saved before the packer stage's identity became the
    one record of the packer knobs also hold them under ``loader.packer`` (the same values): that copy is left out."""
    loader = fingerprint.get("loader")
    if not isinstance(loader, Mapping) or "packer" not in loader:
        return fingerprint
    return {**fingerprint, "loader": {k: v for k, v in loader.items() if k != "packer"}}


def _version_problem(state: Mapping[str, Any]) -> str:
    """The one-line refusal of a state this version cannot read (another state version, or a removed order)."""
    order = saved_world(state)[0]
    why = REMOVED_ORDERS.get(order)
    if why is not None:
        return (f"BagelExternalLoader.restore_state: this loader state was written with data.order {order!r}; {why}. "
                f"Start the data stream fresh while the model resumes ({FRESH_STREAM_KEY}=true), or resume with the "
                "package version that wrote it")
    return (f"BagelExternalLoader.restore_state: loader state version {state.get('version')!r} is not supported (this "
            f"package reads and writes version {STATE_VERSION}); it was written by another version of "
            f"bagel-megatron-data: resume with that version, or start the data stream fresh ({FRESH_STREAM_KEY}=true)")


class BagelExternalLoader(Stage):
    """The train "dataset" for ``dataloader_type="external"``: an iterator of ready packed batches.

    ``batches`` is its source stage (normally ``BagelRNGIterator`` over ``BagelPacker``, or a ``PrefetchStage``
    around it: the builder adds one for ``data.prefetch``); the loader owns it. ``stateful_loaders`` (for callers
    that wire the chain by hand and hand over their readers) are saved with the loader only when the source chain
    does not already own them; each speaks either protocol: ``state_dict()`` / ``load_state_dict(state)`` (torch's
    and ours) or Energon's ``save_state_rank()`` / ``restore_state_rank(state)`` (``SavableDataLoader`` from
    ``get_savable_loader``), whose ``SavableDataLoaderState`` Bridge's restricted unpickler accepts.

    State (``save_state()`` == ``state_dict()``; ``restore_state()`` == ``load_state_dict()``): ``version``,
    ``fingerprint`` (checked on restore: a different configuration is refused naming every differing key),
    ``generation`` (elastic resizes the stream went through), ``position`` (batches handed out), ``source`` (the
    chain's nested states) and ``stateful_loaders``.

    ``fingerprint``: the builder's part of the fingerprint (``ValidatedData.fingerprint``); with its ``order``,
    ``dp_rank`` and ``dp_size`` the loader checks the world a state was saved in. ``topology_keys``: fingerprint keys
    (dotted paths) that may differ on restore because the stream does not depend on them (the elastic order's,
    ``state.ELASTIC_TOPOLOGY_KEYS``).

    ``fresh_stream`` (``data.fresh_stream``): ``restore_state`` restores nothing and the stream starts fresh while
    the model resumes (a deliberate change of the data configuration). ``resume_budget_change``
    (``data.resume_budget_change``, elastic order only): a state whose fingerprint differs from this loader's in
    packer budgets only (``config.schema.PACKER_BUDGET_KEYS``) is restored through ``budget_change_state``; any other
    difference is still refused.

    ``__len__`` is only a positive hint (Megatron's MIMO setup calls ``len``); iteration is not bounded by it
    and it is not part of the state, so a run may resume with a different ``train_iters``.
    """

    _savable_fields = ("version", "fingerprint", "generation", "position", "source", "stateful_loaders")

    def __init__(self, batches: Iterator[dict[str, Any]], *, length: int, stateful_loaders: Iterable[Any] = (),
                 fingerprint: Mapping[str, Any] | None = None, topology_keys: Iterable[str] = (),
                 fresh_stream: bool = False, resume_budget_change: bool = False) -> None:
        if not isinstance(length, int) or isinstance(length, bool) or length <= 0:
            raise ValueError(f"BagelExternalLoader: length must be a positive int (a hint for Megatron), got "
                             f"{length!r}")
        self.source = batches
        self.length = length
        owned = {id(stage) for stage in walk(self.source)}
        self.stateful_loaders = []
        for i, loader in enumerate(stateful_loaders):
            if id(loader) in owned:
                continue  # saved through the source stage that owns it
            if not is_stateful(loader):
                raise TypeError(f"BagelExternalLoader: stateful_loaders[{i}] ({type(loader).__name__}) has neither "
                                "state_dict() / load_state_dict() nor Energon's save_state_rank() / "
                                "restore_state_rank()")
            self.stateful_loaders.append(loader)
        self._config_fingerprint = dict(fingerprint or {})
        self.topology_keys = tuple(topology_keys)
        self.fresh_stream = bool(fresh_stream)
        self.resume_budget_change = bool(resume_budget_change)
        check_restricted(self._config_fingerprint, "fingerprint")
        self._closed = False
        self.reset_state()
        unsavable = unsavable_fields(self)
        if unsavable:  # said now, not first at the first checkpoint (iterating without one still works)
            logger.warning("BagelExternalLoader: save_state() will raise StateError: %s cannot save its state (no "
                           "state_dict() / load_state_dict()); give it one, or do not checkpoint this loader",
                           "; ".join(unsavable))

    def reset_state(self) -> None:
        self.position = self.generation = 0

    def fingerprint(self) -> dict[str, Any]:
        """Everything that changes the stream: the builder's part plus every stage's ``identity()``."""
        return {"loader": dict(self._config_fingerprint), "source": fingerprint_of(self.source),
                "stateful_loaders": [fingerprint_of(s) for s in self.stateful_loaders]}

    @property
    def order(self) -> str | None:
        """The stream order this loader was built for (``data.order``), None when wired by hand."""
        return self._config_fingerprint.get("order")

    # -- iteration ----------------------------------------------------------------------------------
    def __next__(self) -> dict[str, Any]:
        if self._closed:
            raise RuntimeError("BagelExternalLoader: next() after close()")
        try:
            batch = batch_call(next, self.source)  # one watchdog hand-over per batch (watchdog/watch.py)
        except StopIteration:
            logger.error("BagelExternalLoader: the batch stream ended after %d batches (Megatron expects an "
                         "endless stream; check the readers' cycling)", self.position)
            raise
        self.position += 1
        return batch

    def __len__(self) -> int:
        return self.length

    def stats(self) -> dict[str, Any]:
        """Pipeline counters from the trainer's side (identical with and without prefetch for the same batches).

        ``num_batches`` (handed to the trainer), ``consumed`` (samples read per group), ``buffer_len`` (packer
        overflow buffer), ``drops`` (reason → count, packer and readers together), ``packer_drops`` and
        ``source_drops`` (per group) — whatever the source reports, plus ``position``.
        """
        return {**super().stats(), "position": self.position}

    # -- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The declared fields: the version and fingerprint this loader writes, and the rest as declared."""
        return {"version": STATE_VERSION, "fingerprint": self.fingerprint(), "generation": int(self.generation),
                "position": int(self.position), "source": save_value(self.source, "BagelExternalLoader.source"),
                "stateful_loaders": save_value(self.stateful_loaders, "BagelExternalLoader.stateful_loaders")}

    def save_state(self) -> dict[str, Any]:
        """State describing the next batch this loader will yield (Bridge calls this at every checkpoint), checked
        against Megatron's restricted unpickler types here, so a bad state fails at save, not at resume."""
        state = self.state_dict()
        check_restricted(state, "BagelExternalLoader.save_state()", allow=energon_state_classes())
        return state

    def _budget_changes(self, saved: Mapping[str, Any], ignore: Iterable[str]) -> dict[str, tuple[Any, Any]]:
        """``{budget: (saved, current)}`` when the fingerprints ``saved`` and this loader's differ (outside ``ignore``)
        in packer budgets only and this loader accepts that (``resume_budget_change``, elastic order); ``{}`` when
        they do not differ. Raises ``ResumeMismatchError`` naming every differing key otherwise; when only budgets
        differ the message names the key that allows it, or (official order) why it is refused."""
        changes = fingerprint_changes(_comparable(saved), self.fingerprint(), ignore)
        if not changes:
            return {}
        budgets = {budget_of(k): v for k, v in changes.items() if budget_of(k)}
        only_budgets = len(budgets) > 0 and all(budget_of(k) for k in changes)
        if only_budgets and self.resume_budget_change and self.order == "elastic":
            return budgets
        names, note = ", ".join(f"data.packer.{b}" for b in budgets), ""
        if only_budgets and self.order == "official":
            note = (f"only packer budgets differ ({names}), but data.order: official cannot change them across a "
                    "resume: its stream is the official loader's, whose order is a function of the packer state "
                    "(the emulated workers' buffers); keep the budgets, or start the data stream fresh")
        elif only_budgets and self.order == "elastic":
            note = (f"only packer budgets differ ({names}): to keep them and continue the epoch exactly once, resume "
                    f"with {BUDGET_CHANGE_KEY}=true (the packer's waiting samples go back to the readers; "
                    "docs/resume.md)")
        elif self.resume_budget_change and budgets:
            note = (f"{BUDGET_CHANGE_KEY}=true lets only the packer budgets change ({', '.join(PACKER_BUDGET_KEYS)}); "
                    "the other keys above must match")
        diff = dict.fromkeys(f"{_shown_key(k)}: saved={old!r} current={new!r}" for k, (old, new) in changes.items())
        raise ResumeMismatchError(mismatch_message(list(diff), note))

    def check_compatible(self, state: dict[str, Any]) -> None:
        """Refuse a state of another version (naming a removed order), of another configuration (every differing
        key: ``ResumeMismatchError``; a change of packer budgets only is accepted with ``resume_budget_change`` in
        the elastic order), or of another DP rank / size (the elastic order resizes with ``resize_states`` first)."""
        if state.get("version") != STATE_VERSION:
            raise StateError(_version_problem(state))
        check_fields(self, state, "BagelExternalLoader.restore_state")
        position = state.get("position")
        if not isinstance(position, int) or isinstance(position, bool) or position < 0:
            raise StateError(f"BagelExternalLoader.restore_state: position must be an int >= 0, got {position!r}")
        saved = state.get("fingerprint")
        if not isinstance(saved, dict):
            raise StateError("BagelExternalLoader.restore_state: fingerprint must be a dict")
        self._budget_changes(saved, self.topology_keys)
        order, rank, size = saved_world(state)
        here = (self._config_fingerprint.get("dp_rank"), self._config_fingerprint.get("dp_size"))
        if None not in here and (rank, size) != here:  # only the elastic order's fingerprint lets these differ
            raise StateError(
                f"BagelExternalLoader.restore_state: this loader state was saved by DP rank {rank} of {size}, this is "
                f"DP rank {here[0]} of {here[1]}: a resume on another DP size must read every old rank's state (the "
                "job does; with Bridge's pretrain() run `bagel-data resize-state` on the checkpoint first)")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Same as ``restore_state``."""
        if not isinstance(state, dict):
            raise StateError(f"BagelExternalLoader.restore_state: state must be a dict, got {type(state).__name__}")
        if "version" not in state:
            missing = [f for f in self._savable_fields if f not in state]
            raise StateError(f"BagelExternalLoader.restore_state: not a loader state (no {', '.join(missing)}; "
                             f"keys: {sorted(map(str, state))[:8]}): pass what save_state() returned (Bridge keeps it "
                             "as the 'dataloader_state_dict' of train_dataloader_dprankNNN.pt)")
        self.check_compatible(state)
        if self._budget_changes(state["fingerprint"], self.topology_keys):
            state = self.budget_change_state(state)
        if self.position:
            logger.warning("BagelExternalLoader.restore_state after %d batches were already taken", self.position)
        load_value(self, "source", state["source"], "BagelExternalLoader.source")
        load_value(self, "stateful_loaders", state["stateful_loaders"], "BagelExternalLoader.stateful_loaders")
        self.generation = int(state["generation"])
        self.position = int(state["position"])
        logger.info("BagelExternalLoader: restored at batch %d", self.position)

    def restore_state(self, state: Any) -> None:
        """Continue exactly where ``save_state()`` was taken; call before the first ``next()``.

        Raises ``StateError`` for a malformed or old-version state and ``ResumeMismatchError`` (naming every
        differing key) when the configuration changed since the save. With ``fresh_stream`` nothing is restored
        (whatever ``state`` is; ``None`` when the caller did not read it) and one INFO line says so.
        """
        if self.fresh_stream:
            saved = state.get("position") if isinstance(state, Mapping) else None
            logger.info("%s=true: the loader state in the checkpoint%s is not restored; the data stream starts fresh "
                        "(data seed, batch 0) while the model resumes", FRESH_STREAM_KEY,
                        f" (batch {saved})" if isinstance(saved, int) else "")
            return
        self.load_state_dict(state)

    def budget_change_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's state after a deliberate change of packer budgets (``resume_budget_change``; pure data: this
        loader is not changed), for ``load_state_dict``; ``state`` is this rank's own saved state, of this DP rank
        and size, differing from this loader's configuration in packer budgets only.

        Each stage rebuilds its part through the live chain (``Stage.resize_state`` with a ``same_world``
        ``ResizeContext``): the packer's buffered and carried samples are handed back to their group readers (read
        again first, by restore key, as after an elastic resize), the new packer starts with an empty buffer, the
        readers keep their blocks and cursors and every counter stays on this rank, so the ledger keeps balancing
        and every sample of the epoch is still packed or dropped exactly once. The RNG iterator starts fresh streams
        for (seed, rank, generation + 1). The result carries this loader's fingerprint. Logs one INFO line on DP
        rank 0 (old -> new budgets, samples handed back). Raises ``StateError`` for a hand-wired loader's state and
        ``ResumeMismatchError`` when anything but budgets differs or the change is not allowed here.
        """
        if state.get("stateful_loaders"):
            raise StateError("budget change: a loader with hand-wired stateful_loaders cannot change its packer "
                             "budgets")
        budgets = self._budget_changes(state["fingerprint"], self.topology_keys)
        _, rank, size = saved_world(state)
        generation = int(state["generation"]) + 1
        ctx = ResizeContext(rank, size, generation, int(state["fingerprint"]["loader"]["seed"]), same_world=True)
        new = {"version": STATE_VERSION, "fingerprint": self.fingerprint(), "generation": generation,
               "position": int(state["position"]), "source": ctx.resize(self.source, [state["source"]]),
               "stateful_loaders": []}
        changed = ", ".join(f"{k} {old} -> {cur}" for k, (old, cur) in budgets.items()) or "none"
        logger.log(logging.INFO if rank == 0 else logging.DEBUG,
                   "%s=true: packer budgets changed at batch %d (DP rank %d of %d): %s; %d buffered sample(s) handed "
                   "back to the readers (partition cursors kept), the packer starts with an empty buffer",
                   BUDGET_CHANGE_KEY, new["position"], rank, size, changed, ctx.handed_over)
        return new

    def resize_states(self, olds: Sequence[Mapping[str, Any]], dp_rank: int, dp_size: int) -> dict[str, Any]:
        """The state of new DP rank ``dp_rank`` of ``dp_size`` from the states of every old rank (old rank order), for
        ``restore_state`` on a loader built like this one (pure data: this loader is not changed; with the same inputs
        the same output, so one checkpoint restored twice on one new topology gives the same batches).

        Each stage resizes its own part through the live chain (``Stage.resize_state``): the RNG iterator starts fresh
        streams for (seed, new rank, generation), the packer hands its buffered samples to the group readers, the
        readers hand their partitions (with cursors) and handed-over samples to their new owners, and new rank 0
        carries the counters so that the ledger summed over the world is unchanged. Raises ``StateError`` (one line)
        when the states are not one complete elastic checkpoint of this configuration: another order or version, a
        missing or duplicated rank, differing configurations or positions. States that differ from this loader in
        packer budgets only pass when the loader accepts a budget change (``resume_budget_change``): the resized
        state keeps the old fingerprint and ``restore_state`` applies the change (``budget_change_state``).
        """
        if not olds:
            raise StateError("elastic resize: no old loader states")
        for k, old in enumerate(olds):
            if not isinstance(old, Mapping) or old.get("version") != STATE_VERSION:
                raise StateError(_version_problem(old if isinstance(old, Mapping) else {}).replace(
                    "BagelExternalLoader.restore_state", f"elastic resize: old rank {k}"))
            order, rank, size = saved_world(old)
            if order != "elastic":
                raise StateError(f"elastic resize: the checkpoint was written with data.order {order!r}, whose stream "
                                 "depends on the DP size; restarts on another DP size need data.order: elastic")
            if (rank, size) != (k, len(olds)):
                raise StateError(f"elastic resize: state {k} of {len(olds)} was saved by DP rank {rank} of {size}; "
                                 "give every old rank's file, in rank order")
            diff = fingerprint_diff(olds[0]["fingerprint"], old["fingerprint"], ELASTIC_TOPOLOGY_KEYS)
            if diff:
                raise StateError(f"elastic resize: old ranks 0 and {k} differ in configuration: {diff[0]}")
            if old["position"] != olds[0]["position"]:
                raise StateError(f"elastic resize: old ranks stopped at different batches ({olds[0]['position']} vs "
                                 f"{old['position']} on rank {k}): the files are not from one checkpoint")
            if old.get("stateful_loaders"):
                raise StateError("elastic resize: a loader with hand-wired stateful_loaders cannot be resized")
        # a change of budgets (resume_budget_change) is applied by restore_state, after the resize
        self._budget_changes(olds[0]["fingerprint"], ELASTIC_TOPOLOGY_KEYS)
        generation = 1 + max(int(o.get("generation", 0)) for o in olds)
        ctx = ResizeContext(dp_rank, dp_size, generation, int(olds[0]["fingerprint"]["loader"]["seed"]))
        fingerprint = copy.deepcopy(olds[0]["fingerprint"])
        fingerprint["loader"].update(dp_rank=int(dp_rank), dp_size=int(dp_size))
        state = {"version": STATE_VERSION, "fingerprint": fingerprint, "generation": generation,
                 "position": int(olds[0]["position"]), "source": ctx.resize(self.source, [o["source"] for o in olds]),
                 "stateful_loaders": []}
        logger.info("elastic resize: %d old ranks -> DP rank %d of %d at batch %d (generation %d)", len(olds), dp_rank,
                    dp_size, state["position"], generation)
        return state

    def close(self) -> None:
        """Close the source chain (stopping a prefetch producer, closing readers) and extra loaders; idempotent.

        An extra loader with a ``close()`` is closed; a torch ``DataLoader`` without one (Energon's savable
        loader wired in by hand) has its persistent worker processes stopped now (``shutdown_workers``).
        """
        if self._closed:
            return
        self._closed = True
        super().close()
        for obj in self.stateful_loaders:
            close = getattr(obj, "close", None)
            if callable(close):
                close()
            else:
                shutdown_workers(obj)

    def __enter__(self) -> "BagelExternalLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
