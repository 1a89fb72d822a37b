"""BAGEL's per-split attention inside Megatron-Core's transformer layers: a custom core-attention module.

Megatron-Core builds a layer's attention from a ``ModuleSpec``; ``SelfAttentionSubmodules.core_attention`` is
its extension point for the kernel that maps (query, key, value, mask) to the context. ``bagel_layer_spec()``
is Megatron-Core's own local GPT layer (``get_gpt_layer_local_spec``: QKV / output projections, RMSNorm, SwiGLU
MLP, residuals, RoPE application) with that one submodule replaced by ``BagelCoreAttention``.

The ``attention_mask`` argument that Megatron-Core threads through ``TransformerBlock`` → ``TransformerLayer`` →
``SelfAttention`` → core attention is a ``PackedAttention`` built once per batch by ``packed_attention``:

* **flex** (CUDA, flex batches): FlexAttention with the batch's ``BlockMask`` (``data/attention.py``: official
  ``create_sparse_mask`` semantics) over the padded ``max_num_tokens`` sequence; q/k/v are zero-padded from
  ``sequence_length`` to the mask length and the pad rows dropped afterwards (official ``qwen2_navit.py``).
* **sdpa** (CPU, or dense batches): ``scaled_dot_product_attention`` per packed sample (document) with its
  boolean mask: the official ``nested_attention_masks`` in dense mode, or the same rule evaluated from the flex
  metadata (``data.attention.mask_rule``) in flex mode. Work and memory are Σ n_i² over the samples, not L².

Which Megatron-Core parts need CUDA, and why this module exists: the local spec's ``DotProductAttention``
allocates its score buffer with ``parallel_state.get_global_memory_buffer()`` on ``torch.cuda.current_device()``
and forks the CUDA RNG tracker; ``TEDotProductAttention`` needs Transformer Engine; ``RotaryEmbedding.forward``
moves its frequencies to CUDA (``model.py`` uses its ``get_freqs_non_repeated`` instead); the pipeline
schedules (``forward_backward_no_pipelining``) allocate their token counter on CUDA. FlexAttention has no
backward on CPU (torch raises), hence per-document SDPA there: the same mask, evaluated densely per sample.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ..data.attention import block_mask, flex_metadata, mask_rule
from ..data.config import ConfigError

__all__ = ["BagelCoreAttention", "PackedAttention", "bagel_layer_spec", "choose_kernel", "packed_attention"]


@dataclass(frozen=True)
class PackedAttention:
    """The attention of one packed sequence, as every layer's core attention needs it.

    ``length``: S, the real tokens (rows of the hidden states, ``sequence_length``).
    ``documents``: ``(start, end)`` of every packed sample in token units; they tile ``[0, S)`` in order.
    ``masks``: per document, a bool ``[n_i, n_i]`` tensor (True = may attend; rows are queries), for ``sdpa``.
    ``block_mask``: FlexAttention ``BlockMask`` over ``max_num_tokens`` tokens (S plus the pad), for ``flex``.
    Exactly one of ``masks`` / ``block_mask`` is set.
    """

    length: int
    documents: tuple[tuple[int, int], ...]
    masks: tuple[torch.Tensor, ...] | None = None
    block_mask: BlockMask | None = None

    @property
    def kernel(self) -> str:
        return "flex" if self.block_mask is not None else "sdpa"


def choose_kernel(requested: str, device: torch.device, *, flex_batch: bool) -> str:
    """``model.attention`` → the kernel for this batch: ``auto`` is ``flex`` on CUDA for flex batches, else
    ``sdpa``. ``flex`` on a dense batch raises ``ConfigError`` (no flex metadata to build a BlockMask from)."""
    if requested == "auto":
        return "flex" if device.type == "cuda" and flex_batch else "sdpa"
    if requested == "flex" and not flex_batch:
        raise ConfigError("model.attention=flex needs flex batches (data.packer.use_flex: true); dense batches carry "
                          "nested_attention_masks: use model.attention=auto or sdpa")
    if requested not in ("flex", "sdpa"):
        raise ConfigError(f"model.attention: expected auto, flex or sdpa, got {requested!r}")
    return requested


def packed_attention(batch: Mapping[str, Any], device: torch.device | str, kernel: str = "auto") -> PackedAttention:
    """Build the ``PackedAttention`` of one packed batch (flex or dense) on ``device``.

    Flex batches: ``sample_lens`` / ``split_lens`` / ``attn_modes`` (pad entries included) are validated by
    ``data.attention.flex_metadata`` (``ValueError`` for a pack the official packer got wrong). Dense batches:
    the per-sample additive ``nested_attention_masks`` (0.0 = attend, -inf = blocked) become bool masks.
    """
    device = torch.device(device)
    flex_batch = "split_lens" in batch
    kernel = choose_kernel(kernel, device, flex_batch=flex_batch)
    length = int(batch["sequence_length"])
    lens = [int(n) for n in batch["sample_lens"]]
    if flex_batch:
        lens = lens[:-1]  # the trailing pad document
    starts = [sum(lens[:i]) for i in range(len(lens))]
    documents = tuple((s, s + n) for s, n in zip(starts, lens))
    if sum(lens) != length:
        raise ValueError(f"sample_lens {lens} sum to {sum(lens)}, sequence_length is {length}")
    if not flex_batch:
        masks = tuple((m == 0).to(device) for m in batch["nested_attention_masks"])
        if [tuple(m.shape) for m in masks] != [(n, n) for n in lens]:
            raise ValueError("nested_attention_masks shapes do not match sample_lens")
        return PackedAttention(length, documents, masks=masks)
    meta = flex_metadata(batch, device)
    if kernel == "flex":
        return PackedAttention(length, documents, block_mask=block_mask(meta))
    masks = []
    for start, end in documents:
        idx = torch.arange(start, end, device=device)
        masks.append(mask_rule(meta.document_id, meta.full_id, meta.noise_id, idx[:, None], idx[None, :]))
    return PackedAttention(length, documents, masks=tuple(masks))


@functools.cache
def _compiled_flex() -> Any:
    return torch.compile(flex_attention, dynamic=False)


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask, scale: float) -> torch.Tensor:
    fn = _compiled_flex() if q.is_cuda else flex_attention
    return fn(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)


class BagelCoreAttention(torch.nn.Module):
    """Core attention for Megatron-Core's ``SelfAttention`` (the ``core_attention`` submodule of a layer spec).

    Constructed by Megatron-Core with the ``CoreAttentionBuilder`` keywords; holds no parameters. ``forward``
    takes query ``[s, 1, n_q, d]`` and key / value ``[s, 1, n_kv, d]`` (sbhd, Megatron's layout, grouped-query
    heads not yet repeated) and the batch's ``PackedAttention`` as ``attention_mask``; returns the context
    ``[s, 1, n_q · d]`` in the input dtype. Tensor parallelism: heads are per partition already (any TP size);
    context parallelism and Megatron's ``PackedSeqParams`` (THD) are not supported (``ValueError``).
    """

    def __init__(self, *, config: Any, layer_number: int, attn_mask_type: Any = None, attention_type: str = "self",
                 cp_comm_type: str | None = None, softmax_scale: float | None = None, pg_collection: Any = None,
                 **_: Any) -> None:
        super().__init__()
        if getattr(config, "context_parallel_size", 1) != 1:
            raise ValueError("BagelCoreAttention: context parallelism is not supported (context_parallel_size must "
                             "be 1)")
        head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim ** -0.5
        self.layer_number = layer_number

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: PackedAttention,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        if not isinstance(attention_mask, PackedAttention):
            raise TypeError(f"BagelCoreAttention expects the batch's PackedAttention as attention_mask, got "
                            f"{type(attention_mask).__name__} (build it with model.attention.packed_attention)")
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("BagelCoreAttention: packed_seq_params / attention_bias are not supported")
        s, b, n_q, d = query.shape
        if b != 1 or s != attention_mask.length:
            raise ValueError(f"BagelCoreAttention: expected one packed sequence of {attention_mask.length} tokens "
                             f"([s, 1, heads, dim]), got query {tuple(query.shape)}")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [1, heads, s, d]
        if attention_mask.block_mask is not None:
            total = attention_mask.block_mask.seq_lengths[0]
            q, k, v = (F.pad(t, (0, 0, 0, total - s)) for t in (q, k, v))
            out = _flex(q, k, v, attention_mask.block_mask, self.softmax_scale)[:, :, :s]
        else:
            parts = [F.scaled_dot_product_attention(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], attn_mask=m,
                                                    scale=self.softmax_scale, enable_gqa=True)
                     for (a, e), m in zip(attention_mask.documents, attention_mask.masks)]
            out = torch.cat(parts, dim=2)
        return out.permute(2, 0, 1, 3).reshape(s, b, n_q * d)


def bagel_layer_spec() -> Any:
    """Megatron-Core's local GPT layer spec (RMSNorm, SwiGLU MLP, QKV bias per the config) with
    ``BagelCoreAttention`` as the self-attention's core attention: Qwen2's layer, BAGEL's attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = BagelCoreAttention
    return spec
