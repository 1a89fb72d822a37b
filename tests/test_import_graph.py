"""The package's import graph, built from the source with ``ast`` (every import, module-level or inside a
function): no cycle, and no stage imports a later stage (issue 18).

Layers, in the chain's order (a module may import its own layer or an earlier one, never a later one):
infrastructure leaves → configuration → Energon readers → packing → pipeline stages → assembly (builder,
providers, the seed facade) → the job. The converter wing (raw formats → Energon) and the CLI tools sit to the
side: the runtime never imports them, and the converter needs nothing of the runtime beyond the on-disk layout.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = "bridge.models.bagel.data"
PKG_DIR = ROOT.joinpath(*PKG.split("."))
#: ``bridge/models/bagel``: the data package, the reference model package beside it and the launcher
BAGEL = "bridge.models.bagel"
BAGEL_DIR = ROOT.joinpath(*BAGEL.split("."))
#: what the data package never imports (issue 32): the model is the data's consumer, composed by the launcher
CONSUMERS = ("bridge.models.bagel.model", "bridge.models.bagel.launch")

#: Module-name prefixes (relative to the package) → layer. The longest matching prefix wins.
LAYERS: dict[str, int] = {
    # 0: infrastructure leaves (no pipeline knowledge)
    "errors": 0, "state": 0, "stats": 0, "watchdog": 0, "_bridge": 0, "tokenizer": 0, "transforms": 0,
    "attention": 0, "yaml_errors": 0, "parity": 0,
    # 1: configuration (grouped YAML, registry, packer knobs, budget rules, the one validation pass); its length
    # rules are a leaf the packer shares
    "config": 1, "config.lengths": 0,
    # 2: Energon readers and cookers. ``energon.patches`` (Energon internals, version-guarded) is a leaf the state
    # protocol, the watchdog and the converter share, under a package ``__init__`` that imports nothing.
    "energon": 0, "energon.layout": 2, "energon.cooking": 2, "energon.readers": 2, "energon.patches": 0,
    # 3: the pack loop
    "packing": 3,
    # 4: pipeline stages after the packer (RNG, official workers, prefetch, the loader)
    "pipeline": 4,
    # 5: assembly: the builder, the Bridge providers, the seed facade
    "build": 5, "providers": 5, "external": 5,
    # 6: the torchrun job
    "job": 6,
}
#: Side wings: never imported by the runtime (layers 0-6).
CONVERTER = ("converter",)
TOOLS = ("tools",)
#: What the converter may import of the runtime: the on-disk layout contract, Energon's index as the patches write it,
#: and the one-line YAML error leaf.
CONVERTER_MAY_IMPORT = ("energon.layout", "energon.patches.index", "yaml_errors")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG_DIR.rglob("*.py"):
        rel = path.relative_to(PKG_DIR).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path  # "" is the package itself
    return out


def _imports(name: str, path: Path, modules: set[str], with_inits: bool = True) -> set[str]:
    """Package-relative names of the package modules ``name`` imports (a ``from X import y`` of a submodule
    ``y`` counts as importing ``X.y``; of an attribute, as importing ``X``)."""
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if name else []
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PKG + "."):
                    found.add(alias.name[len(PKG) + 1:])
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = here if is_pkg else here[:-1]
            base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
            target = ".".join(base + ([node.module] if node.module else []))
        elif node.module and (node.module == PKG or node.module.startswith(PKG + ".")):
            target = node.module[len(PKG) + 1:] if node.module != PKG else ""
        else:
            continue
        for alias in node.names:
            sub = f"{target}.{alias.name}" if target else alias.name
            found.add(sub if sub in modules else target)
    # importing a.b.c runs the __init__ of a and a.b too: a package's own imports are part of every import of it
    for mod in list(found) if with_inits else ():
        parts = mod.split(".")
        found.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return {m for m in found if m in modules and m != name and not name.startswith(m + ".")}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


@pytest.fixture(scope="module")
def direct() -> dict[str, set[str]]:
    """What each module names in its own imports (the packages whose ``__init__`` runs on the way left out): for
    the rules about who uses what, where the layering and cycle rules above need ``graph``."""
    mods = _modules()
    return {name: _imports(name, path, set(mods), with_inits=False) for name, path in mods.items()}


def _wing(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _layer(name: str) -> int | None:
    best = None
    for prefix, layer in LAYERS.items():
        if name == prefix or name.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, layer)
    return None if best is None else best[1]


def test_graph_sees_the_package(graph):
    assert len(graph) > 30 and "external" in graph and "energon.readers.core" in graph
    assert "pipeline.loader" in graph["external"] and "state" in graph["pipeline.loader"]  # the parser finds real edges


def test_every_module_has_a_place(graph):
    homeless = [m for m in graph if m and _layer(m) is None and not _wing(m, CONVERTER + TOOLS)]
    assert not homeless, f"modules with no layer in LAYERS or wing: {homeless}"


def test_no_import_cycle(graph):
    """Tarjan's strongly connected components: every component is a single module without a self-loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_no_stage_imports_a_later_stage(graph):
    bad = []
    for mod, deps in graph.items():
        lm = _layer(mod)
        if lm is None:
            continue
        for dep in deps:
            ld = _layer(dep)
            if ld is not None and ld > lm:
                bad.append(f"{mod} (layer {lm}) imports {dep} (layer {ld})")
    assert not bad, "\n".join(sorted(bad))


#: Config-time checks: the runtime stages never run them (the builder does, once, through validate_data).
CONFIG_TIME = ("config.budgets", "config.validate")
RUNTIME_STAGES = ("energon", "packing", "pipeline")


def test_runtime_stages_never_import_config_time_checks(direct):
    bad = [f"{m} imports {d}" for m, deps in direct.items() if _wing(m, RUNTIME_STAGES)
           for d in deps if d in CONFIG_TIME or d == "config"]
    assert not bad, bad


def test_length_rules_are_a_leaf(graph):
    """The budget checks (config) and the pack loop (packing) share them; they import neither."""
    assert graph["config.lengths"] == set()


def test_runtime_never_imports_the_side_wings(graph):
    bad = [f"{m} imports {d}" for m, deps in graph.items() if _layer(m) is not None
           for d in deps if _wing(d, CONVERTER + TOOLS)]
    assert not bad, bad


def test_converter_needs_only_the_layout(direct):
    bad = [f"{m} imports {d}" for m, deps in direct.items() if _wing(m, CONVERTER)
           for d in deps if not _wing(d, CONVERTER) and d not in CONVERTER_MAY_IMPORT]
    assert not bad, bad


def _absolute_imports(path: Path) -> set[str]:
    """Every module ``path`` imports, as absolute dotted names (relative imports resolved; ``from X import y``
    counts as ``X.y`` and ``X``)."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    package = parts[:-1]  # the package a module (or an __init__) lives in
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - (node.level - 1)] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def test_data_never_imports_the_model_or_the_launcher():
    """model -> data, launch -> both; nothing under ``data`` imports the model package or the launcher."""
    bad = sorted(f"{path.relative_to(ROOT)} imports {name}" for path in PKG_DIR.rglob("*.py")
                 for name in _absolute_imports(path) if any(name == c or name.startswith(c + ".") for c in CONSUMERS))
    assert not bad, bad
    model_dir = BAGEL_DIR / "model"
    uses_data = {p.name for p in model_dir.rglob("*.py") if any(n.startswith(PKG) for n in _absolute_imports(p))}
    assert "model.py" in uses_data  # the parser sees the model's real (relative) imports of the data package
    never_launch = [p.name for p in model_dir.rglob("*.py")
                    if any(n.startswith(CONSUMERS[1]) for n in _absolute_imports(p))]
    assert not never_launch, f"the model package imports the launcher: {never_launch}"


def test_megatron_bridge_is_imported_in_one_module_only():
    """Transformer Engine comes with Bridge: only ``data/_bridge`` may import ``megatron.bridge``, in the data
    package, the model package and the launcher alike."""
    offenders = []
    for path in BAGEL_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [node.args[0].value] if (isinstance(node, ast.Call) and node.args
                                                   and isinstance(node.args[0], ast.Constant)
                                                   and isinstance(node.args[0].value, str)
                                                   and getattr(node.func, "attr", getattr(node.func, "id", ""))
                                                   == "import_module") else [])
            if any(n == "megatron.bridge" or n.startswith("megatron.bridge.") or n.startswith("transformer_engine")
                   for n in names):
                offenders.append(str(path.relative_to(BAGEL_DIR)))
    assert set(offenders) == {"data/_bridge.py"}, offenders
