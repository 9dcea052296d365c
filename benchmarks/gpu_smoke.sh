#!/usr/bin/env bash
# The first 10 minutes on a GPU: what broke on GPUs while the CPU suite passed, then the steps that must not
# sync, then the loop's overhead. Run from anywhere:
#
#     benchmarks/gpu_smoke.sh [OUTPUT_DIR]      # logs and JSON go to OUTPUT_DIR (default: a temp dir)
#     benchmarks/gpu_smoke.sh --dry-run         # print the plan (stages, limits, commands); run nothing
#
# Stages in priority order, each under its own time limit (`timeout`), the limits summing to under 570 s
# so that the whole script fits a 10-minute slot with room for CUDA's first start:
#   fsdp-bf16-batchnorm   fsdp + train.precision=bf16 on the cnn (BatchNorm): trains (tests/test_gpu_smoke.py)
#   guard-sync-debug      a guard rollback under DDP_SLURM_SYNC_DEBUG=error goes on, no traceback
#   clock-events          at world size 1 every CUDA event recorded is read (none pile up per step); at 2
#                         and more the slow-rank clock holds few events and reads them once completed
#                         (tests/test_gpu_syncs.py)
#   fsdp-save-staging     an fsdp save stages its shards with one wait, not one per tensor (counted under
#                         sync-debug "warn"); the loop's fsdp saves while DDP_SLURM_SYNC_DEBUG=error watches
#   nosync-fp16-guard     the real loop never syncs in a steady step with fp16, and with the guard
#                         (tests/test_gpu_path.py)
#   nosync-activation     the same with train.activation_checkpoint=true (tests/test_gpu_smoke.py)
#   overhead              bench overhead --device cuda: the loop against a bare loop, and the op count
# A failed stage never stops the rest. The last lines are one per stage: NAME PASS|FAIL|SKIP SECONDS (SKIP:
# the stage's tests skipped themselves, e.g. bf16 below compute capability 8.0, or there is no GPU).
# Exit 1 when a stage failed or torch sees no GPU. benchmarks/gpu_check.sh is the long version.
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/gpu_prelude.sh  # DRY, PY, PYTHONPATH; the arguments after --dry-run in ARGS
set -- "${ARGS[@]}"

GPU=1
if [ "$DRY" -eq 1 ]; then
    OUT_DIR=${1:-OUTPUT_DIR}
    echo "gpu_smoke: dry run: the plan, in priority order"
else
    OUT_DIR=${1:-${OUT:-$(mktemp -d)}}
    mkdir -p "$OUT_DIR"
    if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
        echo "gpu_smoke: torch sees no CUDA GPU ($PY): every stage is skipped" >&2
        GPU=0
    else
        "$PY" -c 'import torch; p = torch.cuda.get_device_properties(0)
print("torch", torch.__version__, "cuda", torch.version.cuda, "on", p.name, f"(compute capability {p.major}.{p.minor})")' \
            | tee "$OUT_DIR/device.txt"
    fi
fi

results=()
planned=0
failed=0
# -p no:cacheprovider: the checkout may be read-only; -rA lists every outcome, so a skip shows.
PYTEST=("$PY" -m pytest -p no:cacheprovider -q -rA -m gpu)
SMOKE=tests/test_gpu_smoke.py
SYNCS=tests/test_gpu_syncs.py
stage() {  # stage NAME SECONDS COMMAND...: run under its limit, log to OUTPUT_DIR/NAME.log, record the outcome
    local name=$1 limit=$2; shift 2
    planned=$((planned + limit))
    echo "== $name (limit ${limit}s): $(printf '%q ' "$@")"  # quoted as a shell reads it back
    [ "$DRY" -eq 1 ] && return 0
    if [ "$GPU" -eq 0 ]; then results+=("$name SKIP 0s (no GPU)"); return 0; fi
    local start=$SECONDS log="$OUT_DIR/$name.log" outcome
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    local rc=$?
    tail -n 5 "$log"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        outcome="FAIL"; failed=1; rc="outlived its ${limit}s limit"
    elif [ "$rc" -ne 0 ]; then
        outcome="FAIL"; failed=1; rc="exit $rc"
    elif [ "$1" = "$PY" ] && [ "${2:-}" = "-m" ] && [ "${3:-}" = "pytest" ]; then
        # a pytest stage passes when its tests ran: all skipped is SKIP, some skipped and some passed is FAIL
        if grep -qE "[0-9]+ passed" "$log"; then
            if grep -qE "[0-9]+ skipped" "$log"; then outcome="FAIL"; failed=1; rc="some tests skipped"; else outcome="PASS"; rc="exit 0"; fi
        else
            outcome="SKIP"; rc=$(grep -m1 -oE "^SKIPPED.*" "$log" || echo "nothing ran")
        fi
    else
        outcome="PASS"; rc="exit 0"
    fi
    results+=("$name $outcome $((SECONDS - start))s ($rc)")
}

stage fsdp-bf16-batchnorm 60 "${PYTEST[@]}" "$SMOKE::test_fsdp_bf16_with_batchnorm_trains"
stage guard-sync-debug 60 "${PYTEST[@]}" "$SMOKE::test_guard_rollback_under_sync_debug_goes_on"
stage clock-events 60 "${PYTEST[@]}" "$SMOKE::test_world1_reads_every_cuda_event_it_records" \
    "$SYNCS::test_the_slow_rank_clock_holds_few_events_and_reads_them_once_completed"
stage fsdp-save-staging 75 "${PYTEST[@]}" "$SYNCS::test_an_fsdp_save_stages_its_shards_with_one_wait" \
    "$SMOKE::test_fsdp_saves_under_sync_debug"
stage nosync-fp16-guard 135 "${PYTEST[@]}" tests/test_gpu_path.py \
    -k "test_the_real_loop_never_synchronises_between_boundaries and (fp16 or guard)"
stage nosync-activation 60 "${PYTEST[@]}" "$SMOKE::test_activation_checkpoint_never_synchronises"
stage overhead 110 "$PY" -m ddp_slurm.bench overhead --device cuda --model cnn --batch 128 --steps 600 --pairs 1 \
    --json "$OUT_DIR/overhead.json"

if [ "$DRY" -eq 1 ]; then
    echo "gpu_smoke: dry run: the stage limits add up to ${planned}s; nothing was run"
    exit 0
fi
echo "gpu_smoke: logs in $OUT_DIR; ${SECONDS}s in all (the stage limits add up to ${planned}s)"
for line in "${results[@]}"; do echo "$line"; done
[ "$GPU" -eq 1 ] && [ "$failed" -eq 0 ]
