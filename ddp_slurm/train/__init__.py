"""The runtime any task trains on: the loop, its step, state and checkpoints, signals, logs and metrics."""
