"""Megatron tensor-parallel operators on the `tp` axis.

The conjugate pair `copy_to_tp` (f: identity forward, all-reduce backward) and
`reduce_from_tp` (g: all-reduce forward, identity backward) are the only places the
blocks communicate over tp. The vocabulary-parallel embedding and cross-entropy hold a
contiguous slice of the (padded) vocabulary per tp rank and never gather the full logits.

With sequence parallelism (`mesh.sequence_parallel`, Korthikanti et al. 2022) the
activations between the tensor-parallel matmuls are split over the sequence (dim 1 of
[B, T, C]) across the tp ranks, and the pair becomes all-gather / reduce-scatter:
`gather_from_sequence_parallel_region` (all-gather forward, reduce-scatter backward)
replaces f before a column-parallel matmul, `reduce_scatter_to_sequence_parallel_region`
(reduce-scatter forward, all-gather backward) replaces g after a row-parallel one. A ring
all-reduce is a reduce-scatter plus an all-gather, so the bus bytes are those of f/g.

The cross-entropy's backward is one fused pass (numesh.host.kernels.ce_bwd) when numba is
installed; `vocab_parallel_cross_entropy_bwd_reference` is its NumPy definition. So is the
embedding's (numesh.host.kernels.embedding_grad adds the tokens in order, where
`vocab_parallel_embedding_bwd_reference` adds each id's pairwise).
"""

from __future__ import annotations

import numpy as np

from numesh.host import kernels as K
from numesh.host.threads import chunk_rows, over_rows, zero_into
from numesh.mesh import Mesh, all_gather, pmax, psum, psum_scatter

SEQ = 1  # the sequence dimension of an activation [B, T, C]


def copy_to_tp_bwd(dx: np.ndarray, mesh: Mesh) -> np.ndarray:
    """Backward of f: the input was used by every tp rank, so its gradient is their sum."""
    return psum(dx, mesh, "tp", inplace=True)


def reduce_from_tp(x: np.ndarray, mesh: Mesh) -> np.ndarray:
    """Forward of g: sum the partial results of a row-parallel layer."""
    return psum(x, mesh, "tp", inplace=True)


def gather_from_sequence_parallel_region(x: np.ndarray, mesh: Mesh) -> np.ndarray:
    """Forward of the sp f: every tp rank's sequence slice [B, T/tp, C] -> [B, T, C]."""
    return all_gather(x, mesh, "tp", SEQ)


def gather_from_sequence_parallel_region_bwd(dx: np.ndarray, mesh: Mesh) -> np.ndarray:
    """Backward of the sp f: the full input was used by every tp rank, so each rank's slice
    of the gradient is the sum over tp of that slice, [B, T, C] -> [B, T/tp, C]."""
    return psum_scatter(dx, mesh, "tp", SEQ)


def reduce_scatter_to_sequence_parallel_region(x: np.ndarray, mesh: Mesh) -> np.ndarray:
    """Forward of the sp g: sum a row-parallel layer's partial results over tp, each rank
    keeping its sequence slice, [B, T, C] -> [B, T/tp, C]."""
    return psum_scatter(x, mesh, "tp", SEQ)


def reduce_scatter_to_sequence_parallel_region_bwd(dy: np.ndarray, mesh: Mesh) -> np.ndarray:
    """Backward of the sp g: every rank needs the whole gradient, [B, T/tp, C] -> [B, T, C]."""
    return all_gather(dy, mesh, "tp", SEQ)


def sequence_slice(mesh: Mesh, t_local: int) -> slice:
    """This tp rank's positions of the sequence when an activation holds `t_local` of them
    (all of them without sequence parallelism)."""
    if not mesh.sequence_parallel:
        return slice(0, t_local)
    t0 = mesh.index("tp") * t_local
    return slice(t0, t0 + t_local)


def vocab_range(vocab_local: int, mesh: Mesh) -> tuple[int, int]:
    """[start, stop) of this tp rank's vocabulary slice."""
    start = mesh.index("tp") * vocab_local
    return start, start + vocab_local


def vocab_parallel_embedding_fwd(wte: np.ndarray, ids: np.ndarray, mesh: Mesh) -> tuple[np.ndarray, tuple]:
    """Rows of the embedding for `ids` [B, T], each from the tp rank that holds it: [B, T, C],
    or with sequence parallelism this rank's sequence slice [B, T/tp, C] (the partial rows
    reduce-scattered instead of all-reduced; its backward gathers the gradient first)."""
    if mesh.size("tp") == 1:
        return wte[ids], (ids, None)
    start, stop = vocab_range(wte.shape[0], mesh)
    local = ids - start
    outside = (local < 0) | (local >= wte.shape[0])
    local[outside] = 0
    y = wte[local]
    y[outside] = 0.0
    if mesh.sequence_parallel:
        return reduce_scatter_to_sequence_parallel_region(y, mesh), (local, outside)
    return reduce_from_tp(y, mesh), (local, outside)


def vocab_parallel_embedding_bwd(wte: np.ndarray, ctx: tuple, dy: np.ndarray) -> np.ndarray:
    """Gradient of this rank's wte rows from the gradient of the whole lookup [B, T, C]
    (with sequence parallelism the caller gathers it over tp first): one compiled pass
    (`numesh.host.kernels.embedding_grad`), where the reference's sort and gather ran on the
    main thread alone (`benchmarks/profile_train.py`'s vocab_parallel_embedding_bwd row)."""
    dy2 = dy.reshape(-1, dy.shape[-1])
    if not K.enabled() or dy2.dtype != wte.dtype:
        return vocab_parallel_embedding_bwd_reference(wte, ctx, dy)
    local, outside = ctx
    ids = local.reshape(-1) if outside is None else np.where(outside.reshape(-1), -1, local.reshape(-1))
    dwte = zero_into(np.empty_like(wte))  # [V, C] zeroed on the threads (a real vocabulary's is 50 MB and more)
    K.embedding_grad(ids.astype(np.int64, copy=False), np.ascontiguousarray(dy2), dwte)
    return dwte


def vocab_parallel_embedding_bwd_reference(wte: np.ndarray, ctx: tuple, dy: np.ndarray) -> np.ndarray:
    local, outside = ctx
    dwte = np.zeros_like(wte)
    dy2 = dy.reshape(-1, dy.shape[-1])
    idx = local.reshape(-1)
    if outside is not None:
        keep = ~outside.reshape(-1)
        idx, dy2 = idx[keep], dy2[keep]
    # each id's tokens, sorted stably by id, summed by np.add.reduceat (pairwise within an
    # id; np.add.at, which adds in token order, is ~5x slower)
    order = np.argsort(idx, kind="stable")
    ids = idx[order]
    starts = np.flatnonzero(np.diff(ids, prepend=-1))
    if starts.size:
        dwte[ids[starts]] = np.add.reduceat(dy2[order], starts, axis=0)
    return dwte


# logits a thread takes at least in the cross-entropy's kernels: a hand-off costs
# what a few hundred thousand exps do (numesh.host.threads' ELEMENTWISE_CHUNK)
CE_CHUNK = 1 << 18


def _local_targets(logits: np.ndarray, targets: np.ndarray, vocab_size: int,
                   mesh: Mesh) -> tuple[np.ndarray, np.ndarray]:
    """Both forwards' start: this rank's padding columns (past `vocab_size`) of `logits` set
    to -inf in place, and each token's target as (its column here, whether this rank holds it)."""
    v_local = logits.shape[1]
    start, stop = vocab_range(v_local, mesh)
    if stop > vocab_size:
        logits[:, max(vocab_size - start, 0) :] = -np.inf
    local = targets.reshape(-1) - start
    return local, (local >= 0) & (local < v_local)


def vocab_parallel_cross_entropy_fwd(
    logits: np.ndarray, targets: np.ndarray, vocab_size: int, mesh: Mesh
) -> tuple[np.ndarray, tuple]:
    """Per-token loss from this rank's logit columns [N, V_local]; `logits` is overwritten.

    Columns past `vocab_size` (padding) get zero probability. Returns (loss [N], ctx).
    With the kernels each row is shifted by this rank's own max in one visit
    (`kernels.ce_rows`, rows over the threads), then the ranks' maxima are combined (pmax)
    and each rank's sum rescaled to the common max before the one psum; the backward divides
    this rank's exp(logits - own max) by the sum rescaled back (`ctx[1]`), which is the sum
    itself on one rank. The same collectives and bytes as the NumPy path below."""
    if not K.enabled():
        return vocab_parallel_cross_entropy_fwd_reference(logits, targets, vocab_size, mesh)
    n, v_local = logits.shape
    local, inside = _local_targets(logits, targets, vocab_size, mesh)
    own_max, target = np.empty(n, logits.dtype), np.empty(n, logits.dtype)
    own_sum = np.empty(n, np.float64)
    idx = local.astype(np.int64, copy=False)
    over_rows(lambda r: K.ce_rows(logits[r], idx[r], own_max[r], own_sum[r], target[r]), n,
              chunk_rows(v_local, CE_CHUNK))
    m = pmax(own_max, mesh, "tp")
    # one all-reduce for both: [sum of exp at the common max, the shifted target logit (held by one rank)]
    sums = np.empty((2, n), dtype=logits.dtype)
    sums[0] = own_sum * np.exp((own_max - m).astype(np.float64))  # 1 on one rank; 0 for a rank's all-padding row
    sums[1] = np.where(inside, target - m, 0.0)
    sums = psum(sums, mesh, "tp", inplace=True)
    loss = np.log(sums[0]) - sums[1]
    # the sum at this rank's own max, what its exps divide by: inf where its max lies more
    # than exp's range below the common one, whose exps are then 0 (as they would be)
    with np.errstate(over="ignore"):
        sums[0] *= np.exp(m - own_max)
    return loss, (logits, sums[0], local, inside)


def vocab_parallel_cross_entropy_fwd_reference(
    logits: np.ndarray, targets: np.ndarray, vocab_size: int, mesh: Mesh
) -> tuple[np.ndarray, tuple]:
    """`vocab_parallel_cross_entropy_fwd` as NumPy passes over the whole array, shifted by
    the common max of every rank's columns."""
    n = logits.shape[0]
    local, inside = _local_targets(logits, targets, vocab_size, mesh)
    m = pmax(logits.max(axis=1), mesh, "tp")
    logits -= m[:, None]
    rows = np.arange(n)
    # one all-reduce for both: [sum of exp, the shifted target logit (held by one rank)]
    sums = np.empty((2, n), dtype=logits.dtype)
    sums[1] = np.where(inside, logits[rows, np.where(inside, local, 0)], 0.0)
    np.exp(logits, out=logits)
    logits.sum(axis=1, out=sums[0])
    sums = psum(sums, mesh, "tp", inplace=True)
    loss = np.log(sums[0]) - sums[1]
    return loss, (logits, sums[0], local, inside)


def vocab_parallel_cross_entropy_bwd(ctx: tuple, dloss: np.ndarray | float) -> np.ndarray:
    """Gradient w.r.t. the local logits for upstream gradient `dloss` per token (`ctx`'s
    buffer is reused)."""
    if not K.enabled():
        return vocab_parallel_cross_entropy_bwd_reference(ctx, dloss)
    probs, sumexp, local, inside = ctx
    n, v_local = probs.shape
    targets = np.where(inside, local, -1).astype(np.int64, copy=False)  # -1: the target is another rank's
    # a Python float scales in probs' dtype, as NumPy takes it (`probs *= dloss`); a NumPy
    # scalar or per-token array in float64, rounded once
    d = np.array([probs.dtype.type(dloss)], np.float64) if type(dloss) is float else \
        np.asarray(dloss, dtype=np.float64).reshape(-1)

    def rows(r: slice) -> None:
        K.ce_bwd(probs[r], sumexp[r], targets[r], d if d.shape[0] == 1 else d[r])

    over_rows(rows, n, chunk_rows(v_local, CE_CHUNK))
    return probs


def vocab_parallel_cross_entropy_bwd_reference(ctx: tuple, dloss: np.ndarray | float) -> np.ndarray:
    probs, sumexp, local, inside = ctx
    probs /= sumexp[:, None]
    rows = np.nonzero(inside)[0]
    probs[rows, local[rows]] -= 1.0
    if np.ndim(dloss) == 0:
        probs *= dloss
    else:
        probs *= np.asarray(dloss)[:, None]
    return probs
