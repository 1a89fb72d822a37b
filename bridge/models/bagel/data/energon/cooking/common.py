"""Shared pieces of the BAGEL cookers: recorded/replayed random choices, tombstones, image decoding.

The official source datasets draw from Python's global ``random`` (``choice`` / ``random()``), and the video
frame sampler also from numpy's global RNG (:mod:`.video`). :class:`Draws` makes exactly the same calls on a given
generator (the ``random`` module itself in the official order, a private ``random.Random`` per selection position
and epoch in the elastic order) and records the outcome, or replays it without touching any generator.
"""

from __future__ import annotations

import io
import json
import random as _random_module
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from megatron.energon.task_encoder.cooking import basic_sample_keys

from PIL import Image

from ...transforms import ImageTransform, configure_pil, pil_img2rgb
from ..layout import META_PART, TRUNCATED_IMAGE, VLM, image_index, image_part, image_truncation
from ..layout.checksums import CHECKSUM_MISMATCH, ChecksumTable
from .sample import BagelSample

__all__ = ["CookContext", "Draws", "DropSample", "ReplayError", "SampleCookError", "cook_with", "decode_image",
           "load_meta", "plan_item", "transform_image", "DROP_REASONS", "UNUSED_REASONS"]

#: Every tombstone reason a cooker can produce (stable snake_case strings).
DROP_REASONS: tuple[str, ...] = (
    "bad_meta",            # meta.json part missing / not JSON / wrong group
    "missing_image",       # image null in the raw data, or the referenced file did not exist at conversion
    "image_decode_error",  # image bytes PIL cannot decode (or convert / resize)
    "bad_captions_json",   # t2i: captions null / not JSON / not a {key: str} object
    "too_few_images",      # edit: fewer than 2 images (official: IndexError on the first draw)
    "bad_instructions",    # edit: instruction_list null / too short / not lists of str
    "empty_alternatives",  # edit: the alternatives list of a step that is reached is empty
    "bad_json",            # vlm: the line is not valid JSON
    "bad_record",          # vlm: JSON but not a usable record (no conversations list, bad image entry ...)
    "missing_video",       # vlm: the video file / frame folder did not exist (or was empty) at conversion
    "video_decode_error",  # vlm: decord cannot open / decode the video, or PIL a sampled frame (cooking.video)
    "video_tag_missing",   # vlm: no `<video>` in the first turn ("Cannot find <video> in the conversation!")
    "no_frame_sampler",    # vlm: a video record in a group without frame_sampler_args (official: no sampler)
    "no_loss_item",        # vlm: no plan item carries a loss ("No loss defined, skipped.")
    "checksum_mismatch",   # the sample's bytes differ from the checksum recorded at conversion (layout.checksums)
    TRUNCATED_IMAGE,       # an image cut short (layout.image_truncation), dropped under data.truncated_images: drop
)

#: Every reason a kept record has parts the official readers ignore too (``BagelSample.unused``; ``vlm.ignored_parts``).
#: ``truncated_image``: a kept sample's image is cut short; it is cooked as the official reader does
#: (``LOAD_TRUNCATED_IMAGES = True``: PIL fills the missing rows), counted here (``data.truncated_images: keep``).
UNUSED_REASONS: tuple[str, ...] = ("image_without_placeholder", "placeholder_without_image", "turn_of_other_role",
                                   TRUNCATED_IMAGE)


class ReplayError(RuntimeError):
    """Recorded choices do not fit the sample being replayed (different data or cooker code)."""


class DropSample(Exception):
    """Raised inside a cooker core to turn the sample into a tombstone with ``reason``."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in DROP_REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


class Draws:
    """The random choices of one sample: drawn from ``rng`` (and recorded) or replayed.

    Each method makes the same generator call as the official one it names. numpy's RNG is the process-global one
    when ``rng`` is the ``random`` module (the official order), else a ``RandomState`` seeded from 32 bits of ``rng``
    at the first numpy draw (still a pure function of the read). Every outcome is recorded as ints / floats, a
    permutation as its ``n`` ints.
    """

    def __init__(self, rng: Any = None, replay: tuple | list | None = None) -> None:
        if (rng is None) == (replay is None):
            raise ValueError("Draws: give exactly one of rng (draw) or replay (recorded choices)")
        self._rng, self._pos = rng, 0
        self._np: Any = None
        self._replay = None if replay is None else list(replay)
        self.record: list[int | float] = []

    def _next_recorded(self, kind: type) -> Any:
        if self._pos >= len(self._replay):
            raise ReplayError(f"replay needs more than the {len(self._replay)} recorded choices {self._replay}")
        v = self._replay[self._pos]
        self._pos += 1
        if type(v) is not kind:
            raise ReplayError(f"replayed choice #{self._pos - 1} is {v!r}, expected a {kind.__name__}")
        return v

    def choice_index(self, n: int) -> int:
        """Index drawn like ``random.choice(seq)`` with ``len(seq) == n`` (``IndexError``, no draw, when ``n == 0``)."""
        if n <= 0:
            raise IndexError("Cannot choose from an empty sequence")
        if self._replay is not None:
            v = self._next_recorded(int)
            if not 0 <= v < n:
                raise ReplayError(f"replayed index {v} out of range for a choice over {n} items")
        else:
            v = self._rng.choice(range(n))
        self.record.append(v)
        return v

    def random(self) -> float:
        """A float drawn like ``random.random()``."""
        v = self._next_recorded(float) if self._replay is not None else self._rng.random()
        self.record.append(v)
        return v

    def _numpy(self) -> Any:
        if self._np is None:
            self._np = np.random if self._rng is _random_module else np.random.RandomState(self._rng.getrandbits(32))
        return self._np

    def np_randint(self, low: int, high: int) -> int:
        """An int in ``[low, high)`` drawn like ``np.random.randint(low, high)``."""
        if self._replay is not None:
            v = self._next_recorded(int)
            if not low <= v < high:
                raise ReplayError(f"replayed randint {v} out of range [{low}, {high})")
        else:
            v = int(self._numpy().randint(low, high))
        self.record.append(v)
        return v

    def np_permutation(self, n: int) -> list[int]:
        """``np.random.permutation(n)`` as a list of ints (recorded as its ``n`` ints)."""
        if self._replay is not None:
            out = [self._next_recorded(int) for _ in range(n)]
            if sorted(out) != list(range(n)):
                raise ReplayError(f"replayed permutation {out} is not one of range({n})")
        else:
            out = [int(x) for x in self._numpy().permutation(n)]
        self.record.extend(out)
        return out

    def finish(self) -> tuple:
        """The recorded choices; in replay mode also checks that every recorded choice was used."""
        if self._replay is not None and self._pos != len(self._replay):
            raise ReplayError(f"replay used {self._pos} of the recorded choices {self._replay}")
        return tuple(self.record)


@dataclass
class CookContext:
    """What a group cooker needs besides the crude sample: transforms, tokenizer, group name."""

    group: str
    tokenizer: Any
    transform: ImageTransform
    vit_transform: ImageTransform | None = None
    #: ``data.verify_checksums``: the reader checks every crude sample against its dataset's recorded checksums
    #: (``cook_with(..., checksums=...)``) before cooking
    verify_checksums: bool = True
    #: ``data.truncated_images``: ``"keep"`` (cook them as the official reader does, counted as ``unused``
    #: ``truncated_image``) or ``"drop"`` (a ``truncated_image`` tombstone)
    truncated_images: str = "keep"
    #: the group's ``frame_sampler_args`` (``cooking.video.FrameSampler``); None: video records are dropped
    frame_sampler: Any = None

    def __post_init__(self) -> None:
        configure_pil()  # official import-time PIL globals (2e8 pixels, truncated images load)

    def encode(self, text: str) -> list[int]:
        """``tokenizer.encode`` exactly as the official datasets call it (no chat template)."""
        return list(self.tokenizer.encode(text))


def plan_item(type_: str, enable_cfg: int, loss: int) -> dict:
    """One ``sequence_plan`` entry as the source datasets build it (no special-token loss)."""
    return {"type": type_, "enable_cfg": enable_cfg, "loss": loss, "special_token_loss": 0, "special_token_label": None}


def load_meta(crude: Mapping[str, Any], group: str) -> dict:
    """The parsed ``meta.json`` part; ``DropSample('bad_meta')`` when missing, not JSON or another group."""
    raw = crude.get(META_PART)
    if raw is None:
        raise DropSample("bad_meta", f"sample {crude.get('__key__')!r} has no {META_PART} part")
    try:
        meta = json.loads(raw)
    except (ValueError, TypeError) as e:
        raise DropSample("bad_meta", f"sample {crude.get('__key__')!r}: {META_PART} is not JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("group") != group:
        got = meta.get("group") if isinstance(meta, dict) else type(meta).__name__
        raise DropSample("bad_meta", f"sample {crude.get('__key__')!r}: meta group {got!r}, expected {group!r}")
    return meta


def decode_image(crude: Mapping[str, Any], i: int, what: str) -> Image.Image:
    """Image part ``img{i}`` opened and converted like the official loader (``pil_img2rgb``).

    A missing part is ``missing_image``; anything PIL raises is ``image_decode_error``.
    """
    data = crude.get(image_part(i))
    if data is None:
        raise DropSample("missing_image", f"{what}: image {i} is null / absent")
    try:
        return pil_img2rgb(Image.open(io.BytesIO(data)))
    except Exception as e:  # noqa: BLE001 - the official loader skips on any decode error
        raise DropSample("image_decode_error", f"{what}: image {i}: {type(e).__name__}: {e}") from None


def transform_image(transform: ImageTransform, img: Image.Image, what: str, img_num: int = 1):
    """``transform(img, img_num)`` with failures turned into ``image_decode_error`` tombstones."""
    try:
        return transform(img, img_num=img_num)
    except Exception as e:  # noqa: BLE001
        raise DropSample("image_decode_error", f"{what}: transform failed: {type(e).__name__}: {e}") from None


def cook_with(core: Callable[..., dict], crude: Mapping[str, Any], ctx: CookContext, draws: Draws,
              worker_id: int, *, checksums: ChecksumTable | None = None, index: int = -1) -> BagelSample:
    """Run a group core on a crude sample: a complete ``BagelSample``, or a tombstone on bad data.

    ``core(crude, meta, ctx, draws)`` returns the official fields (plan, texts, images, num_tokens)
    or raises :class:`DropSample`. ``data_indexes`` is the reader form {source coordinate, worker id,
    group}; the reader's order (its plan) replaces it with its own positions. ``checksums``: the sample's dataset's
    recorded checksums (``layout.checksums.ChecksumTable``; None: not verified) and ``index`` its sample index
    there: a sample whose bytes differ is a ``checksum_mismatch`` tombstone, before anything is decoded.
    """
    basic = basic_sample_keys(crude)
    source: dict = {}
    coord: list = []
    try:
        if checksums is not None and (damaged := checksums.check(index, crude)) is not None:
            raise DropSample(CHECKSUM_MISMATCH, damaged)
        meta = load_meta(crude, ctx.group)
        source = meta.get("source") if isinstance(meta.get("source"), dict) else {}
        try:  # the manifest coordinate: t2i/edit [file_index, row_group, row], vlm [line]
            coord = [source["line"]] if ctx.group == VLM else [source["file_index"], source["row_group"], source["row"]]
        except KeyError as e:
            raise DropSample("bad_meta", f"sample {crude.get('__key__')!r}: source lacks {e}") from None
        truncated = _truncated_images(crude)
        if truncated and ctx.truncated_images == "drop":
            raise DropSample(TRUNCATED_IMAGE, "; ".join(truncated))
        fields = core(crude, meta, ctx, draws)
        if truncated:
            fields["unused"] = {**(fields.get("unused") or {}), TRUNCATED_IMAGE: len(truncated)}
    except DropSample as d:
        data_indexes = {"data_indexes": coord, "worker_id": worker_id, "dataset_name": ctx.group}
        return BagelSample(**basic, sequence_plan=[], text_ids_list=[], image_tensor_list=[], num_tokens=0,
                           data_indexes=data_indexes, source=source, rng_choices=tuple(draws.record),
                           drop_reason=d.reason, drop_detail=f"{_where(ctx.group, source, crude)}: {d.detail}")
    except Exception as exc:  # a bug or an environment error, not bad data: name the sample, never swallow it
        raise SampleCookError(f"cooking {_where(ctx.group, source, crude)}{_origin(crude)} failed: "
                              f"{type(exc).__name__}: {exc}") from exc
    data_indexes = {"data_indexes": coord, "worker_id": worker_id, "dataset_name": ctx.group}
    return BagelSample(**basic, **fields, data_indexes=data_indexes, source=source, rng_choices=draws.finish())


def _truncated_images(crude: Mapping[str, Any]) -> list[str]:
    """``"image I: why"`` for every image part of ``crude`` that is cut short (``layout.image_truncation``)."""
    return [f"image {i}: {cut}" for part, data in crude.items()
            if isinstance(part, str) and (i := image_index(part)) is not None
            and isinstance(data, (bytes, bytearray)) and (cut := image_truncation(bytes(data)))]


class SampleCookError(RuntimeError):
    """Cooking one sample raised something other than bad data; the message names dataset, shard and key."""


def _origin(crude: Mapping[str, Any]) -> str:
    """`` in Energon dataset D shard S`` from the crude sample's ``__sources__`` (empty when unknown)."""
    for info in crude.get("__sources__") or ():
        path, shard = getattr(info, "dataset_path", None), getattr(info, "shard_name", None)
        if path is not None:
            return f" in Energon dataset {path}" + (f" shard {shard}" if shard else "")
    return ""


def _where(group: str, source: Mapping[str, Any], crude: Mapping[str, Any]) -> str:
    """Human-readable location of a sample for drop details."""
    key = crude.get("__key__")
    if "file" in source and "line" in source:
        return f"{group} {source['file']} line {source['line']} (key {key})"
    if "file" in source:
        return f"{group} {source['file']} row group {source.get('row_group')} row {source.get('row')} (key {key})"
    return f"{group} sample {key}"
