"""Layers as pure functions with hand-written backward passes.

Every layer has `*_fwd(params, x) -> (y, ctx)` and `*_bwd(params, ctx, dy) -> (dx, dparams)`,
where `dparams` has the parameters' own attrs class. Linear layers also expose their
input-grad and weight-grad halves separately (`linear_bwd_input`, `linear_bwd_weight`),
which is what lets a zero-bubble pipeline schedule defer the weight half.

LayerNorm, GELU and SwiGLU's forward run as fused kernels (numesh/host/kernels.py) when
numba is installed, and so do RMSNorm, SwiGLU's backward and rotary positions
(numesh/host/llama_kernels.py); the `*_reference` functions are the plain NumPy versions,
the readable definition that the kernels are tested against. Attention has its own module
(numesh/nn/attention.py).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import attrs
import numpy as np

from numesh.host import kernels as K
from numesh.host import llama_kernels as LK
from numesh.host.threads import (
    chunk_rows,
    cores,
    matmul,
    matmul_sum,
    matmuls,
    over_rows,
    tiles,
    token_sum,
    tree_sum,
    whole,
)

LN_EPS = 1e-5
_GELU_K = math.sqrt(2.0 / math.pi)


@attrs.frozen
class Linear:
    """y = x @ w (+ b). `w` is [in, *out]: extra output dims (e.g. q/k/v) are kept for sharding."""

    w: np.ndarray
    b: np.ndarray | None = None


@attrs.frozen
class LayerNorm:
    """LayerNorm's scale `w` [C] and shift `b` [C] (None without biases); normalises over the
    last dim with eps `LN_EPS`, as nanoGPT's LayerNorm does."""

    w: np.ndarray
    b: np.ndarray | None = None


@attrs.frozen
class RMSNorm:
    """x / rms(x) * w: LayerNorm without the mean and the bias (Llama's norm)."""

    w: np.ndarray


def _rows(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1, x.shape[-1])


def linear_fwd(p: Linear, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    w2 = p.w.reshape(p.w.shape[0], -1)
    y = matmul(_rows(x), w2)
    if p.b is not None:
        y += p.b.reshape(-1)
    return y.reshape(*x.shape[:-1], w2.shape[1]), x


def linear_bwd_input(p: Linear, dy: np.ndarray) -> np.ndarray:
    w2 = p.w.reshape(p.w.shape[0], -1)
    return matmul(_rows(dy), w2.T).reshape(*dy.shape[:-1], w2.shape[0])


def linear_fwd_many(ps: list[Linear], x: np.ndarray) -> list[np.ndarray]:
    """`linear_fwd`'s outputs of several Linears on one input x, their GEMMs in one hand-off
    to the threads (`threads.matmuls`)."""
    x2 = _rows(x)  # once: a copy where x's rows are not contiguous
    ys = matmuls([(x2, p.w.reshape(p.w.shape[0], -1)) for p in ps])
    for p, y in zip(ps, ys):
        if p.b is not None:
            y += p.b.reshape(-1)
    return [y.reshape(*x.shape[:-1], y.shape[1]) for y in ys]


def linear_bwd_input_sum(grads: list[tuple[Linear, np.ndarray]]) -> np.ndarray:
    """Σ `linear_bwd_input`(p, dy) over (p, dy), added in order, in one hand-off to the
    threads (`threads.matmul_sum`): the input's gradient where several Linears read it."""
    dy0 = grads[0][1]
    ws = [p.w.reshape(p.w.shape[0], -1) for p, _ in grads]
    dx = matmul_sum([(_rows(dy), w2.T) for (_, dy), w2 in zip(grads, ws)])
    return dx.reshape(*dy0.shape[:-1], ws[0].shape[0])


def linear_bwd_weight(p: Linear, x: np.ndarray, dy: np.ndarray, out: Linear | None = None) -> Linear:
    """The weight (and bias) gradient, a sum over tokens (`token_sum`: piece by piece inside
    a block run as pieces). With `out` (the weight's place in the optimiser's gradient
    buffer, `ParamUnits.grad_slot`) and no pieces, the weight's GEMM writes there and the
    result's w is `out.w` itself, which `grads_ready` then need not copy."""
    x2, dy2 = _rows(x), _rows(dy)
    if out is not None and out.w.flags.c_contiguous and out.w.dtype == np.result_type(x2, dy2) \
            and whole(x2.shape[0]):
        dw = out.w
        matmul(x2.T, dy2, out=dw.reshape(x2.shape[1], dy2.shape[1]))
    else:
        dw = token_sum(lambda r: matmul(x2[r].T, dy2[r]), x2.shape[0]).reshape(p.w.shape)
    db = None if p.b is None else token_sum(lambda r: dy2[r].sum(axis=0), dy2.shape[0]).reshape(p.b.shape)
    return Linear(dw, db)


def linear_bwd(p: Linear, ctx: np.ndarray, dy: np.ndarray) -> tuple[np.ndarray, Linear]:
    return linear_bwd_input(p, dy), linear_bwd_weight(p, ctx, dy)


def layernorm_fwd(p: LayerNorm, x: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """LayerNorm over the last dim; the context is (xhat, rstd [..., 1]). One kernel pass
    per row, rows over the threads. A ValueError line for an x that is not float32 or
    float64, or a w or b that is not [x's last dim] (the kernel read past a shorter one)."""
    _check_norm("layernorm_fwd", p.w, p.b, x)
    if not K.enabled():
        return layernorm_fwd_reference(p, x)
    x = np.ascontiguousarray(x)
    y, xhat = np.empty_like(x), np.empty_like(x)
    rstd = np.empty((*x.shape[:-1], 1), x.dtype)
    b = p.w if p.b is None else p.b  # unused without a bias
    x2, y2, xh2, r2 = _rows(x), _rows(y), _rows(xhat), rstd.reshape(-1)
    over_rows(lambda r: K.layernorm_fwd(x2[r], p.w, b, p.b is not None, y2[r], xh2[r], r2[r]), x2.shape[0],
              chunk_rows(x2.shape[1]))
    return y, (xhat, rstd)


def layernorm_bwd(p: LayerNorm, ctx: tuple[np.ndarray, np.ndarray], dy: np.ndarray) -> tuple[np.ndarray, LayerNorm]:
    """dx, and dw, db summed over tokens by fixed row tiles (`_tiled_token_sums`). A
    ValueError line for a dy or context that does not match (`_check_bwd`)."""
    _check_bwd("layernorm_bwd", dy, {"xhat": (ctx[0], None), "rstd": (ctx[1], 1)}, p.w)
    if not K.enabled():
        return layernorm_bwd_reference(p, ctx, dy)
    xhat, rstd = ctx
    dy = np.ascontiguousarray(dy)
    dx = np.empty_like(dy)
    dy2, xh2, rstd2, dx2 = _rows(dy), _rows(xhat), rstd.reshape(-1), _rows(dx)
    c = dy2.shape[1]

    def tile(t: slice) -> tuple[np.ndarray, np.ndarray]:  # dx of these rows; their dw, db
        dw, db = np.empty(c, np.float64), np.empty(c, np.float64)  # float64 accumulators
        K.layernorm_bwd(dy2[t], xh2[t], rstd2[t], p.w, dx2[t], dw, db)
        return dw, db

    dw, db = _tiled_token_sums(tile, dy2.shape[0], c, dy.dtype)
    return dx, LayerNorm(dw, None if p.b is None else db)


def _check_norm(name: str, w: np.ndarray, b: np.ndarray | None, x: np.ndarray) -> None:
    """A norm's entry checks: x a float array, w (and b) [x's last dim]. A dtype and two
    tuple comparisons; a message is built only once its test has failed."""
    if not K.is_float(x):
        K.check_float(f"{name}'s x", x)  # raises
    want = x.shape[-1:]
    for what, a in (("w", w), ("b", b)):
        if a is not None and a.shape != want:
            K.check_shape(f"{name}'s {what}", a, want, f"x {x.shape}")  # raises


def _check_bwd(name: str, dy: np.ndarray, saved: dict[str, tuple[np.ndarray, int | None]],
               w: np.ndarray | None) -> None:
    """A backward's entry checks, as the forward's: dy a float array, each saved array
    (name: (array, its last dim, None for dy's)) float, of dy's dtype and as many rows as
    dy, and w [dy's last dim]; a kernel given a shorter one read past its end. Rows, not
    shapes: callers may hand dy as [tokens, C] for a forward's [B, T, C]. Every backward
    call runs these, so each message is built only once its test has failed."""
    if not K.is_float(dy):
        K.check_float(f"{name}'s dy", dy)  # raises
    c = dy.shape[-1] if dy.ndim else 1
    rows = dy.size // c if c else 0
    for what, (a, last) in saved.items():
        last = c if last is None else last
        if not K.is_float(a):
            K.check_float(f"{name}'s {what}", a)  # raises
        if a.dtype != dy.dtype:
            raise ValueError(f"{name}'s {what} is {a.dtype} but dy {dy.dtype}: give both one dtype")
        if a.size != rows * last or (a.ndim and a.shape[-1] != last):
            raise ValueError(f"{name}'s {what} is {a.shape} but dy {dy.shape} makes it {rows} rows of {last}")
    if w is not None and w.shape != dy.shape[-1:]:
        K.check_shape(f"{name}'s w", w, dy.shape[-1:], f"dy {dy.shape}")  # raises


def _tiled_token_sums(tile: Callable[[slice], Any], n: int, c: int, dtype: Any) -> Any:
    """A norm's weight-gradient sums over n token rows of width c: `tile(rows)` writes those
    rows' dx and returns their float64 sums (an array or a tuple of them); within each
    `token_sum` piece over fixed row tiles (`tiles`, a function of the shape and the cores,
    never of the threads), the tiles' sums added in one pairwise tree (`tree_sum`) and cast
    to `dtype`, so the rows spread over the threads and the bits do not."""

    def piece(rows: slice) -> Any:
        parts = tiles(rows.stop - rows.start, chunk_rows(c), cores())
        sums = tree_sum(lambda i: (None, tile(slice(rows.start + parts[i].start, rows.start + parts[i].stop))),
                        len(parts))[1]
        return tuple(s.astype(dtype) for s in sums) if isinstance(sums, tuple) else sums.astype(dtype)

    return token_sum(piece, n)


def layernorm_fwd_reference(p: LayerNorm, x: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    var = np.einsum("...i,...i->...", xc, xc)[..., None] / x.shape[-1]
    rstd = 1.0 / np.sqrt(var + LN_EPS)
    xhat = xc
    xhat *= rstd
    y = xhat * p.w
    if p.b is not None:
        y += p.b
    return y, (xhat, rstd)


def layernorm_bwd_reference(p: LayerNorm, ctx: tuple[np.ndarray, np.ndarray],
                            dy: np.ndarray) -> tuple[np.ndarray, LayerNorm]:
    xhat, rstd = ctx
    dy2, xh2 = _rows(dy), _rows(xhat)
    dw = token_sum(lambda r: np.einsum("ni,ni->i", dy2[r], xh2[r]), dy2.shape[0])
    db = None if p.b is None else token_sum(lambda r: dy2[r].sum(axis=0), dy2.shape[0])
    dxhat = dy * p.w
    n = xhat.shape[-1]
    mean_d = dxhat.sum(axis=-1, keepdims=True) / n
    mean_dx = np.einsum("...i,...i->...", dxhat, xhat)[..., None] / n
    dxhat -= mean_d
    dxhat -= xhat * mean_dx
    dxhat *= rstd
    return dxhat, LayerNorm(dw, db)


def rmsnorm_fwd(p: RMSNorm, x: np.ndarray, eps: float) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """RMSNorm over the last dim, y = x * rstd * w with rstd = 1/sqrt(mean(x^2) + eps); the
    context is (xhat = x * rstd, rstd [..., 1]). One kernel pass per row, rows over the threads.
    A ValueError line for an x that is not float32 or float64, or a w that is not [x's last dim]."""
    _check_norm("rmsnorm_fwd", p.w, None, x)
    if not K.enabled():
        return rmsnorm_fwd_reference(p, x, eps)
    x = np.ascontiguousarray(x)
    y, xhat = np.empty_like(x), np.empty_like(x)
    rstd = np.empty((*x.shape[:-1], 1), x.dtype)
    x2, y2, xh2, r2 = _rows(x), _rows(y), _rows(xhat), rstd.reshape(-1)
    over_rows(lambda r: LK.rmsnorm_fwd(x2[r], p.w, eps, y2[r], xh2[r], r2[r]), x2.shape[0],
              chunk_rows(x2.shape[1]))
    return y, (xhat, rstd)


def rmsnorm_bwd(p: RMSNorm, ctx: tuple[np.ndarray, np.ndarray], dy: np.ndarray) -> tuple[np.ndarray, RMSNorm]:
    """dx = rstd * (dxhat - xhat * mean(dxhat * xhat)) with dxhat = dy * w; dw sums dy * xhat
    over tokens by fixed row tiles (`_tiled_token_sums`). A ValueError line for a dy or
    context that does not match (`_check_bwd`)."""
    _check_bwd("rmsnorm_bwd", dy, {"xhat": (ctx[0], None), "rstd": (ctx[1], 1)}, p.w)
    if not K.enabled():
        return rmsnorm_bwd_reference(p, ctx, dy)
    xhat, rstd = (np.ascontiguousarray(a) for a in ctx)
    dy = np.ascontiguousarray(dy)
    dx = np.empty_like(dy)
    dy2, xh2, r2, dx2 = _rows(dy), _rows(xhat), rstd.reshape(-1), _rows(dx)
    c = dy2.shape[1]

    def tile(t: slice) -> np.ndarray:  # dx of these rows; their dw
        dw = np.empty(c, np.float64)
        LK.rmsnorm_bwd(dy2[t], xh2[t], r2[t], p.w, dx2[t], dw)
        return dw

    return dx, RMSNorm(_tiled_token_sums(tile, dy2.shape[0], c, dy.dtype))


def rmsnorm_fwd_reference(p: RMSNorm, x: np.ndarray, eps: float) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    ms = np.einsum("...i,...i->...", x, x)[..., None] / x.shape[-1]
    rstd = 1.0 / np.sqrt(ms + eps)
    xhat = x * rstd
    return xhat * p.w, (xhat, rstd)


def rmsnorm_bwd_reference(p: RMSNorm, ctx: tuple[np.ndarray, np.ndarray],
                          dy: np.ndarray) -> tuple[np.ndarray, RMSNorm]:
    xhat, rstd = ctx
    dy2, xh2 = _rows(dy), _rows(xhat)
    dw = token_sum(lambda r: np.einsum("ni,ni->i", dy2[r], xh2[r]), dy2.shape[0])
    dxhat = dy * p.w
    dxhat -= xhat * (np.einsum("...i,...i->...", dxhat, xhat)[..., None] / xhat.shape[-1])
    dxhat *= rstd
    return dxhat, RMSNorm(dw)


def swiglu_fwd(gate: np.ndarray, up: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """SwiGLU's gating: silu(gate) * up, with silu(g) = g * sigmoid(g); the context is
    (gate, up): backward computes the sigmoid again rather than keep it. A ValueError line
    unless gate and up are float32 or float64 arrays of one shape and dtype."""
    K.check_float("swiglu_fwd's gate", gate)
    K.check_float("swiglu_fwd's up", up)
    if up.shape != gate.shape:  # the message only then: every forward runs this
        K.check_shape("swiglu_fwd's up", up, gate.shape, f"gate {gate.shape}")  # raises
    if up.dtype != gate.dtype:  # the kernel wrote gate's dtype where the reference promoted: two answers
        raise ValueError(f"swiglu_fwd's up is {up.dtype} but gate {gate.dtype}: give both one dtype")
    if not K.enabled():
        return swiglu_fwd_reference(gate, up)
    gate, up = np.ascontiguousarray(gate), np.ascontiguousarray(up)
    y = np.empty_like(gate)
    g2, u2, y2 = _rows(gate), _rows(up), _rows(y)
    over_rows(lambda r: LK.swiglu_fwd(g2[r].reshape(-1), u2[r].reshape(-1), y2[r].reshape(-1)),
              g2.shape[0], chunk_rows(g2.shape[1]))
    return y, (gate, up)


def swiglu_bwd(ctx: tuple[np.ndarray, np.ndarray], dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d gate, d up): silu'(g) = s * (1 + g * (1 - s)), s = sigmoid(g) again; one kernel
    pass, rows over the threads. A ValueError line for a dy or context that does not match
    (`_check_bwd`)."""
    _check_bwd("swiglu_bwd", dy, {"gate": (ctx[0], None), "up": (ctx[1], None)}, None)
    if not K.enabled():
        return swiglu_bwd_reference(ctx, dy)
    gate, up = (np.ascontiguousarray(a) for a in ctx)
    dy = np.ascontiguousarray(dy)
    dgate, dup = np.empty_like(dy), np.empty_like(dy)
    flat = [_rows(a) for a in (gate, up, dy, dgate, dup)]
    over_rows(lambda r: LK.swiglu_bwd(*(a[r].reshape(-1) for a in flat)), flat[0].shape[0],
              chunk_rows(flat[0].shape[1]))
    return dgate, dup


def _sigmoid(gate: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-gate))


def swiglu_fwd_reference(gate: np.ndarray, up: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    return gate * _sigmoid(gate) * up, (gate, up)


def swiglu_bwd_reference(ctx: tuple[np.ndarray, np.ndarray], dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    gate, up = ctx
    sig = _sigmoid(gate)
    silu = gate * sig
    dgate = dy * up * sig * (1.0 + gate * (1.0 - sig))
    return dgate, dy * silu


def gelu_fwd(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GELU in GPT-2's tanh form: 0.5·x·(1 + tanh(u)), u = k·(x + 0.044715·x³), computed as
    x·sigmoid(2u) (equal, and accurate far left, where 1 + tanh(u) cancels); the context is
    x alone: the backward computes exp(-2|u|) again (`numesh.host.kernels`' GELU notes; a
    kept tanh(u) was a third of the MLP's saved values). A ValueError line unless x is a
    float32 or float64 array."""
    K.check_float("gelu_fwd's x", x)
    if not K.enabled():
        return gelu_fwd_reference(x)
    x = np.ascontiguousarray(x)
    y = np.empty_like(x)
    x2, y2 = _rows(x), _rows(y)

    over_rows(lambda r: K.gelu_fwd(x2[r].reshape(-1), y2[r].reshape(-1)), x2.shape[0], chunk_rows(x2.shape[1]))
    return y, x


def gelu_bwd(x: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """dx of GELU at x (its forward's context) for the output gradient dy. A ValueError line
    for an x that does not match dy (`_check_bwd`)."""
    _check_bwd("gelu_bwd", dy, {"x": (x, None)}, None)
    if not K.enabled():
        return gelu_bwd_reference(x, dy)
    dy = np.ascontiguousarray(dy)
    dx = np.empty_like(dy)
    x2, dy2, dx2 = _rows(x), _rows(dy), _rows(dx)
    over_rows(lambda r: K.gelu_bwd(x2[r].reshape(-1), dy2[r].reshape(-1), dx2[r].reshape(-1)),
              x2.shape[0], chunk_rows(x2.shape[1]))
    return dx


def _gelu_u(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """u = k·(x + 0.044715·x³) into out, as (x²·0.044715k + k)·x, for the forward and the
    backward alike."""
    np.multiply(x, x, out=out)
    out *= 0.044715 * _GELU_K
    out += _GELU_K
    out *= x
    return out


def gelu_fwd_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    y = np.empty_like(x)
    x2, y2 = _rows(x), _rows(y)

    def rows(r: slice) -> None:  # 0.5·x·(1 + tanh(u)) as x·sigmoid(2u): the same, without 1 + tanh's cancellation
        xr, yr = x2[r], y2[r]
        _gelu_u(xr, yr)
        yr *= -2.0
        with np.errstate(over="ignore"):  # exp(-2u) = inf far left: y = x / inf = -0
            np.exp(yr, out=yr)
        yr += 1.0
        np.divide(xr, yr, out=yr)

    over_rows(rows, x2.shape[0], chunk_rows(x2.shape[1]))
    return y, x


def gelu_bwd_reference(x: np.ndarray, dy: np.ndarray) -> np.ndarray:
    dx = np.empty_like(dy)
    x2, dy2, dx2 = _rows(x), _rows(dy), _rows(dx)

    def rows(r: slice) -> None:
        # d/dx of x·σ(2u) = σ + 2·x·σ(1 - σ)·k·(1 + 3·0.044715·x²); with e = exp(-2|u|),
        # σ(1 - σ) = e/(1 + e)² (no difference near 0 or 1 to cancel)
        xr, out = x2[r], dx2[r]
        e = _gelu_u(xr, np.empty_like(xr))
        u_neg = e < 0
        np.abs(e, out=e)
        e *= -2.0
        np.exp(e, out=e)
        inv = 1.0 / (1.0 + e)
        s1 = e * inv * inv
        sig = np.where(u_neg, e * inv, inv)
        np.multiply(xr, xr, out=out)
        out *= 3 * 0.044715
        out += 1.0
        out *= _GELU_K
        out *= xr
        out *= 2.0
        out *= s1
        out += sig
        out *= dy2[r]

    over_rows(rows, x2.shape[0], chunk_rows(x2.shape[1]))
    return dx


def dropout_mask(rng: np.random.Generator, shape: tuple[int, ...], p: float, dtype) -> np.ndarray:
    """Inverted-dropout mask: 0 with probability p, 1/(1-p) otherwise."""
    return (rng.random(shape) >= p).astype(dtype) / (1.0 - p)
