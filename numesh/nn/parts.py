"""The block's interchangeable parts, each a forward and its backward: the norm (LayerNorm |
RMSNorm) and the attention's input projections (one fused QKV Linear | grouped-query
attention's q, k, v), with rotary positions on q and k. `numesh.nn.transformer` calls these
and never asks which kind of model it runs; the MLP's two kinds (GELU | SwiGLU) are its
`mlp_fwd`. A third kind's new part is a branch here (docs/design.md, "Model kinds").
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import numpy as np

from numesh.host import aligned
from numesh.host.threads import zero_into
from numesh.mesh import Mesh
from numesh.nn.gpt import Attention, GPTConfig, GQAttention
from numesh.nn.layers import (
    LayerNorm,
    Linear,
    RMSNorm,
    layernorm_bwd,
    layernorm_fwd,
    linear_bwd_input,
    linear_bwd_input_sum,
    linear_bwd_weight,
    linear_fwd,
    linear_fwd_many,
    rmsnorm_bwd,
    rmsnorm_fwd,
)
from numesh.nn.rotary import Rotary, rope_bwd, rope_fwd, rotary_tables

Norm = LayerNorm | RMSNorm

# ---------------------------------------------------------------------------------------
# the norm


def norm_fwd(p: Norm, x: np.ndarray, eps: float) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """The norm of x [..., C]; both kinds keep (xhat, rstd) for backward, so sequence
    parallelism regathers either from its x̂ slices (`norm_output`)."""
    if isinstance(p, RMSNorm):
        return rmsnorm_fwd(p, x, eps)
    return layernorm_fwd(p, x)  # its eps is the kernel's (GPTConfig.validate holds them equal)


def norm_bwd(p: Norm, ctx: tuple[np.ndarray, np.ndarray], dy: np.ndarray) -> tuple[np.ndarray, Norm]:
    """(grad of x, the norm's parameter grads)."""
    if isinstance(p, RMSNorm):
        return rmsnorm_bwd(p, ctx, dy)
    return layernorm_bwd(p, ctx, dy)


def norm_output(p: Norm, xhat: np.ndarray) -> np.ndarray:
    """The norm's output from its normalised input (what `norm_fwd` computes)."""
    y = xhat * p.w
    if isinstance(p, LayerNorm) and p.b is not None:
        y += p.b
    return y


# ---------------------------------------------------------------------------------------
# rotary positions


def _positions_key(pos: slice | np.ndarray) -> tuple:
    if isinstance(pos, slice):
        return ("slice", pos.start, pos.stop)
    return ("array", np.asarray(pos, np.int64).tobytes())


@functools.lru_cache(maxsize=32)
def _tables(key: tuple, head_dim: int, theta: float, dtype: str) -> Rotary:
    pos = np.arange(key[1], key[2]) if key[0] == "slice" else np.frombuffer(key[1], np.int64)
    rot = rotary_tables(pos, head_dim, theta, np.dtype(dtype))
    return Rotary(rot.cos[:, None, :], rot.sin[:, None, :])  # [T, 1, hs]: for [B, T, H, hs]


def rotary_for(cfg: GPTConfig, positions: slice | np.ndarray, dtype: Any) -> Rotary | None:
    """cos and sin [T, 1, hs] of the tokens at `positions` (their true places in the sequence),
    for activations laid out [B, T, heads, hs]; None with learned positions. Every block of a
    step asks for the same tables, so they are made once (a small cache)."""
    if cfg.positions != "rotary":
        return None
    return _tables(_positions_key(positions), cfg.head_size, cfg.rope_theta, np.dtype(dtype).str)


# ---------------------------------------------------------------------------------------
# the attention's input projections


def local_heads(cfg: GPTConfig, mesh: Mesh) -> tuple[int, int, slice]:
    """(query heads on this tp rank, head size, this rank's slice of all query heads)."""
    n_local = cfg.n_head // mesh.size("tp")
    h0 = mesh.index("tp") * n_local
    return n_local, cfg.head_size, slice(h0, h0 + n_local)


def local_kv_heads(cfg: GPTConfig, mesh: Mesh) -> slice:
    """The key/value heads this tp rank's query heads read: its share of them, or with more
    tp ranks than kv heads (tp a multiple of them) the one head its query group shares."""
    tp, kv = mesh.size("tp"), cfg.kv_heads
    n = max(1, kv // tp)
    k0 = mesh.index("tp") * kv // tp if tp > kv else mesh.index("tp") * n
    return slice(k0, k0 + n)


@attrs.frozen
class QKVCtx:
    """What the projections' backward needs beyond their input: the rotary tables (None with
    learned positions) and, for GQA, the columns of k and v this rank computed."""

    rot: Rotary | None
    kv_cols: slice | None


def qkv_fwd(p: Attention | GQAttention, h: np.ndarray, cfg: GPTConfig, mesh: Mesh,
            rot: Rotary | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, QKVCtx]:
    """q [B, nh, T, hs] and k, v [B, nkv, T, hs] (this rank's heads; views) from the norm's
    output h [B, T, C], q and k rotated by `rot`."""
    B, T = h.shape[:2]
    nh, hs, _ = local_heads(cfg, mesh)
    if isinstance(p, Attention):
        qkv, _ = linear_fwd(p.qkv, h)
        q, k, v = qkv.reshape(B, T, 3, nh, hs).transpose(2, 0, 1, 3, 4)  # views [B, T, nh, hs]
        cols = None
    else:
        heads = local_kv_heads(cfg, mesh)
        cols = slice(heads.start * hs, heads.stop * hs)
        q, k, v = linear_fwd_many([p.q, _columns(p.k, cols), _columns(p.v, cols)], h)
        q, k, v = q.reshape(B, T, nh, hs), k.reshape(B, T, -1, hs), v.reshape(B, T, -1, hs)
    if rot is not None:  # in place: q and k are this call's fresh projections (or views of one)
        rope_fwd(q, rot, out=q)
        rope_fwd(k, rot, out=k)
    return q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), QKVCtx(rot, cols)


def _columns(lin: Linear, cols: slice) -> Linear:
    """The Linear of output columns `cols` (views)."""
    return Linear(lin.w[:, cols], None if lin.b is None else lin.b[cols])


@attrs.frozen
class QKVGrads:
    """The projections' output grads [B, T, n·hs] (rotations undone): one fused array, or
    GQA's three."""

    qkv: np.ndarray | None = None
    q: np.ndarray | None = None
    k: np.ndarray | None = None
    v: np.ndarray | None = None


def qkv_grad_buffers(p: Attention | GQAttention, shape: tuple[int, int], cfg: GPTConfig, mesh: Mesh,
                     dtype: Any) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], Any]:
    """Zeroed grads of q, k, v as views [B, n, T, hs] for attention's backward to add into,
    and the storage they view."""
    B, T = shape
    nh, hs, _ = local_heads(cfg, mesh)
    if isinstance(p, Attention):
        buf = zero_into(aligned.empty((B, T, 3, nh, hs), dtype))  # the attention's tile products add into it
        return tuple(buf.transpose(2, 0, 3, 1, 4)), buf
    nkv = local_kv_heads(cfg, mesh).stop - local_kv_heads(cfg, mesh).start
    bufs = tuple(zero_into(aligned.empty((B, T, n, hs), dtype)) for n in (nh, nkv, nkv))
    return tuple(b.transpose(0, 2, 1, 3) for b in bufs), bufs


def qkv_bwd_input(p: Attention | GQAttention, ctx: QKVCtx, storage: Any) -> tuple[np.ndarray, QKVGrads]:
    """(grad of the norm's output h [B, T, C], partial over tp; the projections' output
    grads for the weight half) from `qkv_grad_buffers`' storage, which attention's backward
    filled."""
    if isinstance(p, Attention):
        B, T = storage.shape[:2]
        if ctx.rot is not None:  # q and k were rotated after the projection: undo it on their grads
            for i in (0, 1):
                rope_bwd(storage[:, :, i], ctx.rot, out=storage[:, :, i])
        dqkv = storage.reshape(B, T, -1)
        return linear_bwd_input(p.qkv, dqkv), QKVGrads(qkv=dqkv)
    dq, dk, dv = storage
    if ctx.rot is not None:  # in place: the buffers are this backward's own
        rope_bwd(dq, ctx.rot, out=dq)
        rope_bwd(dk, ctx.rot, out=dk)
    B, T = dq.shape[:2]
    dq, dk, dv = (d.reshape(B, T, -1) for d in (dq, dk, dv))
    dh = linear_bwd_input_sum([(p.q, dq), (_columns(p.k, ctx.kv_cols), dk), (_columns(p.v, ctx.kv_cols), dv)])
    return dh, QKVGrads(q=dq, k=dk, v=dv)


def qkv_bwd_weight(p: Attention | GQAttention, h: np.ndarray, ctx: QKVCtx,
                   g: QKVGrads, into: Attention | GQAttention | None = None) -> tuple[Linear, ...]:
    """The projections' weight (and bias) grads from their input h and output grads: the
    fused Linear's, or q's, k's and v's, k and v zero off this rank's columns (their sum
    over tp is the whole gradient, `numesh.nn.transformer.tp_partial`). `into`: where the
    weights' GEMMs may write (`linear_bwd_weight`'s `out`), or None."""
    if isinstance(p, Attention):
        return (linear_bwd_weight(p.qkv, h, g.qkv, into and into.qkv),)
    out = [linear_bwd_weight(p.q, h, g.q, into and into.q)]
    for lin, d, dest in ((p.k, g.k, into and into.k), (p.v, g.v, into and into.v)):
        if ctx.kv_cols == slice(0, lin.w.shape[1]):  # every kv head (tp=1): the part is the whole
            out.append(linear_bwd_weight(lin, h, d, dest))
            continue
        part = linear_bwd_weight(_columns(lin, ctx.kv_cols), h, d)
        whole = Linear(np.zeros_like(lin.w), None if lin.b is None else np.zeros_like(lin.b))
        whole.w[:, ctx.kv_cols] = part.w
        if whole.b is not None:
            whole.b[ctx.kv_cols] = part.b
        out.append(whole)
    return tuple(out)


def attention_grads(p: Attention | GQAttention, projections: tuple[Linear, ...],
                    proj: Linear) -> Attention | GQAttention:
    """The attention's gradient tree from `qkv_bwd_weight`'s grads and the out-projection's."""
    if isinstance(p, Attention):
        return Attention(qkv=projections[0], proj=proj)
    return GQAttention(*projections, proj=proj)
