"""The loader Megatron receives: ``BagelExternalLoader`` (length hint, exact resume, fingerprint, stats).

Megatron's ``dataloader_type="external"`` hands the object returned by ``build_datasets`` straight to
``RerunDataIterator``: no sampler, no collation, no workers, no fast-forward. ``BagelExternalLoader`` is that
object. Its ``save_state()`` / ``restore_state()`` (the names Bridge's ``maybe_save/load_dataloader_state``
call; the only place those names are used — inside the package every stage speaks ``state_dict`` /
``load_state_dict``) save the whole chain it owns — prefetch stage, RNG streams, packer, per-group readers,
each through its own declared state — plus a fingerprint that refuses a resume under a changed
configuration. Public through ``external`` (the seed import path).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from ..energon.workers import shutdown_workers
from ..state import (Stage, StateError, chain_fingerprint, check_restricted, is_stateful, unsavable_fields,
                     walk_stages)
from ..watchdog import batch_call

__all__ = ["BagelExternalLoader", "ResumeMismatchError", "STATE_VERSION", "energon_state_classes", "fingerprint_diff"]

logger = logging.getLogger(__name__)

STATE_VERSION = 3


class ResumeMismatchError(StateError):
    """A saved loader state was produced under a different configuration (fingerprint differs)."""


# -- the loader Megatron receives -----------------------------------------------------------------------


def energon_state_classes() -> tuple[type, ...]:
    """The Energon state classes Bridge's restricted unpickler accepts (Energon readers put them in state)."""
    from megatron.energon.flavors.webdataset.sample_loader import SliceState
    from megatron.energon.rng import SystemRngState
    from megatron.energon.savable_loader import (
        SavableCheckpoint,
        SavableDataLoaderState,
        SavableDatasetCheckpoint,
        SavableDatasetState,
    )
    from megatron.energon.state import FlexState

    return (FlexState, SystemRngState, SavableCheckpoint, SavableDataLoaderState, SavableDatasetCheckpoint,
            SavableDatasetState, SliceState)


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, Mapping):
        for k in value:
            _flatten(value[k], f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _flatten(v, f"{prefix}[{i}]", out)
        if not value:
            out[prefix] = []
    else:
        out[prefix] = value
    return out


def fingerprint_diff(saved: Mapping[str, Any], current: Mapping[str, Any], ignore: Iterable[str] = ()) -> list[str]:
    """Every key (dotted path) whose value differs between two fingerprints, as ``key: saved=… current=…``;
    keys in ``ignore`` (exact dotted paths) are not compared."""
    a, b = _flatten(saved, "", {}), _flatten(current, "", {})
    absent, skip = "<absent>", set(ignore)
    return [f"{k}: saved={a.get(k, absent)!r} current={b.get(k, absent)!r}"
            for k in sorted(set(a) | set(b)) if k not in skip and a.get(k, absent) != b.get(k, absent)]


#: A refused restore names at most this many differing keys, each cut to _DIFF_CHARS characters.
_DIFF_SHOWN, _DIFF_CHARS = 8, 240
#: Loader keys that only the elastic order lets a run change across a restart.
_ELASTIC_KEYS = ("loader.num_workers:", "loader.dp_size:", "loader.dp_rank:")


def mismatch_message(diff: list[str]) -> str:
    """The ``ResumeMismatchError`` text for ``fingerprint_diff`` lines: the configuration keys (``loader.*``:
    ``data.*`` settings, the groups, DP size) first, the stage keys that follow from them only counted, long values
    cut, and what to do, so the line stays readable however much of Energon's config differs."""
    config = [d for d in diff if d.startswith("loader.")]
    shown = (config or diff)[:_DIFF_SHOWN]
    cut = [d if len(d) <= _DIFF_CHARS else d[: _DIFF_CHARS - 1] + "…" for d in shown]
    rest = len(diff) - len(shown)
    if rest:
        cut.append(f"(+{rest} more: keys of the stages" + (", which follow from these)" if config else ")"))
    remedy = ("restore with the data configuration this state was saved with, or start the data stream fresh "
              "(without this state)")
    if any(d.startswith(_ELASTIC_KEYS) for d in config) and not any(d.startswith("loader.order:") for d in config):
        remedy += ("; only data.order: elastic lets a run change DP size or data.num_workers across a restart "
                   "(docs/elastic.md)")
    return ("BagelExternalLoader.restore_state: the saved loader state belongs to a different data configuration; "
            "differing keys:\n  " + "\n  ".join(cut) + f"\n{remedy}")


class BagelExternalLoader(Stage):
    """The train "dataset" for ``dataloader_type="external"``: an iterator of ready packed batches.

    ``batches`` is the upstream stage (normally ``BagelRNGIterator`` over ``BagelPacker``, or a
    ``PrefetchStage`` around it: the builder adds one for ``data.prefetch``); the loader owns it.
    ``stateful_loaders`` (for callers that wire the chain by hand and hand over
    their readers) are saved with the loader only when the upstream chain does not already own them; each
    speaks either protocol: ``state_dict()`` / ``load_state_dict(state)`` (torch's and ours) or Energon's
    ``save_state_rank()`` / ``restore_state_rank(state)`` (``SavableDataLoader`` from
    ``get_savable_loader``), whose ``SavableDataLoaderState`` Bridge's restricted unpickler accepts.

    State (``save_state()`` == ``state_dict()``; ``restore_state()`` == ``load_state_dict()``): ``version``,
    ``fingerprint`` (checked on restore: a different configuration is refused naming every differing key),
    ``position`` (batches handed out), ``upstream`` (the chain's nested states) and ``stateful_loaders``.

    ``topology_keys``: fingerprint keys (dotted paths) that may differ on restore because the stream does not
    depend on them (the elastic order's DP rank/size and workers: its readers check their own world instead).

    ``__len__`` is only a positive hint (Megatron's MIMO setup calls ``len``); iteration is not bounded by it
    and it is not part of the state, so a run may resume with a different ``train_iters``.
    """

    _savable_fields = ("version", "fingerprint", "position", "upstream", "stateful_loaders")

    def __init__(self, batches: Iterator[dict[str, Any]], *, length: int, stateful_loaders: Iterable[Any] = (),
                 fingerprint: Mapping[str, Any] | None = None, topology_keys: Iterable[str] = ()) -> None:
        if not isinstance(length, int) or isinstance(length, bool) or length <= 0:
            raise ValueError(f"BagelExternalLoader: length must be a positive int (a hint for Megatron), got {length!r}")
        self.upstream = batches
        self.length = length
        owned = {id(stage) for stage in walk_stages(self.upstream)}
        self.stateful_loaders = []
        for i, source in enumerate(stateful_loaders):
            if id(source) in owned:
                continue  # saved through the upstream stage that owns it
            if not is_stateful(source):
                raise TypeError(f"BagelExternalLoader: stateful_loaders[{i}] ({type(source).__name__}) has neither "
                                "state_dict() / load_state_dict() nor Energon's save_state_rank() / "
                                "restore_state_rank()")
            self.stateful_loaders.append(source)
        self._config_fingerprint = dict(fingerprint or {})
        self.topology_keys = tuple(topology_keys)
        check_restricted(self._config_fingerprint, "fingerprint")
        self._closed = False
        self.reset_state()
        unsavable = unsavable_fields(self)
        if unsavable:  # said now, not first at the first checkpoint (iterating without one still works)
            logger.warning("BagelExternalLoader: save_state() will raise StateError: %s cannot save its state (no "
                           "state_dict() / load_state_dict()); give it one, or do not checkpoint this loader",
                           "; ".join(unsavable))

    def reset_state(self) -> None:
        self.position = 0

    # -- declared fields that are checked, not restored ---------------------------------------------
    @property
    def version(self) -> int:
        return STATE_VERSION

    @version.setter
    def version(self, value: Any) -> None:
        if value != STATE_VERSION:
            raise StateError(f"BagelExternalLoader.restore_state: loader state version {value!r} is not supported "
                             f"(this package reads and writes version {STATE_VERSION}); it was written by another "
                             "version of bagel-megatron-data: resume with that version, or start the data stream fresh")

    @property
    def fingerprint(self) -> dict[str, Any]:
        """Everything that changes the stream: the builder's fingerprint plus every stage's ``identity()``."""
        return {"loader": dict(self._config_fingerprint), "upstream": chain_fingerprint(self.upstream),
                "stateful_loaders": [chain_fingerprint(s) for s in self.stateful_loaders]}

    @fingerprint.setter
    def fingerprint(self, saved: Any) -> None:
        if not isinstance(saved, dict):
            raise StateError("BagelExternalLoader.restore_state: fingerprint must be a dict")
        diff = fingerprint_diff(saved, self.fingerprint, self.topology_keys)
        if diff:
            raise ResumeMismatchError(mismatch_message(diff))

    # -- iteration ----------------------------------------------------------------------------------
    def __iter__(self) -> "BagelExternalLoader":
        return self

    def __next__(self) -> dict[str, Any]:
        if self._closed:
            raise RuntimeError("BagelExternalLoader: next() after close()")
        try:
            batch = batch_call(next, self.upstream)  # one watchdog hand-over per batch (watchdog/watch.py)
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
        ``source_drops`` (per group) — whatever the upstream reports, plus ``position``.
        """
        out = super().stats()
        out["position"] = self.position
        return out

    # -- state --------------------------------------------------------------------------------------
    def save_state(self) -> dict[str, Any]:
        """State describing the next batch this loader will yield (Bridge calls this at every checkpoint).

        Checked against Megatron's restricted unpickler types here, so a bad state fails at save, not at resume.
        """
        state = self.state_dict()
        check_restricted(state, "BagelExternalLoader.save_state()", allow=energon_state_classes())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Same as ``restore_state``."""
        if not isinstance(state, dict):
            raise StateError(f"BagelExternalLoader.restore_state: state must be a dict, got {type(state).__name__}")
        if "version" in state:
            self.version = state["version"]  # an old state gets the version message, not a field list
        else:
            missing = [f for f in self._savable_fields if f not in state]
            raise StateError(f"BagelExternalLoader.restore_state: not a loader state (no {', '.join(missing)}; "
                             f"keys: {sorted(map(str, state))[:8]}): pass what save_state() returned (Bridge keeps it "
                             "as the 'dataloader_state_dict' of train_dataloader_dprankNNN.pt)")
        position = state.get("position")
        if not isinstance(position, int) or isinstance(position, bool) or position < 0:
            raise StateError(f"BagelExternalLoader.restore_state: position must be an int >= 0, got {position!r}")
        if self.position:
            logger.warning("BagelExternalLoader.restore_state after %d batches were already taken", self.position)
        super().load_state_dict(state)
        logger.info("BagelExternalLoader: restored at batch %d", self.position)

    def restore_state(self, state: Any) -> None:
        """Continue exactly where ``save_state()`` was taken; call before the first ``next()``.

        Raises ``StateError`` for a malformed or old-version state and ``ResumeMismatchError`` (naming every
        differing key) when the configuration changed since the save.
        """
        self.load_state_dict(state)

    def close(self) -> None:
        """Close the upstream chain (stopping a prefetch producer, closing readers) and extra loaders; idempotent.

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
