"""``train.activation_checkpoint``: each unit the task names (``Task.shard_units``) keeps only its input
for backward and runs its forward again there, trading compute for activation memory.

torch's composable ``checkpoint`` (``torch.distributed._composable``) is applied to every unit, under
ddp and fsdp alike (before DDP wraps the model, or before FSDP2 shards the unit, as torch composes them):

- non-reentrant (``torch.utils.checkpoint`` with ``use_reentrant=False``): gradients flow to every
  parameter, it composes with DDP's and FSDP2's hooks, and a unit's recomputation is an ordinary forward;
- RNG-preserving: the recomputed forward sees the RNG state of the first one, and the streams after
  backward are the ones the run would have without it, so dropout masks, gradients and a resumed run are
  bit-identical with and without activation checkpointing (tests/test_activation_checkpoint.py);
- forward hooks, not a wrapper module: state-dict keys stay the model's own, so checkpoints, warm starts
  and the gate's shape checks are the same with and without it (``checkpoint_wrapper`` would prefix every
  key with ``_checkpoint_wrapped_module.``).

The memory it saves is what ``python -m ddp_slurm.bench memory`` reports as activation bytes.
"""

from __future__ import annotations

from torch import nn


def checkpoint_units(units: list[nn.Module]) -> None:
    """Make each of ``units`` recompute its forward in backward (in place; the same module objects)."""
    from torch.distributed._composable import checkpoint

    for unit in units:
        checkpoint(unit, preserve_rng_state=True)  # non-reentrant: the composable API has no other
