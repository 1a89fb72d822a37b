"""Video frames of a vlm_sft ``video`` record, sampled as the official ``FrameSampler`` samples them.

Mirrors the official ``data/video_utils.py`` (``FrameSampler(max_num_frames, min_num_frames, sample="rand")``,
``get_frame_indices``, ``read_frames_decord``, ``read_frames_folder``), with the video's bytes (a file) or its frame
files (a folder, in the official frame order) read from the converted sample instead of the file system:

* the frame count ``t = np.random.randint(min_num_frames, max_num_frames + 1)`` is drawn from **numpy's** RNG (the
  global one in the official order), after the video was opened (a file that decord cannot open draws nothing);
* ``[0, vlen)`` is cut into ``min(t, vlen)`` intervals by ``np.linspace(...).astype(int)``; one index per interval
  is ``random.choice(range(a, b - 1))`` (Python's RNG; the interval's last frame is never chosen, as official); an
  empty range makes the whole choice fall back to ``sorted(np.random.permutation(vlen)[:min(t, vlen)])``, after the
  choices already made; a list shorter than ``t`` is padded with its last index;
* a file: ``decord.VideoReader(file, num_threads=1).get_batch(indices)`` (decord errors after the draws still
  consumed them); a folder: with more than ``t`` frames the sampled ones, else all of them (no index draw).

Every draw goes through :class:`~.common.Draws` (recorded; replayed when a sample is rebuilt). Only the frames used
are decoded: a folder's other frames have their header checked (``PIL.Image.open``), not their pixels (the official
reader decodes all of them, so a frame whose header opens but whose pixels do not is dropped there, kept here).
Parity is proven on decord 0.6.0 (``tests/test_video_golden.py``). decord is the optional ``video`` extra:
:func:`require_decord` fails a build in one line when a dataset holds video files and decord is missing (frame
folders need PIL only).
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from ..layout import MANIFEST_NAME, NUM_VIDEO_FILES, NUM_VIDEO_LINES
from .common import Draws, DropSample

__all__ = ["FrameSampler", "VIDEO_TAG", "frame_indices", "require_decord", "sample_file_frames",
           "sample_folder_frames", "video_lines_of"]

#: The placeholder of a video in the first conversation turn (replaced by one ``<image>`` per frame).
VIDEO_TAG = "<video>"


@dataclass(frozen=True)
class FrameSampler:
    """The group's ``frame_sampler_args`` (official ``FrameSampler``; ``sample="rand"``, the official default)."""

    max_num_frames: int
    min_num_frames: int

    @classmethod
    def of(cls, args: dict[str, Any] | None) -> "FrameSampler | None":
        """From the YAML mapping (None: no sampler, video lines are dropped as ``no_frame_sampler``). Raises ValueError
        unless both keys are given and ``1 <= min_num_frames <= max_num_frames``."""
        if args is None:
            return None
        lo, hi = args.get("min_num_frames"), args.get("max_num_frames")
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"frame_sampler_args needs 1 <= min_num_frames <= max_num_frames, got {args!r}")
        return cls(max_num_frames=hi, min_num_frames=lo)

    def draw_count(self, draws: Draws) -> int:
        """``np.random.randint(min_num_frames, max_num_frames + 1)``."""
        return draws.np_randint(self.min_num_frames, self.max_num_frames + 1)


def frame_indices(num_frames: int, vlen: int, draws: Draws) -> list[int]:
    """Official ``get_frame_indices(num_frames, vlen, sample="rand")``: one index per interval (Python RNG), the
    permutation fallback (numpy RNG), padded with the last index to ``num_frames``. Raises IndexError for
    ``vlen == 0`` (the official padding of an empty list)."""
    acc = min(num_frames, vlen)
    edges = np.linspace(start=0, stop=vlen, num=acc + 1).astype(int).tolist()
    out: list[int] = []
    try:
        for a, b in zip(edges[:-1], edges[1:]):
            out.append(a + draws.choice_index(b - 1 - a))
    except IndexError:
        out = sorted(draws.np_permutation(vlen)[:acc])
    if len(out) < num_frames:
        out = out + [out[-1]] * (num_frames - len(out))
    return out


def require_decord(where: str) -> Any:
    """The ``decord`` module; ``ModuleNotFoundError`` in one line naming ``where`` and the extra otherwise."""
    try:
        import decord
    except ImportError as exc:
        raise ModuleNotFoundError(f"{where}: video records need decord, the `video` extra "
                                  f"(pip install 'bagel-megatron-data[video]'): {exc}") from None
    return decord


def sample_file_frames(data: bytes, sampler: FrameSampler, draws: Draws, what: str) -> list[Image.Image]:
    """Official ``read_frames_decord`` on a video file's bytes: RGB frames ``(H, W)`` of the sampled indices.

    ``DropSample('video_decode_error')`` when decord cannot open the bytes (no draw made) or decode the batch
    (after the draws)."""
    decord = require_decord(what)
    try:
        reader = decord.VideoReader(io.BytesIO(data), num_threads=1)
        vlen = len(reader)
    except Exception as e:  # noqa: BLE001 - decord raises RuntimeError / DECORDError on bad input
        raise DropSample("video_decode_error", f"{what}: {type(e).__name__}: {_short(e)}") from None
    t = sampler.draw_count(draws)
    try:
        idx = frame_indices(t, vlen, draws)
    except IndexError:
        raise DropSample("video_decode_error", f"{what}: the video has no frames") from None
    try:
        batch = reader.get_batch(idx).asnumpy()  # (T, H, W, 3) uint8
    except Exception as e:  # noqa: BLE001
        raise DropSample("video_decode_error", f"{what}: frames {idx}: {type(e).__name__}: {_short(e)}") from None
    return [Image.fromarray(batch[i]) for i in range(batch.shape[0])]


def sample_folder_frames(parts: Sequence[bytes], sampler: FrameSampler, draws: Draws, what: str) -> list[Image.Image]:
    """Official ``read_frames_folder`` on a folder's frame files (official order): the sampled frames (all of them
    when there are no more than the drawn count), each ``Image.open(...).convert("RGB")``. Only the frames used are
    decoded; every frame's header is opened first (the official reader opens them all before drawing).

    ``DropSample('video_decode_error')`` naming the frame PIL cannot open (before any draw) or decode;
    ``DropSample('missing_video')`` for a folder without frames (after its count draw, as official)."""
    opened = []
    for k, data in enumerate(parts):
        try:
            opened.append(Image.open(io.BytesIO(data)))
        except Exception as e:  # noqa: BLE001
            raise DropSample("video_decode_error", f"{what}: frame {k}: {type(e).__name__}: {e}") from None
    t = sampler.draw_count(draws)
    if not opened:  # official: an empty folder yields no frames (a text-only remnant); dropped here, counted
        raise DropSample("missing_video", f"{what}: the frame folder is empty")
    idx = frame_indices(t, len(opened), draws) if len(opened) > t else list(range(len(opened)))
    decoded: dict[int, Image.Image] = {}
    for i in dict.fromkeys(idx):  # each distinct frame once, in order
        try:
            decoded[i] = opened[i].convert("RGB")
        except Exception as e:  # noqa: BLE001
            raise DropSample("video_decode_error", f"{what}: frame {i}: {type(e).__name__}: {e}") from None
    return [decoded[i] for i in idx]


def _short(e: BaseException) -> str:
    """An exception's message on one line, decord's C++ stack trace cut off."""
    return " ".join(str(e).split("\n")[0].split())[:300]


def video_lines_of(path: str) -> tuple[int, int]:
    """``(video lines, video file lines)`` of the converted dataset at ``path`` (its manifest header's
    ``num_video_lines`` / ``num_video_files``; zeros for a dataset converted before video was stored, or without a
    manifest)."""
    try:
        with open(os.path.join(path, MANIFEST_NAME), encoding="utf-8") as f:
            head = json.load(f)
        return int(head.get(NUM_VIDEO_LINES) or 0), int(head.get(NUM_VIDEO_FILES) or 0)
    except (OSError, ValueError, AttributeError):
        return 0, 0
