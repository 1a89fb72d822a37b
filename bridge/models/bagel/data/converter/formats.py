"""Row readers for the three official BAGEL raw formats (t2i parquet, unified_edit parquet + parquet_info, vlm jsonl).

Each reader first validates its inputs (so a bad file fails before anything is written) and splits the work
into :class:`SourceUnit` s: one per parquet file (t2i/edit) or one per line range of the jsonl (vlm). A unit
is converted on its own (in any process) by :func:`iter_unit`, which yields one :class:`RawSample` per row the
official reader can ever read, with the official coordinate, the ``meta.json`` dict of the layout contract and
the original encoded image bytes. Rows the official reader never reads are recorded in :class:`ScanLog`
(``skipped``, aggregated per file / row group and reason), never silently dropped.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..energon.layout import (EDIT, NUM_VIDEO_FILES, NUM_VIDEO_LINES, SKIP_NOT_IN_PARQUET_INFO,
                              SKIP_ROW_GROUP_BEYOND_INFO, T2I, VIDEO_ERROR_KEY, VLM)

logger = logging.getLogger(__name__)

__all__ = ["ConvertError", "RawSample", "ScanLog", "SourceUnit", "T2IReader", "EditReader", "VlmReader", "iter_unit",
           "relpath", "match_parquet_info", "dumps_json"]


class ConvertError(Exception):
    """Bad converter input (unreadable/corrupt file, missing column, missing jsonl, non-empty output, ...)."""


@dataclass
class RawSample:
    """One row: the official coordinate (manifest ``samples`` entry), meta.json dict, ``(image index, bytes)``
    (t2i: a read-only ``memoryview`` into the row group's Arrow buffer, :func:`binary_values`)."""

    coord: list[int]
    meta: dict[str, Any]
    images: list[tuple[int, bytes | memoryview]]


@dataclass(frozen=True)
class SourceUnit:
    """One work unit of a conversion: the stored rows of one parquet file, or a range of jsonl lines. ``num_samples``
    is known from parquet metadata / the line count before anything is read, so shard layout and sample keys are
    fixed up front."""

    path: str                    # the source file as opened
    rel: str                     # its stored (source-root relative) form
    file_index: int              # its position in the sorted listing (vlm: 0)
    row_groups: tuple[int, ...]  # the row groups read, in order (t2i/edit)
    start: int                   # the first line (vlm)
    num_samples: int


@dataclass
class ScanLog:
    """What a reader learned besides the samples: manifest fields, skipped rows, conversion warnings."""

    manifest: dict[str, Any] = field(default_factory=dict)
    #: ``{"file_index", "row_group" (None: the whole file), "rows", "reason"}`` per file/row group.
    skipped: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def warn(self, msg: str) -> None:
        if len(self.warnings) < 10:
            logger.warning("%s", msg)
        elif len(self.warnings) == 10:
            logger.warning("further conversion warnings are only counted (see the summary)")
        self.warnings.append(msg)


def dumps_json(obj: Any) -> bytes:
    """Canonical JSON bytes (sorted keys, no whitespace, UTF-8): the same object always gives the same bytes."""
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")


def relpath(path: str, root: str) -> str:
    """``path`` relative to ``root`` with ``/`` separators (the form stored in meta.json and the manifest)."""
    return os.path.relpath(os.path.abspath(path), os.path.abspath(root)).replace(os.sep, "/")


def _parquet_names(data_dir: str) -> list[str]:
    """Sorted ``*.parquet`` file names of a directory (other files are ignored, like the official lister)."""
    if not os.path.isdir(data_dir):
        what = "is not a directory" if os.path.exists(data_dir) else "does not exist"
        raise ConvertError(f"{data_dir}: parquet data directory {what}")
    return sorted(n for n in os.listdir(data_dir)
                  if n.endswith(".parquet") and os.path.isfile(os.path.join(data_dir, n)))


def _row_group_sizes(md: pq.FileMetaData) -> list[int]:
    return [md.row_group(g).num_rows for g in range(md.num_row_groups)]


def _open_parquet(path: str) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for corrupt or truncated files
        raise ConvertError(f"{path}: unreadable parquet file ({type(e).__name__}: {e})") from e


def _is_binary(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t) or pa.types.is_null(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t)


def _check_columns(path: str, pf: pq.ParquetFile, required: Mapping[str, Any]) -> None:
    """Raise ConvertError naming the file when a required column is missing or has an unusable type."""
    schema = pf.schema_arrow
    for name, (ok, what) in required.items():
        if name not in schema.names:
            raise ConvertError(f"{path}: missing required column {name!r} (columns: {schema.names})")
        if not ok(schema.field(name).type):
            raise ConvertError(f"{path}: column {name!r} has type {schema.field(name).type}, expected {what}")


def _read_row_group(path: str, pf: pq.ParquetFile, g: int, columns: list[str]) -> pa.Table:
    try:
        return pf.read_row_group(g, columns=columns, use_threads=False)  # one thread per unit: units run in parallel
    except Exception as e:
        raise ConvertError(f"{path}: cannot read row group {g} ({type(e).__name__}: {e})") from e


def _captions_problem(raw: Any) -> str | None:
    """Why t2i ``captions`` can give no caption (the same rules as the reader's ``bad_captions_json``), or None."""
    if not isinstance(raw, str):
        return f"captions not JSON ({type(raw).__name__})"
    try:
        captions = json.loads(raw)
    except ValueError:
        return f"captions not JSON ({raw[:40]!r})"
    if not isinstance(captions, dict) or not all(isinstance(v, str) for v in captions.values()):
        return f"captions not a JSON object of strings ({raw[:40]!r})"
    return None


def record_problem(meta: Mapping[str, Any]) -> str | None:
    """Why a converted record can never become a training sample (the cooker will tombstone it), or None.

    Only structural faults visible without decoding: a t2i row without image, or whose ``captions`` are not a
    JSON object of strings (the reader's ``bad_captions_json``, ``energon.cooking.t2i``); a VLM line that is not a
    JSON object or has no ``conversations`` list (the official ``SftJSONLIterableDataset`` schema:
    ``{"image": ..., "conversations": [{"from": "human"|"gpt", "value": str}, ...]}``); a video record whose file or
    frame folder is missing or empty (``missing video``) or whose ``video`` is not a path (``unreadable video``).
    """
    if meta.get("group") == T2I:
        if meta.get("image_null"):
            return "null image"
        return _captions_problem(meta.get("captions"))
    if meta.get("group") == VLM:
        try:
            rec = json.loads(meta.get("raw_line") or "")
        except ValueError:
            return "not JSON"
        if not isinstance(rec, dict):
            return f"a JSON {type(rec).__name__}, not an object"
        if not isinstance(rec.get("conversations"), list):
            return f"no `conversations` list (keys: {', '.join(sorted(map(str, rec))[:8]) or 'none'})"
        video_error = (meta.get("image_errors") or {}).get(VIDEO_ERROR_KEY) if "image" not in rec else None
        if video_error is not None:
            return ("missing video" if video_error.startswith(("FileNotFoundError", "empty")) else "unreadable video") \
                + f" ({video_error})"
    return None


class T2IReader:
    """t2i_pretrain: every ``*.parquet`` of ``data_dir``; all row groups, all rows (columns image, captions)."""

    columns = {
        "image": (_is_binary, "binary (encoded image bytes)"),
        "captions": (lambda t: pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)
                     or _is_binary(t), "string (JSON captions)"),
    }

    def __init__(self, data_dir: str, source_root: str, log: ScanLog) -> None:
        entries, self.units = [], []
        for fi, name in enumerate(_parquet_names(data_dir)):
            path = os.path.join(data_dir, name)
            pf = _open_parquet(path)
            _check_columns(path, pf, self.columns)
            rgs = _row_group_sizes(pf.metadata)
            entries.append({"file": relpath(path, source_root), "file_index": fi, "num_rows": sum(rgs),
                            "row_groups": rgs})
            self.units.append(SourceUnit(path, entries[-1]["file"], fi, tuple(range(len(rgs))), 0, sum(rgs)))
        if not self.units:
            raise ConvertError(f"{data_dir}: no *.parquet files")
        log.manifest.update(files=entries, data_dir=relpath(data_dir, source_root))


def binary_values(column: pa.ChunkedArray | pa.Array) -> list[memoryview | bytes | None]:
    """The values of a binary parquet column as read-only views into Arrow's buffers (no copy), None for nulls.

    ``binary`` / ``large_binary`` chunks: one unsigned-byte ``memoryview`` (format ``B``, so indexing gives ints
    0-255 like ``bytes``) per value, sliced by the chunk's offsets; other types (``binary_view``, ``null``):
    ``to_pylist()`` (``bytes`` / None). ``to_pylist()`` copies every value into a new ``bytes`` object, for bytes
    that are only checked, hashed and written (docs/performance.md, "Conversion"). The views keep the row group's
    buffers alive; they are valid as long as a caller holds them.
    """
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    out: list[memoryview | bytes | None] = []
    for chunk in chunks:
        if not (pa.types.is_binary(chunk.type) or pa.types.is_large_binary(chunk.type)):
            out += chunk.to_pylist()
            continue
        n, offset_type = len(chunk), np.dtype(np.int64 if pa.types.is_large_binary(chunk.type) else np.int32)
        _, offsets_buf, data_buf = chunk.buffers()
        offsets = np.frombuffer(offsets_buf, dtype=offset_type, count=n + 1, offset=chunk.offset * offset_type.itemsize)
        data = memoryview(data_buf if data_buf is not None else b"").cast("B")
        bounds = offsets.tolist()
        views: list[memoryview | None] = [data[bounds[i]:bounds[i + 1]] for i in range(n)]
        if chunk.null_count:
            for i in np.flatnonzero(chunk.is_null().to_numpy(zero_copy_only=False)).tolist():
                views[i] = None
        out += views
    return out


def _iter_parquet(group: str, unit: SourceUnit) -> Iterator[RawSample]:
    """The rows of a t2i (``image``, ``captions``) or unified_edit (``image_list``, ``instruction_list``) unit."""
    t2i, pf, k, fi, rel = group == T2I, _open_parquet(unit.path), 0, unit.file_index, unit.rel
    columns = ["image", "captions"] if t2i else ["image_list", "instruction_list"]
    for g in unit.row_groups:  # a unit's row groups always start at 0: ``k`` counts the file's rows
        tbl = _read_row_group(unit.path, pf, g, columns)
        images = binary_values(tbl.column("image")) if t2i else tbl.column("image_list").to_pylist()
        for r, (img, text) in enumerate(zip(images, tbl.column(columns[1]).to_pylist())):
            source = {"file": rel, "file_index": fi, "row_group": g, "row": r, "file_row": k}
            if t2i:
                cap = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
                meta = {"group": T2I, "source": source, "captions": cap, "image_null": img is None}
                yield RawSample([fi, g, r], meta, [] if img is None else [(0, img)])
            else:
                imgs = img if img is not None else []
                meta = {"group": EDIT, "source": source, "instruction_list": text, "num_images": len(imgs),
                        "null_images": [i for i, b in enumerate(imgs) if b is None]}
                yield RawSample([fi, g, r], meta, [(i, b) for i, b in enumerate(imgs) if b is not None])
            k += 1


def match_parquet_info(parquet_info: Mapping[str, Any], data_dir: str, names: list[str], roots: list[str],
                       info_file: str) -> dict[str, int]:
    """Map file names of ``data_dir`` to their declared ``num_row_groups``.

    A key matches when it equals ``os.path.join(data_dir, name)`` as given (the official rule), or when it
    names the same file after resolving a relative key against each of ``roots`` (``parquet_info_root``,
    the source root) and the working directory.
    """
    exact = {os.path.join(data_dir, n): n for n in names}
    by_abs = {os.path.normpath(os.path.abspath(os.path.join(data_dir, n))): n for n in names}
    out: dict[str, int] = {}
    for key, val in parquet_info.items():
        name = exact.get(key)
        if name is None:
            cands = [key] if os.path.isabs(key) else [os.path.join(r, key) for r in roots] + [key]
            name = next((by_abs[a] for a in (os.path.normpath(os.path.abspath(c)) for c in cands) if a in by_abs), None)
        if name is None:
            continue
        n = val.get("num_row_groups") if isinstance(val, Mapping) else None
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ConvertError(f"{info_file}: entry {key!r} needs an integer num_row_groups >= 0, got {val!r}")
        if name in out and out[name] != n:
            raise ConvertError(f"{info_file}: conflicting num_row_groups for {name!r} ({out[name]} vs {n})")
        out[name] = n
    return out


class EditReader:
    """unified_edit: only files listed in parquet_info, only row groups ``range(declared)`` that exist."""

    columns = {
        "image_list": (lambda t: pa.types.is_null(t) or (_is_list(t) and _is_binary(t.value_type)), "list<binary>"),
        "instruction_list": (lambda t: pa.types.is_null(t) or _is_list(t), "list<list<string>>"),
    }

    def __init__(self, data_dir: str, parquet_info: Mapping[str, Any], info_file: str, info_roots: list[str],
                 source_root: str, log: ScanLog) -> None:
        names = _parquet_names(data_dir)
        declared = match_parquet_info(parquet_info, data_dir, names, info_roots, info_file)
        if not declared:
            log.warn(f"{info_file}: no parquet_info key names a file of {data_dir}; every row is skipped "
                     f"(keys must equal os.path.join(data_dir, file), see convert docs)")
        self.units: list[SourceUnit] = []
        entries, missing = [], []
        for fi, name in enumerate(names):
            path, rel = os.path.join(data_dir, name), relpath(os.path.join(data_dir, name), source_root)
            n_decl = declared.get(name)
            if n_decl is None:
                try:  # the official reader never opens this file; count its rows for the skip report only
                    rgs = _row_group_sizes(pq.ParquetFile(path).metadata)
                except Exception as e:
                    log.warn(f"{path}: unlisted in parquet_info and unreadable ({type(e).__name__}: {e})")
                    rgs = []
                    log.skipped.append({"file_index": fi, "row_group": None, "rows": 0,
                                        "reason": SKIP_NOT_IN_PARQUET_INFO})
                skip_from, reason = 0, SKIP_NOT_IN_PARQUET_INFO
            else:
                pf = _open_parquet(path)
                _check_columns(path, pf, self.columns)
                rgs = _row_group_sizes(pf.metadata)
                skip_from, reason = n_decl, SKIP_ROW_GROUP_BEYOND_INFO
                for g in range(len(rgs), n_decl):
                    missing.append({"file": rel, "file_index": fi, "row_group": g})
                    log.warn(f"{path}: parquet_info declares {n_decl} row groups but the file has {len(rgs)}; "
                             f"row group {g} does not exist (the official reader skips that unit)")
                stored = tuple(range(min(n_decl, len(rgs))))
                self.units.append(SourceUnit(path, rel, fi, stored, 0, sum(rgs[g] for g in stored)))
            entries.append({"file": rel, "file_index": fi, "num_rows": sum(rgs), "row_groups": rgs,
                            "declared_row_groups": n_decl})
            log.skipped += [{"file_index": fi, "row_group": g, "rows": rgs[g], "reason": reason}
                            for g in range(skip_from, len(rgs))]
        if not self.units:
            log.warn(f"{data_dir}: no file of this directory is listed in {info_file}")
        log.manifest.update(files=entries, missing_row_groups=missing, data_dir=relpath(data_dir, source_root),
                            parquet_info={e["file"]: e["declared_row_groups"] for e in entries
                                          if e["declared_row_groups"] is not None})


def _os_error_message(e: OSError, shown_path: str) -> str:
    """The ``Type: message`` the official reader prints when PIL cannot open ``shown_path``."""
    if e.errno is not None and e.strerror:
        return f"{type(e).__name__}: [Errno {e.errno}] {e.strerror}: {shown_path!r}"
    return f"{type(e).__name__}: {e}"


#: jsonl path -> (size, mtime_ns, lines): read once per process (a forked worker inherits the parent's copy).
_VLM_LINES: dict[str, tuple[int, int, list[str]]] = {}


def _read_lines(jsonl_path: str) -> list[str]:
    """Every physical line as ``readlines()`` gives it (universal newlines), cached per process."""
    st = os.stat(jsonl_path)
    hit = _VLM_LINES.get(jsonl_path)
    if hit is not None and hit[:2] == (st.st_size, st.st_mtime_ns):
        return hit[2]
    try:
        with open(jsonl_path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConvertError(f"{jsonl_path}: cannot read jsonl ({type(e).__name__}: {e})") from e
    _VLM_LINES.clear()
    _VLM_LINES[jsonl_path] = (st.st_size, st.st_mtime_ns, lines)
    return lines


class VlmReader:
    """vlm_sft: every physical line of the jsonl (as ``readlines()`` gives it) is one sample, broken ones too.

    The jsonl is split into units of ``lines_per_unit`` consecutive lines (converted in parallel; a line range
    needs no offset pre-pass because every process reads the same ``readlines()`` list).
    """

    def __init__(self, jsonl_path: str, image_dir: str, source_root: str, log: ScanLog, lines_per_unit: int) -> None:
        if not os.path.isfile(jsonl_path):
            raise ConvertError(f"{jsonl_path}: jsonl file does not exist")
        lines = _read_lines(jsonl_path)
        if not os.path.isdir(image_dir):
            line = _first_relative_image(lines)
            if line is not None:  # every such image would be an error, its sample dropped at read time
                raise ConvertError(f"{image_dir}: image directory does not exist, and the jsonl names images below it "
                                   f"(e.g. line {line + 1}): check --image-dir / the entry's data_dir")
            log.warn(f"{image_dir}: image directory does not exist; no line names an image below it")
        self.image_dir, self.rel_image_dir = image_dir, relpath(image_dir, source_root)
        rel_file, step = relpath(jsonl_path, source_root), max(1, lines_per_unit)
        log.manifest.update(files=[{"file": rel_file, "num_lines": len(lines)}], num_lines=len(lines),
                            image_dir=self.rel_image_dir, **_count_video_lines(lines))
        self.units = [SourceUnit(jsonl_path, rel_file, 0, (), a, min(step, len(lines) - a))
                      for a in range(0, len(lines), step)]


def _count_video_lines(lines: list[str]) -> dict[str, int]:
    """The manifest's video counts: lines whose record is a video record (a ``video`` key, no ``image`` key), and
    those naming a file rather than a frame folder (the build requires decord when a dataset has any). Only lines
    naming ``"video"`` are parsed."""
    n = files = 0
    for line in lines:
        if '"video"' in line:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and "video" in rec and "image" not in rec:
                n += 1
                files += not (isinstance(rec["video"], str) and rec["video"].endswith("/"))
    return {NUM_VIDEO_LINES: n, NUM_VIDEO_FILES: files}


def _first_relative_image(lines: list[str]) -> int | None:
    """The first line (0-based index; messages add 1) whose record names an image by a relative path (read below
    the image dir)."""
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        names = rec.get("image") if isinstance(rec, dict) else None
        for name in names if isinstance(names, list) else [names]:
            if isinstance(name, str) and not os.path.isabs(name):
                return i
    return None


def _iter_vlm(unit: SourceUnit, image_dir: str, rel_image_dir: str, warn: Callable[[str], None]) -> Iterator[RawSample]:
    lines = _read_lines(unit.path)
    for i in range(unit.start, unit.start + unit.num_samples):
        line = lines[i]
        names, errors, images, video = None, {}, [], None
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if isinstance(rec, dict):
            if "image" in rec:
                names = rec["image"] if isinstance(rec["image"], list) else [rec["image"]]
            else:
                names = []
                if "video" in rec:
                    video, images = _read_video(rec["video"], image_dir, rel_image_dir, errors)
        for idx, name in enumerate(names or []):
            if not isinstance(name, str):
                errors[str(idx)] = f"TypeError: expected str, bytes or os.PathLike object, not {type(name).__name__}"
                continue
            try:
                with open(os.path.join(image_dir, name), "rb") as f:
                    images.append((idx, f.read()))
            except OSError as e:
                errors[str(idx)] = _os_error_message(e, os.path.join(rel_image_dir, name))
        for idx, msg in errors.items():
            warn(f"{unit.rel} line {i + 1}: image {idx}: {msg}")  # 1-based, as editors number lines
        meta = {"group": VLM, "source": {"file": unit.rel, "line": i}, "raw_line": line, "image_dir": rel_image_dir,
                "image_names": names, "image_errors": errors, **({"video": video} if video is not None else {})}
        yield RawSample([i], meta, images)


_FRAME_NUMBER = re.compile(r"_(\d+).jpg$")


def frame_sort_key(name: str) -> int:
    """The official frame-folder order's key (``video_utils.sort_frames``): the number in ``_<n>.jpg`` ending the
    name, -1 without one (so ``frame_10`` comes after ``frame_9``)."""
    m = _FRAME_NUMBER.search(name)
    return int(m.group(1)) if m else -1


def _read_video(name: Any, image_dir: str, rel_image_dir: str, errors: dict[str, str]
                ) -> tuple[dict[str, Any], list[tuple[int, bytes]]]:
    """A video record's ``meta["video"]`` and members: a file's bytes as member 0, or (a name ending in ``/``) a frame
    folder's files as members ``0..n-1`` in the official order (sorted by the number in ``_<n>.jpg``; names sorted
    first, where the official order is the file system's). What cannot be read is ``errors[VIDEO_ERROR_KEY]`` (the
    cooker drops it as ``missing_video`` / ``bad_record``, drawing nothing)."""
    if not isinstance(name, str):
        errors[VIDEO_ERROR_KEY] = f"TypeError: expected str, bytes or os.PathLike object, not {type(name).__name__}"
        return {"name": None, "folder": False, "num_frames": 0}, []
    path, shown = os.path.join(image_dir, name), os.path.join(rel_image_dir, name)
    folder = name.endswith("/")
    members: list[tuple[int, bytes]] = []
    try:
        if folder:
            files = sorted(sorted(os.listdir(path)), key=frame_sort_key)
            for k, f in enumerate(files):
                with open(os.path.join(path, f), "rb") as fh:
                    members.append((k, fh.read()))
            if not members:
                errors[VIDEO_ERROR_KEY] = f"empty frame folder {shown!r}"
        else:
            with open(path, "rb") as fh:
                members.append((0, fh.read()))
            if not members[0][1]:
                errors[VIDEO_ERROR_KEY], members = f"empty video file (0 bytes) {shown!r}", []
    except OSError as e:
        errors[VIDEO_ERROR_KEY], members = _os_error_message(e, shown), []
    return {"name": name, "folder": folder, "num_frames": len(members) if folder else 0}, members


def iter_unit(group: str, unit: SourceUnit, *, image_dir: str = "", rel_image_dir: str = "",
              warn: Callable[[str], None] = lambda msg: None) -> Iterator[RawSample]:
    """The samples of one work unit, in sample order (``image_dir``/``rel_image_dir``: vlm only)."""
    if group in (T2I, EDIT):
        return _iter_parquet(group, unit)
    return _iter_vlm(unit, image_dir, rel_image_dir, warn)
