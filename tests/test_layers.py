"""Every hand-written backward against central finite differences, in float64."""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import pytest

from conftest import random_global_params, self_mesh, tiny_config
from numesh.base.tree import tree_leaves, tree_leaves_with_path
from numesh.host import kernels as K
from numesh.nn.dropout import EMBED, DropoutKey, Site
from numesh.nn.layers import (
    LayerNorm,
    Linear,
    RMSNorm,
    dropout_mask,
    gelu_bwd,
    gelu_fwd,
    layernorm_bwd,
    layernorm_fwd,
    linear_bwd,
    linear_bwd_input,
    linear_bwd_weight,
    linear_fwd,
    rmsnorm_bwd,
    rmsnorm_fwd,
    swiglu_bwd,
    swiglu_fwd,
)
from numesh.nn.parallel import (
    vocab_parallel_cross_entropy_bwd,
    vocab_parallel_cross_entropy_fwd,
    vocab_parallel_embedding_bwd,
    vocab_parallel_embedding_fwd,
)
from numesh.nn.walk import forward_loss, loss_and_grads

EPS = 1e-6


def fd_grad(f: Callable[[], float], x: np.ndarray, entries: list[tuple] | None = None) -> np.ndarray:
    """Central differences of the scalar f() w.r.t. x (perturbed in place), at `entries` or everywhere."""
    g = np.zeros_like(x)
    for i in entries if entries is not None else list(np.ndindex(x.shape)):
        old = x[i]
        x[i] = old + EPS
        up = f()
        x[i] = old - EPS
        down = f()
        x[i] = old
        g[i] = (up - down) / (2 * EPS)
    return g


def assert_fd(analytic: np.ndarray, numeric: np.ndarray, what: str, entries: list[tuple] | None = None) -> None:
    a, n = np.asarray(analytic), np.asarray(numeric)
    if entries is not None:
        a = np.array([a[i] for i in entries])
        n = np.array([n[i] for i in entries])
    bad = np.abs(a - n) > 1e-7 + 1e-5 * np.abs(n)
    assert not bad.any(), f"{what}: analytic {a[bad][:5]} vs finite differences {n[bad][:5]}"


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


# ---------------------------------------------------------------------------------------
# linear


@pytest.mark.parametrize(
    "wshape, bshape",
    [((5, 4), (4,)), ((5, 4), None), ((4, 3, 4), (3, 4)), ((4, 3, 4), None)],
    ids=["bias", "no-bias", "3d-bias", "3d-no-bias"],
)
def test_linear_fd(rng: np.random.Generator, wshape: tuple, bshape: tuple | None) -> None:
    x = rng.standard_normal((2, 3, wshape[0]))
    p = Linear(rng.standard_normal(wshape), None if bshape is None else rng.standard_normal(bshape))
    n_out = int(np.prod(wshape[1:]))
    r = rng.standard_normal((2, 3, n_out))

    def loss() -> float:
        return float(np.sum(linear_fwd(p, x)[0] * r))

    y, ctx = linear_fwd(p, x)
    assert y.shape == (2, 3, n_out)
    want = x @ p.w.reshape(wshape[0], -1) + (0 if p.b is None else p.b.reshape(-1))
    np.testing.assert_allclose(y, want, rtol=1e-13)
    dx, dp = linear_bwd(p, ctx, r)
    assert type(dp) is Linear and dp.w.shape == p.w.shape
    assert_fd(dx, fd_grad(loss, x), "dx")
    assert_fd(dp.w, fd_grad(loss, p.w), "dw")
    if p.b is None:
        assert dp.b is None
    else:
        assert dp.b.shape == p.b.shape
        assert_fd(dp.b, fd_grad(loss, p.b), "db")
    # the separable halves give the same result
    np.testing.assert_array_equal(linear_bwd_input(p, r), dx)
    np.testing.assert_array_equal(linear_bwd_weight(p, x, r).w, dp.w)


# ---------------------------------------------------------------------------------------
# layernorm


@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_fd(rng: np.random.Generator, bias: bool) -> None:
    C = 6
    x = rng.standard_normal((2, 3, C)) * 2 + 0.5
    p = LayerNorm(1 + 0.3 * rng.standard_normal(C), 0.3 * rng.standard_normal(C) if bias else None)
    r = rng.standard_normal((2, 3, C))

    def loss() -> float:
        return float(np.sum(layernorm_fwd(p, x.copy())[0] * r))

    x0 = x.copy()
    y, ctx = layernorm_fwd(p, x)
    np.testing.assert_array_equal(x, x0)  # the input is not modified
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    want = (x - mu) / np.sqrt(var + 1e-5) * p.w + (0 if p.b is None else p.b)
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-13)
    dx, dp = layernorm_bwd(p, ctx, r)
    assert type(dp) is LayerNorm
    assert_fd(dx, fd_grad(loss, x), "dx")
    assert_fd(dp.w, fd_grad(loss, p.w), "dw")
    if bias:
        assert_fd(dp.b, fd_grad(loss, p.b), "db")
    else:
        assert dp.b is None


# ---------------------------------------------------------------------------------------
# gelu


def test_gelu_value_and_fd(rng: np.random.Generator) -> None:
    x = rng.standard_normal((3, 7)) * 2
    x[0, :3] = [0.0, -5.0, 5.0]
    r = rng.standard_normal((3, 7))
    y, ctx = gelu_fwd(x)
    k = math.sqrt(2 / math.pi)
    u = k * (x + 0.044715 * x**3)
    # 0.5·x·(1 + tanh(u)) = x·sigmoid(2u); the first form loses digits where tanh(u) is near -1 (x = -5: 3e-9)
    np.testing.assert_allclose(y, x / (1 + np.exp(-2 * u)), rtol=1e-14, atol=1e-300)
    assert ctx is x  # the input alone is kept: backward computes exp(-2|u|) again
    dx = gelu_bwd(ctx, r)
    # d/dx of 0.5·x·(1 + tanh(u)), from tanh(u) as NumPy computes it
    t = np.tanh(u)
    want = r * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x))
    np.testing.assert_allclose(dx, want, rtol=1e-12, atol=1e-14)  # 1 - t² cancels where t is near ±1

    def loss() -> float:
        return float(np.sum(gelu_fwd(x)[0] * r))

    assert_fd(dx, fd_grad(loss, x), "gelu dx")


# ---------------------------------------------------------------------------------------
# wrong operands: one line, not a fused kernel reading past the end of a shorter array


_X = np.ones((4, 8), np.float32)
_W8, _W4 = np.ones(8, np.float32), np.ones(4, np.float32)


@pytest.mark.parametrize("call, message", [
    (lambda: layernorm_fwd(LayerNorm(_W4, None), _X), r"layernorm_fwd's w is \(4,\) but x \(4, 8\) makes it \(8,\)"),
    (lambda: layernorm_fwd(LayerNorm(_W8, _W4), _X), r"layernorm_fwd's b is \(4,\) but x \(4, 8\) makes it \(8,\)"),
    (lambda: rmsnorm_fwd(RMSNorm(_W4), _X, 1e-5), r"rmsnorm_fwd's w is \(4,\) but x \(4, 8\) makes it \(8,\)"),
    (lambda: swiglu_fwd(_W4, np.ones(3, np.float32)), r"swiglu_fwd's up is \(3,\) but gate \(4,\) makes it \(4,\)"),
    (lambda: layernorm_fwd(LayerNorm(_W8, None), np.ones((4, 8), int)),
     "layernorm_fwd's x must be a float32 or float64 array, got int64"),  # a page of numba typing errors
    (lambda: rmsnorm_fwd(RMSNorm(_W8), np.ones((4, 8), int), 1e-5), "rmsnorm_fwd's x must be a float32 or float64"),
    (lambda: gelu_fwd(np.ones(4, int)), "gelu_fwd's x must be a float32 or float64 array, got int64"),  # zeros
    (lambda: gelu_fwd(np.ones(4, np.float16)), "gelu_fwd's x must be a float32 or float64 array, got float16"),
    (lambda: swiglu_fwd(np.ones(4, int), _W4), "swiglu_fwd's gate must be a float32 or float64 array, got int64"),
    (lambda: swiglu_fwd(_W4, np.ones(4)), "swiglu_fwd's up is float64 but gate float32: give both one dtype"),
    # the backward passes: dy against what the forward saved
    (lambda: layernorm_bwd(LayerNorm(_W8, None), (_X, np.ones((4, 1), np.float32)), np.ones((2, 8), np.float32)),
     r"layernorm_bwd's xhat is \(4, 8\) but dy \(2, 8\) makes it 2 rows of 8"),
    (lambda: layernorm_bwd(LayerNorm(_W4, None), (_X, np.ones((4, 1), np.float32)), _X),
     r"layernorm_bwd's w is \(4,\) but dy \(4, 8\) makes it \(8,\)"),
    (lambda: rmsnorm_bwd(RMSNorm(_W8), (_X, np.ones((2, 1), np.float32)), _X),
     r"rmsnorm_bwd's rstd is \(2, 1\) but dy \(4, 8\) makes it 4 rows of 1"),
    (lambda: rmsnorm_bwd(RMSNorm(_W8), (_X, np.ones((4, 1), np.float32)), np.ones((4, 8))),
     "rmsnorm_bwd's xhat is float32 but dy float64: give both one dtype"),
    (lambda: swiglu_bwd((_X, _X[:, :4]), _X), r"swiglu_bwd's up is \(4, 4\) but dy \(4, 8\) makes it 4 rows of 8"),
    (lambda: gelu_bwd(_X[:1], _X), r"gelu_bwd's x is \(1, 8\) but dy \(4, 8\) makes it 4 rows of 8"),
    (lambda: gelu_bwd(_X, [1.0]), "gelu_bwd's dy must be a float32 or float64 array, got list"),
], ids=["ln-w", "ln-b", "rms-w", "swiglu-up", "ln-int", "rms-int", "gelu-int", "gelu-f16", "swiglu-int", "swiglu-mix",
        "ln-bwd-dy", "ln-bwd-w", "rms-bwd-rstd", "rms-bwd-mix", "swiglu-bwd-up", "gelu-bwd-x", "gelu-bwd-list"])
@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "numpy"])
def test_a_layer_given_a_wrong_operand_is_one_line_naming_it(call, message: str, kernels: bool) -> None:
    """The fused kernels read past the end of a shorter w, b or up and returned garbage (the
    NumPy references raised a broadcast error), and took int x to zeros; either way now
    it is one line naming the operand and both shapes, or the dtype."""
    with K.switched(kernels), pytest.raises(ValueError, match=message) as e:
        call()
    assert "\n" not in str(e.value)


def test_checks_that_pass_build_no_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every backward (and the norms' forwards) formatted its check messages, dy's shape
    among them, on every call: about half of layernorm_bwd's 4 us of checks. Now a message is built,
    and K.check_float or K.check_shape called, only for a check that fails."""
    ln, rms = LayerNorm(_W8, _W8), RMSNorm(_W8)
    _, ln_ctx = layernorm_fwd(ln, _X)
    _, rms_ctx = rmsnorm_fwd(rms, _X, 1e-5)
    _, sw_ctx = swiglu_fwd(_X, _X)

    def built(*args: object) -> None:
        raise AssertionError(f"a message was built for a check that passes: {args[0]}")

    monkeypatch.setattr(K, "check_float", built)
    monkeypatch.setattr(K, "check_shape", built)
    with K.switched(False):  # the checks come first, kernels or not
        layernorm_fwd(ln, _X)
        rmsnorm_fwd(rms, _X, 1e-5)
        layernorm_bwd(ln, ln_ctx, _X)
        rmsnorm_bwd(rms, rms_ctx, _X)
        swiglu_bwd(sw_ctx, _X)
        gelu_bwd(_X, _X)


# ---------------------------------------------------------------------------------------
# attention: tests/test_attention.py (the fused kernel against its definition and finite
# differences)



def test_dropout_mask_values() -> None:
    m = dropout_mask(np.random.default_rng(0), (200, 100), 0.25, np.float64)
    assert set(np.unique(m)) == {0.0, 1 / 0.75}
    assert abs((m == 0).mean() - 0.25) < 0.02
    assert m.dtype == np.float64
    again = dropout_mask(np.random.default_rng(0), (200, 100), 0.25, np.float64)
    np.testing.assert_array_equal(m, again)


# ---------------------------------------------------------------------------------------
# vocab-parallel embedding and cross-entropy on the 1-rank mesh


def test_vocab_parallel_embedding_fd(rng: np.random.Generator) -> None:
    mesh = self_mesh()
    V, C = 7, 4
    wte = rng.standard_normal((V, C))
    ids = np.array([[0, 3, 3, 6], [1, 3, 0, 5]])  # repeated ids accumulate
    r = rng.standard_normal((2, 4, C))
    y, ctx = vocab_parallel_embedding_fwd(wte, ids, mesh)
    np.testing.assert_array_equal(y, wte[ids])
    dwte = vocab_parallel_embedding_bwd(wte, ctx, r)

    def loss() -> float:
        return float(np.sum(vocab_parallel_embedding_fwd(wte, ids, mesh)[0] * r))

    assert_fd(dwte, fd_grad(loss, wte), "dwte")
    np.testing.assert_array_equal(dwte[[2, 4]], 0.0)  # ids never looked up get no gradient
    np.testing.assert_allclose(dwte[3], r[0, 1] + r[0, 2] + r[1, 1], rtol=1e-14)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rank_slice", [False, True])
def test_embedding_grad_kernel_adds_in_token_order(rng: np.random.Generator, dtype, rank_slice: bool) -> None:
    """numesh.host.kernels.embedding_grad adds the tokens in order: np.add.at's bits, and
    the NumPy path's sums (each id's tokens pairwise, np.add.reduceat) to rounding; ids
    another tp rank holds left out, rows never looked up zero."""
    if not K.HAVE_NUMBA:
        pytest.skip("numba is not installed")
    V, C = 11, 37
    wte = np.zeros((V, C), dtype)
    ids = rng.integers(0, V - 3, (3, 50))  # many repeats; the last 3 rows never looked up
    dy = rng.standard_normal((3, 50, C)).astype(dtype)
    outside = (ids % 4 == 1) if rank_slice else None  # as another tp rank's ids would be
    ctx = (ids, outside)
    with K.switched(False):
        pairwise = vocab_parallel_embedding_bwd(wte, ctx, dy)
    with K.switched(True):
        got = vocab_parallel_embedding_bwd(wte, ctx, dy)
    in_order = np.zeros_like(wte)
    keep = np.ones(ids.shape, bool) if outside is None else ~outside
    np.add.at(in_order, ids[keep], dy[keep])
    assert got.tobytes() == in_order.tobytes()
    tol = 1e-5 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(got, pairwise, rtol=tol, atol=tol)
    assert not got[V - 3:].any() and got[:V - 3].any()
    if rank_slice:
        assert not got[1].any() and not got[5].any()  # every token of ids 1 and 5 is outside


def _log_softmax_loss(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    m = logits.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(logits - m).sum(axis=1))
    return lse - logits[np.arange(len(targets)), targets]


def test_cross_entropy_matches_log_softmax_and_fd(rng: np.random.Generator) -> None:
    mesh = self_mesh()
    N, V = 6, 9
    logits = rng.standard_normal((N, V)) * 3
    targets = rng.integers(0, V, N)
    loss, ctx = vocab_parallel_cross_entropy_fwd(logits.copy(), targets, V, mesh)
    np.testing.assert_allclose(loss, _log_softmax_loss(logits, targets), rtol=1e-13)
    w = rng.standard_normal(N)  # per-token upstream gradient
    dlogits = vocab_parallel_cross_entropy_bwd(ctx, w)

    def f() -> float:
        return float(np.sum(vocab_parallel_cross_entropy_fwd(logits.copy(), targets, V, mesh)[0] * w))

    assert_fd(dlogits, fd_grad(f, logits), "dlogits")
    # scalar upstream gradient
    _, ctx = vocab_parallel_cross_entropy_fwd(logits.copy(), targets, V, mesh)
    d2 = vocab_parallel_cross_entropy_bwd(ctx, 0.5)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(N), targets] -= 1
    np.testing.assert_allclose(d2, 0.5 * p, rtol=1e-12, atol=1e-15)


def test_cross_entropy_padded_vocab_equals_unpadded(rng: np.random.Generator) -> None:
    mesh = self_mesh()
    N, V, pad = 6, 9, 3
    logits = rng.standard_normal((N, V + pad)) * 3
    logits[:, V:] = 50.0  # large padding logits must still get zero probability
    targets = rng.integers(0, V, N)
    loss_pad, ctx_pad = vocab_parallel_cross_entropy_fwd(logits.copy(), targets, V, mesh)
    loss, ctx = vocab_parallel_cross_entropy_fwd(logits[:, :V].copy(), targets, V, mesh)
    np.testing.assert_allclose(loss_pad, loss, rtol=1e-14)
    np.testing.assert_allclose(loss_pad, _log_softmax_loss(logits[:, :V], targets), rtol=1e-13)
    d_pad = vocab_parallel_cross_entropy_bwd(ctx_pad, 1.0)
    d = vocab_parallel_cross_entropy_bwd(ctx, 1.0)
    np.testing.assert_array_equal(d_pad[:, V:], 0.0)
    np.testing.assert_allclose(d_pad[:, :V], d, rtol=1e-13, atol=1e-16)


# ---------------------------------------------------------------------------------------
# the whole model


def _entries(shape: tuple, rng: np.random.Generator, n: int = 3) -> list[tuple]:
    """A few random entries of an array (all of them when it is small)."""
    total = int(np.prod(shape))
    flat = rng.choice(total, size=min(n, total), replace=False)
    return [np.unravel_index(i, shape) for i in flat]


def _batch(cfg, rng: np.random.Generator, B: int = 2, T: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    T = cfg.block_size if T is None else T
    idx = rng.integers(0, cfg.vocab_size, (B, T))
    tgt = rng.integers(0, cfg.vocab_size, (B, T))
    return idx, tgt


@pytest.mark.parametrize("bias", [True, False])
def test_gpt_loss_and_grads_fd(bias: bool) -> None:
    rng = np.random.default_rng(5)
    cfg = tiny_config(bias=bias)
    mesh = self_mesh()
    params = random_global_params(cfg, seed=11)
    idx, tgt = _batch(cfg, rng)
    scale = 1.0 / idx.size
    loss, grads = loss_and_grads(params, idx, tgt, cfg, mesh, scale)
    # the training loss is the forward loss
    ref = forward_loss(params, idx, tgt, cfg, mesh)
    assert ref.shape == (idx.size,)
    assert loss == pytest.approx(float(ref.sum()) * scale, rel=1e-13)

    def f() -> float:
        return float(forward_loss(params, idx, tgt, cfg, mesh).sum()) * scale

    n_leaves = 0
    for (path, p), g in zip(tree_leaves_with_path(params), tree_leaves(grads)):
        assert g.shape == p.shape, path
        entries = _entries(p.shape, rng)
        assert_fd(g, fd_grad(f, p, entries), path, entries)
        n_leaves += 1
    assert n_leaves == (28 if bias else 15)


def test_gpt_loss_and_grads_fd_with_dropout() -> None:
    rng = np.random.default_rng(6)
    cfg = tiny_config(bias=True, dropout=0.2)
    mesh = self_mesh()
    params = random_global_params(cfg, seed=12)
    idx, tgt = _batch(cfg, rng, B=3)
    scale = 1.0 / idx.size
    drop = DropoutKey(p=0.2, seed=3, step=5, row0=0, global_rows=3)
    loss, grads = loss_and_grads(params, idx, tgt, cfg, mesh, scale, drop)
    no_drop = float(forward_loss(params, idx, tgt, cfg, mesh).sum()) * scale
    assert loss != pytest.approx(no_drop, rel=1e-6)  # the masks really apply

    def f() -> float:
        return loss_and_grads(params, idx, tgt, cfg, mesh, scale, drop)[0]

    assert f() == loss  # the same key gives the same masks
    for (path, p), g in zip(tree_leaves_with_path(params), tree_leaves(grads)):
        entries = _entries(p.shape, rng)
        assert_fd(g, fd_grad(f, p, entries), path, entries)


def test_dropout_sites_have_distinct_stable_streams() -> None:
    sites = [EMBED] + [Site(k, layer) for layer in range(5) for k in ("attn", "attn_out", "mlp_out")]
    assert [s.stream for s in sites] == list(range(len(sites)))  # the numbering checkpoints' dropout relies on


def test_dropout_key_slices_the_global_mask() -> None:
    """A micro-batch's mask is its rows of the whole batch's mask (mesh-independent dropout)."""
    full = DropoutKey(0.3, seed=1, step=2, row0=0, global_rows=6).mask(Site("attn", 1), 6, (3, 5))
    part = DropoutKey(0.3, seed=1, step=2, row0=2, global_rows=6).mask(Site("attn", 1), 3, (3, 5))
    np.testing.assert_array_equal(part, full[2:5])
    heads = DropoutKey(0.3, seed=1, step=2, row0=0, global_rows=6).mask(Site("attn", 1), 6, (3, 5), (slice(1, 3),))
    np.testing.assert_array_equal(heads, full[:, 1:3])
    other = DropoutKey(0.3, seed=1, step=3, row0=0, global_rows=6).mask(Site("attn", 1), 6, (3, 5))
    assert not np.array_equal(other, full)


def _full_logits(params, idx, cfg, mesh) -> np.ndarray:
    """Logits [B, T, V] of every position from the training forward pass (tp=1)."""
    from numesh.nn.transformer import block_fwd, embed_fwd

    x, _ = embed_fwd(params, idx, cfg, mesh)
    for layer, bp in enumerate(params.blocks):
        x, _ = block_fwd(bp, x, cfg, mesh, layer)
    xf, _ = layernorm_fwd(params.ln_f, x)
    return xf @ params.wte.T


@pytest.mark.parametrize("bias", [True, False])
def test_kv_cache_logits_match_the_training_forward(bias: bool) -> None:
    from numesh.nn.decode import logits_cached, new_kv_cache

    cfg = tiny_config(bias=bias)
    mesh = self_mesh()
    params = random_global_params(cfg, seed=4)
    idx = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, cfg.block_size))
    want = _full_logits(params, idx, cfg, mesh)
    cache = new_kv_cache(cfg, mesh, 2, np.float64)
    got = logits_cached(params, idx[:, :3], cache, cfg, mesh)  # a prompt of 3 tokens
    np.testing.assert_allclose(got, want[:, 2], rtol=1e-12, atol=1e-13)
    for t in range(3, cfg.block_size):  # then one token at a time
        got = logits_cached(params, idx[:, t : t + 1], cache, cfg, mesh)
        np.testing.assert_allclose(got, want[:, t], rtol=1e-12, atol=1e-13)
    assert cache.length == cfg.block_size
    from numesh.base.errors import ConfigError

    with pytest.raises(ConfigError, match="block_size"):
        logits_cached(params, idx[:, :1], cache, cfg, mesh)
