"""Arrays whose data start on a 64-byte boundary: a cache line, and an AVX-512 vector.

NumPy aligns its arrays to 16 bytes, and a large one (allocated by mmap, a 16-byte header
before its data) starts 16 bytes past a cache line. A 64-byte vector load from such an
array then spans two cache lines: register-tiled products that read their operands in
place (numesh.host.tile_gemm) ran at ~100 GFLOP/s a core on them against ~130 on aligned
ones (`python benchmarks/bench_long_context.py --sections products` times the attention's
kernel both ways). BLAS copies its operands into its own aligned layout, and MKL's strict
reproducibility (numesh.host.mkl) makes its bits the same at any alignment, so the
alignment changes times only, never results.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import numpy as np

ALIGN = 64


def empty(shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
    """np.empty(shape, dtype), C-contiguous, its data on a 64-byte boundary. About 2.5 µs
    more than np.empty (the address read through ctypes, 0.5 µs, where `.ctypes.data` takes
    1.5 and np.prod 5): every matmul output of a step is one. The array is made over the
    aligned part of a larger buffer (np.frombuffer), so that its base is exactly its own
    bytes: numesh.base.tree.held_bytes, which the activation formulas are held equal to,
    counts them and not the up to 64 bytes of slack before them."""
    dtype = np.dtype(dtype)
    nbytes = (shape if isinstance(shape, int) else math.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(raw)) % ALIGN
    return np.frombuffer(raw.data[start:start + nbytes], dtype).reshape(shape)


def zeros(shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
    """np.zeros(shape, dtype), C-contiguous, its data on a 64-byte boundary."""
    out = empty(shape, dtype)
    out.fill(0)
    return out


def copy(x: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of x on a 64-byte boundary (np.ascontiguousarray's, aligned)."""
    out = empty(x.shape, x.dtype)
    out[...] = x
    return out
