"""MNIST (the bundled sample or the full set) with an MLP or a small CNN: the first task."""
