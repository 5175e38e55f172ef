"""NumPy's own BLAS GEMM, callable from inside numba kernels.

A kernel that loops over many small GEMMs in Python (the attention stripes: a few GEMMs
and passes per 128 query rows) hands the GIL back and forth between numesh's threads at
every call; two threads then wait on each other (benchmarks/bench_long_context.py
`--sections loops` measures it). Calling the GEMM from compiled code instead lets one
call do a whole group of heads with the GIL released.

The GEMM is the one `np.matmul` calls: numpy's wheels bundle OpenBLAS as
`libscipy_openblas64_`, whose `scipy_cblas_sgemm64_`/`scipy_cblas_dgemm64_` take 64-bit
integers. `gemm_addresses()` finds them among the loaded BLAS libraries (threadpoolctl),
and keeps them only if a probe multiply gives `np.matmul`'s bits, so results do not
depend on which path runs. Where they are missing (a NumPy built on MKL, Accelerate or a
32-bit-integer BLAS) it returns None and callers keep their NumPy loops. The address goes
into compiled code as an argument (`gemm`), not a global, so the kernels stay cacheable.

Where pip's `mkl` is installed (`numesh[mkl]`) and the CPU is Intel's, numesh's own GEMMs
(the matmul tiles of numesh.host.threads and the attention's stripe loops) run on MKL
instead (numesh.host.mkl), which is faster there (benchmarks/bench_gemm.py). NUMESH_BLAS
picks: `numpy` (numpy's BLAS), `mkl` (MKL on any CPU; an error if it is missing), unset or
empty (the default just said). Other products (`x @ y` elsewhere, the NumPy references)
stay on numpy's BLAS, and so does everything when the kernels are off
(NUMESH_KERNELS=numpy). `name()` says which one runs; a step has the same bits on any
thread count with either.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from typing import Iterator

import numpy as np

from numesh.host import mkl
from numesh.host.kernels import HAVE_NUMBA, enabled, njit

NO_TRANS, TRANS = 111, 112  # CBLAS's CblasNoTrans, CblasTrans
MODES = ("numpy", "mkl")  # NUMESH_BLAS; unset or empty: mkl where installed on an Intel CPU, else numpy
_SYMBOLS = (("scipy_cblas_sgemm64_", "scipy_cblas_dgemm64_"), ("cblas_sgemm64_", "cblas_dgemm64_"))

if HAVE_NUMBA:
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def gemm(typingctx, fn, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        """C = alpha·op(A)·op(B) + beta·C, row-major, by the cblas_?gemm at address `fn`
        (64-bit integer arguments; a, b, c are data addresses, `.ctypes.data`)."""
        sig = types.void(fn, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)

        def codegen(context, builder, signature, args):
            fn, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc = args
            i32, i64, ptr = ir.IntType(32), ir.IntType(64), ir.IntType(8).as_pointer()
            real = context.get_value_type(signature.args[6])
            fnty = ir.FunctionType(ir.VoidType(), [i32, i32, i32, i64, i64, i64, real, ptr, i64, ptr, i64, real,
                                                   ptr, i64])
            call = builder.inttoptr(fn, fnty.as_pointer())
            builder.call(call, [ir.Constant(i32, 101), builder.trunc(ta, i32), builder.trunc(tb, i32), m, n, k,
                                alpha, builder.inttoptr(a, ptr), lda, builder.inttoptr(b, ptr), ldb, beta,
                                builder.inttoptr(c, ptr), ldc])  # 101: CblasRowMajor
            return context.get_dummy_value()

        return sig, codegen

    @njit(cache=True, nogil=True)
    def _lay(x):
        """(CBLAS transpose flag, leading dimension) of a 2-D view BLAS reads in place, or
        (0, 0) where it cannot."""
        item = x.itemsize
        s0, s1 = x.strides
        if s1 == item and s0 % item == 0 and s0 >= max(1, x.shape[1]) * item:
            return NO_TRANS, s0 // item
        if s0 == item and s1 % item == 0 and s1 >= max(1, x.shape[0]) * item:
            return TRANS, s1 // item
        return 0, 0

    @njit(cache=True, nogil=True)
    def _gemm_into(fn, a, b, c):
        """c = a·b by the cblas_?gemm at `fn`, the views read in place, or False where one
        lies so that BLAS cannot read it (`matmul_into`). Compiled, the call costs a few
        microseconds where a ctypes one cost tens (benchmarks/bench_gemm.py's small product)."""
        ta, lda = _lay(a)
        tb, ldb = _lay(b)
        tc, ldc = _lay(c)
        if ta == 0 or tb == 0 or tc != NO_TRANS:
            return False
        m, n = c.shape
        gemm(fn, np.int64(ta), np.int64(tb), np.int64(m), np.int64(n), np.int64(a.shape[1]), c.dtype.type(1.0),
             a.ctypes.data, np.int64(lda), b.ctypes.data, np.int64(ldb), c.dtype.type(0.0), c.ctypes.data,
             np.int64(ldc))
        return True

else:

    def gemm(*args):  # type: ignore[no-redef]
        """Without numba there is no compiled caller: `gemm_addresses` is None, so nothing calls this."""
        raise RuntimeError("numesh.host.blas.gemm needs numba (pip install 'numesh[fast]')")


def loaded_libraries() -> list[dict]:
    """The loaded BLAS libraries as threadpoolctl describes them, numpy's own first: once
    MKL is loaded threadpoolctl may list it before numpy's OpenBLAS."""
    from threadpoolctl import threadpool_info

    libs = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    return sorted(libs, key=lambda i: "numpy" not in (i.get("filepath") or ""))


def _agrees(fn: int, dtype: type) -> bool:
    """Whether `fn` computes np.matmul's bits on products of each transposition."""
    rng = np.random.default_rng(0)
    for ta in (NO_TRANS, TRANS):
        for tb in (NO_TRANS, TRANS):
            a = rng.standard_normal((37, 70) if ta == NO_TRANS else (70, 37)).astype(dtype)
            b = rng.standard_normal((70, 29) if tb == NO_TRANS else (29, 70)).astype(dtype)
            a, b = (a.T if ta == TRANS else a), (b.T if tb == TRANS else b)  # the product's operands
            c = np.empty((37, 29), dtype)
            _gemm_into(fn, a, b, c)  # reads each operand's transposition from its view
            if not np.array_equal(c, a @ b):
                return False
    return True


def _mode() -> str:
    return os.environ.get("NUMESH_BLAS", "").strip().lower()


def check_mode() -> None:
    """A NUMESH_BLAS this module does not know, or `mkl` without MKL, is a one-line error
    (a ConfigError) at a command's start-up."""
    mode = _mode()
    if mode not in MODES and mode != "":
        from numesh.base.errors import ConfigError

        raise ConfigError(f"NUMESH_BLAS={os.environ.get('NUMESH_BLAS', '')!r} is not one of {', '.join(MODES)} "
                          "(or unset/empty for MKL where installed on an Intel CPU, else numpy)")
    if mode == "mkl" and mkl.gemms() is None:
        from numesh.base.errors import ConfigError

        raise ConfigError("NUMESH_BLAS=mkl, but no MKL was found: pip install 'numesh[mkl]' (Linux x86-64), "
                          "or unset NUMESH_BLAS")


def _intel() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return any(line.startswith("vendor_id") and "GenuineIntel" in line for line in f)
    except OSError:
        return False


@functools.cache
def _choice() -> str:
    """Decided once (mkl.library() loads MKL under its lock, so threads that ask at once
    agree); the tests clear the cache to decide again."""
    mode = _mode()
    wanted = mode == "mkl" or (mode not in MODES and _intel())  # MKL measured faster on Intel only
    return "mkl" if wanted and mkl.gemms() is not None else "numpy"


_forced: str | None = None  # `using`'s choice, else None


def name() -> str:
    """The BLAS numesh's own GEMMs run on now: "mkl" or "numpy" (see the module's text)."""
    return (_forced or _choice()) if enabled() else "numpy"


@contextlib.contextmanager
def using(choice: str) -> Iterator[None]:
    """numesh's GEMMs on `choice` ("numpy" or "mkl") inside the block, whatever NUMESH_BLAS
    says: how benchmarks/bench_gemm.py alternates them step by step in one process."""
    global _forced
    if choice not in MODES or (choice == "mkl" and mkl.gemms() is None):
        raise ValueError(f"no {choice!r} BLAS here: one of {', '.join(MODES)} (mkl needs pip install 'numesh[mkl]')")
    saved, _forced = _forced, choice
    try:
        yield
    finally:
        _forced = saved


def describe() -> str:
    """Which BLAS numesh's GEMMs run on, for run headers and benchmarks: "MKL 2026.2" or
    "numpy's BLAS"."""
    if name() == "mkl":
        return f"MKL {mkl.version()}"
    return "numpy's BLAS"


_REALS = {np.dtype(np.float32): 0, np.dtype(np.float64): 1}  # native byte order only: BLAS's reals


def matmul_into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out[...] = a @ b (2-D) on the BLAS `name()` picks: MKL's GEMM called in place on the
    views (from compiled code, with the GIL released), else (or for a layout or dtype it
    cannot take) np.matmul."""
    real = _REALS.get(out.dtype)
    if real is not None and a.dtype == b.dtype == out.dtype and name() == "mkl" and out.size and a.shape[1] \
            and _gemm_into(mkl.gemms()[real], a, b, out):
        return
    np.matmul(a, b, out=out)


@functools.cache
def _numpy_gemms() -> tuple[int, int] | None:
    """(sgemm, dgemm) of numpy's own BLAS, where they give np.matmul's bits."""
    for path in [lib["filepath"] for lib in loaded_libraries() if lib.get("filepath")]:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for names in _SYMBOLS:
            try:
                fns = tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in names)
            except AttributeError:
                continue
            if _agrees(fns[0], np.float32) and _agrees(fns[1], np.float64):
                return fns  # type: ignore[return-value]
    return None


def gemm_addresses() -> tuple[int, int] | None:
    """(sgemm, dgemm) addresses for `gemm` in compiled code: MKL's where `name()` is mkl,
    else numpy's BLAS's where they give np.matmul's bits; None without numba."""
    if not HAVE_NUMBA:
        return None
    return mkl.gemms() if name() == "mkl" else _numpy_gemms()
