"""numesh: GPT training with dp x tp x pp parallelism in NumPy and MPI."""

__version__ = "0.1.0"
