"""The attention kernel's stripe loops compiled whole: one GIL-free call per group of heads.

numesh.nn.attention walks each group of (batch row, kv head, query head) in stripes of
query rows and key tiles; in Python each stripe is ~15 NumPy and numba calls, and each
call hands the GIL to the other thread and waits to get it back. With two threads the
waits cost a quarter of the kernel (`python benchmarks/bench_long_context.py --sections
loops`). `group_fwd` and `group_bwd` run the same loops compiled, calling numpy's own
GEMM (`numesh.host.blas.gemm`) and the same stripe passes (`numesh.host.kernels.stripe_*`),
so a thread takes the GIL once per group. They compute what `_stripe_fwd`/`_stripe_bwd`
compute, head by head in the same order, the gradients accumulated in the GEMM (beta = 1)
rather than as a product then an add, and the 1/sqrt(hs) scale applied as the GEMMs' alpha
rather than to a copy of q. Dropout draws from the same stream (`key`,
`threshold`, `inv_keep`; threshold 0: none) at the same counters: `base` [G, T] each
query's counter base (`AttnDropout.row_base`), `kpos` [Tk] the keys' positions.

Arrays (shapes as in numesh.nn.attention's `_group_fwd`/`_group_bwd`): q, dy, dq
[nb, nh, g, T, hs], k, v [nb, nh, 1, Tk, hs] and dk, dv [nb, nh, g, Tk, hs] (each query
head's share) with each row of hs contiguous, rows at any stride (the GEMMs' leading
dimensions, `_ld`: a group of one stripe reads q, k, v in place in the QKV buffer), q
unscaled; y [nb, nh, g, T, hs] and lse [nb, nh, g, T] any view; `buf`s flat scratch of at
least min(KEY_TILE, Tk)·rows: one head's tile of a stripe.
"""

from __future__ import annotations

import numpy as np

from numesh.host.blas import NO_TRANS, TRANS, gemm
from numesh.host.kernels import _JIT, njit, stripe_dropped, stripe_grad, stripe_probs, stripe_probs_grad, stripe_softmax
from numesh.host.tile_gemm import VB, tile_mm

_N, _T = np.int64(NO_TRANS), np.int64(TRANS)


@njit(**_JIT)
def _heads(q):
    """(nb, nh, g, G = nb·nh·g) of a [nb, nh, g, T, hs] array."""
    nb, nh, g = q.shape[0], q.shape[1], q.shape[2]
    return nb, nh, g, nb * nh * g


@njit(**_JIT)
def _ld(a):
    """The row stride, in elements, of a [..., rows, hs] array whose rows are contiguous:
    the GEMMs' leading dimension, so that they read rows where a strided view holds them."""
    if a.shape[a.ndim - 2] <= 1:  # one row: any stride numpy gives it; BLAS wants >= hs
        return np.int64(a.shape[a.ndim - 1])
    return np.int64(a.strides[a.ndim - 2] // a.itemsize)


@njit(**_JIT)
def _prod(fn, ta, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, raw):
    """C = alpha·op(A)·B + beta·C (beta 0 or 1, B not transposed), row-major, addresses a,
    b, c: by the BLAS GEMM at fn, or where fn is 0 by `tile_mm`, which reads A in place."""
    if fn != 0:
        gemm(fn, ta, _N, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
    elif ta == _N:
        tile_mm(m, n, k, alpha, a, lda, np.int64(1), b, ldb, c, ldc, beta != 0, raw)
    else:
        tile_mm(m, n, k, alpha, a, np.int64(1), lda, b, ldb, c, ldc, beta != 0, raw)


@njit(**_JIT)
def _transposed(fn, x, xt):
    """xᵀ [hs, rows] of one head's stripe rows x [rows, hs], copied into xt where `tile_mm`
    reads it (fn 0), once a stripe: the scores' products read its rows."""
    if fn != 0:  # BLAS reads x in place
        return xt[:0].reshape((0, 0))
    rows, hs = x.shape
    t = xt[: hs * rows].reshape((hs, rows))
    for r in range(rows):
        for c in range(hs):
            t[c, r] = x[r, c]
    return t


@njit(**_JIT)
def _scores(fn, alpha, k, ldk, x, xt, keys, out, raw):
    """out [keys, rows] = alpha·K·xᵀ: a key tile's K (address k, row stride ldk) against x
    [rows, hs], one head's query (or dy) rows of a stripe: BLAS reads x transposed in
    place, `tile_mm` reads xt = xᵀ (`_transposed`)."""
    rows, hs = x.shape
    if fn != 0:
        gemm(fn, _N, _T, np.int64(keys), np.int64(rows), np.int64(hs), alpha, k, ldk, x.ctypes.data, _ld(x),
             x.dtype.type(0.0), out, np.int64(rows))
    else:
        tile_mm(np.int64(keys), np.int64(rows), np.int64(hs), alpha, k, ldk, np.int64(1), xt.ctypes.data,
                np.int64(rows), out, np.int64(rows), False, raw)


@njit(**_JIT)
def _empty(n, like):
    """np.empty(n) of like's dtype, its data on a 64-byte boundary (numesh.host.aligned: a
    vector load from `tile_mm`'s operands then reads one cache line, not two)."""
    raw = np.empty(n + 64 // like.itemsize, like.dtype)
    start = (-raw.ctypes.data) % 64 // like.itemsize
    return raw[start:start + n]


@njit(**_JIT)
def _scratch(fn, q, qt, kt):
    """xt and raw for `_scores` and `_prod`: room for a stripe's qᵀ and dyᵀ, and `tile_mm`'s
    partial sums, where the tile products run (fn 0); BLAS needs neither."""
    if fn != 0:
        return np.empty(0, q.dtype), np.empty(0, q.dtype)
    w = VB // q.itemsize
    hs = q.shape[4]
    return _empty(2 * hs * qt, q), _empty(max(qt, kt) * 4 * w, q)


@njit(**_JIT)
def group_fwd(fn, q, k, v, y, lse, scale, diag, starts, qt, kt, buf, key, threshold, inv_keep, base, kpos):
    """The stripes starting at `starts` (qt query rows each, key tiles of kt): y's rows and
    each row's log-sum-exp, as numesh.nn.attention's `_stripe_fwd` writes them. q, k, v
    unscaled, each row of hs contiguous but rows any stride (`_ld`): the scores' GEMM
    applies `scale`. Head by head, each through its key tiles: a tile's scores' GEMM,
    softmax and P·V while the tile is in cache, qᵀ copied once a stripe (`_transposed`)."""
    nb, nh, g, G = _heads(q)
    T, hs, Tk = q.shape[3], q.shape[4], k.shape[3]
    one, zero = q.dtype.type(1.0), q.dtype.type(0.0)
    hs64, ldk, ldv = np.int64(hs), _ld(k), _ld(v)
    xt, raw = _scratch(fn, q, qt, kt)
    pv = _empty(qt * hs, q).reshape((qt, hs))
    acc = _empty(G * qt * hs, q).reshape((G, qt, hs))
    for q0 in starts:
        q1 = min(T, q0 + qt)
        rows = q1 - q0
        nr = np.int64(rows)
        m = np.full((G, rows), -np.inf, q.dtype)
        l = np.zeros((G, rows), q.dtype)
        alpha = np.empty((G, rows), q.dtype)
        base_s = np.ascontiguousarray(base[:, q0:q1])
        end = min(Tk, q1 + diag)
        for b in range(nb):
            for h in range(nh):
                for i in range(g):
                    x = (b * nh + h) * g + i
                    qs = q[b, h, i, q0:q1]
                    tq = _transposed(fn, qs, xt)
                    for j0 in range(0, end, kt):
                        keys, vis0 = min(end, j0 + kt) - j0, q0 + diag + 1 - j0
                        s = buf[: keys * rows].reshape((1, keys, rows))  # one head's scores [1, keys, rows]
                        _scores(fn, scale, k[b, h, 0, j0:].ctypes.data, ldk, qs, tq, keys, s.ctypes.data, raw)
                        stripe_softmax(s, vis0, m[x:x + 1], l[x:x + 1], alpha[x:x + 1], key, threshold, inv_keep,
                                       base_s[x:x + 1], kpos[j0:j0 + keys])
                        _prod(fn, _T, nr, hs64, np.int64(keys), one, s.ctypes.data, nr, v[b, h, 0, j0:].ctypes.data,
                              ldv, zero, pv.ctypes.data, hs64, raw)
                        _fold(acc[x], pv, alpha[x], rows, j0 == 0)
                    for r in range(rows):
                        lx = l[x, r]
                        for c in range(hs):
                            y[b, h, i, q0 + r, c] = acc[x, r, c] / lx
                        lse[b, h, i, q0 + r] = m[x, r] + np.log(lx)


@njit(**_JIT)
def _fold(acc, pv, alpha, rows, first):
    """acc [qt, hs] <- a key tile's P·V rows (the first tile), or acc·alpha + P·V."""
    for r in range(rows):
        a = alpha[r]
        for c in range(acc.shape[1]):
            acc[r, c] = pv[r, c] if first else acc[r, c] * a + pv[r, c]


@njit(**_JIT)
def group_bwd(fn, q, k, v, dy, lse, dd, dq, dk, dv, scale, diag, starts, qt, kt, p_buf, dp_buf, pd_buf, key,
              threshold, inv_keep, base, kpos):
    """The group's stripes starting at `starts`, in order: dq, and each query head's share
    of dk and dv, accumulated as numesh.nn.attention's `_stripe_bwd` does (added to what
    they hold: the GEMMs' beta is 1); q unscaled (the GEMMs that read it, and dq's, apply
    `scale`); q, k, v, dy, dq, dk, dv rows of hs contiguous at any stride; lse and dd [nb,
    nh, g, T] C-contiguous. Head by head, as `group_fwd`; without dropout
    d(probabilities)' GEMM runs first, so that one sweep makes the probabilities and
    d(scores) (`stripe_probs_grad`)."""
    nb, nh, g, G = _heads(q)
    T, hs, Tk = q.shape[3], q.shape[4], k.shape[3]
    one = q.dtype.type(1.0)
    hs64, ldq, ldk, ldv, ldy = np.int64(hs), _ld(q), _ld(k), _ld(v), _ld(dy)
    ldq_out, ldk_out, ldv_out = _ld(dq), _ld(dk), _ld(dv)
    xt, raw = _scratch(fn, q, qt, kt)
    lse2, dd2 = lse.reshape((G, T)), dd.reshape((G, T))
    for q0 in starts:
        q1 = min(T, q0 + qt)
        rows = q1 - q0
        nr = np.int64(rows)
        lse_s, dd_s = np.ascontiguousarray(lse2[:, q0:q1]), np.ascontiguousarray(dd2[:, q0:q1])
        base_s = np.ascontiguousarray(base[:, q0:q1])
        end = min(Tk, q1 + diag)
        for b in range(nb):
            for h in range(nh):
                for i in range(g):
                    x = (b * nh + h) * g + i
                    qs, dys = q[b, h, i, q0:q1], dy[b, h, i, q0:q1]
                    tq, tdy = _transposed(fn, qs, xt), _transposed(fn, dys, xt[hs * qt:])
                    for j0 in range(0, end, kt):
                        keys, vis0 = min(end, j0 + kt) - j0, q0 + diag + 1 - j0
                        nk, kpos_s = np.int64(keys), kpos[j0:j0 + keys]
                        p = p_buf[: keys * rows].reshape((1, keys, rows))  # one head's [1, keys, rows]
                        dp = dp_buf[: keys * rows].reshape((1, keys, rows))
                        dropped = p if threshold == 0 else pd_buf[: keys * rows].reshape((1, keys, rows))
                        _scores(fn, scale, k[b, h, 0, j0:].ctypes.data, ldk, qs, tq, keys, p.ctypes.data, raw)
                        _scores(fn, one, v[b, h, 0, j0:].ctypes.data, ldv, dys, tdy, keys, dp.ctypes.data,
                                raw)  # d(probabilities)
                        if threshold == 0:
                            stripe_probs_grad(p, dp, vis0, lse_s[x:x + 1], dd_s[x:x + 1])
                        else:
                            stripe_probs(p, vis0, lse_s[x:x + 1])  # the attention probabilities
                            stripe_dropped(p, dropped, key, threshold, inv_keep, base_s[x:x + 1], kpos_s)
                            stripe_grad(p, dp, dd_s[x:x + 1], key, threshold, inv_keep, base_s[x:x + 1], kpos_s)
                        # dv with the weights the values were averaged with; dq, dk with d(scores)
                        _prod(fn, _N, nk, hs64, nr, one, dropped.ctypes.data, nr, dy[b, h, i, q0:].ctypes.data, ldy,
                              one, dv[b, h, i, j0:].ctypes.data, ldv_out, raw)
                        _prod(fn, _T, nr, hs64, nk, scale, dp.ctypes.data, nr, k[b, h, 0, j0:].ctypes.data, ldk,
                              one, dq[b, h, i, q0:].ctypes.data, ldq_out, raw)
                        _prod(fn, _N, nk, hs64, nr, scale, dp.ctypes.data, nr, q[b, h, i, q0:].ctypes.data, ldq,
                              one, dk[b, h, i, j0:].ctypes.data, ldk_out, raw)
