"""The official data selection (num_used_data / shuffle_lines / shuffle_seed) in the default Energon path.

* ``selection_counts`` follows the official rules (files repeated for t2i/edit, first-n shuffled lines for vlm);
* epoch coverage: over one Energon epoch of every DP rank, the multiset of consumed raw rows (dataset, sample),
  drops included, equals the rows the official loader selects (oracle: ``official_units``, the unit lists the
  reader-golden tests prove against the official classes), for DP 1/2 and Energon workers 0/2.
"""

from __future__ import annotations

import collections
import os
import random
from pathlib import Path

import pytest
from megatron.energon.epathlib import EPath
from megatron.energon.flavors.webdataset.itar_reader import SqliteITarEntryReader

from bridge.models.bagel.data.energon.layout import load_manifest
from bridge.models.bagel.data.energon.readers.official import official_units
from bridge.models.bagel.data.energon.readers.core import BagelGroupReader
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
    reader = SqliteITarEntryReader(EPath(path))
    try:
        units = official_units(group, [load_manifest(path)], [reader], num_used, **kw)
    finally:
        reader.close()
    return collections.Counter((os.path.basename(path), idx) for u in units for _, _, idx in (u.rows or ()))


@pytest.mark.parametrize("dp_size,workers", [(1, 0), (1, 2), (2, 0), (2, 2)])
def test_epoch_covers_exactly_the_official_selection(dp_size, workers, converted, tokenizer):
    for group, (rel, targs, num_used, kw) in GROUPS.items():
        path = str(converted / rel)
        expected = _official_rows(path, group, num_used, kw)
        got: collections.Counter = collections.Counter()
        drops = 0
        for rank in range(dp_size):
            reader = BagelGroupReader([path], tokenizer=tokenizer, dp_rank=rank, dp_size=dp_size, num_workers=workers,
                                      group=group, num_used_data=num_used, **targs, **kw)
            try:
                # one Energon epoch per worker (a worker that finishes first wraps into its next epoch while the
                # others still deliver theirs: those reads are not part of this epoch)
                slots = max(workers, 1)
                need = {w: reader.loader.dataset.len_worker(w) for w in range(slots)}
                it = iter(reader.loader)           # the cooked stream, tombstones included (reader.__next__ skips them)
                for _ in range(3 * len(reader.loader)):
                    if not any(need.values()):
                        break
                    s = next(it)
                    w = s.__restore_key__[1] - rank * workers   # global worker id -> local
                    if not need[w]:
                        continue
                    need[w] -= 1
                    got[(os.path.basename(str(s.__sources__[0].dataset_path)), s.__sources__[0].index)] += 1
                    drops += s.drop_reason is not None
                assert not any(need.values()), need
            finally:
                reader.close()
        assert got == expected, group                # nothing lost, nothing extra, repeats as official
        assert sum(expected.values()) > drops        # drops are rows of the selection, counted, not missing


def test_num_used_data_changes_the_reader_identity(converted, tokenizer):
    path = str(converted / "t2i_pretrain/t2i")
    ids = []
    for n in ([4], [6]):
        r = BagelGroupReader([path], tokenizer=tokenizer, image_transform_args=VAE, num_used_data=n)
        ids.append(r.identity()["selection"])
        r.close()
    assert ids[0] == [[[0, 21, 1]]] and ids[1] == [[[0, 10, 2], [10, 21, 1]]]


def test_the_blend_of_a_partial_selection_leaves_no_temporary_directory(converted, tokenizer, short_tmp_path,
                                                                       monkeypatch):
    """The selection's metadataset YAML was removed only by ``close()``, which a trainer never calls: every rank
    of every run left a ``bagel-blend-*`` directory per group. It is gone once Energon has opened it, and the
    reader still reads, saves and resumes (2 workers, a restored sample included)."""
    import torch

    monkeypatch.setattr("tempfile.tempdir", str(short_tmp_path))
    path = str(converted / "t2i_pretrain/t2i")
    kw = dict(tokenizer=tokenizer, image_transform_args=VAE, num_used_data=[6], num_workers=2)
    a = BagelGroupReader([path], **kw)
    try:
        assert a.runs == [[(0, 10, 2), (10, 21, 1)]]  # a blend, not the dataset opened whole
        assert list(short_tmp_path.glob("bagel-blend-*")) == []
        first = [next(a) for _ in range(3)]
        state = a.state_dict()
        rest = [next(a) for _ in range(4)]
    finally:
        a.close()
    b = BagelGroupReader([path], **kw)
    try:
        assert list(short_tmp_path.glob("bagel-blend-*")) == []
        b.load_state_dict(state)
        again = b.restore_sample(first[-1].restore_key)
        assert torch.equal(again.image_tensor_list[0], first[-1].image_tensor_list[0])
        assert [s.restore_key for s in (next(b) for _ in range(4))] == [s.restore_key for s in rest]
    finally:
        b.close()


def test_reader_identity_is_bounded_and_still_refuses_every_change(converted, tokenizer):
    """The resume fingerprint keeps Energon's long lists (shards, worker slice offsets: O(shards) and
    O(samples / max_samples_per_sequence)) as ``{"items", "sha256"}``: bounded in size, deterministic, and a
    changed slice / worker config / sample count still shows up as a differing key under ``loader``."""
    import json

    from bridge.models.bagel.data.energon.identity import canonical_digest, loader_identity, strip_paths
    from bridge.models.bagel.data.pipeline.loader import fingerprint_diff

    path = str(converted / "t2i_pretrain/t2i")

    def ident(**kw):
        r = BagelGroupReader([path], tokenizer=tokenizer, image_transform_args=VAE, **kw)
        try:
            return r.identity(), r.loader.config(), r.open_seconds
        finally:
            r.close()

    base, config, opened = ident(max_samples_per_sequence=1)  # 21 samples -> 22 slice offsets: above the limit
    assert set(opened) == {"selection", "energon", "identity", "other"} and all(v >= 0 for v in opened.values())

    def lists(obj):
        if isinstance(obj, dict):
            return [x for v in obj.values() for x in lists(v)]
        return [obj] + [x for v in obj for x in lists(v)] if isinstance(obj, list) else []

    assert max(map(len, lists(base["loader"]))) <= 16
    offsets = lists(config)[[len(x) for x in lists(config)].index(22)]
    text = json.dumps(base)
    assert canonical_digest(strip_paths(offsets)) in text and '"items": 22' in text  # the digest of the full list
    assert str(converted) not in text                                               # no absolute path kept
    assert loader_identity(config) == base["loader"]
    assert ident(max_samples_per_sequence=1)[0] == base                              # deterministic
    for change in ({"max_samples_per_sequence": 2}, {"dp_size": 2}, {"num_workers": 2}, {"num_used_data": [2]}):
        diff = fingerprint_diff(base, ident(**{"max_samples_per_sequence": 1, **change})[0])
        assert any(d.startswith("loader.") for d in diff), (change, diff)
    diff = fingerprint_diff(base, ident(max_samples_per_sequence=2)[0])
    assert any(".sha256: saved=" in d for d in diff), diff  # the slice offsets' digest is what names the change


def test_loader_identity_digest_of_energon_shard_lists():
    """A long list of Energon's per-shard dicts is hashed column-wise without its ``_path`` values: the same on
    another mount point, different when a shard's name or count differs; short lists stay inline."""
    from bridge.models.bagel.data.energon.identity import loader_identity

    def config(root, counts):
        return {"shards": [{"name": f"shards/shard-{i:06d}.tar", "count": c, "_path": f"{root}/shards/shard-{i:06d}.tar"}
                           for i, c in enumerate(counts)], "path": root, "slice_offsets": [[0, 5, 9]]}

    counts = [100] * 40
    a = loader_identity(config("/mnt/a/t2i", counts))
    assert a == loader_identity(config("/lustre/b/t2i", counts))            # mount point: not part of it
    assert set(a) == {"shards", "slice_offsets"} and a["shards"]["items"] == 40 and a["slice_offsets"] == [[0, 5, 9]]
    assert a != loader_identity(config("/mnt/a/t2i", counts[:-1] + [99]))     # one count changed
    renamed = config("/mnt/a/t2i", counts)
    renamed["shards"][3]["name"] = "shards/other.tar"
    assert a != loader_identity(renamed)
