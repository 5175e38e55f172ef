"""Fused kernels for the Llama kind's memory-bound parts: RMSNorm, SwiGLU's gating and rotary
position embeddings, compiled with numba as numesh/host/kernels.py's are (its `njit`
set-up: cached on disk, `nogil`, no fastmath, so the same bits on every run).

NumPy runs each of these as several passes over activation-sized arrays, with temporaries:
RMSNorm's backward five, SwiGLU's backward seven, a rotation five (the rotate-half
`concatenate` among them). A kernel here makes one pass per row, and works on any run of
rows of preallocated outputs, so numesh.nn splits rows over its threads (`over_rows`, and
`tree_sum` over fixed tiles for RMSNorm's weight gradient). The readable NumPy versions
are the `*_reference` functions in numesh/nn/layers.py and numesh/nn/rotary.py, and
tests/test_llama_kernels.py holds each kernel to its reference.

SwiGLU's sigmoid takes its exponential from numesh/host/kernels.py's `vexp` (float32: the
vectorised `exp32`), inside the one pass.
"""

from __future__ import annotations

import math

import numpy as np

from numesh.host.kernels import _JIT, njit, vexp
from numesh.host.lanes import row_dot

# ---------------------------------------------------------------------------------------
# RMSNorm over the last dim of x [N, C]


@njit(**_JIT)
def rmsnorm_fwd(x, w, eps, y, xhat, rstd):
    """y = x * rstd * w per row, rstd = 1/sqrt(mean(x²) + eps); also xhat = x * rstd and
    rstd [N] for backward. The mean is accumulated in float64 (`row_dot`'s lanes)."""
    n, c = x.shape
    cast = x.dtype.type
    for i in range(n):
        r = cast(1.0 / math.sqrt(row_dot(x, x, i, c) / c + eps))
        rstd[i] = r
        for j in range(c):
            h = x[i, j] * r
            xhat[i, j] = h
            y[i, j] = h * w[j]


@njit(**_JIT)
def rmsnorm_bwd(dy, xhat, rstd, w, dx, dw):
    """dx [N, C] = rstd * (dy·w - xhat * mean(dy·w * xhat)) per row, and dw [C] = Σ_rows
    dy * xhat in float64 (this call's rows). dx holds dy·w in between."""
    n, c = dy.shape
    for j in range(c):
        dw[j] = 0.0
    cast = dx.dtype.type
    for i in range(n):
        for j in range(c):
            g = dy[i, j]
            dw[j] += g * xhat[i, j]
            dx[i, j] = g * w[j]
        m = cast(row_dot(dx, xhat, i, c) / c)
        r = rstd[i]
        for j in range(c):
            dx[i, j] = (dx[i, j] - xhat[i, j] * m) * r


# ---------------------------------------------------------------------------------------
# SwiGLU's gating on flat arrays: y = silu(gate) * up, silu(g) = g * sigmoid(g)


@njit(**_JIT)
def swiglu_fwd(gate, up, y):
    """y = gate * sigmoid(gate) * up, sigmoid(g) = 1/(1 + exp(-g)). The sigmoid is not kept:
    backward computes it again from gate, bit for bit (`swiglu_bwd`), which costs an exp
    there but spares a stored [tokens, F] array per block and a stream each way."""
    one = gate.dtype.type(1.0)
    for i in range(gate.shape[0]):
        g = gate[i]
        s = one / (one + vexp(-g))
        y[i] = g * s * up[i]


@njit(**_JIT)
def swiglu_bwd(gate, up, dy, dgate, dup):
    """dgate = dy * up * s * (1 + gate * (1 - s)) (silu's derivative), dup = dy * silu(gate),
    with s = sigmoid(gate) computed as `swiglu_fwd` computes it."""
    one = gate.dtype.type(1.0)
    for i in range(gate.shape[0]):
        g, d = gate[i], dy[i]
        s = one / (one + vexp(-g))
        dgate[i] = d * up[i] * s * (one + g * (one - s))
        dup[i] = d * (g * s)


# ---------------------------------------------------------------------------------------
# rotary embeddings on x [B, T, H, d] (any strides: q and k may be views of one projection),
# rows r = b·T + t in [r0, r1), tables cos, sin [T, d]


@njit(**_JIT)
def rope(x, cos, sin, inverse, out, r0, r1):
    """out = x rotated by its token's angles (rotate-half layout: pair (j, j + d/2)), or by
    minus them when `inverse` (the backward). out may be x: each pair is read before it is
    written."""
    T, H, d = x.shape[1], x.shape[2], x.shape[3]
    h = d // 2
    for r in range(r0, r1):
        b, t = r // T, r % T
        for k in range(H):
            for j in range(h):
                x1, x2 = x[b, t, k, j], x[b, t, k, j + h]
                if inverse:
                    o1 = x1 * cos[t, j] + x2 * sin[t, j]
                    o2 = x2 * cos[t, j + h] - x1 * sin[t, j + h]
                else:
                    o1 = x1 * cos[t, j] - x2 * sin[t, j]
                    o2 = x2 * cos[t, j + h] + x1 * sin[t, j + h]
                out[b, t, k, j] = o1
                out[b, t, k, j + h] = o2


def warm_up(dtype) -> None:
    """Compile (or load from the disk cache) these kernels for `dtype` on tiny arrays, at
    start-up as numesh.host.kernels.warm_up does for the others."""
    from numesh.host.kernels import enabled, warm_rows

    if not enabled():
        return
    f = np.dtype(dtype).type
    x, w, r, y, xh, dx = warm_rows(dtype)
    rmsnorm_fwd(x, w, 1e-5, y, xh, r)
    rmsnorm_bwd(x, xh, r, w, dx, np.empty(4, np.float64))
    flat = x.reshape(-1)
    swiglu_fwd(flat, flat, y.reshape(-1))
    swiglu_bwd(flat, flat, flat, y.reshape(-1), dx.reshape(-1))
    q = np.ones((1, 2, 2, 4), f)
    rope(q, x, x, False, q, 0, 2)  # C-contiguous, in place
    rope(q[:, :, :1], x, x, True, q[:, :, :1], 0, 2)  # a view of a fused projection
