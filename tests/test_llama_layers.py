"""The Llama family's pieces (RMSNorm, rotary embeddings, SwiGLU) against their definitions
and their backward passes against finite differences, in float64."""

from __future__ import annotations

import numpy as np
import pytest

from numesh.nn.layers import RMSNorm, rmsnorm_bwd, rmsnorm_fwd, swiglu_bwd, swiglu_fwd
from numesh.nn.rotary import rope_bwd, rope_fwd, rotary_tables


def _fd(f, x: np.ndarray, dy: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """d<f(x), dy>/dx by central differences."""
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        x[i] += eps
        up = np.vdot(f(x), dy)
        x[i] -= 2 * eps
        down = np.vdot(f(x), dy)
        x[i] += eps
        g[i] = (up - down) / (2 * eps)
    return g


def test_rmsnorm_matches_its_definition_and_finite_differences() -> None:
    rng = np.random.default_rng(0)
    x, w, dy = rng.standard_normal((2, 3, 8)), rng.standard_normal(8), rng.standard_normal((2, 3, 8))
    y, ctx = rmsnorm_fwd(RMSNorm(w), x, 1e-6)
    assert np.allclose(y, x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w, rtol=1e-13)
    dx, dp = rmsnorm_bwd(RMSNorm(w), ctx, dy)
    assert np.allclose(dx, _fd(lambda v: rmsnorm_fwd(RMSNorm(w), v, 1e-6)[0], x.copy(), dy), rtol=1e-7, atol=1e-9)
    assert np.allclose(dp.w, _fd(lambda v: rmsnorm_fwd(RMSNorm(v), x, 1e-6)[0], w.copy(), dy), rtol=1e-7, atol=1e-9)


def test_swiglu_matches_its_definition_and_finite_differences() -> None:
    rng = np.random.default_rng(1)
    g, u, dy = (rng.standard_normal((3, 5)) * 3 for _ in range(3))
    y, ctx = swiglu_fwd(g, u)
    assert np.allclose(y, g / (1 + np.exp(-g)) * u, rtol=1e-13)
    dg, du = swiglu_bwd(ctx, dy)
    assert np.allclose(dg, _fd(lambda v: swiglu_fwd(v, u)[0], g.copy(), dy), rtol=1e-7, atol=1e-9)
    assert np.allclose(du, _fd(lambda v: swiglu_fwd(g, v)[0], u.copy(), dy), rtol=1e-7, atol=1e-9)


def _rope_by_pairs(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """The definition, pair by pair: pair i = (x[i], x[i + d/2]) rotated by p / theta**(2i/d)."""
    d = x.shape[-1]
    out = np.empty_like(x)
    for t, p in enumerate(positions):
        for i in range(d // 2):
            a = p / theta ** (2 * i / d)
            x1, x2 = x[..., t, i], x[..., t, i + d // 2]
            out[..., t, i] = x1 * np.cos(a) - x2 * np.sin(a)
            out[..., t, i + d // 2] = x2 * np.cos(a) + x1 * np.sin(a)
    return out


@pytest.mark.parametrize("positions", [np.arange(6), np.array([0, 1, 6, 7, 2, 5])])  # in order, zigzag-like
def test_rope_rotates_each_pair_by_its_true_position(positions: np.ndarray) -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 6, 8))  # [B, H, T, d]
    rot = rotary_tables(positions, 8, 10_000.0, np.float64)
    assert np.allclose(rope_fwd(x, rot), _rope_by_pairs(x, positions, 10_000.0), rtol=1e-12, atol=1e-14)
    # the token's rotation depends on its position only: the same token at the same position
    # rotates the same inside any slice of the sequence
    part = rotary_tables(positions[2:4], 8, 10_000.0, np.float64)
    assert np.array_equal(rope_fwd(x[:, :, 2:4], part), rope_fwd(x, rot)[:, :, 2:4])


def test_rope_backward_matches_finite_differences_and_keeps_norms() -> None:
    rng = np.random.default_rng(3)
    x, dy = rng.standard_normal((1, 2, 5, 4)), rng.standard_normal((1, 2, 5, 4))
    rot = rotary_tables(np.arange(3, 8), 4, 500.0, np.float64)
    assert np.allclose(rope_bwd(dy, rot), _fd(lambda v: rope_fwd(v, rot), x.copy(), dy), rtol=1e-7, atol=1e-9)
    assert np.allclose(np.linalg.norm(rope_fwd(x, rot), axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-13)


def test_rope_refuses_an_odd_head_size() -> None:
    with pytest.raises(ValueError, match="even head size"):
        rotary_tables(np.arange(4), 5, 10_000.0, np.float64)


def test_rope_and_rmsnorm_match_transformers_llama() -> None:
    """The same numbers as `LlamaForCausalLM`'s own rotary embedding and RMSNorm (float64),
    at the positions of a zigzag chunk, so imported q/k weights need no permutation.
    transformers computes the angles and the norm's statistics in float32 whatever the
    model's dtype (numesh in the run's dtype), hence 1e-6; a permuted layout or a misplaced
    epsilon would be off by far more."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama as hf

    cfg = transformers.LlamaConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                                   rope_theta=1e5, rms_norm_eps=1e-5, max_position_embeddings=64)
    rng = np.random.default_rng(4)
    q, k = rng.standard_normal((1, 2, 4, 16)), rng.standard_normal((1, 1, 4, 16))
    positions = np.array([3, 9, 10, 17])
    emb = hf.LlamaRotaryEmbedding(cfg).to(torch.float64)
    cos, sin = emb(torch.from_numpy(q), torch.from_numpy(positions)[None])
    hq, hk = hf.apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(k), cos, sin)
    rot = rotary_tables(positions, 16, 1e5, np.float64)
    assert np.allclose(rope_fwd(q, rot), hq.numpy(), rtol=1e-6, atol=1e-6)
    assert np.allclose(rope_fwd(k, rot), hk.numpy(), rtol=1e-6, atol=1e-6)

    norm = hf.LlamaRMSNorm(32, eps=1e-5).to(torch.float64)
    w = rng.standard_normal(32)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(w))
    x = rng.standard_normal((2, 3, 32))
    assert np.allclose(rmsnorm_fwd(RMSNorm(w), x, 1e-5)[0], norm(torch.from_numpy(x)).detach().numpy(), rtol=1e-6)
