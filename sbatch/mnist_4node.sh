#!/bin/bash
# MNIST DDP on 4 nodes, one training process (rank) per GPU, launched by srun.
#
#   source .venv/bin/activate                 # the environment the job should use (see below)
#   sbatch sbatch/mnist_4node.sh              # from the project directory
#   sbatch sbatch/mnist_4node.sh train.epochs=2 run.name=try2     # KEY=VALUE config overrides
#   sbatch --nodes=2 sbatch/mnist_4node.sh    # sbatch options on the command line beat the #SBATCH lines
#   sbatch --nodes=3-4 sbatch/mnist_4node.sh train.global_batch_size=384 train.micro_batch_size=8  # 3 or 4 nodes, docs/cluster.md
#   tail -f mnist-4node-<jobid>.out           # the log, in the directory you submitted from
#
# Lines starting with "#SBATCH" are options for sbatch, read before the job starts (bash sees
# comments). Change them here or override any of them on the sbatch command line.
#
#SBATCH --job-name=mnist-4node
#   4 machines. Fewer or more work unchanged: the ranks and batch split follow the allocation.
#SBATCH --nodes=4
#   One task (= one rank) per GPU: keep these two numbers equal.
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#   CPU cores per rank; torch uses this many threads. Keep tasks x cpus <= the cores of a node.
#SBATCH --cpus-per-task=8
#   Wall-clock limit (HH:MM:SS). The job is stopped when it runs out, so see --signal below.
#SBATCH --time=01:00:00
#   120 s before the time limit Slurm sends SIGUSR2 to the training processes: they finish the
#   current step, write a checkpoint, and rank 0 requeues the job, which later resumes exactly
#   where it stopped. Give the checkpoint time: raise 120 for big models or slow file systems.
#SBATCH --signal=USR2@120
#   Allow the job to be put back in the queue (by the training itself or by a preemption).
#SBATCH --requeue
#   A node that fails does not end the job: Slurm drops it from the allocation, and the training step
#   is launched again on the nodes left, from the newest checkpoint (slurm.restarts times; past that,
#   or when this script's own node is lost, the job is requeued without the lost node).
#SBATCH --no-kill
#   A requeued job appends to its log instead of overwriting the first run's output.
#SBATCH --open-mode=append
#   The log: <job name>-<job id>.out in the directory sbatch was run from (which always exists;
#   sbatch does not create directories, so a path like logs/%x-%j.out needs `mkdir -p logs` first).
#SBATCH --output=%x-%j.out
#   Most clusters want a partition and an account: uncomment and fill in (`sinfo` lists partitions,
#   `sacctmgr show assoc user=$USER` your accounts).
##SBATCH --partition=gpu
##SBATCH --account=my-project
#   Memory per node (the cluster's default otherwise), and whole nodes for this job alone.
##SBATCH --mem=64G
##SBATCH --exclusive
#
# Which Python: the job inherits the environment you submitted from (sbatch copies it), so
# activate the project's venv first, or load your site's modules here (e.g. `module load
# python/3.11 cuda/12.4` followed by `source /path/to/venv/bin/activate`), or set
# DDP_SLURM_PYTHON=/path/to/venv/bin/python. The job uses `python` from PATH otherwise.
#
# Paths: the job runs in the directory you submitted from; relative paths in the config
# (run.output_root, data.root) are relative to it. The config is jobs/mnist.yaml of the project
# (found from the submit directory or the installed package); `--config FILE` as the first
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

# One line about the job at the top of every run (a requeued job appends a new one).
echo "job ${SLURM_JOB_ID} restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NUM_NODES} node(s): ${SLURM_JOB_NODELIST}; python ${PYTHON}; config ${CONFIG}; started $(date '+%F %T')"

# srun starts one task per slot (nodes x ntasks-per-node); each becomes one rank and reads its rank and
# the rendezvous address from Slurm's variables. --kill-on-bad-exit=1: if one rank fails, stop all of
# them at once instead of leaving the others waiting in a collective until a timeout. --cpus-per-task:
# spelled out because srun of some Slurm versions (22.05) ignores the job's value.
# The step runs through ddp_slurm.launch.supervise, which calls srun as above on the job's nodes and, when
#   a node is lost, launches it again on the nodes left (one log line says so); a launch that fails before
#   training begins (a node refusing it for a second) is tried again. Anything else ends the job.
"$PYTHON" -m ddp_slurm.launch.supervise -- \
    "$PYTHON" -m ddp_slurm.train ${CONFIG:+--config} ${CONFIG:+"$CONFIG"} "$@"
status=$?
# 0: finished. 75: stopped on the signal after a checkpoint (the job is already requeued when
# rank 0 could do it). Anything else: a failure, the reason is in the lines above.
echo "job ${SLURM_JOB_ID} restart ${SLURM_RESTART_COUNT:-0}: training exited with ${status} at $(date '+%F %T')"
exit "$status"
