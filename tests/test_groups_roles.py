"""distributed/groups.py: every collective of the package names the group of its role (``host`` or ``train``).

On CPU the two roles' groups are two gloo groups (the NCCL-shaped mode): both carry CPU tensors, so a host
tensor sent on the training group passes every run of the suite and fails on NCCL's, which carries CUDA
tensors only (and a device tensor on the host group the reverse). No run on CPU can tell them apart; the
source can. This test reads the package: each call of a torch collective (``ROLES``) is listed with the
role of what it carries, and the group it names is followed back to where it comes from (``groups.host``,
``groups.train``, a parameter, an attribute set from one, a group made on the spot). A group that arrives
as a parameter makes the function a carrier of that role: every call of it in the package must pass a
group of that role in turn. It fails on a collective not listed, on one that names no group where a role
needs one, and on one that names the other role's group.
"""

from __future__ import annotations

import pytest
from groups_helpers import DEFAULT, HOST, MADE, PACKAGE, TRAIN, Table, check, modules, planted

# Every torch collective of the package, by (file, function, collective): the role of each call in the
# order they appear. host: host memory (flags on the host, pickled objects, DCP's planning); train: tensors
# on the training device; default: the default group, where the code made it itself (no NCCL-shaped mode:
# benchmark workers that start their own plain gloo group); made: a group made on the spot (new_group).
ROLES: dict[tuple[str, str, str], list[str]] = {
    ("distributed/groups.py", "gloo_group", "new_group"): [MADE],
    ("distributed/group.py", "on_rank0", "broadcast_object_list"): [HOST],  # a pickled result
    ("train/evaluation.py", "EvalVote.__call__", "all_reduce"): [HOST],  # the stop flags, read on the host
    ("train/step.py", "evaluate", "broadcast_object_list"): [HOST],  # the metrics' names
    ("train/step.py", "evaluate", "all_reduce"): [TRAIN],  # the metric sums, on the device
    ("train/step.py", "take_rank0_buffers", "broadcast"): [TRAIN],  # the model's buffers
    ("train/vote.py", "StopVote._post", "all_reduce"): [TRAIN],  # the loss's finite flag is on the device
    ("train/window.py", "LossWindow.close", "all_reduce"): [TRAIN, TRAIN],  # the loss sum; the step times
    ("train/window.py", "log_placement", "all_gather_object"): [HOST],
    ("train/ddp.py", "wrap_ddp", "DistributedDataParallel"): [TRAIN],
    ("train/fsdp.py", "shard", "init_device_mesh"): [DEFAULT],  # only where the training group is the default
    ("train/fsdp.py", "shard", "from_group"): [TRAIN],
    ("train/hooks/slowranks.py", "SlowRanks.start", "all_gather_object"): [HOST],
    ("train/hooks/slowranks.py", "SlowRanks.after_step", "all_reduce"): [HOST],  # host clock readings
    ("train/checkpoint/state.py", "gather", "gather_object"): [HOST],
    ("train/guard/culprits.py", "find", "all_gather_object"): [HOST],  # the per-sample losses, on the host
    ("train/checkpoint/sharded.py", "finite", "all_reduce"): [HOST],
    ("train/checkpoint/dcp_safe.py", "load", "load"): [HOST],  # DCP's planning: pickled objects
    ("train/checkpoint/sharded_writer.py", "ShardedCheckpointer.save", "broadcast_object_list"): [HOST, HOST],
    ("train/checkpoint/sharded_writer.py", "ShardedCheckpointer.save", "save"): [HOST],
    ("train/checkpoint/sharded_writer.py", "ShardedCheckpointer.save", "async_save"): [HOST],
    ("train/checkpoint/sharded_writer.py", "ShardedCheckpointer._asynchronous", "all_gather_object"): [HOST],
    ("train/checkpoint/sharded_writer.py", "ShardedCheckpointer._asynchronous", "all_reduce"): [HOST],
    ("tools/doctor.py", "measure", "all_reduce"): [TRAIN],  # doctor times what gradients take
    ("tools/doctor.py", "measure.timed", "all_reduce"): [TRAIN],
    ("tools/doctor.py", "_after_init", "barrier"): [HOST],
    ("tools/doctor.py", "_after_init", "all_gather_object"): [HOST],
    ("tools/doctor.py", "_after_init", "broadcast_object_list"): [HOST],
    ("tools/probes.py", "ring_seconds", "barrier"): [TRAIN],
    ("tools/probes.py", "ring_seconds", "P2POp"): [TRAIN, TRAIN],  # device tensors, the gradients' path
    ("bench/ddp_scaling.py", "worker", "all_reduce"): [TRAIN],
    ("bench/ddp_scaling.py", "worker.window", "barrier"): [HOST, HOST],
    ("bench/forecast.py", "_slowest", "all_reduce"): [HOST],
    ("bench/forecast.py", "measure_ranks", "all_reduce"): [TRAIN, TRAIN],
    ("bench/forecast.py", "measure_ranks", "barrier"): [HOST, HOST],
    # benchmark workers that make a plain default group themselves (gloo, or NCCL with device tensors)
    ("bench/ckpt_measure.py", "main", "barrier"): [DEFAULT],
    ("bench/ckpt_measure.py", "main.barrier", "barrier"): [DEFAULT],
    ("bench/ckpt_worker.py", "Trainer.__init__", "DistributedDataParallel"): [DEFAULT],
    ("bench/ckpt_worker.py", "exchange", "all_reduce"): [DEFAULT],
    ("bench/ckpt_worker.py", "run", "barrier"): [DEFAULT],
    ("bench/strategy_worker.py", "main", "barrier"): [DEFAULT],
    ("bench/strategy_worker.py", "memory", "barrier"): [DEFAULT],
    ("bench/strategy_worker.py", "checkpoint_stall", "barrier"): [DEFAULT, DEFAULT, DEFAULT],
    ("bench/strategy_worker.py", "checkpoint_stall.steps", "barrier"): [DEFAULT],
}
# Calls of a carrier of the training role that may name no group: one rank (no collective), or a benchmark
# worker that makes a plain default group itself, outside the NCCL-shaped mode: its training group.
DEFAULT_IS_TRAIN: set[tuple[str, str, str]] = {
    ("bench/strategy_worker.py", "build", "wrap"),  # its own plain default group
    ("bench/ddp_scaling.py", "worker", "mnist_trainer"),  # the 1-rank run: no collective
    ("bench/ddp_scaling.py", "worker", "StopVote"),
    ("bench/pipeline_speed.py", "FastPipeline.__init__", "mnist_trainer"),  # one rank
}

# Groups made without the run's timeout, in files being changed apart from this test: each must lack it
# (the test fails once one names it, so that it leaves this list).
NO_TIMEOUT_YET: set[tuple[str, str]] = set()


TABLE = Table(ROLES, DEFAULT_IS_TRAIN, NO_TIMEOUT_YET)


def test_every_collective_names_the_group_of_its_role() -> None:
    assert check(modules(), TABLE).wrong == []


MISTAKES = {
    "host-flags-on-train": (  # the evaluation's stop flags (host memory) sent on the training group
        "train/evaluation.py",
        "self.vote = EvalVote(stop, run.world_size, run.groups.host)",
        "self.vote = EvalVote(stop, run.world_size, run.groups.train)",
        "evaluation.py:{} (Evaluations.__init__) EvalVote(group=...) names the train group, but carries the host",
    ),
    "host-names-on-train": (  # pickled names through the training group
        "train/step.py",
        "dist.broadcast_object_list(layout, src=0, group=groups.host)",
        "dist.broadcast_object_list(layout, src=0, group=groups.train)",
        "step.py:{} (evaluate) broadcast_object_list names the train group, but carries the host",
    ),
    "device-sums-on-host": (  # the evaluation's device totals on the host group
        "train/step.py",
        "dist.all_reduce(totals, group=groups.train)",
        "dist.all_reduce(totals, group=groups.host)",
        "step.py:{} (evaluate) all_reduce names the host group, but carries the train",
    ),
    "buffers-on-host": (  # a carrier's caller: the buffers handed the host group
        "train/checkpoint/capture.py",
        "take_rank0_buffers(run.model, run.world_size, run.groups.train)",
        "take_rank0_buffers(run.model, run.world_size, run.groups.host)",
        "capture.py:{} (ShardedCapture.capture) take_rank0_buffers(group=...) names the host group, but carries the train",
    ),
    "no-group": (  # a collective left on the default group
        "train/step.py",
        "dist.all_reduce(totals, group=groups.train)",
        "dist.all_reduce(totals)",
        "step.py:{} (evaluate) all_reduce names no group, but carries the train",
    ),
    "unlisted": (  # a new collective nobody said the role of
        "train/step.py",
        "    names = names or []\n",
        "    dist.barrier(group=groups.host)\n    names = names or []\n",
        "step.py:{} barrier in evaluate is not in ROLES",
    ),
    "pickles-on-train": (  # a carrier of the host role (on_rank0) handed the training group
        "train/checkpoint/checkpointer.py",
        "found = on_rank0(self.run, find, self.run.groups.host)",
        "found = on_rank0(self.run, find, self.run.groups.train)",
        "checkpointer.py:{} (Checkpointer.go_back) on_rank0(group=...) names the train group, but carries the host",
    ),
    "group-without-timeout": (
        "distributed/groups.py",
        'dist.new_group(backend="gloo", timeout=default_timeout())',
        'dist.new_group(backend="gloo")',
        "groups.py:{} new_group names no timeout",
    ),
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_planted_mistake_fails(mistake: str) -> None:
    """The check above is not blind: each mistake, made in memory in the package's source, is named."""
    rel, old, new, said = MISTAKES[mistake]
    before = set(check(modules(), TABLE).wrong)  # empty, unless the test above fails too
    wrong = [w for w in check(planted(rel, old, new), TABLE).wrong if w not in before]
    line = (PACKAGE / rel).read_text().split(old)[0].count("\n") + 1
    assert len(wrong) == 1 and said.format(line) in wrong[0], wrong
