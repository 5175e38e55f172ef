"""numesh.host.lanes: the norms' float64 row reductions, compiled as vectors, against their
NumPy definitions bit for bit, and the definitions against the order their docstring states."""

from __future__ import annotations

import math

import numpy as np
import pytest

from numesh.host import kernels as K
from numesh.host.lanes import LANES, row_dot, row_sum

WIDTHS = [1, LANES - 1, LANES, LANES + 1, 2 * LANES, 77, 128, 576]


def _layouts(a: np.ndarray) -> dict[str, np.ndarray]:
    """The same values as C rows, as rows read backwards (a negative stride) and as Fortran."""
    return {"C": a, "reversed": a[:, ::-1].copy()[:, ::-1], "F": np.asfortranarray(a)}


def _stated_order(values: list[float]) -> float:
    """The lanes' order as lanes.py's docstring states it, in Python floats."""
    n = len(values)
    whole = n - n % LANES
    lanes = [0.0] * LANES
    for j in range(whole):
        lanes[j % LANES] += values[j]
    w = LANES
    while w > 1:
        w //= 2
        lanes = [lanes[k] + lanes[k + w] for k in range(w)]
    s = lanes[0]
    for v in values[whole:]:
        s += v
    return s


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_definitions_follow_the_stated_order(width, dtype):
    rng = np.random.default_rng(width)
    a, b = (rng.standard_normal((2, width)).astype(dtype) for _ in range(2))
    assert row_sum(a, 1, width) == _stated_order([float(x) for x in a[1]])
    assert row_dot(a, b, 1, width) == _stated_order([float(x) * float(y) for x, y in zip(a[1], b[1])])
    assert row_dot(a, b, 1, width) == pytest.approx(math.fsum(float(x) * float(y) for x, y in zip(a[1], b[1])),
                                                    rel=1e-13, abs=1e-13)


def test_a_float32_product_is_exact():
    # (1 + 2^-12)² = 1 + 2^-11 + 2^-24 needs 25 bits: float32 would round it, float64 holds it
    x = np.full((1, 1), 1 + 2.0**-12, np.float32)
    assert row_dot(x, x, 0, 1) == (1 + 2.0**-12) ** 2 != float(x[0, 0] * x[0, 0])


@pytest.mark.skipif(not K.HAVE_NUMBA, reason="numba is not installed: only the definitions run")
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_vectors_give_the_definitions_bits(width, dtype):
    from numba import njit

    @njit
    def both(a, b, i, n):
        return row_sum(a, i, n), row_dot(a, b, i, n)

    rng = np.random.default_rng(width + 1)
    a0, b = (rng.standard_normal((3, width)).astype(dtype) * 10.0 ** rng.integers(-3, 4, (3, width)) for _ in range(2))
    b = b.astype(dtype)
    for layout, a in _layouts(a0.astype(dtype)).items():
        for i in range(3):
            got = both(a, b, i, width)
            assert got == (row_sum(a, i, width), row_dot(a, b, i, width)), (layout, i)
        # n shorter than the row: the tail starts where n says
        assert both(a, b, 0, width - 1)[1] == row_dot(a, b, 0, width - 1), layout


def test_sum_squares_follows_the_order_across_the_definitions_numpy_passes():
    from numesh.host import lanes

    x = np.random.default_rng(3).standard_normal(2 * lanes._CHUNK * LANES + 77).astype(np.float32)
    assert lanes.sum_squares(x) == _stated_order([float(v) * float(v) for v in x])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_kernels_sum_squares_gives_the_definitions_bits(dtype):
    from numesh.host import lanes

    x = (np.random.default_rng(4).standard_normal(100_003) * 10.0).astype(dtype)
    with K.switched(True):
        fast = K.sum_squares(x[5:])  # a slice: the gradient norm sums runs of a flat buffer
    with K.switched(False):
        ref = K.sum_squares(x[5:])
    assert fast == ref == lanes.sum_squares(x[5:])


def test_a_float32_gradient_norm_does_not_overflow():
    # 1e20² overflows float32 (np.dot's accumulator), not float64: the norm stays finite
    x = np.full(1000, 1e20, np.float32)
    with np.errstate(over="ignore"):
        assert np.isinf(np.dot(x, x))
    assert K.sum_squares(x) == pytest.approx(1000 * float(np.float32(1e20)) ** 2, rel=1e-15)
