"""``BagelModel``: a BAGEL-shaped Megatron-Core model that consumes one packed batch and returns its two losses.

Mirrors the data flow of the official ``Bagel.forward`` (``modeling/bagel/bagel.py``) in this package's own
code, with stand-ins for the vision towers:

1. **Sequence assembly.** An ``[S, H]`` hidden sequence (S = ``sequence_length``) is filled at three disjoint
   index sets that tile ``[0, S)``: text embeddings (``packed_text_ids``, Megatron-Core ``VocabParallelEmbedding``)
   at ``packed_text_indexes``; ViT patches (``packed_vit_tokens`` [T_vit, 588], a linear connector, plus a fixed
   2D sin-cos table row ``packed_vit_position_ids``) at ``packed_vit_token_indexes``; VAE latents at
   ``packed_vae_token_indexes``.
2. **VAE latents (stand-in).** ``padded_images`` are pixels in [-1, 1]. ``VaeEncoderStandIn`` replaces the
   FLUX VAE encoder + 2×2 latent patchify: it cuts each image to its ``patchified_vae_latent_shapes`` (h, w)
   grid of 16×16-pixel patches (``data.transforms.patchify``, row-major) and applies a frozen random linear map
   768 → 64, giving x0 [T_vae, 64] in ``packed_vae_token_indexes`` order. Diffusion as BAGEL: ``t =
   sigmoid(packed_timesteps)`` (-inf → 0, a clean latent), shifted by ``timestep_shift``; ``x_t = (1 - t) x0 + t
   ε``; token embedding ``vae2llm(x_t) + timestep_embedder(t) + latent_pos_table[packed_latent_position_ids]``.
   ε ~ N(0, 1) comes from a generator seeded by the batch (``noise_seed``), never from the trainer's RNG, so
   a re-run or a restart draws the same noise.
3. **Decoder.** Megatron-Core ``TransformerBlock`` of ``bagel_layer_spec()`` layers (Qwen2's layer, BAGEL's
   per-split attention through ``BagelCoreAttention``), RoPE from Megatron-Core's ``RotaryEmbedding``
   frequencies at ``packed_position_ids`` (one id per text token, one per image, restarting per sample).
4. **Losses** (float32): CE of the output layer's logits at ``ce_loss_indexes`` against ``packed_label_ids``,
   weighted by ``ce_loss_weights``: Σ w·ce / Σ w; MSE of ``llm2vae(h)`` at ``mse_loss_indexes`` against the
   velocity target ε − x0 of the noised tokens (``isfinite(packed_timesteps)``, the same order), averaged
   over tokens and the 64 values. Official BAGEL divides by DP-global token / weight totals (all-reduced); with
   Megatron's per-micro-batch loss contract this model uses the micro-batch's own totals instead.

Shapes: ``forward`` returns ``torch.stack([ce, mse])``, float32 ``[2]``; a batch without CE (MSE) targets gives
0 for that entry (kept in the graph). One packed sequence per micro-batch (batch dimension 1), TP = PP = CP = 1.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from ..data.transforms import patchify
from .attention import PackedAttention, bagel_layer_spec
from .config import BagelModelConfig

__all__ = ["BagelModel", "TimestepEmbedder", "VaeEncoderStandIn", "build_model", "decoder_fields", "noise_seed",
           "sincos_2d_table", "transformer_config"]


def transformer_config(cfg: BagelModelConfig, *, cpu: bool = True, bf16: bool = False) -> Any:
    """Megatron-Core ``TransformerConfig`` of the decoder (Qwen2 layer: RMSNorm, SwiGLU, QKV bias, no other bias).

    ``cpu``: initialise parameters on the CPU (``use_cpu_initialization``) and switch off the fusions that need
    CUDA kernels (bias-dropout-add, RoPE, masked softmax, gradient-accumulation fusion). Dropout is 0 (BAGEL
    trains without it; any dropout would draw from the trainer's RNG and break exact resume).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**decoder_fields(cfg, cpu=cpu, bf16=bf16))


def decoder_fields(cfg: BagelModelConfig, *, cpu: bool, bf16: bool = False) -> dict[str, Any]:
    """The ``TransformerConfig`` fields of ``transformer_config`` (shared with the Megatron-Bridge provider)."""
    return dict(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups, ffn_hidden_size=cfg.ffn_hidden_size, kv_channels=cfg.head_dim,
        normalization="RMSNorm", layernorm_epsilon=cfg.layernorm_epsilon, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=True, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, use_cpu_initialization=cpu,
        params_dtype=torch.bfloat16 if bf16 else torch.float32, bf16=bf16)


def sincos_2d_table(side: int, dim: int) -> torch.Tensor:
    """Fixed 2D sin-cos position table, float32 ``[side², dim]``; row ``r·side + c`` encodes grid cell (r, c)
    (the flattened ids of ``packed_vit_position_ids`` / ``packed_latent_position_ids``). Half of ``dim`` encodes
    the row, half the column, each as [sin, cos] of ``dim / 4`` frequencies 10000^(-k / (dim / 4))."""
    if dim % 4:
        raise ValueError(f"sincos_2d_table: dim {dim} must be divisible by 4")
    quarter = dim // 4
    omega = 1.0 / (10000.0 ** (torch.arange(quarter, dtype=torch.float64) / quarter))
    grid = torch.arange(side, dtype=torch.float64)
    rows, cols = torch.meshgrid(grid, grid, indexing="ij")

    def encode(pos: torch.Tensor) -> torch.Tensor:
        angles = pos.reshape(-1, 1) * omega
        return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)

    return torch.cat([encode(rows), encode(cols)], dim=1).float()


class TimestepEmbedder(torch.nn.Module):
    """Diffusion timestep t ∈ [0, 1] → ``[T, hidden]``: 256 sinusoidal features of 1000·t, then Linear-SiLU-Linear
    (the DiT-style embedder BAGEL adds to every VAE token)."""

    def __init__(self, hidden: int, frequencies: int = 256) -> None:
        super().__init__()
        self.frequencies = frequencies
        self.mlp = torch.nn.Sequential(torch.nn.Linear(frequencies, hidden), torch.nn.SiLU(),
                                       torch.nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.frequencies // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        angles = (1000.0 * t.float())[:, None] * freqs[None]
        features = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
        return self.mlp(features.to(self.mlp[0].weight.dtype))


class VaeEncoderStandIn(torch.nn.Module):
    """Stand-in for BAGEL's VAE encoder + latent patchify: pixels → one ``latent_dim`` vector per latent token.

    Not a VAE: a fixed 16×16-pixel patchify (``data.transforms.patchify``: row-major grid, (row, col, channel)
    inside a patch) and a frozen Gaussian projection ``p·p·3 → latent_dim`` (a buffer from ``seed``, scaled by
    1/√(p·p·3)), so x0 has BAGEL's latent-token count and size (h·w tokens of 2×2×16 = 64 values) and depends on
    every pixel the batch ships. ``forward(padded_images [N, 3, Hmax, Wmax], shapes [(h, w)] * N)`` →
    ``[Σ h·w, latent_dim]`` (image-major, row-major: the order of ``packed_vae_token_indexes``).
    """

    def __init__(self, pixels_per_token: int, latent_dim: int, seed: int) -> None:
        super().__init__()
        self.p = pixels_per_token
        fan_in = pixels_per_token * pixels_per_token * 3
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("projection", torch.randn(fan_in, latent_dim, generator=g) / math.sqrt(fan_in))

    def forward(self, padded_images: torch.Tensor, shapes: list[tuple[int, int]]) -> torch.Tensor:
        p = self.p
        if len(shapes) != len(padded_images):
            raise ValueError(f"{len(padded_images)} padded_images but {len(shapes)} latent shapes")
        patches = []
        for image, (h, w) in zip(padded_images, shapes):
            if h * p > image.shape[-2] or w * p > image.shape[-1]:
                raise ValueError(f"latent shape {(h, w)} x {p} px exceeds the padded image {tuple(image.shape)}")
            patches.append(patchify(image[:, :h * p, :w * p], p))
        return torch.cat(patches).to(self.projection.dtype) @ self.projection


def noise_seed(batch: Mapping[str, Any], seed: int) -> int:
    """The seed of a batch's diffusion noise: sha256 of (``seed``, ``sequence_length``, ``batch_data_indexes``).

    A function of the batch's identity (which samples, from where) and the model seed, so the same batch draws the
    same ε in a re-run, after a restart or under another trainer; the trainer's torch RNG is never touched.
    """
    identity = json.dumps([int(seed), int(batch["sequence_length"]), batch.get("batch_data_indexes", [])],
                          sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(identity.encode()).digest()[:8], "little") & (2 ** 63 - 1)


class BagelModel(MegatronModule):
    """The reference BAGEL-shaped model (module docstring). ``config``: the decoder's Megatron-Core
    ``TransformerConfig`` (``transformer_config(cfg)``, or a Megatron-Bridge provider, which is one);
    ``cfg``: the resolved ``BagelModelConfig``. Parameters are initialised from the global torch RNG: seed it
    (``build_model`` does) so every rank builds the same model."""

    def __init__(self, config: Any, cfg: BagelModelConfig) -> None:
        super().__init__(config=config)
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
        from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding
        from megatron.core.transformer.transformer_block import TransformerBlock

        self.cfg = cfg
        hidden = cfg.hidden_size
        self.embedding = VocabParallelEmbedding(cfg.vocab_size, hidden, init_method=config.init_method, config=config)
        self.vit_connector = torch.nn.Linear(cfg.vit_patch_dim, hidden)
        self.vae_encoder = VaeEncoderStandIn(cfg.vae_pixels_per_token, cfg.latent_patch_dim, cfg.seed)
        self.vae2llm = torch.nn.Linear(cfg.latent_patch_dim, hidden)
        self.llm2vae = torch.nn.Linear(hidden, cfg.latent_patch_dim)
        self.time_embedder = TimestepEmbedder(hidden)
        self.register_buffer("vit_pos_table", sincos_2d_table(cfg.max_num_patch_per_side, hidden), persistent=False)
        self.register_buffer("latent_pos_table", sincos_2d_table(cfg.max_latent_size, hidden), persistent=False)
        self.rotary = RotaryEmbedding(kv_channels=cfg.head_dim, rotary_percent=1.0, rotary_base=int(cfg.rotary_base),
                                      use_cpu_initialization=True)
        self.decoder = TransformerBlock(config, bagel_layer_spec(), post_process=True)
        self.output_layer = ColumnParallelLinear(hidden, cfg.vocab_size, config=config, init_method=config.init_method,
                                                 bias=False, gather_output=True,
                                                 skip_weight_param_allocation=cfg.tie_embeddings)

    def set_input_tensor(self, input_tensor: Any) -> None:
        """Megatron's pipeline hook (called by its forward step); one stage only, so there is nothing to set."""
        if input_tensor is not None and not (isinstance(input_tensor, list) and all(t is None for t in input_tensor)):
            raise ValueError("BagelModel has no pipeline stages (pipeline_model_parallel_size must be 1)")

    def _rope(self, position_ids: torch.Tensor) -> torch.Tensor:
        """RoPE angles ``[S, 1, 1, head_dim]`` at ``packed_position_ids`` (Megatron-Core's frequencies; its
        ``forward`` would move them to CUDA)."""
        freqs = self.rotary.get_freqs_non_repeated(int(position_ids.max()) + 1).to(position_ids.device)[position_ids]
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]

    def _timesteps(self, raw: torch.Tensor) -> torch.Tensor:
        t = torch.sigmoid(raw.float())  # -inf -> 0: a clean latent
        s = self.cfg.timestep_shift
        return s * t / (1 + (s - 1) * t)

    def forward(self, batch: Mapping[str, Any], attention: PackedAttention, noise_seed: int) -> torch.Tensor:
        """One packed batch (its tensors on this model's device) → float32 ``[2]`` = (weighted CE, MSE).

        ``attention``: ``packed_attention(batch, device, cfg.attention)``; ``noise_seed``: ``noise_seed(batch,
        cfg.seed)``. Raises ``ValueError`` when the index sets do not tile the sequence or the VAE counts disagree.
        """
        dtype = self.vae2llm.weight.dtype
        device = self.vae2llm.weight.device
        length = int(batch["sequence_length"])
        parts = [(batch["packed_text_indexes"], self.embedding(batch["packed_text_ids"]).to(dtype))]
        if "packed_vit_tokens" in batch:
            vit = self.vit_connector(batch["packed_vit_tokens"].to(dtype))
            vit = vit + self.vit_pos_table[batch["packed_vit_position_ids"]]
            parts.append((batch["packed_vit_token_indexes"], vit))
        target = None
        if "padded_images" in batch:
            x0 = self.vae_encoder(batch["padded_images"], batch["patchified_vae_latent_shapes"]).float()
            raw = batch["packed_timesteps"]
            if x0.shape[0] != raw.shape[0]:
                raise ValueError(f"{x0.shape[0]} latent tokens from patchified_vae_latent_shapes but "
                                 f"{raw.shape[0]} packed_timesteps")
            t = self._timesteps(raw)[:, None]
            g = torch.Generator(device=device).manual_seed(noise_seed)
            eps = torch.randn(x0.shape, generator=g, device=device, dtype=torch.float32)
            x_t = (1 - t) * x0 + t * eps
            vae = (self.vae2llm(x_t.to(dtype)) + self.time_embedder(t[:, 0]).to(dtype)
                   + self.latent_pos_table[batch["packed_latent_position_ids"]])
            parts.append((batch["packed_vae_token_indexes"], vae))
            target = (eps - x0)[torch.isfinite(raw)]
        indexes = torch.cat([i for i, _ in parts])
        if indexes.numel() != length or not torch.equal(torch.sort(indexes).values,
                                                          torch.arange(length, device=indexes.device)):
            raise ValueError(f"packed_text/vit/vae indexes ({indexes.numel()} positions) do not tile the "
                             f"{length} packed positions exactly once (sequence_length)")
        hidden = torch.zeros(length, self.cfg.hidden_size, dtype=dtype, device=device)
        hidden = hidden.index_copy(0, indexes, torch.cat([e for _, e in parts]))
        out = self.decoder(hidden[:, None, :], attention, rotary_pos_emb=self._rope(batch["packed_position_ids"]))
        out = out[:, 0, :]  # [S, H], after the final RMSNorm
        zero = out.sum() * 0.0  # a missing loss keeps every parameter in the graph (no unused-gradient holes)
        ce = mse = zero
        if "ce_loss_indexes" in batch and len(batch["ce_loss_indexes"]):
            weight = self.embedding.weight if self.cfg.tie_embeddings else None
            logits, _ = self.output_layer(out[batch["ce_loss_indexes"]], weight=weight)
            per_token = F.cross_entropy(logits.float(), batch["packed_label_ids"], reduction="none")
            w = batch["ce_loss_weights"].float()
            ce = (per_token * w).sum() / w.sum() + zero
        if target is not None and len(batch["mse_loss_indexes"]):
            if target.shape[0] != len(batch["mse_loss_indexes"]):
                raise ValueError(f"{target.shape[0]} noised VAE tokens but {len(batch['mse_loss_indexes'])} "
                                 "mse_loss_indexes")
            prediction = self.llm2vae(out[batch["mse_loss_indexes"]]).float()
            mse = F.mse_loss(prediction, target) + zero
        return torch.stack([ce, mse])


def build_model(cfg: BagelModelConfig, device: torch.device | str = "cpu") -> BagelModel:
    """A ``BagelModel`` of the resolved ``cfg`` on ``device``, initialised from ``cfg.seed`` (the same parameters
    on every rank and in every run); the global torch RNG is left as it was."""
    device = torch.device(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = BagelModel(transformer_config(cfg, cpu=device.type == "cpu"), cfg)
    return model.to(device)
