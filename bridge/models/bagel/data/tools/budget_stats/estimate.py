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

import functools
import io
import itertools
import json
import os
import tarfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from ...config.budgets import image_tokens
from ...config import ConfigError, GroupConfig
from ...config.outcomes import Outcome, Text, edit_outcomes, summary, t2i_outcomes, vlm_outcome
from ...energon.layout.damage import diagnose
from ...energon.layout import EDIT, META_PART, T2I, VLM, load_manifest
from ...energon.layout.shards import shard_samples
from ...errors import DataReadError
from ...config.lengths import is_overlength
from ...packing.cost import Work, expected_work
from ...transforms import ImageTransform, PIL_MAX_IMAGE_PIXELS

__all__ = ["DatasetStats", "GroupStats", "SampleEstimate", "dataset_stats"]


@dataclass(frozen=True)
class SampleEstimate:
    """One sample's estimated packed length (tokens): ``lo`` / ``hi`` over the reader's random choices, ``mean``
    their expectation; ``work`` below; ``vae_side`` / ``vit_side`` its largest image side in patches (0 = none),
    ``vae_px`` its largest VAE image side in pixels after the transform."""

    lo: int
    hi: int
    mean: float
    #: What the sample asks of the model (``packing.cost.Work``), its expectation over the reader's random
    #: choices (mean text lengths; CFG dropout ignored): the straggler prediction's cost of the sample.
    work: Work = Work()
    vae_side: int = 0
    vit_side: int = 0
    vae_px: int = 0


class _Unusable(Exception):
    """The cooker turns this sample into a tombstone (the one argument: the reason, as in
    ``energon.cooking.common.DROP_REASONS``).

    Not ``energon.cooking.common.DropSample``: that module imports Megatron-Energon, which t2i / edit estimates
    need not.
    """


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


#: A text's length in tokens: ``len(tokenizer.encode(text))``, memoized (captions and instructions repeat).
_Encoder = Callable[[str], int]


def _estimate(outcomes: Sequence[Outcome], **sides: int) -> SampleEstimate:
    """The sample's estimate and expected work from its layouts (``config.outcomes``, ``packing.cost``)."""
    return SampleEstimate(*summary(outcomes), work=expected_work(outcomes), **sides)


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
    side, px = _side(t, w, h)
    lens = [enc(v) for v in caps.values()] or [enc(" ")]
    return _estimate(t2i_outcomes(image_tokens(t, w, h), lens), vae_side=side, vae_px=px)


def _text_items(conversations: Any, num_images: int, enc: _Encoder) -> list[tuple[str, int]]:
    """``(kind, tokens)`` of a conversation's items (``cooking.vlm.conversation_elements``: tokens 0 for an image);
    unusable as the cooker drops it, or without a text item with loss."""
    from ...energon.cooking.common import DropSample
    from ...energon.cooking.vlm import conversation_elements

    try:
        elements = conversation_elements(conversations, num_images)
    except DropSample as d:
        raise _Unusable(d.reason) from None
    if not any(has_loss and kind == "text" and enc(text) for kind, text, has_loss in elements):
        raise _Unusable("no_loss_item")
    return [(kind, enc(text) if kind == "text" else 0) for kind, text, _ in elements]


def _vlm(meta: dict, parts: dict[str, bytes], g: GroupConfig, enc: _Encoder) -> SampleEstimate:
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
    items = _text_items(rec.get("conversations"), len(sizes), enc)
    toks = [image_tokens(t, w, h, len(sizes)) for w, h in sizes]
    side = max((_side(t, w, h, len(sizes))[0] for w, h in sizes), default=0)
    return _estimate([vlm_outcome(items, toks)], vit_side=side)


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
    from ...energon.cooking.video import VIDEO_TAG, FrameSampler
    from ...energon.cooking.vlm import IMAGE_TOKEN

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
    outcomes, side = [], 0
    p = 1 / (sampler.max_num_frames - sampler.min_num_frames + 1)  # the frame count: uniform over [min, max]
    for drawn in range(sampler.min_num_frames, sampler.max_num_frames + 1):
        n = min(drawn, vlen) if folder else drawn
        conv = [dict(x) for x in turns] if isinstance(turns, list) else turns
        if conv:
            conv[0]["value"] = conv[0]["value"].replace(VIDEO_TAG, IMAGE_TOKEN * n)
        frames = [image_tokens(t, w, h, n)] * n
        outcomes.append(vlm_outcome(_text_items(conv, n, enc), frames)._replace(probability=p))
        side = max(side, _side(t, w, h, n)[0])
    return _estimate(outcomes, vit_side=side)


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

    def text_lens(step: int) -> Text:
        return Text.of([enc(a) for a in instr[step]])._replace(alts=())  # combined: mean lengths

    def concat_lens(steps: list[int]) -> Text:
        combos = [[]]
        for st in steps:
            combos = [c + [a] for c in combos for a in instr[st]]
            if len(combos) > 256:  # too many to tokenize: bound by the pieces' lengths
                lo = sum(min(enc(a + ". ") for a in instr[s]) for s in steps)
                hi = sum(max(enc(a + ". ") for a in instr[s]) for s in steps)
                return Text(lo, hi, (lo + hi) / 2)
        return Text.of([enc("".join(a + ". " for a in c).rstrip()) for c in combos])._replace(alts=())

    vae_side, vae_px = max(_side(t, w, h) for w, h in sizes)
    vit_side = max(_side(vt, w, h)[0] for w, h in sizes) if vt is not None else 0
    return _estimate(edit_outcomes(vae, vit, text_lens, concat_lens), vae_side=vae_side, vit_side=vit_side,
                     vae_px=vae_px)


_ESTIMATORS: dict[str, Callable[[dict, dict, GroupConfig, _Encoder], SampleEstimate]] = {
    T2I: _t2i, VLM: _vlm, EDIT: _edit}


def _iter_samples(ds_root: str, manifest: dict) -> Iterator[dict[str, bytes]]:
    """``{part: bytes}`` of every sample, in shard order (``energon.layout.shards.shard_samples``).

    Raises ``DataReadError`` (one line: the damaged or missing file and what to do, ``damage.diagnose``) when a
    shard cannot be read (cut short, missing, unreadable storage), instead of tarfile's or the OS's error."""
    for shard in manifest["shards"]:
        path = os.path.join(ds_root, shard["path"])
        n = 0
        try:
            for n, (_, parts) in enumerate(shard_samples(path), 1):
                yield dict(parts)
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise DataReadError(diagnose([ds_root], shard["path"]) or f"shard {path} cannot be read ("
                                f"{type(exc).__name__}: {' '.join(str(exc).split())}): check its storage or convert "
                                "again") from exc
        if n != shard["count"]:  # cut at a tar block boundary: tarfile ends there as if the archive did
            raise DataReadError(diagnose([ds_root], shard["path"]) or f"shard {path} holds {n} samples, the "
                                f"manifest {shard['count']}: convert it again with --overwrite or restore the file")


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
    enc: _Encoder = functools.cache(lambda text: len(tokenizer.encode(text)))
    est_fn = _ESTIMATORS[group.name]
    st = DatasetStats(group.name, name, path, int(manifest["num_samples"]))
    total = st.samples if max_samples is None else min(st.samples, max_samples)
    with tqdm(total=total, desc=f"{group.name}/{name}", unit="sample", disable=not progress or None,
              leave=False) as bar:
        for parts in itertools.islice(_iter_samples(path, manifest), total):
            st.read += 1
            bar.update(1)
            try:
                meta = json.loads(parts.get(META_PART, b"null"))
                if not isinstance(meta, dict) or meta.get("group") != group.name:
                    raise _Unusable("bad_meta")
                st.estimates.append(est_fn(meta, parts, group, enc))
            except _Unusable as u:
                st.unusable[u.args[0]] += 1
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
