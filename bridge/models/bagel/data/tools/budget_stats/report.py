"""What ``bagel-data stats`` shows: the :class:`StatsReport` text (tables, findings) and the histogram PNG."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from PIL import Image, ImageDraw

from ...config.budgets import VAE_GROUPS, BudgetIssue
from ...config import PackerConfig
from .. import text_table
from .estimate import GroupStats
from .simulate import Candidate, SimResult
from .straggler import Prediction

__all__ = ["StatsReport", "data_findings", "draw_histogram"]


@dataclass
class StatsReport:
    """Everything ``bagel-data stats`` shows; :meth:`format` renders the text."""

    source: str
    packer: PackerConfig
    groups: list[GroupStats]
    advice: list[tuple[Candidate, SimResult, list[BudgetIssue]]]
    findings: list[BudgetIssue]
    sampled: bool = False
    histogram: str | None = None
    packer_where: str = "data.packer"
    #: the straggler prediction per DP size (``straggler.predict``), or why there is none
    straggler: list[Prediction] | str = field(default_factory=list)

    def _straggler_lines(self) -> list[str]:
        """``packer.strategy`` official vs balanced: predicted straggler ratio and time lost per DP size."""
        pred, p = self.straggler, self.packer
        if isinstance(pred, str):
            return ["", f"straggler prediction: none ({pred})"]
        if not pred:
            return []
        c = p.cost
        lines = ["", f"straggler prediction, {self.packer_where}.strategy official vs balanced (configured: "
                     f"{p.strategy}): estimated compute per DP rank and step, slowest / mean over the ranks",
                 f"({self.packer_where}.cost: hidden {c.hidden_size}, {c.num_layers} layers; both strategies on the "
                 f"same estimates, CFG dropout ignored, one pack per rank and step, {pred[0].official.steps} steps "
                 "after a warm-up):"]
        head = ("DP", "official", "balanced", "time lost official", "balanced", "tokens/pack official", "balanced",
                "wait p99 balanced")
        rows = [(str(x.dp), f"{x.official.ratio:.3f}", f"{x.balanced.ratio:.3f}", f"{x.official.lost:.1%}",
                 f"{x.balanced.lost:.1%}", f"{x.official.tokens_per_pack:.0f}", f"{x.balanced.tokens_per_pack:.0f}",
                 f"{x.balanced.wait_quantile(0.99)} packs") for x in pred]
        return lines + text_table(head, rows)

    @property
    def impossible(self) -> bool:
        """True when the configured budgets can never produce a batch (a mandatory group fits nothing)."""
        return bool(self.advice) and self.advice[0][1].impossible is not None

    def format(self) -> str:
        p = self.packer
        lim = p.max_num_tokens_per_sample
        lines = [f"bagel-data stats: {self.source}",
                 f"budgets: expected {p.expected_num_tokens} / max {p.max_num_tokens} / per-sample {lim} tokens; "
                 f"max_latent_size {p.max_latent_size} x {p.vae_image_downsample} px, max_num_patch_per_side "
                 f"{p.max_num_patch_per_side} x {p.vit_patch_size} px",
                 "image sizes: read from image headers (no pixel decode; the converter's manifest records no "
                 "sizes)" + ("; SAMPLED: only the first --max-samples samples of each dataset were read"
                             if self.sampled else ""),
                 "tokens = the packer's estimate num_tokens + 2 per plan item; lo-hi over random choices "
                 "(t2i caption, edit steps)", ""]
        head = ("group/dataset", "samples", "read", "unusable", "min", "p10", "p50", "p90", "max", "mean",
                f">{lim} always", "some", "max VAE", "max ViT")
        rows = []
        for g in self.groups:  # a row per dataset, and one for the whole group when it has several
            rows += [_dataset_row(f"{g.group.name}/{d.name}", GroupStats(g.group, [d]), lim) for d in g.datasets]
            if len(g.datasets) > 1:
                rows.append(_dataset_row(f"{g.group.name} (all)", g, lim))
        lines += text_table(head, rows)
        reasons = {f"{d.group}/{d.name}: {r}": n for g in self.groups for d in g.datasets
                   for r, n in d.unusable.items()}
        if reasons:
            lines += ["", "unusable samples (the cooker drops them):",
                      *(f"  {k}: {n}" for k, n in sorted(reasons.items()))]
        lines += ["", "budget advisor (official pack loop replayed on the mean estimates, CFG dropout ignored):"]
        head = ("candidate", "expected", "max", "per-sample", "fill", "samples/pack", "dropped", "config check")
        rows = []
        for c, r, issues in self.advice:
            errs = [i for i in issues if i.level == "error"]
            cp = c.packer
            rows.append((c.label, str(cp.expected_num_tokens), str(cp.max_num_tokens),
                         str(cp.max_num_tokens_per_sample), "never" if r.impossible else f"{r.fill:.1%}",
                         "-" if r.impossible else f"{r.samples_per_pack:.1f}",
                         f"{r.dropped_share:.1%}" if r.consumed else "-", f"refused: {errs[0].key}" if errs else "ok"))
        lines += text_table(head, rows)
        lines += self._straggler_lines()
        lines += ["", "findings:" if self.findings else "findings: none"]
        lines += [f"  {f.level.upper()}: {f.message}" for f in self.findings]
        if self.histogram:
            lines += ["", f"histogram: {self.histogram}"]
        return "\n".join(lines)


def _dataset_row(label: str, gs: GroupStats, lim: int) -> tuple[str, ...]:
    """A row of the dataset table: the counts and estimated tokens of a dataset, or of a group's datasets."""
    ests = gs.estimates
    always, some = gs.over(lim)
    means = sorted(e.mean for e in ests)
    q = [str(round(means[min(len(means) - 1, int(f * len(means)))])) if means else "-" for f in (0.1, 0.5, 0.9)]
    return (label, str(sum(d.samples for d in gs.datasets)), str(sum(d.read for d in gs.datasets)),
            str(sum(sum(d.unusable.values()) for d in gs.datasets)), str(min(e.lo for e in ests)) if ests else "-", *q,
            str(max(e.hi for e in ests)) if ests else "-", f"{sum(means) / len(means):.0f}" if means else "-",
            str(always), str(some), f"{max((e.vae_side for e in ests), default=0)}/side",
            f"{max((e.vit_side for e in ests), default=0)}/side")


def data_findings(packer: PackerConfig, groups: Sequence[GroupStats], pw: str) -> list[BudgetIssue]:
    """What only the data show, beyond the config-time checks: a group with no usable sample, a group whose
    samples are all (or >= 10 %) over ``max_num_tokens_per_sample`` (a mandatory one never yields a batch),
    VAE images larger than ``max_latent_size x vae_image_downsample`` px. ``pw``: the packer's key prefix."""
    out, lim, key = [], packer.max_num_tokens_per_sample, f"{pw}.max_num_tokens_per_sample"
    for g in groups:
        ests, name = g.estimates, g.group.name
        if not ests:
            if any(d.read for d in g.datasets):
                never = ": the packer never yields a batch" if g.group.is_mandatory else ""
                out.append(BudgetIssue("error" if never else "warning", "data",
                                       f"group {name!r}: no usable sample (all dropped for data errors){never}"))
            continue
        always, some = g.over(lim)
        if g.group.is_mandatory and always == len(ests):
            smallest = min(e.lo for e in ests)
            out.append(BudgetIssue("error", key, (
                f"mandatory group {name!r}: every one of its {len(ests)} samples is estimated at >= {smallest} "
                f"tokens, not under {pw}.max_num_tokens_per_sample {lim}: the packer drops them one after another "
                f"and never yields a batch. Raise {pw}.max_num_tokens_per_sample above {smallest} (and "
                f"{pw}.max_num_tokens) or lower the group's image_transform_args.max_image_size")))
        elif always == len(ests):
            out.append(BudgetIssue("warning", key, f"group {name!r}: every sample is over {key} {lim}: its draws are "
                                   "all wasted"))
        elif always + some:
            share = (always + some) / len(ests)
            if share >= 0.1:
                out.append(BudgetIssue("warning", key, f"group {name!r}: {always + some} of {len(ests)} samples "
                                       f"({share:.0%}) can be over {key} {lim} and are dropped"))
        if g.group.name in VAE_GROUPS:
            px = max(e.vae_px for e in ests)
            table_px = packer.max_latent_size * packer.vae_image_downsample
            if px > table_px:
                out.append(BudgetIssue("error" if not packer.interpolate_pos else "warning",
                                       f"{pw}.max_latent_size", (
                    f"group {name!r}: the largest VAE image is {px} px per side after the transform, larger than "
                    f"{pw}.max_latent_size x vae_image_downsample = {packer.max_latent_size} x "
                    f"{packer.vae_image_downsample} = {table_px} px: "
                    + ("latent position ids run past the table; set " if not packer.interpolate_pos else
                       "interpolated position ids squeeze its grid; consider ")
                    + f"{pw}.max_latent_size >= {math.ceil(px / packer.vae_image_downsample)}")))
    return out


def draw_histogram(report: StatsReport, path: str, *, bins: int = 30) -> str:
    """Write one panel per group: histogram of mean estimated tokens per sample, the per-sample limit as a red
    line. Drawn with Pillow's ImageDraw (matplotlib is not a dependency). Returns ``path``."""
    lim = report.packer.max_num_tokens_per_sample
    W, PH, M = 900, 220, 50
    img = Image.new("RGB", (W, PH * max(1, len(report.groups)) + 10), "white")
    d = ImageDraw.Draw(img)
    for k, g in enumerate(report.groups):
        top = k * PH + 10
        vals = [e.mean for e in g.estimates]
        hi = max(max(vals, default=1), lim) * 1.05
        counts = [0] * bins
        for v in vals:
            counts[min(bins - 1, int(v / hi * bins))] += 1
        cmax = max(counts) or 1
        x0, x1, y0, y1 = M, W - 20, top + 25, top + PH - 30
        d.text((x0, top), f"{g.group.name}: {len(vals)} samples, tokens per sample (mean estimate)", fill="black")
        d.line([(x0, y0), (x0, y1), (x1, y1)], fill="black")  # the axes
        bw = (x1 - x0) / bins
        for i, c in enumerate(counts):
            if c:
                d.rectangle([x0 + i * bw + 1, y1 - (y1 - y0) * c / cmax, x0 + (i + 1) * bw - 1, y1],
                            fill=(70, 110, 170))
        xl = x0 + (x1 - x0) * lim / hi
        d.line([(xl, y0), (xl, y1)], fill="red", width=2)
        d.text((xl + 4 if xl < x1 - 130 else xl - 110, y0), f"per-sample {lim}", fill="red")
        d.text((x0 - 10, y1 + 4), "0", fill="black")
        d.text((x1 - 40, y1 + 4), f"{hi:.0f}", fill="black")
        d.text((x0 - 45, y0), f"{cmax}", fill="black")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    img.save(path)
    return path
