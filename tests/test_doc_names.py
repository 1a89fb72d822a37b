"""Every module, file and symbol path the README and the docs/ pages name exists (issue 29: docs a newcomer
trusts).

What counts as a name: a back-quoted token that is a path ending in ``.py`` / ``.md`` / ``.yaml`` / ``.sh``
(looked up from the repository root, under the package ``bridge/models/bagel/data/``, ``bridge/models/bagel/`` and
``docs/``), and a back-quoted dotted name that starts with a package's module (``config.schema.ORDERS``,
``energon.readers.open_group_reader``, ``bridge.models.bagel.data.state``): it must import, attribute by attribute.

A back-quoted identifier that reads as code (``snake_case`` with an inner underscore, ``CamelCase``, or a dotted
chain of such: ``ElasticPlan.resize_state``, ``data.packer.max_num_tokens``) must be a name of the code: defined or
used in the package or the scripts (names, and strings without spaces: state fields, stats and config keys), a
config key of a YAML file here, a module's file name, or a name of the upstream code the pages explain
(``UPSTREAM``, Python's builtins, ``torch``). A renamed class, field or exception left in a page fails here. Plain
words in back quotes (values, shell commands) are not checked.
"""

from __future__ import annotations

import builtins
import functools
import importlib
import inspect
import io
import os
import re
import sys
import tokenize
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


def _lookup(dotted: str) -> tuple[object, str | None]:
    """``(the object, None)`` for a dotted name (package-relative or absolute) that exists, else ``(None, why)``."""
    name = dotted if dotted.startswith("bridge.") else f"{PKG}.{dotted}"
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return None, f"{'.'.join(parts[:i])} has no {attr!r} (in {dotted})"
            obj = getattr(obj, attr)
        return obj, None
    return None, f"no module of {dotted}"


def _resolve(dotted: str) -> str | None:
    """None if ``dotted`` (package-relative or absolute) names a module or an attribute chain that exists, else why."""
    return _lookup(dotted)[1]


#: A quoted call of a package function: ``build.build_bagel_train_loader(config, tokenizer)``.
CALL = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)\(([^()]*)\)$")


def _signature_problem(tok: str) -> str | None:
    """Why a quoted call of a package function names arguments its signature has not (None: it fits, or it is no
    such call). Positional names and ``name=`` must be parameters; ``...`` / ``…`` stand for the rest."""
    m = CALL.match(tok)
    if not m or m.group(1).split(".")[0] not in TOP:
        return None
    obj, why = _lookup(m.group(1))
    if why is not None or not callable(obj):
        return why
    params = inspect.signature(obj).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    names = [a.strip().split("=")[0].strip() for a in m.group(2).split(",") if a.strip() not in ("", "...", "…")]
    wrong = [n for n in names if WORD.fullmatch(n) and n not in params]
    return f"{tok}: {wrong} not parameters of {m.group(1)}{inspect.signature(obj)}" if wrong else None


#: Upstream code whose names the pages explain (paths under site-packages): Energon, Megatron-Bridge's training and
#: data entry points and model conversion, torch's data loading and multiprocessing.
UPSTREAM = ("megatron/energon", "megatron/bridge/training", "megatron/bridge/data", "megatron/bridge/models/conversion",
            "torch/multiprocessing", "torch/utils/data")
#: Names of the official BAGEL repository that pieces here mirror (its classes, functions and flags).
OFFICIAL_NAMES = {"T2IIterableDataset", "UnifiedEditIterableDataset", "SftJSONLIterableDataset", "parse_row",
                  "pack_sequence", "to_tensor", "ce_loss_reweighting", "json_dir_list", "create_sparse_mask"}
#: Names no code here or upstream defines, by page, and why they stay.
OUTSIDE = {
    "slurm.md": {"SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"},  # Slurm's environment
    # the bench_scale columns and reader timers of earlier versions, quoted with the measurements they produced
    "scale.md": {"ours_s", "energon_s", "ident_s", "ok_total", "open_seconds", "identity_seconds",
                 "official_order", "open_train_dataset"},
    "raw-formats.md": {"frame_9", "frame_10"},  # example file names of a frame folder
}
WORD = re.compile(r"[A-Za-z_]\w*")
#: ``key=`` in a string: the keys of the ``key=value`` lines the scripts print (documented in their docstrings).
PRINTED_KEY = re.compile(r"([A-Za-z_]\w*)=")
CODEY = re.compile(r"^_*[A-Za-z0-9]+_\w*[A-Za-z0-9]$|[a-z0-9][A-Z]")


def _code_names(text: str) -> set[str]:
    """Every name of a Python source (comments and prose strings left out), the words of its strings without
    spaces (state fields, stats and config keys, environment variables) and the ``key=`` of its other strings."""
    out: set[str] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.NAME:
            out.add(tok.string)
        elif tok.type in (tokenize.STRING, tokenize.FSTRING_MIDDLE):
            out.update(WORD.findall(tok.string) if not any(c.isspace() for c in tok.string)
                       else PRINTED_KEY.findall(tok.string))
    return out


@functools.cache
def known_names() -> frozenset[str]:
    """The names a page may quote (module docstring): ours (package, scripts, tests), the YAML keys here, module
    file names, upstream's, official BAGEL's."""
    out = set(dir(builtins)) | set(dir(importlib.import_module("torch"))) | OFFICIAL_NAMES
    for top in ("bridge", "scripts", "tests"):
        for path in (REPO / top).rglob("*.py"):
            if path.resolve() != Path(__file__).resolve():  # this file quotes stale names on purpose
                out |= _code_names(path.read_text(encoding="utf-8"))
    out |= {Path(f).stem for f in FILES if f.endswith(".py")}
    for f in FILES:
        if f.endswith((".yaml", ".yml", ".toml")):
            out.update(WORD.findall((REPO / f).read_text(encoding="utf-8", errors="replace")))
    site = ROOTS[-1]
    for part in UPSTREAM:
        for path in (site / part).rglob("*.py"):
            out.update(WORD.findall(path.read_text(encoding="utf-8", errors="replace")))
    return frozenset(out)


def _stdlib_has(parts: list[str]) -> bool:
    """Whether a dotted name of the standard library (``io.BufferedWriter.write``) exists."""
    obj: object = importlib.import_module(parts[0])
    for attr in parts[1:]:
        if not hasattr(obj, attr):
            return False
        obj = getattr(obj, attr)
    return True


def unknown_identifiers(page: Path) -> list[str]:
    """The code-like identifiers a page quotes that no code here or upstream has (module docstring)."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    allowed = known_names() | OUTSIDE.get(page.name, set())
    out = []
    for tok in TICKS.findall(text):
        tok = re.sub(r"\(.*\)$", "", tok.strip().rstrip(",;:"))
        parts = tok.split(".")
        if DATA_FILE.search(tok) or FILE.match(tok) or not all(WORD.fullmatch(x) for x in parts):
            continue
        if len(parts) > 1 and parts[0] in sys.stdlib_module_names and _stdlib_has(parts):
            continue
        out += [x for x in parts if CODEY.search(x) and x not in allowed and x not in out]
    return out


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


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_quoted_identifier_is_a_name_of_the_code(page):
    unknown = unknown_identifiers(page)
    assert not unknown, (f"{page.relative_to(REPO)} quotes identifiers no code has (renamed or removed? fix the page): "
                         f"{unknown}")


def test_the_identifier_check_catches_stale_names(tmp_path):
    """Not vacuous: names the docs once carried after a rename are caught, current ones pass."""
    page = tmp_path / "stale.md"
    page.write_text("The packer saves `carry_keys` and `buffer_keys`; the others raise `OtherRankFailed`; "
                    "`BagelGroupReader.open_seconds`; `io.BufferedWriter.write`, `GroupReader`, "
                    "`ElasticPlan.resize_state`, "
                    "`data.packer.max_num_tokens`, `restore_sample()`, `get_savable_loader` and `TimeoutError` exist;"
                    " plain words like `elastic` or `true` are not checked.", encoding="utf-8")
    assert unknown_identifiers(page) == ["carry_keys", "buffer_keys", "OtherRankFailed", "BagelGroupReader",
                                         "open_seconds"]


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_quoted_call_fits_its_signature(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    wrong = [why for tok in TICKS.findall(text) if (why := _signature_problem(tok.strip()))]
    assert not wrong, f"{page.relative_to(REPO)} quotes calls that do not fit the code: {wrong}"


def test_the_check_sees_names():
    """Not vacuous: the contributor page names files and symbols, and a wrong one is caught."""
    files, dotted = _names(REPO / "docs" / "contributing.md")
    assert "energon/readers/core.py" in files and "config.schema.ORDERS" in dotted
    assert _resolve("config.schema.ORDERS") is None and _resolve("config.schema.NO_SUCH") is not None
    assert _resolve("energon.reader") is not None
    assert DATA_FILE.search("tokenizer.pkl") and not DATA_FILE.search("config.schema.ORDERS")
    assert _exists("readers/core.py") and not _exists("energon/reader.py") and not _exists("elastic_reader.py")
    assert _signature_problem("build.build_bagel_train_loader(config, dp_rank, dp_size)") is not None
    assert _signature_problem("build.build_bagel_train_loader(config, tokenizer, context_or_dp)") is None
