"""Causal attention, fused and tiled: nothing of size T×T is ever held.

`attend_fwd` walks each (batch row, head) in stripes of query rows (`query_tile`). A stripe
multiplies its queries by only the keys they can see (keys above the diagonal are never
multiplied or masked), KEY_TILE keys at a time, folding each key tile into an online
(log-sum-exp) softmax: the largest buffer is KEY_TILE × a stripe per thread, whatever T.
A tile's scores are held transposed, [keys, queries] (see numesh/host/kernels.py for why).
It keeps the output and each row's log-sum-exp. `attend_bwd` is FlashAttention-2's
backward: each stripe's probabilities are recomputed from q, k and the saved log-sum-exp,
and dq, dk, dv accumulate stripe by stripe. The tile GEMMs run on BLAS (NumPy's matmul);
the softmax passes between them are numba kernels (numesh/host/kernels.py, `stripe_*`,
their exp vectorised) or their NumPy equivalents here. With numba, and numpy's GEMM
callable from it (`numesh.host.blas`), a group's whole stripe loop runs compiled
(`numesh.host.attention_kernels`): one GIL-free call per group instead of ~15 calls per
stripe, each handing the GIL between threads, dropout included (the same stream); the
loops below run without numba (or NUMESH_KERNELS=numpy) or without such a GEMM.
`attention_reference` is the plain definition (the whole T×T matrix at once) that both
are tested against.

Grouped-query attention (GQA: fewer key/value heads than query heads) is the same kernel:
q and y are viewed as [B, Hkv, g, T, hs], each kv head's g query heads together, and k, v
as [B, Hkv, 1, T, hs], so every tile GEMM reads one kv head for its whole group by
broadcasting, and the backward sums the group's dk, dv in order. Nothing repeats K or V.

Which keys a query sees is one rule, `diag`: query i sees key j iff j <= i + diag. Training
is diag = 0 (causal), ring attention's off-diagonal blocks see every key (diag >= keys),
and decoding T new tokens after `pos0` cached ones is diag = pos0.

Threads: the work is cut into units (query head, pair of query stripes), pairs first with
last so that each pair has the same causal work, and the units into one run per core
(`_unit_runs`: from the shape and the machine's cores, never the thread count); threads
take whole runs. A head cut between two runs has each run's part of its dk and dv summed
apart and the parts added in run order after the threads meet, so 9 heads split 4.5 : 4.5
over 2 threads (not 5 : 4) and over 16 threads none is idle, with the same bits for any
thread count. Inside a block run as pieces (numesh/nn/walk.py) a call is one run.

Attention dropout draws no mask: `AttnDropout` names the hash stream, and each tile's
keep/drop pattern comes from global (batch row, head, query, key) coordinates (see
numesh/host/kernels.py), the same pattern on every mesh.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import attrs
import numpy as np

from numesh.host import aligned, blas
from numesh.host import attention_kernels as AK
from numesh.host import kernels as K
from numesh.host import tile_gemm as TG
from numesh.host.threads import ELEMENTWISE_CHUNK, cores, in_pieces, over_rows

QUERY_TILE = 128  # query rows per stripe (benchmarks/bench_long_context.py --sections tiles measures others)
# Query rows per stripe where numesh.host.tile_gemm multiplies the tiles (`query_tile`): a
# causal stripe multiplies its whole diagonal block, half of it hidden, so shorter stripes
# waste less at short contexts (T = 512: 1.125x the causal half's products against 1.25x),
# and a tile_gemm product costs nothing to start; BLAS packs its operands at every call and
# keeps QUERY_TILE (`python benchmarks/bench_long_context.py --sections stripes --threads 1
# --clock cpu` times stripes of 32, 64 and 128 rows on both).
TILE_QUERIES = 64
# keys per online-softmax step: bounds a stripe's buffer whatever T is. With the tile
# products (tile_gemm) a 512 × 128 tile of scores and its gradient stay in L2 between the
# products and the passes; one thread, the kernel took 0.98x (head size 32) and 0.97x (64)
# the time it took with 2048-key tiles at T = 2048 (`python benchmarks/bench_long_context.py
# --sections tiles --threads 1 --clock cpu`), 0.95-0.96x at T = 4096, head size 32
KEY_TILE = 512
# Heads up to this wide multiply their tiles with numesh.host.tile_gemm on AVX-512, wider ones
# with BLAS: one thread, with aligned buffers (numesh.host.aligned), the kernel forward +
# backward took 0.90-0.95x BLAS's (MKL's) time at head size 32, 0.93-0.96x at 64 and
# 1.15x at 128 on a Cascade Lake (`python benchmarks/bench_long_context.py --sections products`).
TILE_HEAD_SIZE = 64
GROUP_SCORES = 1 << 18  # scores per group's buffer: (batch row, head) pairs are batched up to it
# A group that runs more stripes than this reads contiguous copies of its q, k, v (and dy)
# rows, else its rows in place: every stripe re-reads the keys, so the copy pays off only
# over many stripes (`python benchmarks/bench_long_context.py --sections copies`).
COPY_STRIPES = 8
_DROP_BITS = 24


@attrs.frozen
class AttnDropout:
    """Where one call's attention-dropout pattern comes from: the stream `key` (a hash of
    seed, step and layer), and the global coordinates of this call's local rows, heads and
    positions (`seq` is the whole sequence's length, the range positions are counted in)."""

    p: float
    key: int
    row0: int
    n_head: int
    head0: int
    seq: int

    @property
    def threshold(self) -> np.uint64:
        return np.uint64(math.ceil(self.p * (1 << _DROP_BITS)))

    def row_base(self, b: int, h: int, qpos: np.ndarray) -> np.ndarray:
        """((b·H + h)·S + q)·S for local batch row b, local head h and query positions qpos."""
        bh = np.uint64((self.row0 + b) * self.n_head + self.head0 + h)
        return (bh * np.uint64(self.seq) + qpos.astype(np.uint64)) * np.uint64(self.seq)


def _kept(key: np.uint64, counters: np.ndarray, threshold: np.uint64) -> np.ndarray:
    """Vectorised `numesh.host.kernels.drop_keep`: whether each counter's pair survives dropout."""
    z = np.uint64(key) ^ (counters * np.uint64(0x9E3779B97F4A7C15))
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(40)) >= threshold


def keep_mask(drop: AttnDropout, b: int, h: int, qpos: np.ndarray, kpos: np.ndarray) -> np.ndarray:
    """The keep (True) / drop pattern [len(qpos), len(kpos)] of one (row, head), vectorised:
    the same hash as the kernels' `drop_keep`."""
    counters = drop.row_base(b, h, qpos)[:, None] + kpos.astype(np.uint64)[None, :]
    return _kept(np.uint64(drop.key), counters, drop.threshold)


@attrs.frozen
class _Stripe:
    """What a stripe's passes need besides the scores: the dropout stream (threshold 0:
    none), each group's queries' counter bases [G, queries] and the key tile's positions."""

    key: np.uint64
    threshold: np.uint64
    inv_keep: float
    row_base: np.ndarray
    kpos: np.ndarray


@attrs.frozen
class _Group:
    """A rectangle of (batch row, head) pairs processed together: rows `b`, heads `h`; and
    with GQA, of each kv head's query heads `i` (all by default)."""

    b: slice
    h: slice
    i: slice = slice(0, None)

    @property
    def size(self) -> int:
        return (self.b.stop - self.b.start) * (self.h.stop - self.h.start)

    def heads(self, g: int) -> range:
        """Which of a kv head's g query heads the group holds."""
        return range(g)[self.i]


def _groups(u0: int, u1: int, H: int, cap: int) -> list[_Group]:
    """Rectangles covering the pairs u0..u1-1 of the flattened (batch row, head) index
    u = b·H + h, in order, each of at most `cap` pairs."""
    out, u = [], u0
    while u < u1:
        b, h = divmod(u, H)
        if h == 0 and cap >= H and u1 - u >= H:
            nb = min((u1 - u) // H, cap // H)
            out.append(_Group(slice(b, b + nb), slice(0, H)))
            u += nb * H
        else:
            n = min(H - h, u1 - u, cap)
            out.append(_Group(slice(b, b + 1), slice(h, h + n)))
            u += n
    return out


def _head_groups(u0: int, u1: int, Hk: int, g: int, cap: int) -> list[_Group]:
    """Rectangles covering the query heads u0..u1-1 of the flattened index u = (b·Hk + kv
    head)·g + i, in order: runs of whole kv groups batched as `_groups` batches pairs (at
    most `cap` pairs), a run's partial groups at its ends alone: runs of units (`_unit_runs`)
    cut kv groups anywhere, so 3 kv heads of 3 query heads each split 4.5 : 4.5 over 2
    threads, not 2 : 1."""
    out, u = [], u0
    while u < u1:
        pair, i = divmod(u, g)
        whole = (u1 - u) // g if i == 0 else 0
        if whole:
            out += _groups(pair, pair + whole, Hk, cap)
            u += whole * g
        else:
            n = min(g - i, u1 - u)
            b, h = divmod(pair, Hk)
            out.append(_Group(slice(b, b + 1), slice(h, h + 1), slice(i, i + n)))
            u += n
    return out


def _stripe(drop: AttnDropout | None, grp: _Group, qpos: np.ndarray, kpos: np.ndarray, dtype,
            g: int = 1) -> _Stripe:
    """The dropout stream of a group's stripe; the group's heads are kv heads, each standing
    for its query heads h·g + i (i in `grp.i`), in that order."""
    f = np.dtype(dtype).type
    heads = grp.heads(g)
    if drop is None or drop.p == 0.0:
        return _Stripe(np.uint64(0), np.uint64(0), f(1.0), np.zeros((grp.size * len(heads), len(qpos)), np.uint64),
                       np.zeros(len(kpos), np.uint64))
    base = np.concatenate([drop.row_base(b, h * g + i, qpos)[None] for b in range(grp.b.start, grp.b.stop)
                           for h in range(grp.h.start, grp.h.stop) for i in heads])
    return _Stripe(np.uint64(drop.key), drop.threshold, f(1.0 / (1.0 - drop.p)), base, kpos.astype(np.uint64))


def _keep(st: _Stripe, shape: tuple[int, int, int]) -> np.ndarray | None:
    """The NumPy passes' dropout factors (0 or 1/(1-p)) [G, keys, queries], or None without dropout."""
    if st.threshold == 0:
        return None
    kept = _kept(st.key, st.kpos[None, :, None] + st.row_base[:, None, :], st.threshold)
    return np.where(kept, st.inv_keep, 0.0).astype(type(st.inv_keep))


# ---------------------------------------------------------------------------------------
# the stripe passes: numba kernels, or the same steps in NumPy without them


def _hidden(vis0: int, shape: tuple[int, ...]) -> np.ndarray:
    """[keys, queries] True where query r does not see key j (j >= vis0 + r)."""
    return np.arange(shape[-2])[:, None] >= (vis0 + np.arange(shape[-1]))[None, :]


def _softmax(s: np.ndarray, vis0: int, m: np.ndarray, l: np.ndarray, alpha: np.ndarray, st: _Stripe) -> None:
    """One key tile of the online softmax: hidden scores out, the running max m and sum l
    updated (alpha: how much the old sum shrinks), s the tile's exp'ed (and dropped) scores."""
    if K.enabled():
        return K.stripe_softmax(s, vis0, m, l, alpha, st.key, st.threshold, st.inv_keep, st.row_base, st.kpos)
    s[:, _hidden(vis0, s.shape)] = -np.inf
    m_new = np.maximum(m, s.max(axis=1))
    with np.errstate(invalid="ignore"):  # -inf - -inf before a row's first key: alpha 0
        alpha[:] = np.where(m > -np.inf, np.exp(m - m_new), 0.0)
    m[:] = m_new
    s -= m_new[:, None, :]
    np.exp(s, out=s)
    l *= alpha
    l += s.sum(axis=1)
    keep = _keep(st, s.shape)
    if keep is not None:
        s *= keep


def _probs(s: np.ndarray, vis0: int, lse: np.ndarray) -> None:
    """The backward's probabilities in place: exp(s - lse), hidden ones 0."""
    if K.enabled():
        return K.stripe_probs(s, vis0, lse)
    s -= lse[:, None, :]
    s[:, _hidden(vis0, s.shape)] = -np.inf
    np.exp(s, out=s)


def _dropped(p: np.ndarray, out: np.ndarray, st: _Stripe) -> np.ndarray:
    """p after dropout (into `out`), or p itself without dropout."""
    if st.threshold == 0:
        return p
    if K.enabled():
        K.stripe_dropped(p, out, st.key, st.threshold, st.inv_keep, st.row_base, st.kpos)
    else:
        np.multiply(p, _keep(st, p.shape), out=out)
    return out


def _grad(p: np.ndarray, dp: np.ndarray, dd: np.ndarray, st: _Stripe) -> None:
    if K.enabled():
        return K.stripe_grad(p, dp, dd, st.key, st.threshold, st.inv_keep, st.row_base, st.kpos)
    keep = _keep(st, p.shape)
    if keep is not None:
        dp *= keep
    dp -= dd[:, None, :]
    dp *= p


# ---------------------------------------------------------------------------------------
# forward and backward


def _key_tiles(q0: int, q1: int, n_keys: int, diag: int) -> list[tuple[int, int, int]]:
    """(first key, end key, vis0) of each key tile query rows [q0, q1) need: the keys up to
    the last row's diagonal, KEY_TILE at a time; row q0 + r sees vis0 + r keys of the tile."""
    end = min(n_keys, q1 + diag)
    return [(j0, min(end, j0 + KEY_TILE), q0 + diag + 1 - j0) for j0 in range(0, end, KEY_TILE)]


def kv_group(n_head: int, n_kv_head: int) -> int:
    """Query heads per key/value head (1 without GQA)."""
    if n_kv_head < 1 or n_head % n_kv_head:
        raise ValueError(f"{n_head} query heads do not split into groups over {n_kv_head} key/value heads")
    return n_head // n_kv_head


def _grouped(x: np.ndarray, g: int) -> np.ndarray:
    """x [B, H, ...] as [B, H/g, g, ...]: query heads h·g ... h·g + g - 1 beside kv head h.
    A view whatever x's strides (numpy's reshape splits one axis without copying), so
    writes reach x; a tenth of as_strided's cost, which a short context's attention paid
    seven times a layer."""
    return x.reshape(x.shape[0], x.shape[1] // g, g, *x.shape[2:])


def _positions(pos: np.ndarray | None, n: int) -> np.ndarray:
    return np.arange(n) if pos is None else np.asarray(pos)


def _cap(Tq: int, Tk: int, qt: int) -> int:
    """Pairs per group: a group's stripe buffer (stripes of qt rows) holds at most
    GROUP_SCORES scores."""
    return max(1, GROUP_SCORES // (min(KEY_TILE, Tk) * min(qt, Tq)))


def query_tile(dtype, head_size: int) -> int:
    """Query rows per stripe: TILE_QUERIES where numesh.host.tile_gemm multiplies the tiles
    (`_gemm` 0), else QUERY_TILE. A function of the dtype, head size and CPU only, never of
    the thread count."""
    return TILE_QUERIES if _gemm(dtype, head_size) == 0 else QUERY_TILE


def _stripe_pairs(Tq: int, qt: int) -> list[tuple[int, ...]]:
    """The query stripes of qt rows (their first rows) in pairs, first with last, second
    with second last...: causal stripes pair up to equal work, so contiguous runs of pairs
    balance."""
    starts = list(range(0, Tq, qt))
    return [tuple(sorted({starts[i], starts[-1 - i]})) for i in range((len(starts) + 1) // 2)]


def _unit_runs(n_heads: int, n_pairs: int) -> list[tuple[int, int]]:
    """The units u = query head · n_pairs + stripe pair cut into one near-equal run per core
    (at most one per unit): [u0, u1) each. A function of the shape and the machine's cores
    (`numesh.host.threads.cores`), never of the thread count, so where a head is cut does
    not depend on how many threads run the runs. Inside a block run as pieces, one run: the
    call's batch rows are a run of pieces, as many as the threads leave each (1 thread: all
    of them, 2: half), so cuts there would move with the threads; and its thread is alone."""
    n = n_heads * n_pairs
    k = 1 if in_pieces() else max(1, min(cores(), n))
    return [(n * i // k, n * (i + 1) // k) for i in range(k)]


def _run_items(u0: int, u1: int, n_pairs: int) -> list[tuple[int, int, slice | None]]:
    """A run of units as (first query head, end query head, its stripe pairs or None for all):
    a partial head at either end alone, the whole heads between together."""
    out = []
    while u0 < u1:
        h, j = divmod(u0, n_pairs)
        if j == 0 and u1 - u0 >= n_pairs:
            whole = (u1 - u0) // n_pairs
            out.append((h, h + whole, None))
            u0 += whole * n_pairs
        else:
            end = min(u1, (h + 1) * n_pairs)
            out.append((h, h + 1, slice(j, end - h * n_pairs)))
            u0 = end
    return out


def _runs(n_heads: int, n_pairs: int) -> list[list[tuple[int, int, slice | None]]]:
    """Each run's items (`_run_items`) of the runs of units (`_unit_runs`)."""
    return [_run_items(u0, u1, n_pairs) for u0, u1 in _unit_runs(n_heads, n_pairs)]


def _starts(pairs: list[tuple[int, ...]], part: slice | None, Tq: int, qt: int) -> list[int]:
    """The first rows of the stripes (qt rows) of some pairs (all of them, in order, for None)."""
    return list(range(0, Tq, qt)) if part is None else sorted(q0 for pair in pairs[part] for q0 in pair)


def attend_fwd(q: np.ndarray, k: np.ndarray, v: np.ndarray, y: np.ndarray, *, scale: float, diag: int = 0,
               drop: AttnDropout | None = None, qpos: np.ndarray | None = None,
               kpos: np.ndarray | None = None) -> np.ndarray:
    """Softmax attention of q [B, H, Tq, hs] over k, v [B, Hkv, Tk, hs] (views with a unit
    last stride are fine; H a multiple of Hkv, query head h reading kv head h // (H/Hkv)),
    query i seeing key j iff j <= i + diag (diag >= 0), written into y [B, H, Tq, hs] (any
    view); returns each row's log-sum-exp [B, H, Tq] of the scaled scores. `qpos`/`kpos`:
    the global positions of the queries and keys (default 0..T-1), which only dropout uses.
    Threads take runs of (query head, stripe pair) units (`_unit_runs`): each stripe of each
    head is computed alike."""
    B, H, Tq, _ = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    if diag < 0:
        raise ValueError(f"diag must be >= 0 (every query sees the first key), got {diag}")
    g = kv_group(H, Hk)
    qpos, kpos = _positions(qpos, Tq), _positions(kpos, Tk)
    lse = np.empty((B, H, Tq), q.dtype)
    qt = query_tile(q.dtype, q.shape[-1])
    cap, pairs = max(1, _cap(Tq, Tk, qt) // g), _stripe_pairs(Tq, qt)
    call = functools.partial(_group_fwd, _grouped(q, g), k[:, :, None], v[:, :, None], _grouped(y, g),
                             lse.reshape(B, Hk, g, Tq), scale, diag, drop, qpos, kpos, qt)
    items = _runs(B * H, len(pairs))

    def run(r: slice) -> None:
        mine = [it for its in items[r] for it in its]
        (buf,) = _scratch(q.dtype, q.shape[-1], Tq, Tk, qt, min(cap * g, max(h1 - h0 for h0, h1, _ in mine)), 1)
        for h0, h1, part in mine:
            for grp in _head_groups(h0, h1, Hk, g, cap):
                call(grp, _starts(pairs, part, Tq, qt), buf)

    over_rows(run, len(items))
    return lse


def _scratch(dtype, head_size: int, Tq: int, Tk: int, qt: int, heads: int, n: int) -> tuple[np.ndarray, ...]:
    """A thread's n score buffers (forward 1, backward 3: probabilities, their gradient,
    dropped), as views of one 64-byte-aligned allocation (numesh.host.aligned; one call, as
    each call costs microseconds under the GIL while the other thread waits): room for one
    head's tile of a stripe (qt rows) where the compiled loops run (they take a head at a
    time), for `heads` heads' where the Python loops batch a group's GEMMs."""
    size = min(KEY_TILE, Tk) * min(qt, Tq) * (1 if _gemm(dtype, head_size) is not None else heads)
    block = aligned.empty(n * size, dtype)
    return tuple(block[i * size:(i + 1) * size] for i in range(n))


def _part(x: np.ndarray, grp: _Group) -> np.ndarray:
    """A group's rows and heads of x [B, Hkv, g or 1, ...] (its query heads `grp.i` of a
    query-head array): a view."""
    return x[grp.b, grp.h, grp.i if x.shape[2] > 1 else slice(None)]


def _read(x: np.ndarray, grp: _Group, copy: bool) -> np.ndarray:
    """A group's rows and heads of x as the compiled loops read it: C-contiguous when `copy`
    (many stripes re-read each key's row, and BLAS packs contiguous rows faster, see `_own`;
    COPY_STRIPES), else the view itself wherever its rows of hs are contiguous (few stripes:
    the GEMMs read each row where the QKV product left it, and a copy would cost more than
    it saves)."""
    part = _part(x, grp)
    return aligned.copy(part) if copy or part.strides[-1] != part.itemsize else part


def _own(x: np.ndarray, grp: _Group, scale: float | None = None) -> np.ndarray:
    """A group's rows and heads of x [B, Hkv, g or 1, ...] (its query heads `grp.i` of a
    query-head array), C-contiguous (times `scale` if given): copied once for all its
    stripes, since BLAS packs contiguous rows faster than rows strided through the QKV
    buffer (~8 % of the tile GEMMs' time at head size 32)."""
    part = _part(x, grp)
    return np.ascontiguousarray(part) if scale is None else part * part.dtype.type(scale)


def _gemm(dtype, head_size: int) -> int | None:
    """How `numesh.host.attention_kernels` (the stripe loops compiled, one GIL-free call per
    group) multiplies a tile: 0 for `numesh.host.tile_gemm`'s register-tiled products, which
    copy nothing, where the CPU has 64-byte vectors and heads are at most TILE_HEAD_SIZE
    wide; else the address of the BLAS GEMM; or None where the loops run here in Python:
    numba off or missing, or no usable GEMM (`blas.gemm_addresses`)."""
    fns = blas.gemm_addresses() if K.enabled() else None
    if fns is None:
        return None
    return 0 if TG.VB == 64 and head_size <= TILE_HEAD_SIZE else fns[np.dtype(dtype) == np.float64]


def _stream(drop: AttnDropout | None, grp: _Group, qpos: np.ndarray, kpos: np.ndarray, dtype,
            g_all: int) -> tuple:
    """The compiled loops' dropout arguments (key, threshold, inv_keep, counter bases [G,
    Tq], key positions [Tk]): every stripe's `_stripe` at once, sliced per stripe there."""
    st = _stripe(drop, grp, qpos, kpos, dtype, g_all)
    return st.key, st.threshold, st.inv_keep, st.row_base, st.kpos


def _group_fwd(q, k, v, y, lse, scale, diag, drop, qpos, kpos, qt: int, grp: _Group, starts,
               buf: np.ndarray) -> None:
    """The stripes (qt rows, `query_tile`) starting at `starts` of one group of (batch row, kv head) pairs, each with
    its query heads `grp.i` (q, y [B, Hkv, g, T, hs], lse [B, Hkv, g, T]; k, v [B, Hkv, 1,
    T, hs]): their y rows and log-sum-exps written."""
    yg, lseg = y[grp.b, grp.h, grp.i], lse[grp.b, grp.h, grp.i]
    fn = _gemm(q.dtype, q.shape[-1])
    if fn is not None:  # the scores' GEMM applies the scale
        qg, kg, vg = (_read(x, grp, len(starts) > COPY_STRIPES) for x in (q, k, v))
        AK.group_fwd(fn, qg, kg, vg, yg, lseg, q.dtype.type(scale), diag, np.asarray(starts, np.int64), qt,
                     KEY_TILE, buf, *_stream(drop, grp, qpos, kpos, q.dtype, q.shape[2]))
        return
    qg, kg, vg = _own(q, grp, scale), _own(k, grp), _own(v, grp)
    for q0 in starts:
        _stripe_fwd(qg, kg, vg, yg, lseg, diag, drop, qpos, kpos, grp, q0, buf, q.shape[2])


def _stripe_fwd(qg, kg, vg, yg, lseg, diag, drop, qpos, kpos, grp: _Group, q0: int, buf: np.ndarray,
                g_all: int) -> None:
    """Query rows [q0, q0 + QUERY_TILE) of a group: qg (scaled), yg [nb, nh, g, T, hs], lseg
    [nb, nh, g, T] (g of the kv group's g_all query heads); kg, vg [nb, nh, 1, T, hs]."""
    nb, nh, g = qg.shape[:3]
    q1 = min(qg.shape[3], q0 + QUERY_TILE)
    rows, G = q1 - q0, nb * nh * g
    qs = qg[:, :, :, q0:q1]  # [nb, nh, g, rows, hs]
    m = np.full((G, rows), -np.inf, qg.dtype)
    l, alpha = np.zeros((G, rows), qg.dtype), np.empty((G, rows), qg.dtype)
    acc = None
    for j0, j1, vis0 in _key_tiles(q0, q1, kg.shape[3], diag):
        s4 = buf[: G * (j1 - j0) * rows].reshape(nb, nh, g, j1 - j0, rows)
        np.matmul(kg[:, :, :, j0:j1], qs.swapaxes(-1, -2), out=s4)  # [nb, nh, g, keys, rows]
        st = _stripe(drop, grp, qpos[q0:q1], kpos[j0:j1], qg.dtype, g_all)
        _softmax(s4.reshape(G, j1 - j0, rows), vis0, m, l, alpha, st)
        pv = np.matmul(s4.swapaxes(-1, -2), vg[:, :, :, j0:j1])  # [nb, nh, g, rows, hs]
        if acc is None:
            acc = pv
        else:
            acc *= alpha.reshape(nb, nh, g, rows, 1)
            acc += pv
    np.divide(acc, l.reshape(nb, nh, g, rows, 1), out=yg[:, :, :, q0:q1])
    lseg[:, :, :, q0:q1] = (m + np.log(l)).reshape(nb, nh, g, rows)


def attend_bwd(q: np.ndarray, k: np.ndarray, v: np.ndarray, dy: np.ndarray, lse: np.ndarray, dd: np.ndarray,
               dq: np.ndarray, dk: np.ndarray, dv: np.ndarray, *, scale: float, diag: int = 0,
               drop: AttnDropout | None = None, qpos: np.ndarray | None = None,
               kpos: np.ndarray | None = None) -> None:
    """Backward of `attend_fwd`, ADDED into dq, dk, dv (so a ring can accumulate): `dy` the
    output's gradient, `lse` the forward's log-sum-exp and `dd` = rowsum(dy·y) [B, H, Tq]
    (`row_dots`), which the softmax backward needs and a ring computes once. k, v, dk, dv
    may have fewer heads than q (GQA, as in `attend_fwd`). Threads take runs of (query head,
    stripe pair) units (`_unit_runs`); each head's dk, dv add its stripes in order, a head
    cut between runs each run's part apart, the parts added in run order at the end; with
    GQA each query head's share of dk, dv is kept apart and the g shares summed in order at
    the end: the sums follow the runs, which follow the cores, not the threads."""
    B, H, Tq, _ = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    g = kv_group(H, Hk)
    qpos, kpos = _positions(qpos, Tq), _positions(kpos, Tk)
    qt = query_tile(q.dtype, q.shape[-1])
    cap = max(1, _cap(Tq, Tk, qt) // g)
    q5, dy5, dq5 = _grouped(q, g), _grouped(dy, g), _grouped(dq, g)  # [B, Hkv, g, T, hs]
    k5, v5, dk5, dv5 = k[:, :, None], v[:, :, None], dk[:, :, None], dv[:, :, None]  # [B, Hkv, 1, T, hs]
    lse5, dd5 = _grouped(lse, g), _grouped(dd, g)
    # with GQA each query head's share of dk, dv: zeroed by the run that computes the head (on
    # its thread, not all on the main one first), or below where runs cut the head
    shares = (dk5, dv5) if g == 1 else (aligned.empty((B, Hk, g, Tk, k.shape[3]), dk.dtype),
                                        aligned.empty((B, Hk, g, Tk, v.shape[3]), dv.dtype))
    pairs = _stripe_pairs(Tq, qt)
    items = _runs(B * H, len(pairs))
    # a head cut between runs: each run's part of its dk, dv apart ([1, 1, 1, Tk, hs], as a group's)
    parts = {(r, h0): (aligned.empty((1, 1, 1, Tk, k.shape[3]), dk.dtype),
                       aligned.empty((1, 1, 1, Tk, v.shape[3]), dv.dtype))
             for r, its in enumerate(items) for h0, _, part in its if part is not None}  # zeroed by their runs
    first_part = {h: r for r, h in sorted(parts, reverse=True)}  # a cut head's share: zeroed by its first run

    def run(r: slice) -> None:
        mine = [(i, it) for i in range(r.start, r.stop) for it in items[i]]
        bufs = _scratch(q.dtype, q.shape[-1], Tq, Tk, qt, min(cap * g, max(h1 - h0 for _, (h0, h1, _) in mine)), 3)
        for i, (h0, h1, part) in mine:
            for buf in parts[i, h0] if part is not None else ():
                buf.fill(0)
            for grp in _head_groups(h0, h1, Hk, g, cap):
                for share in shares if g > 1 and (part is None or first_part[h0] == i) else ():
                    share[grp.b, grp.h, grp.i] = 0
                _group_bwd(q5, k5, v5, dy5, lse5, dd5, dq5, *(shares if part is None else parts[i, h0]), scale, diag,
                           drop, qpos, kpos, grp, bufs, _starts(pairs, part, Tq, qt), qt, part is not None)

    over_rows(run, len(items))
    for (_, h), (pk, pv) in sorted(parts.items()):  # run order
        grp = _head_groups(h, h + 1, Hk, g, cap)[0]  # the head's place, as its part was computed
        shares[0][grp.b, grp.h, grp.i] += pk
        shares[1][grp.b, grp.h, grp.i] += pv
    if g > 1:
        add_shares(dk5, shares[0])
        add_shares(dv5, shares[1])


def add_shares(out: np.ndarray, shares: np.ndarray) -> None:
    """out [B, Hkv, 1, T, hs] += the g query heads' shares [B, Hkv, g, T, hs] summed in
    order, ((s0 + s1) + s2) + ..., as shares.sum(axis=2) adds them, key rows split over the
    threads (element-wise, so the same bits on any thread count; on the main thread alone
    it took ~1 % of a SmolLM2 step at 2048 × 1)."""
    B, Hk, g, T, hs = shares.shape

    def rows(r: slice) -> None:
        for b in range(B):
            for h in range(Hk):
                total = shares[b, h, 0, r] + shares[b, h, 1, r]
                for i in range(2, g):
                    total += shares[b, h, i, r]
                out[b, h, 0, r] += total

    over_rows(rows, T, -(-ELEMENTWISE_CHUNK // (B * Hk * g * hs)))


def _group_bwd(q, k, v, dy, lse, dd, dq, dk, dv, scale, diag, drop, qpos, kpos, grp: _Group,
               bufs: tuple[np.ndarray, ...], starts: list[int], qt: int, part: bool = False) -> None:
    """The stripes (qt rows) starting at `starts` of one group of (batch row, kv head) pairs
    with their query heads `grp.i` (shapes as in `_group_fwd`; dk, dv [B, Hkv, 1, T, hs], or each query
    head's share [B, Hkv, g, T, hs] with GQA), in order: the group's dq and each of its query
    heads' dk, dv. The compiled loops' GEMMs add them straight into dq (those stripes' rows),
    dk and dv (no zeroed buffers, no adds after: at T = 64 those were a tenth of the
    backward's time, `perf record`), into a contiguous copy written back where a gradient's
    rows are not contiguous, so the bits are the same either way; the Python loops sum them
    in contiguous buffers, then add those once. `part`: one query head's part of its stripes,
    dk and dv [1, 1, 1, T, hs] its own buffers."""
    f = q.dtype.type
    fn = _gemm(q.dtype, q.shape[-1])
    qg, kg, vg, dyg = (_read(x, grp, fn is None or len(starts) > COPY_STRIPES) for x in (q, k, v, dy))
    lseg, ddg = _own(lse, grp), _own(dd, grp)
    per_head = (*qg.shape[:3], kg.shape[3])  # [nb, nh, the group's query heads, Tk]
    at = (grp.b, grp.h, grp.i)  # basic indexing: dq[at] etc. are views, and += writes through
    if fn is not None:  # the GEMMs that read q, and dq's, apply the scale
        outs = [dq[at]] + ([] if part else [dk[at], dv[at]])
        # the GEMMs accumulate in place: into each gradient itself where its rows are contiguous
        # (and of q's dtype, which the GEMM writes), else into a contiguous copy written back after
        into = [x if x.strides[-1] == x.itemsize and x.dtype == q.dtype else aligned.copy(x.astype(q.dtype, copy=False))
                for x in outs]
        dqg, dkg, dvg = into[0], *((dk, dv) if part else into[1:])
        AK.group_bwd(fn, qg, kg, vg, dyg, lseg, ddg, dqg, dkg, dvg, f(scale), diag, np.asarray(starts, np.int64),
                     qt, KEY_TILE, *bufs, *_stream(drop, grp, qpos, kpos, q.dtype, q.shape[2]))
        for out, buf in zip(outs, into):
            if buf is not out:  # with `part`, dq alone: other runs write its other stripes' rows meanwhile
                for rows in ([np.s_[:, :, :, q0:q0 + qt] for q0 in starts] if part else [np.s_[...]]):
                    out[rows] = buf[rows]
        return
    dqg = np.zeros(qg.shape, qg.dtype)
    dkg, dvg = (dk, dv) if part else (np.zeros((*per_head, kg.shape[4]), kg.dtype),
                                      np.zeros((*per_head, vg.shape[4]), vg.dtype))
    qg = qg * f(scale)
    for q0 in starts:
        _stripe_bwd(qg, kg, vg, dyg, lseg, ddg, dqg, dkg, dvg, diag, drop, qpos, kpos, grp, q0, bufs, q.shape[2])
    dqg *= f(scale)
    if part:  # other runs write the head's other stripes' rows of dq meanwhile
        for q0 in starts:
            dq[at][:, :, :, q0:q0 + QUERY_TILE] += dqg[:, :, :, q0:q0 + QUERY_TILE]
        return
    dq[at] += dqg
    dk[at] += dkg
    dv[at] += dvg


def _stripe_bwd(qg, kg, vg, dyg, lseg, ddg, dqg, dkg, dvg, diag, drop, qpos, kpos, grp: _Group, q0: int,
                bufs: tuple[np.ndarray, ...], g_all: int) -> None:
    """One stripe of a group (its arrays as `_group_bwd` holds them; g of its kv heads'
    g_all query heads): its rows of dqg (not yet scaled), and each query head's share of
    every visible key's dkg, dvg."""
    nb, nh, g = qg.shape[:3]
    q1 = min(qg.shape[3], q0 + QUERY_TILE)
    rows, G = q1 - q0, nb * nh * g
    qs, dy_s, dqs = qg[:, :, :, q0:q1], dyg[:, :, :, q0:q1], dqg[:, :, :, q0:q1]  # [nb, nh, g, rows, hs]
    lse_s = np.ascontiguousarray(lseg[:, :, :, q0:q1]).reshape(G, rows)
    dd_s = np.ascontiguousarray(ddg[:, :, :, q0:q1]).reshape(G, rows)
    for j0, j1, vis0 in _key_tiles(q0, q1, kg.shape[3], diag):
        st = _stripe(drop, grp, qpos[q0:q1], kpos[j0:j1], qg.dtype, g_all)
        p4, dp4, pd4 = (x[: G * (j1 - j0) * rows].reshape(nb, nh, g, j1 - j0, rows) for x in bufs)
        flat = (G, j1 - j0, rows)
        kt, vt = kg[:, :, :, j0:j1], vg[:, :, :, j0:j1]
        np.matmul(kt, qs.swapaxes(-1, -2), out=p4)
        _probs(p4.reshape(flat), vis0, lse_s)  # the attention probabilities [nb, nh, g, keys, rows]
        dropped = _dropped(p4.reshape(flat), pd4.reshape(flat), st).reshape(p4.shape)
        dvg[:, :, :, j0:j1] += np.matmul(dropped, dy_s)
        np.matmul(vt, dy_s.swapaxes(-1, -2), out=dp4)  # d(probabilities after dropout)
        _grad(p4.reshape(flat), dp4.reshape(flat), dd_s, st)  # d(scores)
        dqs += np.matmul(dp4.swapaxes(-1, -2), kt)
        dkg[:, :, :, j0:j1] += np.matmul(dp4, qs)


def row_dots(dy: np.ndarray, y: np.ndarray) -> np.ndarray:
    """rowsum(dy·y) [B, H, T]: equal to rowsum(dA·A) over the probabilities A, what the
    softmax backward subtracts."""
    return np.einsum("bhtd,bhtd->bht", dy, y)


def stripe_passes(keys: int, rows: int, dtype) -> tuple[Callable[[], None], Callable[[], None]]:
    """The element-wise work of one key tile × query stripe, forward (the online softmax)
    and backward (probabilities, gradient), as the kernels run it: what `numesh plan
    --calibrate` times per score (the GEMMs between them are timed as GEMMs)."""
    rng = np.random.default_rng(0)
    s, dp = (rng.standard_normal((1, keys, rows)).astype(dtype) for _ in range(2))
    m, l, alpha = np.full((1, rows), -np.inf, dtype), np.zeros((1, rows), dtype), np.empty((1, rows), dtype)
    st = _stripe(None, _Group(slice(0, 1), slice(0, 1)), np.arange(rows), np.arange(keys), dtype)

    def fwd() -> None:  # rerun on its own output: the values stay finite (exp of shifted scores)
        _softmax(s, keys, m, l, alpha, st)

    ones = np.ones((1, rows), dtype)

    def bwd() -> None:  # likewise: probabilities of 1 or less, minus a log-sum-exp of 1, stay in (0, 1]
        _probs(s, keys, ones)
        _grad(s, dp, l, st)

    fwd()
    return fwd, bwd


# ---------------------------------------------------------------------------------------
# the causal attention layer of one rank (cp's ring: numesh/nn/ring_attention.py)


@attrs.frozen
class AttnCtx:
    """What attention's backward needs: q, k, v [B, H, T, hs] (views of the QKV matmul's
    output, kept anyway), the output y (a view of the block's attention output), each row's
    log-sum-exp [B, H, T], the dropout stream and the queries' global positions."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    y: np.ndarray
    lse: np.ndarray
    drop: AttnDropout | None
    qpos: np.ndarray | None = None


def causal_attention_fwd(q: np.ndarray, k: np.ndarray, v: np.ndarray, y: np.ndarray,
                         drop: AttnDropout | None = None, qpos: np.ndarray | None = None) -> AttnCtx:
    """Causal attention of q, k, v [B, H, T, hs] into y [B, H, T, hs] (any view); `qpos`
    the tokens' global positions (dropout only; default 0..T-1)."""
    lse = attend_fwd(q, k, v, y, scale=1.0 / math.sqrt(q.shape[-1]), drop=drop, qpos=qpos, kpos=qpos)
    return AttnCtx(q, k, v, y, lse, drop, qpos)


def causal_attention_bwd(ctx: AttnCtx, dy: np.ndarray, dq: np.ndarray, dk: np.ndarray, dv: np.ndarray) -> None:
    """The gradients of q, k, v for the output gradient dy [B, H, T, hs], added into dq, dk,
    dv (zeros, or views of the QKV matmul's gradient)."""
    attend_bwd(ctx.q, ctx.k, ctx.v, dy, ctx.lse, row_dots(dy, ctx.y), dq, dk, dv,
               scale=1.0 / math.sqrt(ctx.q.shape[-1]), drop=ctx.drop, qpos=ctx.qpos, kpos=ctx.qpos)


# ---------------------------------------------------------------------------------------
# the definition


def attention_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, diag: int = 0,
                        drop: AttnDropout | None = None, qpos: np.ndarray | None = None,
                        kpos: np.ndarray | None = None) -> np.ndarray:
    """What `attend_fwd` computes, written plainly with the whole [B, H, Tq, Tk] matrix:
    softmax(q·kᵀ/√hs, keys j > i + diag hidden), dropout, times v; with fewer kv heads,
    each repeated for its group of query heads."""
    B, H, Tq, hs = q.shape
    g = kv_group(H, k.shape[1])
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    Tk = k.shape[2]
    scores = q @ k.swapaxes(-1, -2) / math.sqrt(hs)  # [B, H, Tq, Tk]
    hidden = np.arange(Tk)[None, :] > np.arange(Tq)[:, None] + diag
    scores = np.where(hidden, -np.inf, scores)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    if drop is not None and drop.p > 0:
        qpos, kpos = _positions(qpos, Tq), _positions(kpos, Tk)
        for b in range(B):
            for h in range(H):
                probs[b, h] *= keep_mask(drop, b, h, qpos, kpos) / (1.0 - drop.p)
    return probs @ v


def attention_reference_bwd(q: np.ndarray, k: np.ndarray, v: np.ndarray, dy: np.ndarray, *, diag: int = 0,
                            drop: AttnDropout | None = None, qpos: np.ndarray | None = None,
                            kpos: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dq, dk, dv) of `attention_reference` for the output gradient dy, written plainly
    (with fewer kv heads, dk and dv summed over each group's query heads)."""
    B, H, Tq, hs = q.shape
    g = kv_group(H, k.shape[1])
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    Tk = k.shape[2]
    scale = 1.0 / math.sqrt(hs)
    scores = q @ k.swapaxes(-1, -2) * scale
    scores = np.where(np.arange(Tk)[None, :] > np.arange(Tq)[:, None] + diag, -np.inf, scores)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    keep = np.ones_like(probs)
    if drop is not None and drop.p > 0:
        qpos, kpos = _positions(qpos, Tq), _positions(kpos, Tk)
        for b in range(B):
            for h in range(H):
                keep[b, h] = keep_mask(drop, b, h, qpos, kpos) / (1.0 - drop.p)
    dv = (probs * keep).swapaxes(-1, -2) @ dy
    dprobs = (dy @ v.swapaxes(-1, -2)) * keep
    dscores = probs * (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True))
    dk = dscores.swapaxes(-1, -2) @ q * scale
    Hk = H // g
    return dscores @ k * scale, dk.reshape(B, Hk, g, *dk.shape[2:]).sum(2), dv.reshape(B, Hk, g, *dv.shape[2:]).sum(2)
