"""numesh: GPT training with dp x cp x tp x pp parallelism and ZeRO in NumPy and MPI."""

import os

# OpenBLAS's idle threads spin for 2^28 cycles after each matmul before they sleep. On a
# rank whose cores also run numesh's intra-op threads (numesh.host.threads) or share a physical
# core (hyperthreads), that spinning steals the core the next elementwise op needs, a
# share of every training step (`python benchmarks/bench_train.py --no-torch` against the
# same with OPENBLAS_THREAD_TIMEOUT=28, OpenBLAS's default, shows how much on this machine).
# Spin 2^4 cycles instead. Only effective when numesh is imported before numpy (the CLI
# does); set the variable in the environment to override.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

__version__ = "0.1.0"
