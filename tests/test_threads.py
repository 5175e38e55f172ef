"""Intra-op threads split row-independent work without changing a single bit."""

from __future__ import annotations

import numpy as np
import pytest

from numesh import threads
from numesh.nn.layers import causal_attention_bwd, causal_attention_fwd, gelu_bwd, gelu_fwd
from numesh.optim.adamw import AdamWConfig, adamw_init, adamw_step


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
