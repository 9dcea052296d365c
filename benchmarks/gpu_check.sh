#!/usr/bin/env bash
# GPU checks in one call. Run from anywhere:
#
#     benchmarks/gpu_check.sh [OUTPUT_DIR]      # JSON figures and logs go to OUTPUT_DIR (default: a temp dir)
#     benchmarks/gpu_check.sh --dry-run         # print every stage (name, time limit, command); run nothing
#
# On one GPU: the suite's GPU tests (tests/test_gpu.py, tests/test_gpu_path.py: NCCL at world size 1
# through the real training path with the stop vote on; no host sync in the steady-state step and the
# stop vote under torch.cuda.set_sync_debug_mode("error"), and none in the real loop's steady steps
# (DDP_SLURM_SYNC_DEBUG=error), eager and with train.cuda_graphs; interrupt-and-resume bit-identical
# with train.deterministic=true, eager and with train.cuda_graphs; cuda_graphs on the Dataset path with
# dropout, and a step that needs the host told what broke; bf16, or its refusal below compute
# capability 8.0; the error path's abort; two ranks on one GPU refused with one line); then one stage
# each (tests/test_gpu_stages.py): dist.strategy=fsdp saving, stopping and resuming bit-identical;
# train.accumulate with train.grad_clip under ddp and fsdp; checkpoint.async=false saving, stopping and
# resuming bit-identical; a NaN loss under DDP_SLURM_SYNC_DEBUG=error ending with the one line "loss is
# nan at step N" (exit 1, no traceback). Then the loader benchmark on cuda for the mlp and the cnn,
# time-to-97% on cuda, the loop's overhead against a bare PyTorch loop (cnn, batch 128: fails below
# 0.97) and with train.cuda_graphs (fails below 1.0, the bare eager loop; prints whether the target 3
# is met: docs/gpu.md), and the checkpoint stall with the state on the GPU. With 2 or more GPUs also:
# 2-rank DDP training over NCCL, the doctor on 2 ranks, `bench ddp --device cuda`, and fsdp at 2 ranks
# over NCCL with sharded checkpoints (a run to the end, then a stop and a bit-identical resume); with
# one GPU those stages are skipped with a printed reason.
#
# Time: every stage has its own limit, generous enough for a cold machine (CUDA, cuDNN and NCCL set up
# on first use), so one that hangs cannot eat the others' time; there is no overall budget, so a slow
# start never fails a run whose stages all passed. The limits are summed and printed at the start.
#
# It fails (exit 1) when torch sees no CUDA GPU, when any GPU test skips, and when any stage fails or
# outlives its limit; a failed stage does not stop the rest, and the exit status and the last lines
# say which failed.
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/gpu_prelude.sh  # DRY, PY, PYTHONPATH; the arguments after --dry-run in ARGS
set -- "${ARGS[@]}"

if [ "$DRY" -eq 1 ]; then
    OUT_DIR=${1:-OUTPUT_DIR}
    GPUS=2  # list every stage, the 2-GPU ones too
    echo "gpu_check: dry run: the stages a machine with 2 GPUs runs (with one, the 2-GPU stages are skipped)"
else
    OUT_DIR=${1:-${OUT:-$(mktemp -d)}}
    mkdir -p "$OUT_DIR"
    if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
        echo "gpu_check: FAILED: torch sees no CUDA GPU ($PY): nothing was checked" >&2
        exit 1
    fi
    "$PY" -c 'import torch; p = torch.cuda.get_device_properties(0); v = torch.cuda.nccl.version()
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", v if isinstance(v, int) else ".".join(map(str, v)),
      "on", p.name, f"(compute capability {p.major}.{p.minor}, {torch.cuda.device_count()} GPU(s))")' | tee "$OUT_DIR/device.txt"
    GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
fi

failed=()
planned=0
stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, log to OUTPUT_DIR/NAME.log, remember failures
    local name=$1 limit=$2; shift 2
    planned=$((planned + limit))
    echo "== $name (limit ${limit}s): $*"
    [ "$DRY" -eq 1 ] && return 0
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - start))s"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        failed+=("$name (outlived its ${limit}s limit)")
    elif [ "$rc" -ne 0 ]; then
        failed+=("$name (exit $rc)")
    fi
}
expect() {  # expect NAME PATTERN: the stage's log must hold PATTERN (a check the exit status cannot make)
    [ "$DRY" -eq 1 ] && { echo "   expect in $1's log: $2"; return 0; }
    grep -qE "$2" "$OUT_DIR/$1.log" || failed+=("$1 (no \"$2\" in its log)")
}
no_skips() {  # no_skips NAME: a pytest stage on a GPU machine must not skip anything
    [ "$DRY" -eq 1 ] && { echo "   expect in $1's log: no skipped test"; return 0; }
    if grep -qiE "[0-9]+ skipped|^SKIPPED" "$OUT_DIR/$1.log"; then failed+=("$1 (some skipped on a GPU machine)"); fi
    expect "$1" "[0-9]+ passed"
}
# -p no:cacheprovider: the checkout may be read-only; -rA lists every outcome, so a skip would show.
PYTEST=("$PY" -m pytest -p no:cacheprovider -q -rA)

stage gpu-tests 300 "${PYTEST[@]}" -m gpu tests/test_gpu.py tests/test_gpu_path.py
no_skips gpu-tests
expect gpu-tests "PASSED .*test_the_real_loop_never_synchronises_between_boundaries\[cuda_graphs\]"
expect gpu-tests "PASSED .*test_deterministic_interrupt_and_resume_is_bit_identical\[cuda_graphs\]"
STAGES=tests/test_gpu_stages.py
stage fsdp-1gpu 180 "${PYTEST[@]}" -m gpu "$STAGES::test_fsdp_saves_stops_and_resumes_bit_identical"
no_skips fsdp-1gpu
stage accumulate-clip 180 "${PYTEST[@]}" -m gpu "$STAGES::test_accumulation_with_clipping_trains"
no_skips accumulate-clip
stage sync-save 180 "${PYTEST[@]}" -m gpu "$STAGES::test_synchronous_saves_stop_and_resume_bit_identical"
no_skips sync-save
stage nan-sync-debug 90 "${PYTEST[@]}" -m gpu "$STAGES::test_nan_under_sync_debug_ends_with_one_line"
no_skips nan-sync-debug
stage loader-mlp 60 "$PY" -m ddp_slurm.bench loader --device cuda --model mlp --json "$OUT_DIR/loader-mlp.json"
stage loader-cnn 60 "$PY" -m ddp_slurm.bench loader --device cuda --model cnn --json "$OUT_DIR/loader-cnn.json"
stage tta 120 "$PY" -m ddp_slurm.bench tta --json "$OUT_DIR/tta.json"
stage overhead 90 "$PY" -m ddp_slurm.bench overhead --device cuda --model cnn --batch 128 --steps 600 \
    --json "$OUT_DIR/overhead.json"
stage overhead-graphs 90 "$PY" -m ddp_slurm.bench overhead --device cuda --model cnn --batch 128 --steps 600 \
    --cuda-graphs --json "$OUT_DIR/overhead-graphs.json"
# The thresholds docs/gpu.md states: eager fails below 0.97; graphs fail below 1.0 (slower than the bare
# eager loop: a defect) and report the target 3 (met or not) without failing on it.
stage overhead-targets 30 "$PY" -c 'import json, sys
eager, graphs = (json.load(open(f))["ratio"] for f in sys.argv[1:])
print(f"overhead: ddp_slurm / bare {eager:.3f} (fails below 0.97)")
target = "met" if graphs >= 3 else "NOT met (not a failure)"
print(f"overhead: cuda_graphs / bare {graphs:.2f} (fails below 1.0; target >= 3: {target})")
sys.exit(0 if eager >= 0.97 and graphs >= 1.0 else 1)' "$OUT_DIR/overhead.json" "$OUT_DIR/overhead-graphs.json"
stage checkpoint-cuda 120 "$PY" -m ddp_slurm.bench checkpoint --device cuda --worlds 1 --state-mb 128 --rounds 3 \
    --dir "$OUT_DIR" --json "$OUT_DIR/checkpoint-cuda.json"
expect checkpoint-cuda "stall_ratio"

TWO_GPU_STAGES="ddp-2gpu, doctor-2gpu, bench-ddp, fsdp-2gpu, fsdp-2gpu-resume"
if [ "$GPUS" -ge 2 ]; then
    # Two ranks, one GPU each, over NCCL: the real training path, then the preflight, then DDP's cost.
    stage ddp-2gpu 180 "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 -m ddp_slurm.train \
        dist.backend=nccl model.name=cnn train.epochs=1 "run.output_root=$OUT_DIR/runs" run.name=ddp-2gpu
    expect ddp-2gpu "backend nccl"
    stage ddp-2gpu-eval 30 "$PY" -c 'import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
last = [r for r in rows if r["kind"] == "eval"][-1]
print("eval", last)
sys.exit(0 if last["test_samples"] == 5000 and last["accuracy"] > 0.9 else 1)' "$OUT_DIR/runs/ddp-2gpu/metrics.jsonl"
    stage doctor-2gpu 120 "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 -m ddp_slurm.doctor
    expect doctor-2gpu "doctor: verdict OK"
    stage bench-ddp 150 "$PY" -m ddp_slurm.bench ddp --device cuda --model cnn --windows 4 --repeats 1 \
        --timeout 140 --json "$OUT_DIR/bench-ddp.json"
    # fsdp at 2 ranks over NCCL: sharded checkpoints every 20 steps and at the end, then a stop
    # (SIGUSR2 to one rank) and a resume that ends bit-identical (tests/test_fsdp.py picks NCCL and
    # one GPU per rank by itself where CUDA is visible).
    stage fsdp-2gpu 180 "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 -m ddp_slurm.train \
        dist.backend=nccl dist.strategy=fsdp model.name=cnn train.epochs=1 checkpoint.every_steps=20 \
        "run.output_root=$OUT_DIR/runs" run.name=fsdp-2gpu
    expect fsdp-2gpu "backend nccl"
    stage fsdp-2gpu-saved 30 "$PY" -c 'import json, sys
from pathlib import Path
run = Path(sys.argv[1])
last = [json.loads(line) for line in open(run / "metrics.jsonl") if "\"eval\"" in line][-1]
folders = sorted(p.name for p in (run / "checkpoints").glob("step-*") if (p / "commit.pt").is_file())
print("eval", last, "committed", folders)
sys.exit(0 if folders and last["test_samples"] == 5000 and last["accuracy"] > 0.9 else 1)' "$OUT_DIR/runs/fsdp-2gpu"
    stage fsdp-2gpu-resume 300 "${PYTEST[@]}" \
        "tests/test_fsdp.py::test_sigusr2_resume_is_bit_identical_and_reshards_at_another_world_size"
    no_skips fsdp-2gpu-resume
else
    echo "== $TWO_GPU_STAGES: skipped: they need 2 GPUs and this machine has $GPUS"
fi

if [ "$DRY" -eq 1 ]; then
    echo "gpu_check: dry run: the stage limits add up to ${planned}s; nothing was run"
    exit 0
fi
echo "figures and logs: $OUT_DIR; total ${SECONDS}s (the stage limits add up to ${planned}s)"
if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_check: FAILED: ${failed[*]}" >&2
    exit 1
fi
echo "gpu_check: all passed"
