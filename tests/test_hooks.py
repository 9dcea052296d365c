"""Side features beside the loop (``train/hooks/``): a hook is called at every point of a real run, in
registration order, on every rank; adding one takes a file and one line in ``hooks.standard``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import base_env

from ddp_slurm.train import hooks

# A side feature as a user of the package would add one (here in its own file, registered through the
# same list the runtime's own features are in): it records every call it gets.
FEATURE = """
import json, os
from ddp_slurm.train import hooks
from ddp_slurm.train.hooks import Hook


class Recorder(Hook):
    def __init__(self, run):
        self.path = os.environ["RECORD"] + f".{run.rank}"

    def _say(self, what, t):
        with open(self.path, "a") as f:
            f.write(json.dumps([what, t.run.pos.step]) + "\\n")

    def start(self, t): self._say("start", t)
    def epoch_start(self, t): self._say("epoch_start", t)
    def before_step(self, t): self._say("before_step", t)
    def stepped(self, t): self._say("stepped", t)
    def boundary(self, t): self._say("boundary", t)
    def after_step(self, t, loss): self._say("after_step", t)
    def epoch_end(self, t): self._say("epoch_end", t)
    def end(self, t): self._say("end", t)


standard = hooks.standard


def with_recorder(run, dog=None):
    found = standard(run, dog)
    found.add(Recorder(run))  # the one line of registration (in hooks.standard's list, for the package's own)
    return found


hooks.standard = with_recorder
"""


def test_a_new_feature_is_one_file_and_one_line_and_sees_every_point(tmp_path: Path) -> None:
    (tmp_path / "feature.py").write_text(FEATURE)
    script = "import feature, sys\nfrom ddp_slurm.train import cli\nsys.exit(cli.main(sys.argv[1:]))\n"
    args = ["model.name=mlp", "train.max_steps=12", "train.log_every_steps=4", "checkpoint.every_steps=6"]
    res = subprocess.run(
        [sys.executable, "-c", script, *args, "run.name=h"],
        cwd=tmp_path,
        env=base_env(RECORD=str(tmp_path / "calls"), PYTHONPATH=f"{tmp_path}:{base_env()['PYTHONPATH']}"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    calls = [tuple(json.loads(line)) for line in (tmp_path / "calls.0").read_text().splitlines()]
    assert calls[:3] == [("start", 0), ("epoch_start", 0), ("before_step", 0)]
    assert calls[-1] == ("end", 12)
    steps = [step for what, step in calls if what == "after_step"]
    assert steps == list(range(1, 13))
    # a boundary before every step whose end waits for the device: a train line (4, 8, 12), a save (6, 12)
    assert [step for what, step in calls if what == "boundary"] == [4, 6, 8, 12]
    assert [step for what, step in calls if what == "epoch_end"] == [12]  # train.max_steps ends the epoch


def test_the_runtime_s_own_features_are_registered_in_one_list() -> None:
    source = Path(hooks.__file__).read_text()
    for feature in ("SyncDebug", "Heartbeat", "TrainLine", "ProgressDisplay"):
        assert f"{feature}(" in source.split("def standard")[1], feature
