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

Each block pair runs through the same tiled kernel as one rank's attention
(numesh/nn/attention.py: the diagonal pair causal, the others seeing every key), which
returns the pair's output and log-sum-exp; the pairs are merged by their log-sum-exps.
The backward passes K/V around again and, beside them, dK/dV accumulators: the one for
the block a rank holds collects every rank's contribution on its way and arrives home
after cp hops. Attention dropout hashes each pair's global positions, as on one rank, so it
stays mesh-independent.
"""

from __future__ import annotations

import math

import numpy as np

from numesh.mesh import Mesh
from numesh.nn.attention import (
    AttnCtx,
    AttnDropout,
    attend_bwd,
    attend_fwd,
    causal_attention_bwd,
    causal_attention_fwd,
    row_dots,
)
from numesh.nn.context_parallel import DKV_TAG, KV_TAG, MeshRing, Ring, positions


def block_pairs(r: int, src: int, c: int) -> tuple[slice, slice, bool]:
    """(query rows of rank r, key columns of rank src's block, causal?) that step needs,
    for chunks of c tokens (see the module docstring)."""
    if src == r:
        return slice(0, 2 * c), slice(0, 2 * c), True
    if src < r:
        return slice(0, 2 * c), slice(0, c), False
    return slice(c, 2 * c), slice(0, 2 * c), False


def _diag(causal: bool, keys: int) -> int:
    """`attend_fwd`'s diag for a pair: causal, or every key seen."""
    return 0 if causal else keys


def ring_attention_fwd(q: np.ndarray, k: np.ndarray, v: np.ndarray, y: np.ndarray, ring: Ring,
                       drop: AttnDropout | None = None, overlap: bool = True) -> AttnCtx:
    """Causal attention of this rank's q, k, v [B, H, Tl, hs] (its two chunks) against the
    whole sequence, into y [B, H, Tl, hs] (any view). `overlap=False` sends each block only
    after computing on it (for measuring what overlap buys: `mpirun -n 2 python
    benchmarks/bench_context_parallel.py overlap --block-size 1024` times both, alternating;
    on one 2-core node the 1 MB blocks are cheap beside the compute and the two times are
    within noise, so it is kept on for networks where they are not)."""
    B, H, Tl, hs = q.shape
    n, r, c = ring.size, ring.index, Tl // 2
    T = Tl * n
    qpos = positions(T, n, r)
    lse = np.full((B, H, Tl), -np.inf, q.dtype)
    y[...] = 0.0
    part = np.empty(q.shape, q.dtype)  # one pair's output
    kv = [np.ascontiguousarray(k), np.ascontiguousarray(v)]
    for s in range(n):
        src = (r - s) % n
        pending = ring.shift(kv, KV_TAG) if overlap and s < n - 1 else None
        rows, cols, causal = block_pairs(r, src, c)
        kb, vb = kv[0][:, :, cols], kv[1][:, :, cols]
        part_lse = attend_fwd(q[:, :, rows], kb, vb, part[:, :, rows], scale=1.0 / math.sqrt(hs),
                              diag=_diag(causal, kb.shape[2]), drop=drop, qpos=qpos[rows],
                              kpos=positions(T, n, src)[cols])
        _merge(y[:, :, rows], lse[:, :, rows], part[:, :, rows], part_lse)
        if s < n - 1:
            kv = (pending if pending is not None else ring.shift(kv, KV_TAG)).wait()
    return AttnCtx(q, k, v, y, lse, drop)  # the positions are recomputed in backward: nothing kept


def _merge(y: np.ndarray, lse: np.ndarray, part: np.ndarray, part_lse: np.ndarray) -> None:
    """Fold a pair's (output, log-sum-exp) into the running ones, in place: the softmax over
    both sets of keys is each one's output weighted by its share of the total exp-sum."""
    new = np.logaddexp(lse, part_lse)
    y *= np.exp(lse - new)[..., None]
    y += part * np.exp(part_lse - new)[..., None]
    lse[...] = new


def ring_attention_bwd(ctx: AttnCtx, dy: np.ndarray, dq: np.ndarray, dk: np.ndarray, dv: np.ndarray,
                       ring: Ring, overlap: bool = True) -> None:
    """The gradients of this rank's q, k, v for the gradient `dy` [B, H, Tl, hs] of its
    output, added into dq, dk, dv (any views)."""
    q, lse = ctx.q, ctx.lse
    B, H, Tl, hs = q.shape
    n, r, c = ring.size, ring.index, Tl // 2
    T = Tl * n
    dd = row_dots(dy, ctx.y)  # [B, H, Tl]
    qpos = positions(T, n, r)
    kv = [np.ascontiguousarray(ctx.k), np.ascontiguousarray(ctx.v)]
    dkv: list[np.ndarray] = []
    home = None  # the dK/dV accumulator in flight
    for s in range(n):
        src = (r - s) % n
        pending = ring.shift(kv, KV_TAG) if overlap and s < n - 1 else None
        rows, cols, causal = block_pairs(r, src, c)
        dkv = [np.zeros(ctx.k.shape, q.dtype), np.zeros(ctx.v.shape, q.dtype)] if s == 0 else home.wait()
        attend_bwd(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], dy[:, :, rows], lse[:, :, rows],
                   dd[:, :, rows], dq[:, :, rows], dkv[0][:, :, cols], dkv[1][:, :, cols],
                   scale=1.0 / math.sqrt(hs), diag=_diag(causal, cols.stop - cols.start), drop=ctx.drop,
                   qpos=qpos[rows], kpos=positions(T, n, src)[cols])
        if n > 1:  # on to the next rank; after cp hops each accumulator is back with its owner
            home = ring.shift(dkv, DKV_TAG)
        if s < n - 1:
            kv = (pending if pending is not None else ring.shift(kv, KV_TAG)).wait()
    if n > 1:
        dkv = home.wait()
    dk += dkv[0]
    dv += dkv[1]


def attention_fwd(q: np.ndarray, k: np.ndarray, v: np.ndarray, y: np.ndarray, drop: AttnDropout | None,
                  mesh: Mesh) -> AttnCtx:
    """The block's attention core on any mesh, into y: whole-sequence causal attention, or
    with cp > 1 ring attention over the cp axis (q, k, v [B, H, T/cp, hs] of this rank's
    chunks)."""
    if mesh.size("cp") == 1:
        return causal_attention_fwd(q, k, v, y, drop)
    return ring_attention_fwd(q, k, v, y, MeshRing(mesh), drop)


def attention_bwd(ctx: AttnCtx, dy: np.ndarray, dq: np.ndarray, dk: np.ndarray, dv: np.ndarray,
                  mesh: Mesh) -> None:
    """Backward of `attention_fwd`, added into dq, dk, dv."""
    if mesh.size("cp") == 1:
        return causal_attention_bwd(ctx, dy, dq, dk, dv)
    return ring_attention_bwd(ctx, dy, dq, dk, dv, MeshRing(mesh))
