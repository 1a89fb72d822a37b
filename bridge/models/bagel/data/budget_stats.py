"""``bagel-data stats``: one pass over the converted datasets' metadata, token estimates and a budget advisor.

For every group of a job config and every converted dataset of the group, read the shards once
(``meta.json`` + image *headers*; no pixel decode: the converter's manifest records no image sizes, but an
image header gives the exact input size, which is all the resize rule needs) and estimate each sample's
packed length with the packer's own rule (:mod:`.budgets`: ``num_tokens + 2 * plan items``, images after
the group's transform). Then:

* per group and dataset: sample counts, samples the cooker would drop for recorded data errors, the
  distribution of estimated tokens, how many samples exceed ``max_num_tokens_per_sample`` (always, or only
  for some random choices: t2i caption / edit start, end and instructions), the largest VAE / ViT grid;
* a budget advisor: a replay of the official pack loop (mandatory first, weighted draws, overflow buffer,
  flush) on the estimates, for the configured and a few candidate budgets: fill ratio
  (``sequence_length / max_num_tokens``), samples per pack, share of consumed samples dropped;
* findings: the config-time budget issues (:func:`.budgets.budget_issues`) plus what only the data show:
  a mandatory group none of whose samples fits (the packer would never yield a batch), VAE images larger
  than ``max_latent_size x vae_image_downsample`` (interpolated position ids; extrapolated ones are
  refused at config time already).

Known approximations: corrupt pixel data behind a valid header is not detected; CFG dropout (which
shortens packed samples) is ignored; edit rows are checked for null images / malformed instruction lists as
a whole, whereas the reader only fails on the images and steps a draw reaches.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import random
import tarfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from PIL import Image

from .budgets import (BudgetIssue, budget_issues, edit_outcomes, image_tokens, t2i_estimate, transform_extremes,
                      vlm_estimate)
from .config import (ConfigError, GroupConfig, PackerConfig, ResolvedGroup, load_dataset_info, load_grouped_yaml,
                     resolve_groups)
from .energon.layout import EDIT, META_PART, T2I, VLM, load_manifest
from .transforms import ImageTransform, PIL_MAX_IMAGE_PIXELS

__all__ = ["Candidate", "DatasetStats", "GroupStats", "SampleEstimate", "SimResult", "StatsReport",
           "candidate_budgets", "collect_stats", "dataset_stats", "draw_histogram", "job_stats", "simulate_packing"]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# Per-sample estimates from metadata


@dataclass(frozen=True)
class SampleEstimate:
    """Estimated packed length of one sample (tokens): ``lo`` / ``hi`` over the reader's random choices,
    ``mean`` their expectation; ``vae_side`` / ``vit_side`` the largest image side in patches (0 = none),
    ``vae_px`` the largest VAE image side in pixels after the transform."""

    lo: int
    hi: int
    mean: float
    vae_side: int = 0
    vit_side: int = 0
    vae_px: int = 0


class _Unusable(Exception):
    """The cooker turns this sample into a tombstone (``reason`` as in ``cook_common.DROP_REASONS``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _sizes(parts: dict[str, bytes], indexes: Sequence[int]) -> list[tuple[int, int]]:
    """(width, height) of image parts from their headers; a missing/unreadable part is unusable."""
    out = []
    for i in indexes:
        data = parts.get(f"img{i}")
        if data is None:
            raise _Unusable("missing_image")
        try:
            with Image.open(io.BytesIO(data)) as im:
                out.append(im.size)
        except Exception:  # noqa: BLE001 - anything PIL cannot open is a decode error for the cooker too
            raise _Unusable("image_decode_error") from None
    return out


def _side(t: ImageTransform, w: int, h: int, img_num: int = 1) -> tuple[int, int]:
    oh, ow = t.target_size(w, h, img_num)
    return max(oh, ow) // t.stride, max(oh, ow)


class _Encoder:
    """``tokenizer.encode`` lengths, memoized (captions and instructions repeat)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[str, int] = {}

    def __call__(self, text: str) -> int:
        n = self.cache.get(text)
        if n is None:
            n = self.cache[text] = len(self.tokenizer.encode(text))
        return n


def _t2i(meta: dict, parts: dict[str, bytes], g: GroupConfig, enc: _Encoder) -> SampleEstimate:
    t = g.transform()
    if meta.get("image_null"):
        raise _Unusable("missing_image")
    (w, h), = _sizes(parts, [0])
    raw = meta.get("captions")
    try:
        caps = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        caps = None
    if not isinstance(caps, dict) or not all(isinstance(v, str) for v in caps.values()):
        raise _Unusable("bad_captions_json")
    lens = [enc(v) for v in caps.values()] or [enc(" ")]
    img = image_tokens(t, w, h)
    side, px = _side(t, w, h)
    return SampleEstimate(t2i_estimate(img, min(lens)), t2i_estimate(img, max(lens)),
                          t2i_estimate(img, 0) + sum(lens) / len(lens), vae_side=side, vae_px=px)


def _vlm(meta: dict, parts: dict[str, bytes], g: GroupConfig, enc: _Encoder) -> SampleEstimate:
    from .energon.cook_common import DropSample
    from .energon.cook_vlm import conversation_elements

    t = g.transform()
    try:
        rec = json.loads(meta.get("raw_line") or "")
    except ValueError:
        raise _Unusable("bad_json") from None
    if not isinstance(rec, dict):
        raise _Unusable("bad_record")
    if "image" not in rec and "video" in rec:
        raise _Unusable("video_unsupported")
    if meta.get("image_errors"):  # recorded by the converter: missing file, wrong type, unreadable
        raise _Unusable("missing_image")
    names = meta.get("image_names") or []
    sizes = _sizes(parts, range(len(names)))
    try:
        elements = conversation_elements(rec.get("conversations"), len(sizes))
    except DropSample as d:
        raise _Unusable(d.reason) from None
    texts, images, loss = [], 0, False
    for kind, text, has_loss in elements:
        if kind == "text":
            n = enc(text)
            texts.append(n)
            loss |= bool(has_loss and n)
        else:
            images += 1
    if not loss:
        raise _Unusable("no_loss_item")
    toks = [image_tokens(t, w, h, len(sizes)) for w, h in sizes]
    side = max((_side(t, w, h, len(sizes))[0] for w, h in sizes), default=0)
    est = vlm_estimate(toks, texts, images)
    return SampleEstimate(est, est, float(est), vit_side=side)


def _edit(meta: dict, parts: dict[str, bytes], g: GroupConfig, enc: _Encoder) -> SampleEstimate:
    t, vt = g.transform(), g.vit_transform()
    n = meta.get("num_images")
    if not isinstance(n, int) or n < 2:
        raise _Unusable("too_few_images")
    if meta.get("null_images"):
        raise _Unusable("missing_image")
    instr = meta.get("instruction_list")
    if (not isinstance(instr, list) or len(instr) < n - 1
            or not all(isinstance(a, list) and a and all(isinstance(x, str) for x in a) for a in instr[:n - 1])):
        raise _Unusable("bad_instructions")
    sizes = _sizes(parts, range(n))
    vae = [image_tokens(t, w, h) for w, h in sizes]
    vit = [image_tokens(vt, w, h) for w, h in sizes] if vt is not None else [0] * n

    def text_lens(step: int) -> tuple[int, int, float]:
        lens = [enc(a) for a in instr[step]]
        return min(lens), max(lens), sum(lens) / len(lens)

    def concat_lens(steps: list[int]) -> tuple[int, int, float]:
        combos = [[]]
        for st in steps:
            combos = [c + [a] for c in combos for a in instr[st]]
            if len(combos) > 256:  # too many to tokenize: bound by the pieces' lengths
                lo = sum(min(enc(a + ". ") for a in instr[s]) for s in steps)
                hi = sum(max(enc(a + ". ") for a in instr[s]) for s in steps)
                return lo, hi, (lo + hi) / 2
        lens = [enc("".join(a + ". " for a in c).rstrip()) for c in combos]
        return min(lens), max(lens), sum(lens) / len(lens)

    outs = edit_outcomes(vae, vit, text_lens, concat_lens)
    vae_side, vae_px = max(_side(t, w, h) for w, h in sizes)
    vit_side = max(_side(vt, w, h)[0] for w, h in sizes) if vt is not None else 0
    return SampleEstimate(min(o.lo for o in outs), max(o.hi for o in outs), sum(o.probability * o.mean for o in outs),
                          vae_side=vae_side, vit_side=vit_side, vae_px=vae_px)


_ESTIMATORS: dict[str, Callable[[dict, dict, GroupConfig, _Encoder], SampleEstimate]] = {
    T2I: _t2i, VLM: _vlm, EDIT: _edit}


def _iter_samples(ds_root: str, manifest: dict) -> Iterator[tuple[str, dict[str, bytes]]]:
    """(key, {part: bytes}) of every sample, in shard order (parts of a sample are consecutive members)."""
    for shard in manifest["shards"]:
        with tarfile.open(os.path.join(ds_root, shard["path"]), "r") as tar:
            key, parts = None, {}
            for m in tar:
                if not m.isfile():
                    continue
                k, _, part = m.name.partition(".")
                if k != key and key is not None:
                    yield key, parts
                    parts = {}
                key = k
                parts[part] = tar.extractfile(m).read()
            if key is not None:
                yield key, parts


# --------------------------------------------------------------------------------------------------
# Per-dataset / per-group statistics


@dataclass
class DatasetStats:
    """One converted dataset: ``samples`` (manifest), ``read`` (estimated or unusable), ``unusable`` by
    reason, and one :class:`SampleEstimate` per usable sample, in shard order."""

    group: str
    name: str
    path: str
    samples: int
    read: int = 0
    unusable: Counter = field(default_factory=Counter)
    estimates: list[SampleEstimate] = field(default_factory=list)


def dataset_stats(group: GroupConfig, name: str, path: str, tokenizer: Any, *, max_samples: int | None = None,
                  progress: bool = True) -> DatasetStats:
    """Estimate every sample (or the first ``max_samples``) of the converted dataset at ``path``.

    Raises ConfigError when the directory holds no readable manifest or the group has no transform.
    """
    from tqdm import tqdm

    if not group.image_transform_args:
        raise ConfigError(f"group {group.name!r} needs 'image_transform_args'")
    try:
        manifest = load_manifest(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{group.name}.{name}: cannot read the converted dataset at {path}: {exc}") from exc
    if manifest.get("group") != group.name:
        raise ConfigError(f"{path}: converted for group {manifest.get('group')!r}, registered under {group.name!r}")
    Image.MAX_IMAGE_PIXELS = PIL_MAX_IMAGE_PIXELS  # header reads only; same limit as the readers
    enc = _Encoder(tokenizer)
    est_fn = _ESTIMATORS[group.name]
    st = DatasetStats(group.name, name, path, int(manifest["num_samples"]))
    total = st.samples if max_samples is None else min(st.samples, max_samples)
    with tqdm(total=total, desc=f"{group.name}/{name}", unit="sample", disable=not progress or None,
              leave=False) as bar:
        for _, parts in _iter_samples(path, manifest):
            if st.read >= total:
                break
            st.read += 1
            bar.update(1)
            try:
                meta = json.loads(parts.get(META_PART, b"null"))
                if not isinstance(meta, dict) or meta.get("group") != group.name:
                    raise _Unusable("bad_meta")
                st.estimates.append(est_fn(meta, parts, group, enc))
            except _Unusable as u:
                st.unusable[u.reason] += 1
    return st


def _over(est: float, limit: int, mandatory: bool) -> bool:
    """The packer's per-sample drop rule: mandatory ``est >= limit``, otherwise ``est > limit``."""
    return est >= limit if mandatory else est > limit


@dataclass
class GroupStats:
    """A group's datasets plus its config (weight, mandatory, transforms)."""

    group: GroupConfig
    datasets: list[DatasetStats]

    @property
    def estimates(self) -> list[SampleEstimate]:
        return [e for d in self.datasets for e in d.estimates]

    def over(self, limit: int) -> tuple[int, int]:
        """(always dropped, dropped for some random choices) under ``max_num_tokens_per_sample = limit``."""
        m = self.group.is_mandatory
        always = sum(_over(e.lo, limit, m) for e in self.estimates)
        some = sum(_over(e.hi, limit, m) and not _over(e.lo, limit, m) for e in self.estimates)
        return always, some


# --------------------------------------------------------------------------------------------------
# Budget advisor: the official pack loop replayed on estimates


@dataclass(frozen=True)
class Candidate:
    """Budgets to try: ``label`` and the packer config (other knobs as configured)."""

    label: str
    packer: PackerConfig


@dataclass
class SimResult:
    """Replay outcome: ``packs`` built, ``fill`` = mean sequence_length / max_num_tokens, ``samples_per_pack``,
    ``dropped_share`` = dropped (over the per-sample limit, or discarded by a flush) / consumed,
    ``impossible`` = why no batch can ever be produced (None when packs were built)."""

    packs: int = 0
    fill: float = 0.0
    samples_per_pack: float = 0.0
    dropped_share: float = 0.0
    over_limit: int = 0
    flushed: int = 0
    consumed: int = 0
    impossible: str | None = None


def simulate_packing(streams: Sequence[Sequence[int]], weights: Sequence[float], mandatory: Sequence[bool],
                     names: Sequence[str], packer: PackerConfig, *, packs: int = 200, seed: int = 0,
                     max_draws: int = 200_000) -> SimResult:
    """Replay the official loop (spec §5) on per-group length streams (tokens, cycled) for ``packs`` packs.

    CFG dropout is ignored (packed length = estimate). A mandatory group with no sample under the limit,
    or ``max_draws`` draws without a pack, gives ``impossible``.
    """
    limit, cap = packer.max_num_tokens_per_sample, packer.max_num_tokens
    for s, m, n in zip(streams, mandatory, names):
        if m and not any(x < limit for x in s):
            return SimResult(impossible=f"mandatory group {n!r}: no sample is estimated under "
                                        f"max_num_tokens_per_sample {limit}: the packer drops every sample and "
                                        "never yields a batch")
    if not any(s for s in streams):
        return SimResult(impossible="no usable samples")
    rng = random.Random(seed)
    pos = [0] * len(streams)
    total = sum(weights)
    cum = [sum(weights[:i + 1]) / total for i in range(len(weights))]
    res = SimResult()
    lens: list[int] = []
    counts: list[int] = []

    def draw(i: int) -> int | None:
        s = streams[i]
        if not s:
            return None
        v = s[pos[i] % len(s)]
        pos[i] += 1
        res.consumed += 1
        return v

    buffer: list[int] = []
    draws = 0
    while len(lens) < packs:
        curr, n = 0, 0
        for i, m in enumerate(mandatory):
            if not m:
                continue
            while True:
                v = draw(i)
                draws += 1
                if v is not None and v < limit:
                    break
                res.over_limit += 1
            curr, n = curr + v, n + 1
        while True:
            draws += 1
            if draws > max_draws:
                res.impossible = res.impossible or f"no pack after {max_draws} draws"
                break
            if curr < packer.prefer_buffer_before and buffer:
                v, from_buffer = buffer.pop(0), True
            else:
                u = rng.random()
                i = next((k for k, c in enumerate(cum) if u < c), 0)
                v, from_buffer = draw(i), False
                if v is None:
                    continue
            if v > limit:
                res.over_limit += 1
                continue
            if curr + v > cap:
                if len(buffer) < packer.max_buffer_size and not from_buffer:
                    buffer.append(v)
                    continue
                res.flushed += 1
                break
            curr, n = curr + v, n + 1
            if curr >= packer.expected_num_tokens:
                break
        if res.impossible:
            break
        lens.append(curr)
        counts.append(n)
    if lens:
        res.packs = len(lens)
        res.fill = sum(lens) / len(lens) / cap
        res.samples_per_pack = sum(counts) / len(counts)
        res.impossible = None if res.packs == packs else res.impossible
    res.dropped_share = (res.over_limit + res.flushed) / max(res.consumed, 1)
    return res


def _round_up(x: float, k: int = 128) -> int:
    return int(math.ceil(x / k) * k)


def candidate_budgets(packer: PackerConfig, groups: Sequence[GroupStats]) -> list[Candidate]:
    """The configured budgets, half and double of them, the official default and fine-tuning budgets, and
    "fits all": the smallest 128-multiples keeping every sample (given the number of mandatory groups).

    Candidates other than "configured" also raise ``max_latent_size`` / ``max_num_patch_per_side`` to what
    the groups' transforms need (extrapolated position ids), so they are not refused for that.
    """
    latent, vit = packer.max_latent_size, packer.max_num_patch_per_side
    if not packer.interpolate_pos:
        for g in groups:
            t = g.group.transform()
            if t is None:
                continue
            if g.group.name in (T2I, EDIT):
                latent = max(latent, math.ceil(transform_extremes(t).max_side_px / packer.vae_image_downsample))
            else:
                vit = max(vit, math.ceil(transform_extremes(t).max_side_px / packer.vit_patch_size))
            vt = g.group.vit_transform() if g.group.name == EDIT else None
            if vt is not None:
                vit = max(vit, math.ceil(transform_extremes(vt).max_side_px / packer.vit_patch_size))

    def scaled(label: str, e: int, m: int, s: int) -> Candidate:
        pbb = max(1, min(m - 1, round(packer.prefer_buffer_before * m / packer.max_num_tokens)))
        return Candidate(label, replace(packer, expected_num_tokens=e, max_num_tokens=m,
                                        max_num_tokens_per_sample=min(s, m), prefer_buffer_before=pbb,
                                        max_latent_size=latent, max_num_patch_per_side=vit))

    p = packer
    out = [Candidate("configured", p),
           scaled("half", p.expected_num_tokens // 2, p.max_num_tokens // 2, p.max_num_tokens_per_sample // 2),
           scaled("double", p.expected_num_tokens * 2, p.max_num_tokens * 2, p.max_num_tokens_per_sample * 2),
           scaled("BAGEL default", 32768, 36864, 16384),
           scaled("BAGEL fine-tune", 10240, 11520, 10240)]
    his = [e.hi for g in groups for e in g.estimates]
    if his:
        s = _round_up(max(his) + 1)
        n_mand = max(1, sum(g.group.is_mandatory for g in groups))
        m = _round_up(max(n_mand * (s - 1), s, p.max_num_tokens))
        out.append(scaled("fits all", min(p.expected_num_tokens, m), m, s))
    seen, uniq = set(), []
    for c in out:
        key = (c.packer.expected_num_tokens, c.packer.max_num_tokens, c.packer.max_num_tokens_per_sample)
        if key not in seen:
            seen.add(key)
            uniq.append(c)
    return uniq


# --------------------------------------------------------------------------------------------------
# Report


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
        for g in self.groups:
            for d in g.datasets + ([] if len(g.datasets) == 1 else [None]):
                ds = d.estimates if d else g.estimates
                label = f"{g.group.name}/{d.name}" if d else f"{g.group.name} (all)"
                gs = GroupStats(g.group, [d] if d else g.datasets)
                always, some = gs.over(lim)
                means = sorted(e.mean for e in ds)
                q = (lambda f: str(round(means[min(len(means) - 1, int(f * len(means)))])) if means else "-")
                unusable = sum((d.unusable if d else sum((x.unusable for x in g.datasets), Counter())).values())
                rows.append((label, str(sum(x.samples for x in gs.datasets)), str(sum(x.read for x in gs.datasets)),
                             str(unusable), str(min(e.lo for e in ds)) if ds else "-", q(0.1), q(0.5), q(0.9),
                             str(max(e.hi for e in ds)) if ds else "-",
                             f"{sum(means) / len(means):.0f}" if means else "-", str(always), str(some),
                             f"{max((e.vae_side for e in ds), default=0)}/side",
                             f"{max((e.vit_side for e in ds), default=0)}/side"))
        lines += _table(head, rows)
        reasons = Counter()
        for g in self.groups:
            for d in g.datasets:
                reasons.update({f"{d.group}/{d.name}: {r}": n for r, n in d.unusable.items()})
        if reasons:
            lines += ["", "unusable samples (the cooker drops them):"]
            lines += [f"  {k}: {n}" for k, n in sorted(reasons.items())]
        lines += ["", "budget advisor (official pack loop replayed on the mean estimates, CFG dropout ignored):"]
        head = ("candidate", "expected", "max", "per-sample", "fill", "samples/pack", "dropped", "config check")
        rows = []
        for c, r, issues in self.advice:
            errs = [i for i in issues if i.level == "error"]
            cp = c.packer
            rows.append((c.label, str(cp.expected_num_tokens), str(cp.max_num_tokens),
                         str(cp.max_num_tokens_per_sample),
                         "never" if r.impossible else f"{r.fill:.1%}",
                         "-" if r.impossible else f"{r.samples_per_pack:.1f}",
                         f"{r.dropped_share:.1%}" if r.consumed else "-",
                         f"refused: {errs[0].key}" if errs else "ok"))
        lines += _table(head, rows)
        lines += ["", "findings:" if self.findings else "findings: none"]
        lines += [f"  {f.level.upper()}: {f.message}" for f in self.findings]
        if self.histogram:
            lines += ["", f"histogram: {self.histogram}"]
        return "\n".join(lines)


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    return [fmt.format(*head).rstrip(), "  ".join("-" * w for w in widths)] + [fmt.format(*r).rstrip() for r in rows]


def _data_findings(packer: PackerConfig, groups: Sequence[GroupStats], pw: str) -> list[BudgetIssue]:
    """What only the data show (see the module docstring)."""
    out = []
    lim = packer.max_num_tokens_per_sample
    for g in groups:
        ests = g.estimates
        name = g.group.name
        if not ests:
            if any(d.read for d in g.datasets):
                never = ": the packer never yields a batch" if g.group.is_mandatory else ""
                out.append(BudgetIssue("error" if never else "warning", "data",
                                       f"group {name!r}: no usable sample (all dropped for data "
                                       f"errors){never}"))
            continue
        always, some = g.over(lim)
        if g.group.is_mandatory and always == len(ests):
            smallest = min(e.lo for e in ests)
            out.append(BudgetIssue("error", f"{pw}.max_num_tokens_per_sample", (
                f"mandatory group {name!r}: every one of its {len(ests)} samples is estimated at >= {smallest} "
                f"tokens, not under {pw}.max_num_tokens_per_sample {lim}: the packer drops them one after another "
                f"and never yields a batch. Raise {pw}.max_num_tokens_per_sample above {smallest} (and "
                f"{pw}.max_num_tokens) or lower the group's image_transform_args.max_image_size")))
        elif always == len(ests):
            out.append(BudgetIssue("warning", f"{pw}.max_num_tokens_per_sample", (
                f"group {name!r}: every sample is over {pw}.max_num_tokens_per_sample {lim}: its draws are all "
                "wasted")))
        elif always + some:
            share = (always + some) / len(ests)
            if share >= 0.1:
                out.append(BudgetIssue("warning", f"{pw}.max_num_tokens_per_sample", (
                    f"group {name!r}: {always + some} of {len(ests)} samples ({share:.0%}) can be over "
                    f"{pw}.max_num_tokens_per_sample {lim} and are dropped")))
        if g.group.name in (T2I, EDIT):
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


def collect_stats(groups: Sequence[ResolvedGroup], packer: PackerConfig, tokenizer: Any, *, source: str = "groups",
                  packer_where: str = "data.packer", max_samples: int | None = None, progress: bool = True,
                  sim_packs: int = 200, histogram: str | None = None) -> StatsReport:
    """Read every dataset of ``groups`` once and build the report (see the module docstring).

    ``tokenizer``: anything with ``encode(str) -> list[int]`` (the job's tokenizer). ``histogram``: PNG path
    to write (None = none). Raises ConfigError for a dataset without ``energon_path`` or manifest.
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
    findings += _data_findings(packer, gstats, packer_where)
    findings.sort(key=lambda i: i.level != "error")
    rng = random.Random(0)
    streams = []
    for g in gstats:
        s = [round(e.mean) for e in g.estimates]
        rng.shuffle(s)
        streams.append(s)
    advice = []
    for c in candidate_budgets(packer, gstats):
        r = simulate_packing(streams, [g.group.weight for g in gstats], [g.group.is_mandatory for g in gstats],
                             [g.group.name for g in gstats], c.packer, packs=sim_packs)
        advice.append((c, r, budget_issues(c.packer, cfg_groups, source=source, packer_where=packer_where)))
    sampled = max_samples is not None and any(d.read < d.samples for g in gstats for d in g.datasets)
    report = StatsReport(source, packer, gstats, advice, findings, sampled=sampled, packer_where=packer_where)
    if histogram:
        report.histogram = draw_histogram(report, histogram)
    return report


def draw_histogram(report: StatsReport, path: str, *, bins: int = 30) -> str:
    """Write one panel per group: histogram of mean estimated tokens per sample, the per-sample limit as a red
    line. Drawn with Pillow's ImageDraw (matplotlib is not a dependency). Returns ``path``."""
    from PIL import ImageDraw

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
        d.line([(x0, y1), (x1, y1)], fill="black")
        d.line([(x0, y0), (x0, y1)], fill="black")
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


def job_stats(config: str, overrides: Sequence[str] = (), *, tokenizer: Any = None, **kw: Any) -> StatsReport:
    """``bagel-data stats --config JOB.yaml``: load the job config (generating ``demo_data`` when set and
    missing), the groups and registry *without* refusing bad budgets, the tokenizer, then :func:`collect_stats`.

    Raises ConfigError for an invalid config or an unconverted dataset.
    """
    from .job.config import load_job_config

    cfg = load_job_config(config, list(overrides))
    if cfg.demo_data:
        from .converter.demo import make_demo_data

        make_demo_data(cfg.demo_data, seed=cfg.demo_seed)
    data = cfg.data
    groups = resolve_groups(load_grouped_yaml(data.groups), load_dataset_info(data.dataset_info),
                            source=str(data.dataset_info))
    if tokenizer is None:
        from .tokenizer import load_tokenizer

        tokenizer = load_tokenizer(data.tokenizer)
    return collect_stats(groups, data.packer, tokenizer, source=str(data.groups), **kw)
