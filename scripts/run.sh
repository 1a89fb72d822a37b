#!/usr/bin/env bash
# One entry point for the two commands that matter, on a fresh machine with only Python 3.12:
#   bash scripts/run.sh test   -> builds .venv from uv.lock (if needed) and runs the whole test suite
#   bash scripts/run.sh demo   -> builds .venv, generates the embedded demo data, runs the main job
#   bash scripts/run.sh compat -> the second environment of CI (oldest supported versions, a plain install
#                                 beside an existing torch) and the compatibility part of the suite
# Extra arguments are passed to pytest / the demo script.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  for c in "${PYTHON:-}" python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do
    [ -n "$c" ] || continue
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      "$c" -c 'import sys; print(sys.executable)'; return 0  # the real interpreter, not a shim: uv keeps .venv
    fi
  done
  echo "error: Python 3.12 not found (set PYTHON=/path/to/python3.12)" >&2; return 1
}

ensure_uv() {  # $1: python3.12
  if [ ! -x .tools/bin/uv ]; then
    "$1" -m venv .tools
    .tools/bin/pip install -q --disable-pip-version-check uv
  fi
}

setup_env() {
  local py; py=$(find_python)
  ensure_uv "$py"
  # Bytecode compiled once per lock: every process (ranks, workers, torchrun children) then imports from .pyc
  # instead of compiling torch/transformers/Megatron sources again (imports ~5.4 s -> ~3 s here, also under
  # PYTHONDONTWRITEBYTECODE). ~30 s on 2 cores, so only when the environment is new or uv.lock changed.
  local compile=()
  if [ ! -f .venv/.bytecode-compiled ] || [ uv.lock -nt .venv/.bytecode-compiled ]; then compile=(--compile-bytecode); fi
  UV_PYTHON_DOWNLOADS=never .tools/bin/uv sync --frozen --extra bridge "${compile[@]}" --python "$py" -q
  [ ${#compile[@]} -eq 0 ] || touch .venv/.bytecode-compiled
  # This package's own modules (an editable install: they are read from ./bridge) are compiled here too: under
  # PYTHONDONTWRITEBYTECODE every process -- each torchrun rank, worker and CLI of the suite -- would otherwise
  # compile its ~100 modules from source again (~0.4 CPU s each). Only changed files are compiled (~1 s).
  .venv/bin/python -m compileall -q -j 0 bridge >/dev/null
}

# The second environment (.ci/run, issue 30): a user's own virtual environment that already has a torch other
# than uv.lock's -- the oldest supported one, with every other requirement at its floor (.ci/compat-oldest.txt,
# made by scripts/compat_lock.py) -- into which this package is installed with a plain, non-editable
# `uv pip install '.[bridge]'` (Megatron-Bridge's GPU-only requirements overridden away, torch NOT in the
# constraints); it fails unless that torch is kept, then runs the compatibility part of the suite (`-m compat`)
# against the installed copy (`python -P`: the checkout is not on sys.path). Extra arguments go to pytest.
compat_env() {
  local py; py=$(find_python)
  ensure_uv "$py"
  local env=.venv-compat lock=.ci/compat-oldest.txt uv=.tools/bin/uv t0=$SECONDS
  export UV_PYTHON_DOWNLOADS=never
  rm -rf "$env"
  "$uv" venv -q --python "$py" "$env"
  local torch_pin; torch_pin=$(grep -E '^torch==' "$lock")
  "$uv" pip install -q --python "$env/bin/python" -c "$lock" "$torch_pin"          # the environment's own torch
  local probe='import hashlib, importlib.metadata as m; d = m.distribution("torch"); print(d.version, hashlib.sha256(d.read_text("RECORD").encode()).hexdigest()[:16])'
  local before after; before=$("$env/bin/python" -c "$probe")
  grep -vE '^torch==' "$lock" > "$env/constraints-without-torch.txt"
  # setuptools builds in ./build and keeps what an earlier build left there: a module since moved or removed
  # would be installed too (a clean clone has none; a worktree may)
  rm -rf build bagel_megatron_data.egg-info
  "$uv" pip install --python "$env/bin/python" ".[bridge]" pytest pytest-timeout pytest-xdist \
    -c "$env/constraints-without-torch.txt" --overrides install/bridge-overrides.txt 2>&1 | tee "$env/install.log"
  after=$("$env/bin/python" -c "$probe")
  if [ "$before" != "$after" ] || grep -qE '^ [-+~] (torch|triton)==' "$env/install.log"; then
    echo "error: installing this package changed the environment's torch ($before -> $after): see $env/install.log" >&2
    return 1
  fi
  echo "compat: torch $before kept; environment built in $((SECONDS - t0)) s"
  local t1=$SECONDS rc=0
  BAGEL_COMPAT_INSTALLED=1 "$env/bin/python" -P -m pytest -q -p no:cacheprovider -n 0 -m compat --durations=12 "$@" \
    || rc=$?
  echo "compat: the compatibility part ran in $((SECONDS - t1)) s (exit $rc)"
  return $rc
}

cmd=${1:-}; shift || true
case "$cmd" in
  setup) setup_env ;;
  test)
    setup_env
    set +e
    # Test files run in ${BAGEL_TEST_PROCESSES:-2} processes (pytest-xdist; a file's tests stay together, so its
    # module fixtures are built once): the torchrun and worker tests leave a core idle much of the time.
    # Files go out in collection order (--no-loadscope-reorder; tests/conftest.py puts the minutes-long ones
    # first, so none of them runs alone at the end). Tests marked `serial` (sensitive to tests running beside
    # them) then run alone. `-n 0` runs the first part in one process too.
    .venv/bin/python -m pytest -q -p no:cacheprovider -n "${BAGEL_TEST_PROCESSES:-2}" --dist loadfile \
      --no-loadscope-reorder -m "not serial" "$@"
    rc=$?
    # The serial part collects only the files that hold a serial test (collecting the whole suite again to
    # run 4 tests took ~12 s); with arguments, pytest gets exactly what was asked for.
    serial_files=()
    [ $# -eq 0 ] && mapfile -t serial_files < <(grep -l "pytest.mark.serial" tests/test_*.py)
    .venv/bin/python -m pytest -q -p no:cacheprovider -m serial "${serial_files[@]}" "$@"
    rc2=$?
    set -e
    # 5 = nothing collected: fine for one part (a selection), not for both
    [ $rc -eq 5 ] && [ $rc2 -eq 5 ] && { echo "error: pytest collected no tests" >&2; exit 1; }
    [ $rc -eq 5 ] && rc=0
    [ $rc2 -eq 5 ] && rc2=0
    [ $rc -ne 0 ] && exit $rc
    exit $rc2 ;;
  demo)
    setup_env
    exec .venv/bin/python scripts/demo.py "$@" ;;
  compat) compat_env "$@" ;;
  compat-lock)
    py=$(find_python); ensure_uv "$py"
    exec "$py" scripts/compat_lock.py --python "$py" --uv .tools/bin/uv "$@" ;;
  *) echo "usage: bash scripts/run.sh {setup|test|demo|compat|compat-lock} [args...]" >&2; exit 2 ;;
esac
