"""Every command the README and docs/ show is run by a test (tests/docs_commands.py reads them).

- ```bash blocks are run here, in order, on a fresh copy of the repository with bash: the README's
  first (its later lines use what earlier ones made: `report` plots the runs trained above), then each
  page of docs/ (after writing the files a page asks the reader to write, such as `line.py`).
- ```sh blocks need what a plain test run here has not got: make's own install, internet, a Slurm
  cluster, a model's full training time. Each of their commands is in ``SHORTENED`` (run here as shown,
  with a few overrides appended so that it ends in seconds), ``CLAIMED`` (run by the named test, whose
  file must contain the given text) or ``NOT_OURS`` (a shell or Slurm viewing command, with why).

A command a page shows and no table names fails ``test_every_shown_command_has_a_test``, and so does
a table entry that no page shows any more.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, base_env, fresh_copy
from docs_commands import PAGES, Command, commands, files

from ddp_slurm.train import checkpoint

pytestmark = pytest.mark.slow

README = REPO / "README.md"

SHORTENED = {
    "python -m ddp_slurm.train --config examples/addition/addition.yaml": "train.max_steps=10",
    "python -m ddp_slurm.submit --config jobs/mnist.yaml --nodes 4 --gpus-per-node 4 --time 120 --partition gpu": (
        "--dry-run"
    ),
    "python -m ddp_slurm.submit --nodes 4 --dry-run": "",
    "python -m ddp_slurm.submit --cluster local --tasks-per-node 2 --wait": "model.name=mlp train.max_steps=10",
}
"""Shown in ```sh blocks, run here with these arguments appended."""

SBATCH = "tests/cluster/test_sbatch.py"
SUBMIT_CLUSTER = "tests/cluster/test_submit_cluster.py"
TASKS_CLUSTER = "tests/cluster/test_tasks_cluster.py"
WHEEL = "tests/cluster/test_wheel_cluster.py::test_wheel_init_then_sbatch"
CLAIMED = {
    "python -m ddp_slurm.train guard.rollbacks=3": (
        "tests/test_guard.py::test_a_quiet_run_of_the_examples_is_never_flagged",
        '"guard.rollbacks=3"',
    ),
    "make run": ("tests/test_docs.py::test_make_run", '"run"'),
    "make test": (".ci/run", "make test"),
    "make run TORCH=cpu": ("tests/test_docs.py::test_make_with_another_torch_build_redoes_the_install", '"TORCH=cpu"'),
    # no internet here: its failure (one line, exit 1) is what runs; a fetch needs a network
    "python -m ddp_slurm.data download --root data": (
        "tests/test_data.py::test_download_command_without_network",
        '"ddp_slurm.data", "download", "--root"',
    ),
    # the test cluster has no internet, hence no full MNIST: the jobs run the bundled sample
    "sbatch sbatch/mnist_4node.sh": (f"{SBATCH}::test_srun_script_4_nodes_cnn_accuracy", '"mnist_4node.sh"'),
    "ddp-slurm init myproject && cd myproject": (WHEEL, '"ddp-slurm", "init"'),
    "sbatch sbatch/mnist_4node.sh --config jobs/mnist_sample.yaml": (WHEEL, '"mnist_4node.sh"'),
    "sudo tests/cluster/cluster up": ("tests/cluster/conftest.py", '_cluster_cmd("up"'),
    "sinfo": ("tests/cluster/test_cluster.py::test_all_nodes_idle", '"sinfo"'),
    "sbatch --ntasks-per-node=1 --gpus-per-node=1 --cpus-per-task=1 sbatch/mnist_4node.sh "
    "--config jobs/mnist_sample.yaml model.name=mlp": (SBATCH, '"--ntasks-per-node=1"'),
    "scancel --signal=USR2 1": (f"{SBATCH}::test_scancel_usr2_reaches_torchrun_workers_and_requeues", "--signal=USR2"),
    "scontrol update JobId=1 StartTime=now": ("tests/cluster/conftest.py", "StartTime=now"),
    "sudo tests/cluster/cluster status": ("tests/cluster/conftest.py", '_cluster_cmd("status"'),
    "sudo tests/cluster/cluster down": ("tests/cluster/conftest.py", '_cluster_cmd("down"'),
    ".venv/bin/python -m pytest tests/test_faults.py tests/cluster/test_faults_cluster.py "
    "-o junit_family=legacy --junitxml=faults.xml": ("tests/run_suite.py", '"-m", "pytest"'),
    "srun -N2 --ntasks-per-node=1 python -m ddp_slurm.bench forecast --json f2.json": (
        "tests/cluster/test_forecast_cluster.py::test_forecast_measures_across_two_nodes_and_reports_once",
        '"forecast"',
    ),
    "srun -N1 -n1 python -m ddp_slurm.bench forecast --json f1.json": (
        "tests/cluster/test_forecast_cluster.py::test_forecast_measures_across_two_nodes_and_reports_once",
        '"forecast"',
    ),
    "python -m ddp_slurm.bench forecast --from f1.json,f2.json": ("tests/test_bench.py", '"--from"'),
    "python -m ddp_slurm.submit --nodes 2 --wait train.lr=1e-3": (SUBMIT_CLUSTER, '"--wait"'),
    "python -m ddp_slurm.submit --nodes 1 --name lr-sweep --sweep train.lr=1e-3,3e-3,1e-2 --wait": (
        f"{SUBMIT_CLUSTER}::test_sweep_of_three_is_a_job_array_with_three_run_directories",
        '"--sweep"',
    ),
    "python -m ddp_slurm.submit --summary runs/lr-sweep": (
        "tests/test_submit.py::test_local_sweep_makes_one_run_per_value_and_a_summary",
        '"--summary"',
    ),
    # my_project.tasks:Digits stands for the reader's task; the tests select theirs the same ways
    "python -m ddp_slurm.train task=my_project.tasks:Digits data.root=/scratch/digits": (
        "tests/test_tasks.py::test_minimal_task_trains_through_python_and_torchrun",
        "my_project.tasks:Line",
    ),
    "torchrun --standalone --nproc_per_node 2 -m ddp_slurm.train task=my_project.tasks:Digits": (
        "tests/test_tasks.py::test_minimal_task_trains_through_python_and_torchrun",
        "my_project.tasks:Line",
    ),
    "sbatch sbatch/mnist_4node.sh --config my_job.yaml": (TASKS_CLUSTER, '"--config"'),
    "sbatch sbatch/mnist_torchrun.sh --config my_job.yaml": (
        f"{TASKS_CLUSTER}::test_sbatch_torchrun_minimal_task",
        "mnist_torchrun.sh",
    ),
    "python -m ddp_slurm.submit --nodes 4 task=my_project.tasks:Digits": (
        f"{TASKS_CLUSTER}::test_submit_4_nodes_minimal_task_and_example",
        '"--nodes"',
    ),
    "DDP_SLURM_SYNC_DEBUG=error python -m ddp_slurm.train model.name=cnn train.epochs=2": (
        "tests/test_gpu_path.py::test_the_real_loop_never_synchronises_between_boundaries",
        "DDP_SLURM_SYNC_DEBUG",
    ),
    "python -m ddp_slurm.train model.name=cnn train.cuda_graphs=true": ("tests/test_gpu_path.py", "train.cuda_graphs"),
    "python -m ddp_slurm.bench overhead --device cuda --model cnn --batch 128 --json overhead.json": (
        "benchmarks/gpu_check.sh",
        "bench overhead --device cuda",
    ),
    "python -m ddp_slurm.bench overhead --device cuda --model cnn --batch 128 --cuda-graphs --json graphs.json": (
        "benchmarks/gpu_check.sh",
        "--cuda-graphs",
    ),
    "bash benchmarks/gpu_check.sh": ("tests/test_gpu_check.py", "gpu_check.sh"),
    "bash benchmarks/gpu_check.sh --dry-run": (
        "tests/test_gpu_check.py::test_the_script_parses_and_its_dry_run_lists_every_stage",
        '"--dry-run"',
    ),
    "python -m ddp_slurm.bench overhead --device cpu --model mlp --threads 1": (
        "tests/test_bench.py::test_overhead_smoke",
        '"overhead"',
    ),
    "python -m ddp_slurm.train run.name=short model.name=mlp train.max_steps=80": (
        "tests/test_warmstart.py::test_extending_a_finished_run_points_to_a_warm_start",
        "run.init_from=runs/base",
    ),
    "python -m ddp_slurm.train run.name=bad run.init_from=runs/short": (
        "tests/test_warmstart.py::test_another_model_is_refused_before_training",
        '"model.name=cnn"',
    ),
    "python -m ddp_slurm.report runs/lrsweep": (
        "tests/test_report_overlay.py::test_sweep_manifest_order",
        '"sweep"',
    ),
    "python -m ddp_slurm.report runs/a runs/b --output ab.png": (
        "tests/test_report_overlay.py::test_folder_of_runs_overlaid",
        '"--output"',
    ),
    # docs/scaling.md: fsdp, its benchmarks, accumulation (2 ranks and the full sample: their tests run them short)
    "torchrun --standalone --nproc_per_node 2 -m ddp_slurm.train dist.strategy=fsdp": (
        "tests/test_fsdp.py::test_sigusr2_resume_is_bit_identical_and_reshards_at_another_world_size",
        '"dist.strategy=fsdp"',
    ),
    "torchrun --standalone --nproc_per_node 1 -m ddp_slurm.train dist.strategy=fsdp run.name=big": (
        "tests/test_fsdp.py::test_sigusr2_resume_is_bit_identical_and_reshards_at_another_world_size",
        "from a sharded checkpoint of world size 2",
    ),
    "python -m ddp_slurm.bench memory --strategy ddp,fsdp --world 2 --json memory.json": (
        "tests/test_bench_memory.py::test_memory_fsdp_holds_a_share_of_the_model_state",
        '"memory", "--world", "2"',
    ),
    "python -m ddp_slurm.bench checkpoint --strategy fsdp --state-mb 64": (
        "tests/test_bench_memory.py::test_checkpoint_fsdp_smoke",
        '"--strategy", "fsdp"',
    ),
    "torchrun --standalone --nproc_per_node 2 -m ddp_slurm.train dist.strategy=fsdp train.activation_checkpoint=true": (
        "tests/test_activation_checkpoint.py::test_two_ranks_stop_and_resume_bit_identical_to_a_run_without_it",
        '"train.activation_checkpoint=true"',
    ),
    "python -m ddp_slurm.bench memory --world 2 --task examples/addition/task.py:Addition --batch 128": (
        "tests/test_bench_memory.py::test_memory_measures_a_tasks_activations",
        "activations.task_model(ADDITION",
    ),
    "torchrun --standalone --nproc_per_node 2 -m ddp_slurm.train train.accumulate=4 train.grad_clip=1.0": (
        "tests/test_accumulate.py::test_accumulate_trains_as_well_resumes_exactly_and_logs_the_norm",
        '"train.accumulate=4", "train.grad_clip=5.0"',
    ),
}
"""Shown in ```sh blocks and run by another test: ``(test, text its file contains)``."""

NOT_OURS = {
    "source .venv/bin/activate": "the shell's; the tests put the environment's bin/ first on PATH, as it does",
    "tail -f mnist-4node-<jobid>.out": "viewing a log",
    "tail -f mnist-4node-123456.out": "viewing a log",
    "export SLURM_CONF=/var/lib/ddp-slurm-testcluster/slurm.conf": "the shell's; the cluster fixture sets it",
    "squeue; tail -f mnist-4node-1.out": "viewing the queue and a log",
}
"""Shown in ```sh blocks, not the project's commands."""


def run_block(command: Command, root: Path, env: dict[str, str], extra: str = "") -> None:
    """Run one command as shown (plus ``extra``) in ``root``; check its exit status and quoted texts."""
    line = f"{command.text} {extra}".strip()
    res = subprocess.run(["bash", "-c", line], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    said = res.stdout + res.stderr
    where = f"`{line}` ({command.page})"
    assert res.returncode == command.code, (
        f"{where} exited {res.returncode}, the page says {command.code}\n{said[-3000:]}"
    )
    for text in command.quoted:
        assert text in said, f"{where}: the page quotes {text!r}, the output does not say it\n{said[-3000:]}"
    if command.code == 2:
        assert res.stderr.count("\n") == 1, f"{where}: a usage error is one line\n{res.stderr}"


def user_env(root: Path) -> dict[str, str]:
    """`python` and `torchrun` are this environment's; the package is the fresh copy's."""
    return base_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(root))


def test_the_readme_parses() -> None:
    cmds = [c for c in commands(README) if c.lang == "bash"]
    assert len(cmds) >= 8, cmds
    assert Command("python -m ddp_slurm.train train.epochz=3", "README.md", "bash", 2) in cmds
    assert sum(1 for line in README.read_text().splitlines()) <= 200


def test_the_readme_is_at_most_150_lines() -> None:
    """The README is the newcomer's path (what it is, the two make commands, the first local run, the first
    cluster job, where to look when it fails); the detail lives in docs/."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines: move detail into docs/"


def test_readme_commands_in_order(tmp_path: Path) -> None:
    root = fresh_copy(tmp_path / "repo")
    env = user_env(root)
    for command in commands(README):
        if command.lang == "bash":
            run_block(command, root, env)
    assert (root / "runs" / "report.png").is_file() and (root / "runs" / "lrs" / "report.png").is_file()


def test_docs_commands_in_order(tmp_path: Path) -> None:
    root = fresh_copy(tmp_path / "repo")
    env = user_env(root)
    ran = []
    for page in PAGES[1:]:
        for name, source in files(page).items():
            (root / name).write_text(source)
        for command in commands(page):
            if command.lang == "bash":
                run_block(command, root, env)
                ran.append(command.text)
    assert any("--print-config" in c for c in ran) and any("task=line.py:Line" in c for c in ran), ran
    line = checkpoint.load_latest(root / "runs" / "line")  # docs/tasks.md's example learned its line
    assert line is not None and line["finished"] and abs(line["model"]["weight"].item() - 3) < 0.3


def test_shortened_commands(tmp_path: Path) -> None:
    root = fresh_copy(tmp_path / "repo")
    env = user_env(root)
    shown = {c.text: c for page in PAGES for c in commands(page) if c.lang == "sh"}
    for text, extra in SHORTENED.items():
        run_block(shown[text], root, env, extra)
    assert checkpoint.load_latest(root / "runs" / "addition")["step"] == 10


def test_make_run(tmp_path: Path) -> None:
    """`make run` on a fresh copy, with this environment as its .venv (`make test` runs the install
    recipe itself; -o keeps make from redoing it here)."""
    root = fresh_copy(tmp_path / "repo")
    (root / ".venv").symlink_to(Path(sys.prefix))
    res = subprocess.run(
        ["make", "-o", ".venv/.installed", "run", "RUN_NAME=made"],
        cwd=root,
        env=user_env(root),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "run directory: runs/made" in res.stdout, res.stdout
    state = checkpoint.load_latest(root / "runs" / "made")
    assert state is not None and state["finished"] and state["world_size"] == 2


def test_make_run_installs_no_test_tools_and_torch_cpu_takes_the_cpu_build(tmp_path: Path) -> None:
    """What `make run` would install on a fresh copy (make -n: the recipes, not run): the package alone;
    `make test` adds the test extra; TORCH=cpu points pip at torch's CPU wheels for both."""

    def recipe(*args: str) -> str:
        res = subprocess.run(["make", "-n", *args], cwd=root, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr
        return res.stdout

    root = fresh_copy(tmp_path / "repo")
    run = " ".join(recipe("run").split(" "))
    assert re.search(r"pip install -q +-e \.\n", run) and "[test]" not in run and "download.pytorch.org" not in run
    assert "ddp_slurm.launch --standalone --nproc_per_node 2" in run
    assert re.search(r"python -m ddp_slurm.tools.torchbuild *\n", run)  # which build got installed, said last
    test = recipe("test")
    assert "-e '.[test]'" in test and "tests/run_suite.py" in test  # pytest twice, side by side
    cpu = recipe("run", "TORCH=cpu")
    # the CPU index is probed (fails at once where blocked), then asked for torch and torchvision alone
    probe = "python -m ddp_slurm.tools.torchbuild --reach https://download.pytorch.org/whl/cpu/torch/\n"
    alone = 'pip install -q --index-url https://download.pytorch.org/whl/cpu --upgrade "torch>=2.9,<2.15" "torchvision>=0.24,<0.30"\n'
    assert cpu.index(probe) < cpu.index(alone) < cpu.index("pip install -q -e .\n"), cpu
    assert "python -m ddp_slurm.tools.torchbuild cpu\n" in cpu and "extra-index-url" not in cpu


FAKE_TOOL = '#!/bin/sh\necho "$0 $*" >> "$(dirname "$0")/../calls"\n'
"""A stand-in for .venv/bin/python and pip: it notes how it was called, and does nothing."""


def test_make_clean_keeps_what_was_trained(tmp_path: Path) -> None:
    """`make clean` removes the environment only: runs/ (checkpoints, metrics) and data/ stay."""
    root = fresh_copy(tmp_path / "repo")
    for made in ("runs/first/checkpoints/step-10.pt", "runs/first/metrics.jsonl", "data/MNIST/raw/x", ".venv/x"):
        (root / made).parent.mkdir(parents=True, exist_ok=True)
        (root / made).write_text("mine")
    res = subprocess.run(["make", "clean"], cwd=root, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert not (root / ".venv").exists()
    assert (root / "runs/first/checkpoints/step-10.pt").read_text() == "mine"
    assert (root / "runs/first/metrics.jsonl").is_file() and (root / "data/MNIST/raw/x").is_file()


def test_make_with_another_torch_build_redoes_the_install(tmp_path: Path) -> None:
    """A .venv installed with PyPI's torch, then `make run TORCH=cpu`: the install runs again (naming torch
    for an upgrade, since an installed torch satisfies pip) and says which build it got; the same choice
    again installs nothing; back to the default, it runs again."""
    root = fresh_copy(tmp_path / "repo")
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for tool in ("python", "pip"):
        (bin_dir / tool).write_text(FAKE_TOOL)
        (bin_dir / tool).chmod(0o755)
    calls = root / ".venv" / "calls"

    def make(*args: str) -> str:
        calls.unlink(missing_ok=True)
        res = subprocess.run(["make", *args, ".venv/.installed"], cwd=root, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr
        return calls.read_text() if calls.exists() else ""

    assert "pip install -q" in make()  # the first install, PyPI's torch
    assert make() == ""  # up to date
    cpu = make("TORCH=cpu")
    assert (
        "--index-url https://download.pytorch.org/whl/cpu --upgrade torch>=2.9,<2.15 torchvision>=0.24,<0.30" in cpu
    ), cpu
    assert "python -m ddp_slurm.tools.torchbuild cpu" in cpu
    assert make("TORCH=cpu") == ""
    assert "python -m ddp_slurm.tools.torchbuild\n" in make()


def defines(path: Path, name: str) -> bool:
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in ast.walk(ast.parse(path.read_text())))


def test_every_shown_command_has_a_test() -> None:
    shown = {c.text for page in PAGES for c in commands(page) if c.lang == "sh"}
    tables = [set(SHORTENED), set(CLAIMED), set(NOT_OURS)]
    assert not set.intersection(*tables[:2]) and not tables[1] & tables[2] and not tables[0] & tables[2]
    missing = shown - set.union(*tables)
    assert not missing, f"shown in a ```sh block, run by no test (add it to a table of {__file__}): {missing}"
    stale = set.union(*tables) - shown
    assert not stale, f"in a table here, shown on no page any more: {stale}"
    for command, (test, text) in CLAIMED.items():
        file, _, name = test.partition("::")
        assert (REPO / file).is_file(), f"{command!r}: {file} does not exist"
        assert not name or defines(REPO / file, name), f"{command!r}: {file} defines no {name}"
        assert text in (REPO / file).read_text(), f"{command!r}: {file} does not say {text!r}"


# A repository path as the pages write it: a top-level folder of this repository, then a path. Not one
# inside another path (``~/ddp_slurm/sbatch/...``, ``/home/me/ddp_slurm/runs``: the reader's copy) and
# not a pattern (``tests/test_<module>.py``, ``jobs/*.yaml``).
TOP = ("ddp_slurm", "tests", "docs", "jobs", "sbatch", "benchmarks", "examples", ".ci")
NAMED_PATH = re.compile(rf"(?<![\w/.~<-])((?:{'|'.join(map(re.escape, TOP))})/[\w./-]*[\w/])(?![\w<*{{]|\.\w)")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def named_paths(text: str, folder: Path) -> set[str]:
    """Every repository path a page's ``text`` names: in the text (from the repository root) and in its
    links (from the page's ``folder``)."""
    found = set(NAMED_PATH.findall(text))
    for target in LINK.findall(text):
        if not re.match(r"[a-z]+:", target):  # not https: or mailto:
            found.add(os.path.relpath(os.path.normpath(folder / target), REPO))
    return found


def test_named_paths_finds_what_a_page_names() -> None:
    text = (
        "See `ddp_slurm/train/loop.py`, [faults](faults.md), [top](../README.md#x), tests/test_x.py. "
        "Not ~/ddp_slurm/sbatch/a.sh, /home/me/ddp_slurm/runs/m, tests/test_<module>.py, jobs/*.yaml "
        "or [a site](https://example.org/docs/x.md)."
    )
    found = named_paths(text, REPO / "docs")
    assert found == {"ddp_slurm/train/loop.py", "docs/faults.md", "README.md", "tests/test_x.py"}


def test_every_path_a_page_names_exists() -> None:
    missing = [
        f"{page.relative_to(REPO)}: {path}"
        for page in PAGES
        for path in sorted(named_paths(page.read_text(), page.parent))
        if not (REPO / path).exists()
    ]
    assert not missing, f"pages name paths that do not exist (moved or renamed?): {missing}"


def test_tasks_page_lists_every_reserved_section_name() -> None:
    """docs/tasks.md names the sections a task's Config may not reuse: all of them (`log` was missing)."""
    from ddp_slurm.config.schema import RUNTIME_SECTIONS

    text = " ".join((REPO / "docs" / "tasks.md").read_text().split())
    listed = re.search(r"validated exactly like the runtime's \(([^)]*)\)", text)
    assert listed, "docs/tasks.md no longer says which section names are the runtime's"
    assert set(re.findall(r"`(\w+)`", listed.group(1))) == {*RUNTIME_SECTIONS, "task"}
