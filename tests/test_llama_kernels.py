"""The Llama parts' fused kernels (numesh/host/llama_kernels.py) against their NumPy
references, and the same bits on any thread count.

Each layer function runs once with the kernels and once with the references
(`kernels.switched`): float64 agrees to 1e-12 relative, float32 to a few ulps. Edge shapes:
one token, odd widths, views of a fused projection rotated in place, positions out of order
(cp's zigzag chunks).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from numesh.host import kernels as K
from numesh.host import llama_kernels as LK
from numesh.nn.layers import RMSNorm, rmsnorm_bwd, rmsnorm_fwd, swiglu_bwd, swiglu_fwd
from numesh.nn.rotary import Rotary, rope_bwd, rope_fwd, rotary_tables
from test_kernels import assert_close, both

pytestmark = pytest.mark.skipif(not K.HAVE_NUMBA, reason="numba is not installed: the layers use the NumPy references")

DTYPES = [np.float64, np.float32]
SHAPES = [(1, 1, 8), (2, 1, 5), (3, 7, 13), (2, 3, 77), (2, 9, 576)]  # 77: whole lanes and a tail


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rmsnorm(dtype, shape) -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * 3 + 1).astype(dtype)
    p = RMSNorm(rng.standard_normal(shape[-1]).astype(dtype))
    dy = rng.standard_normal(shape).astype(dtype)
    fast, ref = both(lambda: rmsnorm_fwd(p, x, 1e-5))
    assert_close(fast, ref, dtype, "rmsnorm_fwd", scale=4)
    fast, ref = both(lambda: rmsnorm_bwd(p, rmsnorm_fwd(p, x, 1e-5)[1], dy))
    assert_close(fast, ref, dtype, "rmsnorm_bwd", scale=4 * np.sqrt(np.prod(shape[:-1])))  # dw sums the rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_swiglu(dtype, shape) -> None:
    rng = np.random.default_rng(2)
    gate, up, dy = ((rng.standard_normal(shape) * 4).astype(dtype) for _ in range(3))
    gate.reshape(-1)[:2] = [200.0, -200.0][: gate.size]  # sigmoid saturated: exp(-g) overflows to inf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the reference's overflow in exp
        fast, ref = both(lambda: swiglu_fwd(gate, up))
        assert_close(fast, ref, dtype, "swiglu_fwd", scale=2)
        fast, ref = both(lambda: swiglu_bwd(swiglu_fwd(gate, up)[1], dy))
    assert_close(fast, ref, dtype, "swiglu_bwd", scale=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the kernel path says nothing about the saturated entries
        with K.switched(True):
            swiglu_fwd(gate, up)


def _tables(T: int, d: int, dtype, zigzag: bool) -> Rotary:
    pos = np.r_[0:T // 2, T + T // 2:2 * T] if zigzag else np.arange(T)  # cp=2: chunks 0 and 3 of 2T
    return rotary_tables(pos, d, 1e4, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zigzag", [False, True])
@pytest.mark.parametrize("B, T, H, d", [(1, 1, 1, 2), (2, 6, 3, 8), (2, 5, 9, 64)])
def test_rope_in_the_blocks_layout(dtype, zigzag: bool, B: int, T: int, H: int, d: int) -> None:
    """x [B, T, H, d] by tables [T, 1, d], as the block rotates its projections: into a new
    array, and in place on views of one fused q|k|v buffer."""
    rng = np.random.default_rng(3)
    tab = _tables(T, d, dtype, zigzag)
    rot = Rotary(tab.cos[:, None, :], tab.sin[:, None, :])
    x = rng.standard_normal((B, T, H, d)).astype(dtype)
    for fn in (rope_fwd, rope_bwd):
        fast, ref = both(lambda: fn(x, rot))
        assert_close(fast, ref, dtype, fn.__name__, scale=2)
        assert fast.dtype == dtype
        fused = rng.standard_normal((B, T, 3, H, d)).astype(dtype)
        views = {}
        for on in (True, False):
            buf = fused.copy()
            with K.switched(on):
                out = fn(buf[:, :, 1], rot, out=buf[:, :, 1])
            assert np.shares_memory(out, buf)
            np.testing.assert_array_equal(buf[:, :, [0, 2]], fused[:, :, [0, 2]])  # the other parts untouched
            views[on] = buf
        assert_close(views[True], views[False], dtype, f"{fn.__name__} in place", scale=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_heads_before_tokens(dtype) -> None:
    """x [B, H, T, d] by tables [T, d] (rope_fwd's other layout) takes the kernel too."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 7, 16)).astype(dtype)
    rot = _tables(7, 16, dtype, True)
    for fn in (rope_fwd, rope_bwd):
        fast, ref = both(lambda: fn(x, rot))
        assert_close(fast, ref, dtype, fn.__name__, scale=2)
    back = rope_bwd(rope_fwd(x, rot), rot)  # orthogonal: backward undoes forward
    np.testing.assert_allclose(back, x, rtol=0, atol=1e-12 if dtype == np.float64 else 1e-5)


def test_the_kernels_are_the_same_bits_on_any_thread_count(with_threads) -> None:
    """Rows split over 1, 2 or 3 threads; RMSNorm's weight gradient over fixed tiles of the
    16 cores `with_threads` sets: every output bit for bit."""
    rng = np.random.default_rng(5)
    # float64: float32 outputs of float64 sums would hide an order of addition that follows the threads
    x, dy = (rng.standard_normal((4, 600, 96)) for _ in range(2))  # 4 tiles of dw
    p = RMSNorm(rng.standard_normal(96))
    tab = _tables(600, 32, np.float64, True)
    rot = Rotary(tab.cos[:, None, :], tab.sin[:, None, :])

    def run() -> list[np.ndarray]:
        y, ctx = rmsnorm_fwd(p, x, 1e-5)
        dx, dp = rmsnorm_bwd(p, ctx, dy)
        g, act = swiglu_fwd(x, dy)
        da, du = swiglu_bwd(act, x)
        q = x.reshape(4, 600, 3, 32)
        return [y, dx, dp.w, g, da, du, rope_fwd(q, rot), rope_bwd(q, rot)]

    runs = {}
    with K.switched(True):
        for k in (1, 2, 3):
            with_threads(k)
            runs[k] = run()
    for k in (2, 3):
        for a, b in zip(runs[1], runs[k], strict=True):
            np.testing.assert_array_equal(b, a)


def test_warm_up_compiles_every_kernel() -> None:
    for dtype in DTYPES:
        LK.warm_up(dtype)
    for fn in (LK.rmsnorm_fwd, LK.rmsnorm_bwd, LK.swiglu_fwd, LK.swiglu_bwd, LK.rope):
        assert fn.signatures, fn.__name__  # compiled (or loaded from the cache) for some dtype
