"""Intel MKL's GEMM, when pip's `mkl` is installed (`pip install 'numesh[mkl]'`).

numpy's wheels bring OpenBLAS; on Intel's AVX-512 server cores MKL runs numesh's GEMM
shapes faster (benchmarks/bench_gemm.py prints both, and torch's, on the machine it runs
on), and MKL is what PyTorch multiplies with there. `library()` loads
pip's `libmkl_rt` and sets it up for numesh before anything else can call it:

- the sequential threading layer: numesh runs its own threads and gives each GEMM tile
  one (numesh.host.threads), as it keeps OpenBLAS on one thread;
- conditional numerical reproducibility, strict (`MKL_CBWR=AUTO,STRICT`): without it MKL
  may take another path for differently aligned arrays, and a tile's bits would depend
  on where its process happened to allocate it, so on the thread count.

`gemms()` returns the ILP64 `cblas_sgemm_64`/`cblas_dgemm_64` addresses, the same
arguments as numpy's `scipy_cblas_?gemm64_` (numesh.host.blas picks between them).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
import re
import sys
import threading

_SEQUENTIAL = 1  # MKL_THREADING_SEQUENTIAL
_CBWR_AUTO_STRICT = 2 | 0x10000  # MKL_CBWR_AUTO | MKL_CBWR_STRICT
_CBWR_SUCCESS = 0


def _candidates() -> list[str]:
    """Where libmkl_rt may be: pip's `mkl` puts its libraries in the environment's lib/
    (sys.prefix, or the user base for `pip install --user`), else the loader's search path."""
    import site

    dirs = [sys.prefix, getattr(site, "USER_BASE", None) or ""]
    paths = [p for d in dirs if d for p in sorted(glob.glob(os.path.join(d, "lib", "libmkl_rt.so*")))]
    found = ctypes.util.find_library("mkl_rt")
    return paths + ([found] if found else [])


_LOCK = threading.Lock()


def library() -> ctypes.CDLL | None:
    """pip's libmkl_rt, sequential and strictly reproducible, or None where it is missing
    or will not take those settings (an MKL too old for STRICT). Loaded once, under a lock:
    the first GEMM may come from two threads at once, and MKL takes its settings only
    before its first computation."""
    with _LOCK:
        return _load()


@functools.cache
def _load() -> ctypes.CDLL | None:
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
            lib.MKL_Set_Threading_Layer(ctypes.c_int(_SEQUENTIAL))  # before any call that computes
            if lib.MKL_CBWR_Set(ctypes.c_int(_CBWR_AUTO_STRICT)) != _CBWR_SUCCESS:
                continue
            lib.cblas_sgemm_64, lib.cblas_dgemm_64  # noqa: B018 - the ILP64 symbols gemms() needs
        except (OSError, AttributeError):
            continue
        return lib
    return None


@functools.cache  # matmul_into asks at every call
def gemms() -> tuple[int, int] | None:
    """(sgemm, dgemm) addresses of MKL's ILP64 CBLAS GEMM, or None without MKL."""
    lib = library()
    if lib is None:
        return None
    return tuple(ctypes.cast(f, ctypes.c_void_p).value for f in (lib.cblas_sgemm_64, lib.cblas_dgemm_64))  # type: ignore[return-value]


def version() -> str:
    """MKL's version ("2026.2", from its version line), or "" without MKL."""
    lib = library()
    if lib is None:
        return ""
    buf = ctypes.create_string_buffer(256)
    lib.MKL_Get_Version_String(buf, ctypes.c_int(len(buf)))
    line = buf.value.decode(errors="replace")
    found = re.search(r"Version ([0-9][0-9.]*)", line)
    return found.group(1) if found else line.strip()
