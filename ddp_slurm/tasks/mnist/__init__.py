"""MNIST (the bundled sample or the full set) with an MLP or a small CNN: the first task."""

from ddp_slurm.tasks.mnist.task import MNIST

__all__ = ["MNIST"]
