"""The official data selection (num_used_data / shuffle_lines / shuffle_seed) in the default (elastic) order.

* ``selection_counts`` follows the official rules (files repeated for t2i/edit, first-n shuffled lines for vlm);
* epoch coverage: over epoch 0 of every DP rank, the multiset of read raw rows (dataset, sample), drops included,
  equals the rows the official loader selects (oracle: ``official_units``, the unit lists the reader-golden tests
  prove against the official classes), for DP 1, 2 and 3 (a world where the partitions do not divide evenly).
"""

from __future__ import annotations

import collections
import os
import random
from pathlib import Path

import pytest
from bridge.models.bagel.data.energon.cooking import make_cook_context
from bridge.models.bagel.data.energon.layout import load_manifest
from bridge.models.bagel.data.energon.readers import GroupDatasets, open_group_reader
from bridge.models.bagel.data.energon.readers.access import DatasetAccess
from bridge.models.bagel.data.energon.readers.official import official_units
from bridge.models.bagel.data.energon.readers.selection import selection_counts, selection_runs

pytestmark = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")

RAW = Path(__file__).parent / "fixtures" / "bagel_readers" / "raw"
VAE = dict(max_image_size=1024, min_image_size=512, image_stride=16)
VIT = dict(max_image_size=518, min_image_size=224, image_stride=14)
VLM_T = dict(max_image_size=980, min_image_size=378, image_stride=14, max_pixels=2_007_040)


def _file_manifest(group, rows_per_file):
    files, samples = [], []
    for fi, n in enumerate(rows_per_file):
        files.append({"file": f"d/part-{fi}.parquet", "file_index": fi, "row_groups": [n]})
        samples += [[fi, 0, r] for r in range(n)]
    return {"group": group, "files": files, "samples": samples}


def _vlm_manifest(n):
    return {"group": "vlm_sft", "num_lines": n, "files": [{"file": "x.jsonl"}], "samples": [[i] for i in range(n)]}


def test_t2i_edit_files_repeat_or_subset():
    man = _file_manifest("t2i_pretrain", [2, 3, 1])
    assert selection_counts(man, 2) == {0: 1, 1: 1, 2: 1, 3: 1, 4: 1}                  # first 2 files
    assert selection_counts(man, 7) == {0: 3, 1: 3, 2: 2, 3: 2, 4: 2, 5: 2}            # listing repeated, first 7
    assert selection_runs(selection_counts(man, 7)) == [(0, 2, 3), (2, 6, 2)]
    assert selection_counts(_file_manifest("unified_edit", [1, 1]), 1) == {0: 1}
    assert selection_counts(man, None) == {i: 1 for i in range(6)}


def test_vlm_first_n_lines_after_shuffle():
    assert selection_counts(_vlm_manifest(16), 4) == {0: 1, 1: 1, 2: 1, 3: 1}
    lines = list(range(16))
    random.Random(7).shuffle(lines)
    assert selection_counts(_vlm_manifest(16), 4, shuffle_lines=True, shuffle_seed=7) == {i: 1 for i in lines[:4]}
    assert selection_counts(_vlm_manifest(16), 100) == {i: 1 for i in range(16)}      # no repetition for vlm
    # the example: two vlm datasets (4 and 16 lines), [1, 16] and [4, 16] select different rows
    a = [selection_counts(_vlm_manifest(4), n) for n in (1, 4)]
    assert a[0] == {0: 1} and a[1] == {0: 1, 1: 1, 2: 1, 3: 1}



# group -> (converted dir, transforms, num_used_data, shuffle kwargs): t2i files repeated (6 of 4), edit a file
# subset (2 of 4), vlm 10 of 25 shuffled lines
GROUPS = {
    "t2i_pretrain": ("t2i_pretrain/t2i", dict(image_transform_args=VAE), [6], {}),
    "unified_edit": ("unified_edit/unified_edit", dict(image_transform_args=VAE, vit_image_transform_args=VIT), [2],
                     {}),
    "vlm_sft": ("vlm_sft/vlm_sft", dict(image_transform_args=VLM_T), [10], dict(shuffle_lines=True, shuffle_seed=3)),
}


def _official_rows(path, group, num_used, kw):
    units = official_units(group, [load_manifest(path)], [DatasetAccess(path)], num_used, **kw)
    return collections.Counter((os.path.basename(path), idx) for u in units for _, _, idx in (u.rows or ()))


@pytest.mark.parametrize("dp_size", [1, 2, 3])
def test_epoch_covers_exactly_the_official_selection(dp_size, converted, tokenizer):
    for group, (rel, targs, num_used, kw) in GROUPS.items():
        path = str(converted / rel)
        expected = _official_rows(path, group, num_used, kw)
        got: collections.Counter = collections.Counter()
        ctx = make_cook_context(group, tokenizer, targs["image_transform_args"], targs.get("vit_image_transform_args"))
        for rank in range(dp_size):
            reader = open_group_reader("elastic", [path], ctx, num_used_data=num_used, dp_rank=rank, dp_size=dp_size,
                                       partitions=4, **kw)
            plan = reader.source.copy()  # what the reader will read, item by item (cooking aside)
            for _ in range(3 * sum(expected.values())):
                read = plan.next_read()
                if read.data_indexes["epoch"] == 0:
                    got[(os.path.basename(reader.datasets.paths[read.dataset]), read.index)] += 1
            reader.close()
        assert got == expected, group  # nothing lost, nothing extra, repeats as official


def test_drops_are_rows_of_the_selection_counted_not_missing(converted, tokenizer):
    rel, targs, num_used, kw = GROUPS["vlm_sft"]
    path = str(converted / rel)
    reader = open_group_reader("elastic", [path], make_cook_context("vlm_sft", tokenizer, **targs),
                               num_used_data=num_used, partitions=4, **kw)
    keys = [next(reader).restore_key for _ in range(20)]  # two epochs of 10 lines
    assert reader.taken == len(keys) + reader.drops.total and reader.drops.total > 0
    reader.close()


def test_num_used_data_changes_the_selection_and_the_identity(converted, tokenizer):
    path = str(converted / "t2i_pretrain/t2i")
    runs = [GroupDatasets([path]).selection(n, False, 0) for n in ([4], [6])]
    assert runs[0] == [[(0, 21, 1)]] and runs[1] == [[(0, 10, 2), (10, 21, 1)]]
    ctx = make_cook_context("t2i_pretrain", tokenizer, VAE)
    ids = [open_group_reader("elastic", [path], ctx, num_used_data=n).source.identity() for n in ([4], [6])]
    assert ids[0]["selection_sha256"] != ids[1]["selection_sha256"] and ids[0]["num_positions"] == 21
    assert ids[1]["num_positions"] == 31
