"""Going back to a chosen checkpoint (``ddp-slurm resume RUN_DIR --step N``): the newer ones set aside.

A launch resumes the newest checkpoint that passes the gate. To continue from an older one (the run
diverged after step N; a learning-rate change wants an earlier point) the newer ones must stop being
candidates. They are moved, never deleted, into ``<run dir>/set-aside/<UTC time>-after-step-<N>/`` under
their own names, with the ``best`` file when it named one of them; one line says what moved where, and
moving them back into ``checkpoints/`` undoes it. The metrics the abandoned steps logged stay in
metrics.jsonl; the tools already keep only the latest launch's lines for a step it redid.

The chosen checkpoint passes the gate first (trusted, whole, where its name says, well formed, written by
this run's config): nothing moves for a step that cannot be resumed. The run's lock is held while they
move, so a launch that is training is never rewound under itself.
"""

from __future__ import annotations

from pathlib import Path

from ddp_slurm import config
from ddp_slurm.errors import UsageError
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.train.checkpoint import gate, setaside
from ddp_slurm.train.rundir import RunLock


def rewind(run_dir: Path, step: int) -> str:
    """Set aside every checkpoint of ``run_dir`` newer than the one of ``step``; returns the line that says
    what moved. UsageError (nothing moved) when ``step`` has no checkpoint the run could resume."""
    cfg = config.read_resolved(RunPaths(run_dir).config)  # the runtime's keys: nothing is imported
    paths = RunPaths(run_dir, cfg.run.shared)
    backend = gate.backend_of(paths)
    check = gate.Gate(backend, paths, [gate.same_config(cfg)])
    candidates = check.candidates()
    chosen = [(s, p) for s, p in candidates if s == step]
    if not chosen:
        have = ", ".join(str(s) for s, _ in sorted(candidates)) or "none"
        raise UsageError(f"--step {step}: {run_dir} has no checkpoint of step {step} (steps: {have})")
    check.check_trust(candidates)
    try:
        record = check.judge(*chosen[0])
    except ValueError as exc:
        raise UsageError(f"--step {step}: {chosen[0][1]} cannot be resumed ({exc}); choose another step") from None
    newer = sorted(p for s, p in candidates if s > step)
    if not newer:
        return f"{chosen[0][1].name} is the newest checkpoint already: nothing set aside"
    lock = RunLock(paths)
    lock.acquire()  # RunLocked: a launch is training this run
    try:
        return setaside.set_aside(paths, step, newer, record.get("best_step"))
    finally:
        lock.release()
