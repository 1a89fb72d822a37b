"""Every module, file and symbol path the README and the docs/ pages name exists (issue 29: docs a newcomer
trusts).

What counts as a name: a back-quoted token that is a path ending in ``.py`` / ``.md`` / ``.yaml`` / ``.sh``
(looked up from the repository root, under the package ``bridge/models/bagel/data/``, ``bridge/models/bagel/`` and
``docs/``), and a back-quoted dotted name that starts with a package's module (``config.schema.ORDERS``,
``energon.readers.open_group_reader``, ``bridge.models.bagel.data.state``): it must import, attribute by attribute.
Words in back quotes that are neither (config keys, shell commands, values) are not checked here.
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PKG = "bridge.models.bagel.data"
ROOTS = [REPO, REPO / "bridge" / "models" / "bagel" / "data", REPO / "bridge" / "models" / "bagel", REPO / "docs",
         REPO / ".venv" / "lib" / "python3.12" / "site-packages"]  # upstream files a page points into
TICKS = re.compile(r"`([^`\n]+)`")
FILE = re.compile(r"^[\w./-]+\.(py|md|yaml|sh)$")
DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
#: a data file's name (``tokenizer.pkl``, ``manifest.json``) looks dotted but is no module path: not checked here
DATA_FILE = re.compile(r"\.(pkl|json|jsonl|npy|npz|pt|png|txt|tar|idx|parquet)$")
#: the package's top-level modules and sub-packages: a dotted name starting with one of them is a package path
TOP = {p.stem for p in (REPO / "bridge" / "models" / "bagel" / "data").iterdir()
       if (p.suffix == ".py" or (p / "__init__.py").exists()) and not p.name.startswith("__")}


def _repo_files() -> set[str]:
    """Every file of the repository (paths from the root), build outputs and environments left out."""
    skip = {".git", ".venv", ".tools", "runs", "__pycache__", "node_modules", "demo_data"}
    out = set()
    for top, dirs, names in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in skip]
        rel = Path(top).relative_to(REPO)
        out.update((rel / n).as_posix() for n in names)
    return out


FILES = _repo_files()


#: Paths of the official BAGEL repository that pages cite as the source a piece mirrors (not files of ours).
OFFICIAL = ("data/", "modeling/", "train/", "eval/")


def _exists(name: str) -> bool:
    """A path from one of ``ROOTS``, the tail of a repository path (``readers/core.py``, ``bench_scale.py``), or a
    path of the official BAGEL repository (``OFFICIAL``)."""
    if name.startswith(OFFICIAL):
        return True
    if any((root / name).exists() for root in ROOTS):
        return True
    return any(f == name or f.endswith("/" + name) for f in FILES)


def _resolve(dotted: str) -> str | None:
    """None if ``dotted`` (package-relative or absolute) names a module or an attribute chain that exists, else why."""
    name = dotted if dotted.startswith("bridge.") else f"{PKG}.{dotted}"
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return f"{'.'.join(parts[:i])} has no {attr!r} (in {dotted})"
            obj = getattr(obj, attr)
        return None
    return f"no module of {dotted}"


def _names(page: Path) -> tuple[list[str], list[str]]:
    files, dotted = [], []
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # code blocks: run elsewhere
    for tok in TICKS.findall(text):
        tok = tok.strip().rstrip(",;:")
        tok = re.sub(r"\(\)$", "", tok)
        if FILE.match(tok) and "/" in tok or FILE.match(tok) and tok.endswith(".py"):
            files.append(tok)
        elif DOTTED.match(tok) and not DATA_FILE.search(tok) and (tok.split(".")[0] in TOP or tok.startswith(PKG)):
            dotted.append(tok)
    return files, dotted


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_named_path_and_symbol_exists(page):
    files, dotted = _names(page)
    missing = [f for f in files if not _exists(f)]
    broken = [why for d in dotted if (why := _resolve(d))]
    assert not missing and not broken, (f"{page.relative_to(REPO)} names what does not exist:\n  files: {missing}\n"
                                        f"  symbols: {broken}")


def test_the_check_sees_names():
    """Not vacuous: the contributor page names files and symbols, and a wrong one is caught."""
    files, dotted = _names(REPO / "docs" / "contributing.md")
    assert "energon/readers/core.py" in files and "config.schema.ORDERS" in dotted
    assert _resolve("config.schema.ORDERS") is None and _resolve("config.schema.NO_SUCH") is not None
    assert _resolve("energon.reader") is not None
    assert DATA_FILE.search("tokenizer.pkl") and not DATA_FILE.search("config.schema.ORDERS")
    assert _exists("readers/core.py") and not _exists("energon/reader.py") and not _exists("elastic_reader.py")
