"""Sharded data: WebDataset tar shards, indexed once, read by byte range in an order addressed by position.

``tarscan`` (one tar's samples and their byte ranges), ``index`` (the sealed index beside the shards, and
the checks against it), ``order`` (the epoch's order: a pure function of (seed, epoch, position) in
O(shards) memory), ``dataset`` (``ddp_slurm.Shards``, what a task returns), ``write`` (``ddp-slurm data
write``: deterministic shards from a folder, a JSONL list or a task's data), ``decode`` (ready-made
decoders). docs/tasks.md, "Sharded data", is the user's page.
"""
