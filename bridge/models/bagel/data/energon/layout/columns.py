"""Manifest format 3: the O(files) tables of ``manifest.json`` as numpy columns in one sidecar file.

A format-3 dataset holds two files next to each other:

``manifest.json`` (the *header*, canonical JSON: sorted keys, no whitespace, UTF-8, one trailing newline)
    Every top-level key of the format-2 manifest except the tables listed in :data:`TABLES` (and except
    ``parquet_info`` when it is exactly the one derived from ``files``, see below), plus

    * ``"format": 3``, ``"num_files"`` and ``"num_shards"`` (the row counts of ``files`` and ``shards``);
    * ``"columns"``: ``{"file": "manifest.columns.npy", "bytes": <sidecar size>, "sha256": <hex of the
      sidecar>, "tables": {<table>: <rows>, ...}, "arrays": [[<table>, <key>, <part>, <byte offset>], ...],
      "derived": [...]}``.

``manifest.columns.npy`` (:data:`COLUMNS_NAME`, the *sidecar*)
    The arrays listed in ``columns["arrays"]``, in that order, each written by
    ``np.save(f, a, allow_pickle=False)`` right after the previous one (no gap, no zip container: the same
    manifest always gives the same bytes). ``<byte offset>`` is where an array's ``.npy`` magic starts; the
    last array ends at ``bytes``. Every array is one-dimensional, little-endian.

Tables (:data:`TABLES`, in this order; a table is stored when the manifest has it as a list of dicts):
``files`` (one row per source parquet / jsonl file), ``shards`` (one per tar shard), ``skipped`` (one per file /
row group / reason) and ``missing_row_groups`` (edit). A table of ``n`` rows is stored key by key (keys sorted,
the union over its rows); a key is stored as the parts below, in this order (``m``: the rows that have the
key with a value that is not None):

======================  ============  ===========  ==========================================================
part                    dtype         shape        holds
======================  ============  ===========  ==========================================================
``int``                 ``<i8``       ``[n]``      the value, when every value is a (non-bool) int in int64
``str``                 ``<U{w}``     ``[n]``      the value, when every value is a str not ending in NUL;
                                                   ``w`` = the longest (at least 1)
``ints_values``         ``<i8``       ``[sum]``    a list of ints per row (e.g. ``row_groups``), concatenated
``ints_offsets``        ``<i8``       ``[n + 1]``  row ``i``'s list is ``values[offsets[i]:offsets[i + 1]]``;
                                                   ``offsets[0] == 0``, non-decreasing, last == ``len(values)``
``json``                ``<U{w}``     ``[n]``      any other value, as canonical JSON text
``null``                ``|b1``       ``[n]``      True where the value is None (only written if one is)
``absent``              ``|b1``       ``[n]``      True where the row lacks the key (only written if one does)
======================  ============  ===========  ==========================================================

Exactly one of ``int`` / ``str`` / ``ints_*`` / ``json`` holds a key's values (0 / ``""`` / ``[]`` in rows that
are None or absent). What the converter writes, per group (arrays in sidecar order):

* t2i_pretrain: ``files``: ``file`` str, ``file_index`` int, ``first_sample`` int, ``num_rows`` int,
  ``num_samples`` int, ``row_groups`` ints_values + ints_offsets; ``shards``: ``bytes`` int (the file's size),
  ``count`` int, ``path`` str, ``sha256`` str (of the whole file; both absent in datasets converted before
  checksums); ``skipped`` and ``missing_row_groups`` likewise when not empty.
* unified_edit: ``files``: ``declared_row_groups`` int (+ ``null`` when a file is not in parquet_info), then
  as t2i; ``shards`` as t2i; ``skipped``: ``file_index`` int, ``reason`` str, ``row_group`` int (+ ``null``),
  ``rows`` int; ``missing_row_groups``: ``file`` str, ``file_index`` int, ``row_group`` int. Its
  ``parquet_info`` (``{file: declared_row_groups}`` of the files that declare some) is not stored: ``"derived":
  ["parquet_info"]`` says to rebuild it from ``files`` (only written when that gives exactly the same dict).
* vlm_sft: ``files`` (one row): ``file`` str, ``first_sample`` int, ``num_lines`` int, ``num_samples`` int;
  ``shards`` as t2i.

Reading: :func:`join_manifest` (the format-2 dict, O(files)), :func:`read_file_ranges` / :func:`read_columns` (a few
columns, O(1) Python objects). A format-3 header may also hold a table inline (then it is not in ``tables``). Every
problem raises :class:`ColumnsError` with a short cause (``layout`` makes it its one-line ``ManifestError``).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .. import remote

__all__ = ["COLUMNS_NAME", "TABLES", "ColumnsError", "dumps_canonical", "reading", "split_manifest", "join_manifest",
           "read_file_ranges", "read_columns"]

#: File name of the sidecar, next to ``manifest.json``.
COLUMNS_NAME = "manifest.columns.npy"
#: Top-level manifest keys stored as columns (when a list of dicts), in sidecar order.
TABLES: tuple[str, ...] = ("files", "shards", "skipped", "missing_row_groups")
#: Header keys of format 3 only (not part of the format-2 dict).
HEADER_ONLY = ("columns", "num_files", "num_shards")
_PARQUET_INFO = "parquet_info"
_I64, _BOOL = np.dtype("<i8"), np.dtype("|b1")
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_VALUE_PARTS = ("int", "str", "ints_values", "json")
_PARTS = ("int", "str", "ints_values", "ints_offsets", "json", "null", "absent")
_ABSENT = object()


class ColumnsError(ValueError):
    """The sidecar (or the header's ``columns``) is missing, cut short or inconsistent; the message is a short
    cause (``layout`` adds the manifest path, the dataset and the remedy)."""


@contextlib.contextmanager
def reading(name: str) -> Iterator[None]:
    """Within it, an OSError becomes a ColumnsError naming the file ``name``: ``no such file``, else its cause."""
    try:
        yield
    except FileNotFoundError:
        raise ColumnsError(f"{name}: no such file") from None
    except OSError as e:
        raise ColumnsError(f"{name}: {e.strerror or e}") from None


def dumps_canonical(obj: Any) -> bytes:
    """Canonical JSON bytes (sorted keys, no whitespace, UTF-8): the same object always gives the same bytes."""
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")


def _is_i64(v: Any) -> bool:
    return type(v) is int and _I64_MIN <= v <= _I64_MAX


def _derived_parquet_info(files: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``{file: declared_row_groups}`` of the files that declare some, keys sorted (what format 2 loads)."""
    return dict(sorted((f["file"], f["declared_row_groups"]) for f in files
                       if f.get("declared_row_groups") is not None))


def _encode_key(rows: Sequence[Mapping[str, Any]], key: str) -> list[tuple[str, np.ndarray]]:
    """The parts of one key of a table (see the module docstring), in sidecar order."""
    vals = [r.get(key, _ABSENT) for r in rows]
    absent, null = [v is _ABSENT for v in vals], [v is None for v in vals]
    present = [v for v in vals if v is not _ABSENT and v is not None]
    parts: list[tuple[str, np.ndarray]] = []
    if all(map(_is_i64, present)):
        parts.append(("int", np.array([v if type(v) is int else 0 for v in vals], dtype=_I64)))
    elif all(type(v) is str and not v.endswith("\x00") for v in present):
        strs = [v if type(v) is str else "" for v in vals]
        parts.append(("str", np.array(strs, dtype=f"<U{max([1, *map(len, strs)])}")))
    elif all(type(v) is list and all(map(_is_i64, v)) for v in present):
        lists = [v if type(v) is list else [] for v in vals]
        offsets = np.zeros(len(lists) + 1, dtype=_I64)
        np.cumsum([len(x) for x in lists], out=offsets[1:])
        flat = np.fromiter(itertools.chain.from_iterable(lists), dtype=_I64, count=int(offsets[-1]))
        parts += [("ints_values", flat), ("ints_offsets", offsets)]
    else:
        texts = ["" if v is _ABSENT or v is None else dumps_canonical(v).decode("utf-8") for v in vals]
        parts.append(("json", np.array(texts, dtype=f"<U{max([1, *map(len, texts)])}")))
    return parts + [(name, np.array(mask, dtype=_BOOL)) for name, mask in (("null", null), ("absent", absent))
                    if any(mask)]


def split_manifest(man: Mapping[str, Any], fmt: int) -> tuple[dict[str, Any], bytes]:
    """A format-2-shaped manifest as (format-``fmt`` header dict, sidecar bytes); deterministic.

    Raises ValueError when ``files`` / ``shards`` are not lists of dicts or the manifest already uses a
    format-3 header key (``columns``, ``num_files``, ``num_shards``).
    """
    clash = [k for k in HEADER_ONLY if k in man]
    if clash:
        raise ValueError(f"manifest key {clash[0]!r} is reserved for the format-3 header")
    tables = {t: man[t] for t in TABLES if isinstance(man.get(t), list) and all(isinstance(r, Mapping) for r in man[t])}
    for t in ("files", "shards"):
        if t not in tables:
            raise ValueError(f"manifest {t!r} must be a list of objects")
    derived, info = [], man.get(_PARQUET_INFO)
    if (isinstance(info, Mapping) and all(type(v) is int for v in info.values())
            and all(isinstance(f.get("file"), str) for f in tables["files"])
            and dict(info) == _derived_parquet_info(tables["files"])):
        derived.append(_PARQUET_INFO)
    buf, arrays = io.BytesIO(), []
    for t, rows in tables.items():
        for key in sorted({k for r in rows for k in r}):
            if not isinstance(key, str):
                raise ValueError(f"manifest {t!r}: key {key!r} is not a string")
            for part, a in _encode_key(rows, key):
                arrays.append([t, key, part, buf.tell()])
                np.save(buf, a, allow_pickle=False)
    data = buf.getvalue()
    header = {k: v for k, v in man.items() if k not in tables and k not in derived}
    header.update(format=fmt, num_files=len(tables["files"]), num_shards=len(tables["shards"]),
                  columns={"file": COLUMNS_NAME, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                           "tables": {t: len(rows) for t, rows in tables.items()}, "arrays": arrays,
                           "derived": derived})
    return header, data


def _spec(header: Mapping[str, Any]) -> tuple[dict[str, int], list[tuple[str, str, str, int]], int]:
    """``(tables, arrays, bytes)`` of a header's ``columns``, type-checked (raises ColumnsError)."""
    spec = header.get("columns")
    try:
        tables, size = spec["tables"], spec["bytes"]
        arrays = [(str(t), str(k), str(p), o) for t, k, p, o in spec["arrays"]]
        ok = (isinstance(spec, dict) and spec.get("file") == COLUMNS_NAME and isinstance(tables, dict)
              and all(t in TABLES and _is_i64(n) and n >= 0 for t, n in tables.items())
              and _is_i64(size) and all(t in tables and p in _PARTS and _is_i64(o) for t, _, p, o in arrays)
              and isinstance(spec.get("derived", []), list))
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise ColumnsError(f"header 'columns' is not a {COLUMNS_NAME} description")
    for t, key in (("files", "num_files"), ("shards", "num_shards")):
        if t in tables and header.get(key) != tables[t]:
            raise ColumnsError(f"{key} {header.get(key)!r} but the columns hold {tables[t]} {t}")
    return tables, arrays, size


def _load(f: Any, where: str) -> np.ndarray:
    try:
        return np.load(f, allow_pickle=False)
    except (ValueError, OSError, EOFError, SyntaxError) as e:
        raise ColumnsError(f"{COLUMNS_NAME}: {where}: {type(e).__name__}: {e}") from None


def _checked(a: np.ndarray, part: str, n: int, where: str) -> np.ndarray:
    """``a`` when its dtype and shape are those of ``part`` in a table of ``n`` rows, else ColumnsError."""
    if part in ("int", "ints_values", "ints_offsets"):
        ok, dtype = a.dtype == _I64, _I64.str
    elif part in ("str", "json"):
        ok, dtype = a.dtype.kind == "U" and a.dtype.byteorder in "<=", "<U"
    else:
        ok, dtype = a.dtype == _BOOL, _BOOL.str
    want = None if part == "ints_values" else n + 1 if part == "ints_offsets" else n
    if not ok or a.ndim != 1 or (want is not None and len(a) != want):
        raise ColumnsError(f"{COLUMNS_NAME}: {where}: {a.dtype.str} {list(a.shape)}, expected {dtype} "
                           f"[{'*' if want is None else want}]")
    return a


def _decode_key(parts: dict[str, np.ndarray], where: str) -> tuple[list[Any], list[bool] | None]:
    """One key's values (None where null) and its absent mask (None when every row has it)."""
    kinds = [p for p in _VALUE_PARTS if p in parts]
    if len(kinds) != 1 or (("ints_values" in parts) != ("ints_offsets" in parts)):
        raise ColumnsError(f"{COLUMNS_NAME}: {where}: parts {sorted(parts)}")
    kind = kinds[0]
    if kind == "ints_values":
        vals, offs = parts["ints_values"], parts["ints_offsets"]
        if (offs[0] != 0 or offs[-1] != len(vals) or (np.diff(offs) < 0).any()):
            raise ColumnsError(f"{COLUMNS_NAME}: {where}: offsets do not cut the values")
        flat, cut = vals.tolist(), offs.tolist()
        values: list[Any] = [flat[a:b] for a, b in zip(cut, cut[1:])]
    elif kind == "json":
        try:
            values = [json.loads(s) if s else None for s in parts["json"].tolist()]
        except ValueError as e:
            raise ColumnsError(f"{COLUMNS_NAME}: {where}: {e}") from None
    else:
        values = parts[kind].tolist()
    if "null" in parts:
        values = [None if z else v for v, z in zip(values, parts["null"].tolist())]
    return values, parts["absent"].tolist() if "absent" in parts else None


def join_manifest(header: Mapping[str, Any], ds_root: str | os.PathLike) -> dict[str, Any]:
    """The format-2-shaped dict of a format-3 header and its sidecar (same keys, values and key order as the
    format-2 JSON of the same manifest; the sidecar's size and sha256 checked, its columns made Python objects by
    ``tolist()``). Without ``columns`` the tables are taken inline. Raises ColumnsError."""
    out = {k: v for k, v in header.items() if k not in HEADER_ONLY}
    if "columns" in header:
        tables, arrays, size = _spec(header)
        both = [t for t in tables if t in header]
        if both:
            raise ColumnsError(f"{both[0]!r} is both in the header and in {COLUMNS_NAME}")
        with reading(COLUMNS_NAME):
            data = remote.read_bytes(remote.join(ds_root, COLUMNS_NAME))
        if len(data) != size:
            raise ColumnsError(f"{COLUMNS_NAME}: {len(data)} bytes, the header says {size}")
        if hashlib.sha256(data).hexdigest() != header["columns"].get("sha256"):
            raise ColumnsError(f"{COLUMNS_NAME}: sha256 differs from the header's")
        buf, keyed = io.BytesIO(data), {t: {} for t in tables}
        for t, key, part, off in arrays:
            if buf.tell() != off:
                raise ColumnsError(f"{COLUMNS_NAME}: {t}.{key} {part} at byte {buf.tell()}, the header says {off}")
            keyed[t].setdefault(key, {})[part] = _checked(_load(buf, f"{t}.{key}"), part, tables[t], f"{t}.{key}")
        if buf.tell() != size:
            raise ColumnsError(f"{COLUMNS_NAME}: the arrays end at byte {buf.tell()} of {size}")
        for t, n in tables.items():
            keys = sorted(keyed[t])
            cols = [_decode_key(keyed[t][k], f"{t}.{k}") for k in keys]
            if keys and all(absent is None for _, absent in cols):  # every row has every key: C-level zips
                out[t] = [dict(zip(keys, row)) for row in zip(*(v for v, _ in cols))]
            else:
                out[t] = [{k: v for k, (vals, absent) in zip(keys, cols)
                           for v in (vals[i],) if absent is None or not absent[i]} for i in range(n)]
        if _PARQUET_INFO in header["columns"].get("derived", []):
            try:
                out[_PARQUET_INFO] = _derived_parquet_info(out["files"])
            except (KeyError, TypeError) as e:
                raise ColumnsError(f"{COLUMNS_NAME}: cannot derive parquet_info from files ({e})") from None
    return dict(sorted(out.items()))


def read_file_ranges(header: Mapping[str, Any], ds_root: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """``(first_sample, num_samples)`` of every ``files`` row: two int64 ``[num_files]`` arrays (read-only),
    read from the sidecar alone (O(1) Python objects). Their consistency is the caller's to check.
    Raises ColumnsError (sidecar missing, of another size, a column missing, of another dtype or length)."""
    _, arrays, _ = _spec(header)
    for key in ("first_sample", "num_samples"):
        if {p for t, k, p, _ in arrays if t == "files" and k == key} not in ({"int"}, set()):
            raise ColumnsError(f"{COLUMNS_NAME}: files.{key} is not one int column")
    first, num = read_columns(header, ds_root, "files", [("first_sample", "int"), ("num_samples", "int")])
    return first, num


def read_columns(header: Mapping[str, Any], ds_root: str | os.PathLike, table: str,
                 wanted: Sequence[tuple[str, str]]) -> list[np.ndarray]:
    """The ``(key, part)`` arrays ``wanted`` of ``table`` (e.g. ``[("count", "int"), ("path", "str")]`` of
    ``shards``), read-only, in that order, read from the sidecar alone (one ``np.load`` after a seek each: O(1)
    Python objects; the sidecar's size checked, its hash not). Raises ColumnsError (sidecar missing or of another
    size, the table or a part missing, of another dtype or length)."""
    tables, arrays, size = _spec(header)
    if table not in tables:
        raise ColumnsError(f"header 'columns' holds no {table} table")
    n = tables[table]
    where = {(k, p): o for t, k, p, o in arrays if t == table}
    out = []
    # a remote sidecar: read once into memory
    with reading(COLUMNS_NAME), remote.open_binary(remote.join(ds_root, COLUMNS_NAME)) as f:
        actual = f.seek(0, os.SEEK_END)
        if actual != size:
            raise ColumnsError(f"{COLUMNS_NAME}: {actual} bytes, the header says {size}")
        for key, part in wanted:
            if (key, part) not in where:
                raise ColumnsError(f"{COLUMNS_NAME}: no {table}.{key} {part} column")
            f.seek(where[key, part])
            a = _checked(_load(f, f"{table}.{key}"), part, n, f"{table}.{key}")
            a.flags.writeable = False
            out.append(a)
    return out
