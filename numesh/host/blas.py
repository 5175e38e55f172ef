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
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from numesh.host.kernels import HAVE_NUMBA, njit

NO_TRANS, TRANS = 111, 112  # CBLAS's CblasNoTrans, CblasTrans
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
    def _probe(fn, a, b, c, ta, tb):
        m, n = c.shape
        k = a.shape[0] if ta == TRANS else a.shape[1]
        gemm(fn, np.int64(ta), np.int64(tb), np.int64(m), np.int64(n), np.int64(k), a.dtype.type(1.0),
             a.ctypes.data, np.int64(a.shape[1]), b.ctypes.data, np.int64(b.shape[1]), a.dtype.type(0.0),
             c.ctypes.data, np.int64(n))

else:

    def gemm(*args):  # type: ignore[no-redef]
        """Without numba there is no compiled caller: `gemm_addresses` is None, so nothing calls this."""
        raise RuntimeError("numesh.host.blas.gemm needs numba (pip install 'numesh[fast]')")


def _libraries() -> list[str]:
    """The loaded BLAS libraries' paths, numpy's first (imported by numpy, so loaded)."""
    from threadpoolctl import ThreadpoolController

    paths = [lib.filepath for lib in ThreadpoolController().select(user_api="blas").lib_controllers if lib.filepath]
    return sorted(paths, key=lambda p: "numpy" not in p)


def _agrees(fn: int, dtype: type) -> bool:
    """Whether `fn` computes np.matmul's bits on products of each transposition."""
    rng = np.random.default_rng(0)
    for ta in (NO_TRANS, TRANS):
        for tb in (NO_TRANS, TRANS):
            a = rng.standard_normal((37, 70) if ta == NO_TRANS else (70, 37)).astype(dtype)
            b = rng.standard_normal((70, 29) if tb == NO_TRANS else (29, 70)).astype(dtype)
            c = np.empty((37, 29), dtype)
            _probe(fn, a, b, c, ta, tb)
            if not np.array_equal(c, (a.T if ta == TRANS else a) @ (b.T if tb == TRANS else b)):
                return False
    return True


@functools.cache
def gemm_addresses() -> tuple[int, int] | None:
    """(sgemm, dgemm) addresses of numpy's BLAS for `gemm`, or None where there are none
    that give np.matmul's bits (or no numba)."""
    if not HAVE_NUMBA:
        return None
    for path in _libraries():
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
