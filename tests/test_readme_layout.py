"""The contributor page's layout table matches the tree: every module has its row, every row names a real path.

``docs/contributing.md`` holds the only copy of each package's table, between ``<!-- layout:package ROOT -->``
and ``<!-- /layout:package -->`` (paths relative to ROOT; one block per package: the data package, the reference
model package), and the repository-level one between
``<!-- layout:repo -->`` and ``<!-- /layout:repo -->`` (paths from the repository root). The table's format is
free: a row's path is the first back-quoted word of a table line (``| `path` | ... |``). The set of paths is
strict: for the package, exactly the ``.py`` files under ROOT, where a sub-package's ``__init__.py`` is written
as its folder (``energon/``); for the repository table, every path must exist.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "contributing.md"
ROW_PATH = re.compile(r"^\s*\|\s*`([^`]+)`")


def _block_re(tag: str) -> re.Pattern:
    return re.compile(rf"<!--\s*layout:{tag}\b\s*([^>]*?)\s*-->(.*?)<!--\s*/layout:{tag}\s*-->", re.S)


def _rows(body: str, tag: str) -> list[str]:
    paths = [r[1] for line in body.splitlines() if (r := ROW_PATH.match(line))]
    assert paths, f"a layout:{tag} block of docs/contributing.md has no table rows"
    return paths


def block(text: str, tag: str) -> tuple[str, list[str]]:
    """``(argument of the opening marker, first back-quoted path of each table row)`` of the first marked block."""
    m = _block_re(tag).search(text)
    assert m, f"docs/contributing.md has no <!-- layout:{tag} ... --> ... <!-- /layout:{tag} --> block"
    return m[1], _rows(m[2], tag)


def blocks(text: str, tag: str) -> list[tuple[str, list[str]]]:
    """Every marked block of ``tag``, in page order (one package table per package: data, model)."""
    found = [(m[1], _rows(m[2], tag)) for m in _block_re(tag).finditer(text)]
    assert found, f"docs/contributing.md has no <!-- layout:{tag} ... --> ... <!-- /layout:{tag} --> block"
    return found


def tree_modules(root: Path) -> set[str]:
    """Every module under ``root`` as the table writes it: ``a/b.py``, a sub-package as ``a/``."""
    out = set()
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if "__pycache__" in rel:
            continue
        if rel.endswith("/__init__.py"):
            rel = rel[: -len("__init__.py")]
        out.add(rel)
    return out


@pytest.mark.parametrize("index", range(len(blocks(PAGE.read_text(encoding="utf-8"), "package"))))
def test_package_table_matches_tree(index):
    root_arg, paths = blocks(PAGE.read_text(encoding="utf-8"), "package")[index]
    root = REPO / root_arg
    assert root_arg and root.is_dir(), f"layout:package names {root_arg!r}, not a folder of the repository"
    dupes = sorted({p for p in paths if paths.count(p) > 1})
    assert not dupes, f"docs/contributing.md layout table lists these more than once: {dupes}"
    listed, tree = set(paths), tree_modules(root)
    missing, stale = sorted(tree - listed), sorted(listed - tree)
    assert not missing and not stale, (
        f"docs/contributing.md layout table (under {root_arg}) is out of date.\n"
        f"  modules without a row (add them): {missing}\n"
        f"  rows naming no module (remove or rename them): {stale}")


def test_every_bagel_package_has_a_table():
    """Each sub-package of ``bridge/models/bagel`` (data, model) has its own block: none is left unchecked."""
    roots = {arg for arg, _ in blocks(PAGE.read_text(encoding="utf-8"), "package")}
    packages = {p.parent.relative_to(REPO).as_posix() for p in (REPO / "bridge/models/bagel").glob("*/__init__.py")}
    assert packages <= roots, f"docs/contributing.md has no layout:package block for {sorted(packages - roots)}"


def test_repo_table_paths_exist():
    _, paths = block(PAGE.read_text(encoding="utf-8"), "repo")
    absent = [p for p in paths if not (REPO / p).exists()]
    assert not absent, f"docs/contributing.md repository layout table names paths that do not exist: {absent}"


@pytest.mark.parametrize("text, expect", [
    ("<!-- layout:package a/b -->\n| m | w |\n|---|---|\n| `x.py` | X |\n| `p/` | P |\n<!-- /layout:package -->",
     ("a/b", ["x.py", "p/"])),
    ("<!-- layout:package r -->\n|`y.py`|Y, see `z.py`|\ntext `not_a_row.py`\n<!-- /layout:package -->",
     ("r", ["y.py"])),
])
def test_block_parsing(text, expect):
    """Only the first back-quoted word of a table line is a path; prose in the block is ignored."""
    assert block(text, "package") == expect


def test_blocks_reads_every_block():
    text = ("<!-- layout:package a -->\n| `x.py` | X |\n<!-- /layout:package -->\nprose\n"
            "<!-- layout:package b -->\n| `y/` | Y |\n| `y/z.py` | Z |\n<!-- /layout:package -->")
    assert blocks(text, "package") == [("a", ["x.py"]), ("b", ["y/", "y/z.py"])]
