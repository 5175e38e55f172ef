"""numesh.host.tile_gemm: the attention's register-tiled tile products against NumPy.

Every shape class the blocks meet (rows in whole blocks and the last rows in blocks of 4, 2
and 1, columns in
4-, 2- and 1-vector blocks with a partial last vector, k in one chunk and several, k = 0),
A read row-wise and transposed, C written and accumulated, float32 and float64; what lies
outside C's rows and columns is left alone; and an element's bits do not depend on the
block it fell in (C computed whole, by rows, or by columns).
"""

from __future__ import annotations

import numpy as np
import pytest

from numesh.host import aligned
from numesh.host import kernels as K
from numesh.host import tile_gemm as TG

pytestmark = pytest.mark.skipif(not K.HAVE_NUMBA, reason="the tile products are compiled code: numba is not installed")

W32 = TG.VB // 4  # float32 lanes a vector


def _product(a: np.ndarray, b: np.ndarray, c: np.ndarray, alpha: float, accumulate: bool,
              transposed: bool) -> None:
    """c (+)= alpha·a·b by tile_mm, a given as [m, k] (read in place, or from its transpose's
    storage), b [k, n] and c [m, n] views with contiguous rows."""
    m, k = a.shape
    store = np.ascontiguousarray(a.T) if transposed else np.ascontiguousarray(a)
    sam, sak = (1, m) if transposed else (k, 1)
    raw = np.empty(max(1, m) * 4 * (TG.VB // a.itemsize), a.dtype)
    TG.tile_mm(np.int64(m), np.int64(c.shape[1]), np.int64(k), a.dtype.type(alpha), store.ctypes.data,
               np.int64(sam), np.int64(sak), b.ctypes.data, np.int64(b.strides[0] // b.itemsize), c.ctypes.data,
               np.int64(c.strides[0] // c.itemsize), accumulate, raw)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
# with 6-row blocks 7 = 6 + 1, 15 = 12 + 2 + 1, 64 = 60 + 4 (48 + 12 + 4 in panels); with
# 8-row blocks 7 = 4 + 2 + 1, 15 = 8 + 4 + 2 + 1; 2-row blocks (kind 0 on 32-byte vectors) end in 1
@pytest.mark.parametrize("m", [1, 7, 15, 64, 130])
@pytest.mark.parametrize("n", [1, W32 - 1, W32, W32 + 1, 2 * W32 + 3, 3 * W32 + 1, 4 * W32, 4 * W32 + 5, 128])
@pytest.mark.parametrize("k", [0, 1, TG.KC, TG.KC + 1, 300])
def test_the_product_matches_numpy_and_touches_nothing_else(dtype, m, n, k):
    rng = np.random.default_rng(m * 1000 + n * 10 + k)
    a = rng.standard_normal((m, k)).astype(dtype)
    b_store = rng.standard_normal((k, n + 7)).astype(dtype)  # rows wider than n: B's stride
    b = b_store[:, 2:n + 2]
    for transposed in (False, True):
        for accumulate in (False, True):
            c_store = np.full((m, n + 9), 7.0, dtype)
            c = c_store[:, 3:n + 3]
            c[...] = rng.standard_normal((m, n))
            want = c.astype(np.float64).copy()
            TG.tile_mm_reference(0.5, a.astype(np.float64), b.astype(np.float64), want, accumulate)
            _product(a, b, c, 0.5, accumulate, transposed)
            tol = 1e-5 if dtype == np.float32 else 1e-13
            np.testing.assert_allclose(c, want, rtol=tol, atol=tol * max(1, k) ** 0.5)
            assert (c_store[:, :3] == 7).all() and (c_store[:, n + 3:] == 7).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_an_elements_bits_do_not_depend_on_its_block(dtype):
    """The same C whole, in row slices of every height up to 9 (each row then falls in
    another block: the full blocks and the 4-, 2- and 1-row tails) and in column slices of
    every width (other block kinds, other partial vectors)."""
    rng = np.random.default_rng(1)
    m, n, k = 37, 4 * W32 + 11, TG.KC * 2 + 9
    a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    whole = np.zeros((m, n), dtype)
    _product(a, b, whole, 0.25, False, True)
    for height in range(1, 10):
        rows = np.zeros((m, n), dtype)
        for i in range(0, m, height):
            _product(a[i:i + height], b, rows[i:i + height], 0.25, False, True)
        assert rows.tobytes() == whole.tobytes(), height
    for width in (1, 3, W32, W32 + 2, 3 * W32 + 1):
        cols = np.zeros((m, n), dtype)
        for j in range(0, n, width):
            part = np.ascontiguousarray(b[:, j:j + width])
            out = np.zeros((m, part.shape[1]), dtype)
            _product(a, part, out, 0.25, False, True)
            cols[:, j:j + width] = out
        assert cols.tobytes() == whole.tobytes(), width


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_an_elements_bits_do_not_depend_on_the_operands_alignment(dtype):
    """The same C from operands on a 64-byte boundary (numesh.host.aligned: how the model
    holds them) and from the same values placed 1 to 15 elements past it, C too."""
    rng = np.random.default_rng(2)
    m, n, k = 29, 3 * W32 + 5, TG.KC + 17
    a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    results = []
    for shift in (0, 1, 3, 4, 15):
        store = aligned.empty(3 * (m * k + k * n + m * n) + 64, dtype)
        a_at = store[shift:shift + m * k].reshape(m, k)
        b_at = store[m * k + 2 * shift:m * k + 2 * shift + k * n].reshape(k, n)
        c_at = store[m * k + k * n + 3 * shift:m * k + k * n + 3 * shift + m * n].reshape(m, n)
        a_at[...], b_at[...], c_at[...] = a, b, 0
        _product(a_at, b_at, c_at, 0.5, True, False)
        results.append(c_at.tobytes())
    assert all(r == results[0] for r in results[1:])
