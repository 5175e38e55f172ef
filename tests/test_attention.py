"""The fused tiled attention (numesh/nn/attention.py) against its plain definition.

`attend_fwd`/`attend_bwd` with the numba stripe kernels and with their NumPy passes, against
`attention_reference` (the whole T×T matrix) in float64 to 1e-12, and against finite
differences: causal, shifted diagonals (decoding), every key seen (ring blocks), several key
tiles (the online softmax), ragged query stripes, dropout. Plus what the design promises:
the dropout pattern is a function of global coordinates only (any split of rows, heads or
positions sees the same one), results do not depend on the thread count, and nothing of
size T×T is allocated.
"""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

from numesh.host import blas, threads
from numesh.host import kernels as K
from numesh.nn import attention as A
from numesh.nn.attention import (
    AttnDropout,
    attend_bwd,
    attend_fwd,
    attention_reference,
    attention_reference_bwd,
    causal_attention_bwd,
    causal_attention_fwd,
    keep_mask,
    row_dots,
)

KERNELS = [pytest.param(True, id="numba"), pytest.param(False, id="numpy")]


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles small enough that test shapes have several query stripes and key tiles (the
    stripe height of both paths: BLAS's QUERY_TILE and tile_gemm's TILE_QUERIES)."""
    def set_tiles(query: int, key: int) -> None:
        monkeypatch.setattr(A, "QUERY_TILE", query)
        monkeypatch.setattr(A, "TILE_QUERIES", query)
        monkeypatch.setattr(A, "KEY_TILE", key)
    return set_tiles


@pytest.fixture(params=["tile", "blas"])
def products(request, monkeypatch):
    """The compiled loops multiply their tiles with numesh.host.tile_gemm ("tile") or with
    BLAS ("blas"), whatever this CPU and the head size would pick (`attention._gemm`)."""
    real = A._gemm
    if request.param == "tile":
        monkeypatch.setattr(A, "_gemm", lambda dtype, hs: None if real(dtype, hs) is None else 0)
    else:
        monkeypatch.setattr(A, "_gemm", lambda dtype, hs: real(dtype, 1 << 30))
    return request.param


def _inputs(B, H, Tq, Tk, hs, dtype=np.float64, seed=0, kv_heads=None):
    rng = np.random.default_rng(seed)
    q, dy = (rng.standard_normal((B, H, Tq, hs)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((B, kv_heads or H, Tk, hs)).astype(dtype) for _ in range(2))
    return q, k, v, dy


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("H,Hkv,B", [(6, 2, 1), (4, 1, 2), (3, 3, 1)])  # groups of 3, multi-query, none
def test_grouped_query_attention_matches_repeated_kv(small_tiles, kernels, dropout, H, Hkv, B):
    """GQA: each kv head serves its group of query heads in the kernel itself; the result is
    the definition's with K and V repeated per group (to 1e-12), dk and dv summed over the
    group, bit for bit the multi-head kernel's output on K and V repeated."""
    if kernels and not K.HAVE_NUMBA:
        pytest.skip("numba is not installed")
    small_tiles(8, 16)
    q, k, v, dy = _inputs(B, H, 37, 37, 8, kv_heads=Hkv)
    drop = AttnDropout(dropout, key=7, row0=0, n_head=H, head0=0, seq=37) if dropout else None
    with K.switched(kernels):
        got = _run(q, k, v, dy, drop=drop)
    want = [attention_reference(q, k, v, drop=drop), *attention_reference_bwd(q, k, v, dy, drop=drop)]
    for name, a, b in zip(("y", "dq", "dk", "dv"), got, want):
        assert a.shape == b.shape, name
        assert np.allclose(a, b, rtol=1e-12, atol=1e-12), f"{name}: max diff {np.abs(a - b).max()}"
    # the same as the plain multi-head kernel on repeated K/V (a check of the grouping only)
    rep = [np.repeat(x, H // Hkv, axis=1) for x in (k, v)]
    with K.switched(kernels):
        y_rep = _run(q, *rep, dy, drop=drop)[0]
    assert np.array_equal(got[0], y_rep)


def test_grouped_query_attention_refuses_uneven_groups():
    q, k, v, _ = _inputs(1, 4, 5, 5, 4, kv_heads=3)
    with pytest.raises(ValueError, match="do not split into groups"):
        attend_fwd(q, k, v, np.empty_like(q), scale=0.5)


def test_grouped_heads_are_a_view_writes_reach():
    """GQA's [B, H/g, g, T, hs] view of a head axis that lies strided through the QKV buffer
    (as the model hands it over): the backward's dq is added through it, so a copy would lose it."""
    buf = np.zeros((2, 5, 3, 6, 4))  # [B, T, q/k/v, H, hs]
    dq = buf[:, :, 0].transpose(0, 2, 1, 3)  # [B, H, T, hs]
    grouped = A._grouped(dq, 3)
    assert grouped.shape == (2, 2, 3, 5, 4)
    grouped[1, 1, 2, 4, 3] = 7.0  # batch row 1, query head 1·3 + 2 = 5, token 4
    assert buf[1, 4, 0, 5, 3] == 7.0 and np.count_nonzero(buf) == 1


def _run(q, k, v, dy, diag=0, drop=None, qpos=None, kpos=None):
    """(y, dq, dk, dv) of the tiled kernel."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    y = np.empty(q.shape, q.dtype)
    lse = attend_fwd(q, k, v, y, scale=scale, diag=diag, drop=drop, qpos=qpos, kpos=kpos)
    grads = [np.zeros_like(x) for x in (q, k, v)]
    attend_bwd(q, k, v, dy, lse, row_dots(dy, y), *grads, scale=scale, diag=diag, drop=drop, qpos=qpos, kpos=kpos)
    return [y, *grads]


CASES = [  # B, H, Tq, Tk, hs, diag, query tile, key tile
    pytest.param(2, 3, 37, 37, 8, 0, 8, 16, id="causal-ragged"),
    pytest.param(1, 2, 64, 64, 16, 0, 16, 16, id="causal-aligned"),
    pytest.param(1, 1, 1, 1, 4, 0, 8, 16, id="one-token"),
    pytest.param(1, 2, 5, 40, 16, 35, 2, 16, id="decode-after-35"),
    pytest.param(2, 2, 12, 20, 8, 20, 4, 8, id="all-keys-seen"),
]


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("B,H,Tq,Tk,hs,diag,qt,kt", CASES)
def test_tiled_attention_matches_the_definition(small_tiles, kernels, dropout, B, H, Tq, Tk, hs, diag, qt, kt):
    if kernels and not K.HAVE_NUMBA:
        pytest.skip("numba is not installed")
    small_tiles(qt, kt)
    q, k, v, dy = _inputs(B, H, Tq, Tk, hs)
    drop = AttnDropout(dropout, key=99, row0=1, n_head=H + 1, head0=1, seq=Tk) if dropout else None
    want = [attention_reference(q, k, v, diag=diag, drop=drop), *attention_reference_bwd(q, k, v, dy, diag=diag,
                                                                                         drop=drop)]
    with K.switched(kernels):
        got = _run(q, k, v, dy, diag, drop)
    for g, w, name in zip(got, want, ("y", "dq", "dk", "dv")):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12, err_msg=name)


def _compiled_gemm() -> None:
    """Skip (saying why) where the compiled stripe loops cannot run here."""
    if not K.HAVE_NUMBA:
        pytest.skip("numba is not installed")
    if blas.gemm_addresses() is None:
        pytest.skip("numpy's BLAS has no 64-bit-integer cblas gemm giving np.matmul's bits (pip's numpy wheel has)")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("B,H,Tq,Tk,hs,diag,qt,kt,kv", [*(c.values + (None,) for c in CASES),
                                                        (1, 6, 37, 37, 8, 0, 8, 16, 2), (2, 4, 33, 33, 8, 0, 8, 8, 1)])
def test_compiled_stripe_loops_match_the_python_loops(small_tiles, products, monkeypatch, dtype, dropout, B, H, Tq,
                                                      Tk, hs, diag, qt, kt, kv):
    """numesh.host.attention_kernels (one GIL-free call per group, its tile products by
    numesh.host.tile_gemm or by BLAS called from numba) computes what the Python stripe
    loop computes, dropout's pattern included, to rounding: it accumulates the gradients
    in the GEMM (beta = 1) where the loop adds each product, and takes libm's log for the
    log-sum-exp where NumPy has its own."""
    _compiled_gemm()
    small_tiles(qt, kt)
    q, k, v, dy = _inputs(B, H, Tq, Tk, hs, dtype, kv_heads=kv)
    drop = AttnDropout(dropout, key=5, row0=1, n_head=H + 2, head0=2, seq=Tk) if dropout else None
    calls = []
    for name in ("group_fwd", "group_bwd"):
        monkeypatch.setattr(A.AK, name, lambda *a, f=getattr(A.AK, name), n=name: calls.append(n) or f(*a))
    with K.switched(True):
        compiled = _run(q, k, v, dy, diag, drop)
        assert {"group_fwd", "group_bwd"} <= set(calls), "the compiled loops did not run"
        monkeypatch.setattr(blas, "gemm_addresses", lambda: None)
        python = _run(q, k, v, dy, diag, drop)
    tol = 1e-12 if dtype == np.float64 else 2e-6
    for a, b, name in zip(compiled, python, ("y", "dq", "dk", "dv")):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=name)
    if dropout:  # dropout acted: the match above is not of two runs that both ignore it
        assert not np.allclose(compiled[0], _run(q, k, v, dy, diag)[0], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("vis0", [-3, 0, 5, 40])
def test_one_sweep_of_probabilities_and_their_gradient_is_the_two_sweeps_bit_for_bit(dtype, vis0):
    """`stripe_probs_grad` (the backward without dropout) gives what `stripe_probs` then
    `stripe_grad` give, bits and signed zeros included, whether a tile hides nothing, part
    of its rows or (past the diagonal) whole rows."""
    rng = np.random.default_rng(3)
    s = rng.standard_normal((2, 24, 19)).astype(dtype)
    dp = rng.standard_normal(s.shape).astype(dtype)
    lse, dd = (rng.standard_normal((2, 19)).astype(dtype) for _ in range(2))
    u = np.zeros((2, 19), np.uint64)
    p1, dp1, p2, dp2 = s.copy(), dp.copy(), s.copy(), dp.copy()
    K.stripe_probs(p1, vis0, lse)
    K.stripe_grad(p1, dp1, dd, np.uint64(0), np.uint64(0), dtype(1), u, u[0])
    K.stripe_probs_grad(p2, dp2, vis0, lse, dd)
    for a, b in ((p1, p2), (dp1, dp2)):
        assert a.tobytes() == b.tobytes()
    assert (p2 == 0).any() == (vis0 < 24)  # the cases hide something, except the one that sees all


def test_the_gemm_probe_refuses_a_gemm_that_disagrees_with_numpy():
    """numpy's GEMM for the compiled loops is kept only if it gives np.matmul's bits: dgemm's
    address offered as sgemm's fails the probe (it reads float32 data as float64)."""
    _compiled_gemm()
    if blas._numpy_gemms() is None:
        pytest.skip("numpy's BLAS has no 64-bit-integer cblas gemm giving np.matmul's bits (pip's numpy wheel has)")
    sgemm, dgemm = blas._numpy_gemms()
    assert blas._agrees(sgemm, np.float32) and blas._agrees(dgemm, np.float64)
    assert not blas._agrees(sgemm, np.float64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kernels_and_numpy_passes_agree(small_tiles, dtype):
    if not K.HAVE_NUMBA:
        pytest.skip("numba is not installed")
    small_tiles(16, 32)
    q, k, v, dy = _inputs(2, 2, 70, 70, 8, dtype)
    drop = AttnDropout(0.2, key=5, row0=0, n_head=2, head0=0, seq=70)
    with K.switched(True):
        fast = _run(q, k, v, dy, drop=drop)
    with K.switched(False):
        ref = _run(q, k, v, dy, drop=drop)
    tol = 1e-12 if dtype == np.float64 else 2e-5
    for a, b in zip(fast, ref):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_backward_matches_finite_differences(small_tiles, dropout):
    small_tiles(4, 4)  # 3 query stripes, up to 3 key tiles
    B, H, T, hs = 1, 2, 10, 3
    q, k, v, w = _inputs(B, H, T, T, hs, seed=4)
    drop = AttnDropout(dropout, key=3, row0=0, n_head=H, head0=0, seq=T) if dropout else None
    _, dq, dk, dv = _run(q, k, v, w, drop=drop)

    def loss(qq, kk, vv) -> float:
        y = np.empty(qq.shape)
        attend_fwd(qq, kk, vv, y, scale=1 / math.sqrt(hs), drop=drop)
        return float((y * w).sum())

    rng, eps = np.random.default_rng(1), 1e-6
    for which, grad in enumerate((dq, dk, dv)):
        for _ in range(8):
            i = tuple(int(rng.integers(0, n)) for n in q.shape)
            args = [q.copy(), k.copy(), v.copy()]
            args[which][i] += eps
            up = loss(*args)
            args[which][i] -= 2 * eps
            assert (up - loss(*args)) / (2 * eps) == pytest.approx(grad[i], rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("T", [33, 300])  # one stripe (read in place), several (copied)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gradients_into_any_views_are_the_same_bits(products, T, dtype):
    """The compiled backward adds dq, dk, dv straight into gradients whose rows are
    contiguous, and through buffers into any others (every other element of a wider array,
    here): the same bits either way, and a second call adds to what the first left."""
    q, k, v, dy = _inputs(2, 3, T, T, 8, dtype, seed=3)
    scale = 1.0 / math.sqrt(8)
    y = np.empty(q.shape, q.dtype)
    lse = attend_fwd(q, k, v, y, scale=scale)
    dd = row_dots(dy, y)
    plain = [np.zeros_like(x) for x in (q, k, v)]
    wide = [np.zeros((*x.shape[:-1], 2 * x.shape[-1]), dtype)[..., ::2] for x in (q, k, v)]
    for grads in (plain, wide):
        for _ in range(2):
            attend_bwd(q, k, v, dy, lse, dd, *grads, scale=scale)
    for a, b, name in zip(plain, wide, ("dq", "dk", "dv")):
        np.testing.assert_array_equal(a, b, err_msg=name)
    once = [np.zeros_like(x) for x in (q, k, v)]
    attend_bwd(q, k, v, dy, lse, dd, *once, scale=scale)
    np.testing.assert_allclose(plain[0], 2 * once[0], rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-6)


def test_strided_views_in_and_out():
    """The block passes q, k, v as views of the QKV output [B, T, 3, H, hs] and y as a view
    of [B, T, H, hs]: the same results as contiguous arrays."""
    B, T, H, hs = 2, 33, 3, 8
    qkv = np.random.default_rng(2).standard_normal((B, T, 3, H, hs))
    q, k, v = qkv.transpose(2, 0, 3, 1, 4)
    out = np.empty((B, T, H, hs))
    lse = attend_fwd(q, k, v, out.transpose(0, 2, 1, 3), scale=0.3)
    y = np.empty((B, H, T, hs))
    lse2 = attend_fwd(*(np.ascontiguousarray(a) for a in (q, k, v)), y, scale=0.3)
    np.testing.assert_array_equal(out.transpose(0, 2, 1, 3), y)
    np.testing.assert_array_equal(lse, lse2)


def test_causal_attention_is_causal():
    B, H, T, hs = 2, 2, 6, 4
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((B, H, T, hs)) for _ in range(3))
    y = np.empty_like(q)
    causal_attention_fwd(q, k, v, y)
    for t in range(T - 1):
        q2, k2, v2 = q.copy(), k.copy(), v.copy()
        for a in (q2, k2, v2):
            a[..., t + 1:, :] = rng.standard_normal(a[..., t + 1:, :].shape) * 10
        y2 = np.empty_like(q)
        causal_attention_fwd(q2, k2, v2, y2)
        np.testing.assert_array_equal(y2[..., : t + 1, :], y[..., : t + 1, :])
        assert not np.allclose(y2[..., t + 1:, :], y[..., t + 1:, :])
    np.testing.assert_allclose(y[..., 0, :], v[..., 0, :], rtol=1e-14)  # position 0 sees only itself


def test_dropout_pattern_depends_on_global_coordinates_only():
    """A rank holding rows 1.., heads 2..3 and positions 4..11 of a whole sequence of 16
    sees exactly that part of the one-rank pattern; the drop rate is p."""
    whole = AttnDropout(0.25, key=7, row0=0, n_head=4, head0=0, seq=16)
    pos = np.arange(16)
    part = AttnDropout(0.25, key=7, row0=1, n_head=4, head0=2, seq=16)
    for b in range(2):
        for h in range(2):
            got = keep_mask(part, b, h, pos[4:12], pos)
            np.testing.assert_array_equal(got, keep_mask(whole, b + 1, h + 2, pos, pos)[4:12])
    big = AttnDropout(0.25, key=11, row0=0, n_head=1, head0=0, seq=512)
    rate = 1 - keep_mask(big, 0, 0, np.arange(512), np.arange(512)).mean()
    assert abs(rate - 0.25) < 0.01  # 262,144 draws: the standard error is ~0.001
    other = AttnDropout(0.25, key=12, row0=0, n_head=1, head0=0, seq=512)
    assert (keep_mask(other, 0, 0, pos, pos) != keep_mask(big, 0, 0, pos, pos)).any()


@pytest.mark.bits
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
# threads take runs of (query head, stripe pair) units, heads cut between runs; with GQA the
# query heads of one kv head
@pytest.mark.parametrize("B,H,Hkv", [(3, 2, 2), (1, 1, 1), (1, 6, 2), (2, 3, 1), (1, 9, 3)])
def test_results_do_not_depend_on_the_thread_count(with_threads, small_tiles, products, dtype, B, H, Hkv):
    small_tiles(8, 16)
    q, k, v, dy = _inputs(B, H, 40, 40, 8, dtype, kv_heads=Hkv)
    drop = AttnDropout(0.2, key=1, row0=0, n_head=H, head0=0, seq=40)
    results = []
    for n in (1, 2, 3):
        with_threads(n)
        results.append(_run(q, k, v, dy, drop=drop))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


@pytest.mark.bits
@pytest.mark.parametrize("g", [2, 3, 8])
def test_query_heads_shares_are_added_in_order_on_any_thread_count(with_threads, monkeypatch, g):
    """`add_shares`: dk += the g query heads' shares summed over axis 2, numpy's order and
    bits, into a strided view (k's columns of a QKV gradient buffer), its key rows split
    over the threads; nothing outside the view written."""
    monkeypatch.setattr(A, "ELEMENTWISE_CHUNK", 64)  # split even these few rows
    rng = np.random.default_rng(g)
    scales = 10.0 ** rng.integers(-4, 5, (2, 3, g, 50, 1))  # sums that round differently in another order
    shares = (rng.standard_normal((2, 3, g, 50, 8)) * scales).astype(np.float32)
    store = rng.standard_normal((2, 50, 7, 8)).astype(np.float32)  # [B, T, heads, hs]

    def view(x):
        return x[:, :, 2:5].transpose(0, 2, 1, 3)[:, :, None]  # [B, 3, 1, T, hs]

    want = view(store).copy()
    want += shares.sum(axis=2, keepdims=True)
    for n in (1, 2, 3):
        with_threads(n)
        got = store.copy()
        A.add_shares(view(got), shares)
        assert np.ascontiguousarray(view(got)).tobytes() == want.tobytes()
        np.testing.assert_array_equal(got[:, :, :2], store[:, :, :2])
        np.testing.assert_array_equal(got[:, :, 5:], store[:, :, 5:])


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("kernels", KERNELS)
def test_nothing_of_size_t_by_t_is_allocated(kernels, n_threads, with_threads, monkeypatch):
    """At T = 2048 a [T, T] float32 array is 16 MiB; forward and backward together must
    peak far below that: three stripes of 128 × 2048 × 4 B = 1 MiB in backward on each
    thread running at once, and a few [T, hs] arrays (the head's contiguous copies, its dq,
    dk, dv sums, and with the head cut between two runs (2 cores) the second part's dk, dv
    sums). The thread count is set here: with two, both runs hold their stripes at once
    (a test before this one that left two threads made it fail here)."""
    if kernels and not K.HAVE_NUMBA:
        pytest.skip("numba is not installed")
    with_threads(n_threads)
    monkeypatch.setattr(threads, "_cores", 2)  # whatever this machine has: the head cut in two runs
    q, k, v, dy = _inputs(1, 1, 2048, 2048, 16, np.float32)
    y = np.empty_like(q)
    dq, dk, dv = (np.zeros_like(x) for x in (q, k, v))
    with K.switched(kernels):
        _run(q[:, :, :8], k[:, :, :8], v[:, :, :8], dy[:, :, :8])  # compile outside the measurement
        tracemalloc.start()
        ctx = causal_attention_fwd(q, k, v, y)
        causal_attention_bwd(ctx, dy, dq, dk, dv)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < n_threads * 3 * 2**20 + 16 * 2048 * 16 * 4, f"peak {peak / 2**20:.1f} MiB on {n_threads} threads"


@pytest.mark.parametrize("u0,u1,Hk,g,cap", [(0, 9, 3, 3, 4), (2, 7, 3, 3, 4), (4, 5, 3, 3, 1), (0, 24, 2, 4, 2),
                                            (1, 12, 4, 1, 8)])
def test_head_groups_cover_the_query_heads_in_order(u0, u1, Hk, g, cap):
    """The units threads split the query heads into: each query head (b, kv head, i) once, in
    order, whole kv groups at most `cap` pairs at a time."""
    heads = []
    for grp in A._head_groups(u0, u1, Hk, g, cap):
        assert grp.size <= cap
        heads += [(b * Hk + h) * g + i for b in range(grp.b.start, grp.b.stop)
                  for h in range(grp.h.start, grp.h.stop) for i in grp.heads(g)]
    assert heads == list(range(u0, u1))


@pytest.mark.parametrize("u0,u1,H,cap", [(0, 12, 4, 8), (3, 11, 4, 8), (0, 12, 4, 3), (5, 6, 4, 1), (0, 7, 1, 4)])
def test_groups_cover_the_pairs_in_order(u0, u1, H, cap):
    """The (row, head) rectangles a run of pairs is batched as: each pair once, in order,
    at most `cap` pairs each."""
    seen = []
    for g in A._groups(u0, u1, H, cap):
        assert 0 < g.size <= cap
        seen += [b * H + h for b in range(g.b.start, g.b.stop) for h in range(g.h.start, g.h.stop)]
    assert seen == list(range(u0, u1))


@pytest.mark.parametrize("heads,pairs,cores", [(9, 8, 2), (1, 3, 16), (4, 8, 2), (3, 1, 16), (5, 4, 3)])
def test_unit_runs_cover_every_head_and_pair_once(monkeypatch, heads, pairs, cores):
    """The runs the threads take: one per core (at most one per unit), near-equal, and as
    items each (query head, pair) once in order, whole heads together and a head cut
    between runs alone with its pairs."""
    monkeypatch.setattr(threads, "_cores", cores)
    runs = A._unit_runs(heads, pairs)
    assert len(runs) == min(cores, heads * pairs)
    assert max(u1 - u0 for u0, u1 in runs) - min(u1 - u0 for u0, u1 in runs) <= 1
    seen = []
    for u0, u1 in runs:
        for h0, h1, part in A._run_items(u0, u1, pairs):
            assert part is None or h1 == h0 + 1
            seen += [h * pairs + j for h in range(h0, h1) for j in range(pairs)[part or slice(None)]]
    assert seen == list(range(heads * pairs))


@pytest.mark.bits
def test_a_block_run_as_pieces_cuts_no_head(small_tiles, monkeypatch):
    """Inside a block run as pieces, attention sees a run of the pieces (all of them on one
    thread, half on each of two): computed on 4 sequences at once or 2 and 2, the bits are
    the same. Cutting heads by cores there would cut 4 × 3 heads × 3 stripe pairs into
    whole heads, and 2 × 3 × 3 into runs of 4.5 units, summing dk, dv differently."""
    small_tiles(8, 16)
    monkeypatch.setattr(threads, "_cores", 4)
    q, k, v, dy = _inputs(4, 3, 40, 40, 8, np.float64)
    with threads.token_pieces((slice(0, 40), slice(40, 80))):
        whole = _run(q, k, v, dy)
        halves = [_run(*(x[r] for x in (q, k, v, dy))) for r in (slice(0, 2), slice(2, 4))]
    for a, b in zip(whole, (np.concatenate(parts) for parts in zip(*halves))):
        np.testing.assert_array_equal(a, b)


def test_stripe_pairs_balance_causal_work():
    """Stripes paired first-with-last: with whole stripes every pair (but a lone middle
    one) sees the same keys."""
    for T in (128, 1024, 2048):
        for qt in (A.TILE_QUERIES, A.QUERY_TILE):
            pairs = A._stripe_pairs(T, qt)
            assert sorted(q for p in pairs for q in p) == list(range(0, T, qt))
            work = {sum(min(T, q + qt) for q in p) for p in pairs if len(p) == 2}
            assert len(work) <= 1


def test_stripes_are_shorter_where_tile_gemm_multiplies_them(products):
    """The stripe height follows the products: TILE_QUERIES rows where tile_gemm multiplies
    the tiles, QUERY_TILE where BLAS does, and QUERY_TILE in the Python loops; the kernel's
    stripe loops are handed that height."""
    _compiled_gemm()
    assert A.TILE_QUERIES < A.QUERY_TILE
    want = A.TILE_QUERIES if products == "tile" else A.QUERY_TILE
    assert A.query_tile(np.float32, 64) == want
    seen = []
    real = A.AK.group_fwd
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(A.AK, "group_fwd", lambda *a: seen.append((list(a[8]), a[9])) or real(*a))
        q, k, v, _ = _inputs(1, 2, 256, 256, 64, np.float32)
        A.attend_fwd(q, k, v, np.empty_like(q), scale=0.125)
    assert seen and {qt for _, qt in seen} == {want}
    assert sorted({int(q0) for starts, _ in seen for q0 in starts}) == list(range(0, 256, want))
    with K.switched(False):
        assert A.query_tile(np.float32, 64) == A.QUERY_TILE


@pytest.mark.parametrize("p", [1.0, -0.5, 1.5, float("nan")])
def test_a_dropout_key_refuses_a_rate_outside_0_to_1(p: float) -> None:
    """p = 1 was a ZeroDivisionError, -0.5 an OverflowError in the attention hash's
    threshold, and 1.5 trained on silently."""
    from numesh.nn.dropout import DropoutKey

    with pytest.raises(ValueError, match="a DropoutKey's rate p must be in \\[0, 1\\)"):
        DropoutKey(p, 0, 0, 0, 2)
