"""The seed contract: the names a Megatron user imports, wired by hand or through the builder.

* ``BagelRNGIterator(iterator, rank_seed)`` (module ``rng``) gives the packer private Python/NumPy/torch-CPU
  RNG streams, initialised exactly as the official one-worker torch DataLoader would, swapped in around every
  ``next()`` and saved.
* ``BagelExternalLoader(batches, *, length, stateful_loaders=())`` (module ``loader``) is the iterator Megatron
  receives (``dataloader_type="external"``), with ``save_state()`` / ``restore_state()`` for Bridge's
  checkpointing; ``stateful_loaders`` may be Energon's own ``get_savable_loader(...)`` loaders.
* ``BagelMegatronMIMODatasetProvider(train_loader=...)`` (module ``providers``) hands that loader to Bridge's
  MIMO path; its ``get_collate_fn()`` is ``_reject_collate``. It needs Megatron-Bridge, so it is created on
  first access (module ``__getattr__``) and this module imports without Bridge or Transformer Engine.

Nothing is defined here: the stages live in their own modules and this module only re-exports them.
"""

from __future__ import annotations

from typing import Any

from .pipeline.loader import STATE_VERSION, BagelExternalLoader
from .state import ResumeMismatchError, energon_state_classes, fingerprint_diff
from .providers import megatron_mimo_provider_class, reject_collate as _reject_collate
from .pipeline.rng import BagelRNGIterator, initial_worker_rng_states

__all__ = ["BagelExternalLoader", "BagelMegatronMIMODatasetProvider", "BagelRNGIterator", "ResumeMismatchError",
           "STATE_VERSION", "energon_state_classes", "fingerprint_diff", "initial_worker_rng_states"]


def __getattr__(name: str) -> Any:
    """Create the Bridge-dependent provider class on first use (importing Megatron-Bridge only then)."""
    if name == "BagelMegatronMIMODatasetProvider":
        return megatron_mimo_provider_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
