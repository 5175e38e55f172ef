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
reproducible: no reassociation, no fused multiply-add contraction (but in `exp32`, which
may fuse: see there).

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

from numesh.host import lanes as _lanes
from numesh.host.lanes import row_dot, row_sum

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

    from numesh.host import numba_cache, numba_target

    numba_cache.install()  # a kernel's cache entry is renewed when any kernel file changes
    numba_target.prefer_full_width()  # 512-bit vectors on AVX-512 CPUs, before anything compiles
    _lanes.compile_for_numba()
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
        from numesh.base.errors import ConfigError

        raise ConfigError(f"NUMESH_KERNELS={os.environ.get('NUMESH_KERNELS', '')!r} is not one of "
                          f"{', '.join(MODES)} (or unset/empty for numba when installed)")


# the float types the model and optimisers compute in: the kernels are compiled for these
# two (a float16 leaf was a bare NotImplementedError, an int one a page of numba typing
# errors, and an int model rounded every update away)
FLOAT_DTYPES: tuple[np.dtype, ...] = (np.dtype(np.float32), np.dtype(np.float64))


def float_dtype(dtype: object, what: str = "dtype") -> np.dtype:
    """`dtype` as a numpy dtype if it is float32 or float64, else one ConfigError line."""
    from numesh.base.errors import ConfigError

    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError):
        dt = None
    if dt is None or dt not in FLOAT_DTYPES:  # `is None` first: np.dtype(None) == float64
        got = repr(dtype) if dt is None else dt.name
        raise ConfigError(f"{what} must be float32 or float64, got {got}")
    return dt


def is_float(a: object) -> bool:
    """Whether `a` is a float32 or float64 array, the two dtypes the kernels are compiled
    for: `check_float`'s test, for a caller that builds the name only when it fails."""
    return isinstance(a, np.ndarray) and a.dtype in FLOAT_DTYPES


def check_float(what: str, a: object) -> None:
    """One ValueError line unless `a` is a float32 or float64 array, the two dtypes the
    kernels are compiled for (an int array was a page of numba typing errors, or zeros).
    `what` names it: "layernorm_fwd's x". One dtype comparison."""
    if not is_float(a):
        got = a.dtype.name if isinstance(a, np.ndarray) else type(a).__name__
        raise ValueError(f"{what} must be a float32 or float64 array, got {got}")


def check_shape(what: str, a: np.ndarray, want: tuple[int, ...], why: str) -> None:
    """One ValueError line unless `a` has shape `want` (`why`: what makes it so, "x's last
    dim"): a kernel given a shorter operand read past its end. One tuple comparison."""
    if a.shape != want:
        raise ValueError(f"{what} is {a.shape} but {why} makes it {want}")


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
# exp in float32 that LLVM vectorises. numba's math.exp is a call into libm, one element at
# a time, unless Intel's SVML is loaded (it needs an SVML-patched llvmlite, which the
# wheels are not: `numba -s`). Written out as arithmetic instead, a loop of it compiles to
# packed AVX2 / AVX-512 code: on a Zen 3 (AVX2) ~0.85 ns an element against NumPy's SIMD
# np.exp's 1.5-2.1 ns, and it fuses into the passes around it instead of being a sweep of
# its own. Cephes' expf: x = n·ln2 + r with |r| <= ln2/2 (ln2 split in two so r is exact),
# exp(r) by a degree-7 polynomial, times 2^n built in the exponent bits, as two halves so
# that n = 128 overflows to inf rather than to a wrong exponent. Results below float32's
# smallest normal (x < -87.34) are 0: a subnormal anywhere in the arithmetic costs a
# microcode assist per lane (the masked diagonal scores, exp(-inf), ran 2× slower with
# them), and no softmax or sigmoid can see a weight below 1.2e-38. It alone may contract
# a multiply and an add into an FMA (fastmath={"contract"}: 0.62 against 0.85 ns an element
# on Zen 3), which rounds once where the two round twice: a CPU without FMA (before Haswell)
# gets other bits, as it would from BLAS; nothing is reassociated, so any thread count on
# one machine gets the same bits. Every float32 input checked against float64 exp: within
# 1.03 ulp where the result is normal (0.99 without FMA; tests/test_kernels.py samples it);
# -inf gives 0, NaN stays NaN.

_LOG2E = 1.4426950408889634
_LN2_HI = 0.693359375  # ln 2 in 10 bits: n·_LN2_HI is exact for |n| < 2^14
_LN2_LO = -2.12194440e-4  # ln 2 - _LN2_HI
_EXP_LO = -87.33654  # float32 just above ln(2^-126): below it exp is subnormal, returned as 0
_EXP_HI = 89.0  # exp(89) > float32's largest: inf
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
             5.0000001201e-1)


@njit(**{**_JIT, "fastmath": {"contract"}})
def _exp_split(xc):
    """exp(xc) = 2^n · p for a clamped float32 xc: (n as a float, p = exp(r) by the
    polynomial), r = xc - n·ln2 in two parts so that it is exact; `exp32` and `exp32_low`
    build 2^n each their own way."""
    f = np.float32
    nf = np.floor(xc * f(_LOG2E) + f(0.5))
    r = xc - nf * f(_LN2_HI)
    r = r - nf * f(_LN2_LO)
    c0, c1, c2, c3, c4, c5 = _EXP_POLY
    p = f(c0)
    p = p * r + f(c1)
    p = p * r + f(c2)
    p = p * r + f(c3)
    p = p * r + f(c4)
    p = p * r + f(c5)
    p = p * r * r + r + f(1.0)
    return nf, p


@njit(**{**_JIT, "fastmath": {"contract"}})
def exp32(x):
    """exp of a float32 (within 1.03 ulp; 0 below float32's normal range), as arithmetic that
    vectorises; NaN in, NaN out."""
    f = np.float32
    xc = f(_EXP_LO) if x < f(_EXP_LO) else x  # written so that NaN passes both
    xc = f(_EXP_HI) if xc > f(_EXP_HI) else xc
    nf, p = _exp_split(xc)
    n = np.int32(nf)
    n1 = n >> 1
    s1 = np.int32((n1 + 127) << 23).view(np.float32)
    s2 = np.int32((n - n1 + 127) << 23).view(np.float32)
    return f(0.0) if x < f(_EXP_LO) else p * s1 * s2


@njit(**{**_JIT, "fastmath": {"contract"}})
def exp32_low(x):
    """`exp32` of a float32 x <= 88, bit for bit, in fewer instructions: the softmax's
    shifted scores and GELU's -2|u| are <= 0 (up to rounding), so the clamp at the top and
    the 2^n built in two halves, which only exp's overflow range needs, go. Above 88 it
    does not overflow to inf. Its loops run about a quarter faster than exp32's
    (`python benchmarks/bench_exp.py`)."""
    f = np.float32
    xc = f(_EXP_LO) if x < f(_EXP_LO) else x  # written so that NaN passes
    nf, p = _exp_split(xc)  # -126 <= n <= 127 here: one normal scale
    s = np.int32((np.int32(nf) + 127) << 23).view(np.float32)
    return f(0.0) if x < f(_EXP_LO) else p * s


def vexp(x):
    """exp of one element inside a kernel: `exp32` for float32, libm's exp otherwise
    (float64 runs are for parity checks, where accuracy matters more than lanes)."""
    return math.exp(x)


def vexp_low(x):
    """`vexp` of an x <= 88 (`exp32_low` for float32): the softmax's and GELU's exp."""
    return math.exp(x)


if HAVE_NUMBA:
    from numba import types
    from numba.extending import overload

    @overload(vexp)
    def _vexp_typed(x):
        if isinstance(x, types.Float) and x.bitwidth == 32:
            return lambda x: exp32(x)
        return lambda x: math.exp(x)

    @overload(vexp_low)
    def _vexp_low_typed(x):
        if isinstance(x, types.Float) and x.bitwidth == 32:
            return lambda x: exp32_low(x)
        return lambda x: math.exp(x)


@njit(**_JIT)
def exp_into(x, out):
    """out = exp(x) elementwise on flat arrays, by `vexp` (its tests call this)."""
    for i in range(x.shape[0]):
        out[i] = vexp(x[i])


@njit(**_JIT)
def _sum_squares(x):
    return _lanes.sum_squares(x)


def sum_squares(x: np.ndarray) -> float:
    """Σ x² of a contiguous vector in float64, in numesh.host.lanes' order: compiled where
    the kernels are on, else that module's NumPy definition (the same bits)."""
    return float(_sum_squares(x)) if _on else _lanes.sum_squares(x)


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
        mu = cast(row_sum(x, i, c) / c)
        for j in range(c):
            xhat[i, j] = x[i, j] - mu
        r = cast(1.0 / math.sqrt(row_dot(xhat, xhat, i, c) / c + LN_EPS))
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
        mean_d = cast(row_sum(dx, i, c) / c)
        mean_dx = cast(row_dot(dx, xhat, i, c) / c)
        r = rstd[i]
        for j in range(c):
            dx[i, j] = (dx[i, j] - mean_d - xhat[i, j] * mean_dx) * r


# ---------------------------------------------------------------------------------------
# GELU (tanh form), elementwise on flat arrays: 0.5·x·(1 + tanh(u)) = x·σ(2u), u = k·(x +
# 0.044715·x³), from one `vexp`, e = exp(-2|u|) in (0, 1]: σ(2u) = 1/(1 + e) for u >= 0,
# e/(1 + e) below, and σ(2u)·(1 - σ(2u)) = e/(1 + e)², so neither tail cancels (1 + tanh(u)
# and 1 - tanh(u)² computed as differences lose the left tail's digits: at x = -9.4 the
# derivative from tanh had no correct digit). Only x is kept: the backward computes e again,
# in about the time that writing and reading back a saved tanh took
# (`python benchmarks/profile_train.py --preset default`), a fifth of a GPT block's memory less.


@njit(**_JIT)
def _sigmoid_2u(v, k, c, one, two):
    """(σ(2u), σ(2u)·(1 - σ(2u))) of one value v, u = k·(v + c·v³)."""
    u = k * (v + c * v * v * v)
    e = vexp_low(-two * abs(u))
    inv = one / (one + e)
    return (inv if u >= 0 else e * inv), e * inv * inv


@njit(**_JIT)
def gelu_fwd(x, y):
    """y = x·σ(2u) = 0.5·x·(1 + tanh(u))."""
    f = x.dtype.type
    k, c, one, two = f(GELU_K), f(GELU_C), f(1.0), f(2.0)
    for i in range(x.shape[0]):
        v = x[i]
        y[i] = v * _sigmoid_2u(v, k, c, one, two)[0]


@njit(**_JIT)
def gelu_bwd(x, dy, dx):
    """dx = dy · (σ(2u) + 2·x·σ(2u)(1 - σ(2u))·k·(1 + 3·0.044715·x²)), GELU's derivative."""
    f = x.dtype.type
    one, two, k, c, c3 = f(1.0), f(2.0), f(GELU_K), f(GELU_C), f(3.0 * GELU_C)
    for i in range(x.shape[0]):
        v = x[i]
        s, s1 = _sigmoid_2u(v, k, c, one, two)
        d = s + two * v * k * (one + c3 * v * v) * s1
        dx[i] = d * dy[i]


# ---------------------------------------------------------------------------------------
# attention stripes (numesh/nn/attention.py): the scores of a tile of keys against a stripe
# of queries, for a group of (batch row, head) pairs, transposed, s [G, keys, queries]
# (k·qᵀ: BLAS runs that shape faster than q·kᵀ, and every pass below then runs along a
# key's row of queries, where it vectorises without reordering a sum). Query r sees key j
# iff j < vis0 + r. The exp is `vexp`, inside the passes: the forward's softmax is two
# sweeps over a tile's scores (max; exp and sums), the backward's probabilities one.
#
# Attention dropout draws no mask: whether query q of (batch row b, head h) keeps key j is a
# hash of (the stream's key, the counter ((b·H + h)·S + q)·S + j), with b, h, q and j global,
# so every mesh and every tile drops the same pairs. `row_base[g, r]` carries
# ((b·H + h)·S + q)·S for group g's query r and `kpos[j]` the key's global position. splitmix64's finaliser
# mixes the counter; its top 24 bits against `threshold` = ceil(p·2^24) keep or drop.


@njit(**_JIT)
def drop_keep(key, counter, threshold):
    """Whether the pair with this counter survives dropout (all uint64)."""
    z = key ^ (counter * np.uint64(0x9E3779B97F4A7C15))
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(40)) >= threshold


@njit(**_JIT)
def _first_seen(vis0, j, rows):
    """The first query of the stripe that sees key j."""
    return min(max(j - vis0 + 1, 0), rows)


@njit(**_JIT)
def _hide(s, vis0):
    """Hidden scores (query r, key j >= vis0 + r) to -inf. Every pass here then runs whole
    rows: a loop from a varying start does not vectorise (numba/LLVM), one over a row does."""
    groups, keys, rows = s.shape
    for g in range(groups):
        for j in range(max(0, vis0), keys):
            row = s[g, j]
            for r in range(_first_seen(vis0, j, rows)):
                row[r] = -np.inf


@njit(**_JIT)
def stripe_softmax(s, vis0, m, l, alpha, key, threshold, inv_keep, row_base, kpos):
    """Online softmax over one key tile, for each group g (a (batch row, head)) of s [G,
    keys, queries], in two sweeps: (1) hidden scores (query r, key j >= vis0 + r) to -inf
    and each query's running max m[g, r] raised to its visible scores' max, alpha[g, r] =
    exp(old m - new m); (2) s <- exp(s - m) and l[g, r] <- l[g, r]·alpha[g, r] + Σ_j s[g,
    j, r] (float64 sums), then with dropout (threshold > 0) s scaled by the keep mask. Needs
    a visible key for every query by this tile (m finite after it)."""
    groups, keys, rows = s.shape
    _hide(s, vis0)
    acc = np.empty(rows, np.float64)
    ping, pong = np.empty(rows, m.dtype), np.empty(rows, m.dtype)
    for g in range(groups):
        mg, ag = m[g], alpha[g]
        mx = _col_max(s[g], mg, ping, pong)
        for r in range(rows):
            ag[r] = vexp_low(mg[r] - mx[r]) if mg[r] > -np.inf else 0.0
            mg[r] = mx[r]
            acc[r] = 0.0
        for j in range(keys):
            row = s[g, j]
            for r in range(rows):
                row[r] = vexp_low(row[r] - mx[r])
            for r in range(rows):  # a loop of its own: fused with the exp (float32 to float64) it stays scalar
                acc[r] += row[r]
        for r in range(rows):
            l[g, r] = l[g, r] * ag[r] + acc[r]
        if threshold > 0:
            _drop_rows(s[g], key, threshold, inv_keep, row_base[g], kpos)


@njit(**_JIT)
def _col_max(a, start, ping, pong):
    """max(start[r], max_j a[j, r]) for each r, returned in ping or pong (scratch arrays of
    start's size). The running maxima alternate between the two: `cur[r] = max(cur[r], x)`
    in place compiles to a masked store (vmaskmovps), which Zen 3 runs at a seventh of the
    speed (measured 0.77 against 0.11 ns a score)."""
    cur, nxt = ping, pong
    for r in range(a.shape[1]):
        cur[r] = start[r]
    for j in range(a.shape[0]):
        row = a[j]
        for r in range(a.shape[1]):
            nxt[r] = max(cur[r], row[r])
        cur, nxt = nxt, cur
    return cur


@njit(**_JIT)
def _drop_rows(p, key, threshold, inv_keep, base, kpos):
    """p [keys, queries] of one group times its keep mask (0 or inv_keep), in place."""
    for j in range(p.shape[0]):
        kj = kpos[j]
        row = p[j]
        for r in range(p.shape[1]):
            if drop_keep(key, base[r] + kj, threshold):
                row[r] *= inv_keep
            else:
                row[r] = 0.0


@njit(**_JIT)
def stripe_probs(s, vis0, lse):
    """Backward, the probabilities in one sweep: s <- exp(s - lse[g, r]) for visible scores,
    0 for hidden ones (the exp runs over whole rows, then the hidden head of a row is
    zeroed: a loop from a varying start would not vectorise)."""
    groups, keys, rows = s.shape
    for g in range(groups):
        lg = lse[g]
        for j in range(keys):
            row = s[g, j]
            for r in range(rows):
                row[r] = vexp_low(row[r] - lg[r])
            if j >= vis0:
                for r in range(_first_seen(vis0, j, rows)):
                    row[r] = 0.0


@njit(**_JIT)
def stripe_probs_grad(s, dp, vis0, lse, dd):
    """`stripe_probs` then `stripe_grad` without dropout, in one sweep: s <- the
    probabilities exp(s - lse[g, r]) (0 where hidden), dp <- s·(dp - dd[g, r]), row by row
    while the row is in L1, with their ops and order, so the same bits; it reads the
    probabilities back from L1 where the second sweep read them from the tile again. dp
    must hold d(probabilities) already: the backward runs that GEMM first."""
    groups, keys, rows = s.shape
    for g in range(groups):
        lg, dg = lse[g], dd[g]
        for j in range(keys):
            row, dj = s[g, j], dp[g, j]
            for r in range(rows):
                row[r] = vexp_low(row[r] - lg[r])
            if j >= vis0:
                for r in range(_first_seen(vis0, j, rows)):
                    row[r] = 0.0
            for r in range(rows):
                dj[r] = row[r] * (dj[r] - dg[r])


@njit(**_JIT)
def stripe_dropped(p, out, key, threshold, inv_keep, row_base, kpos):
    """out = the probabilities p after dropout (the weights the values were averaged with)."""
    groups, keys, rows = p.shape
    for g in range(groups):
        base = row_base[g]
        for j in range(keys):
            kj = kpos[j]
            for r in range(rows):
                out[g, j, r] = p[g, j, r] * inv_keep if drop_keep(key, base[r] + kj, threshold) else 0.0


@njit(**_JIT)
def stripe_grad(p, dp, dd, key, threshold, inv_keep, row_base, kpos):
    """Softmax backward in place: dp <- p·(dp∘keep - dd[g, r]), dd = rowsum(dy·y)."""
    groups, keys, rows = p.shape
    for g in range(groups):
        dg = dd[g]
        for j in range(keys):
            pj, dj = p[g, j], dp[g, j]
            if threshold > 0:
                base, kj = row_base[g], kpos[j]
                for r in range(rows):
                    x = dj[r] * inv_keep if drop_keep(key, base[r] + kj, threshold) else 0.0
                    dj[r] = pj[r] * (x - dg[r])
            else:
                for r in range(rows):
                    dj[r] = pj[r] * (dj[r] - dg[r])


# ---------------------------------------------------------------------------------------
# Cross-entropy over logits [N, V] (this tp rank's vocabulary columns), a row at a time,
# rows over the threads (numesh.nn.parallel): a real vocabulary's row (SmolLM2's 49,152
# columns, 192 KB) stays in L2 from its max to its sum, where NumPy's passes (max, shift,
# exp, sum, each over the whole [N, V] array, on one thread) read the logits from memory
# again at each (`python benchmarks/bench_cross_entropy.py` times both beside torch's).

_MAX_LANES = 64  # running maxima a row keeps: whole vectors (float32: 4 on AVX-512, 8 on AVX2)


@njit(**_JIT)
def _row_max(row, ping, pong):
    """max of a row (-inf for none), over `_MAX_LANES` running maxima that compile to vector
    max, folded twice in halves and then one by one: a max is exact in any order, so the
    lanes change nothing but the speed. numba's max(a, b) keeps a where b is NaN, so a NaN
    is skipped here; it reaches the loss through the row's sum (`ce_rows`). The maxima
    alternate between ping and pong (`stripe_softmax`'s masked-store note)."""
    v = row.shape[0]
    whole = v - v % _MAX_LANES
    m = row.dtype.type(-np.inf)
    if whole:
        cur, nxt = ping, pong
        for k in range(_MAX_LANES):
            cur[k] = -np.inf
        for j0 in range(0, whole, _MAX_LANES):
            for k in range(_MAX_LANES):
                nxt[k] = max(cur[k], row[j0 + k])
            cur, nxt = nxt, cur
        half, quarter = _MAX_LANES // 2, _MAX_LANES // 4
        for k in range(half):
            nxt[k] = max(cur[k], cur[k + half])
        for k in range(quarter):
            cur[k] = max(nxt[k], nxt[k + quarter])
        for k in range(quarter):
            m = max(m, cur[k])
    for j in range(whole, v):
        m = max(m, row[j])
    return m


@njit(**_JIT)
def ce_rows(logits, local, m, s, target):
    """For each row i of logits [N, V] (this rank's columns): m[i] its max, target[i] its
    logit at column local[i] (0 where local[i] is outside [0, V): another rank's), then in
    place exp(logits[i] - m[i]), and s[i] their float64 sum (`row_sum`'s lanes). A row of
    -inf alone (this rank's columns all padding) becomes zeros, s[i] = 0; a NaN or +inf
    logit makes s[i] NaN."""
    n, v = logits.shape
    ping, pong = np.empty(_MAX_LANES, logits.dtype), np.empty(_MAX_LANES, logits.dtype)
    for i in range(n):
        row = logits[i]
        mi = _row_max(row, ping, pong)
        m[i] = mi
        t = local[i]
        target[i] = row[t] if 0 <= t < v else 0.0
        shift = mi if mi > -np.inf else logits.dtype.type(0.0)
        for j in range(v):
            row[j] = vexp_low(row[j] - shift)
        s[i] = row_sum(logits, i, v)


@njit(**_JIT)
def ce_bwd(probs, sumexp, local, dloss):
    """In place: probs <- (exp / sumexp - onehot(target)) · dloss[i] (dloss has 1 or N
    float64 entries; each product rounded once, as NumPy's reference rounds it). The
    target's entry goes after the row's loop, which then has no branch in it and vectorises."""
    n, v = probs.shape
    scalar = dloss.shape[0] == 1
    f = probs.dtype.type
    for i in range(n):
        g = dloss[0] if scalar else dloss[i]
        se = sumexp[i]
        t = local[i]
        row = probs[i]
        inside = 0 <= t < v
        pt = row[t] if inside else f(0.0)
        for j in range(v):
            row[j] = row[j] / se * g
        if inside:
            row[t] = (pt / se - f(1.0)) * g


@njit(**_JIT)
def embedding_grad(ids, dy, out):
    """out [V, C] (zeros from the caller) += each token's row of dy [N, C] into row ids[t]
    (ids[t] < 0: another rank's, skipped), token by token in order, as np.add.at adds: one
    pass, with no sort and no gathered copy of dy. `numesh.nn.parallel`'s NumPy path adds
    each id's tokens pairwise (np.add.reduceat), so the two agree to rounding."""
    for t in range(ids.shape[0]):
        i = ids[t]
        if i >= 0:
            row, d = out[i], dy[t]
            for c in range(d.shape[0]):
                row[c] += d[c]


# ---------------------------------------------------------------------------------------
# AdamW on flat buffers


@njit(**_JIT)
def adamw(p, g, m, v, decay, wd, beta1, one_b1, beta2, one_b2, eps, c1, c2):
    """One pass of the reference's AdamW update, in its order of operations and in p's
    dtype (the scalars given in it, decay cast to it): p -= wd·decay·p; m = b1·m + (1-b1)·g;
    v = b2·v + (1-b2)·g²; p -= c1·m / (c2·sqrt(v) + eps). In float32 that is 16 lanes of
    float32 sqrt and divide: with float64 scalars the loop ran in float64, 8 lanes of the
    slow float64 sqrt and divide, 2.2-2.7x the time in cache (`python benchmarks/bench_adamw.py`)."""
    cast = p.dtype.type
    for i in range(p.shape[0]):
        pi = p[i]
        pi = pi - pi * cast(decay[i]) * wd
        gi = g[i]
        mi = m[i] * beta1 + gi * one_b1
        vi = v[i] * beta2 + gi * gi * one_b2
        m[i] = mi
        v[i] = vi
        p[i] = pi - mi / (np.sqrt(vi) * c2 + eps) * c1


# ---------------------------------------------------------------------------------------


def warm_rows(dtype) -> tuple[np.ndarray, ...]:
    """The tiny operands `warm_up` (and numesh.host.llama_kernels.warm_up) compiles the row
    kernels on: x [2, 4], a weight w [4], per-row r [2], and y, xh, dx shaped as x."""
    f = np.dtype(dtype).type
    x = np.ones((2, 4), f)
    return x, np.ones(4, f), np.ones(2, f), np.empty_like(x), np.empty_like(x), np.empty_like(x)


def warm_up(dtype) -> None:
    """Compile (or load from the disk cache) every kernel a training run of `dtype` calls,
    on tiny arrays: at start-up, before any collective has a deadline, rather than inside
    step 0 (a cold compile takes seconds; a warm cache loads in well under one)."""
    if not enabled():
        return
    f = np.dtype(dtype).type
    x, w, r, y, xh, dx = warm_rows(dtype)
    dw, db = np.empty(4, np.float64), np.empty(4, np.float64)
    layernorm_fwd(x, w, w, False, y, xh, r)
    layernorm_fwd(x, w, w, True, y, xh, r)
    layernorm_bwd(x, xh, r, w, dx, dw, db)
    flat, out = x.reshape(-1), y.reshape(-1)
    gelu_fwd(flat, out)
    gelu_bwd(flat, flat, out)
    s, v1, u = np.zeros((1, 4, 2), f), np.zeros((1, 2), f), np.zeros((1, 4), np.uint64)
    stripe_softmax(s, 1, v1, v1.copy(), v1.copy(), np.uint64(1), np.uint64(1), f(2), u[:, :2], u[0])
    stripe_probs(s, 1, v1)
    stripe_dropped(s, s.copy(), np.uint64(1), np.uint64(1), f(2), u[:, :2], u[0])
    stripe_grad(s, s.copy(), v1, np.uint64(1), np.uint64(1), f(2), u[:, :2], u[0])
    stripe_probs_grad(s, s.copy(), 1, v1, v1)
    ce_rows(np.ones((2, 3), f), np.zeros(2, np.int64), v1[0], np.ones(2), v1[0].copy())
    ce_bwd(np.ones((2, 3), f), np.ones(2, f), np.zeros(2, np.int64), np.ones(1))
    embedding_grad(np.array([0, -1, 0], np.int64), np.ones((3, 2), f), np.zeros((1, 2), f))
    z = np.zeros(8, f)
    consts = (f(c) for c in (0.0, 0.9, 0.1, 0.99, 0.01, 1e-8, 1.0, 1.0))  # in the dtype, as adamw_step gives them
    adamw(z, z.copy(), z.copy(), z.copy(), np.ones(8, bool), *consts)  # decay: a bool mask
