#!/usr/bin/env bash
# Run a command with its writes to the disk that holds DIR limited to MIB_PER_S, as on a cluster
# file system that is slower than this machine's disk: the kernel's own block-I/O throttle (a cgroup:
# io.max on cgroup v2, blkio.throttle.write_bps_device on v1), not a simulation. Needs root.
#
#   benchmarks/throttled_disk.sh 400 . -- .venv/bin/python -m ddp_slurm.bench checkpoint --state-mb 512
#
# What it limits: writes the command's processes submit themselves (fsync, sync_file_range, O_DIRECT),
# which is how a checkpoint reaches the disk (docs/checkpoints.md). On cgroup v1, pages left for the
# kernel's flusher threads to write are not limited; on v2 they are.
set -euo pipefail

usage() { echo "usage: $0 MIB_PER_S DIR -- COMMAND [ARGS...]" >&2; exit 2; }
[ $# -ge 4 ] && [ "$3" = "--" ] || usage
rate_mib=$1 dir=$2
shift 3
[[ $rate_mib =~ ^[1-9][0-9]*$ ]] || { echo "$0: MIB_PER_S must be a positive integer, not '$rate_mib'" >&2; exit 2; }
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

if [ -f /sys/fs/cgroup/cgroup.controllers ]; then  # v2
    grep -qw io /sys/fs/cgroup/cgroup.controllers || { echo "$0: the io controller is not available" >&2; exit 2; }
    echo +io >/sys/fs/cgroup/cgroup.subtree_control
    group=/sys/fs/cgroup/ddp_slurm-throttle-$$
    mkdir "$group"
    echo "$majmin wbps=$bytes" >"$group/io.max"
elif [ -d /sys/fs/cgroup/blkio ]; then  # v1
    group=/sys/fs/cgroup/blkio/ddp_slurm-throttle-$$
    mkdir "$group"
    echo "$majmin $bytes" >"$group/blkio.throttle.write_bps_device"
else
    echo "$0: no cgroup io (v2) or blkio (v1) hierarchy is mounted" >&2
    exit 2
fi
cleanup() { rmdir "$group" 2>/dev/null || true; }
trap cleanup EXIT
echo "$0: writes to $disk ($majmin) limited to $rate_mib MiB/s for: $*" >&2
set +e
(echo "$BASHPID" >"$group/cgroup.procs" && exec "$@")
code=$?
set -e
exit "$code"
