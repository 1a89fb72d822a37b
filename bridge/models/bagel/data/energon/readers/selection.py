"""The official per-dataset data selection (``num_used_data`` / ``shuffle_lines`` / ``shuffle_seed``) as
sample-index runs, computed from the converter's manifest (no reconversion when the YAML changes).

Official rules (spec bagel_packer.md §4.2–§4.5, mirroring ``data/parquet_utils.get_parquet_data_paths``,
``T2IIterableDataset``, ``ParquetStandardIterableDataset`` and ``SftJSONLIterableDataset.__init__``):

* t2i / edit: ``n`` parquet files: the file listing repeated ``n // len + 1`` times, first ``n`` entries
  (``select_files``), every row of a selected file read once per selection (edit: only the row groups
  declared in parquet_info, which are the only ones the converter stores). The listing is the manifest's
  sorted file order (the official ``os.listdir`` order is file-system dependent).
* vlm: the file's lines in order, shuffled with ``random.Random(shuffle_seed)`` when ``shuffle_lines``,
  the first ``n`` kept (no repetition).

:func:`manifest_runs` gives one converted dataset's selection as ``(start, end, repetitions)`` runs of consecutive
sample indices (laid out by the elastic order as one epoch's selection positions: ``partitions.GroupLayout``). Cost:
t2i / edit O(files) at C speed (a format-2 dict's entries or a ``layout.ManifestIndex``'s int64 columns; no
per-sample object); vlm O(1) unless a shuffled strict subset is asked, then one exact permutation of the lines
(:func:`shuffled_range`, 4 bytes per line) and one run per stretch of consecutive selected lines.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..layout import VLM, ManifestIndex, file_ranges, upgrade_manifest_v1

__all__ = ["select_files", "selection_counts", "selection_runs", "manifest_runs", "shuffled_range", "vlm_lines"]

Run = tuple[int, int, int]


def select_files(files: Sequence[Any], n: int) -> list[Any]:
    """``get_parquet_data_paths``: the listing repeated ``n // len + 1`` times, first ``n`` entries."""
    return (list(files) * (n // len(files) + 1))[:n] if files else []


def shuffled_range(n: int, seed: int) -> np.ndarray:
    """``random.Random(seed).shuffle(list(range(n)))`` as a numpy array, bit-identical (the same ``_randbelow``
    draws in the same order), without ``n`` Python int objects: int32 (int64 beyond 2**31), ~0.4 µs per line."""
    a = array("i" if n < 2**31 else "q", range(n))
    randbelow = random.Random(seed)._randbelow  # what Random.shuffle itself calls, in the same order
    for i in range(n - 1, 0, -1):
        j = randbelow(i + 1)
        a[i], a[j] = a[j], a[i]
    return np.frombuffer(a, dtype=np.int32 if a.itemsize == 4 else np.int64)


#: A dataset's manifest as :func:`manifest_runs` takes it: the format-2 dict (``layout.load_manifest``; an
#: in-memory format-1 dict is upgraded) or its :class:`~.layout.ManifestIndex` (``layout.load_manifest_index``).
Manifest = Mapping[str, Any] | ManifestIndex


def _index(manifest: Manifest) -> ManifestIndex:
    """``manifest`` as a :class:`ManifestIndex` (an in-memory format-1 dict with ``samples`` upgraded first; a vlm
    dict's file ranges are left empty: its selection needs ``num_lines`` only)."""
    if isinstance(manifest, ManifestIndex):
        return manifest
    if "samples" in manifest and "first_sample" not in (manifest.get("files") or [{}])[0]:
        manifest = upgrade_manifest_v1(manifest, "<in-memory manifest>")
    lines = int(manifest.get("num_lines", manifest.get("num_samples", 0)))
    ranges = file_ranges(manifest["files"] if manifest["group"] != VLM else [])
    return ManifestIndex("", manifest["group"], lines, lines, *ranges)


def vlm_lines(manifest: Manifest, n: int | None, shuffle_lines: bool, shuffle_seed: int) -> np.ndarray | None:
    """The selected line numbers of a vlm dataset in selection order (the official ``lines[:n]`` after the
    optional shuffle), or None when they are simply ``0 .. min(n, num_lines) - 1`` in order."""
    num_lines = _index(manifest).num_lines
    if not shuffle_lines:
        return None
    return shuffled_range(num_lines, shuffle_seed)[: num_lines if n is None else max(n, 0)]


def manifest_runs(manifest: Manifest, n: int | None, *, shuffle_lines: bool = False,
                  shuffle_seed: int = 0) -> list[Run]:
    """The official selection of one converted dataset as sorted ``(start, end, repetitions)`` runs (Python
    ints), the same for its format-2 dict and its ``ManifestIndex``.

    ``n`` is the dataset's ``num_used_data`` entry; None selects every converted sample once. Equal to
    ``selection_runs(selection_counts(...))`` without building a per-sample dict.
    """
    man = _index(manifest)
    if man.group == VLM:
        num_lines = man.num_lines
        used = num_lines if n is None else min(max(n, 0), num_lines)
        if used in (0, num_lines) or not shuffle_lines:  # every line, or the first ``used`` lines
            return [(0, used, 1)] if used else []
        starts = np.sort(vlm_lines(man, used, shuffle_lines, shuffle_seed))  # each selected line once
        ends, reps = starts + 1, np.ones(len(starts), dtype=np.int64)
    else:
        starts, ends = man.file_first_sample, man.file_first_sample + man.file_num_samples
        k, extra = (1, 0) if n is None else divmod(max(n, 0), max(len(starts), 1))  # times in select_files(files, n)
        reps = np.full(len(starts), k, dtype=np.int64)
        reps[:extra] += 1
        keep = (reps > 0) & (ends > starts)
        starts, ends, reps = starts[keep], ends[keep], reps[keep]
    if len(starts) == 0:
        return []
    # a run continues while the next kept piece (file, or line) starts where the previous ends, with the same reps
    new_run = np.ones(len(starts), dtype=bool)
    new_run[1:] = (starts[1:] != ends[:-1]) | (reps[1:] != reps[:-1])
    first = np.flatnonzero(new_run)
    last = np.append(first[1:] - 1, len(starts) - 1)
    return list(zip(starts[first].tolist(), ends[last].tolist(), reps[first].tolist()))


def selection_counts(manifest: Manifest, n: int | None, *, shuffle_lines: bool = False,
                     shuffle_seed: int = 0) -> dict[int, int]:
    """``{sample index: times the official loader reads it per pass}`` of one converted dataset (O(samples):
    for tests and small datasets; the reader uses :func:`manifest_runs`).

    ``n`` is the dataset's ``num_used_data`` entry; None selects every converted sample once (our default
    when the YAML has no ``num_used_data``). Indices are Energon sample indices (the converter's write order).
    """
    return {i: c for s, e, c in manifest_runs(manifest, n, shuffle_lines=shuffle_lines, shuffle_seed=shuffle_seed)
            for i in range(s, e)}


def selection_runs(counts: Mapping[int, int]) -> list[Run]:
    """``counts`` as sorted ``(start, end, repetitions)`` runs: indices ``start..end-1`` each ``repetitions`` times."""
    runs: list[list[int]] = []
    for i in sorted(counts):
        c = counts[i]
        if c <= 0:
            continue
        if runs and runs[-1][1] == i and runs[-1][2] == c:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1, c])
    return [tuple(r) for r in runs]
