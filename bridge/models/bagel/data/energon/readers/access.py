"""Random access to a converted dataset: the crude sample at a sample index, through Energon's savable loader.

Both orders read by index. :class:`DatasetAccess` opens one converted dataset with Energon as a training dataset read
whole (one rank, no workers, no shuffle buffer), with a task encoder whose only cooker hands the crude sample through
unchanged (``decoder = None``: the parts stay the bytes on disk), and fetches sample ``i`` with the savable loader's
``restore_sample`` (Energon reads it through the shard's ``.tar.idx``). The cooking is the reader's.

On a tested Energon (``patches.active``) it is opened by ``patches.compact`` with the key from the wrapper chain;
elsewhere by Energon's own ``get_train_dataset``, the key taken from a sample the loader yields (``patches``). Either
way every restored sample's own key is checked against the one asked for.
"""

from __future__ import annotations

import warnings
from typing import Any

import megatron.energon as energon
import torch
from megatron.energon import Cooker, DefaultTaskEncoder, WorkerConfig, get_savable_loader, reraise_exception

from .. import patches
from .workers import close_tar_files

__all__ = ["DatasetAccess"]

_PIN_MEMORY_WARNING = ".*pin_memory.*"


def _crude(sample: Any) -> Any:
    """The crude sample itself: cooking is the reader's."""
    return sample


_crude.__stateless__ = True  # what Energon's ``@stateless`` marks (no randomness)


class _CrudeEncoder(DefaultTaskEncoder):
    """Raw parts in, the crude sample out (every converted dataset is a ``CrudeWebdataset``)."""

    decoder = None
    cookers = [Cooker(_crude)]


class DatasetAccess:
    """The crude samples of one converted dataset (``path``) by sample index (0 .. ``num_samples`` - 1).

    ``patched``: use the patches (None: ``patches.active()``). Raises what Energon raises for a dataset it cannot
    open (``layout.damage.check_prepared`` names the common causes first, in the reader).
    """

    def __init__(self, path: str, *, patched: bool | None = None) -> None:
        self.path, self.patched = path, patches.active() if patched is None else bool(patched)
        wc = WorkerConfig(rank=0, world_size=1, num_workers=0, global_error_handler=reraise_exception)
        encoder, dataset = _CrudeEncoder(), None
        if self.patched:
            from ..patches.compact import open_dataset

            dataset = open_dataset(path, worker_config=wc, task_encoder=encoder)
        if dataset is None:
            dataset = energon.get_train_dataset(path, worker_config=wc, batch_size=None, shuffle_buffer_size=None,
                                                max_samples_per_sequence=None, repeat=False, task_encoder=encoder)
        self.loader = get_savable_loader(dataset, gc_collect_every_n_steps=0, watchdog_timeout_seconds=None)
        self._prefix: tuple | None = patches.restore_key_prefix(self.loader) if self.patched else None

    def _key_prefix(self) -> tuple:
        if self._prefix is None:  # public path: the key of a sample the loader yields, less its index
            # Energon's iteration draws from torch's global RNG; the caller's stream must not move (fork_rng)
            with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
                warnings.filterwarnings("ignore", message=_PIN_MEMORY_WARNING, category=UserWarning)
                it = iter(self.loader)
                try:
                    key = tuple(next(it)["__restore_key__"])
                finally:
                    close = getattr(it, "close", None)
                    if callable(close):
                        close()
            if len(key) < 2 or key[-2] != "Webdataset" or not isinstance(key[-1], int):
                raise RuntimeError(f"Energon {energon.__version__}: restore keys of {self.path} look like {key!r}, not "
                                   "(..., 'Webdataset', index): this Energon's random access is not supported")
            self._prefix = key[:-1]
        return self._prefix

    def crude(self, index: int) -> Any:
        """The crude sample at ``index``: Energon's dict of the raw parts (bytes) plus ``__key__``,
        ``__restore_key__``, ``__sources__`` (dataset and shard file), ``__subflavors__``."""
        key = (*self._key_prefix(), int(index))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_PIN_MEMORY_WARNING, category=UserWarning)
            sample = self.loader.restore_sample(key)
        if tuple(sample["__restore_key__"]) != key:
            raise RuntimeError(f"Energon {energon.__version__} restored sample {index} of {self.path} under key "
                               f"{tuple(sample['__restore_key__'])!r}, expected {key!r}: the readers do not know this "
                               "Energon version's restore keys")
        return sample

    def close_files(self) -> None:
        """Close the shard and index files Energon holds open (they reopen on the next read): after reading in a
        process whose worker processes fork later, so they never share a file offset (``workers.close_tar_files``)."""
        close_tar_files(self.loader)
