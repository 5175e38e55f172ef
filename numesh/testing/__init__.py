"""Helpers for numesh's tests and benchmarks, not for training code.

`numesh.testing.torch_nanogpt` is the PyTorch reference nanoGPT that the export test and the
speed and convergence benchmarks compare numesh with. It is the only module of the project
that imports torch, and only when it is itself imported; this package's `__init__` imports
nothing, and no other numesh module imports `numesh.testing` (an import-linter contract in
pyproject.toml checks both).
"""
