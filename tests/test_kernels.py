"""The fused kernels (numesh/kernels.py) against their plain NumPy references.

Each public layer function is called twice on the same input, once with the kernels and
once with the references (`kernels.switched`): float64 must agree to 1e-12 relative, float32
to a few float32 ulps (float64 accumulation in the kernels makes them the more accurate).
Edge shapes: one token, odd widths, a tp vocabulary slice with padding columns and targets
held by another rank.
"""

from __future__ import annotations

import os
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
SHAPES = [(1, 1, 8), (2, 1, 5), (3, 7, 13), (2, 9, 128)]


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


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("dloss_kind", ["scalar", "per-token"])
@pytest.mark.parametrize("vocab_size", [13, 11])
def test_cross_entropy(dtype, dloss_kind, vocab_size):
    """vocab 11 in 13 columns: the last two are padding; targets past the columns stand for
    tokens held by another tp rank (-1 in the kernel)."""
    rng = np.random.default_rng(4)
    N, V = 17, 13
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
@pytest.mark.parametrize("n", [1, 7, 100_003])
@pytest.mark.parametrize("decay_dtype", [bool, np.float64])
def test_adamw(dtype, n, decay_dtype):
    rng = np.random.default_rng(5)
    cfg = AdamWConfig()
    p0, g = rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype)
    decay = (rng.random(n) < 0.7).astype(decay_dtype)

    def run():
        p = p0.copy()
        st = AdamWState(np.zeros_like(p), np.zeros_like(p))
        for lr in (1e-2, 3e-3, 1e-3):
            adamw_step(p, g * lr * 100, st, lr, cfg, decay)
        return p, st.m, st.v

    fast, ref = both(run)
    if dtype == np.float64:  # the same operations in the same order: bit-identical
        for a, b in zip(fast, ref):
            np.testing.assert_array_equal(a, b)
    assert_close(fast, ref, dtype, "adamw", scale=4)


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


def test_numpy_switch_turns_kernels_off():
    """NUMESH_KERNELS=numpy runs the references (the A/B switch of the benchmarks)."""
    code = "import numesh.host.kernels as K; print(K.enabled())"
    env = {**os.environ, "NUMESH_KERNELS": "numpy"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
