"""The Megatron-Bridge dataset providers for BAGEL (created lazily: importing them needs Megatron-Bridge).

* ``BagelMegatronMIMODatasetProvider`` (the seed name, exported by ``external``): a
  ``MegatronMIMODatasetProvider`` that hands an already built ``BagelExternalLoader`` (or any loader of
  ready batches) to Bridge's external-loader path.
* ``BagelDatasetProvider``: a plain ``DatasetProvider`` that builds this rank's loader from a
  ``BagelDataConfig`` and the build context's DP group, for Bridge's standard ``pretrain()`` path.

Both are ``dataloader_type="external"`` (Bridge passes the loader through ``RerunDataIterator`` unchanged)
and their ``get_collate_fn()`` is a guard that raises. Validation: with ``data.valid`` (``BagelDatasetProvider``)
or a ``valid_loader`` (MIMO) the valid split is a ``pipeline.valid.BagelValidLoader``, which restarts itself after
each evaluation's micro-batches, so the one iterator Bridge keeps yields the same batches at every evaluation. No
test split: the third element is always None. ``seq_length`` (read by Bridge's training loop and
throughput logging) comes from the packer's ``max_num_tokens``; a different explicit value is refused. Both
classes are created on first access (module ``__getattr__``), so this module imports without Bridge.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

from ._bridge import import_bridge

__all__ = ["BagelDatasetProvider", "BagelMegatronMIMODatasetProvider", "check_seq_length", "dataset_provider_class",
           "megatron_mimo_provider_class", "reject_collate"]

logger = logging.getLogger(__name__)


def reject_collate(_: Any) -> Any:
    """Collate guard for ``get_collate_fn()``: packed batches are complete and must never be collated."""
    raise RuntimeError(
        "BAGEL packed batches must not be collated again: use dataloader_type='external' so Megatron "
        "passes the BagelExternalLoader through unchanged"
    )


def check_seq_length(explicit: int | None, packed: int, where: str) -> int:
    """The provider's ``seq_length``: the packed sequence length, or ``explicit`` when it agrees.

    Raises ``ValueError`` when an explicit value differs from the packer's ``max_num_tokens``
    (Bridge would otherwise size buffers and throughput for a sequence length the batches never have).
    """
    if explicit is not None and int(explicit) != int(packed):
        raise ValueError(f"{where}: seq_length={explicit} but the loader packs sequences of max_num_tokens={packed}; "
                         "leave seq_length unset (it is taken from the loader) or make them agree")
    return int(packed)


@functools.cache
def _log_unknown_seq_length(loader: str) -> None:
    logger.warning("BagelMegatronMIMODatasetProvider: the train loader (%s) does not know its packed sequence "
                   "length, so seq_length stays unset; MIMO training reads cfg.dataset.seq_length: set it there "
                   "(or pass seq_length=)", loader)


@dataclasses.dataclass(kw_only=True)
class _ExternalLoaderFields:
    """The Bridge data-loader fields both providers fix: the loader object itself, never collated or re-worked."""

    seq_length: int | None = None
    dataloader_type: str | None = "external"
    num_workers: int = 0
    persistent_workers: bool = False
    pin_memory: bool = False

    def get_collate_fn(self) -> Any:
        """A guard that raises: Megatron requires the method but never collates external batches."""
        return reject_collate


@functools.cache
def megatron_mimo_provider_class() -> type:
    """``BagelMegatronMIMODatasetProvider``: a MegatronMIMO dataset provider handing out a live loader."""
    @dataclasses.dataclass(kw_only=True)
    class BagelMegatronMIMODatasetProvider(_ExternalLoaderFields, import_bridge().MegatronMIMODatasetProvider):
        """MIMO dataset provider for an already built loader (``dataloader_type="external"``).

        ``train_loader``: a ``BagelExternalLoader`` or any iterator of ready batches. ``seq_length`` defaults
        to the loader's packed sequence length (the packer's ``max_num_tokens``); an explicit value that
        differs raises ``ValueError``. A loader that does not know its length leaves ``seq_length`` as given
        (possibly None; logged once): MIMO training reads ``cfg.dataset.seq_length``, so set it there.
        """

        train_loader: Any
        #: Optional: the validation stream, an iterator that yields the same batches at every evaluation by
        #: itself (``build.build_bagel_valid_loader`` makes one: a ``BagelValidLoader`` restarting after each
        #: evaluation's micro-batches). None = no validation split.
        valid_loader: Any = None

        def __post_init__(self) -> None:
            packed = getattr(self.train_loader, "seq_length", None)
            if packed is not None:
                self.seq_length = check_seq_length(self.seq_length, packed, "BagelMegatronMIMODatasetProvider")
            elif self.seq_length is None:
                _log_unknown_seq_length(type(self.train_loader).__name__)
            valid_packed = getattr(self.valid_loader, "seq_length", None)
            if valid_packed is not None and self.seq_length is not None:
                check_seq_length(self.seq_length, valid_packed, "BagelMegatronMIMODatasetProvider (valid_loader)")

        def build_datasets(self, context: Any) -> tuple[Any, Any, None]:
            """(the train loader, or None when no training samples are requested; the valid loader, or None when
            none was given or no validation samples are requested; no test split)."""
            train = self.train_loader if context.train_samples > 0 else None
            valid = self.valid_loader if getattr(context, "valid_samples", 0) > 0 else None
            return train, valid, None

    BagelMegatronMIMODatasetProvider.__module__ = "bridge.models.bagel.data.external"
    BagelMegatronMIMODatasetProvider.__qualname__ = "BagelMegatronMIMODatasetProvider"
    return BagelMegatronMIMODatasetProvider


@functools.cache
def dataset_provider_class() -> type:
    """``BagelDatasetProvider``: a plain Bridge ``DatasetProvider`` building the loader for ``pretrain()``."""
    from .build import build_bagel_train_loader, build_bagel_valid_loader, dp_rank_size
    from .config import BagelDataConfig, validate_data
    from .pipeline.loader import BagelExternalLoader
    from .pipeline.valid import BagelValidLoader
    from .tokenizer import load_tokenizer

    @dataclasses.dataclass(kw_only=True)
    class BagelDatasetProvider(_ExternalLoaderFields, import_bridge().DatasetProvider):
        """Builds this rank's ``BagelExternalLoader`` from ``data`` (DP rank/size from ``context.pg_collection``).

        ``tokenizer`` is the HF tokenizer used for the BAGEL text (Bridge's own tokenizer in the context is a
        Megatron wrapper and is not used). ``seq_length`` = ``data.packer.max_num_tokens`` (an explicit value
        that differs raises ``ValueError``).

        Validation: with ``data.valid`` set and validation samples requested, the valid split is this rank's
        ``BagelValidLoader`` (``build.build_bagel_valid_loader``), restarting after ``valid_batches_per_eval``
        micro-batches. None derives it from the build context: Bridge sets ``test_samples`` to one evaluation's
        samples (``validation.eval_iters × eval_global_batch_size``), i.e. ``test_samples / DP`` micro-batches of
        one packed sequence per rank. No test split.
        """

        data: BagelDataConfig
        tokenizer: Any = None
        valid_batches_per_eval: int | None = None

        def __post_init__(self) -> None:
            self.seq_length = check_seq_length(self.seq_length, self.data.packer.max_num_tokens,
                                               "BagelDatasetProvider")

        def build_datasets(self, context: Any) -> tuple[BagelExternalLoader | None, BagelValidLoader | None, None]:
            """(this rank's loader, or None when no training samples are requested; the validation stream, or
            None without ``data.valid`` or validation samples; no test). The configuration is validated once,
            validation groups included."""
            if context.train_samples <= 0:
                return None, None, None
            tokenizer = self.tokenizer if self.tokenizer is not None else load_tokenizer(self.data.tokenizer)
            data = validate_data(self.data)
            train = build_bagel_train_loader(data, tokenizer, context)
            valid = None
            if data.has_valid and getattr(context, "valid_samples", 0) > 0:
                per_eval = self.valid_batches_per_eval
                if per_eval is None:
                    _, dp_size = dp_rank_size(context)
                    per_eval = int(getattr(context, "test_samples", 0) or 0) // dp_size
                if per_eval > 0:
                    valid = build_bagel_valid_loader(data, tokenizer, context, batches_per_eval=per_eval)
            return train, valid, None

    BagelDatasetProvider.__module__ = "bridge.models.bagel.data.providers"
    BagelDatasetProvider.__qualname__ = "BagelDatasetProvider"
    return BagelDatasetProvider


def __getattr__(name: str) -> Any:
    """Create the Bridge-dependent provider classes on first use (importing Megatron-Bridge only then)."""
    if name == "BagelMegatronMIMODatasetProvider":
        return megatron_mimo_provider_class()
    if name == "BagelDatasetProvider":
        return dataset_provider_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
