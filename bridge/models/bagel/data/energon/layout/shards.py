"""The samples of one converted shard as Energon groups them: the one member-key split rule of the package.

``bagel-data verify`` (the per-sample checksums) and ``bagel-data stats`` (the token estimates) read shards through
:func:`shard_samples`, so both see exactly the samples the readers get: the tar's regular members in order, names
``__…__`` skipped, a member name split into sample key and part at the first dot of its base name
(``megatron.energon.flavors.webdataset.config``'s ``split_name_re`` / ``skip_meta_re``).
"""

from __future__ import annotations

import itertools
import re
import tarfile
from collections.abc import Iterator
from typing import IO

__all__ = ["shard_samples", "split_member"]

#: Energon's split of a member name into sample key and part name, and the member names it skips.
_SPLIT_NAME = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_SKIP_META = re.compile(r"__[^/]*__($|/)")


def split_member(name: str) -> tuple[str, str] | None:
    """(sample key, part) of a tar member name as Energon splits it; None for a name Energon skips."""
    hit = None if _SKIP_META.match(name) else _SPLIT_NAME.match(name)
    return (hit.group(1), hit.group(2)) if hit else None


def shard_samples(path: str | IO[bytes]) -> Iterator[tuple[str, list[tuple[str, bytes]]]]:
    """``(key, [(part, bytes), ...])`` of the shard at ``path`` (or in an open binary file) in tar order (a sample's
    parts are consecutive members, their bytes as stored). Raises tarfile / OS errors (``layout.damage.diagnose``
    names the cause)."""
    with (tarfile.open(path, "r:") if isinstance(path, str) else tarfile.open(fileobj=path, mode="r:")) as tf:
        members = ((split, m) for m in tf if m.isfile() for split in [split_member(m.name)] if split is not None)
        for key, group in itertools.groupby(members, key=lambda split_m: split_m[0][0]):  # consecutive members
            yield key, [(ext, tf.extractfile(m).read()) for (_, ext), m in group]  # type: ignore[union-attr]
