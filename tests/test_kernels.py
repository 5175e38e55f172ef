"""The fused kernels (numesh/kernels.py) against their plain NumPy references.

Each public layer function is called twice on the same input, once with the kernels and
once with the references (`kernels.switched`): float64 must agree to 1e-12 relative, float32
to a few float32 ulps (float64 accumulation in the kernels makes them the more accurate).
Edge shapes: one token, odd widths, a tp vocabulary slice with padding columns and targets
held by another rank.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import self_mesh
from numesh.base.tree import tree_leaves
from numesh.host import kernels as K
from numesh.nn.layers import (
    LayerNorm,
    gelu_bwd,
    gelu_fwd,
    layernorm_bwd,
    layernorm_fwd,
)
from numesh.nn.parallel import vocab_parallel_cross_entropy_bwd, vocab_parallel_cross_entropy_fwd
from numesh.optim.adamw import AdamWConfig, AdamWState, adamw_step

pytestmark = pytest.mark.skipif(not K.HAVE_NUMBA, reason="numba is not installed: the layers use the NumPy references")

TOL = {np.float64: 1e-12, np.float32: 2e-6}
# 77: whole lanes and a tail (numesh.host.lanes); the last: rows over several tiles
SHAPES = [(1, 1, 8), (2, 1, 5), (3, 7, 13), (2, 9, 128), (2, 3, 77), (4, 300, 64)]


def both(fn):
    """fn() with the kernels, then with the NumPy references."""
    with K.switched(True):
        fast = fn()
    with K.switched(False):
        ref = fn()
    return fast, ref


def assert_close(fast, ref, dtype, what: str, scale: float = 1.0) -> None:
    fl, rl = tree_leaves(fast), tree_leaves(ref)
    assert len(fl) == len(rl), what
    for a, b in zip(fl, rl):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
        err = np.max(np.abs(a - b)) if a.size else 0.0
        bound = TOL[dtype] * scale * max(1.0, float(np.max(np.abs(b))) if b.size else 1.0)
        assert err <= bound, f"{what}: max abs diff {err:.3e} > {bound:.3e}"


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_layernorm(dtype, shape, bias):
    rng = np.random.default_rng(1)
    C = shape[-1]
    x = (rng.standard_normal(shape) * 3 + 1).astype(dtype)
    p = LayerNorm(rng.standard_normal(C).astype(dtype), rng.standard_normal(C).astype(dtype) if bias else None)
    dy = rng.standard_normal(shape).astype(dtype)
    fast, ref = both(lambda: layernorm_fwd(p, x))
    assert_close(fast, ref, dtype, "layernorm_fwd", scale=4)
    fast, ref = both(lambda: layernorm_bwd(p, layernorm_fwd(p, x)[1], dy))
    # dw, db sum over every row: their rounding grows with the rows
    assert_close(fast, ref, dtype, "layernorm_bwd", scale=4 * np.sqrt(np.prod(shape[:-1])))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_gelu(dtype, shape):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(shape) * 4).astype(dtype)
    x.reshape(-1)[:2] = [30.0, -30.0][: x.size]  # saturated tanh
    dy = rng.standard_normal(shape).astype(dtype)
    fast, ref = both(lambda: gelu_fwd(x))
    assert_close(fast, ref, dtype, "gelu_fwd", scale=2)
    fast, ref = both(lambda: gelu_bwd(gelu_fwd(x)[1], dy))
    assert_close(fast, ref, dtype, "gelu_bwd", scale=4)


def _exp_inputs() -> np.ndarray:
    """float32 inputs over exp's whole range: every result order of magnitude from 0
    (subnormal, underflow) to inf, the ends of each 2^n step, and the special values."""
    rng = np.random.default_rng(8)
    span = np.linspace(-110.0, 90.0, 400_001)
    steps = np.arange(-151, 129)[:, None] * np.log(2.0) + np.array([-1e-6, 0.0, 1e-6, 0.17, 0.34])[None, :]
    special = [-np.inf, np.inf, 0.0, -0.0, 1e-30, -1e-30, 88.72283, 88.72284, -87.33654, -103.97208, -103.97209]
    return np.concatenate([span, steps.ravel(), rng.standard_normal(100_000) * 30, special]).astype(np.float32)


def test_exp32_is_within_one_ulp_of_exp_everywhere():
    """`kernels.exp32` (the attention's, GELU's and SwiGLU's exp) against float64 exp, in
    units of the float32 spacing at the true result: at most 1.03 ulp (1 ulp, and the FMA's
    other rounding: every float32 input was checked once) wherever the result is a normal
    float32; 0 below that (x < -87.3365, an absolute error under 2^-126) and for
    -inf, inf where float32 overflows, NaN for NaN."""
    x = _exp_inputs()
    got = np.empty_like(x)
    K.exp_into(x, got)
    true = np.exp(x.astype(np.float64))
    with np.errstate(over="ignore"):
        true32 = true.astype(np.float32)
    tiny = np.finfo(np.float32).tiny
    big, small = np.isinf(true32), true < tiny
    assert np.all(np.isinf(got[big])), "exp must overflow to inf where float32 does"
    assert np.all(got[small] == 0.0) and np.all(got[x == -np.inf] == 0.0), "below the normal range: 0"
    assert np.any(small & (x > -104.0)), "the inputs reach the subnormal range"
    normal = ~big & ~small
    spacing = np.spacing(true32[normal]).astype(np.float64)
    ulps = np.abs(got[normal].astype(np.float64) - true[normal]) / spacing
    worst = int(np.argmax(ulps))
    assert ulps[worst] <= 1.03, f"exp32({x[normal][worst]!r}) = {got[normal][worst]!r}, off by {ulps[worst]:.3f} ulp"
    nan = np.array([np.nan], np.float32)
    K.exp_into(nan, nan)
    assert np.isnan(nan[0]), "a NaN score must stay NaN (the run's NaN check sees it)"


def test_exp32_low_is_exp32_bit_for_bit_up_to_88():
    """`kernels.exp32_low` (the softmax's and GELU's exp) drops exp32's overflow handling:
    on its domain, x <= 88 (every value there the sample of exp's range reaches, -inf
    included), it must return exp32's very bits, so the attention's and GELU's results do
    not depend on which of the two they call; NaN stays NaN."""
    x = _exp_inputs()
    x = np.concatenate([x[x <= 88.0], np.float32([88.0, -0.0, np.nan])])
    want, got = np.empty_like(x), np.empty_like(x)
    K.exp_into(x, want)
    _exp_low_into(x, got)
    same = (want.view(np.uint32) == got.view(np.uint32)) | (np.isnan(want) & np.isnan(got))
    assert same.all(), f"exp32_low({x[~same][0]!r}) = {got[~same][0]!r}, exp32 gives {want[~same][0]!r}"


@K.njit(nogil=True, error_model="numpy")  # not cached: numba would keep a stale copy of exp32_low
def _exp_low_into(x, out):
    for i in range(x.shape[0]):
        out[i] = K.vexp_low(x[i])


def test_exp_runs_as_packed_simd_code(tmp_path):
    """The float32 exp loop compiles to packed 256- or 512-bit instructions (ymm/zmm), not
    one element at a time: the point of writing it out (numba's own exp is a libm call).
    Compiled in a child with an empty cache: numba keeps no assembly for cached code."""
    code = ("import numpy as np, numesh.host.kernels as K\n"
            "x = np.ones(64, np.float32); K.exp_into(x, x.copy())\n"
            "print(K.exp_into.inspect_asm(K.exp_into.signatures[0]))\n")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    asm = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    packed = re.findall(r"\bv(?:mul|add|sub|f\w*madd\w*)ps\s[^\n]*[yz]mm", asm)  # FMAs too
    assert len(packed) >= 10, f"the exp loop is not vectorised ({len(packed)} packed float ops)"


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("dloss_kind", ["scalar", "per-token"])
@pytest.mark.parametrize("N, V, vocab_size", [(17, 13, 13), (17, 13, 11), (9, 203, 200)])
def test_cross_entropy(dtype, dloss_kind, N, V, vocab_size):
    """vocab 11 in 13 columns: the last two are padding; targets past the columns stand for
    tokens held by another tp rank (-1 in the kernel). 203 columns: whole blocks of the
    row max's lanes and of row_sum's, and a tail of each."""
    rng = np.random.default_rng(4)
    logits = (rng.standard_normal((N, V)) * 3).astype(dtype)
    targets = rng.integers(0, vocab_size, N)
    dloss = 1.0 / N if dloss_kind == "scalar" else rng.standard_normal(N)
    mesh = self_mesh()

    def run():
        loss, ctx = vocab_parallel_cross_entropy_fwd(logits.copy(), targets, vocab_size, mesh)
        return loss, vocab_parallel_cross_entropy_bwd(ctx, dloss)

    fast, ref = both(run)
    assert_close(fast, ref, dtype, "cross-entropy", scale=4)
    # a target outside the slice contributes no -1
    probs = (rng.random((3, 5)) + 0.1).astype(dtype)
    sums = probs.sum(axis=1)
    ctx = (probs.copy(), sums, np.array([0, 7, -2]), np.array([True, False, False]))
    fast, ref = both(lambda: vocab_parallel_cross_entropy_bwd((ctx[0].copy(), *ctx[1:]), 2.0))
    assert_close(fast, ref, dtype, "cross-entropy outside the slice")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_cross_entropy_rows(dtype):
    """`ce_rows` row by row against NumPy: the max, the target's logit (0 off this rank's
    columns), exp(logits - max) in place and its sum; a row of padding alone (every column
    -inf) gives zeros and a zero sum, not NaN; a NaN logit makes the row's sum NaN."""
    rng = np.random.default_rng(6)
    logits = (rng.standard_normal((5, 131)) * 4).astype(dtype)
    logits[2] = -np.inf
    local = np.array([5, 130, 0, -1, 3])
    x = logits.copy()
    x[4, 70] = np.nan
    m, target, s = np.empty(5, dtype), np.empty(5, dtype), np.empty(5)
    K.ce_rows(x, local, m, s, target)
    np.testing.assert_array_equal(m[:4], logits[:4].max(axis=1))
    np.testing.assert_array_equal(target[:4], [logits[0, 5], logits[1, 130], logits[2, 0], 0.0])
    for i in (0, 1, 3):
        np.testing.assert_allclose(x[i], np.exp(logits[i] - m[i]), rtol=TOL[dtype])
        np.testing.assert_allclose(s[i], np.exp(logits[i].astype(np.float64) - m[i]).sum(), rtol=TOL[dtype] * 4)
    assert not x[2].any() and s[2] == 0.0
    assert np.isnan(s[4])


@pytest.mark.bits
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_cross_entropy_does_not_depend_on_the_thread_count(with_threads, dtype):
    """Rows over the threads (300 rows of 4,096 logits: several chunks): the same bits."""
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal((300, 4096)) * 3).astype(dtype)
    targets = rng.integers(0, 4096, 300)
    results = []
    for n in (1, 2, 3):
        with_threads(n)
        loss, ctx = vocab_parallel_cross_entropy_fwd(logits.copy(), targets, 4096, self_mesh())
        results.append((loss, vocab_parallel_cross_entropy_bwd(ctx, 1.0 / 300)))
    for loss, grad in results[1:]:
        np.testing.assert_array_equal(loss, results[0][0])
        np.testing.assert_array_equal(grad, results[0][1])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("n", [1, 7, 100_003])
@pytest.mark.parametrize("decay_dtype", [bool, np.float32, np.float64])
def test_adamw(dtype, n, decay_dtype):
    rng = np.random.default_rng(5)
    cfg = AdamWConfig()
    p0, g = rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype)
    decay = (rng.random(n) < 0.7).astype(decay_dtype)

    def run():
        p = p0.copy()
        st = AdamWState(np.zeros_like(p), np.zeros_like(p))
        for lr in (1e-2, 3e-3, np.float64(1e-3)):  # a NumPy learning rate too (np.float64 is not weak)
            adamw_step(p, g * float(lr) * 100, st, lr, cfg, decay)
        return p, st.m, st.v

    fast, ref = both(run)
    for a, b in zip(fast, ref):  # the same operations in the same order, in p's dtype: bit-identical
        np.testing.assert_array_equal(a, b)


def test_cache_dir_falls_back_when_package_is_read_only(tmp_path):
    """With the package directory read-only and no NUMBA_CACHE_DIR, the cache goes to
    $XDG_CACHE_HOME/numesh/numba (checked in a fresh interpreter, as at start-up)."""
    code = (
        "import os, pathlib, numesh.host.kernels as K\n"
        "ro = pathlib.Path(K.__file__).resolve().parent\n"
        "orig = os.access\n"
        "os.access = lambda p, m: False if pathlib.Path(p).resolve() == ro else orig(p, m)\n"
        "os.environ.pop('NUMBA_CACHE_DIR', None)\n"
        "K._cache_dir()\n"
        "print(os.environ['NUMBA_CACHE_DIR'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(tmp_path / "numesh" / "numba")
    assert (tmp_path / "numesh" / "numba").is_dir()


def test_training_runs_with_the_kernels_off(tmp_path):
    """NUMESH_KERNELS=numpy (as without numba): every module still imports, and the
    attention's Python stripe loops compute the definition (the compiled loops' module once
    failed to import without numba, so the whole model did)."""
    code = ("import numpy as np; import numesh.host.kernels as K; from numesh.nn import attention as A; "
            "r = np.random.default_rng(0); q, k, v = (r.standard_normal((1, 2, 70, 8)) for _ in range(3)); "
            "y = np.empty_like(q); A.attend_fwd(q, k, v, y, scale=8 ** -0.5); "
            "print(K.enabled(), A._gemm(np.float64, 8), float(np.abs(y - A.attention_reference(q, k, v)).max()))")
    env = {**os.environ, "NUMESH_KERNELS": "numpy"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    enabled, gemm, err = out.split()
    assert (enabled, gemm) == ("False", "None") and float(err) < 1e-12


def test_numpy_switch_turns_kernels_off():
    """NUMESH_KERNELS=numpy runs the references (the A/B switch of the benchmarks)."""
    code = "import numesh.host.kernels as K; print(K.enabled())"
    env = {**os.environ, "NUMESH_KERNELS": "numpy"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
