"""The reference model's configuration (the job's ``model:`` section): presets, the CPU trainer's optimizer knobs.

``model.name`` selects the model: ``null`` (default) keeps the job data-only (the pipeline measured alone),
``bagel-tiny`` is the CPU-sized reference model the tests and the demo train, ``bagel-7b`` has BAGEL-7B's
decoder shapes (Qwen2-7B: official ``Qwen2Config`` of ``ByteDance-Seed/BAGEL-7B-MoT``) for the GPU path. Any
field set explicitly (``model.hidden_size=128``) wins over the preset.

What the presets do not reproduce (this is a data-contract consumer, not BAGEL): no SigLIP ViT (a linear
connector embeds the 14×14×3 = 588-value patches), no VAE (a fixed patchify + frozen linear projection of the
pixels stands in for the FLUX VAE encoder, see ``model.VaeEncoderStandIn``), no mixture-of-transformers (one
set of decoder weights for understanding and generation tokens; BAGEL-MoT duplicates QKV/MLP/norms for the
generation tokens).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..data.config import ConfigError

__all__ = ["ATTENTION_KERNELS", "PRESETS", "BagelModelConfig", "OptimizerConfig"]

#: ``model.attention``: ``auto`` = FlexAttention with the batch's BlockMask on CUDA, per-document SDPA elsewhere;
#: ``flex`` = FlexAttention everywhere (forward only on CPU: torch has no FlexAttention backward there);
#: ``sdpa`` = per-document ``scaled_dot_product_attention`` with a boolean mask everywhere.
ATTENTION_KERNELS = ("auto", "flex", "sdpa")

#: Decoder / stand-in shapes per preset. ``bagel-7b``: Qwen2-7B (BAGEL-7B-MoT's ``llm_config``): 28 layers,
#: hidden 3584, 28 query heads in 4 KV groups (head dim 128), SwiGLU FFN 18944, vocab 152064, RoPE base 1e6,
#: RMSNorm eps 1e-6, QKV bias, untied output layer; ViT input 588 (SigLIP so400m patch 14); latent patch
#: 2×2×16 = 64 (FLUX VAE: 16 channels, 8× downsample; BAGEL ``latent_patch_size`` 2), ViT table side 70.
PRESETS: dict[str, dict[str, Any]] = {
    "bagel-tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                       tie_embeddings=True),
    "bagel-7b": dict(num_layers=28, hidden_size=3584, num_attention_heads=28, num_query_groups=4,
                     ffn_hidden_size=18944, vocab_size=152064, tie_embeddings=False),
}


@dataclass
class OptimizerConfig:
    """AdamW of the job's own trainer (``model.optimizer``): constant learning rate, global-norm clipping.

    Under Megatron-Bridge's ``pretrain()`` the recipe's ``OptimizerConfig`` / scheduler are used instead.
    """

    lr: float = 1e-3
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0          # max global L2 norm of the gradients; 0 = no clipping

    def problems(self) -> list[str]:
        out = []
        if not self.lr > 0:
            out.append(f"model.optimizer.lr: must be > 0, got {self.lr!r}")
        if self.weight_decay < 0 or self.clip_grad < 0:
            out.append("model.optimizer.weight_decay / clip_grad: must be >= 0")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            out.append("model.optimizer.adam_beta1 / adam_beta2: must be in [0, 1)")
        return out


@dataclass
class BagelModelConfig:
    """The ``model:`` section. Fields left ``None`` come from the preset ``name`` (``resolved()``)."""

    name: str | None = None                 # null = data-only job; "bagel-tiny" | "bagel-7b"
    num_layers: int | None = None
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_query_groups: int | None = None     # KV heads (grouped-query attention)
    ffn_hidden_size: int | None = None      # SwiGLU inner size
    vocab_size: int | None = None           # None: the tokenizer's length with BAGEL's special tokens, padded to 128
    tie_embeddings: bool | None = None      # output layer shares the input embedding's weight
    rotary_base: float = 1_000_000.0
    layernorm_epsilon: float = 1e-6
    vit_patch_dim: int = 588                # 14 x 14 x 3 values per ViT patch (``packed_vit_tokens``' last dim)
    max_num_patch_per_side: int = 70        # ViT 2D position table side (``packed_vit_position_ids`` < 70²)
    vae_pixels_per_token: int = 16          # pixels per latent token side: 8x VAE downsample x 2x2 latent patchify
    latent_patch_dim: int = 64              # values per latent token: 2 x 2 x 16 VAE channels
    max_latent_size: int | None = None      # latent 2D position table side; None: data.packer.max_latent_size
    timestep_shift: float = 1.0             # BAGEL's t' = s t / (1 + (s - 1) t)
    ce_weight: float = 1.0
    mse_weight: float = 1.0
    attention: str = "auto"                 # see ATTENTION_KERNELS
    seed: int = 1234                        # initialisation (identical on every rank) and the noise streams
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)

    @property
    def enabled(self) -> bool:
        """Whether the job trains a model (``name`` set and not ``"none"``)."""
        return self.name not in (None, "", "none", "null")

    def resolved(self, *, vocab_size: int | None = None, max_latent_size: int | None = None) -> "BagelModelConfig":
        """A copy with the preset's values in the fields left ``None`` and the data-side sizes filled in.

        ``vocab_size``: the tokenizer's length (padded up to a multiple of 128 here, Megatron's
        ``make_vocab_size_divisible_by``); ``max_latent_size``: ``data.packer.max_latent_size``. Raises
        ``ConfigError`` (every problem, keys named) for an unknown preset or invalid values.
        """
        if not self.enabled:
            raise ConfigError("model.name: no model selected (data-only job); set model.name to one of "
                              f"{sorted(PRESETS)}")
        if self.name not in PRESETS:
            raise ConfigError(f"model.name: unknown model {self.name!r}; expected one of {sorted(PRESETS)} "
                              "(or null for a data-only job)")
        values = {k: v for k, v in PRESETS[self.name].items() if getattr(self, k) is None}
        if self.vocab_size is None and "vocab_size" not in values:
            if vocab_size is None:
                raise ConfigError("model.vocab_size: not set and no tokenizer length given")
            values["vocab_size"] = -(-int(vocab_size) // 128) * 128
        if self.max_latent_size is None:
            if max_latent_size is None:
                raise ConfigError("model.max_latent_size: not set and no data.packer.max_latent_size given")
            values["max_latent_size"] = int(max_latent_size)
        out = dataclasses.replace(self, **values)
        problems = out.problems(vocab_size)
        if problems:
            raise ConfigError.of(problems, header=f"model: {len(problems)} invalid keys")
        return out

    def problems(self, tokenizer_length: int | None = None) -> list[str]:
        """Every invalid value of a resolved config, one line each (empty = valid)."""
        out = []
        for key in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                    "vocab_size", "vit_patch_dim", "max_num_patch_per_side", "vae_pixels_per_token",
                    "latent_patch_dim", "max_latent_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                out.append(f"model.{key}: must be a positive integer, got {value!r}")
        if not out:
            if self.hidden_size % self.num_attention_heads:
                out.append(f"model.hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                           f"{self.num_attention_heads}")
            elif (self.hidden_size // self.num_attention_heads) % 2:
                out.append("model: the head dimension hidden_size / num_attention_heads must be even (RoPE)")
            if self.num_attention_heads % self.num_query_groups:
                out.append(f"model.num_attention_heads {self.num_attention_heads} is not divisible by "
                           f"num_query_groups {self.num_query_groups}")
            if self.hidden_size % 4:
                out.append("model.hidden_size must be divisible by 4 (2D sin-cos position tables)")
            if tokenizer_length is not None and self.vocab_size < tokenizer_length:
                out.append(f"model.vocab_size {self.vocab_size} is smaller than the tokenizer's {tokenizer_length} "
                           "tokens (BAGEL's special tokens included)")
        if self.attention not in ATTENTION_KERNELS:
            out.append(f"model.attention: expected one of {ATTENTION_KERNELS}, got {self.attention!r}")
        if self.timestep_shift <= 0:
            out.append(f"model.timestep_shift: must be > 0, got {self.timestep_shift!r}")
        if self.ce_weight < 0 or self.mse_weight < 0 or self.ce_weight + self.mse_weight == 0:
            out.append("model.ce_weight / mse_weight: must be >= 0 and not both 0")
        return out + self.optimizer.problems()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def identity(self) -> dict[str, Any]:
        """What a checkpoint of this model must agree on to be restored (everything but the optimizer knobs)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("optimizer", "attention")}
