#!/usr/bin/env bash
# GPU checks in one call, under 5 minutes. Run from anywhere:
#
#     benchmarks/gpu_check.sh [OUTPUT_DIR]      # JSON figures and logs go to OUTPUT_DIR (default: a temp dir)
#
# On one GPU: the suite's GPU tests (tests/test_gpu.py, tests/test_gpu_path.py: NCCL at world size 1
# through the real training path with the stop vote on; no host sync in the steady-state step and the
# stop vote under torch.cuda.set_sync_debug_mode("error"), and none in the real loop's steady steps
# (DDP_SLURM_SYNC_DEBUG=error), eager and with train.cuda_graphs; interrupt-and-resume bit-identical
# with train.deterministic=true, eager and with train.cuda_graphs; cuda_graphs on the Dataset path with
# dropout, and a step that needs the host told what broke; bf16, or its refusal below compute
# capability 8.0; the error path's abort; two ranks on one GPU refused with one line), then the loader
# benchmark on cuda for the mlp and the cnn, time-to-97% on cuda, the loop's overhead against a bare
# PyTorch loop (cnn, batch 128: fails below 0.97) and with train.cuda_graphs (fails below 1.0; target
# 3), and the checkpoint stall with the state on the GPU (copied through pinned host memory). With 2
# or more GPUs also: 2-rank DDP training over NCCL, the doctor on 2 ranks, and `bench ddp --device cuda`.
#
# It fails (exit 1) when torch sees no CUDA GPU, when any GPU test skips, when any stage fails or
# outlives its limit, and when the whole takes 5 minutes or more. Each stage has its own time limit,
# so one that hangs cannot eat the others' time; a failed stage does not stop the rest, and the exit
# status and the last lines say which failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT_DIR=${1:-${OUT:-$(mktemp -d)}}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package from this checkout, installed or not
BUDGET_S=300

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: FAILED: torch sees no CUDA GPU ($PY): nothing was checked" >&2
    exit 1
fi
"$PY" -c 'import torch; p = torch.cuda.get_device_properties(0); v = torch.cuda.nccl.version()
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", v if isinstance(v, int) else ".".join(map(str, v)),
      "on", p.name, f"(compute capability {p.major}.{p.minor}, {torch.cuda.device_count()} GPU(s))")' | tee "$OUT_DIR/device.txt"
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')

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
expect() {  # expect NAME PATTERN: the stage's log must hold PATTERN (a check the exit status cannot make)
    grep -qE "$2" "$OUT_DIR/$1.log" || failed+=("$1 (no \"$2\" in its log)")
}

# -p no:cacheprovider: the checkout may be read-only; -rA lists every outcome, so a skip would show.
stage gpu-tests 180 "$PY" -m pytest -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_gpu_path.py -q -rA
if grep -qiE "[0-9]+ skipped|^SKIPPED" "$OUT_DIR/gpu-tests.log"; then failed+=("gpu-tests (some skipped on a GPU machine)"); fi
expect gpu-tests "[0-9]+ passed"
expect gpu-tests "PASSED .*test_the_real_loop_never_synchronises_between_boundaries\[cuda_graphs\]"
expect gpu-tests "PASSED .*test_deterministic_interrupt_and_resume_is_bit_identical\[cuda_graphs\]"
stage loader-mlp 30 "$PY" -m ddp_slurm.bench loader --device cuda --model mlp --json "$OUT_DIR/loader-mlp.json"
stage loader-cnn 30 "$PY" -m ddp_slurm.bench loader --device cuda --model cnn --json "$OUT_DIR/loader-cnn.json"
stage tta 60 "$PY" -m ddp_slurm.bench tta --json "$OUT_DIR/tta.json"
stage overhead 50 "$PY" -m ddp_slurm.bench overhead --device cuda --model cnn --batch 128 --steps 600 \
    --json "$OUT_DIR/overhead.json"
stage overhead-graphs 50 "$PY" -m ddp_slurm.bench overhead --device cuda --model cnn --batch 128 --steps 600 \
    --cuda-graphs --json "$OUT_DIR/overhead-graphs.json"
stage overhead-targets 10 "$PY" -c 'import json, sys
eager, graphs = (json.load(open(f))["ratio"] for f in sys.argv[1:])
print(f"overhead: ddp_slurm / bare {eager:.3f} (target >= 0.97); cuda_graphs / bare {graphs:.2f} (target >= 3)")
sys.exit(0 if eager >= 0.97 and graphs >= 1.0 else 1)' "$OUT_DIR/overhead.json" "$OUT_DIR/overhead-graphs.json"
stage checkpoint-cuda 60 "$PY" -m ddp_slurm.bench checkpoint --device cuda --worlds 1 --state-mb 128 --rounds 3 \
    --dir "$OUT_DIR" --json "$OUT_DIR/checkpoint-cuda.json"
expect checkpoint-cuda "stall_ratio"

if [ "$GPUS" -ge 2 ]; then
    # Two ranks, one GPU each, over NCCL: the real training path, then the preflight, then DDP's cost.
    stage ddp-2gpu 60 "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 -m ddp_slurm.train \
        dist.backend=nccl model.name=cnn train.epochs=1 "run.output_root=$OUT_DIR/runs" run.name=ddp-2gpu
    expect ddp-2gpu "backend nccl"
    stage ddp-2gpu-eval 10 "$PY" -c 'import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
last = [r for r in rows if r["kind"] == "eval"][-1]
print("eval", last)
sys.exit(0 if last["test_samples"] == 5000 and last["accuracy"] > 0.9 else 1)' "$OUT_DIR/runs/ddp-2gpu/metrics.jsonl"
    stage doctor-2gpu 45 "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 -m ddp_slurm.doctor
    expect doctor-2gpu "doctor: verdict OK"
    stage bench-ddp 75 "$PY" -m ddp_slurm.bench ddp --device cuda --model cnn --windows 4 --repeats 1 \
        --timeout 70 --json "$OUT_DIR/bench-ddp.json"
else
    echo "== ddp-2gpu, doctor-2gpu, bench-ddp: not part of this check: they need 2 GPUs and this machine has $GPUS"
fi

echo "figures and logs: $OUT_DIR; total ${SECONDS}s"
if [ "$SECONDS" -ge "$BUDGET_S" ]; then failed+=("the whole check took ${SECONDS}s, over its ${BUDGET_S}s budget"); fi
if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_check: FAILED: ${failed[*]}" >&2
    exit 1
fi
echo "gpu_check: all passed"
