"""AdamW against PyTorch's formula, the decay mask, the LR schedule, global-norm clipping."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import random_global_params, self_mesh, tiny_config
from numesh.base.errors import ConfigError
from numesh.base.tree import flatten, tree_leaves, tree_leaves_with_path, unflatten
from numesh.mesh import P
from numesh.nn.gpt import gpt_specs, init_gpt
from numesh.optim import AdamWConfig, adamw_init, adamw_step, clip_scale, cosine_lr, decay_mask
from numesh.optim.zero import ZeroOptimizer


def torch_adamw_reference(p, grads_per_step, lrs, cfg: AdamWConfig, decay):
    """PyTorch's torch.optim.AdamW (amsgrad=False), written out step by step."""
    p = p.copy()
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    wd = cfg.weight_decay * decay  # decay only where the mask is 1
    for t, (g, lr) in enumerate(zip(grads_per_step, lrs), start=1):
        p = p * (1 - lr * wd)
        m = cfg.beta1 * m + (1 - cfg.beta1) * g
        v = cfg.beta2 * v + (1 - cfg.beta2) * g * g
        bc1 = 1 - cfg.beta1**t
        bc2 = 1 - cfg.beta2**t
        denom = np.sqrt(v) / math.sqrt(bc2) + cfg.eps
        p = p - (lr / bc1) * m / denom
    return p, m, v


@pytest.mark.parametrize("eps", [1e-8, 1e-2])
@pytest.mark.parametrize("use_scratch", [False, True])
def test_adamw_matches_pytorch_formula(eps: float, use_scratch: bool) -> None:
    rng = np.random.default_rng(0)
    n = 50
    p0 = rng.standard_normal(n)
    decay = (rng.random(n) < 0.5).astype(np.float64)
    assert 0 < decay.sum() < n
    grads = [rng.standard_normal(n) * s for s in (1.0, 0.1, 3.0)]
    lrs = [1e-2, 5e-3, 2e-2]
    cfg = AdamWConfig(beta1=0.9, beta2=0.95, eps=eps, weight_decay=0.3)
    want_p, want_m, want_v = torch_adamw_reference(p0, grads, lrs, cfg, decay)

    p = p0.copy()
    state = adamw_init(p)
    assert state.step == 0 and not state.m.any() and not state.v.any()
    scratch = np.empty_like(p) if use_scratch else None
    for g, lr in zip(grads, lrs):
        g_in = g.copy()
        adamw_step(p, g_in, state, lr, cfg, decay, scratch)
        np.testing.assert_array_equal(g_in, g)  # gradients are read, not modified
    assert state.step == 3
    np.testing.assert_allclose(p, want_p, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(state.m, want_m, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(state.v, want_v, rtol=1e-12, atol=1e-15)
    # decay changes exactly the masked entries: rerun without decay and compare
    p_nd = p0.copy()
    state_nd = adamw_init(p_nd)
    for g, lr in zip(grads, lrs):
        adamw_step(p_nd, g, state_nd, lr, cfg, np.zeros(n))
    differ = ~np.isclose(p_nd, p, rtol=1e-14, atol=0)
    np.testing.assert_array_equal(differ, decay == 1)


def test_adamw_updates_flat_buffer_in_place_so_tree_views_follow() -> None:
    params = init_gpt(tiny_config(), self_mesh(), seed=0, dtype=np.float64)
    flat = flatten(params)
    tree = unflatten(flat, params)
    state = adamw_init(flat)
    adamw_step(flat, np.ones_like(flat), state, 0.1, AdamWConfig(weight_decay=0.0), decay_mask(tree))
    # with g = 1 everywhere the first Adam step moves every entry by lr / (1 + eps) ~ 0.1
    np.testing.assert_allclose(tree_leaves(tree)[0], tree_leaves(params)[0] - 0.1, rtol=1e-6)


_F4 = np.ones(4, np.float32)


@pytest.mark.parametrize("change, message", [
    (dict(g=np.ones(3, np.float32)), r"adamw_step's grads is \(3,\) but params \(4,\) makes it \(4,\)"),
    (dict(decay=np.ones(2, np.float32)), r"adamw_step's decay is \(2,\) but params \(4,\) makes it \(4,\)"),
    (dict(m=np.zeros(3, np.float32)), r"adamw_step's state.m is \(3,\) but params \(4,\)"),
    (dict(scratch=np.empty(3, np.float32)), r"adamw_step's scratch is \(3,\) but params \(4,\)"),
    (dict(decay=None), "adamw_step's decay must be an array of params' shape .*, got None"),  # a TypeError
    (dict(p=np.ones((2, 2), np.float32), g=np.ones((2, 2), np.float32), m=np.zeros((2, 2), np.float32)),
     r"adamw_step's params must be a flat \(1-D\) buffer, got shape \(2, 2\)"),  # a numba TypingError
    (dict(p=np.ones(4, int)), "adamw_step's params must be a float32 or float64 array, got int64"),
    (dict(p=np.frombuffer(bytes(16), np.float32)), r"adamw_step's params is read-only: pass a writeable copy"),
    (dict(m=np.frombuffer(bytes(16), np.float32)), r"adamw_step's state.m is read-only"),  # numba typing errors
], ids=["grads", "decay", "m", "scratch", "no-decay", "2d", "int", "read-only", "read-only-m"])
@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "numpy"])
def test_adamw_step_given_buffers_that_do_not_match_is_one_line(change: dict, message: str, kernels: bool) -> None:
    """The fused pass read past the end of a shorter gradient (or moment, or mask) and moved
    params by garbage; now one line naming the buffer and both shapes, params untouched."""
    from numesh.host import kernels as K

    b = dict(p=_F4.copy(), g=_F4, m=np.zeros(4, np.float32), decay=_F4, scratch=None)
    b.update(change)
    p0 = b["p"].copy()
    state = adamw_init(b["p"])
    state.m = b["m"]
    with K.switched(kernels), pytest.raises(ValueError, match=message) as e:
        adamw_step(b["p"], b["g"], state, 1e-3, AdamWConfig(), b["decay"], b["scratch"])
    assert "\n" not in str(e.value) and state.step == 0
    np.testing.assert_array_equal(b["p"], p0)


def test_decay_mask_is_one_for_leaves_of_ndim_two_or_more() -> None:
    tree = {"a": np.zeros((2, 3)), "b": np.zeros(4), "c": np.zeros((2, 2, 2)), "d": np.array(1.0)}
    mask = decay_mask(tree)
    assert mask.dtype == np.float64
    np.testing.assert_array_equal(unflatten(mask, tree)["a"], 1.0)
    np.testing.assert_array_equal(unflatten(mask, tree)["b"], 0.0)
    np.testing.assert_array_equal(unflatten(mask, tree)["c"], 1.0)
    np.testing.assert_array_equal(unflatten(mask, tree)["d"], 0.0)
    assert decay_mask(tree, np.float32).dtype == np.float32


_MATRICES = ("wte", "wpe", ".attn.qkv.w", ".attn.proj.w", ".mlp.fc.w", ".mlp.proj.w")


@pytest.mark.parametrize(
    "bias",
    [
        False,
        True,
    ],
)
def test_decay_mask_of_gpt_matrices_and_embeddings_only(bias: bool) -> None:
    cfg = tiny_config(bias=bias)
    params = init_gpt(cfg, self_mesh(), seed=0, dtype=np.float64)
    mask_tree = unflatten(decay_mask(params), params)
    for (path, p), m in zip(tree_leaves_with_path(params), tree_leaves(mask_tree)):
        is_matrix = path.endswith(_MATRICES)
        np.testing.assert_array_equal(m, 1.0 if is_matrix else 0.0, err_msg=path)


def test_cosine_lr() -> None:
    lr, min_lr, warmup, decay = 1e-3, 1e-4, 10, 110
    f = lambda s: cosine_lr(s, lr, min_lr, warmup, decay)  # noqa: E731
    assert f(0) == pytest.approx(lr * 1 / 11, rel=1e-15)  # nanoGPT: lr * (it + 1) / (warmup + 1)
    assert f(9) == pytest.approx(lr * 10 / 11, rel=1e-15)
    assert f(warmup) == pytest.approx(lr, rel=1e-15)
    assert f(60) == pytest.approx((lr + min_lr) / 2, rel=1e-12)  # half way through the decay
    assert f(35) == pytest.approx(min_lr + 0.5 * (1 + math.cos(math.pi * 0.25)) * (lr - min_lr), rel=1e-12)
    assert f(decay) == pytest.approx(min_lr, rel=1e-12)
    assert f(decay + 1) == min_lr
    assert f(10_000) == min_lr
    warm = [f(s) for s in range(warmup + 1)]
    assert all(a < b for a, b in zip(warm, warm[1:]))
    down = [f(s) for s in range(warmup, decay + 1)]
    assert all(a > b for a, b in zip(down, down[1:]))
    assert cosine_lr(0, lr, min_lr, 0, 100) == pytest.approx(lr)  # no warmup


def global_norm(grads, specs, mesh) -> float:
    """The optimiser's norm of `grads`, handed to it as the gradient of one unit."""
    opt = ZeroOptimizer({"only": grads}, {"only": specs}, mesh)
    opt.grads_ready("only", grads)
    return opt.global_norm()


def test_global_norm_on_one_rank() -> None:
    cfg = tiny_config(bias=True)
    mesh = self_mesh()
    grads = random_global_params(cfg, seed=3, scale=1.0)
    want = math.sqrt(sum(float(np.sum(g * g)) for g in tree_leaves(grads)))
    assert global_norm(grads, gpt_specs(cfg), mesh) == pytest.approx(want, rel=1e-13)
    assert mesh.counter.total(kind="calls") == 0
    simple = [np.array([3.0]), np.array([[4.0]])]
    assert global_norm(simple, [P(), P(None, "tp")], mesh) == pytest.approx(5.0, rel=1e-15)


def test_clip_scale() -> None:
    assert clip_scale(0.5, 1.0) == 1.0
    assert clip_scale(1.0, 1.0) == 1.0
    assert clip_scale(100.0, 0.0) == 1.0  # 0 = clipping off
    s = clip_scale(4.0, 1.0)
    assert s == pytest.approx(1.0 / (4.0 + 1e-6), rel=1e-15)
    assert 4.0 * s <= 1.0
    assert clip_scale(1e6, 2.0) * 1e6 == pytest.approx(2.0, rel=1e-9)


@pytest.mark.parametrize("norm, max_norm, message", [
    (float("nan"), 1.0, "clip_scale's norm must be a finite number, got nan"),  # was a NaN factor
    (5.0, -1.0, r"clip_scale's max_norm must be >= 0 \(0 = no clipping\), got -1.0"),  # was "off"
    ("5", 1.0, "clip_scale's norm must be a finite number, got '5'"),  # was a TypeError
])
def test_clip_scale_refuses_what_it_cannot_clip(norm, max_norm, message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{message}$"):
        clip_scale(norm, max_norm)


def test_cosine_lr_refuses_a_step_before_the_first() -> None:
    """A negative step put the warmup's line below zero: a negative learning rate."""
    with pytest.raises(ConfigError, match="starts at step 0, got step -5"):
        cosine_lr(-5, 1e-3, 1e-4, 10, 100)


def test_adamw_refuses_a_decay_that_flips_the_weights() -> None:
    """lr·wd >= 1 made W·(1 - lr·wd) zero or negative each step: the run finished with loss 51,934."""
    from numesh.optim import make_optimizer

    with pytest.raises(ConfigError, match="--weight-decay 1e\\+06 times --learning-rate 0.001 is 1000, not below 1"):
        make_optimizer("adamw", {"weight_decay": 1e6})
    make_optimizer("adamw", {"weight_decay": 999.0})  # 0.999: a strong decay, still a decay
