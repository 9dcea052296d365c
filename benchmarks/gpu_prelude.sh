# Sourced by gpu_check.sh and gpu_smoke.sh from the repository root: --dry-run (DRY=1, shifted away), the
# Python to use (PYTHON, else .venv's, else python3) as PY, and the package of this checkout on PYTHONPATH.
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package from this checkout, installed or not
ARGS=("$@")
