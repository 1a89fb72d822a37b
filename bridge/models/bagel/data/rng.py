"""``BagelRNGIterator``: runs the packer on private Python / NumPy / torch-CPU RNG streams.

The official loader draws all packer randomness inside its single DataLoader worker. Here the same initial
streams are derived from ``rank_seed`` exactly as that worker would get them, swapped into the process
globals only while the packer runs, and saved with the loader state, so model-side RNG use and data-side RNG
use never disturb each other and a resumed run continues the exact stream.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .state import Savable, StateError

__all__ = ["BagelRNGIterator", "initial_worker_rng_states"]

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

    @property
    def seq_length(self) -> int | None:
        """The wrapped iterator's packed sequence length (``max_num_tokens``), or None."""
        return getattr(self.inner, "seq_length", None)

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
