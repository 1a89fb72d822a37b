"""docs/batch.md lists every key of a packed batch: the key set of a real flex and a real dense batch (demo data,
real Energon readers and packer) equals the page's, and each key's dtype / number of dimensions / Python type is
the page's. A key the batch gains or loses, or a changed type, fails here until the page says so."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from _train_common import small_image_groups

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "batch.md"
ROW = re.compile(r"^\|\s*`(?P<key>[a-z_]+)`\s*\|\s*(?P<mode>both|flex|dense)\s*\|\s*(?P<type>[^|]+?)\s*\|")


def documented() -> dict[str, tuple[str, str]]:
    """key -> (mode, type) from the marked table of docs/batch.md."""
    text = PAGE.read_text(encoding="utf-8")
    block = re.search(r"<!-- batch-keys -->(.*?)<!-- /batch-keys -->", text, re.S)
    assert block, "docs/batch.md has no <!-- batch-keys --> ... <!-- /batch-keys --> table"
    rows = {m["key"]: (m["mode"], m["type"]) for line in block[1].splitlines() if (m := ROW.match(line))}
    assert len(rows) > 15
    return rows


def type_problem(value, spec: str) -> str | None:
    """None when ``value`` matches the page's type column ``spec`` (e.g. ``int64 [T_vit]``, ``list[str]``)."""
    tensor = re.fullmatch(r"(int64|float32) \[([^\]]*)\]", spec)
    if tensor:
        dims = len(tensor[2].split(","))
        if not isinstance(value, torch.Tensor):
            return f"expected a tensor, got {type(value).__name__}"
        if str(value.dtype) != f"torch.{tensor[1]}" or value.dim() != dims:
            return f"expected {tensor[1]} with {dims} dims, got {value.dtype} {list(value.shape)}"
        return None
    if spec == "int":
        return None if isinstance(value, int) else f"expected int, got {type(value).__name__}"
    inner = re.fullmatch(r"list\[(.*)\]", spec)
    assert inner, f"docs/batch.md: type {spec!r} is not understood by this test"
    if not isinstance(value, list) or not value:
        return f"expected a non-empty list, got {type(value).__name__}"
    item = inner[1]
    simple = {"int": int, "str": str, "dict": dict}
    for element in value:
        if item in simple:
            ok = isinstance(element, simple[item])
        elif item == "tuple[int, int]":
            ok = isinstance(element, tuple) and len(element) == 2 and all(isinstance(x, int) for x in element)
        else:
            ok = type_problem(element, item) is None
        if not ok:
            return f"expected list[{item}], got an element {type(element).__name__}"
    return None


@pytest.fixture(scope="module")
def batches(demo_setup, tmp_path_factory):
    from bridge.models.bagel.data.build import build_bagel_train_loader
    from bridge.models.bagel.data.config import BagelDataConfig, PackerConfig

    out, tok = demo_setup
    groups = small_image_groups(out, tmp_path_factory.mktemp("batch_doc") / "groups.yaml")
    found = {}
    for mode, flex in (("flex", True), ("dense", False)):
        cfg = BagelDataConfig(groups=str(groups), dataset_info=str(out / "dataset_info.yaml"), num_workers=0, seed=3,
                              packer=PackerConfig(expected_num_tokens=1536, max_num_tokens=2048,
                                                  max_num_tokens_per_sample=1024, prefer_buffer_before=512,
                                                  use_flex=flex, max_latent_size=64))
        with build_bagel_train_loader(cfg, tok, (0, 1), length=1) as loader:
            found[mode] = next(loader)
    return found


@pytest.mark.parametrize("mode", ["flex", "dense"])
def test_the_page_lists_exactly_the_batch_keys(batches, mode):
    rows = documented()
    expected = {k for k, (m, _) in rows.items() if m in ("both", mode)}
    batch = batches[mode]
    assert set(batch) - expected == set(), f"keys in a {mode} batch that docs/batch.md does not list"
    assert expected - set(batch) == set(), f"keys docs/batch.md lists for {mode} batches that the batch lacks"


@pytest.mark.parametrize("mode", ["flex", "dense"])
def test_the_page_gives_each_key_its_type(batches, mode):
    rows = documented()
    problems = {k: p for k, v in batches[mode].items() if (p := type_problem(v, rows[k][1]))}
    assert not problems, problems


def test_the_type_rule_is_not_vacuous():
    assert type_problem(torch.zeros(3, dtype=torch.int64), "int64 [T]") is None
    assert type_problem(torch.zeros(3, dtype=torch.int32), "int64 [T]")
    assert type_problem(torch.zeros(3, 4), "float32 [T, 4]") is None and type_problem(torch.zeros(3), "float32 [T, 4]")
    assert type_problem([(1, 2)], "list[tuple[int, int]]") is None and type_problem([[1, 2]], "list[tuple[int, int]]")
    assert type_problem([torch.zeros(2, 2)], "list[float32 [n, n]]") is None
