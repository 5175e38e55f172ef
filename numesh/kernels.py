"""Fused kernels for the memory-bound work of a step, compiled with numba when it is installed.

NumPy runs LayerNorm, GELU, the attention softmax, the cross-entropy and AdamW as many
separate passes over activation-sized arrays (LayerNorm backward alone is ~10), each with
its own call overhead and a trip through memory. A kernel here does each of them in one or
two passes per row. The readable NumPy versions stay where they were (numesh/nn/layers.py,
numesh/nn/parallel.py, numesh/optim/adamw.py, the `*_reference` functions); tests check
every kernel against its reference (float64 to 1e-12) and the parity suites run on them.

Every kernel works on plain C-contiguous arrays, writes only its own rows of preallocated
outputs and holds no Python state, so callers may split rows over numesh's threads
(`nogil=True`: numba releases the GIL inside). `fastmath=False` keeps the results
reproducible: no reassociation, no fused multiply-add contraction.

Compiled code is cached on disk (`cache=True`) next to this file, or, when the package
directory is not writable (a system install), in $NUMBA_CACHE_DIR, which `_cache_dir`
points at $XDG_CACHE_HOME/numesh/numba (~/.cache/numesh/numba) unless the user set it.
Signatures are compiled lazily, so only the dtypes a run uses are compiled.

`enabled()` says whether the kernels are used: numba is importable and NUMESH_KERNELS is
not "numpy" (the switch the A/B benchmarks and the reference tests use). Any value other than
numba, numpy or empty is a ConfigError from `check_mode()`, which commands call at start-up.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np

LN_EPS = 1e-5
GELU_K = math.sqrt(2.0 / math.pi)
GELU_C = 0.044715


def _cache_dir() -> None:
    """Point numba's cache at a user directory when the package directory is read-only."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    here = Path(__file__).resolve().parent
    if os.access(here, os.W_OK):
        return  # numba writes __pycache__/ beside this file
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    target = base / "numesh" / "numba"
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError:
        target = Path(tempfile.gettempdir()) / f"numesh-numba-{os.getuid() if hasattr(os, 'getuid') else 0}"
        target.mkdir(parents=True, exist_ok=True)
    os.environ["NUMBA_CACHE_DIR"] = str(target)


_MODE = os.environ.get("NUMESH_KERNELS", "numba").strip().lower()
MODES = ("numba", "numpy")  # and unset or empty: numba when installed
try:
    if _MODE == "numpy":
        raise ImportError("NUMESH_KERNELS=numpy")
    _cache_dir()
    from numba import njit

    HAVE_NUMBA = True
except ImportError:  # the NumPy references are used
    HAVE_NUMBA = False

    def njit(*args, **kwargs):  # type: ignore[no-redef]
        """Without numba, a kernel stays a (slow, correct) Python function: tests may still call it."""
        return (lambda f: f) if not args or not callable(args[0]) else args[0]


_JIT = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")


_on = HAVE_NUMBA


def check_mode() -> None:
    """A NUMESH_KERNELS this module does not know is a one-line error (a ConfigError), raised
    at a command's start-up rather than here at import: `cuda` once ran numba silently."""
    if _MODE not in MODES and _MODE != "":
        from numesh.errors import ConfigError

        raise ConfigError(f"NUMESH_KERNELS={os.environ.get('NUMESH_KERNELS', '')!r} is not one of "
                          f"{', '.join(MODES)} (or unset/empty for numba when installed)")


def enabled() -> bool:
    """Whether the layers use these kernels (numba installed, NUMESH_KERNELS != numpy)."""
    return _on


@contextlib.contextmanager
def switched(on: bool) -> Iterator[None]:
    """Use the kernels (on, if numba is installed) or the NumPy references inside the block:
    how the tests compare the two and the benchmarks alternate them in one process."""
    global _on
    saved = _on
    _on = on and HAVE_NUMBA
    try:
        yield
    finally:
        _on = saved


# ---------------------------------------------------------------------------------------
# row sums with four accumulators: without fastmath LLVM may not reorder a sum, so one
# accumulator is a chain of dependent adds (~4 cycles each); four chains run side by side.
# Measured on the default model's LayerNorm (768 rows × 128): one accumulator 199 µs, four
# ~70 µs, NumPy's 6 passes 118 µs. The order is fixed, so results stay reproducible.


@njit(**_JIT)
def _row_sum(a, i, n):
    """Σ_{j<n} a[i, j], in float64."""
    s0 = 0.0
    s1 = 0.0
    s2 = 0.0
    s3 = 0.0
    j = 0
    while j + 4 <= n:
        s0 += a[i, j]
        s1 += a[i, j + 1]
        s2 += a[i, j + 2]
        s3 += a[i, j + 3]
        j += 4
    while j < n:
        s0 += a[i, j]
        j += 1
    return (s0 + s1) + (s2 + s3)


@njit(**_JIT)
def _row_dot(a, b, i, n):
    """Σ_{j<n} a[i, j]·b[i, j], in float64."""
    s0 = 0.0
    s1 = 0.0
    s2 = 0.0
    s3 = 0.0
    j = 0
    while j + 4 <= n:
        s0 += a[i, j] * b[i, j]
        s1 += a[i, j + 1] * b[i, j + 1]
        s2 += a[i, j + 2] * b[i, j + 2]
        s3 += a[i, j + 3] * b[i, j + 3]
        j += 4
    while j < n:
        s0 += a[i, j] * b[i, j]
        j += 1
    return (s0 + s1) + (s2 + s3)


# ---------------------------------------------------------------------------------------
# LayerNorm over the last dim of x [N, C]


@njit(**_JIT)
def layernorm_fwd(x, w, b, has_b, y, xhat, rstd):
    """y = (x - mean) / sqrt(var + eps) * w (+ b) per row; also xhat and rstd [N] for backward.

    Sums are accumulated in float64 whatever the dtype (two passes: mean, then the centred
    variance, as the reference; xhat holds x - mean in between)."""
    n, c = x.shape
    cast = x.dtype.type  # elementwise math in the array's dtype (8 float32 lanes, not 4 float64)
    for i in range(n):
        mu = cast(_row_sum(x, i, c) / c)
        for j in range(c):
            xhat[i, j] = x[i, j] - mu
        r = cast(1.0 / math.sqrt(_row_dot(xhat, xhat, i, c) / c + LN_EPS))
        rstd[i] = r
        if has_b:
            for j in range(c):
                h = xhat[i, j] * r
                xhat[i, j] = h
                y[i, j] = h * w[j] + b[j]
        else:
            for j in range(c):
                h = xhat[i, j] * r
                xhat[i, j] = h
                y[i, j] = h * w[j]


@njit(**_JIT)
def layernorm_bwd(dy, xhat, rstd, w, dx, dw, db):
    """dx [N, C] of LayerNorm, and dw, db [C] summed over rows (float64 accumulators).

    dx holds dy·w in between (the row sums read it)."""
    n, c = dy.shape
    for j in range(c):
        dw[j] = 0.0
        db[j] = 0.0
    for i in range(n):
        for j in range(c):
            g = dy[i, j]
            dw[j] += g * xhat[i, j]
            db[j] += g
            dx[i, j] = g * w[j]
        cast = dx.dtype.type
        mean_d = cast(_row_sum(dx, i, c) / c)
        mean_dx = cast(_row_dot(dx, xhat, i, c) / c)
        r = rstd[i]
        for j in range(c):
            dx[i, j] = (dx[i, j] - mean_d - xhat[i, j] * mean_dx) * r


# ---------------------------------------------------------------------------------------
# GELU (tanh form), elementwise on flat arrays. numba has no vectorised tanh without Intel's
# SVML (measured: math.tanh ~100 ns an element, NumPy's SIMD tanh 0.36 ns on float32), so
# the tanh is NumPy's, between two fused passes (~85 µs + 142 µs + ~60 µs for the default
# model's 393k elements, against ~400 µs for the reference's seven NumPy passes).


@njit(**_JIT)
def gelu_fwd_pre(x, u):
    """u = k·(x + 0.044715·x³) (then tanh'ed in place by the caller)."""
    k = x.dtype.type(GELU_K)
    c = x.dtype.type(GELU_C)
    for i in range(x.shape[0]):
        v = x[i]
        u[i] = k * (v + c * v * v * v)


@njit(**_JIT)
def gelu_fwd_post(x, t, y):
    """y = 0.5·x·(1 + t) from t = tanh(u)."""
    half = x.dtype.type(0.5)
    one = x.dtype.type(1.0)
    for i in range(x.shape[0]):
        y[i] = half * x[i] * (one + t[i])


@njit(**_JIT)
def gelu_bwd(x, t, dy, dx):
    """dx = dy · (0.5(1+t) + 0.5·x·(1-t²)·k·(1 + 3·0.044715·x²))."""
    f = x.dtype.type
    half, one, k, c3 = f(0.5), f(1.0), f(GELU_K), f(3.0 * GELU_C)
    for i in range(x.shape[0]):
        v = x[i]
        th = t[i]
        d = half * (one + th) + half * v * (one - th * th) * k * (one + c3 * v * v)
        dx[i] = d * dy[i]


# ---------------------------------------------------------------------------------------
# causal softmax over att [M, T, T] (M = batch × heads), in place; NumPy's exp between


@njit(**_JIT)
def causal_softmax_pre(att):
    """Row i: subtract the max of columns 0..i; -inf after column i (exp makes it 0)."""
    m, T, _ = att.shape
    for h in range(m):
        for i in range(T):
            mx = att[h, i, 0]
            for j in range(1, i + 1):
                if att[h, i, j] > mx:
                    mx = att[h, i, j]
            for j in range(i + 1):
                att[h, i, j] -= mx
            for j in range(i + 1, T):
                att[h, i, j] = -np.inf


@njit(**_JIT)
def causal_softmax_post(att):
    """Row i (already exp'ed): divide columns 0..i by their sum."""
    m, T, _ = att.shape
    for h in range(m):
        a = att[h]
        for i in range(T):
            inv = att.dtype.type(1.0 / _row_sum(a, i, i + 1))
            for j in range(i + 1):
                a[i, j] *= inv


def causal_softmax_fwd(att: np.ndarray) -> None:
    """Causal softmax of att [M, T, T] in place: a fused pass, NumPy's SIMD exp, a fused pass."""
    causal_softmax_pre(att)
    np.exp(att, out=att)
    causal_softmax_post(att)


@njit(**_JIT)
def causal_softmax_bwd(a, da):
    """da <- a · (da - Σ_j da·a) per row, in place (zero above the diagonal, where a is 0)."""
    m, T, _ = a.shape
    for h in range(m):
        ah = a[h]
        dh = da[h]
        for i in range(T):
            s = dh.dtype.type(_row_dot(dh, ah, i, i + 1))
            for j in range(i + 1):
                dh[i, j] = ah[i, j] * (dh[i, j] - s)
            for j in range(i + 1, T):
                dh[i, j] = 0.0


# ---------------------------------------------------------------------------------------
# cross-entropy over logits [N, V] (this tp rank's vocabulary columns)


@njit(**_JIT)
def ce_bwd(probs, sumexp, local, dloss):
    """In place: probs <- (exp / sumexp - onehot(target)) · dloss[i] (dloss has 1 or N entries)."""
    n, v = probs.shape
    scalar = dloss.shape[0] == 1
    for i in range(n):
        g = dloss[0] if scalar else dloss[i]
        se = sumexp[i]
        t = local[i]
        for j in range(v):
            probs[i, j] = probs[i, j] / se
            if j == t:
                probs[i, j] -= 1.0
            probs[i, j] *= g


# ---------------------------------------------------------------------------------------
# AdamW on flat buffers


@njit(**_JIT)
def adamw(p, g, m, v, decay, wd, beta1, beta2, eps, c1, c2):
    """One pass of the reference's AdamW update, in its order of operations:
    p -= wd·decay·p; m = b1·m + (1-b1)·g; v = b2·v + (1-b2)·g²; p -= c1·m / (c2·sqrt(v) + eps)."""
    one_b1 = 1.0 - beta1
    one_b2 = 1.0 - beta2
    for i in range(p.shape[0]):
        pi = p[i]
        pi = pi - pi * decay[i] * wd
        gi = g[i]
        mi = m[i] * beta1 + gi * one_b1
        vi = v[i] * beta2 + gi * gi * one_b2
        m[i] = mi
        v[i] = vi
        p[i] = pi - mi / (math.sqrt(vi) * c2 + eps) * c1


# ---------------------------------------------------------------------------------------


def warm_up(dtype) -> None:
    """Compile (or load from the disk cache) every kernel a training run of `dtype` calls,
    on tiny arrays: at start-up, before any collective has a deadline, rather than inside
    step 0 (a cold compile takes seconds; a warm cache loads in well under one)."""
    if not enabled():
        return
    f = np.dtype(dtype).type
    x = np.ones((2, 4), f)
    w, r = np.ones(4, f), np.ones(2, f)
    y, xh, dx = np.empty_like(x), np.empty_like(x), np.empty_like(x)
    dw, db = np.empty(4, np.float64), np.empty(4, np.float64)
    layernorm_fwd(x, w, w, False, y, xh, r)
    layernorm_fwd(x, w, w, True, y, xh, r)
    layernorm_bwd(x, xh, r, w, dx, dw, db)
    flat, out, t = x.reshape(-1), y.reshape(-1), xh.reshape(-1)
    gelu_fwd_pre(flat, t)
    gelu_fwd_post(flat, t, out)
    gelu_bwd(flat, t, flat, out)
    att = np.zeros((1, 2, 2), f)
    causal_softmax_fwd(att)
    causal_softmax_bwd(att, np.zeros_like(att))
    ce_bwd(np.ones((2, 3), f), np.ones(2, f), np.zeros(2, np.int64), np.ones(1))
    z = np.zeros(8, f)
    adamw(z, z.copy(), z.copy(), z.copy(), np.ones(8, bool), 0.0, 0.9, 0.99, 1e-8, 1.0, 1.0)  # decay: a bool mask
