#!/usr/bin/env bash
# GPU checks in one call, under 5 minutes on one GPU: the suite's GPU tests, then the loader benchmark
# on cuda for the mlp and the cnn, then time-to-97% on cuda. Run from anywhere:
#
#     benchmarks/gpu_check.sh [OUTPUT_DIR]      # JSON figures and logs go to OUTPUT_DIR (default: a temp dir)
#
# It fails (exit 1) when torch sees no CUDA GPU instead of letting the GPU tests skip. Each stage has
# its own time limit, so one that hangs cannot eat the others' time; a failed stage does not stop the
# rest, and the exit status says whether all passed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT_DIR=${1:-${OUT:-$(mktemp -d)}}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package from this checkout, installed or not

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: torch sees no CUDA GPU ($PY): nothing to check" >&2
    exit 1
fi
"$PY" -c 'import torch; print("torch", torch.__version__, "on", torch.cuda.get_device_name(0),
                               f"({torch.cuda.device_count()} GPU(s))")' | tee "$OUT_DIR/device.txt"

failed=()
stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, log to OUTPUT_DIR/NAME.log, remember failures
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - start))s"
    [ "$rc" -eq 0 ] || failed+=("$name (exit $rc)")
}

# -p no:cacheprovider: the checkout may be read-only; -rA lists every outcome, so a skip would show.
stage gpu-tests 120 "$PY" -m pytest -p no:cacheprovider -m gpu tests/test_gpu.py -q -rA
if grep -qi "skipped" "$OUT_DIR/gpu-tests.log"; then failed+=("gpu-tests (some skipped on a GPU machine)"); fi
stage loader-mlp 40 "$PY" -m ddp_slurm.bench loader --device cuda --model mlp --json "$OUT_DIR/loader-mlp.json"
stage loader-cnn 40 "$PY" -m ddp_slurm.bench loader --device cuda --model cnn --json "$OUT_DIR/loader-cnn.json"
stage tta 75 "$PY" -m ddp_slurm.bench tta --json "$OUT_DIR/tta.json"

echo "figures and logs: $OUT_DIR"
if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_check: FAILED: ${failed[*]}" >&2
    exit 1
fi
echo "gpu_check: all passed"
