"""The official per-dataset data selection (``num_used_data`` / ``shuffle_lines`` / ``shuffle_seed``) as
Energon sample ranges, computed from the converter's manifest (no reconversion when the YAML changes).

Official rules (spec bagel_packer.md §4.2–§4.5, mirroring ``data/parquet_utils.get_parquet_data_paths``,
``T2IIterableDataset``, ``ParquetStandardIterableDataset`` and ``SftJSONLIterableDataset.__init__``):

* t2i / edit: ``n`` parquet files: the file listing repeated ``n // len + 1`` times, first ``n`` entries
  (``select_files``), every row of a selected file read once per selection (edit: only the row groups
  declared in parquet_info, which are the only ones the converter stores). The listing is the manifest's
  sorted file order (the official ``os.listdir`` order is file-system dependent).
* vlm: the file's lines in order, shuffled with ``random.Random(shuffle_seed)`` when ``shuffle_lines``,
  the first ``n`` kept (no repetition).

``selection_counts`` gives ``{sample index: times selected}`` per converted dataset;
``selection_runs`` compresses it into ``(start, end, repetitions)`` runs of consecutive sample indices,
which the reader turns into a ``blend_epochized`` metadataset (``subset: {range: [start, end]}`` +
``repetitions``): one Energon epoch then holds exactly the official selection.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from .layout import VLM

__all__ = ["select_files", "selection_counts", "selection_runs"]


def select_files(files: Sequence[Any], n: int) -> list[Any]:
    """``get_parquet_data_paths``: the listing repeated ``n // len + 1`` times, first ``n`` entries."""
    if not files:
        return []
    return (list(files) * (n // len(files) + 1))[:n]


def _vlm_counts(manifest: Mapping[str, Any], n: int | None, shuffle_lines: bool, shuffle_seed: int) -> dict[int, int]:
    by_line = {int(c[0]): i for i, c in enumerate(manifest["samples"])}
    num_lines = int(manifest.get("num_lines", len(by_line)))
    if sorted(by_line) != list(range(num_lines)):
        raise ValueError(f"vlm dataset {manifest.get('dataset_name')!r}: the manifest does not hold every line "
                         f"0..{num_lines - 1} once; reconvert it")
    lines = list(range(num_lines))
    if shuffle_lines:
        random.Random(shuffle_seed).shuffle(lines)  # the official self.rng.seed(shuffle_seed); self.rng.shuffle(lines)
    if n is not None:
        lines = lines[:n]
    return {by_line[line]: 1 for line in lines}


def selection_counts(manifest: Mapping[str, Any], n: int | None, *, shuffle_lines: bool = False,
                     shuffle_seed: int = 0) -> dict[int, int]:
    """``{sample index: times the official loader reads it per pass}`` of one converted dataset.

    ``n`` is the dataset's ``num_used_data`` entry; None selects every converted sample once (our default
    when the YAML has no ``num_used_data``). Indices are Energon sample indices (= manifest ``samples``
    positions, the converter's write order). Raises ValueError on a manifest that does not fit.
    """
    if manifest["group"] == VLM:
        return _vlm_counts(manifest, n, shuffle_lines, shuffle_seed)
    if n is None:
        return {i: 1 for i in range(len(manifest["samples"]))}
    of_file: dict[int, list[int]] = {}
    for i, coord in enumerate(manifest["samples"]):
        of_file.setdefault(int(coord[0]), []).append(i)
    counts: dict[int, int] = {}
    for f in select_files(manifest["files"], n):
        for i in of_file.get(int(f["file_index"]), ()):
            counts[i] = counts.get(i, 0) + 1
    return counts


def selection_runs(counts: Mapping[int, int]) -> list[tuple[int, int, int]]:
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
