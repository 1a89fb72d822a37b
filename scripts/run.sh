#!/usr/bin/env bash
# One entry point for the two commands that matter, on a fresh machine with only Python 3.12:
#   bash scripts/run.sh test   -> builds .venv from uv.lock (if needed) and runs the whole test suite
#   bash scripts/run.sh demo   -> builds .venv, generates the embedded demo data, runs the main job
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

setup_env() {
  local py; py=$(find_python)
  if [ ! -x .tools/bin/uv ]; then
    "$py" -m venv .tools
    .tools/bin/pip install -q --disable-pip-version-check uv
  fi
  # Bytecode compiled once per lock: every process (ranks, workers, torchrun children) then imports from .pyc
  # instead of compiling torch/transformers/Megatron sources again (imports ~5.4 s -> ~3 s here, also under
  # PYTHONDONTWRITEBYTECODE). ~30 s on 2 cores, so only when the environment is new or uv.lock changed.
  local compile=()
  if [ ! -f .venv/.bytecode-compiled ] || [ uv.lock -nt .venv/.bytecode-compiled ]; then compile=(--compile-bytecode); fi
  UV_PYTHON_DOWNLOADS=never .tools/bin/uv sync --frozen "${compile[@]}" --python "$py" -q
  [ ${#compile[@]} -eq 0 ] || touch .venv/.bytecode-compiled
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
    .venv/bin/python -m pytest -q -p no:cacheprovider -m serial "$@"
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
  *) echo "usage: bash scripts/run.sh {setup|test|demo} [args...]" >&2; exit 2 ;;
esac
