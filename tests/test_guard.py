"""The guard (ddp_slurm/train/guard/): a loss spike rolled back, replayed and judged in the same process.

Bad data (``Poison``'s sample 300 multiplies its rank's loss by 1e6) is reproduced by the replay and skipped:
the run ends torch.equal to one started with that step skipped (1 rank, 2 ranks ddp and fsdp). A one-shot
fault on one rank is not reproduced: that rank and its host are named, nothing is skipped, and the run ends
equal to one that never had the fault. Skipped steps outlive the launch (a resume at another world size keeps
them), the cap ends the run in one line, and a quiet run of the examples is never flagged.
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import Launcher, base_env
from guard_helpers import GUARDED, same_weights, write_poison_task
from helpers import resume

from ddp_slurm import safefs, skips
from ddp_slurm.config import ConfigError, value_of
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.train import checkpoint, loader
from ddp_slurm.train.checkpoint import schema
from ddp_slurm.train.guard import record, replay, spike

# -- the rules, as pure functions ------------------------------------------------------------------------


def test_skipped_steps_parse_merge_and_refuse_what_is_not_a_list_of_steps() -> None:
    assert skips.parse("1201-1400, 1650,1401-1410") == [(1201, 1410), (1650, 1650)]
    assert skips.show(skips.parse("9,18-20")) == "9,18-20"
    for bad in ("", "0", "5-3", "a-b", "1-2-3", "9,"):
        with pytest.raises(ValueError):
            skips.parse(bad)
    with pytest.raises(ConfigError, match="steps count from 1"):
        value_of("guard.skip", "5-3")
    assert skips.Skips([(3, 4)]).covers(4) and not skips.Skips([(3, 4)]).covers(5)


def test_a_skipped_step_draws_no_batch_and_every_other_step_keeps_its_own() -> None:
    """In memory and through the sampler of the Dataset path: the same batches, without the skipped ones."""
    data = loader.Tensors(torch.arange(64).float().unsqueeze(1))
    plain = loader.InMemory(data, torch.device("cpu"), 0, 8, 0, 1)
    every = [b[0].flatten().tolist() for b in plain.epoch(1, 0)]
    plain.skip = skips.Skips([(10, 11), (16, 16)]).covers  # epoch 1 holds steps 9-16
    kept = [b[0].flatten().tolist() for b in plain.epoch(1, 0)]
    assert kept == [every[0]] + every[3:7]
    sampler = loader.StepSampler(64, 0, 8, 0, 1)
    sampler.skip = plain.skip
    sampler.set_position(1, 0)
    assert [[i for _, i in b] for b in sampler] == [[int(v) for v in b] for b in kept] and len(sampler) == 5


def test_spikes_are_judged_after_the_warmup_against_a_robust_running_scale() -> None:
    state = spike.fresh()
    g = torch.Generator().manual_seed(0)
    noisy = (2.0 * torch.exp(-torch.arange(400) / 100) + 0.3 + 0.05 * torch.randn(400, generator=g)).tolist()
    assert not any(spike.observe(state, v, 10.0, 20, 50) for v in noisy), "a quiet, noisy loss is flagged"
    assert "deviations above its running mean" in spike.observe(state, 50.0, 10.0, 20, 50)
    assert spike.observe(state, float("nan"), 10.0, 20, 50) == ""  # the non-finite flag says so itself
    early = spike.fresh()
    assert not any(spike.observe(early, v, 10.0, 20, 50) for v in [1.0] * 5 + [1e6])  # inside the warm-up


def test_the_verdict_names_the_rank_whose_own_loss_differs_first() -> None:
    same = {"loss_at": None, "grad_at": None}
    assert replay.judge([same | {"rank": 0}, same | {"rank": 1}]) == (True, [], None)
    faulty = [{"rank": 0, "loss_at": 13, "grad_at": 12}, {"rank": 1, "loss_at": 12, "grad_at": 12}]
    assert replay.judge(faulty) == (False, [1], 12)
    exchange = [{"rank": 0, "loss_at": None, "grad_at": 7}, {"rank": 1, "loss_at": None, "grad_at": 7}]
    assert replay.judge(exchange) == (False, [0, 1], 7)
    # every rank of several named: nobody to blame (a nondeterministic kernel); one rank of one is to blame
    assert replay.nobody_to_blame([0, 1], 2) and not replay.nobody_to_blame([1], 2)
    assert not replay.nobody_to_blame([0], 1)


def test_traces_compare_bit_for_bit() -> None:
    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    a, b = replay.Trace(), replay.Trace()
    for step in (1, 2):
        a.add(step, torch.tensor(float(step)), model)
        b.add(step, torch.tensor(float(step) + (1e-6 if step == 2 else 0)), model)
    got = replay.compare(a, a.since(0))
    assert (got["loss_at"], got["grad_at"], got["steps"], got["first"] == got["replay"]) == (None, None, 2, True)
    got = replay.compare(a, b)
    assert (got["loss_at"], got["grad_at"], got["first"] == got["replay"]) == (2, None, False)


def test_the_record_of_rollbacks_and_skips_reads_back_and_refuses_a_foreign_line(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    assert record.read(paths) == (set(), [])
    record.append(paths, "rollback", step=9, to=5)
    record.append(paths, "skip", step=9, steps=[9, 9])
    record.append(paths, "skip", step=18, steps=[17, 18])
    assert record.read(paths) == ({9}, [(9, 9), (17, 18)])
    with open(paths.guard, "a") as f:
        f.write('{"event": "skip", "steps": [5')  # a writer killed mid-line: ignored
    assert record.read(paths) == ({9}, [(9, 9), (17, 18)])
    with open(paths.guard, "a") as f:
        f.write('\n{"event": "skip", "steps": "all"}\n')
    with pytest.raises(safefs.UnsafePath, match="guard.jsonl line"):
        record.read(paths)


def test_a_record_cut_by_a_kill_takes_the_next_line_on_a_line_of_its_own(tmp_path: Path) -> None:
    """A ``guard.jsonl`` whose last line a kill cut short once had the next record glued onto it: every later
    launch was refused (exit 2) and the rollback was lost from the record."""
    paths = RunPaths(tmp_path)
    record.append(paths, "rollback", step=9, to=5)
    with open(paths.guard, "a") as f:
        f.write('{"event": "skip", "steps": [9')  # the skip's line, cut by a kill
    record.append(paths, "rollback", step=18, to=12)  # the next launch's rollback
    lines = paths.guard.read_text().splitlines()
    assert len(lines) == 3 and lines[1] == '{"event": "skip", "steps": [9' and '"step": 18' in lines[2]
    assert record.read(paths) == ({9, 18}, [])


def test_a_checkpoint_whose_guard_state_is_not_one_is_refused() -> None:
    bad_samples = ({"samples": [[300]]}, {"samples": [[300, -1]]}, {"samples": "300"})
    for bad in ({"mean": 1.0}, spike.fresh() | {"skips": [[5, 3]]}, spike.fresh() | {"rollbacks": -1}, []):
        ok, _ = schema.OPTIONAL["guard"]
        assert not ok(bad), bad
    for bad in bad_samples:
        assert not schema.OPTIONAL["guard"][0](spike.fresh() | bad), bad
    assert schema.OPTIONAL["guard"][0](spike.fresh() | {"skips": [[9, 9]], "mean": 0.5, "seen": 3})
    assert schema.OPTIONAL["guard"][0](spike.fresh() | {"samples": [[300, 0]]})
    old = {k: v for k, v in spike.fresh().items() if k != "samples"}  # a checkpoint made before bad samples
    assert schema.OPTIONAL["guard"][0](old)


def test_a_bad_sample_is_left_out_of_its_batch_from_the_epoch_it_was_found_in() -> None:
    """The loader's rule (in memory and through a Dataset): sample 300 found in epoch 0 (at step 9) is trained
    in no later epoch; every other sample keeps its place; the culprit rule names it from per-sample losses."""
    from ddp_slurm.train.guard import culprits
    from ddp_slurm.train.task import Tensors

    data = Tensors(torch.arange(512))
    for world in (1, 2):
        seen: dict[int, list[list[int]]] = {}
        for rank in range(world):
            batches = loader.InMemory(data, torch.device("cpu"), 0, 32, rank, world)
            batches.drop = {300: 1}
            sampler = loader.StepSampler(512, 0, 32, rank, world)
            sampler.drop = {300: 1}
            for epoch in (0, 1):
                sampler.set_position(epoch, 0)
                got = [b[0].tolist() for b in batches.epoch(epoch, 0)]
                assert got == [[i for _, i in ids] for ids in sampler]  # both paths, the same batches
                seen.setdefault(epoch, []).extend(got)
        flat = {e: sum(b, []) for e, b in seen.items()}
        assert 300 in flat[0] and 300 not in flat[1] and len(flat[1]) == 511, world
    assert culprits.choose([(1, 0.5), (2, 0.4), (300, 5e5)], limit=2.0) == [300]
    assert culprits.choose([(1, 0.5), (2, float("nan"))], limit=None) == [2]
    assert culprits.choose([(1, 3.0), (2, 3.0), (3, 3.0)], limit=2.0) == []  # no few samples explain it


# -- whole runs ------------------------------------------------------------------------------------------


def rows(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def train(
    cwd: Path, nproc: int, *overrides: str, check: bool = True, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    launcher = Launcher(cwd)
    cmd = launcher.cmd_train(*overrides) if nproc == 1 else launcher.cmd_torchrun(nproc, *overrides)
    return launcher.run(cmd, check=check, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-rank guarded run through sample 300, hit at step 9 (epoch 1), named and left out of epoch 2 (its step
    18 trains without it: no second rollback); a CSV logger.
    It runs under DDP_SLURM_SYNC_DEBUG=error in a process that stands in for a GPU (``PoisonOnFakeGpu``: the
    same training, with the calls that wait for a GPU raising while the watch is on); its log is kept in
    ``poisoned.log``."""
    cwd = tmp_path_factory.mktemp("guard")
    write_poison_task(cwd, fake_sync_debug=True)
    res = train(
        cwd,
        1,
        *GUARDED,
        "task=poison_task.py:PoisonOnFakeGpu",
        "poison.ids=300",
        "log.csv=true",
        "run.name=poisoned",
        env=base_env(DDP_SLURM_SYNC_DEBUG="error"),
    )
    (cwd / "poisoned.log").write_text(res.stderr)
    return cwd


def test_rollbacks_and_verdicts_under_sync_debug_error_wait_only_with_the_watch_paused(poisoned: Path) -> None:
    """Two rollbacks, two verdicts and the log lines after them, with the watch on for the steady steps
    around them (from the 3rd step of the launch, and again 3 steps after each step gone back to): none
    raised a sync-debug error, and the watch says how many steps it watched."""
    log = (poisoned / "poisoned.log").read_text()
    assert "synchronizing CUDA operation" not in log and "Traceback" not in log, log[-3000:]
    [watched] = re.findall(r"DDP_SLURM_SYNC_DEBUG=error: (\d+) steady steps ran without a host sync", log)
    # 32 steps, 1 skipped, 4 replayed; watched from step 3 of the launch and of each pass after a move
    assert 20 <= int(watched) <= 32, log[-3000:]


def test_the_loggers_get_every_rollback_verdict_and_skip(poisoned: Path) -> None:
    with open(poisoned / "runs" / "poisoned" / "csv" / "events.csv", newline="") as f:
        kinds = [row["kind"] for row in csv.DictReader(f)]
    assert [k for k in kinds if k in ("rollback", "replay", "skip")] == ["rollback", "replay", "skip"], kinds


@pytest.mark.parametrize(("nproc", "strategy"), [(1, "ddp"), (2, "ddp"), (2, "fsdp")])
def test_bad_data_is_rolled_back_replayed_and_skipped_exactly(
    poisoned: Path, tmp_path: Path, nproc: int, strategy: str
) -> None:
    """Sample 300 lies in step 9's batch (epoch 1) and step 18's (epoch 2). One rollback (stumble: one bad sample
    once cost one rollback per epoch, named by its place in a shuffled order): the replay names sample 300 by
    dataset index in the log, the skip line, guard.jsonl and the checkpoint; epoch 2 trains without it. The run
    ends torch.equal to one told to skip step 9 and leave sample 300 out of epoch 2 from the start."""
    cwd = poisoned
    name = f"{nproc}-{strategy}"
    log = (cwd / "poisoned.log").read_text()
    if nproc > 1:
        log = train(cwd, nproc, *GUARDED, "poison.ids=300", f"dist.strategy={strategy}", f"run.name=p{name}").stderr
    run_dir = cwd / "runs" / ("poisoned" if nproc == 1 else f"p{name}")
    assert "the data of step 9 is bad: sample(s) 300 (dataset index), left out of every later epoch" in log
    by_hand = ("guard.skip=9", "guard.drop=300@1")  # step 9 skipped, sample 300 left out of epoch 2 on
    train(cwd, nproc, *GUARDED, *by_hand, f"dist.strategy={strategy}", f"run.name=r{name}")
    assert same_weights(run_dir, cwd / "runs" / f"r{name}")
    assert [(r["step"], r["to"], r["suspect"]) for r in rows(run_dir, "rollback")] == [(9, 5, [9, 9])]
    assert all("deviations above its running mean" in r["why"] for r in rows(run_dir, "rollback"))
    assert [(r["verdict"], r["first"] == r["replay"]) for r in rows(run_dir, "replay")] == [("reproduced", True)]
    skipped = [(r["steps"], r["samples"], r["bad_samples"]) for r in rows(run_dir, "skip")]
    assert skipped == [([9, 9], [256, 288], [[300, 0]])]
    assert record.read(RunPaths(run_dir)) == ({9}, [(9, 9)]) and record.bad_samples(RunPaths(run_dir)) == [[300, 0]]
    assert checkpoint.load_latest(run_dir)["guard"]["samples"] == [[300, 0]]
    assert not (run_dir / "lost_nodes").exists()
    assert rows(run_dir, "end"), "the run did not finish"


def test_a_fault_that_a_replay_does_not_reproduce_names_the_rank_and_skips_nothing(tmp_path: Path) -> None:
    write_poison_task(tmp_path)
    train(tmp_path, 2, *GUARDED, "poison.fault_rank=1", "poison.fault_call=12", "run.name=fault")
    train(tmp_path, 2, *GUARDED, "run.name=clean")
    run_dir = tmp_path / "runs" / "fault"
    [verdict] = rows(run_dir, "replay")
    assert (verdict["verdict"], verdict["ranks"], verdict["at"]) == ("not reproduced", [1], 12)
    assert not rows(run_dir, "skip") and record.read(RunPaths(run_dir)) == ({12}, [])
    [host] = verdict["hosts"]
    assert (run_dir / "lost_nodes").read_text().startswith(f"{host}\t")
    # the replay is sound: the run ends where one without the fault does
    assert same_weights(run_dir, tmp_path / "runs" / "clean")


def test_a_replay_that_differs_on_every_rank_blames_no_node(tmp_path: Path) -> None:
    """A nondeterministic backward (``poison.noise``: every rank's gradients vary from pass to pass, as
    atomics and cuDNN's weight gradients do on a GPU with train.deterministic off) at 2 ranks: every replay
    differs on both ranks, so no host goes to lost_nodes and each verdict says why, naming
    train.deterministic=true. The bad data at step 9 is flagged again by its replay: skipped. A one-shot
    fault of rank 1 (its 21st step: step 13) is not flagged again: training goes on from the replay."""
    write_poison_task(tmp_path)
    res = train(
        tmp_path,
        2,
        *GUARDED,
        "train.epochs=1",
        "poison.ids=300",
        "poison.noise=1e-3",
        "poison.fault_rank=1",
        "poison.fault_call=21",  # steps 1-10 (9 is flagged a step late), its replay 6-9, 6-8 and 10-13
        "run.name=nd",
        timeout=300,  # a replay judged again and again would roll back to step 9 for ever
    )
    run_dir = tmp_path / "runs" / "nd"
    assert [(r["step"], r["to"]) for r in rows(run_dir, "rollback")] == [(9, 5), (13, 10)]
    data, fault = rows(run_dir, "replay")
    assert (data["verdict"], data["exact"], data["first"] != data["replay"]) == ("reproduced", False, True)
    assert (fault["verdict"], fault["ranks"], fault["hosts"]) == (replay.NONDETERMINISTIC, [0, 1], [])
    assert [r["steps"] for r in rows(run_dir, "skip")] == [[9, 9]]
    assert not (run_dir / "lost_nodes").exists()
    assert res.stderr.count("set train.deterministic=true so that a replay can tell bad data from a fault") == 2
    assert "the replay did not reproduce step 13 on any rank" in res.stderr, res.stderr[-3000:]


def test_skipped_steps_outlive_the_launch_at_another_world_size(tmp_path: Path) -> None:
    """``ddp-slurm resume --step 5 --nproc-per-node 2``: back to step 5 (before both skips; its checkpoint
    predates them) and on at world size 2. guard.jsonl keeps both skips, so nothing is rolled back again,
    and the run ends as a run skipping them by hand does."""
    write_poison_task(tmp_path)
    for name, extra in (("poisoned", ["poison.ids=300"]), ("byhand", ["guard.skip=9", "guard.drop=300@1"])):
        train(tmp_path, 1, *GUARDED, *extra, "checkpoint.keep=100", f"run.name={name}")
        res = resume(tmp_path / "runs" / name, "--step", 5, "--nproc-per-node", 2)
        assert res.returncode == 0, res.stderr
    run_dir = tmp_path / "runs" / "poisoned"
    assert len(rows(run_dir, "rollback")) == 1, "a skipped step or a bad sample was trained again after the resume"
    assert rows(run_dir, "start")[-1]["world_size"] == 2
    assert same_weights(run_dir, tmp_path / "runs" / "byhand")


def test_a_stop_that_lands_just_before_the_spike_is_judged_first(tmp_path: Path) -> None:
    """SIGUSR2 during step 8: the vote says stop after step 8's flags, one step before step 9's spike is read.
    The spike is still judged before the stop's save: rolled back, nothing of step 9 saved; the relaunch
    rolls back again, skips step 9, and ends where the run left alone ends."""
    write_poison_task(tmp_path)
    stopped = train(tmp_path, 1, *GUARDED, "poison.ids=300", "poison.signal_call=8", "run.name=s", check=False)
    assert stopped.returncode == 75, stopped.stderr
    run_dir = tmp_path / "runs" / "s"
    assert [(r["step"], r["to"]) for r in rows(run_dir, "rollback")] == [(9, 5)]
    assert rows(run_dir, "stop")[-1]["step"] == 5 and not (run_dir / "checkpoints" / "step-9.pt").exists()
    train(tmp_path, 1, *GUARDED, "poison.ids=300", "poison.signal_call=8", "run.name=s")
    train(tmp_path, 1, *GUARDED, "poison.ids=300", "run.name=alone")
    assert same_weights(run_dir, tmp_path / "runs" / "alone")
    assert [r["steps"] for r in rows(run_dir, "skip")] == [[9, 9]]
    # step 9 flagged again by the relaunch is the same rollback: one in all, as in the run left alone
    assert [r["rollback"] for r in rows(run_dir, "rollback")] == [1, 1]


def test_one_flag_past_the_cap_ends_the_run_in_one_line(tmp_path: Path) -> None:
    write_poison_task(tmp_path)
    # two bad samples: 300 at step 9 and 110 at step 12 of the first epoch
    res = train(tmp_path, 1, *GUARDED, "guard.rollbacks=1", "poison.ids=300,110", "run.name=capped", check=False)
    assert res.returncode == 1, res.stderr
    assert "at step 12 (suspect: step 12): guard.rollbacks=1 used up; stopping" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_a_quiet_run_of_the_examples_is_never_flagged(tmp_path: Path) -> None:
    """The examples' full training with the guard on (its defaults): no rollback."""
    repo = Path(__file__).resolve().parents[1]
    launcher = Launcher(tmp_path)
    runs = {
        "mnist": launcher.popen(launcher.cmd_train("guard.rollbacks=3", "run.name=mnist")),
        "addition": launcher.popen(
            launcher.cmd_train(
                f"task={repo / 'examples' / 'addition' / 'task.py'}:Addition",
                "guard.rollbacks=3",
                "run.name=addition",
            )
        ),
    }
    for name, proc in runs.items():
        out, _ = proc.communicate(timeout=1200)
        assert proc.returncode == 0, out
        run_dir = tmp_path / "runs" / name
        assert rows(run_dir, "end") and not rows(run_dir, "rollback"), out


def test_skipped_steps_covering_the_whole_run_are_refused(tmp_path: Path) -> None:
    """A ``guard.skip`` covering every step once trained nothing and said "finished" with an untrained model:
    exit 2 and one line; covering all but one step trains that one."""
    import tasks_helpers

    tasks_helpers.write_line_task(tmp_path)
    launcher = Launcher(tmp_path)
    base = ["task=line_task.py:Line", *tasks_helpers.LINE_RUN, "train.max_steps=6"]
    every = launcher.run(launcher.cmd_train(*base, "guard.skip=1-3,4-100", "run.name=all"), timeout=300)
    assert every.returncode == 2, every.stderr
    [line] = [x for x in every.stderr.splitlines() if "cover every step" in x]
    assert "(1-100: guard.skip" in line and "1-6" in line and "narrow guard.skip" in line, line
    assert "finished" not in every.stderr and "Traceback" not in every.stderr, every.stderr
    one = launcher.run(launcher.cmd_train(*base, "guard.skip=1-5", "run.name=one"), timeout=300)
    assert one.returncode == 0, one.stderr
    assert skips.Skips([(1, 5)]).covers_all(1, 5) and not skips.Skips([(1, 5)]).covers_all(1, 6)


def test_the_guard_s_way_back_to_step_0_is_never_pruned(tmp_path: Path) -> None:
    """Step 0 (docs/guard.md: always kept) once went to ``checkpoint.keep`` when ``guard.suspect_steps`` reached
    past it, so the first spike ended the run with exit 1; it is spared beside the ``keep`` newest."""
    import tasks_helpers

    tasks_helpers.write_line_task(tmp_path)
    launcher = Launcher(tmp_path)
    res = launcher.run(
        launcher.cmd_train(
            "task=line_task.py:Line",
            *tasks_helpers.LINE_RUN,
            "guard.rollbacks=1",
            "guard.suspect_steps=50",
            "checkpoint.every_steps=4",
            "checkpoint.keep=1",
            "run.name=wide",
        ),
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    kept = sorted(p.name for p in (tmp_path / "runs" / "wide" / "checkpoints").iterdir())
    assert kept == ["step-0.pt", "step-24.pt"], kept
