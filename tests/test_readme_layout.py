"""The contributor page's layout table matches the tree: every module has its row, every row names a real path.

``docs/contributing.md`` holds the only copy of the table, between ``<!-- layout:package ROOT -->`` and
``<!-- /layout:package -->`` (paths relative to ROOT), and the repository-level one between
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


def block(text: str, tag: str) -> tuple[str, list[str]]:
    """``(argument of the opening marker, first back-quoted path of each table row)`` of one marked block."""
    m = re.search(rf"<!--\s*layout:{tag}\b\s*([^>]*?)\s*-->(.*?)<!--\s*/layout:{tag}\s*-->", text, re.S)
    assert m, f"docs/contributing.md has no <!-- layout:{tag} ... --> ... <!-- /layout:{tag} --> block"
    paths = [r[1] for line in m[2].splitlines() if (r := ROW_PATH.match(line))]
    assert paths, f"the layout:{tag} block of docs/contributing.md has no table rows"
    return m[1], paths


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


def test_package_table_matches_tree():
    root_arg, paths = block(PAGE.read_text(encoding="utf-8"), "package")
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
