"""numesh's GEMMs on MKL (numesh.host.mkl, picked by numesh.host.blas): which BLAS runs, the
one-line errors, MKL's products against NumPy's, and bits that do not depend on where an
array lies. The thread-count bit checks rerun under MKL in tests/test_blas_kernels.py."""

from __future__ import annotations

import numpy as np
import pytest

from numesh.base.errors import ConfigError
from numesh.host import blas, mkl
from numesh.host import kernels as K


def _need_mkl() -> None:
    if mkl.gemms() is None:
        pytest.skip("pip's mkl is not installed here (pip install 'numesh[mkl]', Linux x86-64)")
    if not K.HAVE_NUMBA:
        pytest.skip("numba is not installed: numesh's GEMMs stay on numpy's BLAS with the kernels off")


@pytest.fixture
def choose(monkeypatch):
    """Set NUMESH_BLAS (None: unset) and forget the cached choice, before and after."""
    def set_mode(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv("NUMESH_BLAS", raising=False)
        else:
            monkeypatch.setenv("NUMESH_BLAS", value)
        blas._choice.cache_clear()

    yield set_mode
    blas._choice.cache_clear()


def test_a_numesh_blas_it_does_not_know_is_a_one_line_error(choose):
    choose("openblas")
    with pytest.raises(ConfigError, match=r"^NUMESH_BLAS='openblas' is not one of numpy, mkl \(or unset"):
        blas.check_mode()


def test_asking_for_mkl_where_it_is_missing_is_a_one_line_error(choose, monkeypatch):
    monkeypatch.setattr(mkl, "gemms", lambda: None)
    choose("mkl")
    with pytest.raises(ConfigError, match=r"no MKL was found: pip install 'numesh\[mkl\]'"):
        blas.check_mode()
    assert blas.name() == "numpy"


def test_without_mkl_or_off_intel_numesh_keeps_numpys_blas(choose, monkeypatch):
    monkeypatch.setattr(blas, "_intel", lambda: False)
    choose(None)
    assert blas.name() == "numpy" and blas.describe() == "numpy's BLAS"
    monkeypatch.setattr(blas, "_intel", lambda: True)
    monkeypatch.setattr(mkl, "gemms", lambda: None)
    choose("")
    assert blas.name() == "numpy"


def test_mkl_runs_where_installed_on_intel_or_asked_for_and_never_with_the_kernels_off(choose, monkeypatch):
    _need_mkl()
    monkeypatch.setattr(blas, "_intel", lambda: True)
    choose(None)
    assert blas.name() == "mkl" and blas.describe().startswith("MKL 20")
    assert blas.gemm_addresses() == mkl.gemms()
    with K.switched(False):
        assert blas.name() == "numpy"
    monkeypatch.setattr(blas, "_intel", lambda: False)
    choose("mkl")
    assert blas.name() == "mkl"
    choose("numpy")
    assert blas.name() == "numpy" and blas.gemm_addresses() != mkl.gemms()


def test_views_blas_reads_in_place_and_the_ones_it_cannot():
    _need_mkl()
    x = np.zeros((6, 10), np.float32)
    assert blas._lay(x) == (blas.NO_TRANS, 10)
    assert blas._lay(x.T) == (blas.TRANS, 10)
    assert blas._lay(x[1:4, 2:7]) == (blas.NO_TRANS, 10)  # a tile: rows 10 apart
    assert blas._lay(x[::2]) == (blas.NO_TRANS, 20)
    assert blas._lay(x[:, ::2]) == (0, 0)  # columns 2 apart: no leading dimension says that
    assert blas._lay(np.zeros((3, 4, 5))[:, 0, :]) == (blas.NO_TRANS, 20)


def _operand(rng, shape, dtype, how):
    """An array of `shape` laid out as `how`: contiguous, transposed, or a strided window."""
    if how == "T":
        return np.ascontiguousarray(rng.standard_normal(shape[::-1]).astype(dtype)).T
    if how == "window":
        big = rng.standard_normal((shape[0] + 3, shape[1] + 5)).astype(dtype)
        return big[2:2 + shape[0], 1:1 + shape[1]]
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("ha,hb", [("C", "C"), ("T", "C"), ("C", "T"), ("T", "T"), ("window", "window")])
def test_mkl_products_match_numpys(choose, monkeypatch, dtype, ha, hb):
    _need_mkl()
    choose("mkl")
    rng = np.random.default_rng(1)
    a, b = _operand(rng, (70, 300), dtype, ha), _operand(rng, (300, 45), dtype, hb)
    out = np.full((80, 50), 7.0, dtype)[3:73, 2:47]  # a window: the rest must stay untouched
    calls = []
    monkeypatch.setattr(np, "matmul", lambda *x, **kw: calls.append(1))  # MKL must do it, not a fallback
    blas.matmul_into(a, b, out)
    monkeypatch.undo()
    assert not calls
    want = a.astype(np.float64) @ b.astype(np.float64)
    tol = 1e-12 if dtype == np.float64 else 2e-5
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol * 20)
    whole = out.base if out.base is not None else out
    assert np.count_nonzero(whole == 7.0) == 80 * 50 - 70 * 45


def test_what_mkl_cannot_take_falls_back_to_numpys_bits(choose, monkeypatch):
    _need_mkl()
    choose("mkl")

    gemm_into, answers = blas._gemm_into, []

    def watched(fn, a, b, c):
        answers.append(gemm_into(fn, a, b, c))
        return answers[-1]

    monkeypatch.setattr(blas, "_gemm_into", watched)
    rng = np.random.default_rng(2)
    a = rng.standard_normal((40, 60)).astype(np.float32)
    c = rng.standard_normal((60, 80)).astype(np.float32)[:, ::2]  # [60, 40], columns 2 apart
    out = np.empty((40, 40), np.float32)
    blas.matmul_into(a, c, out)
    assert answers == [False]  # MKL looked and refused: no leading dimension says "2 apart"
    assert np.array_equal(out, np.matmul(a, c))
    blas.matmul_into(a, c, out.T)  # a transposed output: CBLAS writes rows only
    want = np.empty((40, 40), np.float32).T
    np.matmul(a, c, out=want)
    assert answers == [False, False] and np.array_equal(out.T, want)
    ints = np.arange(12).reshape(3, 4)
    got = np.empty((3, 3), ints.dtype)
    blas.matmul_into(ints, ints.T, got)  # integers: never handed to MKL
    assert len(answers) == 2
    assert np.array_equal(got, ints @ ints.T)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mkl_gives_the_same_bits_wherever_the_arrays_lie(choose, dtype):
    """Strict CNR (numesh.host.mkl): one product, its operands and output at 16 different
    offsets from a 64-byte boundary, the same bits every time."""
    _need_mkl()
    choose("mkl")
    rng = np.random.default_rng(3)
    m, k, n = 130, 257, 99
    a0, b0 = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    results = []
    for off in range(16):
        def at(shape, shift):
            buf = np.empty(int(np.prod(shape)) + 64, dtype)
            return buf[shift:shift + int(np.prod(shape))].reshape(shape)
        a, b, out = at((m, k), off), at((k, n), (3 * off) % 16), at((m, n), (5 * off) % 16)
        a[:], b[:] = a0, b0
        blas.matmul_into(a, b, out)
        results.append(out.copy())
    assert all(np.array_equal(results[0], r) for r in results[1:])


def test_using_switches_the_blas_for_a_block_and_refuses_one_it_lacks(choose, monkeypatch):
    choose("numpy")
    if mkl.gemms() is not None and K.HAVE_NUMBA:
        with blas.using("mkl"):
            assert blas.name() == "mkl"
        assert blas.name() == "numpy"
    monkeypatch.setattr(mkl, "gemms", lambda: None)
    with pytest.raises(ValueError, match="no 'mkl' BLAS here"):
        with blas.using("mkl"):
            pass
    with pytest.raises(ValueError, match="no 'openblas' BLAS here"):
        with blas.using("openblas"):
            pass
