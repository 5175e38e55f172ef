"""Causal ring attention over the cp axis, load-balanced, with its hand-written backward.

Each cp rank holds the queries, keys and values of its two chunks of every sequence (the
zigzag layout of `numesh.nn.context_parallel`: chunk r and chunk 2cp-1-r of 2cp). The
forward passes K/V blocks around the ring; at step s rank r holds the block of rank
src = r - s (mod cp) and folds it into an online (log-sum-exp) softmax. The transfer of the
next block is posted before the current one is computed on, so it runs under the compute.

Which pairs a step needs follows from the layout, no mask required off the first step:
  * s = 0, its own block: ordinary causal attention over its 2 chunks (its positions
    increase along its local order, so the local causal mask is the global one);
  * src < r: the src block's front chunk precedes both of r's chunks and its back chunk
    follows both: all of r's queries against the front half of the keys;
  * src > r: r's front chunk precedes both src chunks and r's back chunk follows both:
    r's back half of the queries against all the keys.
So every step off the diagonal is half a block of work on every rank, and every rank does
the same work: that is the load balance.

The backward passes K/V around again and, beside them, dK/dV accumulators: the one for
the block a rank holds collects every rank's contribution on its way and arrives home
after cp hops. Attention dropout applies the whole-sequence mask (drawn as on one rank) to
the probabilities by global position, so it stays mesh-independent.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np

from numesh.mesh import Mesh
from numesh.nn.context_parallel import DKV_TAG, KV_TAG, MeshRing, Ring, positions
from numesh.nn.layers import causal_attention_bwd, causal_attention_fwd


@attrs.frozen
class RingAttnCtx:
    """What the ring backward needs: scaled queries, this rank's K and V, the output and
    the rows' log-sum-exp [B, H, Tl, 1], and the dropout mask rows [B, H, Tl, T] (or None)."""

    qs: np.ndarray
    k: np.ndarray
    v: np.ndarray
    y: np.ndarray
    lse: np.ndarray
    drop_mask: np.ndarray | None


def block_pairs(r: int, src: int, c: int) -> tuple[slice, slice, bool]:
    """(query rows of rank r, key columns of rank src's block, causal?) that step needs,
    for chunks of c tokens (see the module docstring)."""
    if src == r:
        return slice(0, 2 * c), slice(0, 2 * c), True
    if src < r:
        return slice(0, 2 * c), slice(0, c), False
    return slice(c, 2 * c), slice(0, 2 * c), False


def _causal_bias(n: int, dtype) -> np.ndarray:
    """[n, n] additive mask: 0 on and below the diagonal, -inf above."""
    return np.where(np.tri(n, dtype=bool), 0.0, -np.inf).astype(dtype)


def _mask_block(drop_mask: np.ndarray | None, rows: slice, key_pos: np.ndarray) -> np.ndarray | None:
    """The dropout mask of some query rows against keys at global positions `key_pos`."""
    if drop_mask is None:
        return None
    return drop_mask[:, :, rows][..., key_pos]


def _scores(qs: np.ndarray, k: np.ndarray, causal: bool) -> np.ndarray:
    s = qs @ k.swapaxes(-1, -2)  # [B, H, rows, cols]
    if causal:
        s += _causal_bias(s.shape[-1], s.dtype)
    return s


def ring_attention_fwd(q: np.ndarray, k: np.ndarray, v: np.ndarray, ring: Ring,
                       drop_mask: np.ndarray | None = None, overlap: bool = True) -> tuple[np.ndarray, RingAttnCtx]:
    """Causal attention of this rank's q, k, v [B, H, Tl, hs] (its two chunks) against the
    whole sequence; `drop_mask` [B, H, Tl, T] (already scaled) over global key positions.
    `overlap=False` sends each block only after computing on it (for measuring what overlap
    buys: `mpirun -n 2 python benchmarks/bench_context_parallel.py overlap --block-size 1024`
    times both, alternating; on one 2-core node the 1 MB blocks are cheap beside the compute
    and the two times are within noise, so it is kept on for networks where they are not)."""
    B, H, Tl, hs = q.shape
    n, r, c = ring.size, ring.index, Tl // 2
    T = Tl * n
    qs = q * (1.0 / math.sqrt(hs))
    m = np.full((B, H, Tl, 1), -np.inf, q.dtype)  # running row maxima
    l = np.zeros((B, H, Tl, 1), q.dtype)  # running sums of exp
    acc = np.zeros(q.shape, q.dtype)  # running sums of exp × v
    kv = [np.ascontiguousarray(k), np.ascontiguousarray(v)]
    for s in range(n):
        src = (r - s) % n
        pending = ring.shift(kv, KV_TAG) if overlap and s < n - 1 else None
        rows, cols, causal = block_pairs(r, src, c)
        sc = _scores(qs[:, :, rows], kv[0][:, :, cols], causal)
        m_new = np.maximum(m[:, :, rows], sc.max(axis=-1, keepdims=True))
        alpha = np.exp(m[:, :, rows] - m_new)
        np.exp(sc - m_new, out=sc)  # p: un-normalised probabilities
        l[:, :, rows] = l[:, :, rows] * alpha + sc.sum(axis=-1, keepdims=True)
        md = _mask_block(drop_mask, rows, positions(T, n, src)[cols])
        acc[:, :, rows] = acc[:, :, rows] * alpha + (sc if md is None else sc * md) @ kv[1][:, :, cols]
        m[:, :, rows] = m_new
        if s < n - 1:
            kv = (pending if pending is not None else ring.shift(kv, KV_TAG)).wait()
    y = acc / l
    lse = m + np.log(l)
    return y, RingAttnCtx(qs, k, v, y, lse, drop_mask)


def ring_attention_bwd(ctx: RingAttnCtx, dy: np.ndarray, ring: Ring,
                       overlap: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dq, dk, dv) of this rank's q, k, v from the gradient `dy` [B, H, Tl, hs] of its output."""
    qs, lse, dm = ctx.qs, ctx.lse, ctx.drop_mask
    B, H, Tl, hs = qs.shape
    n, r, c = ring.size, ring.index, Tl // 2
    T = Tl * n
    d = np.einsum("bhtd,bhtd->bht", dy, ctx.y)[..., None]  # rowsum(dy·y) = rowsum(dA·A) [B, H, Tl, 1]
    dqs = np.zeros(qs.shape, qs.dtype)
    kv = [np.ascontiguousarray(ctx.k), np.ascontiguousarray(ctx.v)]
    dkv: list[np.ndarray] = []
    home = None  # the dK/dV accumulator in flight
    for s in range(n):
        src = (r - s) % n
        pending = ring.shift(kv, KV_TAG) if overlap and s < n - 1 else None
        rows, cols, causal = block_pairs(r, src, c)
        kb, vb, dyr = kv[0][:, :, cols], kv[1][:, :, cols], dy[:, :, rows]
        p = _scores(qs[:, :, rows], kb, causal)
        p -= lse[:, :, rows]
        np.exp(p, out=p)  # the attention probabilities A of these pairs
        md = _mask_block(dm, rows, positions(T, n, src)[cols])
        dv_part = (p if md is None else p * md).swapaxes(-1, -2) @ dyr
        ds = dyr @ vb.swapaxes(-1, -2)  # dA (before dropout)
        if md is not None:
            ds *= md
        ds -= d[:, :, rows]
        ds *= p  # softmax backward: dS = A (dA - rowsum(dA·A))
        dqs[:, :, rows] += ds @ kb
        dk_part = ds.swapaxes(-1, -2) @ qs[:, :, rows]
        dkv = [np.zeros(ctx.k.shape, qs.dtype), np.zeros(ctx.v.shape, qs.dtype)] if s == 0 else home.wait()
        dkv[0][:, :, cols] += dk_part
        dkv[1][:, :, cols] += dv_part
        if n > 1:  # on to the next rank; after cp hops each accumulator is back with its owner
            home = ring.shift(dkv, DKV_TAG)
        if s < n - 1:
            kv = (pending if pending is not None else ring.shift(kv, KV_TAG)).wait()
    if n > 1:
        dkv = home.wait()
    dqs *= 1.0 / math.sqrt(hs)
    return dqs, dkv[0], dkv[1]



def attention_fwd(q: np.ndarray, k: np.ndarray, v: np.ndarray, drop_mask: np.ndarray | None,
                  mesh: Mesh) -> tuple[np.ndarray, Any]:
    """The block's attention core on any mesh: whole-sequence causal attention, or with
    cp > 1 ring attention over the cp axis (q, k, v [B, H, T/cp, hs] of this rank's chunks)."""
    if mesh.size("cp") == 1:
        return causal_attention_fwd(q, k, v, drop_mask)
    return ring_attention_fwd(q, k, v, MeshRing(mesh), drop_mask)


def attention_bwd(ctx: Any, dy: np.ndarray, mesh: Mesh) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Backward of `attention_fwd`."""
    if isinstance(ctx, RingAttnCtx):
        return ring_attention_bwd(ctx, dy, MeshRing(mesh))
    return causal_attention_bwd(ctx, dy)
