"""The attention's tile products as register-tiled loops that read their operands in place.

A BLAS GEMM copies ("packs") both operands into its own layout before it multiplies. At
the attention's tile shapes one operand is a whole tile of scores (512 to 2,048 keys ×
128 queries) and the other is thin (a head's 32 or 64 columns), so the copies are a large part
of each call: MKL spent ~18 % of the kernel's time packing at T = 4,096, head size 32
(`perf`), and its tile GEMMs ran at half its rate on large products
(`python benchmarks/bench_long_context.py --sections attention` times the kernel).

`tile_mm` computes C (+)= alpha·A·B where B's rows are contiguous and A is read as scalars
at any two strides (so A may be a tile read transposed): an MR × NV block of C lives in
vector registers while k runs, each step one vector load per B vector, one broadcast per A
row and MR·NV fused multiply-adds; nothing is copied. When k is long (a stripe's keys) it
runs in chunks of KC steps, the block's unscaled partial sums kept in a small scratch
buffer between chunks, so that a chunk of B stays in L1.

Every element of C is one chain over k in order: acc = fma(a_k, b_k, acc) from 0, then C =
alpha·acc (or C + alpha·acc), so its bits do not depend on the block it fell in, the chunk
length, the thread count or the BLAS; the chain rounds differently from a BLAS GEMM, whose
order is its own. The fused multiply-add is LLVM's `fmuladd` (one rounding on every x86-64
CPU since Haswell). The block sizes are the vector registers' count and width: 64-byte
vectors on AVX-512, 32-byte ones elsewhere (`numba_target.vector_bytes`).

`tile_mm_reference` is the product in NumPy (float64 sums): what tests compare with.
"""

from __future__ import annotations

import numpy as np

from numesh.host.kernels import _JIT, HAVE_NUMBA, njit
from numesh.host.numba_target import vector_bytes

KC = 128  # k steps per chunk: a chunk of B (128 × 64 floats) stays in L1
MP = 48  # rows per panel when k is one chunk: their A rows (48 × 128 floats at most) stay in L1


# (MR, NV) register blocks: 64-byte vectors have 32 registers, 32-byte ones 16; each block
# leaves room for its NV loads of B and one broadcast of A.
_BLOCKS = {64: ((6, 4), (8, 2), (8, 1)), 32: ((2, 4), (6, 2), (8, 1))}


def tile_mm_reference(alpha: float, a: np.ndarray, b: np.ndarray, c: np.ndarray, accumulate: bool) -> None:
    """c (+)= alpha·a·b for a [m, k], b [k, n] and c [m, n] views, in float64 sums."""
    prod = alpha * (a.astype(np.float64) @ b.astype(np.float64))
    c[...] = (c + prod) if accumulate else prod


class _Vectors:
    """LLVM IR helpers for one micro-kernel: vectors of w elements, the last vector of a
    block masked to its first nlast lanes."""

    def __init__(self, builder, elem, width: int, nlast) -> None:
        from llvmlite import ir

        self.b, self.ir = builder, ir
        self.bits = 64 if isinstance(elem, ir.DoubleType) else 32
        self.w = width * 8 // self.bits
        i1, self.i32, self.i64 = ir.IntType(1), ir.IntType(32), ir.IntType(64)
        self.vt, self.eptr = ir.VectorType(elem, self.w), elem.as_pointer()
        self.vptr, mvt = self.vt.as_pointer(), ir.VectorType(i1, self.w)
        self.zero, self.align = ir.Constant(self.vt, [0.0] * self.w), ir.Constant(self.i32, self.bits // 8)
        name = f"v{self.w}f{self.bits}"
        self.mload = self._declare(f"llvm.masked.load.{name}.p0", ir.FunctionType(self.vt, [self.vptr, self.i32, mvt,
                                                                                             self.vt]))
        self.mstore = self._declare(f"llvm.masked.store.{name}.p0", ir.FunctionType(ir.VoidType(), [
            self.vt, self.vptr, self.i32, mvt]))
        self.fma = self._declare(f"llvm.fmuladd.{name}", ir.FunctionType(self.vt, [self.vt] * 3))
        lanes = ir.Constant(ir.VectorType(self.i64, self.w), list(range(self.w)))
        self.mask = builder.icmp_signed("<", lanes, self.splat(nlast, ir.VectorType(self.i64, self.w)))

    def _declare(self, name: str, fty):
        f = self.b.module.globals.get(name)
        return f if f is not None else self.ir.Function(self.b.module, fty, name)

    def const(self, x: int):
        return self.ir.Constant(self.i64, x)

    def splat(self, x, ty=None):
        ty = ty or self.vt
        v = self.b.insert_element(self.ir.Constant(ty, self.ir.Undefined), x, self.ir.Constant(self.i32, 0))
        return self.b.shuffle_vector(v, v, self.ir.Constant(self.ir.VectorType(self.i32, self.w), [0] * self.w))

    def load(self, p, last: bool):
        p = self.b.bitcast(p, self.vptr)
        if last:
            return self.b.call(self.mload, [p, self.align, self.mask, self.zero])
        return self.b.load(p, align=self.bits // 8)

    def store(self, x, p, last: bool) -> None:
        p = self.b.bitcast(p, self.vptr)
        if last:
            self.b.call(self.mstore, [x, p, self.align, self.mask])
        else:
            self.b.store(x, p, align=self.bits // 8)

    def block(self, base, ld, mr: int, nv: int) -> list:
        """Pointers to the mr × nv vectors of a block at address base, rows ld apart."""
        base = self.b.inttoptr(base, self.eptr)
        return [[self.b.gep(base, [self.b.add(self.b.mul(self.const(i), ld), self.const(v * self.w))])
                 for v in range(nv)] for i in range(mr)]


def _phis(v: _Vectors, mr: int, nv: int, incoming: list) -> list:
    """mr × nv vector phis, each with its (value, block) pairs of `incoming`."""
    out = [[v.b.phi(v.vt) for _ in range(nv)] for _ in range(mr)]
    for values, block in incoming:
        for i in range(mr):
            for j in range(nv):
                out[i][j].add_incoming(values[i][j], block)
    return out


def _start(v: _Vectors, mr: int, nv: int, start, src, lds) -> list:
    """The block's sums before its first step: zero, or (start != 0) the partial sums at src."""
    zeros = [[v.zero] * nv for _ in range(mr)]
    before = v.b.block
    with v.b.if_then(v.b.icmp_signed("!=", start, v.const(0))):
        at = v.block(src, lds, mr, nv)
        loaded = [[v.load(at[i][j], j == nv - 1) for j in range(nv)] for i in range(mr)]
        loaded_in = v.b.block
    return _phis(v, mr, nv, [(zeros, before), (loaded, loaded_in)])


def _steps(v: _Vectors, mr: int, nv: int, init: list, a, sam, sak, b, ldb, kdim) -> list:
    """The k loop: each step one load per B vector, one broadcast per A row, mr·nv FMAs."""
    entry = v.b.block
    head, body, done = (v.b.append_basic_block(f"tile.{x}") for x in ("head", "body", "done"))
    v.b.branch(head)
    v.b.position_at_end(head)
    k = v.b.phi(v.i64)
    k.add_incoming(v.const(0), entry)
    acc = _phis(v, mr, nv, [(init, entry)])
    v.b.cbranch(v.b.icmp_signed("<", k, kdim), body, done)
    v.b.position_at_end(body)
    ap, bp = v.b.inttoptr(a, v.eptr), v.b.inttoptr(b, v.eptr)
    brow, arow = v.b.gep(bp, [v.b.mul(k, ldb)]), v.b.gep(ap, [v.b.mul(k, sak)])
    bvec = [v.load(v.b.gep(brow, [v.const(j * v.w)]), j == nv - 1) for j in range(nv)]
    for i in range(mr):
        x = v.splat(v.b.load(v.b.gep(arow, [v.b.mul(v.const(i), sam)])))
        for j in range(nv):
            acc[i][j].add_incoming(v.b.call(v.fma, [x, bvec[j], acc[i][j]]), body)
    k.add_incoming(v.b.add(k, v.const(1)), body)
    v.b.branch(head)
    v.b.position_at_end(done)
    return acc


def _finish(v: _Vectors, mr: int, nv: int, acc: list, c, ldc, alpha, finish) -> None:
    """finish 0: the sums into c unscaled; 1: c = alpha·sums; 2: c += alpha·sums."""
    out, scale = v.block(c, ldc, mr, nv), v.splat(alpha)
    each = [(i, j, j == nv - 1) for i in range(mr) for j in range(nv)]
    with v.b.if_else(v.b.icmp_signed("==", finish, v.const(0))) as (raw, scaled):
        with raw:
            for i, j, last in each:
                v.store(acc[i][j], out[i][j], last)
        with scaled, v.b.if_else(v.b.icmp_signed("==", finish, v.const(2))) as (plus, put):
            with plus:
                for i, j, last in each:
                    v.store(v.b.fadd(v.load(out[i][j], last), v.b.fmul(acc[i][j], scale)), out[i][j], last)
            with put:
                for i, j, last in each:
                    v.store(v.b.fmul(acc[i][j], scale), out[i][j], last)


def _micro(mr: int, nv: int):
    """The intrinsic for one register block of mr rows × nv vectors of C."""
    from numba import types
    from numba.extending import intrinsic

    width = vector_bytes()

    @intrinsic
    def micro(typingctx, a, sam, sak, b, ldb, src, lds, c, ldc, kdim, nlast, alpha, start, finish):
        """C block (addresses, strides in elements) from A, B over kdim steps: `start` 0
        from zero, 1 from the partial sums at src; `finish` 0 those sums into c unscaled,
        1 c = alpha·sums, 2 c += alpha·sums. The last vector holds nlast valid lanes."""
        sig = types.void(a, sam, sak, b, ldb, src, lds, c, ldc, kdim, nlast, alpha, start, finish)

        def codegen(context, builder, signature, args):
            a, sam, sak, b, ldb, src, lds, c, ldc, kdim, nlast, alpha, start, finish = args
            v = _Vectors(builder, context.get_value_type(signature.args[11]), width, nlast)
            acc = _steps(v, mr, nv, _start(v, mr, nv, start, src, lds), a, sam, sak, b, ldb, kdim)
            _finish(v, mr, nv, acc, c, ldc, alpha, finish)
            return context.get_dummy_value()

        return sig, codegen

    return micro


VB = vector_bytes()
_TAILS = (4, 2, 1)  # rows of the blocks that finish a column's last rows: 64 rows of 6-row blocks end 4 high
if HAVE_NUMBA:
    (_MR0, _NV0), (_MR1, _NV1), (_MR2, _NV2) = _BLOCKS[VB]
    _K0, _K0_4, _K0_2, _K0_1 = _micro(_MR0, _NV0), _micro(4, _NV0), _micro(2, _NV0), _micro(1, _NV0)
    _K1, _K1_4, _K1_2, _K1_1 = _micro(_MR1, _NV1), _micro(4, _NV1), _micro(2, _NV1), _micro(1, _NV1)
    _K2, _K2_4, _K2_2, _K2_1 = _micro(_MR2, _NV2), _micro(4, _NV2), _micro(2, _NV2), _micro(1, _NV2)
else:  # the compiled attention loops, its only callers, run only with numba
    _MR0 = _NV0 = _MR1 = _NV1 = _MR2 = _NV2 = 1
    _K0 = _K0_4 = _K0_2 = _K0_1 = _K1 = _K1_4 = _K1_2 = _K1_1 = _K2 = _K2_4 = _K2_2 = _K2_1 = None


@njit(**_JIT)
def _block(kind, h, a, sam, sak, b, ldb, src, lds, dst, ldd, kc, nlast, alpha, start, fin):
    """One block of h rows (the kind's MR, or 4, 2, 1) of block column kind (NV = 4, 2, 1 vectors)."""
    if kind == 0:
        if h == 4:
            _K0_4(a, sam, sak, b, ldb, src, lds, dst, ldd, kc, nlast, alpha, start, fin)
        elif h == 2:
            _K0_2(a, sam, sak, b, ldb, src, lds, dst, ldd, kc, nlast, alpha, start, fin)
        elif h == 1:
            _K0_1(a, sam, sak, b, ldb, src, lds, dst, ldd, kc, nlast, alpha, start, fin)
        else:
            _K0(a, sam, sak, b, ldb, src, lds, dst, ldd, kc, nlast, alpha, start, fin)
    elif kind == 1:
        if h == 4:
            _K1_4(a, sam, sak, b, ldb, src, lds, dst, ldd, kc, nlast, alpha, start, fin)
        elif h == 2:
            _K1_2(a, sam, sak, b, ldb, src, lds, dst, ldd, kc, nlast, alpha, start, fin)
        elif h == 1:
            _K1_1(a, sam, sak, b, ldb, src, lds, dst, ldd, kc, nlast, alpha, start, fin)
        else:
            _K1(a, sam, sak, b, ldb, src, lds, dst, ldd, kc, nlast, alpha, start, fin)
    elif h == 4:
        _K2_4(a, sam, sak, b, ldb, src, lds, dst, ldd, kc, nlast, alpha, start, fin)
    elif h == 2:
        _K2_2(a, sam, sak, b, ldb, src, lds, dst, ldd, kc, nlast, alpha, start, fin)
    elif h == 1:
        _K2_1(a, sam, sak, b, ldb, src, lds, dst, ldd, kc, nlast, alpha, start, fin)
    else:
        _K2(a, sam, sak, b, ldb, src, lds, dst, ldd, kc, nlast, alpha, start, fin)


@njit(**_JIT)
def _rows(kind, m, a, sam, sak, b, ldb, src, lds, dst, ldd, kc, nlast, alpha, start, fin, es):
    """Rows 0..m of one block column (kind 0, 1, 2: NV = 4, 2, 1 vectors): blocks of MR
    rows, then the rest in blocks of 4, 2 and 1 rows (`_TAILS`), not a row at a time: a
    1-row block has too few independent sums to keep the FMA units busy, and a 64-row
    stripe of 6-row blocks left 4 such rows, ~1/5 of the product's time."""
    mr = _MR0 if kind == 0 else (_MR1 if kind == 1 else _MR2)
    i = 0
    while i < m:
        h = mr
        if i + mr > m:
            for t in _TAILS:
                if t <= m - i:
                    h = t
                    break
        _block(kind, h, a + i * sam * es, sam, sak, b, ldb, src + i * lds * es, lds, dst + i * ldd * es, ldd, kc,
               nlast, alpha, start, fin)
        i += h


@njit(**_JIT)
def tile_mm(m, n, k, alpha, a, sam, sak, b, ldb, c, ldc, accumulate, raw):
    """C [m, n] = alpha·A·B, or C += alpha·A·B (accumulate), with A[i, j] at a + (i·sam +
    j·sak) elements, B [k, n] rows at b with stride ldb, C's rows at c with stride ldc (a,
    b, c addresses; elements of raw's dtype). raw: scratch of at least m·4·(VB/itemsize)
    elements, used when k > KC."""
    es = raw.itemsize
    w = VB // es
    lds = np.int64(4 * w)
    a, b, c, rp = np.int64(a), np.int64(b), np.int64(c), np.int64(raw.ctypes.data)
    fin = np.int64(2 if accumulate else 1)
    if k <= KC:  # one chunk: panels of MP rows, each across every block column while its A rows are in L1
        for m0 in range(0, m, MP):
            _columns(min(MP, m - m0), n, k, alpha, a + m0 * sam * es, sam, sak, b, ldb, c + m0 * ldc * es, ldc, fin,
                     rp, lds, w, es)
        return
    n0 = 0
    while n0 < n:
        kind, nv, width, nlast = _column(n - n0, w)
        for k0 in range(0, k, KC):
            kc = np.int64(min(KC, k - k0))
            last = k0 + KC >= k
            dst, ldd, f = (c + n0 * es, np.int64(ldc), fin) if last else (rp, lds, np.int64(0))
            _rows(kind, m, a + k0 * sak * es, sam, sak, b + (k0 * ldb + n0) * es, ldb, rp, lds, dst, ldd, kc, nlast,
                  alpha, np.int64(k0 > 0), f, es)
        n0 += width


@njit(**_JIT)
def _column(rem, w):
    """(kind, vectors, columns, lanes of the last vector) of the block column that starts
    with rem columns left: 4 vectors while more than 3 remain, then 2, then 1."""
    kind, nv = (0, _NV0) if rem > 3 * w else ((1, _NV1) if rem > w else (2, _NV2))
    width = min(rem, nv * w)
    return kind, nv, width, np.int64(width - (nv - 1) * w)


@njit(**_JIT)
def _columns(m, n, k, alpha, a, sam, sak, b, ldb, c, ldc, fin, rp, lds, w, es):
    """Rows 0..m of C across all its block columns, k in one chunk."""
    n0 = 0
    while n0 < n:
        kind, nv, width, nlast = _column(n - n0, w)
        _rows(kind, m, a, sam, sak, b + n0 * es, ldb, rp, lds, c + n0 * es, np.int64(ldc), np.int64(k), nlast, alpha,
              np.int64(0), fin, es)
        n0 += width
