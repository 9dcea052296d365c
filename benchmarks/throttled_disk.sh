#!/usr/bin/env bash
# Run a command with its writes (--read: its reads; both: --read --write) to the disk that holds DIR
# limited to MIB_PER_S, as on a cluster file system that is slower than this machine's disk: the
# kernel's own block-I/O throttle (a cgroup: io.max on cgroup v2, blkio.throttle.*_device on v1), not a
# simulation. --iops N also limits the throttled directions to N requests a second (small random reads
# are bound by requests, not bytes). Needs root. The command's children (DataLoader workers) inherit it.
#
#   benchmarks/throttled_disk.sh 400 . -- .venv/bin/python -m ddp_slurm.bench checkpoint --state-mb 512
#   benchmarks/throttled_disk.sh --read --iops 2000 100 . -- .venv/bin/python -m ddp_slurm.bench shards --dir .
#
# What it limits: writes the command's processes submit themselves (fsync, sync_file_range, O_DIRECT),
# which is how a checkpoint reaches the disk (docs/checkpoints.md). On cgroup v1, pages left for the
# kernel's flusher threads to write are not limited; on v2 they are. Reads: every read that misses the
# page cache (a process waits for its own reads, the kernel's read-ahead included), on v1 and v2 alike;
# `bench shards` evicts its files from the cache before each pass, so each pass reads at this rate.
set -euo pipefail

usage() { echo "usage: $0 [--read] [--write] [--iops N] MIB_PER_S DIR -- COMMAND [ARGS...]" >&2; exit 2; }
read_limit=0 write_limit=0 iops=
while [ $# -gt 0 ]; do
    case $1 in
        --read) read_limit=1; shift ;;
        --write) write_limit=1; shift ;;
        --iops) [ $# -ge 2 ] || usage; iops=$2; shift 2 ;;
        *) break ;;
    esac
done
[ "$read_limit" = 1 ] || write_limit=1  # writes alone unless --read is given
[ $# -ge 4 ] && [ "$3" = "--" ] || usage
rate_mib=$1 dir=$2
shift 3
[[ $rate_mib =~ ^[1-9][0-9]*$ ]] || { echo "$0: MIB_PER_S must be a positive integer, not '$rate_mib'" >&2; exit 2; }
[ -z "$iops" ] || [[ $iops =~ ^[1-9][0-9]*$ ]] || { echo "$0: --iops must be a positive integer, not '$iops'" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "$0: needs root (it creates a cgroup)" >&2; exit 2; }
[ -d "$dir" ] || { echo "$0: no such directory: $dir" >&2; exit 2; }

# The whole disk under DIR's file system: the throttle works on disks, not partitions.
source_dev=$(findmnt -n -o SOURCE -T "$dir")
[ -b "$source_dev" ] || { echo "$0: $dir is on $source_dev, not a block device: nothing to throttle" >&2; exit 2; }
parent=$(lsblk -no PKNAME "$source_dev" | head -n1)
disk=${parent:+/dev/$parent}
disk=${disk:-$source_dev}
majmin=$(lsblk -dno MAJ:MIN "$disk" | tr -d ' ')
bytes=$((rate_mib * 1024 * 1024))
directions=()
[ "$read_limit" = 0 ] || directions+=(read)
[ "$write_limit" = 0 ] || directions+=(write)

if [ -f /sys/fs/cgroup/cgroup.controllers ]; then  # v2
    grep -qw io /sys/fs/cgroup/cgroup.controllers || { echo "$0: the io controller is not available" >&2; exit 2; }
    echo +io >/sys/fs/cgroup/cgroup.subtree_control
    group=/sys/fs/cgroup/ddp_slurm-throttle-$$
    mkdir "$group"
    limits=
    for d in "${directions[@]}"; do
        limits+=" ${d:0:1}bps=$bytes${iops:+ ${d:0:1}iops=$iops}"
    done
    echo "$majmin$limits" >"$group/io.max"
elif [ -d /sys/fs/cgroup/blkio ]; then  # v1
    group=/sys/fs/cgroup/blkio/ddp_slurm-throttle-$$
    mkdir "$group"
    for d in "${directions[@]}"; do
        echo "$majmin $bytes" >"$group/blkio.throttle.${d}_bps_device"
        [ -z "$iops" ] || echo "$majmin $iops" >"$group/blkio.throttle.${d}_iops_device"
    done
else
    echo "$0: no cgroup io (v2) or blkio (v1) hierarchy is mounted" >&2
    exit 2
fi
cleanup() { rmdir "$group" 2>/dev/null || true; }
trap cleanup EXIT
what=${directions[*]/%/s}
echo "$0: ${what/ / and } on $disk ($majmin) limited to $rate_mib MiB/s${iops:+ and $iops requests/s} for: $*" >&2
set +e
(echo "$BASHPID" >"$group/cgroup.procs" && exec "$@")
code=$?
set -e
exit "$code"
