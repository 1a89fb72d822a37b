"""``BagelRNGIterator``: runs the packer on private Python / NumPy / torch-CPU RNG streams.

The official loader draws all packer randomness inside its single DataLoader worker. Here the same initial
streams are derived from ``rank_seed`` exactly as that worker would get them, swapped into the process
globals only while the packer runs, and saved with the loader state, so model-side RNG use and data-side RNG
use never disturb each other and a resumed run continues the exact stream. NumPy's stream is data RNG too: the
official order's video frame sampler draws the frame count and the permutation fallback from it
(``energon.cooking.video``), so it is isolated, saved and restored with the Python and torch streams.
"""

from __future__ import annotations

import contextlib
import numbers
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ..state import ResizeContext, Stage, StateError, check_fields, load_nested, save_value

__all__ = ["BagelRNGIterator", "elastic_rank_seed", "initial_worker_rng_states"]

_NUMPY_FIELDS = ("bit_generator", "keys", "pos", "has_gauss", "cached_gaussian")
#: What ``torch.Generator.manual_seed`` takes (an int64 or a uint64).
_SEED_RANGE = (-(2**63), 2**64)


def _to_plain(python: tuple, numpy_: tuple, torch_: torch.Tensor) -> dict[str, Any]:
    """The three live streams in plain forms (Python: ``[version, 625 ints, gauss]``; NumPy: a dict with 624 keys;
    torch: the 1-D uint8 ``get_rng_state()`` tensor)."""
    name, keys, pos, has_gauss, cached = numpy_
    return {"python_rng": [int(python[0]), [int(x) for x in python[1]], python[2]],
            "numpy_rng": {"bit_generator": str(name), "keys": [int(k) for k in np.asarray(keys).tolist()],
                          "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "torch_rng": torch_}


def _from_plain(state: dict[str, Any]) -> tuple[tuple, tuple, torch.Tensor]:
    """The live streams of ``_to_plain`` output; ``StateError`` naming a malformed one."""
    py, npy, th = state["python_rng"], state["numpy_rng"], state["torch_rng"]
    if not (isinstance(py, (list, tuple)) and len(py) == 3 and isinstance(py[1], (list, tuple)) and len(py[1]) == 625):
        raise StateError("BagelRNGIterator: python_rng must be [version, 625 ints, gauss]")
    if not isinstance(npy, dict) or any(k not in npy for k in _NUMPY_FIELDS) or len(npy["keys"]) != 624:
        raise StateError(f"BagelRNGIterator: numpy_rng must be a dict with {list(_NUMPY_FIELDS)} and 624 keys")
    if not isinstance(th, torch.Tensor) or th.dtype != torch.uint8 or th.dim() != 1:
        raise StateError("BagelRNGIterator: torch_rng must be a 1-D uint8 tensor (torch.get_rng_state())")
    return ((int(py[0]), tuple(int(x) for x in py[1]), py[2]),
            (npy["bit_generator"], np.asarray(npy["keys"], dtype=np.uint32), int(npy["pos"]), int(npy["has_gauss"]),
             float(npy["cached_gaussian"])), th.detach().clone())


def _checked_seed(rank_seed: Any) -> int:
    """``rank_seed`` as an int, refused at construction (not at the first batch) when it is not an integer
    (``"42"``, ``1.5``; an integral float is taken) or outside what torch seeds with."""
    integral = isinstance(rank_seed, numbers.Integral) or (isinstance(rank_seed, float) and rank_seed.is_integer())
    if isinstance(rank_seed, bool) or not integral:
        raise TypeError(f"BagelRNGIterator: rank_seed must be an integer, got {rank_seed!r} "
                        f"({type(rank_seed).__name__})")
    seed = int(rank_seed)
    if not _SEED_RANGE[0] <= seed < _SEED_RANGE[1]:
        raise ValueError(f"BagelRNGIterator: rank_seed {seed} is outside [-2**63, 2**64), the seeds torch takes")
    return seed


def initial_worker_rng_states(rank_seed: int, worker_id: int = 0) -> tuple[tuple, tuple, torch.Tensor]:
    """(python, numpy, torch) RNG states of worker ``worker_id`` of a torch DataLoader seeded ``rank_seed``.

    Mirrors ``torch.utils.data`` (``_BaseDataLoaderIter.__init__`` + ``_worker_loop``): the iterator draws
    ``base_seed`` as one int64 ``random_`` from the (``torch.manual_seed(rank_seed)``-seeded) generator; worker
    w then seeds ``random``/torch with ``base_seed + w`` and NumPy with ``_generate_state(base_seed, w)``.
    Computed on private generators: the process RNG is not touched.
    """
    from torch.utils.data._utils.worker import _generate_state

    generator = torch.Generator()
    generator.manual_seed(int(rank_seed))
    base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
    seed = base_seed + int(worker_id)
    py_state = random.Random(seed).getstate()
    np_state = np.random.RandomState(_generate_state(base_seed, int(worker_id))).get_state()
    torch_gen = torch.Generator()
    torch_gen.manual_seed(seed)
    return py_state, np_state, torch_gen.get_state()


def elastic_rank_seed(seed: int, dp_rank: int, generation: int = 0) -> int:
    """Seed of DP rank ``dp_rank``'s data RNG in the elastic order, resize ``generation`` (0: the first run):
    independent of the DP size, different for every (rank, generation)."""
    return int(np.random.SeedSequence([int(seed) & (2**63 - 1), int(dp_rank), int(generation)]).generate_state(
        1, dtype=np.uint64)[0] >> 1)


@contextlib.contextmanager
def _process_rng_kept() -> Iterator[None]:
    """Whatever runs inside leaves the process-global Python / NumPy / torch-CPU RNG as it found it."""
    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


class BagelRNGIterator(Stage):
    """Runs ``source`` (the packer) with private, saved Python/NumPy/torch-CPU RNG streams (module docstring).

    State: the three streams (plain, restricted-unpickler-safe forms) and the source's own state."""

    _savable_fields = ("python_rng", "numpy_rng", "torch_rng", "source")

    def __init__(self, iterator: Iterator[Any], rank_seed: int, *, worker_id: int = 0) -> None:
        self.source = iterator
        self.rank_seed = _checked_seed(rank_seed)
        self.worker_id = int(worker_id)
        self.reset_state()

    def reset_state(self) -> None:
        self._python, self._numpy, self._torch = initial_worker_rng_states(self.rank_seed, self.worker_id)

    def identity(self) -> dict[str, Any]:
        # worker_id only when set (the emulated official workers)
        return {"rank_seed": self.rank_seed, **({"worker_id": self.worker_id} if self.worker_id else {})}

    def state_dict(self) -> dict[str, Any]:
        """The three streams in plain forms (``_to_plain``) and the source's tagged state. Saving the source neither
        uses nor disturbs any RNG stream."""
        with _process_rng_kept():
            return {**_to_plain(self._python, self._numpy, self._torch.clone()),
                    "source": save_value(self.source, "BagelRNGIterator.source")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the streams (checked: ``StateError`` for a malformed one) and the source."""
        check_fields(self, state)
        streams = _from_plain(state)
        with _process_rng_kept():
            load_nested(self.source, state["source"], "BagelRNGIterator.source")
        self._python, self._numpy, self._torch = streams

    def resize_state(self, olds: list[dict[str, Any]], ctx: ResizeContext, **kw: Any) -> dict[str, Any]:
        """A new rank's state after a resize: fresh streams seeded ``elastic_rank_seed(ctx.seed, ctx.dp_rank,
        ctx.generation)`` (never reusing an old rank's), and the source's resized state."""
        streams = initial_worker_rng_states(elastic_rank_seed(ctx.seed, ctx.dp_rank, ctx.generation))
        return {**_to_plain(*streams), "source": ctx.resize(self.source, [old["source"] for old in olds])}

    def __next__(self) -> Any:
        with _process_rng_kept():
            random.setstate(self._python)
            np.random.set_state(self._numpy)
            torch.set_rng_state(self._torch)
            try:
                return next(self.source)
            finally:
                self._python, self._numpy, self._torch = random.getstate(), np.random.get_state(), torch.get_rng_state()
