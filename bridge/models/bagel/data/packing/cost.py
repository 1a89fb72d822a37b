"""What one pack costs to train on: the compute model shared by the balanced packer, the job's straggler
telemetry and ``bagel-data stats`` (one function, :meth:`CostModel.cost`).

A pack's compute is a linear function of five additive counts, its :class:`Work`:

* ``tokens``: LLM sequence positions (the pack's real tokens, ``sequence_length``);
* ``attn_pairs``: (query, key) pairs the LLM attention mask lets through, per sample from its split layout
  (spec §7, ``attention.mask_rule``): a query attends every earlier key of its sample except those of
  another ``noise`` split, plus (``full`` / ``noise`` split) every key of its own split. For split ``i`` of a
  sample, at offset ``c_i``, of ``s_i`` tokens, with ``n_i`` tokens of noise splits before it:
  ``s_i * (c_i - n_i) + (s_i * (s_i + 1) / 2 if causal else s_i ** 2)``;
* ``vit_tokens`` / ``vit_pairs``: ViT patch tokens and the sum of ``n ** 2`` over ViT images (SigLIP attends
  within each image, ``vit_token_seqlens``);
* ``vae_tokens``: latent tokens of the VAE images (what the VAE encoder produces).

:meth:`CostModel.cost` weighs them with FLOPs per unit derived from the model's dimensions
(``config.CostConfig``: Megatron's names; 2 FLOPs per multiply-add; training = forward + backward = 3x forward
for the LLM and the ViT, the frozen VAE encoder forward only). With ``h`` hidden size, ``L`` layers, ``d = h /
heads`` the head dim, ``g`` query groups (KV heads), ``f`` the FFN size:

* per token, per layer, forward: Q and O projections ``4 h^2``, K and V ``4 h g d``, SwiGLU MLP (gate, up,
  down) ``6 h f``; so ``token_flops = 3 L (4 h^2 + 4 h g d + 6 h f)``;
* per (query, key) pair, per layer, forward: ``Q K^T`` and ``P V`` over all heads, ``2 h + 2 h = 4 h`` (GQA
  shares K/V heads but not this math); so ``pair_flops = 3 L 4 h``;
* ViT (MHA, GELU MLP of two matrices; hidden ``hv``, FFN ``fv``, ``Lv`` layers): ``vit_token_flops = 3 Lv
  (8 hv^2 + 4 hv fv)``, ``vit_pair_flops = 3 Lv 4 hv``;
* ``vae_token_flops = vae_flops_per_token`` (as given; 0 = not counted).

BAGEL-7B (the defaults): Qwen2-7B, ``h = 3584, L = 28, 28 heads (d = 128), g = 4, f = 18944``: per layer
``4 * 3584^2 = 51,380,224``, ``4 * 3584 * 4 * 128 = 7,340,032``, ``6 * 3584 * 18944 = 407,371,776``, together
466,092,032; x 28 layers = 13.05 GFLOPs per token forward, ``token_flops`` = 39.15 GFLOPs (about 6x the 6.5 B
non-embedding parameters, as expected). ``pair_flops = 3 * 28 * 4 * 3584`` = 1,204,224. So attention equals the
linear work of a causal sample at ``n ~ 2 token_flops / pair_flops = 65,000`` tokens, of a bidirectional
split at 32,500: at 16K tokens a causal sample's attention adds 25 % to its cost, a 1.6K one 2.5 %. SigLIP-so400m
/14 as BAGEL runs it (26 of 27 layers, ``vit_select_layer = -2``; ``hv = 1152``, ``fv = 4304``): 0.79 GFLOPs
per ViT token forward, ``vit_token_flops`` = 2.38 GFLOPs, ``vit_pair_flops`` = 359,424.

Left out (each below ~3 % of a pack, and mostly the same share in every pack): norms, biases, softmax,
RoPE, the ViT patch embedding and the ViT->LLM connector (34 MFLOPs per ViT token), the LM head (2 h x vocab =
1.09 GFLOPs per token, run only at CE positions), the flex pad document (FlexAttention runs the pad's causal
block too: at most ``(max_num_tokens - sequence_length)^2 / 2`` pairs), FlexAttention's 128-token tiles (partial
tiles on block diagonals add about 64 pairs per token, < 0.3 % of ``token_flops``), FlashAttention's
backward recomputation (backward ~2.5x forward for attention instead of 2x). It is a model of FLOPs, not of
time: attention and GEMMs run at different efficiencies on a GPU.

Pure Python (torch only for a dense-mode batch's masks, read by :func:`batch_work`).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..config.outcomes import Outcome, Text
from ..config.packer import CostConfig

__all__ = ["CostModel", "Work", "batch_work", "expected_work", "layout_work", "sample_work", "split_pairs",
           "splits_of_plan", "straggler_ratio"]


class Work(NamedTuple):
    """What a sample or a pack asks of the model; additive over samples (:meth:`plus`). Counts (ints), or
    expectations over a reader's random choices (floats, ``bagel-data stats``)."""

    tokens: float = 0
    attn_pairs: float = 0
    vit_tokens: float = 0
    vit_pairs: float = 0
    vae_tokens: float = 0

    def plus(self, other: "Work") -> "Work":
        """The work of both (field by field)."""
        return Work(*(a + b for a, b in zip(self, other)))

    def scaled(self, k: float) -> "Work":
        """``k`` times this work (expectations)."""
        return Work(*(k * a for a in self))


@dataclass(frozen=True)
class CostModel:
    """FLOPs per unit of :class:`Work` for one training step (forward + backward), from ``CostConfig``."""

    token_flops: float
    pair_flops: float
    vit_token_flops: float
    vit_pair_flops: float
    vae_token_flops: float

    @classmethod
    def of(cls, config: CostConfig | None = None) -> "CostModel":
        """The model of ``config`` (default: BAGEL-7B); the formulas are in the module docstring."""
        c = config if config is not None else CostConfig()
        h, layers, g = c.hidden_size, c.num_layers, c.num_query_groups
        d = h // c.num_attention_heads
        hv, fv, lv = c.vit_hidden_size, c.vit_ffn_hidden_size, c.vit_num_layers
        return cls(token_flops=3.0 * layers * (4 * h * h + 4 * h * g * d + 6 * h * c.ffn_hidden_size),
                   pair_flops=3.0 * layers * 4 * h,
                   vit_token_flops=3.0 * lv * (8 * hv * hv + 4 * hv * fv),
                   vit_pair_flops=3.0 * lv * 4 * hv,
                   vae_token_flops=float(c.vae_flops_per_token))

    def cost(self, work: Work) -> float:
        """FLOPs of one training step on ``work`` (a sample's or a pack's): THE cost of the package, used by
        the balanced packer, the job's straggler telemetry and ``bagel-data stats``."""
        return (self.token_flops * work.tokens + self.pair_flops * work.attn_pairs
                + self.vit_token_flops * work.vit_tokens + self.vit_pair_flops * work.vit_pairs
                + self.vae_token_flops * work.vae_tokens)


def split_pairs(split_lens: Iterable[int], attn_modes: Iterable[str]) -> int:
    """Attention (query, key) pairs of ONE sample laid out as ``split_lens`` / ``attn_modes`` (its splits in
    order; modes ``causal`` / ``full`` / ``noise``): the formula of the module docstring, which counts the
    pairs ``attention.mask_rule`` allows inside the sample."""
    pairs = offset = hidden = 0
    for n, mode in zip(split_lens, attn_modes):
        n = int(n)
        pairs += n * (offset - hidden) + (n * (n + 1) // 2 if mode == "causal" else n * n)
        offset += n
        if mode == "noise":
            hidden += n
    return pairs


def splits_of_plan(plan: Sequence[Mapping[str, Any]], item_tokens: Sequence[int]) -> tuple[list[int], list[str]]:
    """The split layout ``pack_sample`` gives a sample with no item CFG-dropped (spec §6.3).

    ``plan``: the ``sequence_plan`` items; ``item_tokens``: each item's tokens without its two special tokens
    (text: its ids; images: patch or latent tokens; floats for expectations). Text is ``causal``, a ViT image
    ``full``, a VAE image ``noise`` when it starts a split with ``loss == 1`` and no ``frame_delta``, else ``full``;
    ``split_start`` / ``split_end`` (default True) join consecutive items (video frames) into one split.
    """
    lens: list[int] = []
    modes: list[str] = []
    split_len, mode = 0, "causal"
    for item, n in zip(plan, item_tokens):
        if item.get("split_start", True):
            split_len = 0
            noise = item["type"] == "vae_image" and item.get("loss") == 1 and "frame_delta" not in item
            mode = "causal" if item["type"] == "text" else "noise" if noise else "full"
        split_len += n + 2
        if item.get("split_end", True):
            lens.append(split_len)
            modes.append(mode)
    return lens, modes


def sample_work(sample: Any, *, vit_patch_size: int, vae_image_downsample: int, dropped: int = 0) -> Work:
    """The work of one cooked sample (``sequence_plan``, ``text_ids_list``, ``image_tensor_list`` of (C, H, W)
    tensors) as ``SequenceBuilder.pack_sample`` lays it out when the CFG dropout drops the items ``dropped``
    names: bit ``k`` set = the ``k``-th item with ``enable_cfg == 1`` (plan order) is dropped (it still
    consumes its text or image). With ``dropped = 0`` its ``tokens`` are ``lengths.estimate`` of the sample,
    less the images no plan item uses (quirk §13.14: counted in ``num_tokens``, never packed)."""
    get = sample.get if isinstance(sample, dict) else lambda k: getattr(sample, k)
    plan, texts, images = get("sequence_plan"), get("text_ids_list"), get("image_tensor_list")
    kept: list[Mapping[str, Any]] = []
    sizes: list[int] = []
    text_i = image_i = cfg_k = 0
    for item in plan:
        if item["type"] == "text":
            n = len(texts[text_i])
            text_i += 1
        else:
            image = images[image_i]
            image_i += 1
            p = vit_patch_size if item["type"] == "vit_image" else vae_image_downsample
            n = (int(image.shape[-2]) // p) * (int(image.shape[-1]) // p)
        if item["enable_cfg"] == 1:
            cfg_k += 1
            if dropped >> (cfg_k - 1) & 1:
                continue
        kept.append(item)
        sizes.append(n)
    return layout_work(kept, sizes)


def layout_work(plan: Sequence[Mapping[str, Any]], item_tokens: Sequence[float]) -> Work:
    """The work of one sample laid out as ``plan`` (``sequence_plan`` items) with ``item_tokens`` per item (without
    the two special tokens; :func:`splits_of_plan`)."""
    lens, modes = splits_of_plan(plan, item_tokens)
    vit = [n for item, n in zip(plan, item_tokens) if item["type"] == "vit_image"]
    return Work(tokens=sum(lens), attn_pairs=split_pairs(lens, modes), vit_tokens=sum(vit),
                vit_pairs=sum(n * n for n in vit),
                vae_tokens=sum(n for item, n in zip(plan, item_tokens) if item["type"] == "vae_image"))


def expected_work(outcomes: Sequence[Outcome]) -> Work:
    """The expected work of a row over its layouts (``config.outcomes``; CFG dropout ignored): a text listing its
    alternatives (:class:`~..config.outcomes.Text` ``alts``) at each of them, equally likely, any other at its mean
    length."""
    out = Work()
    for o in outcomes:
        plan = [{"type": i.type, "loss": i.loss} for i in o.items]
        choice = next((k for k, i in enumerate(o.items) if isinstance(i.tokens, Text) and i.tokens.alts), None)
        alts = o.items[choice].tokens.alts if choice is not None else (None,)
        for alt in alts:
            tokens = [alt if k == choice else i.tokens.mean if isinstance(i.tokens, Text) else i.tokens
                      for k, i in enumerate(o.items)]
            out = out.plus(layout_work(plan, tokens).scaled(o.probability * (1 / len(alts))))
    return out


def straggler_ratio(step_max: Sequence[float], step_mean: Sequence[float]) -> tuple[float, float]:
    """(straggler ratio, lost share) of steps whose slowest rank did ``step_max[i]`` and whose mean rank
    ``step_mean[i]`` (FLOPs; a step lasts as long as its slowest rank): the mean over steps of max / mean (1.0 for
    a step without compute: nobody waits; 1.0 without steps) and ``sum(max - mean) / sum(max)`` (0.0 without
    compute). THE formula of the job's straggler line and of ``bagel-data stats``' prediction."""
    ratios = [mx / mean if mean > 0 else 1.0 for mx, mean in zip(step_max, step_mean)]
    lost = sum(mx - mean for mx, mean in zip(step_max, step_mean))
    total = sum(mx for mx, _ in zip(step_max, step_mean))
    return (statistics.fmean(ratios) if ratios else 1.0), (lost / total if total > 0 else 0.0)


def _dense_splits(mask: Any) -> tuple[list[int], list[str]]:
    """A split layout with the same attention pairs as one sample's dense additive mask (float [L, L], 0 =
    attend), read from O(L) entries: consecutive tokens that see each other (the first superdiagonal) form a
    ``full`` / ``noise`` split; such a split is ``noise`` when the token right after it cannot see its first
    token. The tokens in between become one ``causal`` split (adjacent causal splits cost the same as one)."""
    n = int(mask.shape[0])
    together = (mask.diagonal(1) == 0).tolist()
    splits: list[tuple[int, str]] = []
    start = i = 0
    while i < n:
        if i < n - 1 and together[i]:
            end = i + 1  # tokens i .. end - 1 form the split
            while end < n and together[end - 1]:
                end += 1
            if i > start:
                splits.append((i - start, "causal"))
            splits.append((end - i, "noise" if end < n and bool(mask[end, i] != 0) else "full"))
            start = i = end
        else:
            i += 1
    if n > start:
        splits.append((n - start, "causal"))
    return [length for length, _ in splits], [mode for _, mode in splits]


def batch_work(batch: Mapping[str, Any]) -> Work:
    """The work of a packed batch (flex or dense mode), real tokens only (the flex pad is not counted).

    Flex: the samples' splits from ``sample_lens`` / ``split_lens`` / ``attn_modes`` (pad entries dropped);
    dense: read back from ``nested_attention_masks`` (:func:`_dense_splits`, O(L) per sample). ViT from
    ``vit_token_seqlens``, VAE from ``patchified_vae_latent_shapes``. Raises ValueError when the flex splits do
    not tile the samples.
    """
    pairs = 0
    if "split_lens" in batch:
        sample_lens = [int(n) for n in batch["sample_lens"][:-1]]
        split_lens, modes = [int(n) for n in batch["split_lens"][:-1]], batch["attn_modes"][:-1]
        k = 0
        for length in sample_lens:
            j = k
            while length > 0 and j < len(split_lens):
                length -= split_lens[j]
                j += 1
            if length != 0:
                raise ValueError("batch_work: the flex split_lens do not tile sample_lens")
            pairs += split_pairs(split_lens[k:j], modes[k:j])
            k = j
        tokens = sum(sample_lens)
    else:
        tokens = 0
        for mask in batch["nested_attention_masks"]:
            lens, modes = _dense_splits(mask)
            pairs += split_pairs(lens, modes)
            tokens += sum(lens)
    seqlens = [int(n) for n in batch.get("vit_token_seqlens", ())]
    vae = sum(int(h) * int(w) for h, w in batch.get("patchified_vae_latent_shapes", ()))
    return Work(tokens=tokens, attn_pairs=pairs, vit_tokens=sum(seqlens), vit_pairs=sum(n * n for n in seqlens),
                vae_tokens=vae)
