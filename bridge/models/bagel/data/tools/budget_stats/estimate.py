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
from ...transforms import ImageTransform, PIL_MAX_IMAGE_PIXELS

__all__ = ["DatasetStats", "GroupStats", "SampleEstimate", "dataset_stats"]

logger = logging.getLogger(__name__)


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
    """The cooker turns this sample into a tombstone (``reason`` as in ``cook_common.DROP_REASONS``).

    Not ``cook_common.DropSample``: that module imports Megatron-Energon, which t2i / edit estimates need not.
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
        limit`` tokens (:func:`..packing.lengths.is_overlength`)."""
        m = self.group.is_mandatory
        always = sum(is_overlength(e.lo, limit, m) for e in self.estimates)
        some = sum(is_overlength(e.hi, limit, m) and not is_overlength(e.lo, limit, m) for e in self.estimates)
        return always, some
