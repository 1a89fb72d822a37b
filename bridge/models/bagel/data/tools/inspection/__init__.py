"""Look at packed batches before training: per-batch numbers and one picture of each pack's attention.

``bagel-data inspect`` (see ``cli.py``) builds the job's real loader with ``build_bagel_train_loader`` from
the job YAML, pulls N batches and, for each, reports what went into the pack and draws its attention matrix
(:func:`run_inspect`). The pieces are usable on their own, one module per concern: ``view`` (:func:`pack_view`:
flex or dense batch -> one canonical :class:`PackView`; :func:`attention_allowed`: the official mask rule on it),
``report`` (:func:`summarize_batch`, :func:`format_batch_summary`: tokens per sample and modality, loss targets,
fill, padding) and ``picture`` (:func:`render_pack`: the picture, deterministic, with Pillow).

Package name: ``inspection`` (not ``inspect``) so that it never shadows the standard library module.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from .picture import canvas_size, render_pack, sampled_positions
from .report import BatchSummary, format_batch_summary, summarize_batch
from .view import PackView, attention_allowed, pack_view

__all__ = ["BatchSummary", "PackView", "attention_allowed", "canvas_size", "format_batch_summary", "pack_view",
           "render_pack", "run_inspect", "sampled_positions", "summarize_batch"]

logger = logging.getLogger(__name__)


def _norms(groups: Sequence[Any]) -> tuple[tuple[float, float], tuple[float, float]]:
    """(mean, std) for VAE and ViT images from the groups' transforms (0.5/0.5 when unset or mixed)."""
    vae, vit = set(), set()
    for grp in groups:
        if (t := grp.transform()) is not None:
            (vit if grp.name == "vlm_sft" else vae).add((t.image_mean, t.image_std))
        if (t := grp.vit_transform()) is not None:
            vit.add((t.image_mean, t.image_std))

    def pick(found: set, kind: str) -> tuple[float, float]:
        if len(found) == 1:
            return next(iter(found))
        if found:
            logger.warning("inspect: groups normalise %s images differently (%s); thumbnails use 0.5/0.5", kind,
                           sorted(found))
        return 0.5, 0.5

    return pick(vae, "VAE"), pick(vit, "ViT")


def run_inspect(config: str | os.PathLike | None, *, overrides: Sequence[str] = (), batches: int = 4,
                out: str | os.PathLike | None = "runs/inspect", size: int = 512, dp_rank: int = 0, dp_size: int = 1,
                progress: bool = True, emit: Callable[[str], None] | None = None) -> list[BatchSummary]:
    """Build the job's loader from ``config`` (+ ``overrides``) and report/draw ``batches`` batches.

    Uses the job's own path: ``load_job_config`` → demo data generated if ``demo_data`` is set and missing →
    ``load_tokenizer(data.tokenizer)`` → ``build_bagel_train_loader(data, tokenizer, (dp_rank, dp_size))``.
    ``data.prefetch`` is set to 0: for a few batches a producer process only adds start-up time, and prefetching
    changes neither the batches nor ``stats()``. Each batch's report goes to ``emit`` (default: the logger) and its
    picture to ``out/batch_NNNN.png`` (``out=None``: no pictures). Returns one :class:`BatchSummary` per batch.
    Raises ``ConfigError`` for a bad config and ``ValueError`` for ``batches < 1``.
    """
    from ...build import build_bagel_train_loader
    from ...job.config import load_job_config, validate_job
    from ...tokenizer import load_tokenizer

    if batches < 1:
        raise ValueError(f"inspect: --batches must be >= 1, got {batches}")
    emit = emit or logger.info
    cfg = load_job_config(config, [*overrides, "data.prefetch=0"])
    if cfg.demo_data:
        from ...converter.demo import make_demo_data

        make_demo_data(cfg.demo_data, seed=cfg.demo_seed)
    p = cfg.data.packer
    data = validate_job(cfg)  # the job's own validation pass and messages
    vae_norm, vit_norm = _norms(data.group_configs)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if out is not None:
        os.makedirs(out, exist_ok=True)
    summaries: list[BatchSummary] = []
    loader = build_bagel_train_loader(data, tokenizer, (dp_rank, dp_size), length=batches)
    try:
        from tqdm import tqdm

        drops: dict[str, int] = {}
        for i in tqdm(range(batches), desc="inspect", unit="batch", disable=not progress):
            batch = next(loader)
            stats = loader.stats() if hasattr(loader, "stats") else {}
            s = summarize_batch(batch, p.max_num_tokens, batch_index=i, stats=stats)
            emit(format_batch_summary(s, drops))
            drops = dict(stats.get("drops") or {})
            summaries.append(s)
            if out is not None:
                pic = render_pack(batch, title=f"batch {i} (rank {dp_rank}/{dp_size})", size=size, vae_norm=vae_norm,
                                  vit_norm=vit_norm, max_num_tokens=p.max_num_tokens, vit_patch_size=p.vit_patch_size,
                                  vae_image_downsample=p.vae_image_downsample,
                                  max_num_patch_per_side=p.max_num_patch_per_side)
                pic.save(os.path.join(out, f"batch_{i:04d}.png"), optimize=True)
    finally:
        loader.close()
    return summaries
