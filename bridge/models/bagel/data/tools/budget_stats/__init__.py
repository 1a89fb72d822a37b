"""``bagel-data stats``: one pass over the converted datasets' metadata, token estimates and a budget advisor.

For every group of a job config and every converted dataset of the group, read the shards once and estimate
each sample's packed length with the packer's own rule (:mod:`..budgets`), then report. One module per concern:
``estimate`` (:func:`dataset_stats`: a :class:`SampleEstimate` per usable sample from ``meta.json`` and image
headers, the samples the cooker would drop; :class:`GroupStats`), ``simulate`` (:func:`simulate_packing`: the
official pack loop replayed on the estimates for the configured and a few :func:`candidate_budgets`: fill ratio,
samples per pack, share dropped), ``straggler`` (:func:`.straggler.predict`: the predicted straggler ratio of
both ``packer.strategy`` loops on several simulated DP ranks) and ``report`` (:class:`StatsReport`, the tables
and findings, and :func:`draw_histogram`).

Findings are the config-time budget issues (:func:`..budgets.budget_issues`) plus what only the data
show (:func:`.report.data_findings`): a mandatory group none of whose samples fits (the packer would never
yield a batch), VAE images larger than ``max_latent_size x vae_image_downsample`` (interpolated position
ids; extrapolated ones are refused at config time already).

Known approximations: CFG dropout (which shortens packed samples) is ignored; the others are the estimates'
(see ``estimate``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from ...config.budgets import budget_issues
from ...config import ConfigError, PackerConfig, ResolvedGroup
from .estimate import DatasetStats, GroupStats, SampleEstimate, dataset_stats
from .report import StatsReport, data_findings, draw_histogram
from .simulate import Candidate, SimResult, candidate_budgets, simulate_packing
from .straggler import Prediction, predict

__all__ = ["Candidate", "DatasetStats", "GroupStats", "Prediction", "SampleEstimate", "SimResult", "StatsReport",
           "candidate_budgets", "collect_stats", "dataset_stats", "draw_histogram", "job_stats", "simulate_packing"]


def collect_stats(groups: Sequence[ResolvedGroup], packer: PackerConfig, tokenizer: Any, *, source: str = "groups",
                  packer_where: str = "data.packer", max_samples: int | None = None, progress: bool = True,
                  sim_packs: int = 200, histogram: str | None = None,
                  straggler_dp: Sequence[int] = (8, 64)) -> StatsReport:
    """Read every dataset of ``groups`` once and build the report (see the package docstring).

    ``tokenizer``: anything with ``encode(str) -> list[int]`` (the job's tokenizer). ``sim_packs``: packs
    replayed per candidate. ``histogram``: PNG path to write (None = none). ``straggler_dp``: the DP sizes of the
    straggler prediction (empty: none). Raises ConfigError for a dataset without ``energon_path`` or manifest.
    """
    gstats = []
    for rg in groups:
        ds = []
        for name, entry in zip(rg.group.dataset_names, rg.datasets):
            if not entry.energon_path:
                raise ConfigError(f"{rg.group.name}.{name}: no 'energon_path'; convert it first (bagel-data convert)")
            ds.append(dataset_stats(rg.group, name, entry.energon_path, tokenizer, max_samples=max_samples,
                                    progress=progress))
        gstats.append(GroupStats(rg.group, ds))
    cfg_groups = [g.group for g in gstats]
    findings = budget_issues(packer, cfg_groups, source=source, packer_where=packer_where)
    findings += data_findings(packer, gstats, packer_where)
    findings.sort(key=lambda i: i.level != "error")
    rng, streams = random.Random(0), [[round(e.mean) for e in g.estimates] for g in gstats]
    for s in streams:  # each group's mean estimates, in a fixed shuffled order
        rng.shuffle(s)
    advice = []
    for c in candidate_budgets(packer, gstats):
        r = simulate_packing(streams, [g.group.weight for g in gstats], [g.group.is_mandatory for g in gstats],
                             [g.group.name for g in gstats], c.packer, packs=sim_packs)
        advice.append((c, r, budget_issues(c.packer, cfg_groups, source=source, packer_where=packer_where)))
    sampled = max_samples is not None and any(d.read < d.samples for g in gstats for d in g.datasets)
    straggler = predict(gstats, packer, dps=straggler_dp) if straggler_dp else []
    report = StatsReport(source, packer, gstats, advice, findings, sampled=sampled, packer_where=packer_where,
                         straggler=straggler)
    if histogram:
        report.histogram = draw_histogram(report, histogram)
    return report


def job_stats(config: str, overrides: Sequence[str] = (), *, tokenizer: Any = None, **kw: Any) -> StatsReport:
    """``bagel-data stats --config JOB.yaml``: load the job config (generating ``demo_data`` when set and
    missing), the groups and registry *without* refusing bad budgets, the tokenizer, then :func:`collect_stats`.

    Raises ConfigError for an invalid config or an unconverted dataset.
    """
    from ...job.config import load_job_config, validate_job

    cfg = load_job_config(config, list(overrides))
    if cfg.demo_data:
        from ...converter.demo import make_demo_data

        make_demo_data(cfg.demo_data, seed=cfg.demo_seed)
    data = cfg.data
    groups = validate_job(cfg, budgets="report").groups  # the job's pass; bad budgets are what this report is for
    if tokenizer is None:
        from ...tokenizer import load_tokenizer

        tokenizer = load_tokenizer(data.tokenizer)
    return collect_stats(groups, data.packer, tokenizer, source=data.groups_source, **kw)
