"""Layers as pure functions with hand-written backward passes.

Every layer has `*_fwd(params, x) -> (y, ctx)` and `*_bwd(params, ctx, dy) -> (dx, dparams)`,
where `dparams` has the parameters' own attrs class. Linear layers also expose their
input-grad and weight-grad halves separately (`linear_bwd_input`, `linear_bwd_weight`),
which is what lets a zero-bubble pipeline schedule defer the weight half.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

LN_EPS = 1e-5
_GELU_K = math.sqrt(2.0 / math.pi)


@attrs.frozen
class Linear:
    """y = x @ w (+ b). `w` is [in, *out]: extra output dims (e.g. q/k/v) are kept for sharding."""

    w: np.ndarray
    b: np.ndarray | None = None


@attrs.frozen
class LayerNorm:
    w: np.ndarray
    b: np.ndarray | None = None


def _rows(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1, x.shape[-1])


def linear_fwd(p: Linear, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    w2 = p.w.reshape(p.w.shape[0], -1)
    y = _rows(x) @ w2
    if p.b is not None:
        y += p.b.reshape(-1)
    return y.reshape(*x.shape[:-1], w2.shape[1]), x


def linear_bwd_input(p: Linear, dy: np.ndarray) -> np.ndarray:
    w2 = p.w.reshape(p.w.shape[0], -1)
    return (_rows(dy) @ w2.T).reshape(*dy.shape[:-1], w2.shape[0])


def linear_bwd_weight(p: Linear, x: np.ndarray, dy: np.ndarray) -> Linear:
    dy2 = _rows(dy)
    dw = (_rows(x).T @ dy2).reshape(p.w.shape)
    db = None if p.b is None else dy2.sum(axis=0).reshape(p.b.shape)
    return Linear(dw, db)


def linear_bwd(p: Linear, ctx: np.ndarray, dy: np.ndarray) -> tuple[np.ndarray, Linear]:
    return linear_bwd_input(p, dy), linear_bwd_weight(p, ctx, dy)


def layernorm_fwd(p: LayerNorm, x: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
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


def layernorm_bwd(p: LayerNorm, ctx: tuple[np.ndarray, np.ndarray], dy: np.ndarray) -> tuple[np.ndarray, LayerNorm]:
    xhat, rstd = ctx
    dy2, xh2 = _rows(dy), _rows(xhat)
    dw = np.einsum("ni,ni->i", dy2, xh2)
    db = None if p.b is None else dy2.sum(axis=0)
    dxhat = dy * p.w
    n = xhat.shape[-1]
    mean_d = dxhat.sum(axis=-1, keepdims=True) / n
    mean_dx = np.einsum("...i,...i->...", dxhat, xhat)[..., None] / n
    dxhat -= mean_d
    dxhat -= xhat * mean_dx
    dxhat *= rstd
    return dxhat, LayerNorm(dw, db)


def gelu_fwd(x: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """GELU in GPT-2's tanh form."""
    t = x * x
    t *= 0.044715
    t += 1.0
    t *= x
    t *= _GELU_K
    np.tanh(t, out=t)
    y = t + 1.0
    y *= x
    y *= 0.5
    return y, (x, t)


def gelu_bwd(ctx: tuple[np.ndarray, np.ndarray], dy: np.ndarray) -> np.ndarray:
    x, t = ctx
    # d/dx = 0.5(1+t) + 0.5 x (1-t^2) k (1 + 3·0.044715 x^2)
    inner = x * x
    inner *= 3 * 0.044715 * _GELU_K
    inner += _GELU_K
    inner *= x
    sech2 = t * t
    np.subtract(1.0, sech2, out=sech2)
    inner *= sech2
    inner += t
    inner += 1.0
    inner *= 0.5
    inner *= dy
    return inner


def causal_attention_fwd(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, drop_mask: np.ndarray | None = None
) -> tuple[np.ndarray, tuple]:
    """Causal softmax attention over [B, H, T, hs] tensors; `drop_mask` (already scaled) applies to the weights."""
    T, hs = q.shape[-2], q.shape[-1]
    qs = q * (1.0 / math.sqrt(hs))  # scaling q costs T·hs, scaling the scores T·T
    att = qs @ k.swapaxes(-1, -2)
    att += _causal_bias(T, att.dtype)
    att -= att.max(axis=-1, keepdims=True)
    np.exp(att, out=att)
    att *= 1.0 / att.sum(axis=-1, keepdims=True)
    p = att if drop_mask is None else att * drop_mask
    y = p @ v
    return y, (qs, k, v, att, drop_mask)


def causal_attention_bwd(ctx: tuple, dy: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    qs, k, v, att, drop_mask = ctx
    p = att if drop_mask is None else att * drop_mask
    dv = p.swapaxes(-1, -2) @ dy
    datt = dy @ v.swapaxes(-1, -2)
    if drop_mask is not None:
        datt *= drop_mask
    # softmax backward: ds = a * (da - sum(da * a))
    datt -= np.einsum("...ij,...ij->...i", datt, att)[..., None]
    datt *= att
    dq = datt @ k
    dq *= 1.0 / math.sqrt(qs.shape[-1])
    dk = datt.swapaxes(-1, -2) @ qs
    return dq, dk, dv


_CAUSAL_BIAS: dict[tuple[int, np.dtype], np.ndarray] = {}


def _causal_bias(T: int, dtype) -> np.ndarray:
    """[T, T] additive mask: 0 on and below the diagonal, -inf above."""
    key = (T, np.dtype(dtype))
    if key not in _CAUSAL_BIAS:
        _CAUSAL_BIAS[key] = np.where(np.tri(T, dtype=bool), 0.0, -np.inf).astype(dtype)
    return _CAUSAL_BIAS[key]


def dropout_mask(rng: np.random.Generator, shape: tuple[int, ...], p: float, dtype) -> np.ndarray:
    """Inverted-dropout mask: 0 with probability p, 1/(1-p) otherwise."""
    return (rng.random(shape) >= p).astype(dtype) / (1.0 - p)
