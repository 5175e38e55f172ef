"""Row sums and dot products in float64, in a fixed order that compiles to vectors.

The norms' kernels (LayerNorm, RMSNorm) reduce each row of C values to one float64 sum.
numba compiles without fastmath, so LLVM may not reorder a sum: written as a loop, a sum
is one chain of dependent adds, one element a cycle (a float32 element also pays a scalar
conversion). The order here is written out instead as `LANES` lanes: lane k adds the
elements j = k, k + LANES, k + 2·LANES, ... of the row's whole blocks of LANES, in turn;
the lanes are then added in halves (lane k + lane k + LANES/2, and so on down to one); the
tail after the last whole block is added to that, element by element. Under numba the
lanes are one LLVM vector of LANES doubles, which LLVM lays over the CPU's registers (four
zmm on AVX-512, eight ymm on AVX2): IEEE arithmetic lane by lane, so the same bits on any
ISA and any thread count. A float32 element is widened to float64 before it is used, so a
product of two float32 values is exact. `python benchmarks/bench_rows.py` times these
against the four-chain scalar loops they replace and the norms against PyTorch's.

`row_sum` and `row_dot` are the definitions, in NumPy (what runs without numba, and what
the tests compare the compiled code with); `compile_for_numba` gives numba their vector
form, once numesh.host.kernels has set numba up.
"""

from __future__ import annotations

import numpy as np

LANES = 32  # 4 AVX-512 vectors of doubles: enough independent adds to hide an add's latency


_CHUNK = 1 << 14  # blocks of LANES a NumPy pass of the definition takes: bounds its float64 copies


def _lanes_reference(a: np.ndarray, b: np.ndarray | None = None) -> float:
    """The lanes' order applied to a vector a (of a·b with b), in float64: NumPy adds the
    rows of an [m, LANES] array over axis 0 one row after another (a sum along the
    contiguous axis would be pairwise instead), each pass's first row carrying the lanes so
    far."""
    n = a.shape[0]
    whole = n - n % LANES
    lanes = np.zeros((1, LANES))
    for start in range(0, whole, LANES * _CHUNK):
        stop = min(whole, start + LANES * _CHUNK)
        t = np.array(a[start:stop], np.float64).reshape(-1, LANES)
        if b is not None:
            t *= np.asarray(b[start:stop], np.float64).reshape(-1, LANES)
        t[0] += lanes[0]  # the lanes so far, then this pass's blocks in order
        lanes = np.add.reduce(t, axis=0, keepdims=True)
    v, w = lanes[0], LANES
    while w > 1:
        w //= 2
        v = v[:w] + v[w : 2 * w]
    s = float(v[0])
    for j in range(whole, n):
        s += float(a[j]) if b is None else float(a[j]) * float(b[j])
    return s


def row_sum(a: np.ndarray, i: int, n: int) -> float:
    """Σ_{j<n} a[i, j] in float64, in the lanes' order."""
    return _lanes_reference(a[i, :n])


def row_dot(a: np.ndarray, b: np.ndarray, i: int, n: int) -> float:
    """Σ_{j<n} a[i, j]·b[i, j] in float64 (each factor widened first), in the lanes' order."""
    return _lanes_reference(a[i, :n], b[i, :n])


def sum_squares(x: np.ndarray) -> float:
    """Σ x[j]² of a vector in float64 (each element widened first), in the lanes' order: a
    gradient norm's sum, the same bits whatever the BLAS, and no float32 overflow."""
    return _lanes_reference(x, x)


def _row_pointer(context, builder, aty, value, i):
    """(pointer to a[i, 0] as bytes, the stride between a row's elements in bytes)."""
    from llvmlite import ir

    arr = context.make_array(aty)(context, builder, value)
    raw = builder.bitcast(arr.data, ir.IntType(8).as_pointer())
    start = builder.gep(raw, [builder.mul(i, builder.extract_value(arr.strides, 0))])
    return start, builder.extract_value(arr.strides, 1)


def _load_block(context, builder, aty, start, stride, offset):
    """Elements offset .. offset + LANES of a row as float64 lanes: one vector load where
    the rows are C-contiguous, else element by element (the same values)."""
    from llvmlite import ir

    elem, i64, i32 = context.get_data_type(aty.dtype), ir.IntType(64), ir.IntType(32)
    if aty.layout == "C":
        p = builder.gep(builder.bitcast(start, elem.as_pointer()), [offset])
        v = builder.load(builder.bitcast(p, ir.VectorType(elem, LANES).as_pointer()), align=aty.dtype.bitwidth // 8)
    else:
        v = ir.Constant(ir.VectorType(elem, LANES), ir.Undefined)
        for k in range(LANES):
            at = builder.mul(builder.add(offset, ir.Constant(i64, k)), stride)
            x = builder.load(builder.bitcast(builder.gep(start, [at]), elem.as_pointer()))
            v = builder.insert_element(v, x, ir.Constant(i32, k))
    return v if elem == ir.DoubleType() else builder.fpext(v, ir.VectorType(ir.DoubleType(), LANES))


def _halves(builder, v):
    """The lanes of v added in halves (lane k + lane k + w/2, ...) down to one float64."""
    from llvmlite import ir

    i32, w = ir.IntType(32), LANES
    while w > 1:
        w //= 2
        half = ir.VectorType(i32, w)
        lo = builder.shuffle_vector(v, v, ir.Constant(half, list(range(w))))
        hi = builder.shuffle_vector(v, v, ir.Constant(half, list(range(w, 2 * w))))
        v = builder.fadd(lo, hi)
    return builder.extract_element(v, ir.Constant(i32, 0))


def _lanes_codegen(context, builder, arrays, values, i, n):
    """LLVM IR for row i's whole blocks of LANES (of one array: its sum; of two: their
    product's), lane by lane, then `_halves`: a float64 (the tail is the caller's)."""
    from llvmlite import ir

    i64, vec = ir.IntType(64), ir.VectorType(ir.DoubleType(), LANES)
    rows = [_row_pointer(context, builder, aty, v, i) for aty, v in zip(arrays, values)]
    blocks = builder.udiv(n, ir.Constant(i64, LANES))
    entry = builder.block
    head = builder.append_basic_block("lanes.head")
    body = builder.append_basic_block("lanes.body")
    done = builder.append_basic_block("lanes.done")
    builder.branch(head)
    builder.position_at_end(head)
    k, acc = builder.phi(i64), builder.phi(vec)
    k.add_incoming(ir.Constant(i64, 0), entry)
    acc.add_incoming(ir.Constant(vec, [0.0] * LANES), entry)
    builder.cbranch(builder.icmp_unsigned("<", k, blocks), body, done)
    builder.position_at_end(body)
    offset = builder.mul(k, ir.Constant(i64, LANES))
    terms = [_load_block(context, builder, aty, start, stride, offset) for aty, (start, stride) in zip(arrays, rows)]
    term = terms[0] if len(terms) == 1 else builder.fmul(terms[0], terms[1])
    k.add_incoming(builder.add(k, ir.Constant(i64, 1)), body)
    acc.add_incoming(builder.fadd(acc, term), body)
    builder.branch(head)
    builder.position_at_end(done)
    return _halves(builder, acc)


_compiled = False


def compile_for_numba() -> None:
    """Register the vector form of `row_sum` and `row_dot` with numba (idempotent). Called by
    numesh.host.kernels after it has pointed numba's cache and set its CPU features."""
    global _compiled
    if _compiled:
        return
    from numba import types
    from numba.extending import intrinsic, overload

    def rows(a) -> bool:
        return isinstance(a, types.Array) and a.ndim == 2 and isinstance(a.dtype, types.Float)

    @intrinsic
    def blocks_sum(typingctx, a, i, n):
        if not rows(a):
            return None
        return (types.float64(a, types.int64, types.int64),
                lambda context, builder, sig, args: _lanes_codegen(context, builder, sig.args[:1], args[:1], *args[1:]))

    @intrinsic
    def blocks_dot(typingctx, a, b, i, n):
        if not (rows(a) and rows(b)):
            return None
        return (types.float64(a, b, types.int64, types.int64),
                lambda context, builder, sig, args: _lanes_codegen(context, builder, sig.args[:2], args[:2], *args[2:]))

    @overload(row_sum)
    def _row_sum_vector(a, i, n):
        def impl(a, i, n):
            s = blocks_sum(a, np.int64(i), np.int64(n))
            for j in range(n - n % LANES, n):
                s += np.float64(a[i, j])
            return s

        return impl

    @overload(row_dot)
    def _row_dot_vector(a, b, i, n):
        def impl(a, b, i, n):
            s = blocks_dot(a, b, np.int64(i), np.int64(n))
            for j in range(n - n % LANES, n):
                s += np.float64(a[i, j]) * np.float64(b[i, j])
            return s

        return impl

    @overload(sum_squares)
    def _sum_squares_vector(x):
        def impl(x):
            rows = x.reshape((1, x.shape[0]))  # a contiguous vector as one row
            return row_dot(rows, rows, 0, x.shape[0])

        return impl

    _compiled = True
