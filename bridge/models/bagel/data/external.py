"""Megatron-facing stage: RNG-isolated packer iterator and the exact-resume external loader.

Megatron's ``dataloader_type="external"`` hands the object returned by ``build_datasets`` straight to
``RerunDataIterator``: no sampler, no collation, no workers, no fast-forward. Everything that makes a
resumed run continue bit-identically is therefore done here:

* ``BagelRNGIterator`` (module ``rng``, re-exported here) gives the packer private Python/NumPy/torch-CPU RNG streams, initialised exactly
  as the official one-worker torch DataLoader would, swapped in around every ``next()`` and saved.
* ``BagelExternalLoader`` is the iterator Megatron receives; its ``save_state()``/``restore_state()``
  (the names Bridge's ``maybe_save/load_dataloader_state`` call) capture the per-group readers, the
  packer and the RNG streams, plus a fingerprint that refuses a resume under a changed configuration.

``BagelMegatronMIMODatasetProvider`` needs Megatron-Bridge; it is created on first access (module
``__getattr__``) by ``_bridge``, so this module imports without Bridge or Transformer Engine.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from .rng import BagelRNGIterator, initial_worker_rng_states
from .state import Savable, StateError, check_restricted

__all__ = [
    "BagelExternalLoader",
    "BagelMegatronMIMODatasetProvider",
    "BagelRNGIterator",
    "ResumeMismatchError",
    "STATE_VERSION",
    "energon_state_classes",
    "initial_worker_rng_states",
]

logger = logging.getLogger(__name__)

STATE_VERSION = 1
_LOADER_KEYS = ("version", "fingerprint", "position", "packer", "loaders")


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


def fingerprint_diff(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Every key (dotted path) whose value differs between two fingerprints, as ``key: saved=… current=…``."""
    a, b = _flatten(saved, "", {}), _flatten(current, "", {})
    absent = "<absent>"
    return [f"{k}: saved={a.get(k, absent)!r} current={b.get(k, absent)!r}"
            for k in sorted(set(a) | set(b)) if a.get(k, absent) != b.get(k, absent)]


def _reader_save(reader: Any) -> Any:
    if hasattr(reader, "save_state_rank"):
        return reader.save_state_rank()
    return reader.state_dict()


def _reader_restore(reader: Any, state: Any) -> None:
    if hasattr(reader, "restore_state_rank"):
        reader.restore_state_rank(state)
    else:
        reader.load_state_dict(state)


class BagelExternalLoader(Savable):
    """The train "dataset" for ``dataloader_type="external"``: an iterator of ready packed batches.

    ``__len__`` is only a positive hint (Megatron's MIMO setup calls ``len``); iteration is not bounded by it
    and it is not part of the state, so a run may resume with a different ``train_iters``.
    """

    _savable_fields = ("position",)

    def __init__(self, batches: Iterator[dict[str, Any]], *, length: int, stateful_loaders: Iterable[Any] = (),
                 fingerprint: Mapping[str, Any] | None = None, prefetch: int = 0) -> None:
        if not isinstance(length, int) or isinstance(length, bool) or length <= 0:
            raise ValueError(f"BagelExternalLoader: length must be a positive int (a hint for Megatron), got {length!r}")
        self.batches = batches
        self.length = length
        self.stateful_loaders = list(stateful_loaders)
        for i, reader in enumerate(self.stateful_loaders):
            if not (hasattr(reader, "save_state_rank") or hasattr(reader, "state_dict")):
                raise TypeError(f"BagelExternalLoader: stateful_loaders[{i}] ({type(reader).__name__}) has neither "
                                "save_state_rank() nor state_dict()")
        self._fingerprint = dict(fingerprint or {})
        check_restricted(self._fingerprint, "fingerprint")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"BagelExternalLoader: prefetch must be an int >= 0, got {prefetch!r}")
        self.prefetch = prefetch
        self._prefetcher: Any = None      # PrefetchedPipeline once the producer process is started
        self._restored: dict[str, Any] | None = None
        self._closed = False
        self.reset_state()

    def reset_state(self) -> None:
        self.position = 0

    def fingerprint(self) -> dict[str, Any]:
        """Everything that changes the stream: the builder's fingerprint plus each reader's ``fingerprint()``."""
        readers = [dict(r.fingerprint()) if hasattr(r, "fingerprint") else {"type": type(r).__name__}
                   for r in self.stateful_loaders]
        return {"loader": dict(self._fingerprint), "readers": readers}

    def __iter__(self) -> "BagelExternalLoader":
        return self

    def _pipeline_state(self) -> dict[str, Any]:
        """Packer (+ private RNG) and reader states of the objects in this process, taken together."""
        if not hasattr(self.batches, "state_dict"):
            raise RuntimeError(f"BagelExternalLoader.save_state: the batch stream ({type(self.batches).__name__}) "
                               "has no state_dict(); wrap the packer in BagelRNGIterator")
        return {"packer": self.batches.state_dict(), "loaders": [_reader_save(r) for r in self.stateful_loaders]}

    def _source(self) -> Iterator[dict[str, Any]]:
        """The batch stream: the packer itself, or (prefetch > 0) a producer process running it ahead."""
        if not self.prefetch:
            return self.batches
        if self._prefetcher is None:
            from .prefetch import PrefetchedPipeline

            restored = self._restored
            initial = restored if restored is not None else self._pipeline_state()
            self._prefetcher = PrefetchedPipeline(
                self.batches, self._pipeline_state, depth=self.prefetch, initial_state=initial,
                on_start=None if restored is None else (lambda: self._apply_pipeline_state(restored)))
        return self._prefetcher

    def _apply_pipeline_state(self, pipeline: dict[str, Any]) -> None:
        for reader, reader_state in zip(self.stateful_loaders, pipeline["loaders"]):
            _reader_restore(reader, reader_state)
        self.batches.load_state_dict(pipeline["packer"])

    def __next__(self) -> dict[str, Any]:
        if self._closed:
            raise RuntimeError("BagelExternalLoader: next() after close()")
        try:
            batch = next(self._source())
        except StopIteration:
            logger.error("BagelExternalLoader: the batch stream ended after %d batches (Megatron expects an "
                         "endless stream; check the readers' cycling)", self.position)
            raise
        self.position += 1
        return batch

    def __len__(self) -> int:
        return self.length

    @property
    def seq_length(self) -> int | None:
        """Packed sequence length of every batch (the packer's ``max_num_tokens``), or None if unknown."""
        return getattr(self.batches, "seq_length", None)

    def stats(self) -> dict[str, Any]:
        """Pipeline counters from the trainer's side: batches, per-group consumption, buffer occupancy, drops."""
        from .stats import merge_counts

        packer = getattr(self.batches, "inner", None)
        stats = packer.stats() if hasattr(packer, "stats") else {}
        reader_drops = [dict(r.drops.counts) for r in self.stateful_loaders if hasattr(r, "drops")]
        stats["drops"] = merge_counts([stats.get("drops", {}), *reader_drops])
        return stats

    def save_state(self) -> dict[str, Any]:
        """State describing the next batch this loader will yield (readers, packer + RNG, position, fingerprint).

        Checked against Megatron's restricted unpickler types here, so a bad state fails at save, not at resume.
        """
        if self.prefetch:  # the state that produces the next batch the trainer receives, not the producer's
            pipeline = self._source().state
        else:
            pipeline = self._pipeline_state()
        state = {"version": STATE_VERSION, "fingerprint": self.fingerprint(), "position": self.position, **pipeline}
        check_restricted(state, "BagelExternalLoader.save_state()", allow=energon_state_classes())
        return state

    def restore_state(self, state: Any) -> None:
        """Continue exactly where ``save_state()`` was taken; call before the first ``next()``.

        Raises ``StateError`` for a malformed state and ``ResumeMismatchError`` (naming every differing key)
        when the configuration changed since the save.
        """
        if not isinstance(state, dict):
            raise StateError(f"BagelExternalLoader.restore_state: state must be a dict, got {type(state).__name__}")
        missing = [k for k in _LOADER_KEYS if k not in state]
        if missing:
            raise StateError(f"BagelExternalLoader.restore_state: state lacks keys {missing} (has {sorted(state)})")
        if state["version"] != STATE_VERSION:
            raise StateError(f"BagelExternalLoader.restore_state: state version {state['version']!r} is not "
                             f"supported (this package writes version {STATE_VERSION})")
        if not isinstance(state["fingerprint"], dict):
            raise StateError("BagelExternalLoader.restore_state: fingerprint must be a dict")
        diff = fingerprint_diff(state["fingerprint"], self.fingerprint())
        if diff:
            raise ResumeMismatchError("BagelExternalLoader.restore_state: the saved loader state belongs to a "
                                      "different data configuration; differing keys:\n  " + "\n  ".join(diff))
        loaders = state["loaders"]
        if not isinstance(loaders, list) or len(loaders) != len(self.stateful_loaders):
            raise StateError(f"BagelExternalLoader.restore_state: state has "
                             f"{len(loaders) if isinstance(loaders, list) else loaders!r} reader states, this "
                             f"loader {len(self.stateful_loaders)} readers (group count differs)")
        if not isinstance(state["position"], int) or state["position"] < 0:
            raise StateError(f"BagelExternalLoader.restore_state: position must be an int >= 0, got {state['position']!r}")
        if self._prefetcher is not None and self._prefetcher.running:
            raise StateError("BagelExternalLoader.restore_state: the prefetch producer is already running; restore "
                             "into a freshly built loader before the first next()")
        if self.position:
            logger.warning("BagelExternalLoader.restore_state after %d batches were already taken", self.position)
        pipeline = {"packer": state["packer"], "loaders": loaders}
        if self.prefetch:  # applied inside the producer process, so this process never opens the datasets
            self._restored = pipeline
        else:
            self._apply_pipeline_state(pipeline)
        super().load_state_dict({"position": state["position"]})
        logger.info("BagelExternalLoader: restored at batch %d", self.position)

    def close(self) -> None:
        """Close readers (and the batch stream) that have ``close()``; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._prefetcher is not None:
            self._prefetcher.close()
        for obj in [self.batches, *self.stateful_loaders]:
            close = getattr(obj, "close", None)
            if callable(close):
                close()

    def __enter__(self) -> "BagelExternalLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def __getattr__(name: str) -> Any:
    """Create the Bridge-dependent provider class on first use (importing Megatron-Bridge only then)."""
    if name == "BagelMegatronMIMODatasetProvider":
        from .providers import megatron_mimo_provider_class

        return megatron_mimo_provider_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
