"""The bad-input table of tests/test_faults.py (section 6), beyond its first cases: what a careless user
or a hostile co-tenant types or leaves around. Each must be answered with exit 2, one line on stderr,
nothing on stdout and nothing created.

Config-only cases go through ``python -m ddp_slurm.submit --dry-run`` (the same ``config.load``, and
no torch import: the table stays quick); launcher-variable cases through ``python -m ddp_slurm.train``.
"""

from __future__ import annotations

from dataclasses import dataclass

FIFO = b"<fifo>"  # a file entry with this content is made as a named pipe
DIR = b"<dir>"  # ... as a directory
LINK = b"<link>"  # ... as a symlink to victim.txt (another user's file) in the working directory


@dataclass(frozen=True)
class Bad:
    """A command line that must be refused: exit 2, one line on stderr, nothing started or created."""

    argv: tuple[str, ...]
    says: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    file: str | None = None  # written to job.yaml in the working directory first
    module: str = "ddp_slurm.train"
    files: tuple[tuple[str, bytes], ...] = ()  # more files (relative path, content, FIFO, DIR or LINK) made first
    modes: tuple[tuple[str, int], ...] = ()  # then chmod (relative path, mode)
    after_start: bool = False  # found once the ranks are up (the run directory): one ERROR line among the logs


def dry(*argv: str, says: tuple[str, ...], file: str | None = None, files: tuple = ()) -> Bad:
    return Bad(("--dry-run", *argv), says, file=file, module="ddp_slurm.submit", files=files)


def report(*argv: str, says: tuple[str, ...], metrics: bytes | None = None, files: tuple = ()) -> Bad:
    made = ((("run/metrics.jsonl", metrics),) if metrics is not None else ()) + tuple(files)
    return Bad(argv, says, module="ddp_slurm.report", files=made)


START = b'{"kind": "start", "step": 0, "epoch": 0, "time_s": 0.0}\n'
SRUN = (
    ("SLURM_JOB_ID", "77"),
    ("SLURM_STEP_ID", "0"),
    ("SLURM_PROCID", "0"),
    ("SLURM_LOCALID", "0"),
    ("SLURM_NODEID", "0"),
    ("SLURM_NTASKS", "2"),
    ("SLURM_NNODES", "2"),
    ("SLURM_TASKS_PER_NODE", "1(x2)"),
    ("SLURM_JOB_NODELIST", "n[1-2]"),
)
TORCHRUN = (
    ("RANK", "0"),
    ("WORLD_SIZE", "2"),
    ("LOCAL_RANK", "0"),
    ("LOCAL_WORLD_SIZE", "2"),
    ("MASTER_PORT", "29400"),
)


def _srun(**changed: str) -> tuple[tuple[str, str], ...]:
    return tuple((k, changed.pop(k, v)) for k, v in SRUN) + tuple(changed.items())


def _torchrun(**changed: str) -> tuple[tuple[str, str], ...]:
    return tuple((k, changed.pop(k, v)) for k, v in TORCHRUN) + tuple(changed.items())


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi")
)
CASES: dict[str, Bad] = {}

# --- numbers that are not finite, or overflow what they feed (torch, timedelta, Slurm)
for key in ("train.lr", "train.weight_decay", "train.log_every_s", "dist.timeout_s"):
    for label, value in (("inf", ".inf"), ("minus-inf", "-.inf"), ("nan", ".nan"), ("1e400", "1e400")):
        CASES[f"{key}-{label}"] = dry(f"{key}={value}", says=(key, "a number (finite)"))
for key in ("train.epochs", "train.global_batch_size", "train.max_steps", "checkpoint.every_steps", "checkpoint.keep"):
    CASES[f"{key}-huge"] = dry(f"{key}={10**30}", says=(key, "an integer"))
CASES["seed-huge"] = dry("run.seed=18446744073709551616", says=("run.seed", "an integer"))
CASES["seed-2-to-the-40"] = dry(f"run.seed={2**40}", says=("run.seed", "0 to 4294967295"))
CASES["seed-negative"] = dry("run.seed=-1", says=("run.seed", "0 to 4294967295"))
CASES["timeout-1e300"] = dry("dist.timeout_s=1e300", says=("dist.timeout_s", "<= 10000000"))
CASES["time-zero"] = dry("--time", "0", says=("--time",))
CASES["signal-delay-huge"] = dry("slurm.signal_delay_s=99999999999", says=("slurm.signal_delay_s",))
CASES["lr-nan-in-file"] = dry(
    "--config", "job.yaml", says=("train.lr in", "job.yaml", "finite"), file="train:\n  lr: .nan\n"
)
CASES["timeout-inf-in-file"] = dry(
    "--config", "job.yaml", says=("dist.timeout_s", "job.yaml"), file="dist:\n  timeout_s: .inf\n"
)
CASES["seed-huge-in-file"] = dry(
    "--config", "job.yaml", says=("run.seed", "job.yaml"), file=f"run:\n  seed: {10**40}\n"
)

# --- control characters and unsafe names: they reach the job script and file names
for key in ("slurm.partition", "slurm.account", "slurm.qos", "slurm.constraint", "run.name", "run.output_root"):
    # YAML double-quoted escapes: a raw newline in a plain scalar would be folded into a space
    for label, char in (("newline", "\\n"), ("carriage-return", "\\r"), ("escape", "\\e"), ("tab", "\\t")):
        CASES[f"{key}-{label}"] = dry(f'{key}="gpu{char}echo pwned"', says=(key, "without control characters"))
for flag in ("--partition", "--account", "--qos", "--constraint", "--name"):
    CASES[f"flag{flag}-newline"] = dry(flag, "x\n#SBATCH --time=99999", says=("without control characters",))
for label, char in (("newline", "\n"), ("carriage-return", "\r"), ("escape", "\x1b"), ("tab", "\t")):
    CASES[f"sbatch-option-{label}"] = dry(
        "--sbatch", f"mail-type=END{char}#SBATCH --time=99999", says=("--sbatch", "holds control characters")
    )
CASES["setup-line-newline"] = dry("--setup", "module load x\nrm -rf ~", says=("--setup", "holds control characters"))
for label, name in (
    ("space", "a b"),
    ("semicolon", "a;touch x"),
    ("dollar", "$(id)"),
    ("backtick", "`id`"),
    ("dotdot", ".."),
    ("dot-start", ".hidden"),
    ("dash-start", "-rf"),
    ("star", "run*"),
    ("quote", "it's"),
    ("too-long", "r" * 201),
    ("slash", "a/b"),
    ("unicode", "rün"),
):
    CASES[f"run-name-{label}"] = dry(f"--name={name}", says=("run.name", "letters, digits"))
for key, value in (("slurm.partition", "a b"), ("slurm.account", "acct;id"), ("slurm.qos", "$(id)")):
    CASES[f"{key}-shell"] = dry(f"{key}={value}", says=(key, "a Slurm name"))
CASES["constraint-shell"] = dry("slurm.constraint=a;id", says=("slurm.constraint", "a Slurm constraint"))
CASES["name-newline-in-file"] = dry(
    "--config", "job.yaml", says=("run.name", "job.yaml", "control characters"), file='run:\n  name: "a\\nb"\n'
)
CASES["partition-newline-in-file"] = dry(
    "--config",
    "job.yaml",
    says=("slurm.partition", "job.yaml"),
    file='slurm:\n  partition: "gpu\\n#SBATCH --requeue"\n',
)

# --- config files that are not small UTF-8 YAML mappings
CASES["alias-bomb"] = dry("--config", "job.yaml", says=("job.yaml", "section 'a'"), file=BOMB)
CASES["alias-bomb-as-value"] = dry(
    "--config",
    "job.yaml",
    says=("train.lr in", "a number"),
    file="".join(f"# {line}\n" for line in BOMB.splitlines())
    + "train:\n  lr: &a [x, x, x, x, x, x, x, x, x]\n  weight_decay: [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n",
)
CASES["deep-alias-bomb-in-key"] = dry("--config", "job.yaml", says=("job.yaml",), file=BOMB + "train:\n  lr: *i\n")
CASES["duplicate-key"] = dry(
    "--config", "job.yaml", says=("'lr' appears twice", "line 3"), file="train:\n  lr: 0.1\n  lr: 0.2\n"
)
CASES["duplicate-section"] = dry(
    "--config", "job.yaml", says=("'train' appears twice",), file="train:\n  lr: 0.1\ntrain:\n  epochs: 2\n"
)
CASES["fifo-config"] = dry("--config", "pipe.yaml", says=("FIFO",), files=(("pipe.yaml", FIFO),))
CASES["dev-zero-config"] = dry("--config", "/dev/zero", says=("/dev/zero", "not a plain file"))
CASES["dev-urandom-config"] = dry("--config", "/dev/urandom", says=("not a plain file",))
CASES["dev-stdin-config"] = dry("--config", "/dev/stdin", says=("not a plain file",))
CASES["latin1-config"] = dry(
    "--config", "job.yaml", says=("not UTF-8",), files=(("job.yaml", "run:\n  name: caf\xe9\n".encode("latin-1")),)
)
CASES["binary-config"] = dry("--config", "job.yaml", says=("not UTF-8",), files=(("job.yaml", bytes(range(256))),))
CASES["nul-in-config"] = dry("--config", "job.yaml", says=("not valid YAML",), files=(("job.yaml", b"train:\0\n"),))
CASES["huge-config"] = dry(
    "--config", "job.yaml", says=("larger than 1048576 bytes",), files=(("job.yaml", b"# x\n" * 300_000),)
)
CASES["deep-nesting"] = dry("--config", "job.yaml", says=("job.yaml",), file="train: " + "[" * 50_000 + "]" * 50_000)
CASES["scalar-config"] = dry("--config", "job.yaml", says=("expected a mapping of sections",), file="42\n")
CASES["string-config"] = dry("--config", "job.yaml", says=("expected a mapping of sections",), file="hello\n")
CASES["list-value"] = dry("--config", "job.yaml", says=("train.lr in", "a number"), file="train:\n  lr: [0.1, 0.2]\n")
CASES["mapping-value"] = dry(
    "--config", "job.yaml", says=("train.epochs in", "an integer"), file="train:\n  epochs: {a: 1}\n"
)
CASES["null-section"] = dry("--config", "job.yaml", says=("section 'train'", "mapping"), file="train:\n")
CASES["numeric-section"] = dry("--config", "job.yaml", says=("unknown config section '1'",), file="1:\n  a: 2\n")
CASES["unhashable-key"] = dry("--config", "job.yaml", says=("job.yaml",), file="train:\n  ? [a, b]\n  : 1\n")
CASES["tabs-indent"] = dry("--config", "job.yaml", says=("not valid YAML",), file="train:\n\tlr: 0.1\n")
CASES["python-tag"] = dry(
    "--config", "job.yaml", says=("not valid YAML",), file="train:\n  lr: !!python/object/apply:os.system [id]\n"
)
CASES["bool-for-int"] = dry(
    "--config", "job.yaml", says=("train.epochs in", "an integer"), file="train:\n  epochs: yes\n"
)
CASES["override-alias"] = dry("train.lr=*a", says=("bad override", "not a YAML scalar"))
CASES["override-list"] = dry("train.lr=[1, 2]", says=("bad override", "scalar"))
CASES["override-mapping"] = dry("train.lr={a: 1}", says=("bad override", "scalar"))
CASES["override-tag"] = dry("train.lr=!!python/name:os.system", says=("bad override", "not a YAML scalar"))

# --- a run directory holding a damaged or foreign config.yaml (what a resume reads first)
for label, content in (
    ("empty", b""),
    ("a-list", b"- 1\n- 2\n"),
    ("garbage", b"\x00\x01\x02 not yaml"),
    ("truncated", b"run:\n  name: mnist-sample\ntrain:\n  lr: [\n"),
    ("invalid-value", b"train:\n  epochs: -5\n"),
    ("unknown-key", b"train:\n  lrr: 0.1\n"),
    ("a-directory", DIR),
    ("a-fifo", FIFO),
    ("a-scalar", b"3\n"),
):
    CASES[f"run-dir-config-{label}"] = dry(
        "--name=mnist-sample",
        says=("runs/mnist-sample/config.yaml", "damaged", "move the run directory away"),
        files=(("runs/mnist-sample/config.yaml", content),),
    )

# --- launcher variables
for label, nodelist in (
    ("product-huge", "n[0-9999][0-9999]"),
    ("range-huge", "n[0-99999999]"),
    ("many-names-huge", ",".join(f"m{i}[0-9999]" for i in range(10))),
    ("unclosed", "n[1-2"),
    ("stray-close", "n]1"),
    ("empty", ","),
    ("text-after", "n[1-2]x"),
    ("reverse", "n[9-1]"),
):
    CASES[f"nodelist-{label}"] = Bad((), ("Slurm host list",), env=_srun(SLURM_JOB_NODELIST=nodelist))
CASES["tasks-per-node-huge"] = Bad(
    (), ("SLURM_TASKS_PER_NODE", "more than"), env=_srun(SLURM_TASKS_PER_NODE="1(x999999999999)")
)
CASES["tasks-per-node-garbage"] = Bad((), ("SLURM_TASKS_PER_NODE",), env=_srun(SLURM_TASKS_PER_NODE="two"))
for var, value in (
    ("RANK", "abc"),
    ("RANK", "-1"),
    ("RANK", "99999999999999999999"),
    ("WORLD_SIZE", "0"),
    ("WORLD_SIZE", "1e3"),
    ("LOCAL_RANK", "x"),
    ("LOCAL_WORLD_SIZE", "0"),
    ("MASTER_PORT", "0"),
    ("MASTER_PORT", "http"),
    ("MASTER_PORT", "99999999999999999999"),
):
    CASES[f"torchrun-{var}-{value[:12]}"] = Bad((), (var,), env=_torchrun(**{var: value}))
for var, value in (("SLURM_PROCID", "x"), ("SLURM_NTASKS", "-2"), ("SLURM_PROCID", "5"), ("SLURM_NNODES", "1e9")):
    CASES[f"srun-{var}-{value}"] = Bad((), (var,), env=_srun(**{var: value}))

# --- submit options that contradict each other
CASES["signal-delay-beyond-time"] = dry(
    "--time", "1", "--signal-delay", "600", says=("--signal-delay 600 s", "--time 1 (1 min)")
)
CASES["signal-delay-equals-time"] = dry("--time", "2", "--signal-delay", "120", says=("--signal-delay 120 s",))
CASES["signal-delay-negative"] = dry("--signal-delay", "-1", says=("--signal-delay",))

# --- report on metrics that this program did not write, or output it cannot write
REPORT_BAD_LINES = {
    "list-line": b"[1, 2, 3]\n",
    "number-line": b"42\n",
    "string-line": b'"hello"\n',
    "null-line": b"null\n",
    "step-string": b'{"kind": "train", "step": "7", "epoch": 0, "time_s": 1.0}\n',
    "step-bool": b'{"kind": "train", "step": true, "epoch": 0, "time_s": 1.0}\n',
    "kind-number": b'{"kind": 3, "step": 1, "epoch": 0, "time_s": 1.0}\n',
    "loss-string": b'{"kind": "train", "step": 1, "epoch": 0, "time_s": 1.0, "loss": "low"}\n',
    "accuracy-list": b'{"kind": "eval", "step": 1, "epoch": 0, "time_s": 1.0, "accuracy": [1]}\n',
    "time-object": b'{"kind": "train", "step": 1, "epoch": 0, "time_s": {"s": 1}, "loss": 1.0}\n',
    "world-size-float": b'{"kind": "start", "step": 0, "epoch": 0, "time_s": 0.0, "world_size": 2.5}\n',
}
for label, line in REPORT_BAD_LINES.items():
    CASES[f"report-{label}"] = report("run", says=("metrics.jsonl line 2",), metrics=START + line)
CASES["report-output-missing-dir"] = report(
    "run", "--output", "nowhere/r.png", says=("cannot write nowhere/r.png",), metrics=START
)
CASES["report-output-in-proc"] = report(
    "run", "--output", "/proc/report.png", says=("cannot write /proc/report.png",), metrics=START
)
CASES["report-output-is-dir"] = report(
    "run", "--output", "out", says=("cannot write out",), metrics=START, files=(("out", DIR),)
)
CASES["report-metrics-fifo"] = report("run", says=("metrics.jsonl",), files=(("run/metrics.jsonl", FIFO),))
CASES["report-metrics-dir"] = report("run", says=("metrics.jsonl",), files=(("run/metrics.jsonl", DIR),))
CASES["report-no-run"] = report("missing", says=("metrics.jsonl does not exist",))

# --- a run directory with files a co-tenant or a damaged copy left: the real training entry point
RUN = ("run.name=r", "model.name=mlp", "train.max_steps=2")
JUNK = ("runs/r/checkpoints/step-10.pt", b"not a checkpoint")  # a checkpoint name makes a resume read config.yaml
for label, content in (
    ("empty", b""),
    ("a-list", b"- 1\n"),
    ("garbage", b"\x00\x01"),
    ("a-directory", DIR),
    ("a-fifo", FIFO),
):
    CASES[f"train-run-dir-config-{label}"] = Bad(
        RUN, ("runs/r/config.yaml", "damaged"), files=(("runs/r/config.yaml", content), JUNK), after_start=True
    )
for label, path in (("run-dir", "runs/r"), ("checkpoints", "runs/r/checkpoints"), ("checkpoint", JUNK[0])):
    CASES[f"train-group-writable-{label}"] = Bad(
        RUN,
        (f"refusing to resume from {path}", "writable by the group", "run.shared=true"),
        files=(JUNK,),
        modes=((path, 0o775 if path != JUNK[0] else 0o664),),
        after_start=True,
    )
CASES["train-world-writable-shared-run"] = Bad(
    (*RUN, "run.shared=true"),
    ("refusing to resume from runs/r", "writable by every user"),
    files=(JUNK,),
    modes=(("runs/r", 0o777),),
    after_start=True,
)
for label, path in (
    ("lock", "runs/r/.lock"),
    ("checkpoints", "runs/r/checkpoints"),
    ("config", "runs/r/config.yaml"),
    ("metrics", "runs/r/metrics.jsonl"),
):
    CASES[f"train-symlink-{label}"] = Bad(
        RUN, (path, "symlink"), files=(("runs/r/x", b""), (path, LINK)), after_start=True
    )

# train.cuda_graphs where it cannot hold, found before the ranks start (train/graphs.py: check)
CASES["cuda-graphs-on-cpu"] = Bad(("train.cuda_graphs=true",), ("train.cuda_graphs=true needs a CUDA GPU",))

# --- the tools' flags (bench, doctor): every number finite and bounded by what the machine can run or
# hold, every output path writable, each checked before anything starts (ddp_slurm/argtypes.py)


def bench(*argv: str, says: tuple[str, ...], files: tuple = ()) -> Bad:
    return Bad(argv, says, module="ddp_slurm.bench", files=files)


def doctor(*argv: str, says: tuple[str, ...]) -> Bad:
    return Bad(argv, says, module="ddp_slurm.doctor")


FORECAST = (  # a forecast JSON as the command writes it, but for its compute time
    b'{"measured": {"world_size": 2, "nodes": 2, "ranks_per_node": 1, "batch_per_rank": 128, "grad_bytes": 4096, '
    b'"forward_s": 0.001, "model": "mlp", "backend": "gloo", "device": "cpu", "alpha_s": 1e-05, '
    b'"beta_s_per_byte": 1e-09, "buckets": [4096], "measured_step_s": null, '
)
SAVED_FORECAST = FORECAST + b'"compute_s": 0.002}}'
# "--flag=-inf": as two words argparse would take -inf for an option
NOT_FINITE = (("nan", "nan"), ("inf", "inf"), ("minus-inf", "-inf"), ("1e400", "1e400"))
for label, value in (*NOT_FINITE, ("negative", "-1"), ("zero", "0"), ("huge", "1e12")):
    CASES[f"bench-checkpoint-state-mb-{label}"] = bench(
        "checkpoint", f"--state-mb={value}", says=("--state-mb", f"got '{value}'", "available memory")
    )
for label, value in (*NOT_FINITE, ("negative", "-5"), ("zero", "0"), ("huge", "1e30")):
    CASES[f"doctor-timeout-{label}"] = doctor(f"--timeout={value}", says=("--timeout", f"got '{value}'", "10000000"))
    CASES[f"doctor-size-mb-{label}"] = doctor(f"--size-mb={value}", says=("--size-mb", f"got '{value}'", "memory"))
for label, value in (("zero", "0"), ("non-integer", "1.5"), ("huge", str(10**30)), ("text", "many")):
    CASES[f"doctor-iters-{label}"] = doctor("--iters", value, says=("--iters", "an integer from 1 to 1000"))
CASES["doctor-backend-newline"] = doctor("--backend", "gloo\nnccl", says=("--backend", "'gloo\\nnccl'"))
CASES["doctor-stray-argument-newline"] = doctor("x\ny", says=("unrecognized arguments: x\\ny",))

# processes and threads: bounded by the CPUs this process may use
CASES["bench-memory-world-huge"] = bench("memory", "--world", "100000", says=("--world", "'100000'", "CPUs"))
CASES["bench-memory-world-zero"] = bench("memory", "--world", "0", says=("--world", "got '0'"))
CASES["bench-checkpoint-worlds-huge"] = bench("checkpoint", "--worlds", "1,100000", says=("--worlds", "CPUs"))
CASES["bench-checkpoint-worlds-float"] = bench("checkpoint", "--worlds", "1.5", says=("--worlds", "got '1.5'"))
CASES["bench-checkpoint-worlds-empty"] = bench("checkpoint", "--worlds", "1,,2", says=("--worlds", "got ''"))
CASES["bench-loader-workers-huge"] = bench("loader", "--workers", "100000", says=("--workers", "CPUs"))
CASES["bench-loader-dataset-workers-negative"] = bench(
    "loader", "--dataset-workers", "-1", says=("--dataset-workers", "got '-1'")
)
CASES["bench-threads-huge"] = bench("limit", "--threads", str(10**30), says=("--threads", "CPUs"))

# counts and steps: at least one, at most a sane number
for command, flag, value in (
    ("startup", "--repeats", "0"),
    ("ddp", "--repeats", "100000"),
    ("ddp", "--windows", "0"),
    ("ddp", "--steps", "-3"),
    ("ddp", "--warmup", "1e3"),
    ("loader", "--rounds", "0"),
    ("loader", "--samples", str(10**30)),
    ("limit", "--rounds", "0.5"),
    ("forecast", "--windows", "0"),
    ("forecast", "--max-nodes", str(10**30)),
    ("forecast", "--ranks-per-node", "0"),
    ("overhead", "--pairs", "0"),
    ("overhead", "--steps", "0"),
    ("memory", "--steps", "0"),
    ("memory", "--depth", "0"),
    ("checkpoint", "--rounds", "0"),
    ("checkpoint", "--width", "-1"),
    ("tta", "--seeds", "1,1"),
    ("tta", "--seeds", "-1"),
    ("tta", "--seeds", str(2**32)),
):
    CASES[f"bench-{command}{flag}-{value[:8]}"] = bench(command, flag, value, says=(flag, f"'{value}'"))
for label, value in (("nan", "nan"), ("minus-inf", "-inf"), ("zero", "0"), ("above-one", "1.5")):
    CASES[f"bench-tta-target-{label}"] = bench("tta", f"--target={value}", says=("--target", f"got '{value}'"))
CASES["bench-limit-seconds-inf"] = bench("limit", "--seconds", "inf", says=("--seconds", "got 'inf'"))
CASES["bench-ddp-timeout-nan"] = bench("ddp", "--timeout", "nan", says=("--timeout", "got 'nan'"))
CASES["bench-memory-timeout-zero"] = bench("memory", "--timeout", "0", says=("--timeout", "got '0'"))
CASES["bench-checkpoint-timeout-inf"] = bench("checkpoint", "--timeout", "inf", says=("--timeout", "got 'inf'"))
CASES["bench-startup-timeout-huge"] = bench("startup", "--timeout", "1e300", says=("--timeout", "10000000"))
for command in ("loader", "limit", "ddp", "forecast", "overhead"):
    CASES[f"bench-{command}-batch-huge"] = bench(command, "--batch", "100000", says=("--batch", "the bundled sample"))
CASES["bench-forecast-sizes-zero"] = bench("forecast", "--sizes-kib", "4,0", says=("--sizes-kib", "got '0'"))
CASES["bench-forecast-sizes-huge"] = bench("forecast", "--sizes-kib", str(10**15), says=("--sizes-kib", "memory"))

# sizes whose product would not fit in this host's memory: refused before anything is allocated
CASES["bench-memory-model-too-big"] = bench(
    "memory", "--width", "60000", "--depth", "10000", says=("--width 60000 --depth 10000", "available memory")
)
CASES["bench-overhead-data-too-big"] = bench(
    "overhead", "--device", "cpu", "--steps", "1000000", "--batch", "5000", says=("--steps 1000000", "available memory")
)

# output paths that cannot be written, found before the benchmark runs (nothing printed, nothing created);
# forecast --from: a benchmark that would otherwise print its table at once
for label, path, files in (
    ("in-proc", "/proc/bench.json", ()),
    ("missing-folder", "nowhere/bench.json", ()),
    ("a-directory", "out", (("out", DIR),)),
    ("a-fifo", "out.json", (("out.json", FIFO),)),
    ("newline", "a\nb.json", ()),
):
    CASES[f"bench-json-{label}"] = bench(
        "forecast", "--from", "f.json", "--json", path, says=("--json",), files=(("f.json", SAVED_FORECAST), *files)
    )
for label, path, files in (
    ("in-proc", "/proc/bench", ()),
    ("missing", "nowhere", ()),
    ("a-fifo", "pipe", (("pipe", FIFO),)),
    ("a-file", "f", (("f", b"x"),)),
):
    CASES[f"bench-checkpoint-dir-{label}"] = bench("checkpoint", "--dir", path, says=("--dir",), files=files)

# inputs: the training config of startup and tta is checked before the first child starts
CASES["bench-startup-override-nan"] = bench("startup", "train.lr=nan", says=("train.lr", "finite"))
CASES["bench-tta-config-fifo"] = bench(
    "tta", "--config", "job.yaml", says=("job.yaml", "not a plain file"), files=(("job.yaml", FIFO),)
)
CASES["bench-startup-config-newline"] = bench("startup", "--config", "a\nb.yaml", says=("--config", "control"))
for label, content, says in (
    ("a-fifo", FIFO, "FIFO"),
    ("not-json", b"not json", "cannot read a forecast JSON"),
    ("a-list", b"[1, 2]", "cannot read a forecast JSON"),
    ("nan", FORECAST + b'"compute_s": NaN}}', "measured.compute_s"),  # JSON's extension
    ("string-world", b'{"measured": {"world_size": "2"}}', "measured.world_size"),
    ("huge", b" " * (2 << 20), "larger than"),
):
    CASES[f"bench-forecast-from-{label}"] = bench(
        "forecast", "--from", "f.json", says=("--from f.json", says), files=(("f.json", content),)
    )
CASES["bench-forecast-from-missing"] = bench("forecast", "--from", "f.json", says=("--from f.json", "no such file"))
CASES["bench-unknown-command"] = bench("fast", says=("invalid choice: 'fast'",))
CASES["bench-stray-argument-newline"] = bench("loader", "x\ny", says=("unrecognized arguments: x\\ny",))
