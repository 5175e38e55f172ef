"""Intra-op threads: row-independent ops split without changing a single bit, and blocks
split over sequences (`over_batch`) equal to one thread up to the order of the chunk sums."""

from __future__ import annotations

import numpy as np
import pytest

from numesh import threads
from numesh.mesh import Mesh
from numesh.nn import stage
from numesh.nn.dropout import DropoutKey
from numesh.nn.gpt import GPTConfig, init_gpt
from numesh.nn.stage import loss_and_grads
from numesh.nn.layers import causal_attention_bwd, causal_attention_fwd, gelu_bwd, gelu_fwd
from numesh.optim.adamw import AdamWConfig, adamw_init, adamw_step
from numesh.tree import held_bytes as _nbytes
from numesh.tree import tree_leaves


@pytest.fixture
def with_threads():
    """Run a test body once per thread count, restoring the count afterwards."""
    before = threads.threads()
    yield threads.set_threads
    threads.set_threads(before)


@pytest.mark.parametrize("n, k, min_rows", [(10, 3, 1), (7, 2, 1), (5, 4, 3), (1, 2, 1), (0, 2, 1)])
def test_over_rows_covers_each_row_once(with_threads, n: int, k: int, min_rows: int) -> None:
    with_threads(k)
    hits = np.zeros(n, dtype=int)
    chunks: list[slice] = []

    def fn(r: slice) -> None:
        chunks.append(r)
        hits[r] += 1

    threads.over_rows(fn, n, min_rows)
    assert (hits == 1).all()
    want = max(1, min(k, n // min_rows))
    assert len(chunks) == want


def test_over_rows_reraises_a_worker_error(with_threads) -> None:
    with_threads(2)

    def fn(r: slice) -> None:
        if r.start > 0:
            raise ValueError("boom in the worker")

    with pytest.raises(ValueError, match="boom in the worker"):
        threads.over_rows(fn, 8)
    threads.over_rows(lambda r: None, 8)  # the pool still works afterwards


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_threaded_layers_are_bit_identical(with_threads, dtype) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 20, 48)).astype(dtype)
    q, k, v, dy = (rng.standard_normal((6, 2, 9, 4)).astype(dtype) for _ in range(4))
    mask = (rng.random((6, 2, 9, 9)) > 0.2).astype(dtype) / 0.8

    def run() -> list[np.ndarray]:
        y, ctx = gelu_fwd(x)
        out, actx = causal_attention_fwd(q, k, v, mask)
        return [y, gelu_bwd(ctx, x), out, *causal_attention_bwd(actx, dy)]

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


@pytest.mark.parametrize("batch", [2, 5])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_blocks_split_over_sequences_match_one_thread(with_threads, monkeypatch, batch: int, dropout: float) -> None:
    monkeypatch.setattr(threads, "GLUE_FLOPS", 1.0)  # split even this tiny model's blocks
    cfg = GPTConfig(vocab_size=23, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=dropout, bias=True)
    mesh = Mesh.parse("")
    params = init_gpt(cfg, mesh, seed=3, dtype=np.float64)
    rng = np.random.default_rng(0)
    idx, targets = rng.integers(0, cfg.vocab_size, (2, batch, cfg.block_size))
    drop = DropoutKey(dropout, 7, 1, 0, batch) if dropout else None
    runs = {}
    for k in (1, 2):
        with_threads(k)
        runs[k] = loss_and_grads(params, idx, targets, cfg, mesh, 1.0 / idx.size, drop)
    (loss1, g1), (loss2, g2) = runs[1], runs[2]
    assert abs(loss1 - loss2) <= 1e-13 * abs(loss1)
    for a, b in zip(tree_leaves(g1), tree_leaves(g2)):
        np.testing.assert_allclose(b, a, rtol=1e-11, atol=1e-15)

    # the zero-bubble halves (input grad now, weight grad later) split the same way
    x = rng.standard_normal((batch, cfg.block_size, cfg.n_embd))
    dy = rng.standard_normal(x.shape)
    block = params.blocks[0]
    with_threads(1)
    y1, ctx1 = stage.run_block_fwd(block, x, cfg, mesh, 0, drop)
    dx1, w1 = stage.run_block_bwd(block, ctx1, dy, cfg, mesh)
    with_threads(2)
    y2, ctx2 = stage.run_block_fwd(block, x, cfg, mesh, 0, drop)
    assert isinstance(ctx2, threads.RowChunks) and _nbytes(ctx2) == _nbytes(ctx1)  # pipeline memory accounting
    dx2, wctx = stage.run_block_bwd_input(block, ctx2, dy, cfg, mesh)
    w2 = stage.run_block_bwd_weight(block, wctx)
    np.testing.assert_array_equal(y2, y1)  # rows are independent: no sum crosses chunks
    np.testing.assert_array_equal(dx2, dx1)
    for a, b in zip(tree_leaves(w1), tree_leaves(w2)):
        np.testing.assert_allclose(b, a, rtol=1e-11, atol=1e-15)


@pytest.mark.parametrize("n_threads, rows, flops, want", [
    (16, 12, 906e6, 7),      # the default model: its glue, not its matmuls, bounds the split
    (16, 64, 30e9, 16),      # the baby model: every thread
    (16, 2, 30e9, 2),        # no more chunks than rows
    (2, 12, 906e6, 2),       # no more chunks than threads
    (8, 12, 1e6, 1),         # too little work: whole
    (1, 12, 30e9, 1),
])
def test_block_chunks(n_threads: int, rows: int, flops: float, want: int) -> None:
    assert threads.block_chunks(n_threads, rows, flops) == want


@pytest.mark.parametrize("m, k, n", [(1, 3, 5), (257, 64, 96), (1000, 128, 65)])
def test_matmul_split_over_rows_is_bit_identical(with_threads, monkeypatch, m: int, k: int, n: int) -> None:
    """Each row comes from one BLAS call on a block of rows: splitting changes no bit (BLAS
    on one thread, as numesh.runtime.set_blas_threads sets it), and small products are not split."""
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    calls: list[int] = []
    real = threads.over_rows

    def counting(fn, rows, min_rows=1):
        calls.append(min(threads.threads(), rows // max(1, min_rows)))
        real(fn, rows, min_rows)

    monkeypatch.setattr(threads, "over_rows", counting)
    with threadpool_limits(limits=1, user_api="blas"):
        with_threads(1)
        one = threads.matmul(a, b)
        with_threads(3)
        monkeypatch.setattr(threads, "MIN_CHUNK_FLOPS", 1.0)
        split = threads.matmul(a, b)
        np.testing.assert_array_equal(split, one)
        np.testing.assert_array_equal(threads.matmul(a.T.copy().T, b), one)  # a strided view
        monkeypatch.setattr(threads, "MIN_CHUNK_FLOPS", 1e12)
        calls.clear()
        threads.matmul(a, b)
        assert calls[-1] <= 1  # too small to split
