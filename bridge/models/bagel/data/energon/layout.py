"""The on-disk layout contract of converted BAGEL datasets (shared by the converter and the readers/cookers).

One Energon crude WebDataset per group and sub-dataset: ``<out>/<group>/<dataset_name>/`` holding
``shards/shard-000000.tar`` ..., a prepared ``.nv-meta/`` (crude ``dataset.yaml`` with subflavor
``bagel_group: <group>``) and ``manifest.json``. Sample keys are ``%08d`` of the sample index; every
sample has a ``meta.json`` part (group, official source coordinate, group fields) and image parts
``img0``, ``img1``, ... holding the original encoded bytes.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = [
    "GROUPS", "T2I", "EDIT", "VLM", "MANIFEST_FORMAT", "MANIFEST_NAME", "SHARDS_DIR", "META_PART",
    "SUBFLAVOR_KEY", "DEFAULT_SAMPLES_PER_SHARD", "SKIP_NOT_IN_PARQUET_INFO", "SKIP_ROW_GROUP_BEYOND_INFO",
    "VIDEO_ERROR_KEY", "VIDEO_UNSUPPORTED",
    "sample_key", "image_part", "image_index", "shard_name", "shard_relpath", "dataset_dir", "load_manifest",
    "crude_dataset_yaml",
]

T2I = "t2i_pretrain"
EDIT = "unified_edit"
VLM = "vlm_sft"
#: The three official groups, in the order of the official example.yaml.
GROUPS: tuple[str, ...] = (T2I, EDIT, VLM)

#: Version of manifest.json (bumped on incompatible layout changes).
MANIFEST_FORMAT = 1
MANIFEST_NAME = "manifest.json"
SHARDS_DIR = "shards"
#: Tar member suffix of the per-sample metadata (the crude sample dict key).
META_PART = "meta.json"
#: Key of ``__subflavors__`` that names the group (set by ``.nv-meta/dataset.yaml``).
SUBFLAVOR_KEY = "bagel_group"
DEFAULT_SAMPLES_PER_SHARD = 1000

#: Skip reasons recorded in ``manifest["skipped"]`` (unified_edit rows the official reader never reads).
SKIP_NOT_IN_PARQUET_INFO = "file not in parquet_info"
SKIP_ROW_GROUP_BEYOND_INFO = "row group beyond parquet_info"

#: vlm_sft: ``meta["image_errors"]`` key and message for a ``video`` record (not decoded).
VIDEO_ERROR_KEY = "video"
VIDEO_UNSUPPORTED = "video unsupported"

_IMG_PREFIX = "img"


def sample_key(index: int) -> str:
    """Tar key of the sample with the given dataset-wide index (ascending in write order)."""
    return f"{index:08d}"


def image_part(i: int) -> str:
    """Part name (tar suffix, crude dict key) of image ``i`` of a sample."""
    return f"{_IMG_PREFIX}{i}"


def image_index(part: str) -> int | None:
    """Inverse of :func:`image_part`; None when ``part`` is not an image part."""
    if part.startswith(_IMG_PREFIX) and part[len(_IMG_PREFIX):].isdigit():
        return int(part[len(_IMG_PREFIX):])
    return None


def shard_name(i: int) -> str:
    return f"shard-{i:06d}.tar"


def shard_relpath(i: int) -> str:
    """Shard path relative to the dataset root (as given to Energon's prepare and stored in the manifest)."""
    return f"{SHARDS_DIR}/{shard_name(i)}"


def dataset_dir(out_root: str | os.PathLike, group: str, dataset_name: str) -> str:
    """``<out>/<group>/<dataset_name>``: the root of one converted dataset."""
    return os.path.join(os.fspath(out_root), group, dataset_name)


def load_manifest(ds_root: str | os.PathLike) -> dict[str, Any]:
    """Read ``manifest.json`` of a converted dataset, checking its format version."""
    path = os.path.join(os.fspath(ds_root), MANIFEST_NAME)
    with open(path, encoding="utf-8") as f:
        man = json.load(f)
    if man.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{path}: unsupported manifest format {man.get('format')!r} (expected {MANIFEST_FORMAT})")
    return man


def crude_dataset_yaml(group: str) -> str:
    """Text of ``.nv-meta/dataset.yaml``: a crude dataset whose samples carry the group as subflavor."""
    return (
        "__module__: megatron.energon\n"
        "__class__: CrudeWebdataset\n"
        "subflavors:\n"
        f"  {SUBFLAVOR_KEY}: {group}\n"
    )
