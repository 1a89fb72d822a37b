"""Every benchmark still runs: each ``scripts/bench_*.py --quick`` and ``scripts/gpu_check.py --dry-run``.

Benches are discovered by globbing ``scripts/bench_*.py``, so a new bench is covered the day it lands. Each runs
as a subprocess through the project's ``.venv`` python (what a user runs), from the repository root, and must
exit 0 with a machine-readable last line on stdout: ``<name>: key=value key=value ...`` (at least one numeric
value, every number finite). The numbers of a quick run are not checked: speed targets live in the benches'
full runs, never in timed tests. Benches that read the demo dataset get this session's generated copy (the
option that names it is listed in ``DATA_OPTION``); a bench not listed there runs with ``--quick`` alone.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
BENCHES = sorted(p.name for p in SCRIPTS.glob("bench_*.py"))
#: the option through which a bench takes an existing demo dataset directory (instead of generating its own)
DATA_OPTION = {"bench_balance.py": "--data", "bench_pipeline.py": "--data", "bench_train.py": "--data",
               "bench_watchdog.py": "--data", "bench_elastic.py": "--data", "bench_startup.py": "--demo-dir",
               "bench_state.py": "--demo-dir", "bench_remote.py": "--data",
               "gpu_check.py": "--data"}
#: bench_packer's default comparison: our packer at this git revision (``git archive``)
PACKER_BASELINE = re.search(r'^BASELINE_REV = "([^"]+)"', (SCRIPTS / "bench_packer.py").read_text(), re.M)
LAST_LINE = re.compile(r"^(?P<name>[A-Za-z_][\w.-]*): (?P<pairs>[\w.-]+=\S+(?: [\w.-]+=\S+)*)$")
TIMEOUT_S = 240


def python() -> str:
    """The project's ``.venv`` interpreter (``scripts/run.sh`` builds it); this one if there is no ``.venv``."""
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def has_git_revision(rev: str) -> bool:
    """Whether this checkout's history holds ``rev`` (a shallow CI clone may not)."""
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                              capture_output=True).returncode == 0
    except OSError:
        return False


def parse_last_line(stdout: str) -> tuple[str, dict[str, str]]:
    """``(name, {key: value})`` of the last non-empty stdout line; AssertionError if it is not ``name: k=v ...``."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert lines, "the bench printed nothing on stdout"
    m = LAST_LINE.match(lines[-1].strip())
    assert m, f"last stdout line is not machine-readable (`<name>: key=value ...`): {lines[-1]!r}"
    return m["name"], dict(pair.split("=", 1) for pair in m["pairs"].split())


def run_script(name: str, args: list[str], tmpdir: Path | None = None) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **({"TMPDIR": str(tmpdir)} if tmpdir is not None else {}))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([python(), str(SCRIPTS / name), *args], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")[-3000:]
        pytest.fail(f"{name} {' '.join(args)} ran over {TIMEOUT_S} s (a quick run must take well under a minute); "
                    f"stdout tail:\n{tail.decode(errors='replace') if isinstance(tail, bytes) else tail}")
    return proc, time.perf_counter() - t0


def check(name: str, args: list[str], tmpdir: Path | None = None) -> dict[str, str]:
    """Run the bench; its last line parsed. With ``tmpdir`` (its TMPDIR), it must leave that directory empty."""
    proc, secs = run_script(name, args, tmpdir)
    assert proc.returncode == 0, (f"{name} {' '.join(args)} exited {proc.returncode} after {secs:.0f} s\n"
                                  f"--- stdout (tail)\n{proc.stdout[-3000:]}\n--- stderr (tail)\n{proc.stderr[-3000:]}")
    if tmpdir is not None:
        left = sorted(p.name for p in tmpdir.iterdir() if not p.name.startswith("torchinductor_"))  # its cache
        assert not left, f"{name} {' '.join(args)} left in its temp dir: {left}"
    bench, pairs = parse_last_line(proc.stdout)
    numbers = {}
    for key, value in pairs.items():
        try:
            numbers[key] = float(value)
        except ValueError:
            continue
    assert numbers, f"{name}: last line {bench}: {pairs} has no numeric value"
    bad = {k: v for k, v in numbers.items() if not math.isfinite(v)}
    assert not bad, f"{name}: non-finite values in its last line: {bad}"
    print(f"{name} {' '.join(args)}: {secs:.1f} s; {proc.stdout.strip().splitlines()[-1]}")
    return pairs


def test_benches_are_discovered():
    """The glob finds the benches this file was written against (new ones join automatically)."""
    assert {"bench_attention.py", "bench_packer.py", "bench_pipeline.py", "bench_startup.py",
            "bench_state.py"} <= set(BENCHES)
    for name in BENCHES:
        assert "--quick" in (SCRIPTS / name).read_text(), f"{name} has no --quick mode (CI runs every bench with it)"


@pytest.mark.parametrize("name", BENCHES)
def test_bench_quick(name, demo_setup, short_tmp_path):
    args = ["--quick"]
    if name in DATA_OPTION:
        args += [DATA_OPTION[name], str(demo_setup[0])]
    if name == "bench_packer.py" and not has_git_revision(PACKER_BASELINE[1]):
        # shallow clone: the baseline revision is not in the history, so compare against our own packer through
        # the --reference path (equality check and timing still run; the ratio is ~1)
        args += ["--reference", "bench_packer:ours"]
    # and nothing left behind in its temp dir (a leak per run); a short path: torch's shared-memory manager
    # binds a unix socket there (at most 107 bytes)
    pairs = check(name, args, short_tmp_path)
    if name == "bench_packer.py":
        assert set(pairs) >= {"speedup_flex", "speedup_dense", "vs"}


def test_gpu_check_dry_run(demo_setup):
    """The GPU check's CPU smoke path end to end (its one dry run in the suite): demo loader, to_device, mask
    build, eager FlexAttention, flex-vs-SDPA, exact masks, and the training step (the recipe for Bridge's pretrain(), trained on CPU with the same forward step)."""
    pairs = check("gpu_check.py", ["--dry-run", DATA_OPTION["gpu_check.py"], str(demo_setup[0])])
    assert list(pairs)[0] == "copy_ms" and list(pairs)[-1] == "ok" and pairs["ok"] == "true", pairs
    # the training step: the reference model's recipe, dataset provider and forward step, optimizer steps on CPU;
    # loss_first / loss_last: step 1's batch before training and again at the last step (every step reads a new pack)
    assert int(pairs["train_steps"]) >= 2 and float(pairs["loss_last"]) < float(pairs["loss_first"]), pairs


def test_last_line_rule():
    """The rule above accepts the benches' line format and refuses prose or a bare number."""
    assert parse_last_line("x\nattention: dense_ms=219.0 flex_ms=15.8 ratio=13.9\n") == (
        "attention", {"dense_ms": "219.0", "flex_ms": "15.8", "ratio": "13.9"})
    for bad in ("speedup vs baseline 660104d: flex=1.95 dense=1.87", "done", "42", "attention: fast"):
        with pytest.raises(AssertionError):
            parse_last_line(bad)
