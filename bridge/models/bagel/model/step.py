"""``get_batch`` / ``forward_step`` / ``loss_func`` in Megatron-Bridge's signatures, for ``BagelModel``.

``forward_step(data_iterator, model)`` is Bridge's two-argument forward step (``TwoArgForwardStep``): Bridge's
``pretrain()`` and Megatron-Core's schedules call it once per micro-batch with the external loader (wrapped in
``RerunDataIterator``) and the model chunk (possibly wrapped in DDP / ``Float16Module``); the job's own trainer
(``trainer.py``) calls the very same function. It returns ``(output_tensor, loss_func)``; ``loss_func(output)``
returns Megatron's two-tuple ``(loss, {"loss", "ce loss", "mse loss"})``: the schedule divides the loss by the
number of micro-batches (gradient accumulation averages), Bridge averages the reported values over them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..data.attention import to_device
from .attention import PackedAttention, packed_attention
from .config import BagelModelConfig
from .model import noise_seed

__all__ = ["BagelInputs", "forward_step", "get_batch", "loss_func", "model_config"]


@dataclass(frozen=True)
class BagelInputs:
    """What ``BagelModel.forward`` takes: the batch on the model's device, its attention, its noise seed."""

    batch: Mapping[str, Any]
    attention: PackedAttention
    noise_seed: int


def model_config(model: Any) -> BagelModelConfig:
    """The ``BagelModelConfig`` of a ``BagelModel``, however Bridge wrapped it (DDP, ``Float16Module``)."""
    from megatron.core.utils import get_attr_wrapped_model

    return get_attr_wrapped_model(model, "cfg")


def get_batch(data_iterator: Iterator[Mapping[str, Any]], cfg: BagelModelConfig,
              device: torch.device | str | None = None) -> BagelInputs:
    """Next packed batch → ``BagelInputs`` on ``device`` (default: CUDA when available, else CPU).

    Every tensor moves with ``data.attention.to_device`` (pinned, non-blocking on CUDA); the lists
    (``sample_lens``, ``split_lens``, ``attn_modes``, ``batch_data_indexes``) stay on the host. The attention is
    built here, once per micro-batch, for every layer (``packed_attention`` with ``cfg.attention``). Raises
    ``StopIteration`` when the loader is exhausted and ``ValueError`` for a malformed pack.
    """
    batch = next(data_iterator)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    on_device = to_device(batch, device)
    return BagelInputs(on_device, packed_attention(on_device, device, cfg.attention), noise_seed(batch, cfg.seed))


def loss_func(ce_weight: float, mse_weight: float, output_tensor: torch.Tensor
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``BagelModel``'s ``[ce, mse]`` → Megatron's two-tuple: the micro-batch loss ``ce_weight·ce + mse_weight·mse``
    (float32 scalar) and the values Bridge logs (detached)."""
    ce, mse = output_tensor[0], output_tensor[1]
    loss = ce_weight * ce + mse_weight * mse
    return loss, {"loss": loss.detach().clone(), "ce loss": ce.detach().clone(), "mse loss": mse.detach().clone()}


def forward_step(data_iterator: Iterator[Mapping[str, Any]], model: Any) -> tuple[torch.Tensor, functools.partial]:
    """Megatron-Bridge forward step: one packed micro-batch through ``model``; ``(output [2], loss_func)``."""
    cfg = model_config(model)
    device = next(model.parameters()).device
    inputs = get_batch(data_iterator, cfg, device)
    output = model(inputs.batch, inputs.attention, inputs.noise_seed)
    return output, functools.partial(loss_func, cfg.ce_weight, cfg.mse_weight)
