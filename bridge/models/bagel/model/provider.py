"""The reference model for Megatron-Bridge's own ``pretrain()``: a model provider and a recipe.

* ``BagelModelProvider`` (created lazily, Bridge import): a ``GPTModelProvider`` — so Bridge's config
  validation, parallel setup, DDP / ``Float16Module`` wrapping and checkpointing treat it as any GPT model — whose
  ``provide()`` returns ``BagelModel``. Its ``TransformerConfig`` fields are the decoder's (``model.decoder_fields``),
  its ``bagel`` field the resolved ``BagelModelConfig``.
* ``bagel_recipe(data, model, ...)``: a complete ``ConfigContainer``: that provider, ``BagelDatasetProvider`` over
  ``data`` (the loader is built inside ``pretrain()`` from its DP group), one packed micro-batch per DP rank per
  step (gradient accumulation when ``global_batch_size`` > DP size), Adam with a constant learning rate,
  validation only when asked (``eval_interval`` / ``eval_iters``, on ``data.valid``), a NullTokenizer (the BAGEL
  text is tokenised by the data pipeline's Qwen2 tokenizer). ``bagel_tiny_recipe()`` is the zero-argument form
  for ``--recipe`` (the demo data of ``configs/demo.yaml``, the tiny model).

The forward step to pass with it is ``step.forward_step``. Only TP = PP = CP = 1 is supported by ``BagelModel``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from ..data._bridge import import_bridge_training
from ..data.config import BagelDataConfig
from .config import BagelModelConfig
from .model import BagelModel, decoder_fields

__all__ = ["bagel_model_provider", "bagel_model_provider_class", "bagel_recipe", "bagel_tiny_recipe"]


@functools.cache
def bagel_model_provider_class() -> type:
    """``BagelModelProvider``: Megatron-Bridge's ``GPTModelProvider`` providing ``BagelModel``."""
    base = import_bridge_training().GPTModelProvider

    @dataclasses.dataclass
    class BagelModelProvider(base):
        """A ``GPTModelProvider`` whose ``provide()`` builds ``BagelModel`` (one pipeline stage only)."""

        bagel: Any = None  # the resolved BagelModelConfig

        def provide(self, pre_process: bool | None = None, post_process: bool | None = None,
                    vp_stage: int | None = None) -> BagelModel:
            if not isinstance(self.bagel, BagelModelConfig):
                raise ValueError("BagelModelProvider.bagel: set it to a resolved BagelModelConfig "
                                 "(bagel_model_provider() does)")
            if pre_process is False or post_process is False or vp_stage not in (None, 0):
                raise ValueError("BagelModel has one pipeline stage: pipeline_model_parallel_size must be 1")
            return BagelModel(self, self.bagel)

    BagelModelProvider.__module__ = __name__
    BagelModelProvider.__qualname__ = "BagelModelProvider"
    return BagelModelProvider


def bagel_model_provider(cfg: BagelModelConfig, *, seq_length: int, bf16: bool = False) -> Any:
    """A ``BagelModelProvider`` for the resolved ``cfg``; ``seq_length`` = the packer's ``max_num_tokens``."""
    fields = decoder_fields(cfg, cpu=False, bf16=bf16)
    return bagel_model_provider_class()(
        **fields, seq_length=seq_length, vocab_size=cfg.vocab_size, make_vocab_size_divisible_by=128,
        share_embeddings_and_output_weights=bool(cfg.tie_embeddings), position_embedding_type="rope",
        rotary_base=int(cfg.rotary_base), tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        context_parallel_size=1, bagel=cfg)


def bagel_recipe(data: BagelDataConfig, model: BagelModelConfig, *, tokenizer: Any = None, train_iters: int = 10,
                 global_batch_size: int = 1, seed: int = 1234, save: str | None = None, bf16: bool = False,
                 eval_interval: int | None = None, eval_iters: int = 0) -> Any:
    """A Megatron-Bridge ``ConfigContainer`` training ``model`` (resolved here against the tokenizer and
    ``data.packer``) on ``data`` (module docstring). ``tokenizer``: the BAGEL text tokenizer (default:
    ``data.tokenizer``, the offline Qwen2 one). ``eval_interval`` / ``eval_iters``: Bridge's validation (steps
    between evaluations, iterations per evaluation); it needs ``data.valid`` (``ValueError`` otherwise)."""
    from ..data.providers import BagelDatasetProvider
    from ..data.tokenizer import add_special_tokens, load_tokenizer

    if eval_iters and eval_interval and data.valid is None:
        raise ValueError("bagel_recipe: eval_interval / eval_iters ask for validation but data.valid is not set")
    api = import_bridge_training()
    if tokenizer is None:
        tokenizer = load_tokenizer(data.tokenizer)
    tokenizer = add_special_tokens(tokenizer)[0]
    resolved = model.resolved(vocab_size=len(tokenizer), max_latent_size=data.packer.max_latent_size)
    o = resolved.optimizer
    return api.ConfigContainer(
        model=bagel_model_provider(resolved, seq_length=data.packer.max_num_tokens, bf16=bf16),
        train=api.TrainingConfig(train_iters=train_iters, global_batch_size=global_batch_size, micro_batch_size=1),
        validation=api.ValidationConfig(eval_iters=eval_iters if eval_interval else 0, eval_interval=eval_interval),
        optimizer=api.OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.lr, weight_decay=o.weight_decay,
                                      adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                                      clip_grad=o.clip_grad, bf16=bf16, use_distributed_optimizer=False),
        scheduler=api.SchedulerConfig(lr_decay_style="constant", lr_warmup_iters=0),
        ddp=api.DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False),
        dataset=BagelDatasetProvider(data=data, tokenizer=tokenizer),
        logger=api.LoggerConfig(log_interval=1),
        tokenizer=api.TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=resolved.vocab_size),
        checkpoint=api.CheckpointConfig(save=save, save_interval=train_iters if save else None),
        rng=api.RNGConfig(seed=seed))


def bagel_tiny_recipe() -> Any:
    """``--recipe bridge.models.bagel.model.provider:bagel_tiny_recipe``: the tiny model on ``configs/demo.yaml``'s
    data (the launcher replaces the dataset with its own ``data`` section and takes train_iters / batch sizes /
    parallel layout from this recipe: 10 steps, one packed batch per step)."""
    from pathlib import Path

    from ..data.job.config import load_job_config

    checkout = Path(__file__).resolve().parents[4] / "configs" / "demo.yaml"  # the repository's demo config
    job = load_job_config(str(checkout if checkout.is_file() else Path("configs") / "demo.yaml"))
    return bagel_recipe(job.data, BagelModelConfig(name="bagel-tiny"), train_iters=10, global_batch_size=1)
