"""The ``.nv-meta`` index of a converted dataset written from what the converter already knows (O(units + shards)).

What Energon's ``prepare_dataset`` would write, and why it is not called on a tested Energon: it re-reads every shard
(the converter knows every offset already), its ``index.uuid`` is a fresh ``uuid4`` on every run, and with
``workers > 1`` its sqlite rows arrive in worker completion order, so neither is byte-deterministic. Here instead:
``index.sqlite`` with Energon's ``samples`` table and indexes only (Energon's ``SqliteIndexWriter`` makes the schema;
the rows are copied from the units' index fragments by SQLite itself, ``ATTACH`` + ``INSERT ... SELECT``, in unit
order; the ``sample_parts`` table serves lookups by full entry name, which no BAGEL reader does, and is dropped), and
``.info.json`` / ``split.yaml`` from Energon's own structs and serialisers. On an Energon version not in
``TESTED_ENERGON`` (``patches.active()`` False) Energon's public ``prepare_dataset`` writes them (one worker: rows in
shard order), reading the shards again.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from collections.abc import Sequence
from typing import Any

from . import active

__all__ = ["write_index"]

_NV = ".nv-meta"


def _write(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def write_index(root: str, shards: Sequence[dict[str, Any]], unit_indexes: Sequence[str]) -> None:
    """Write ``root/.nv-meta/{index.sqlite,.info.json,split.yaml}`` for the tar shards ``shards`` (``path`` relative to
    ``root``, sample ``count``; their ``.tar.idx`` written) whose ``samples`` rows are in the sqlite files
    ``unit_indexes``, in order (the patched path), or with Energon's ``prepare_dataset`` (the public path)."""
    os.makedirs(os.path.join(root, _NV), exist_ok=True)
    if not active():
        from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory

        BaseWebdatasetFactory.prepare_dataset(root, [sh["path"] for sh in shards], split_parts_ratio=[("train", 1.0)],
                                              shuffle_seed=None, workers=1)
        return
    _write_samples(root, unit_indexes)
    _write_info(root, shards)


def _write_samples(root: str, unit_indexes: Sequence[str]) -> None:
    from megatron.energon.epathlib import EPath
    from megatron.energon.flavors.webdataset.indexing import SqliteIndexWriter

    db_path = os.path.join(root, _NV, "index.sqlite")
    tmp = db_path + ".tmp"
    if os.path.exists(tmp):
        os.remove(tmp)
    writer = SqliteIndexWriter(EPath(tmp))  # Energon's schema for `samples` (+ `sample_parts`, dropped below)
    db = writer.db
    assert db is not None
    db.execute("PRAGMA synchronous = OFF")  # built under a temporary name, published by os.replace
    for unit in unit_indexes:
        db.execute("ATTACH DATABASE ? AS u", (unit,))
        db.execute("INSERT INTO samples (tar_file_id, sample_key, sample_index, byte_offset, byte_size) "
                   "SELECT tar_file_id, sample_key, sample_index, byte_offset, byte_size FROM u.samples ORDER BY rowid")
        db.commit()
        db.execute("DETACH DATABASE u")
    writer.close()
    with contextlib.closing(sqlite3.connect(tmp)) as db:
        db.execute("PRAGMA synchronous = OFF")
        db.execute("DROP TABLE sample_parts")
        db.commit()
        db.execute("VACUUM")
    os.replace(tmp, db_path)


def _write_info(root: str, shards: Sequence[dict[str, Any]]) -> None:
    import yaml
    from megatron.energon import __version__ as energon_version
    from megatron.energon.bracecollapse import collapse
    from megatron.energon.flavors.webdataset.structs import WebdatasetInfo, WebdatasetSplits
    from megatron.energon.typed_converter import to_json_object

    names = [sh["path"] for sh in shards]
    info = json.dumps(to_json_object(WebdatasetInfo(energon_version=energon_version,
                                                    shard_counts={sh["path"]: sh["count"] for sh in shards})), indent=2)
    split = yaml.dump(to_json_object(WebdatasetSplits(split_parts={"train": collapse(names, keep_order=True)})),
                      sort_keys=False)
    _write(os.path.join(root, _NV, ".info.json"), info.encode())
    _write(os.path.join(root, _NV, "split.yaml"), split.encode())
