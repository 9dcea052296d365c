"""Build hook: ship the top-level jobs/*.yaml and sbatch/*.sh inside the wheel, under ddp_slurm/assets/.

They live once, at the top of the repository (where users of a checkout find them); the build copies
them into the package so that `ddp-slurm init DIR` can hand them to users who installed a wheel.
A checkout or an editable install reads the top-level files directly (see ddp_slurm/launch/init.py).
Everything else about the package is declared in setup.cfg.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
SHIPPED = {"jobs": "*.yaml", "sbatch": "*.sh"}


class build_py_with_assets(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads the top-level files in place
        for folder, pattern in SHIPPED.items():
            dest = Path(self.build_lib, "ddp_slurm", "assets", folder)
            dest.mkdir(parents=True, exist_ok=True)
            for src in sorted((HERE / folder).glob(pattern)):
                shutil.copy2(src, dest / src.name)  # copy2 keeps the scripts' executable bit


setup(cmdclass={"build_py": build_py_with_assets})
