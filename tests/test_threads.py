"""Intra-op threads: row-independent ops split without changing a single bit, and blocks
split over sequences (`over_batch`) equal to one thread up to the order of the chunk sums."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from numesh.base.tree import tree_leaves, tree_leaves_with_path
from numesh.host import kernels as K
from numesh.host import spin, threads
from numesh.mesh import Mesh
from numesh.nn import walk
from numesh.nn.attention import AttnDropout, causal_attention_bwd, causal_attention_fwd
from numesh.nn.dropout import DropoutKey
from numesh.nn.gpt import GPTConfig, init_gpt
from numesh.nn.layers import gelu_bwd, gelu_fwd
from numesh.nn.walk import loss_and_grads
from numesh.optim.adamw import AdamWConfig, adamw_init, adamw_step


@pytest.mark.parametrize("spin", [False, True])
@pytest.mark.parametrize("n, k, min_rows", [(10, 3, 1), (7, 2, 1), (5, 4, 3), (1, 2, 1), (0, 2, 1)])
def test_over_rows_covers_each_row_once(with_threads, n: int, k: int, min_rows: int, spin: bool) -> None:
    with_threads(k, spin=spin)
    hits = np.zeros(n, dtype=int)
    chunks: list[slice] = []

    def fn(r: slice) -> None:
        chunks.append(r)
        hits[r] += 1

    threads.over_rows(fn, n, min_rows)
    assert (hits == 1).all()
    want = max(1, min(k, n // min_rows))
    assert len(chunks) == want


@pytest.mark.parametrize("spin", [False, True])
def test_over_rows_reraises_a_worker_error(with_threads, spin: bool) -> None:
    with_threads(2, spin=spin)

    def fn(r: slice) -> None:
        if r.start > 0:
            raise ValueError("boom in the worker")

    with pytest.raises(ValueError, match="boom in the worker"):
        threads.over_rows(fn, 8)
    threads.over_rows(lambda r: None, 8)  # the pool still works afterwards


def test_spinning_threads_run_every_job_between_sleeps(with_threads) -> None:
    """Waiting threads that spin awake (`set_threads(spin=True)`) still run every job once
    and hand every result back, whether the next job comes while they spin (back to back)
    or after they have gone to sleep (gaps longer than the spin)."""
    with_threads(4, spin=True)
    hits = np.zeros(64, dtype=int)
    for i in range(200):
        threads.over_rows(lambda r: hits.__setitem__(r, hits[r] + 1), 64)
        if i % 50 == 49:
            time.sleep(2 * spin.SPIN_SECONDS)  # the workers give up spinning and sleep on the queue
    assert (hits == 200).all()


@pytest.mark.skipif(not K.HAVE_NUMBA, reason="numba is not installed: waiters sleep at once")
def test_a_spinning_waiter_sees_a_bump_from_another_thread() -> None:
    """`spin.Counter.wait_change` returns True once another thread bumps the counter while
    it spins (without the GIL: the bumping thread needs it), and False when none does."""
    counter = spin.Counter()
    assert not counter.wait_change(counter.value(), seconds=1e-3)
    seen = counter.value()
    bumper = threading.Timer(0.01, counter.bump)
    bumper.start()
    assert counter.wait_change(seen, seconds=10.0), "the bump was never seen"
    bumper.join()
    assert counter.value() == seen + 1


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_threaded_layers_are_bit_identical(with_threads, dtype) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 20, 48)).astype(dtype)
    q, k, v, dy = (rng.standard_normal((6, 2, 9, 4)).astype(dtype) for _ in range(4))
    drop = AttnDropout(0.2, key=3, row0=0, n_head=2, head0=0, seq=9)

    def run() -> list[np.ndarray]:
        y, ctx = gelu_fwd(x)
        out = np.empty_like(q)
        actx = causal_attention_fwd(q, k, v, out, drop)
        grads = [np.zeros_like(a) for a in (q, k, v)]
        causal_attention_bwd(actx, dy, *grads)
        return [y, gelu_bwd(ctx, x), out, *grads]

    with_threads(1)
    one = run()
    with_threads(3)
    three = run()
    for a, b in zip(one, three):
        np.testing.assert_array_equal(a, b)


def test_threaded_adamw_is_bit_identical(with_threads) -> None:
    rng = np.random.default_rng(1)
    n = 300_001  # several 65536-element chunks and a ragged end
    p0, g = rng.standard_normal(n), rng.standard_normal(n)
    decay = (rng.random(n) > 0.5).astype(np.float64)
    results = []
    for k in (1, 4):
        with_threads(k)
        p, state = p0.copy(), adamw_init(p0)
        for _ in range(3):
            adamw_step(p, g, state, 1e-3, AdamWConfig(), decay)
        results.append((p, state.m, state.v))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_over_batch_returns_chunks_in_order_single_threaded_inside(with_threads) -> None:
    with_threads(3)
    seen: list[tuple[slice, int]] = []

    def fn(r: slice) -> tuple[int, int]:
        seen.append((r, threads.threads()))
        return r.start, r.stop

    assert threads.over_batch(fn, 7) == [(0, 2), (2, 4), (4, 7)]
    assert all(k == 1 for _, k in seen)  # nested over_rows / over_batch run as plain calls
    assert threads.threads() == 3
    assert threads.over_batch(fn, 1) == [(0, 1)]
    with pytest.raises(ValueError, match="boom"):
        threads.over_batch(lambda r: (_ for _ in ()).throw(ValueError("boom")) if r.start else 0, 4)
    assert threads.threads() == 3  # restored after an error too


def test_over_batch_limits_blas_only_where_it_runs_on_more_than_one_thread(with_threads) -> None:
    """Inside `over_batch` BLAS runs on one thread: left alone where it already does (as
    numesh.host.runtime sets it), limited for the call and restored where it does not."""
    with_threads(2)
    threads.over_batch(lambda r: None, 2)  # makes the BLAS controller

    def counts_now() -> list[int]:
        return [lib.num_threads for lib in threads._blas.lib_controllers]

    counts: list[list[int]] = []
    with threadpool_limits(limits=2, user_api="blas"):  # OpenBLAS's count (pip's MKL may be sequential)
        before = counts_now()
        threads.over_batch(lambda r: counts.append(counts_now()), 2)
        assert counts_now() == before and max(before) == 2
    with threadpool_limits(limits=1, user_api="blas"):
        threads.over_batch(lambda r: counts.append(counts_now()), 2)
    assert counts and all(n == 1 for c in counts for n in c)


def test_one_hand_off_holds_the_calls_back_and_runs_them_in_one(with_threads, monkeypatch) -> None:
    """`over_rows` calls made inside `one_hand_off` run at its end, all in one hand-off, each
    cut as it would have been at once; small ones, other threads' calls and calls with one
    thread run at once."""
    hand_offs = []
    real = threads._run_all
    monkeypatch.setattr(threads, "_run_all", lambda calls: hand_offs.append(len(calls)) or real(calls))
    sizes = (10, 3, 7)
    for k in (1, 2, 3):
        with_threads(k)
        hand_offs.clear()
        outs = [np.zeros(n) for n in sizes]
        seen: list[tuple[int, slice]] = []

        def fill(i: int, r: slice) -> None:
            seen.append((i, r))
            outs[i][r] = np.arange(r.start, r.stop) + 100 * i

        with threads.one_hand_off():
            for i, n in enumerate(sizes):
                threads.over_rows(lambda r, i=i: fill(i, r), n, 3)
            threads.over_rows(lambda r: fill(1, r), 3, 2)  # one chunk: at once
            assert hand_offs == [] and (k == 1 or not outs[0].any())
            other = np.zeros(10)
            t = threading.Thread(target=threads.over_rows, args=(lambda r: other.__setitem__(r, 1.0), 10, 3))
            t.start()
            t.join()
            assert other.all()  # another thread's call: at once
            hand_offs.clear()
        for i, n in enumerate(sizes):
            np.testing.assert_array_equal(outs[i], np.arange(n) + 100 * i)
        assert hand_offs == ([] if k == 1 else [k])
        want = [(i, r) for i, n in enumerate(sizes) for r in threads._bounds(n, min(k, n // 3))]
        assert sorted(seen, key=str) == sorted(want + [(1, slice(0, 3))], key=str)
    with pytest.raises(ValueError, match="boom"), threads.one_hand_off():
        threads.over_rows(lambda r: None, 10, 1)
        raise ValueError("boom")
    assert threads._held is None  # an error drops the held calls


# the model kinds' parts (numesh.nn.gpt.ARCHS): GPT-2's, and Llama's with one kv head for both query heads
KINDS = {"gpt2": {}, "llama": dict(norm="rmsnorm", positions="rotary", mlp="swiglu", tie_embeddings=False,
                                   n_kv_head=1)}


@pytest.mark.bits
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch", [2, 5])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_blocks_run_as_pieces_are_the_same_bits_on_any_thread_count(with_threads, monkeypatch, batch: int,
                                                                     dropout: float, kind: str) -> None:
    monkeypatch.setattr(walk, "PIECE_TOKENS", 1)  # pieces of one sequence, even in this tiny model
    cfg = GPTConfig(vocab_size=23, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=dropout, bias=True,
                    **KINDS[kind])
    mesh = Mesh.parse("")
    params = init_gpt(cfg, mesh, seed=3, dtype=np.float64)
    rng = np.random.default_rng(0)
    idx, targets = rng.integers(0, cfg.vocab_size, (2, batch, cfg.block_size))
    drop = DropoutKey(dropout, 7, 1, 0, batch) if dropout else None
    x = rng.standard_normal((batch, cfg.block_size, cfg.n_embd))
    dy = rng.standard_normal(x.shape)
    block = params.blocks[0]
    runs = {}
    with threadpool_limits(limits=1, user_api="blas"):
        for k in (1, 2, 3, 4):
            with_threads(k)
            loss, grads = loss_and_grads(params, idx, targets, cfg, mesh, 1.0 / idx.size, drop)
            y, ctx = walk.run_block_fwd(block, x, cfg, mesh, 0, drop)
            assert isinstance(ctx, threads.RowChunks) and len(ctx.rows) == len(
                threads.runs_for(k, threads.tiles(batch, 1, 16)))
            dx, w = walk.run_block_bwd(block, ctx, dy, cfg, mesh)
            # the zero-bubble halves (input grad now, weight grad later): the same pieces, the same tree
            _, ctx2 = walk.run_block_fwd(block, x, cfg, mesh, 0, drop)
            dx2, wctx = walk.run_block_bwd_input(block, ctx2, dy, cfg, mesh)
            w2 = walk.run_block_bwd_weight(block, wctx)
            for a, b in zip([dx, *tree_leaves(w)], [dx2, *tree_leaves(w2)], strict=True):
                np.testing.assert_array_equal(b, a)  # B then W = B and W at once
            runs[k] = [np.array(loss), *tree_leaves(grads), y, dx, *tree_leaves(w)]
    for k in (2, 3, 4):
        for a, b in zip(runs[1], runs[k], strict=True):
            np.testing.assert_array_equal(b, a)


@pytest.mark.bits
@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_a_stage_in_one_hand_off_is_the_same_bits_as_block_by_block(with_threads, monkeypatch, dropout: float,
                                                                    recompute: str) -> None:
    """On one rank a stage's blocks run in one hand-off each way (`walk.stage_blocks_fwd`,
    `stage_blocks_bwd`), its backward block by block where the runs' weight gradients
    would take more than STAGE_GRAD_BYTES: the loss and every gradient bit for bit as
    block by block, on one thread as on several."""
    monkeypatch.setattr(walk, "PIECE_TOKENS", 1)
    cfg = GPTConfig(vocab_size=23, block_size=8, n_layer=3, n_head=2, n_embd=16, dropout=dropout, bias=True)
    mesh = Mesh.parse("")
    params = init_gpt(cfg, mesh, seed=3, dtype=np.float64)
    idx, targets = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 4, cfg.block_size))
    drop = DropoutKey(dropout, 7, 1, 0, 4) if dropout else None
    hand_offs = []
    real = threads._run_all
    monkeypatch.setattr(threads, "_run_all", lambda calls: hand_offs.append(len(calls)) or real(calls))
    runs = {}
    with threadpool_limits(limits=1, user_api="blas"):
        for k, how in ((1, "one"), (2, "blocks"), (2, "one"), (2, "one fwd"), (4, "one")):
            with_threads(k)
            with monkeypatch.context() as m:
                if how == "blocks":
                    m.setattr(walk, "_one_hand_off", lambda *a: False)
                if how == "one fwd":
                    m.setattr(walk, "STAGE_GRAD_BYTES", 0)
                hand_offs.clear()
                loss, grads = loss_and_grads(params, idx, targets, cfg, mesh, 1.0 / idx.size, drop, recompute)
            runs[k, how] = [np.array(loss), *tree_leaves(grads)]
            blocks = len([n for n in hand_offs if n == min(k, 4)])
            assert blocks == {"one": 2, "blocks": 6, "one fwd": 4}[how] if k > 1 else hand_offs == []
    for key, got in runs.items():
        for a, b in zip(runs[1, "one"], got, strict=True):
            np.testing.assert_array_equal(b, a)


def test_block_pieces_are_a_function_of_the_shape() -> None:
    """At least PIECE_TOKENS tokens a piece, a power of two of them, at most one per core;
    whole with tp or cp; one run of pieces per thread, a power of two of them."""
    assert len(walk.block_pieces(1, 1, 12, 64, 16)) == 2  # the default model: 2 pieces of 6 sequences
    assert len(walk.block_pieces(1, 1, 2, 1024, 16)) == 2
    assert len(walk.block_pieces(1, 1, 64, 256, 16)) == 16  # the baby model on 16 cores: 4 sequences each
    assert len(walk.block_pieces(1, 1, 64, 256, 2)) == 2  # on 2
    assert len(walk.block_pieces(1, 1, 64, 256, 1)) == 1
    assert len(walk.block_pieces(1, 1, 1, 4096, 16)) == 1
    assert len(walk.block_pieces(1, 1, 12, 8, 16)) == 1  # 96 tokens: whole
    assert walk.block_pieces(2, 1, 64, 256, 16) == walk.block_pieces(1, 2, 64, 256, 16) == (slice(0, 64),)
    pieces = walk.block_pieces(1, 1, 64, 256, 16)
    assert [len(threads.runs_for(n, pieces)) for n in (1, 2, 3, 4, 16, 32)] == [1, 2, 2, 4, 16, 16]
    assert walk.row_chunks(4, 1, 1, 64, 256) == 4 and walk.row_chunks(4, 2, 1, 64, 256) == 1


@pytest.mark.parametrize("n, min_rows, most, count", [(768, 256, 16, 2), (1000, 256, 16, 2), (1100, 256, 16, 4),
                                                      (511, 256, 16, 1), (12, 2, 16, 4), (64, 1, 16, 16),
                                                      (64, 1, 2, 2), (64, 1, 3, 2), (0, 4, 16, 1)])
def test_tiles(with_threads, n: int, min_rows: int, most: int, count: int) -> None:
    got = {}
    for k in (1, 2, 16):
        with_threads(k)
        got[k] = threads.tiles(n, min_rows, most)
    assert got[1] == got[2] == got[16]  # never a function of the thread count
    t = got[1]
    assert len(t) == count and t[0].start == 0 and t[-1].stop == n
    assert all(a.stop == b.start for a, b in zip(t, t[1:]))
    assert count == 1 or min(r.stop - r.start for r in t) >= min_rows


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13])
def test_tree_sum_adds_in_one_tree_whichever_thread_adds(with_threads, n: int) -> None:
    """Values whose sum depends on the order of the additions: every thread count (so every
    split of the pieces into runs) gives the same bits as the pairwise tree written out."""
    vals = [np.array([1.0, 3.0]) * 10.0 ** (4 * (i % 5)) + 0.1 * i for i in range(n)]

    def tree(lo: int, size: int):
        if lo >= n:
            return None
        if size == 1:
            return vals[lo].copy()
        left, right = tree(lo, size // 2), tree(lo + size // 2, size // 2)
        return left if right is None else left + right

    want = tree(0, 1 << (n - 1).bit_length())
    for k in (1, 2, 3, 4):
        with_threads(k)
        sides, got = threads.tree_sum(lambda i: (i, vals[i].copy()), n)
        assert sides == list(range(n))
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_the_pairwise_sum_into_a_destination_has_the_same_bits(with_threads, n: int) -> None:
    """`_pairwise(trees, out)` (where the runs' weight gradients land in the optimiser's
    buffer, `ParamUnits.grad_slot`): the same bits as without, written into out's arrays and
    returning out itself; one tree is returned as it is and out is left alone. A mutation
    that adds the last pair in another order, or that drops one run, fails here."""
    rng = np.random.default_rng(1)
    scales = 10.0 ** rng.integers(-6, 7, size=(8, 1, 1))  # sums whose bits depend on their order
    trees = [(rng.standard_normal((3, 5)) * scales[i], (None, rng.standard_normal(4) * scales[i, 0]))
             for i in range(n)]

    def copies():
        return [(a.copy(), (None, b.copy())) for a, (_, b) in trees]

    for k in (1, 2, 3):
        with_threads(k)
        want = threads._pairwise(copies())
        out = (np.full((3, 5), np.nan), (None, np.full(4, np.nan)))
        got = threads._pairwise(copies(), out)
        if n == 1:
            assert got is not out and np.isnan(out[0]).all()
            np.testing.assert_array_equal(got[0], trees[0][0])
            continue
        assert got is out
        assert got[0].tobytes() == want[0].tobytes() and got[1][1].tobytes() == want[1][1].tobytes()
    with pytest.raises(ValueError, match="not shaped like"):
        threads._pairwise(copies()[:2] if n > 1 else copies() * 2, (np.zeros((5, 3)), (None, np.zeros(4))))


def test_a_sum_into_a_destination_splits_all_its_leaves_in_one_hand_off(with_threads, monkeypatch) -> None:
    """Leaves each too small to split (and an empty one) but together worth it: `_add_to`
    hands them to the threads at once, cut through the leaves wherever the chunks fall,
    with a + b's bits in every element; strided leaves go one by one as `add_into` takes
    them."""
    c = threads.ELEMENTWISE_CHUNK
    rng = np.random.default_rng(2)
    sizes = [c - 3, 0, c + 7, 5, c // 2]
    a = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    b = [rng.standard_normal(n) for n in sizes]  # float64 into float32, as `a += b`
    want = [x.copy() for x in a]
    for x, y in zip(want, b):
        x += y
    calls = []
    real = threads.over_rows
    monkeypatch.setattr(threads, "over_rows", lambda fn, m, r=1: calls.append(m) or real(fn, m, r))
    for k in (1, 2, 3, 4):
        with_threads(k)
        calls.clear()
        out = [np.full(n, np.nan, np.float32) for n in sizes]
        assert threads._add_to(out, a, b) is out
        assert all(o.tobytes() == w.tobytes() for o, w in zip(out, want))
        assert calls == ([sum(sizes)] if k > 1 else [])
    strided = [np.zeros(2 * n, np.float32)[::2] for n in sizes]
    calls.clear()
    threads._add_to(strided, a, b)
    assert all(o.tobytes() == w.tobytes() for o, w in zip(strided, want)) and calls == []


@pytest.mark.parametrize("n", [7, 2 * threads.ELEMENTWISE_CHUNK + 5, 5 * threads.ELEMENTWISE_CHUNK])
def test_add_into_and_copy_into_split_large_arrays_with_the_same_bits(with_threads, monkeypatch, n: int) -> None:
    """`add_into`, `copy_into`, `scale_into` and `zero_into` give a += b, dst[...] = src,
    x *= f's and x[...] = 0's bits on any thread count, float32 into float64 included; large
    contiguous ones are split over the threads, small, strided or broadcast ones are not
    (and still come out right)."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n)
    want_sum = a.copy()
    want_sum += b
    calls = []
    real = threads.over_rows
    monkeypatch.setattr(threads, "over_rows", lambda fn, m, r=1: calls.append(m) or real(fn, m, r))
    for k in (1, 2, 3):
        with_threads(k)
        calls.clear()
        got = a.copy()
        assert threads.add_into(got, b) is got
        np.testing.assert_array_equal(got, want_sum)
        into, a0 = np.full(n, np.nan, np.float32), a.copy()
        assert threads.add_into(a0, b, out=into) is into  # out = a + b, a left as it was
        assert into.tobytes() == want_sum.tobytes() and a0.tobytes() == a.tobytes()
        dst = np.empty(n)
        threads.copy_into(dst, a)
        np.testing.assert_array_equal(dst, a.astype(np.float64))
        scaled, want_scaled = a.copy(), a.copy()
        want_scaled *= 0.123456789
        threads.scale_into(scaled, 0.123456789)
        assert scaled.tobytes() == want_scaled.tobytes()
        zeroed = a.copy()
        assert threads.zero_into(zeroed) is zeroed
        assert not zeroed.any()
        assert calls == ([n, n, n, n, n] if k > 1 and n >= 2 * threads.ELEMENTWISE_CHUNK else [])
    strided = np.zeros(2 * n, np.float32)[::2]
    threads.add_into(strided, a)
    np.testing.assert_array_equal(strided, a)
    grid = np.ones((n, 2))
    threads.add_into(grid, np.array([1.0, 2.0]))  # broadcast
    np.testing.assert_array_equal(grid[-1], [2.0, 3.0])


def _record_over_tiles(monkeypatch) -> list[tuple[int, int, int | None]]:
    """Each `threads.over_tiles` call from now on, as (the thread count then, tiles, thread cap)."""
    calls: list[tuple[int, int, int | None]] = []
    real = threads.over_tiles

    def recording(fn, count, k=None):
        calls.append((threads.threads(), count, k))
        return real(fn, count, k)

    monkeypatch.setattr(threads, "over_tiles", recording)
    return calls


@pytest.mark.bits
@pytest.mark.parametrize("tile_rows", [16, threads.TILE_ROWS])
@pytest.mark.parametrize("m, k, n", [(1, 3, 5), (257, 64, 96), (1000, 128, 65), (1100, 64, 48)])
def test_matmul_split_over_rows_is_bit_identical(with_threads, monkeypatch, tile_rows: int, m: int, k: int,
                                                 n: int) -> None:
    """Each row comes from one single-threaded BLAS call on a fixed tile of rows: splitting
    over threads changes no bit (BLAS on one thread, as numesh.host.runtime.set_blas_threads sets
    it), and small products are not handed to other threads."""
    monkeypatch.setattr(threads, "TILE_ROWS", tile_rows)
    rng = np.random.default_rng(0)
    calls = _record_over_tiles(monkeypatch)
    for dtype in (np.float32, np.float64):
        a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
        calls.clear()
        with threadpool_limits(limits=1, user_api="blas"):
            monkeypatch.setattr(threads, "MIN_CHUNK_FLOPS", 1.0)
            with_threads(1)
            one = threads.matmul(a, b)
            a_f = a.T.copy().T  # a strided view, as the weight gradient's xᵀ: BLAS's transposed path
            one_f = threads.matmul(a_f, b)
            for n_threads in (2, 3):
                with_threads(n_threads)
                np.testing.assert_array_equal(threads.matmul(a, b), one)
                np.testing.assert_array_equal(threads.matmul(a_f, b), one_f)
            used = [min(t, c, cap) for t, c, cap in calls]
            assert max(used, default=1) == min(3, len(threads.tiles(m, tile_rows, threads.cores())))
            monkeypatch.setattr(threads, "MIN_CHUNK_FLOPS", 1e12)
            calls.clear()
            np.testing.assert_array_equal(threads.matmul(a, b), one)
            # too small to hand off: every tile on this thread
            assert max((min(t, c, cap) for t, c, cap in calls), default=0) <= 1


@pytest.mark.bits
@pytest.mark.parametrize("m", [1, 100, 1000])  # one tile (column tiles or one call), and row tiles
def test_several_products_in_one_hand_off_are_matmuls_bits(with_threads, monkeypatch, m: int) -> None:
    """`matmuls` gives each product's `matmul` bits and `matmul_sum` those of `matmul` then
    `add_into` in order (q, k, v's projections and their input gradient), on any thread
    count, with B read transposed as the backward reads Wᵀ; the products share one
    hand-off where `matmul` would cut all of them into row tiles."""
    monkeypatch.setattr(threads, "TILE_ROWS", 64)
    monkeypatch.setattr(threads, "_cores", 4)  # several row tiles at m = 1000 on any machine
    monkeypatch.setattr(threads, "MIN_CHUNK_FLOPS", 1.0)
    rng = np.random.default_rng(m)
    for dtype in (np.float32, np.float64):
        x = rng.standard_normal((m, 48)).astype(dtype)
        ws = [rng.standard_normal((n, 48)).astype(dtype) for n in (96, 32, 32)]  # [out, in], read as wᵀ
        dys = [rng.standard_normal((m, w.shape[0])).astype(dtype) * 10.0 ** (2 * i) for i, w in enumerate(ws)]
        with threadpool_limits(limits=1, user_api="blas"):
            with_threads(1)
            want_each = [threads.matmul(x, w.T) for w in ws]
            want_sum = threads.matmul(dys[0], ws[0])
            for dy, w in zip(dys[1:], ws[1:]):
                want_sum = threads.add_into(want_sum, threads.matmul(dy, w))
            calls = _record_over_tiles(monkeypatch)
            for n_threads in (1, 2, 3):
                with_threads(n_threads)
                calls.clear()
                got = threads.matmuls([(x, w.T) for w in ws])
                summed = threads.matmul_sum(list(zip(dys, ws)))
                for a, b in zip(got, want_each, strict=True):
                    assert a.tobytes() == b.tobytes()
                assert summed.tobytes() == want_sum.tobytes()
                if m == 1000:  # one hand-off each, every product's row tiles in it
                    assert [c for _, c, _ in calls] == [len(threads.tiles(m, 64, 4))] * 2


@pytest.mark.bits
@pytest.mark.parametrize("m, k, n", [(128, 512, 384), (100, 64, 300), (7, 33, 1000)])
def test_matmul_split_over_columns_is_bit_identical(with_threads, monkeypatch, m: int, k: int, n: int) -> None:
    """Too few rows for two row tiles (a narrow layer's weight gradient xᵀ·dy): each column
    comes from one single-threaded BLAS call on a fixed tile of columns, the tiles spread
    over the threads without changing a bit, and they are cut as the machine's cores say."""
    monkeypatch.setattr(threads, "TILE_COLS", 64)
    monkeypatch.setattr(threads, "_cores", 4)  # as on a 4-core machine, whatever this one has
    rng = np.random.default_rng(1)
    calls = _record_over_tiles(monkeypatch)
    for dtype in (np.float32, np.float64):
        a = rng.standard_normal((k, m)).astype(dtype).T  # a strided view, as the gradient's xᵀ
        b = rng.standard_normal((k, n)).astype(dtype)
        calls.clear()
        with threadpool_limits(limits=1, user_api="blas"):
            monkeypatch.setattr(threads, "MIN_CHUNK_FLOPS", 1.0)
            with_threads(1)
            one = threads.matmul(a, b)
            for n_threads in (2, 3, 4):
                with_threads(n_threads)
                np.testing.assert_array_equal(threads.matmul(a, b), one)
        assert {c for _, c, _ in calls} == {len(threads.tiles(n, 64, 4))} and len(threads.tiles(n, 64, 4)) > 1
        np.testing.assert_allclose(one, a @ b, rtol=1e-4 if dtype == np.float32 else 1e-12,
                                   atol=1e-4 if dtype == np.float32 else 1e-12)


@pytest.mark.bits
@pytest.mark.parametrize("dtype, arch", [("float32", "gpt2"), ("float64", "gpt2"), ("float64", "llama")])
def test_a_training_step_is_the_same_bits_on_1_and_2_threads(char_dataset, tmp_path, with_threads, monkeypatch,
                                                              dtype: str, arch: str) -> None:
    """Two optimiser steps: once with blocks whole (their matmuls in row tiles) and once as 4
    pieces (one run of 4 on one thread, two runs of 2 on two); losses, gradient norms and
    every parameter bit for bit. The Llama kind (GQA, rotary, RMSNorm, SwiGLU: their kernels
    split rows over the threads, RMSNorm's weight gradient over fixed tiles) as GPT-2's."""
    from numesh.run.config import TrainConfig
    from numesh.run.train import Trainer

    for piece_tokens, pieces in ((1 << 20, 1), (128, 4)):
        monkeypatch.setattr(walk, "PIECE_TOKENS", piece_tokens)
        monkeypatch.setattr(threads, "TILE_ROWS", 128)  # the head and the whole blocks' matmuls in 4 tiles
        runs = {}
        with threadpool_limits(limits=1, user_api="blas"):
            for k in (1, 2):
                with_threads(k)
                kind = {} if arch == "gpt2" else dict(norm="rmsnorm", positions="rotary", mlp="swiglu", n_kv_head=2,
                                                        tie_embeddings=False)
                cfg = TrainConfig(data=str(char_dataset), out=str(tmp_path / f"t{k}-{pieces}"), n_layer=2, n_embd=64,
                                  n_head=4, block_size=64, batch_size=8, max_iters=2, dtype=dtype, dropout=0.1,
                                  bias=True, arch=arch, **kind)
                t = Trainer(cfg)
                assert len(walk.block_pieces(1, 1, cfg.batch_size, cfg.block_size, threads.cores())) == pieces
                steps = [t.train_step() for _ in range(2)]
                runs[k] = [np.array(steps), *tree_leaves(t.gathered_params())]
        for a, b in zip(runs[1], runs[2], strict=True):
            np.testing.assert_array_equal(b, a)


def test_inside_a_run_of_pieces_a_matmul_is_one_call_per_piece(monkeypatch) -> None:
    """A block run as pieces is already split over the threads by its runs: inside one, a
    matmul over token rows makes one BLAS call per piece, and a weight gradient's xᵀ·dy
    (inside `token_sum`) one call, however many row or column tiles the shape would cut."""
    calls = []
    real = threads.matmul_into

    def counted(a, b, out):
        calls.append(a.shape)
        real(a, b, out)

    monkeypatch.setattr(threads, "matmul_into", counted)
    monkeypatch.setattr(threads, "_cores", 8)  # outside pieces these shapes are cut into tiles
    rng = np.random.default_rng(2)
    x, w, dy = rng.standard_normal((1024, 64)), rng.standard_normal((64, 96)), rng.standard_normal((1024, 96))
    threads.matmul(x, w)
    assert len(calls) > 1  # row tiles outside pieces
    calls.clear()
    with threads.token_pieces((slice(0, 512), slice(512, 1024))):
        y = threads.matmul(x, w)
        dw = threads.token_sum(lambda r: threads.matmul(x[r].T, dy[r]), 1024)
    assert calls == [(512, 64), (512, 64), (64, 512), (64, 512)]
    np.testing.assert_allclose(y, x @ w, rtol=1e-12)
    np.testing.assert_allclose(dw, x.T @ dy, rtol=1e-10, atol=1e-12)  # pieces summed apart



@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("run", ["fused", "block by block", "whole blocks"])
@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("how", ["plain", "split, 2 micro-batches"])
def test_the_weight_gradients_land_in_the_optimisers_buffer_without_a_copy(with_threads, monkeypatch, stage: int,
                                                                           run: str, arch: str, how: str) -> None:
    """A backward writes its blocks' weight gradients straight into the ZeRO optimiser's
    gradient buffer (`ParamUnits.grad_slot`): where blocks run in pieces over the threads
    the runs' last sum lands there (a stage's blocks in one hand-off, `fused`, or block by
    block), where a block runs whole its weights' GEMMs write there. Under stages 0 and 1
    nothing of it is copied afterwards (only the outer unit, and a whole block's norms and
    biases, which no GEMM makes); under stage 2 (no full buffer) everything is handed over
    as before. Either way the buffer holds the bits of a backward without the slots, two
    steps running (the slots are made once), with the weight halves deferred (zero-bubble's
    W, `stage_weight`) and with a second micro-batch added into the first's."""
    from mpi4py import MPI

    from numesh.nn.gpt import gpt_specs
    from numesh.nn.units import OUTER, split_units
    from numesh.optim import grad_sync
    from numesh.optim.zero import ZeroOptimizer

    monkeypatch.setattr(walk, "PIECE_TOKENS", 1 << 20 if run == "whole blocks" else 1)  # pieces of one sequence
    if run == "block by block":
        monkeypatch.setattr(walk, "STAGE_GRAD_BYTES", 0)
    parts = dict(norm="rmsnorm", positions="rotary", mlp="swiglu", n_kv_head=1, bias=False) if arch == "llama" \
        else dict(bias=True)
    cfg = GPTConfig(vocab_size=13, block_size=8, n_layer=3, n_head=2, n_embd=8, dropout=0.0, **parts)
    mesh = Mesh.create(comm=MPI.COMM_SELF)
    rng = np.random.default_rng(3)
    idx, tgt = rng.integers(0, 13, (8, 8)), rng.integers(0, 13, (8, 8))
    model = walk.whole_model(cfg.n_layer)
    real_copy = grad_sync.copy_into

    def grads(slots: bool) -> tuple[dict, list]:
        units = split_units(init_gpt(cfg, mesh, seed=0, dtype=np.float64))
        opt = ZeroOptimizer(units, split_units(gpt_specs(cfg)), mesh, stage=stage)
        if not slots:
            monkeypatch.setattr(opt, "grad_slot", lambda key: None)
        copied: list[int] = []
        monkeypatch.setattr(grad_sync, "copy_into", lambda d, s: copied.append(d.size) or real_copy(d, s))
        micro = [slice(0, 8)] if how == "plain" else [slice(0, 4), slice(4, 8)]
        for _ in range(2):
            copied.clear()
            opt.begin_step(len(micro))
            for rows in micro:
                _, ctx = walk.stage_forward(opt, model, idx[rows], tgt[rows], cfg, mesh)
                _, outer, deferred = walk.stage_backward(opt, model, ctx, 1.0 / idx.size, cfg, mesh,
                                                         split=how != "plain")
                walk.stage_weight(opt, deferred)
                opt.grads_ready(OUTER, outer)
            opt.wait()
        return {k: opt.sync.grad(k).copy() for k in opt.units}, copied

    with_threads(2)
    want, copied_without = grads(False)
    got, copied_with = grads(True)
    for k in want:
        assert got[k].tobytes() == want[k].tobytes(), k
    units = split_units(init_gpt(cfg, mesh, seed=0, dtype=np.float64))
    leaves = {u: len(tree_leaves(t)) for u, t in units.items()}
    made_by_gemms = {u: sum(path.endswith("w") and x.ndim > 1 for path, x in tree_leaves_with_path(t))
                     for u, t in units.items() if not u.is_outer}  # the Linears' weights
    if stage == 2:
        assert copied_with == copied_without == []
    else:
        assert len(copied_without) == sum(leaves.values())
        left = 0 if run != "whole blocks" else sum(leaves[u] - made_by_gemms[u] for u in made_by_gemms)
        assert len(copied_with) == leaves[OUTER] + left


@pytest.mark.parametrize("spin", [False, True])
def test_a_worker_lets_go_of_its_job_when_it_is_done(with_threads, spin: bool) -> None:
    """What a job's closure reads is freed once the hand-off returns, not kept by the worker
    thread until its next job (a block's weight gradients lived on through the rest of
    each backward that way)."""
    import gc
    import weakref

    with_threads(2, spin=spin)
    was = gc.isenabled()
    gc.disable()
    try:
        arr = np.ones(8)
        ref = weakref.ref(arr)
        threads.over_rows(lambda r, a=arr: a[r].sum(), 8)
        del arr
        assert ref() is None
    finally:
        if was:
            gc.enable()


def test_a_slot_is_offered_once_a_step_and_refused_back_later() -> None:
    """`grad_slot` offers a unit's place in the buffer only while the step has none of its
    gradient (the same tree every step); handing the slot back for a later micro-batch,
    which would add the buffer to itself, is an error, not a doubled gradient."""
    from mpi4py import MPI

    from numesh.nn.gpt import gpt_specs
    from numesh.nn.units import split_units
    from numesh.optim.zero import ZeroOptimizer

    cfg = GPTConfig(vocab_size=13, block_size=8, n_layer=1, n_head=2, n_embd=8, dropout=0.0, bias=True)
    mesh = Mesh.create(comm=MPI.COMM_SELF)
    units = split_units(init_gpt(cfg, mesh, seed=0, dtype=np.float64))
    opt = ZeroOptimizer(units, split_units(gpt_specs(cfg)), mesh)
    key = next(u for u in units if not u.is_outer)
    opt.begin_step(2)
    slot = opt.grad_slot(key)
    for leaf in tree_leaves(slot):
        leaf[...] = 1.0
    opt.grads_ready(key, slot)
    assert opt.grad_slot(key) is None
    with pytest.raises(ValueError, match="later micro-batch"):
        opt.grads_ready(key, slot)
    opt.begin_step(1)
    assert opt.grad_slot(key) is slot
    assert (opt.sync.grad(key)[: sum(x.size for x in tree_leaves(slot))] == 1.0).all()
