"""``GroupDatasets``: the converted datasets of one group, checked and opened once per rank."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from .. import remote
from ..layout import MANIFEST_NAME, ManifestIndex, damage, load_manifest_index
from ..layout.checksums import ChecksumTable
from .access import DatasetAccess
from .selection import manifest_runs

__all__ = ["GroupDatasets"]


def _info_num_samples(path: str) -> int:
    """The sample count of a prepared dataset without a converter manifest, from its ``.nv-meta/.info.json``."""
    info = remote.join(path, ".nv-meta", ".info.json")
    if not remote.isfile(info):
        raise ValueError(f"{path}: not a converted BAGEL dataset (no {MANIFEST_NAME} and no .nv-meta/.info.json)")
    return int(sum(json.loads(remote.read_bytes(info)).get("shard_counts", {}).values()))


class GroupDatasets:
    """The converted datasets of one group: absolute ``paths``, the ``group`` name, each dataset's sample count
    (``counts``) and manifest index (``manifests``, read once; None without a converter manifest), their recorded
    checksums (``checksums``: a memory-mapped ``layout.checksums.ChecksumTable``, None for a dataset without them),
    and their random access (``access``, opened on first use).

    Raises ValueError (one line) for an empty dataset or datasets of different groups; ``layout.damage`` names a
    damaged ``.nv-meta`` first (Energon would only say "Invalid dataset at <dir>"); ManifestError for a damaged
    manifest or checksums file.
    """

    def __init__(self, paths: str | Sequence[str], group: str | None = None, *, patched: bool | None = None) -> None:
        self.paths = [remote.absolute(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
        if not self.paths:
            raise ValueError("a group reader needs at least one dataset path")
        for p in self.paths:
            damage.check_prepared(p)
        groups: set[str | None] = {group}
        self.counts: list[int] = []
        self.manifests: list[ManifestIndex | None] = []
        self.checksums: list[ChecksumTable | None] = []
        for p in self.paths:  # the manifests' O(1) view (format 3: no per-file Python object)
            man = load_manifest_index(p) if remote.isfile(remote.join(p, MANIFEST_NAME)) else None
            self.manifests.append(man)
            self.checksums.append(ChecksumTable.open(p) if man is not None else None)
            g, n = (man.group, man.num_samples) if man is not None else ("", _info_num_samples(p))
            if n == 0:
                raise ValueError(f"{p}: no samples; a dataset of a group must hold data")
            groups.add(g or group)
            self.counts.append(n)
        groups.discard(None)
        if len(groups) != 1:
            raise ValueError(f"datasets {self.paths} are not all of one group: {sorted(map(str, groups))}")
        self.group: str = groups.pop()  # type: ignore[assignment]
        self._patched = patched
        self._access: list[DatasetAccess | None] = [None] * len(self.paths)

    def name(self, d: int) -> str:
        """Dataset ``d``'s directory name."""
        return os.path.basename(self.paths[d])

    def access(self, d: int) -> DatasetAccess:
        """Dataset ``d``'s random access (opened on first use)."""
        if self._access[d] is None:
            self._access[d] = DatasetAccess(self.paths[d], patched=self._patched)
        return self._access[d]  # type: ignore[return-value]

    def accesses(self) -> list[DatasetAccess]:
        return [self.access(d) for d in range(len(self.paths))]

    def selection(self, num_used_data: Sequence[int] | None, shuffle_lines: bool, shuffle_seed: int
                  ) -> list[list[tuple[int, int, int]]]:
        """Per dataset, the official selection as ``(start, end, repetitions)`` sample-index runs
        (``selection.manifest_runs``). Raises ValueError when the selection needs a manifest it has not."""
        if num_used_data is not None and len(num_used_data) != len(self.paths):
            raise ValueError(f"num_used_data has {len(num_used_data)} entries for {len(self.paths)} datasets")
        runs = []
        for i, (p, n) in enumerate(zip(self.paths, self.counts)):
            used = None if num_used_data is None else int(num_used_data[i])
            if used is None and not (shuffle_lines and self.group == "vlm_sft"):
                runs.append([(0, n, 1)] if n else [])
                continue
            man = self.manifests[i]
            if man is None:
                raise ValueError(f"{p}: num_used_data / shuffle_lines need the converter's {MANIFEST_NAME}")
            runs.append(manifest_runs(man, used, shuffle_lines=shuffle_lines, shuffle_seed=shuffle_seed))
        return runs

    def unverified(self) -> list[str]:
        """The datasets that record no checksums (their samples are read unverified)."""
        return [p for p, t in zip(self.paths, self.checksums) if t is None]

    def close_files(self) -> None:
        for a in self._access:
            if a is not None:
                a.close_files()
