#!/bin/bash
# MNIST DDP on 4 nodes the other common way: one torchrun agent per node (started by srun), and
# each agent starts one training process per GPU of its node.
#
#   source .venv/bin/activate                 # the environment the job should use (see below)
#   sbatch sbatch/mnist_torchrun.sh           # from the project directory
#   sbatch sbatch/mnist_torchrun.sh train.epochs=2 run.name=try2  # KEY=VALUE config overrides
#   sbatch --nodes=2 sbatch/mnist_torchrun.sh # sbatch options on the command line beat the #SBATCH lines
#   tail -f mnist-torchrun-<jobid>.out        # the log, in the directory you submitted from
#
# Lines starting with "#SBATCH" are options for sbatch (bash sees comments). Change them here or
# override any of them on the sbatch command line.
#
#SBATCH --job-name=mnist-torchrun
#SBATCH --nodes=4
#   One task per node: the torchrun agent. It starts the training processes itself.
#SBATCH --ntasks-per-node=1
#   GPUs per node; the agent starts one training process per GPU it is given.
#SBATCH --gpus-per-node=4
#   All the cores of a node you want to use, shared by its training processes
#   (each gets cpus-per-task / GPUs threads).
#SBATCH --cpus-per-task=32
#   Wall-clock limit (HH:MM:SS).
#SBATCH --time=01:00:00
#   120 s before the time limit Slurm sends SIGUSR2 to every process of the job step: the
#   training processes checkpoint and rank 0 requeues the job, which later resumes exactly.
#   torchrun's agent would die of SIGUSR2, so it is started through `python -m ddp_slurm.launch`,
#   which keeps it alive, passes the signal on to the training processes and exits 75 with them.
#SBATCH --signal=USR2@120
#   Allow the job to be put back in the queue (by the training itself or by a preemption).
#SBATCH --requeue
#   A requeued job appends to its log instead of overwriting the first run's output.
#   A node that fails does not end the job: Slurm drops it from the allocation, and the training step
#   is launched again on the nodes left, from the newest checkpoint (slurm.restarts times; past that,
#   or when this script's own node is lost, the job is requeued without the lost node).
#SBATCH --no-kill
#SBATCH --open-mode=append
#   The log: <job name>-<job id>.out in the directory sbatch was run from (which always exists;
#   sbatch does not create directories, so a path like logs/%x-%j.out needs `mkdir -p logs` first).
#SBATCH --output=%x-%j.out
#   Most clusters want a partition and an account: uncomment and fill in.
##SBATCH --partition=gpu
##SBATCH --account=my-project
#   Memory per node (the cluster's default otherwise), and whole nodes for this job alone.
##SBATCH --mem=64G
##SBATCH --exclusive
#
# Which Python: the job inherits the environment you submitted from (sbatch copies it), so
# activate the project's venv first, or load your site's modules here, or set
# DDP_SLURM_PYTHON=/path/to/venv/bin/python. The job uses `python` from PATH otherwise.
# Training processes per node: DDP_SLURM_NPROC_PER_NODE, else one per GPU Slurm gave the node
# (SLURM_GPUS_ON_NODE, SLURM_GPUS_PER_NODE, the job's GPU list); a GPU request that gives no per-node
# count (--gpus=N over several nodes) stops with a message; a job without GPUs runs one CPU process per node.
#
# Paths: the job runs in the directory you submitted from; relative paths in the config are
# relative to it. The config is jobs/mnist.yaml of the project; `--config FILE` as the first
# argument after the script name replaces it, and `task=...` without `--config` runs that task
# with its own defaults (docs/tasks.md: a YAML of your own once it needs more than a few overrides).
set -uo pipefail

if [ -z "${SLURM_JOB_ID:-}" ]; then
    echo "error: this is a Slurm batch script: submit it with \`sbatch $0 [KEY=VALUE ...]\` (or run it inside an salloc allocation)" >&2
    exit 2
fi
# Site modules the job needs, if your cluster uses them (before Python is looked up below):
# module load python/3.11 cuda/12.4
# source /path/to/venv/bin/activate
PYTHON=$(command -v "${DDP_SLURM_PYTHON:-python}") || {
    echo "error: no '${DDP_SLURM_PYTHON:-python}' on PATH: activate the project's environment before sbatch, or set DDP_SLURM_PYTHON=/path/to/venv/bin/python" >&2
    exit 2
}
# sbatch runs a copy of this script from its spool directory, so the files are found from the
# submit directory (or a parent of it): a source checkout goes on PYTHONPATH, and jobs/mnist.yaml
# (a checkout's, or the copy `ddp-slurm init DIR` made) is the config; failing that, the config
# shipped with the installed package.
PROJECT=""
FOUND=""
dir=${SLURM_SUBMIT_DIR:-$PWD}
while [ "$dir" != / ]; do
    [ -z "$PROJECT" ] && [ -f "$dir/ddp_slurm/__init__.py" ] && PROJECT=$dir
    [ -z "$FOUND" ] && [ -f "$dir/jobs/mnist.yaml" ] && FOUND=$dir/jobs/mnist.yaml
    dir=$(dirname "$dir")
done
if [ -n "$PROJECT" ]; then
    export PYTHONPATH="$PROJECT${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PYTHON" -c 'import ddp_slurm' 2>/dev/null; then
    echo "error: $PYTHON cannot import ddp_slurm: activate the environment it is installed in before sbatch, set DDP_SLURM_PYTHON, or submit from the project directory" >&2
    exit 2
fi
CONFIG=${FOUND:-$("$PYTHON" -c 'from ddp_slurm.launch.init import asset; print(asset("jobs/mnist.yaml"))' 2>/dev/null)}
if [ "${1:-}" = --config ]; then
    CONFIG=$2
    shift 2
elif printf '%s\n' "$@" | grep -q '^task='; then
    CONFIG=  # another task (task=...): its own defaults, not the MNIST job config
elif [ ! -f "$CONFIG" ]; then
    echo "error: cannot find jobs/mnist.yaml: submit from the project directory (or one made by \`ddp-slurm init DIR\`), or pass --config FILE" >&2
    exit 2
fi

# When a rank is lost or stuck, each rank left dumps its flight recorder (its last collectives: which were
# issued, which completed; gloo's too) with the verdict, its last step and where its training stood, to
# nccl-traces/<job>.<restart>-rank<N> in the submit directory (<job>.<restart>.<K>-rank<N> for the K-th
# relaunch inside the allocation), the evidence of who stopped where; NCCL's own watchdog writes the same
# file when a collective hangs until dist.timeout_s. Values already set in the environment win.
export TORCH_NCCL_TRACE_BUFFER_SIZE=${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
export TORCH_NCCL_DEBUG_INFO_TEMP_FILE=${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-$PWD/nccl-traces/${SLURM_JOB_ID}.${SLURM_RESTART_COUNT:-0}-rank}
mkdir -p "$(dirname "$TORCH_NCCL_DEBUG_INFO_TEMP_FILE")" || true  # the dump goes nowhere without it

NPROC_LINE=$("$PYTHON" -m ddp_slurm.launch.nproc) || exit 2  # the error says what to set
NPROC=${NPROC_LINE%% *}
NPROC_FROM=${NPROC_LINE#* }
# Threads per training process: the task's cores shared out, so processes never oversubscribe a node.
CPUS=${SLURM_CPUS_PER_TASK:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CPUS / NPROC > 0 ? CPUS / NPROC : 1 ))}
# The rendezvous: a TCP store that the agent on the job's first node starts, on a port derived from
# the job id (two jobs sharing a node do not collide, a requeued job gets the same one), and the
# job id as rendezvous id, so agents of different jobs can never join each other.
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
RDZV_PORT=$(( 20000 + SLURM_JOB_ID % 12000 ))

echo "job ${SLURM_JOB_ID} restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NUM_NODES} node(s): ${SLURM_JOB_NODELIST}; ${NPROC} process(es) per node (${NPROC_FROM}), ${OMP_NUM_THREADS} thread(s) each; rendezvous ${HEAD}:${RDZV_PORT}; python ${PYTHON}; config ${CONFIG}; started $(date '+%F %T')"

# The step runs through ddp_slurm.launch.supervise, which calls srun with one agent per node
#   (--ntasks-per-node=1) and --kill-on-bad-exit=1 (if one node fails, the others stop instead of waiting),
#   each agent `python -m ddp_slurm.launch --nnodes=<nodes> --nproc-per-node=$NPROC` with its rendezvous on
#   the launch's first node. When a node is lost it launches again on the nodes left (a fresh rendezvous on
#   the next port, one log line says so); a launch that fails before training begins is tried again.
"$PYTHON" -m ddp_slurm.launch.supervise --torchrun "$NPROC" --rdzv-port "$RDZV_PORT" -- \
    "$PYTHON" -m ddp_slurm.train ${CONFIG:+--config} ${CONFIG:+"$CONFIG"} "$@"
status=$?
# 0: finished. 75: stopped on the signal after a checkpoint (the job is already requeued when
# rank 0 could do it). Anything else: a failure, the reason is in the lines above.
echo "job ${SLURM_JOB_ID} restart ${SLURM_RESTART_COUNT:-0}: training exited with ${status} at $(date '+%F %T')"
exit "$status"
