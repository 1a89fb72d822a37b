"""Installing into the environment a user already has (issue 30): ranges, not pins; the oldest supported set
checked in CI; Megatron-Bridge as an extra that says so when it is missing; the console entry points; the one
build-time parity warning outside the versions bit parity was proven on.

The whole file is in the compatibility part (``compat``): ``scripts/run.sh compat`` runs it in a second
environment, at the oldest end of the ranges, where this package was installed with a plain
``uv pip install .`` beside a torch that was there before.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import pkgutil
import re
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from _external_common import demo_loader

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
OLDEST = REPO / ".ci" / "compat-oldest.txt"
OVERRIDES = REPO / "install" / "bridge-overrides.txt"
PKG = "bridge.models.bagel.data"


def _raw_requirements() -> list[str]:
    """``[project] dependencies`` and every extra, as written: what ``pip install .[…]`` asks for."""
    project = PYPROJECT["project"]
    reqs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    return reqs


def _runtime_requirements() -> list[Requirement]:
    return [Requirement(r) for r in _raw_requirements()]


def _floor(req: Requirement) -> str | None:
    """The version of the one ``>=`` bound, None without one."""
    lows = [s.version for s in req.specifier if s.operator == ">="]
    return lows[0] if len(lows) == 1 else None


def test_no_runtime_dependency_is_pinned_exactly() -> None:
    """Install requirements are ranges: an ``==`` / ``===`` pin makes the package unresolvable beside any
    other version a user's environment has (uv.lock pins the tested set instead)."""
    pinned = [str(r) for r in _runtime_requirements() if any(s.operator in ("==", "===") for s in r.specifier)]
    assert pinned == [], f"pyproject.toml pins runtime dependencies exactly: {pinned}"


def test_every_runtime_dependency_has_a_floor_and_upper_bounds_say_why() -> None:
    """Each requirement has one ``>=`` floor (the oldest version checked: the compat lock below); a ``<``,
    ``<=``, ``!=`` or ``~=`` bound only with a comment on its line naming the known break."""
    assert [str(r) for r in _runtime_requirements() if _floor(r) is None] == []
    lines = (REPO / "pyproject.toml").read_text(encoding="utf-8").splitlines()
    for raw in _raw_requirements():
        if any(s.operator in ("<", "<=", "!=", "~=") for s in Requirement(raw).specifier):
            line = next(line for line in lines if f'"{raw}"' in line)
            assert "#" in line.split(f'"{raw}"', 1)[1], f"pyproject.toml: an upper bound without a comment " \
                                                        f"naming the known break: {line.strip()}"


def _pins(path: Path) -> dict[str, str]:
    """``name -> version`` of a ``uv pip compile`` output (names normalised)."""
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        if m:
            out[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return out


def test_the_compat_lock_pins_every_floor() -> None:
    """The second environment (``.ci/compat-oldest.txt``) holds every runtime requirement at exactly its
    floor, so CI checks the floors pyproject.toml declares (``scripts/compat_lock.py`` regenerates it)."""
    pins = _pins(OLDEST)
    wrong = {}
    for req in _runtime_requirements():
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        floor = Version(Version(_floor(req)).base_version)  # torch>=2.8.0a0 is checked at 2.8.0 (pyproject.toml)
        if name not in pins or Version(pins[name]) != floor:
            wrong[name] = (str(floor), pins.get(name))
    assert wrong == {}, f"{OLDEST.name} does not pin these floors (floor, pinned): {wrong}"


def test_the_overrides_file_is_pyprojects_list() -> None:
    """``install/bridge-overrides.txt`` (for ``uv pip install --overrides``) keeps out exactly the packages
    that ``[tool.uv] override-dependencies`` keeps out of uv.lock (Megatron-Bridge's GPU-only requirements)."""
    ours = [line.split("#")[0].strip() for line in OVERRIDES.read_text(encoding="utf-8").splitlines()]
    assert sorted(x for x in ours if x) == sorted(PYPROJECT["tool"]["uv"]["override-dependencies"])


def _modules() -> list[str]:
    package = importlib.import_module(PKG)
    return [PKG] + sorted(m.name for m in pkgutil.walk_packages(package.__path__, PKG + "."))


def test_every_module_imports() -> None:
    """Every module of the package imports in this environment (Bridge-dependent parts import Bridge lazily)."""
    failed = {}
    for name in _modules():
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - collected and reported together
            failed[name] = f"{type(exc).__name__}: {exc}"
    assert failed == {}


@pytest.mark.skipif(os.environ.get("BAGEL_COMPAT_INSTALLED") != "1",
                    reason="set by scripts/run.sh compat, whose environment holds a plain (non-editable) install")
def test_the_package_under_test_is_the_installed_copy() -> None:
    """In the compat environment the tests import the wheel pip/uv installed, not this checkout."""
    module = importlib.import_module(PKG)
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    assert Path(module.__file__).resolve().is_relative_to(site), module.__file__
    # (sys.path itself may hold the checkout by now: tests that run the scripts/ put it there after the package
    # was imported; the module's file above is what was tested)


def _scripts_dir() -> Path:
    return Path(sysconfig.get_paths()["scripts"])


def test_console_scripts() -> None:
    """Every ``[project.scripts]`` entry point names an importable callable, and ``bagel-data`` runs."""
    scripts = PYPROJECT["project"]["scripts"]
    assert scripts["bagel-train"] == "bridge.models.bagel.launch:main"
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        if module == "bridge.models.bagel.launch" and importlib.util.find_spec(module) is None:
            continue  # the job's main() moves there in issue 32; until then only the name is declared
        assert callable(getattr(importlib.import_module(module), attr)), target
    exe = _scripts_dir() / "bagel-data"
    assert exe.is_file(), f"{exe} was not installed"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "convert" in out.stdout, out.stderr[-2000:]


_HIDE_BRIDGE = """
import sys
sys.modules["megatron.bridge"] = None   # as if megatron-bridge were not installed
from bridge.models.bagel.data import external
try:
    external.BagelMegatronMIMODatasetProvider
except ModuleNotFoundError as exc:
    print(type(exc).__name__ + ": " + str(exc))
else:
    print("no error")
"""


def test_without_megatron_bridge_the_error_is_one_line_naming_the_extra() -> None:
    """The seed-contract module imports without Bridge; the Bridge provider then fails in one line that
    names the ``bridge`` extra (it was a bare "No module named 'megatron.bridge'")."""
    out = subprocess.run([sys.executable, "-c", _HIDE_BRIDGE], capture_output=True, text=True, timeout=300,
                         cwd=REPO / "tests")
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0 and len(lines) == 1, (out.stdout, out.stderr[-3000:])
    assert lines[0].startswith("BridgeNotInstalledError: Megatron-Bridge is not installed"), lines[0]
    assert "'bridge' extra" in lines[0] and "pip install 'bagel-megatron-data[bridge]'" in lines[0], lines[0]


def test_the_loader_build_warns_once_outside_the_proven_versions(demo_setup, monkeypatch, caplog) -> None:
    """``build_bagel_train_loader`` logs one WARNING per process naming the versions bit parity was proven on
    when this environment has others (here: a proven Pillow that no environment has), none when it matches."""
    from bridge.models.bagel.data import parity

    out, tok = demo_setup
    monkeypatch.setattr(parity, "_warned", False)
    expect_note = parity.parity_note()
    with caplog.at_level(logging.WARNING, logger=parity.__name__):
        with demo_loader(out, tok, 0, True, length=2):
            pass
    mine = [r for r in caplog.records if r.name == parity.__name__]
    assert [r.getMessage() for r in mine] == ([expect_note] if expect_note else [])

    caplog.clear()
    monkeypatch.setattr(parity, "_warned", False)
    monkeypatch.setitem(parity.PROVEN_VERSIONS, "pillow", "0.0.1")
    with caplog.at_level(logging.WARNING, logger=parity.__name__):
        for _ in range(2):
            with demo_loader(out, tok, 0, True, length=2):
                pass
    mine = [r for r in caplog.records if r.name == parity.__name__]
    assert len(mine) == 1 and mine[0].levelno == logging.WARNING, [r.getMessage() for r in mine]
    assert "proven for Pillow 0.0.1 and torch 2.13.0 only" in mine[0].getMessage()
    assert "Pillow " in mine[0].getMessage().split("this environment has", 1)[1]
