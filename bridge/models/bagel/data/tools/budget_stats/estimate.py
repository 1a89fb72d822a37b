"""Per-sample token estimates from a converted dataset's metadata (``meta.json`` + image headers).

No pixel is decoded: the converter's manifest records no image sizes, but an image header gives the exact
input size, which is all the resize rule needs. Each usable sample gets a :class:`SampleEstimate` from the
packer's own rule (:mod:`..budgets`: ``num_tokens + 2 * plan items``, images after the group's transform);
a sample the cooker would turn into a tombstone for a recorded data error is counted by reason instead.

Known approximations: corrupt pixel data behind a valid header is not detected; edit rows are checked for
null images / malformed instruction lists as a whole, whereas the reader only fails on the images and steps
a draw reaches.
"""

from __future__ import annotations

import io
import json
import logging
import os
import tarfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from ...config.budgets import edit_outcomes, image_tokens, t2i_estimate, vlm_estimate
from ...config import ConfigError, GroupConfig
from ...energon.layout.damage import diagnose
from ...energon.layout import EDIT, META_PART, T2I, VLM, load_manifest
from ...errors import DataReadError
from ...config.lengths import is_overlength
from ...packing.cost import Work, split_pairs
from ...transforms import ImageTransform, PIL_MAX_IMAGE_PIXELS

__all__ = ["DatasetStats", "GroupStats", "SampleEstimate", "dataset_stats", "layout_work"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampleEstimate:
    """Estimated packed length of one sample (tokens): ``lo`` / ``hi`` over the reader's random choices,
    ``mean`` their expectation; ``vae_side`` / ``vit_side`` the largest image side in patches (0 = none),
    ``vae_px`` the largest VAE image side in pixels after the transform; ``work`` below."""

    lo: int
    hi: int
    mean: float
    vae_side: int = 0
    vit_side: int = 0
    vae_px: int = 0
    #: What the sample asks of the model (``packing.cost.Work``), its expectation over the reader's random
    #: choices (mean text lengths; CFG dropout ignored): the straggler prediction's cost of the sample.
    work: Work = Work()


class _Unusable(Exception):
    """The cooker turns this sample into a tombstone (``reason`` as in ``energon.cooking.common.DROP_REASONS``).

    Not ``energon.cooking.common.DropSample``: that module imports Megatron-Energon, which t2i / edit estimates need not.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _sizes(parts: dict[str, bytes], indexes: Sequence[int]) -> list[tuple[int, int]]:
    """(width, height) in pixels of image parts from their headers; a missing/unreadable part is unusable."""
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
    """Long side of a ``w`` x ``h`` px image after ``t``: (patches = px // stride, px)."""
    oh, ow = t.target_size(w, h, img_num)
    return max(oh, ow) // t.stride, max(oh, ow)


class _Encoder:
    """``tokenizer.encode`` lengths in tokens, memoized (captions and instructions repeat)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[str, int] = {}

    def __call__(self, text: str) -> int:
        n = self.cache.get(text)
        if n is None:
            n = self.cache[text] = len(self.tokenizer.encode(text))
        return n


def layout_work(items: list[tuple[str, float]]) -> Work:
    """The work of a sample laid out as ``items``: (mode, tokens without the two special tokens) per plan item, in
    order, one split each (``causal`` text, ``full`` ViT or clean VAE image, ``noise`` noised VAE target); ViT
    items are ``full`` splits marked ``vit``, VAE ones ``vae`` (``("full", n, "vae")``-style triples accepted)."""
    lens = [n + 2 for _, n, *_ in items]
    modes = [m for m, *_ in items]
    vit = [n for m, n, *k in items if k and k[0] == "vit"]
    vae = sum(n for m, n, *k in items if k and k[0] == "vae")
    return Work(tokens=sum(lens), attn_pairs=split_pairs(lens, modes), vit_tokens=sum(vit),
                vit_pairs=sum(n * n for n in vit), vae_tokens=vae)


def _mean_work(works: list[tuple[float, Work]]) -> Work:
    """The expectation of (probability, work) pairs."""
    out = Work()
    for p, w in works:
        out = out.plus(w.scaled(p))
    return out


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
    work = _mean_work([(1 / len(lens), layout_work([("causal", n), ("noise", img, "vae")])) for n in lens])
    return SampleEstimate(t2i_estimate(img, min(lens)), t2i_estimate(img, max(lens)),
                          t2i_estimate(img, 0) + sum(lens) / len(lens), vae_side=side, vae_px=px, work=work)


def _vlm(meta: dict, parts: dict[str, bytes], g: GroupConfig, enc: _Encoder) -> SampleEstimate:
    from ...energon.cooking.common import DropSample
    from ...energon.cooking.vlm import conversation_elements

    t = g.transform()
    try:
        rec = json.loads(meta.get("raw_line") or "")
    except ValueError:
        raise _Unusable("bad_json") from None
    if not isinstance(rec, dict):
        raise _Unusable("bad_record")
    if "image" not in rec and "video" in rec:
        return _video(rec, meta, parts, g, enc)
    if meta.get("image_errors"):  # recorded by the converter: missing file, wrong type, unreadable
        raise _Unusable("missing_image")
    names = meta.get("image_names") or []
    sizes = _sizes(parts, range(len(names)))
    try:
        elements = conversation_elements(rec.get("conversations"), len(sizes))
    except DropSample as d:
        raise _Unusable(d.reason) from None
    toks = [image_tokens(t, w, h, len(sizes)) for w, h in sizes]
    texts, images, loss = [], 0, False
    items: list[tuple] = []
    for kind, text, has_loss in elements:
        if kind == "text":
            n = enc(text)
            texts.append(n)
            loss |= bool(has_loss and n)
            if n:
                items.append(("causal", n))
        else:
            items.append(("full", toks[images], "vit"))
            images += 1
    if not loss:
        raise _Unusable("no_loss_item")
    side = max((_side(t, w, h, len(sizes))[0] for w, h in sizes), default=0)
    est = vlm_estimate(toks, texts, images)
    return SampleEstimate(est, est, float(est), vit_side=side, work=layout_work(items))


def _video_frames(meta: dict, parts: dict[str, bytes]) -> tuple[int, int, int, bool]:
    """``(frames, width, height, folder)`` of a video record from its stored parts: a folder's first frame header,
    a file's stream through decord (one frame decoded for its size)."""
    info = meta.get("video") if isinstance(meta.get("video"), dict) else {}
    if info.get("folder"):
        n = int(info.get("num_frames", 0))
        if n == 0:
            raise _Unusable("missing_video")
        (w, h), = _sizes(parts, [0])
        return n, w, h, True
    from ...energon.cooking.video import require_decord

    decord = require_decord("bagel-data stats")
    try:
        reader = decord.VideoReader(io.BytesIO(parts["img0"]), num_threads=1)
        h, w = reader[0].shape[:2]
        return len(reader), w, h, False
    except Exception:  # noqa: BLE001 - the cooker drops what decord cannot read
        raise _Unusable("video_decode_error") from None


def _video(rec: dict, meta: dict, parts: dict[str, bytes], g: GroupConfig, enc: _Encoder) -> SampleEstimate:
    """A video record: ``t`` uniform in ``[min_num_frames, max_num_frames]`` (a folder of ``vlen <= t`` frames keeps
    its ``vlen``), every frame of the input size resized with ``img_num`` = the frame count (``cooking.video``)."""
    from ...energon.cooking.common import DropSample
    from ...energon.cooking.video import VIDEO_TAG, FrameSampler
    from ...energon.cooking.vlm import IMAGE_TOKEN, conversation_elements

    if (meta.get("image_errors") or {}).get("video") is not None:
        raise _Unusable("missing_video")
    sampler = FrameSampler.of(g.frame_sampler_args)
    if sampler is None:
        raise _Unusable("no_frame_sampler")
    vlen, w, h, folder = _video_frames(meta, parts)
    turns = rec.get("conversations")
    if isinstance(turns, list) and turns and isinstance(turns[0], dict) and isinstance(turns[0].get("value"), str):
        if VIDEO_TAG not in turns[0]["value"]:
            raise _Unusable("video_tag_missing")
    t = g.transform()
    ests, works, side = [], [], 0
    for drawn in range(sampler.min_num_frames, sampler.max_num_frames + 1):
        n = min(drawn, vlen) if folder else drawn
        conv = [dict(x) for x in turns] if isinstance(turns, list) else turns
        if conv:
            conv[0]["value"] = conv[0]["value"].replace(VIDEO_TAG, IMAGE_TOKEN * n)
        try:
            elements = conversation_elements(conv, n)
        except DropSample as d:
            raise _Unusable(d.reason) from None
        tok = image_tokens(t, w, h, n)
        texts = [enc(text) for kind, text, _ in elements if kind == "text"]
        if not any(has_loss and enc(text) for kind, text, has_loss in elements if kind == "text"):
            raise _Unusable("no_loss_item")
        items = [("causal", enc(text)) if kind == "text" else ("full", tok, "vit") for kind, text, _ in elements
                 if kind != "text" or enc(text)]
        ests.append(vlm_estimate([tok] * n, texts, n))
        works.append((1 / (sampler.max_num_frames - sampler.min_num_frames + 1), layout_work(items)))
        side = max(side, _side(t, w, h, n)[0])
    return SampleEstimate(min(ests), max(ests), sum(ests) / len(ests), vit_side=side, work=_mean_work(works))


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
    work = _edit_work(vae, vit, lambda st: text_lens(st)[2], lambda steps: concat_lens(steps)[2])
    vae_side, vae_px = max(_side(t, w, h) for w, h in sizes)
    vit_side = max(_side(vt, w, h)[0] for w, h in sizes) if vt is not None else 0
    return SampleEstimate(min(o.lo for o in outs), max(o.hi for o in outs), sum(o.probability * o.mean for o in outs),
                          vae_side=vae_side, vit_side=vit_side, vae_px=vae_px, work=work)


def _edit_work(vae: Sequence[int], vit: Sequence[int], text_mean: Callable[[int], float],
               concat_mean: Callable[[list[int]], float]) -> Work:
    """The expected work of an edit row over the reader's draws (the outcomes of ``budgets.edit_outcomes``, spec
    §4.5; mean instruction lengths): context clean VAE + ViT, then the concatenated instruction and the target,
    or per step its instruction, and a noised + clean VAE + ViT copy of each intermediate image, the target
    noised last. ``vit[i]`` 0 = no ViT copy."""
    n = len(vae)

    def image(i: int, clean: bool) -> list[tuple]:
        out: list[tuple] = [] if clean else [("noise", vae[i], "vae")]
        if clean:
            out.append(("full", vae[i], "vae"))
            if vit[i]:
                out.append(("full", vit[i], "vit"))
        return out

    works: list[tuple[float, Work]] = []
    for s in range(n - 1):
        ends = list(range(s + 1, min(s + 3, n)))
        for e in ends:
            p = 1.0 / (n - 1) / len(ends)
            ctx = image(s, True)
            variants = [("step", p)] if e - s == 1 else [("concat", p / 2), ("step", p / 2)]
            for kind, q in variants:
                if kind == "concat":
                    e2 = e - 1 if e == n - 1 else e
                    items = ctx + [("causal", concat_mean(list(range(s, e2))))] + image(e2, False)
                else:
                    items = list(ctx)
                    for i in range(s + 1, e + 1):
                        items.append(("causal", text_mean(i - 1)))
                        items += image(i, False) + (image(i, True) if i != e else [])
                works.append((q, layout_work(items)))
    return _mean_work(works)


_ESTIMATORS: dict[str, Callable[[dict, dict, GroupConfig, _Encoder], SampleEstimate]] = {
    T2I: _t2i, VLM: _vlm, EDIT: _edit}


def _iter_samples(ds_root: str, manifest: dict) -> Iterator[tuple[str, dict[str, bytes]]]:
    """(key, {part: bytes}) of every sample, in shard order (parts of a sample are consecutive members).

    Raises ``DataReadError`` (one line: the damaged or missing file and what to do, ``damage.diagnose``) when a
    shard cannot be read (cut short, missing, unreadable storage), instead of tarfile's or the OS's error."""
    for shard in manifest["shards"]:
        path = os.path.join(ds_root, shard["path"])
        n = 0
        try:
            for sample in _shard_samples(path):
                n += 1
                yield sample
        except (tarfile.TarError, EOFError, OSError) as exc:
            found = diagnose([ds_root], shard["path"])
            raise DataReadError(found or f"shard {path} cannot be read ({type(exc).__name__}: "
                                         f"{' '.join(str(exc).split())}): check its storage or convert again") from exc
        if n != shard["count"]:  # cut at a tar block boundary: tarfile ends there as if the archive did
            raise DataReadError(diagnose([ds_root], shard["path"]) or f"shard {path} holds {n} samples, the "
                                f"manifest {shard['count']}: convert it again with --overwrite or restore the file")


def _shard_samples(path: str) -> Iterator[tuple[str, dict[str, bytes]]]:
    """The samples of one shard (see :func:`_iter_samples`)."""
    with tarfile.open(path, "r") as tar:
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


@dataclass
class GroupStats:
    """A group's datasets plus its config (weight, mandatory, transforms)."""

    group: GroupConfig
    datasets: list[DatasetStats]

    @property
    def estimates(self) -> list[SampleEstimate]:
        return [e for d in self.datasets for e in d.estimates]

    def over(self, limit: int) -> tuple[int, int]:
        """(always dropped, dropped for some random choices) sample counts under ``max_num_tokens_per_sample =
        limit`` tokens (:func:`..config.lengths.is_overlength`)."""
        m = self.group.is_mandatory
        always = sum(is_overlength(e.lo, limit, m) for e in self.estimates)
        some = sum(is_overlength(e.hi, limit, m) and not is_overlength(e.lo, limit, m) for e in self.estimates)
        return always, some
