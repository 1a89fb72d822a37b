"""The reference model on real packed batches (demo data, real Energon readers, the real packer), on CPU.

One flex and one dense batch of the same pack go through ``BagelModel`` (Megatron-Core layers, BAGEL's per-split
attention as the core attention) forward and backward; the two attention paths give the same loss and gradients
(bit for bit on CPU: both evaluate the same mask, one from the flex metadata, one from the official dense masks);
FlexAttention itself (forward only on CPU) agrees with SDPA within 1e-5; a token moved to a wrong index changes
the loss; gradient accumulation equals averaging the micro-batch gradients (what DP does).
"""

from __future__ import annotations

import pytest
import torch

from _external_common import single_process_pg_collection
from _train_common import small_image_groups

from bridge.models.bagel.model.attention import BagelCoreAttention, PackedAttention, packed_attention
from bridge.models.bagel.model.config import BagelModelConfig
from bridge.models.bagel.model.model import build_model, noise_seed
from bridge.models.bagel.model.step import forward_step, get_batch, loss_func
from bridge.models.bagel.model.trainer import BagelTrainer

#: FlexAttention (eager, CPU, float32) vs per-document SDPA on the same mask: measured max |diff| ~1e-6 in the loss
FLEX_VS_SDPA_TOL = 1e-5
#: a misplaced token must move the fitted model's loss by more than this: 100x the ~1e-6 float-order noise of an
#: equivalent computation (FlexAttention vs SDPA above); measured 4e-3 .. 1.5e-2 on the demo packs
MOVED_TOKEN_MIN_CHANGE = 1e-4


@pytest.fixture(scope="module")
def megatron():
    """One-rank gloo world + Megatron-Core's model-parallel state (TP = PP = 1), torn down after the module."""
    from megatron.core import parallel_state

    pgs = single_process_pg_collection()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    yield pgs
    parallel_state.destroy_model_parallel()


def _loader(out, groups, tok, use_flex: bool):
    from bridge.models.bagel.data.build import build_bagel_train_loader
    from bridge.models.bagel.data.config import BagelDataConfig, PackerConfig

    cfg = BagelDataConfig(groups=str(groups), dataset_info=str(out / "dataset_info.yaml"), num_workers=0, seed=1,
                          packer=PackerConfig(expected_num_tokens=1536, max_num_tokens=2048,
                                              max_num_tokens_per_sample=1024, prefer_buffer_before=512,
                                              use_flex=use_flex, max_latent_size=64))
    return build_bagel_train_loader(cfg, tok, (0, 1), length=2)


@pytest.fixture(scope="module")
def batches(demo_setup, tmp_path_factory):
    """The first two packs of the demo data in flex mode and in dense mode (same seed: the same samples)."""
    out, tok = demo_setup
    groups = small_image_groups(out, tmp_path_factory.mktemp("model") / "groups.yaml")
    with _loader(out, groups, tok, True) as flex, _loader(out, groups, tok, False) as dense:
        pairs = [(next(flex), next(dense)) for _ in range(2)]
    for f, d in pairs:
        assert f["sequence_length"] == d["sequence_length"] and torch.equal(f["packed_text_ids"], d["packed_text_ids"])
    return pairs


@pytest.fixture(scope="module")
def cfg(demo_setup):
    from bridge.models.bagel.data.tokenizer import add_special_tokens

    return BagelModelConfig(name="bagel-tiny").resolved(vocab_size=len(add_special_tokens(demo_setup[1])[0]),
                                                         max_latent_size=64)


@pytest.fixture(scope="module")
def fitted(megatron, cfg, batches):
    """The tiny model after 20 optimizer steps on the first pack: at initialisation its logits barely depend on
    the input (output weights ~0.02), and after a few steps it has learnt little beyond token frequencies, so a
    misplaced token would move the loss by little more than float noise (a ViT patch: ~1e-5 after 6 steps)."""
    import dataclasses

    fit_cfg = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, lr=3e-2))
    trainer = BagelTrainer(fit_cfg, megatron)
    losses = [trainer.train_step([batches[0][0]], step=k)["loss"] for k in range(1, 21)]
    assert losses[-1] < losses[0] - 1.0, losses
    return trainer.model


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    output, fn = forward_step(iter([batch]), model)
    loss, report = fn(output)
    loss.backward()
    return output.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_batch_has_every_token_kind(batches):
    flex, dense = batches[0]
    for key in ("packed_vit_tokens", "padded_images", "ce_loss_indexes", "mse_loss_indexes"):
        assert key in flex and key in dense and len(flex[key]) > 0, key
    assert "split_lens" in flex and "nested_attention_masks" in dense


def test_megatron_layers_run_bagel_core_attention(megatron, cfg):
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.transformer_layer import TransformerLayer

    model = build_model(cfg)
    layers = model.decoder.layers
    assert len(layers) == cfg.num_layers and all(isinstance(layer, TransformerLayer) for layer in layers)
    assert all(isinstance(layer.self_attention, SelfAttention) for layer in layers)
    assert all(isinstance(layer.self_attention.core_attention, BagelCoreAttention) for layer in layers)
    again = build_model(cfg)  # every rank builds the same parameters from model.seed
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_flex_and_dense_batches_give_the_same_loss_and_gradients(megatron, cfg, batches):
    model = build_model(cfg)
    flex, dense = batches[0]
    out_f, grads_f = _loss_and_grads(model, flex)
    out_d, grads_d = _loss_and_grads(model, dense)
    assert out_f.dtype == torch.float32 and out_f.shape == (2,)
    assert bool(torch.isfinite(out_f).all()) and float(out_f[0]) > 0 and float(out_f[1]) > 0
    assert torch.equal(out_f, out_d), (out_f, out_d)  # the same mask, the same kernel: bit for bit on CPU
    assert grads_f.keys() == grads_d.keys() and all(torch.equal(grads_f[k], grads_d[k]) for k in grads_f)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert grads_f.keys() == trainable
    silent = [n for n, g in grads_f.items() if not bool(g.abs().sum() > 0)]
    assert not silent, f"parameters without gradient: {silent}"  # text, ViT, VAE, timestep paths all reached


def test_flex_attention_kernel_agrees_with_sdpa(megatron, cfg, batches):
    """FlexAttention with the batch's BlockMask over the padded sequence (forward only: no CPU backward in torch)."""
    import dataclasses

    model = build_model(cfg)
    flex = batches[0][0]
    with torch.no_grad():
        out_sdpa, _ = forward_step(iter([flex]), model)
        inputs = get_batch(iter([flex]), dataclasses.replace(cfg, attention="flex"), "cpu")
        assert inputs.attention.kernel == "flex" and inputs.attention.block_mask.seq_lengths[0] == sum(
            flex["sample_lens"])
        out_flex = model(inputs.batch, inputs.attention, inputs.noise_seed)
    assert torch.allclose(out_flex, out_sdpa, rtol=0, atol=FLEX_VS_SDPA_TOL), (out_flex, out_sdpa)


def _split_mode_at(batch, position: int) -> str:
    """The attention mode (``attn_modes``) of the split holding sequence ``position``."""
    ends = torch.cumsum(torch.tensor(batch["split_lens"]), 0)
    return batch["attn_modes"][int(torch.searchsorted(ends, position, right=True))]


def _move(batch, key: str, by: int):
    """One image's tokens of ``key``'s index set sit ``|by|`` positions too early (``by < 0``) or too late
    (``by > 0``); the ``|by|`` tokens they displace (other sets: the image's start or end token and the neighbouring
    split's token next to it) take the vacated positions at the image's other end, so the index sets still tile the
    sequence and the model accepts the batch.

    The image moved is the first whose neighbouring split on that side is causal text (what later text tokens, and
    so the CE loss, read); a ``noise`` split is seen by no later token and a ``full`` image split before an image
    is another image, so a move into those barely reaches the loss. Masks and RoPE ids belong to positions, so this
    puts one patch / latent into the neighbouring split and that split's token into the image's. Only such moves
    across a split boundary can change the loss: inside an image's split (start token, patches, end token) BAGEL's
    attention is bidirectional and every position has the same RoPE id, so a permutation there is, correctly,
    invisible (the 2D layout travels with each token in its own position id)."""
    b = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    ranked, order = torch.sort(b[key])
    breaks = [0, *((ranked[1:] != ranked[:-1] + 1).nonzero().flatten() + 1).tolist(), len(ranked)]
    runs = list(zip(breaks[:-1], breaks[1:]))

    def neighbour(lo: int, hi: int) -> int:  # a position of the split beyond the image's start / end token
        return int(ranked[lo]) - 2 if by < 0 else int(ranked[hi - 1]) + 2

    lo, hi = next(((lo, hi) for lo, hi in runs if _split_mode_at(b, neighbour(lo, hi)) == "causal"), runs[0])
    first, last = int(ranked[lo]), int(ranked[hi - 1])
    displaced = range(first + by, first) if by < 0 else range(last + 1, last + 1 + by)
    vacated = range(last + by + 1, last + 1) if by < 0 else range(first, first + by)
    for src, dst in zip(displaced, vacated):
        for other in ("packed_text_indexes", "packed_vit_token_indexes", "packed_vae_token_indexes"):
            hit = (b[other] == src).nonzero() if other != key else []
            if len(hit):
                b[other][hit[0, 0]] = dst
    b[key][order[lo:hi]] += by
    return b


@pytest.mark.parametrize("key", ["packed_vit_token_indexes", "packed_vae_token_indexes", "ce_loss_indexes",
                                 "mse_loss_indexes"])
def test_a_token_at_a_wrong_index_changes_the_loss(megatron, fitted, batches, key):
    model = fitted
    flex = batches[0][0]
    with torch.no_grad():
        reference, _ = forward_step(iter([flex]), model)
        if key in ("ce_loss_indexes", "mse_loss_indexes"):  # every loss target read one position early
            moved = {**flex, key: flex[key] - 1}
        else:
            moved = _move(flex, key, 2 if key == "packed_vit_token_indexes" else -2)
        changed, _ = forward_step(iter([moved]), model)
    assert (changed - reference).abs().max() > MOVED_TOKEN_MIN_CHANGE, (key, reference, changed)


def test_forward_step_contract_and_noise_from_the_batch(megatron, cfg, batches):
    """Megatron's two-tuple loss contract; the noise is the batch's own (same loss twice), the torch RNG untouched."""
    model = build_model(cfg)
    flex = batches[0][0]
    state = torch.random.get_rng_state()
    with torch.no_grad():
        a, fn = forward_step(iter([flex]), model)
        b, _ = forward_step(iter([flex]), model)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(a, b)
    loss, report = fn(a)
    assert loss.shape == () and set(report) == {"loss", "ce loss", "mse loss"}
    assert torch.equal(loss, cfg.ce_weight * a[0] + cfg.mse_weight * a[1])
    assert noise_seed(flex, cfg.seed) != noise_seed(batches[1][0], cfg.seed)
    assert loss_func(0.0, 1.0, a)[0] == a[1]


def test_packed_attention_masks_match_between_modes(batches):
    flex, dense = batches[0]
    pf, pd = packed_attention(flex, "cpu", "sdpa"), packed_attention(dense, "cpu", "auto")
    assert isinstance(pf, PackedAttention) and pf.kernel == pd.kernel == "sdpa"
    assert pf.documents == pd.documents and pf.documents[-1][1] == flex["sequence_length"]
    assert all(torch.equal(a, b) for a, b in zip(pf.masks, pd.masks))
    with pytest.raises(ValueError, match="flex batches"):
        packed_attention(dense, "cpu", "flex")


def test_gradient_accumulation_equals_averaged_gradients(megatron, cfg, batches):
    """Global batch 2 at DP 1 (two micro-batches accumulated) makes the same update as the average of the two
    micro-batches' gradients (what DP 2 computes), bit for bit."""
    (b1, _), (b2, _) = batches
    trainer = BagelTrainer(cfg, megatron)
    reference = BagelTrainer(cfg, megatron)
    metrics = trainer.train_step([b1, b2], step=1)
    g1 = _loss_and_grads(reference.model, b1)[1]
    g2 = _loss_and_grads(reference.model, b2)[1]
    for name, p in reference.model.named_parameters():
        p.grad = (g1[name] + g2[name]) / 2
    torch.nn.utils.clip_grad_norm_(reference.params, cfg.optimizer.clip_grad, foreach=False)
    reference.optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), reference.model.parameters()))
    assert set(metrics) == {"loss", "ce_loss", "mse_loss", "grad_norm"} and metrics["grad_norm"] > 0
    state = trainer.state_dict()
    fresh = BagelTrainer(cfg, megatron)
    fresh.load_state_dict(state)
    assert fresh.parameter_digest() == trainer.parameter_digest()
