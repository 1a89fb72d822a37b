"""Megatron-facing stage: RNG-isolated packer iterator and the exact-resume external loader.

Megatron's ``dataloader_type="external"`` hands the object returned by ``build_datasets`` straight to
``RerunDataIterator``: no sampler, no collation, no workers, no fast-forward. Everything that makes a
resumed run continue bit-identically is therefore done here:

* ``BagelRNGIterator`` gives the packer private Python/NumPy/torch-CPU RNG streams, initialised exactly
  as the official one-worker torch DataLoader would, swapped in around every ``next()`` and saved.
* ``BagelExternalLoader`` is the iterator Megatron receives; its ``save_state()``/``restore_state()``
  (the names Bridge's ``maybe_save/load_dataloader_state`` call) capture the per-group readers, the
  packer and the RNG streams, plus a fingerprint that refuses a resume under a changed configuration.

``BagelMegatronMIMODatasetProvider`` needs Megatron-Bridge; it is created on first access (module
``__getattr__``) by ``_bridge``, so this module imports without Bridge or Transformer Engine.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

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


def _reject_collate(_: Any) -> Any:
    """Collate guard for ``get_collate_fn()``: packed batches are complete and must never be collated."""
    raise RuntimeError(
        "BAGEL packed batches must not be collated again: use dataloader_type='external' so Megatron "
        "passes the BagelExternalLoader through unchanged"
    )


# -- RNG state conversion (live form <-> plain restricted form) ----------------------------------------


def _python_to_plain(state: tuple) -> list:
    version, internal, gauss = state
    return [int(version), [int(x) for x in internal], gauss]


def _python_from_plain(value: Any) -> tuple:
    if not (isinstance(value, (list, tuple)) and len(value) == 3 and isinstance(value[1], (list, tuple))
            and len(value[1]) == 625):
        raise StateError("BagelRNGIterator: python_rng must be [version, 625 ints, gauss]")
    return (int(value[0]), tuple(int(x) for x in value[1]), value[2])


def _numpy_to_plain(state: tuple) -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = state
    return {"bit_generator": str(name), "keys": [int(k) for k in np.asarray(keys).tolist()], "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def _numpy_from_plain(value: Any) -> tuple:
    need = ("bit_generator", "keys", "pos", "has_gauss", "cached_gaussian")
    if not isinstance(value, dict) or any(k not in value for k in need) or len(value["keys"]) != 624:
        raise StateError(f"BagelRNGIterator: numpy_rng must be a dict with {list(need)} and 624 keys")
    keys = np.asarray(value["keys"], dtype=np.uint32)
    return (value["bit_generator"], keys, int(value["pos"]), int(value["has_gauss"]), float(value["cached_gaussian"]))


def _torch_from_plain(value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise StateError("BagelRNGIterator: torch_rng must be a 1-D uint8 tensor (torch.get_rng_state())")
    return value.detach().clone()


def initial_worker_rng_states(rank_seed: int) -> tuple[tuple, tuple, torch.Tensor]:
    """(python, numpy, torch) RNG states of worker 0 of a torch DataLoader whose generator is seeded ``rank_seed``.

    Mirrors ``torch.utils.data``: the iterator draws ``base_seed`` as one int64 ``random_`` from the loader's
    generator; worker 0 then seeds ``random``/torch with ``base_seed + 0`` and NumPy with
    ``_generate_state(base_seed, 0)``. Computed on private generators: the process RNG is not touched.
    """
    from torch.utils.data._utils.worker import _generate_state

    generator = torch.Generator()
    generator.manual_seed(int(rank_seed))
    base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
    seed = base_seed + 0
    py_state = random.Random(seed).getstate()
    np_state = np.random.RandomState(_generate_state(base_seed, 0)).get_state()
    torch_gen = torch.Generator()
    torch_gen.manual_seed(seed)
    return py_state, np_state, torch_gen.get_state()


class _ProcessRNG:
    """Context manager: install given RNG states into the process globals, capture the advanced ones, put back."""

    def __init__(self, owner: "BagelRNGIterator", capture: bool = True) -> None:
        self.owner = owner
        self.capture = capture

    def __enter__(self) -> None:
        self.saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        try:
            random.setstate(self.owner._python)
            np.random.set_state(self.owner._numpy)
            torch.set_rng_state(self.owner._torch)
        except BaseException:
            self._restore()
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            if self.capture:
                self.owner._python = random.getstate()
                self.owner._numpy = np.random.get_state()
                self.owner._torch = torch.get_rng_state()
        finally:
            self._restore()

    def _restore(self) -> None:
        random.setstate(self.saved[0])
        np.random.set_state(self.saved[1])
        torch.set_rng_state(self.saved[2])


class BagelRNGIterator(Savable):
    """Runs the wrapped iterator (the packer) with private, saved Python/NumPy/torch-CPU RNG streams.

    The official loader draws packer randomness in a DataLoader worker; here the same initial streams are
    derived from ``rank_seed`` and swapped into the process globals only while the packer runs, so model
    code and data code never disturb each other and a resume continues the exact stream.
    """

    _savable_fields = ("python_rng", "numpy_rng", "torch_rng")

    def __init__(self, iterator: Iterator[Any], rank_seed: int) -> None:
        self.inner = iterator
        self.rank_seed = int(rank_seed)
        self.reset_state()

    def reset_state(self) -> None:
        self._python, self._numpy, self._torch = initial_worker_rng_states(self.rank_seed)

    # Declared fields map onto the live states; the plain forms are what gets saved.
    @property
    def python_rng(self) -> list:
        return _python_to_plain(self._python)

    @python_rng.setter
    def python_rng(self, value: tuple) -> None:
        self._python = value

    @property
    def numpy_rng(self) -> dict[str, Any]:
        return _numpy_to_plain(self._numpy)

    @numpy_rng.setter
    def numpy_rng(self, value: tuple) -> None:
        self._numpy = value

    @property
    def torch_rng(self) -> torch.Tensor:
        return self._torch.clone()

    @torch_rng.setter
    def torch_rng(self, value: torch.Tensor) -> None:
        self._torch = value

    def _load_field(self, name: str, value: Any) -> Any:
        convert = {"python_rng": _python_from_plain, "numpy_rng": _numpy_from_plain, "torch_rng": _torch_from_plain}
        return convert[name](value)

    def __iter__(self) -> "BagelRNGIterator":
        return self

    def __next__(self) -> Any:
        with _ProcessRNG(self):
            return next(self.inner)

    def state_dict(self) -> dict[str, Any]:
        """``inner`` (the wrapped iterator's state, taken with the private RNG installed) + the three RNG states.

        Side-effect free: whatever the inner ``state_dict()`` does to the RNG is discarded.
        """
        with _ProcessRNG(self, capture=False):
            inner = self.inner.state_dict()
        return {"inner": inner, **super().state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the wrapped iterator and the private RNG streams; the process RNG is left unchanged."""
        if not isinstance(state, dict) or "inner" not in state:
            raise StateError(f"BagelRNGIterator: state must be a dict with key 'inner', got {type(state).__name__}"
                             + (f" with keys {sorted(state)}" if isinstance(state, dict) else ""))
        super().load_state_dict({k: v for k, v in state.items() if k != "inner"})
        with _ProcessRNG(self):
            self.inner.load_state_dict(state["inner"])

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if callable(close):
            close()


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
                 fingerprint: Mapping[str, Any] | None = None) -> None:
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

    def __next__(self) -> dict[str, Any]:
        if self._closed:
            raise RuntimeError("BagelExternalLoader: next() after close()")
        try:
            batch = next(self.batches)
        except StopIteration:
            logger.error("BagelExternalLoader: the batch stream ended after %d batches (Megatron expects an "
                         "endless stream; check the readers' cycling)", self.position)
            raise
        self.position += 1
        return batch

    def __len__(self) -> int:
        return self.length

    def save_state(self) -> dict[str, Any]:
        """State describing the next batch this loader will yield (readers, packer + RNG, position, fingerprint).

        Checked against Megatron's restricted unpickler types here, so a bad state fails at save, not at resume.
        """
        if not hasattr(self.batches, "state_dict"):
            raise RuntimeError(f"BagelExternalLoader.save_state: the batch stream ({type(self.batches).__name__}) "
                               "has no state_dict(); wrap the packer in BagelRNGIterator")
        state = {
            "version": STATE_VERSION,
            "fingerprint": self.fingerprint(),
            "position": self.position,
            "packer": self.batches.state_dict(),
            "loaders": [_reader_save(r) for r in self.stateful_loaders],
        }
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
        if self.position:
            logger.warning("BagelExternalLoader.restore_state after %d batches were already taken", self.position)
        for reader, reader_state in zip(self.stateful_loaders, loaders):
            _reader_restore(reader, reader_state)
        self.batches.load_state_dict(state["packer"])
        super().load_state_dict({"position": state["position"]})
        logger.info("BagelExternalLoader: restored at batch %d", self.position)

    def close(self) -> None:
        """Close readers (and the batch stream) that have ``close()``; idempotent."""
        if self._closed:
            return
        self._closed = True
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
        from ._bridge import megatron_mimo_provider_class

        return megatron_mimo_provider_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
