"""The numbers of one packed batch: tokens per sample and modality, loss targets, fill and padding."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .view import as_index, num_tokens

__all__ = ["BatchSummary", "format_batch_summary", "summarize_batch"]


@dataclass
class BatchSummary:
    """What one packed batch holds (all counts are tokens unless named otherwise).

    ``samples``: one dict per packed sample in pack order with ``group``, ``data_indexes``, ``tokens``,
    ``text``, ``vit``, ``vae``, ``ce``, ``mse``. ``totals``: the same token keys summed over the pack.
    ``fill`` = sequence_length / max_num_tokens (1.0 = full); ``padding`` = max_num_tokens - sequence_length
    (0 when a pack exceeds the budget). ``totals`` count every position of the batch's tensors; per-sample
    counts leave out ``outside_samples`` positions that lie past ``sum(sample_lens)`` (the official
    unclosed-split quirk; normally 0). ``groups``: samples per group. ``stats``: the loader's cumulative
    ``stats()`` after this batch (``buffer_len``, ``drops``, ``consumed``), empty when unknown.
    """

    index: int
    sequence_length: int
    max_num_tokens: int
    samples: list[dict[str, Any]]
    totals: dict[str, int]
    groups: dict[str, int]
    fill: float
    padding: int
    outside_samples: int = 0
    stats: dict[str, Any] = field(default_factory=dict)


def _count_per_sample(positions: np.ndarray, bounds: np.ndarray, n: int, seq_len: int) -> list[int]:
    positions = positions[positions < seq_len]  # positions outside every sample (unclosed-split quirk) excluded
    which = np.searchsorted(bounds, positions, side="right") - 1
    return np.bincount(which, minlength=n)[:n].astype(int).tolist() if n else []


def summarize_batch(batch: Mapping[str, Any], max_num_tokens: int, *, batch_index: int = 0,
                    stats: Mapping[str, Any] | None = None) -> BatchSummary:
    """Per-sample and per-modality token counts of one packed batch (see :class:`BatchSummary`)."""
    seq_len = int(batch["sequence_length"])
    nreal = len(batch["batch_data_indexes"])  # packed samples: sample_lens may end with a flex pad entry
    lens = [int(x) for x in batch["sample_lens"][:nreal]]
    bounds = np.cumsum([0] + lens[:-1]).astype(np.int64) if lens else np.zeros(0, dtype=np.int64)
    keys = {"text": "packed_text_indexes", "vit": "packed_vit_token_indexes", "vae": "packed_vae_token_indexes",
            "ce": "ce_loss_indexes", "mse": "mse_loss_indexes"}
    index = {k: as_index(batch.get(key)) for k, key in keys.items()}
    per = {k: _count_per_sample(v, bounds, nreal, seq_len) for k, v in index.items()}
    samples, groups = [], {}
    for i, d in enumerate(batch["batch_data_indexes"]):
        group = d.get("dataset_name", "?") if isinstance(d, Mapping) else "?"
        groups[group] = groups.get(group, 0) + 1
        samples.append({"group": group, "data_indexes": d.get("data_indexes") if isinstance(d, Mapping) else d,
                        "tokens": lens[i], **{k: v[i] for k, v in per.items()}})
    totals = {"tokens": seq_len, **{k: len(v) for k, v in index.items()}}
    return BatchSummary(index=batch_index, sequence_length=seq_len, max_num_tokens=int(max_num_tokens),
                        samples=samples, totals=totals, groups=groups,
                        fill=seq_len / max_num_tokens if max_num_tokens else 0.0,
                        padding=max(int(max_num_tokens) - seq_len, 0),
                        outside_samples=num_tokens(batch) - seq_len, stats=dict(stats or {}))


def format_batch_summary(s: BatchSummary, previous_drops: Mapping[str, int] | None = None) -> str:
    """Plain-text report of one batch: a header line, one line per sample, buffer and drops.

    ``previous_drops``: the loader's cumulative ``drops`` before this batch, to show this batch's new ones.
    """
    t = s.totals
    lines = [f"batch {s.index}: tokens {t['tokens']}/{s.max_num_tokens} fill {100 * s.fill:.1f}% padding "
             f"{s.padding} | text {t['text']} vit {t['vit']} vae {t['vae']} | ce {t['ce']} mse {t['mse']} | "
             f"samples {len(s.samples)} " + " ".join(f"{g}={n}" for g, n in sorted(s.groups.items()))]
    if s.outside_samples:
        lines.append(f"  WARNING {s.outside_samples} packed positions lie outside sample_lens (unclosed split)")
    for i, smp in enumerate(s.samples):
        lines.append(f"  sample {i:>2} {smp['group']:<14} tokens {smp['tokens']:>6} text {smp['text']:>6} "
                     f"vit {smp['vit']:>6} vae {smp['vae']:>6} ce {smp['ce']:>6} mse {smp['mse']:>6}  "
                     f"data_indexes {smp['data_indexes']}")
    st = s.stats
    if st:
        drops = dict(st.get("drops") or {})
        prev = dict(previous_drops or {})
        new = {k: v - prev.get(k, 0) for k, v in drops.items() if v - prev.get(k, 0)}
        lines.append(f"  buffer {st.get('buffer_len', '?')} | consumed {st.get('consumed', '?')} | drops so far "
                     f"{drops or 'none'}" + (f" (this batch: {new})" if new else ""))
    return "\n".join(lines)
