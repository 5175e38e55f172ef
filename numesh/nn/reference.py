"""The model in a few dozen lines, for readers: nanoGPT's `Block.forward` in NumPy, with
Llama's parts beside GPT-2's (RMSNorm, rotary positions, grouped-query attention, SwiGLU).

No mesh, no dropout, no backward, no contexts: what `numesh.nn.transformer.block_fwd`
computes on the 1-rank mesh, written as nanoGPT writes it (tests/test_reference.py and
tests/test_llama_model.py hold the two equal). The real block adds what this one leaves
out: the tp and sp collectives, the cp ring, dropout, the saved contexts its hand-written
backward needs, the fused kernels, and GQA without repeating k and v.
"""

from __future__ import annotations

import math

import numpy as np

from numesh.nn.gpt import GPT, MLP, Attention, Block, GPTConfig, GQAttention
from numesh.nn.layers import LN_EPS, LayerNorm, Linear, RMSNorm


def linear(p: Linear, x: np.ndarray) -> np.ndarray:
    y = x @ p.w.reshape(p.w.shape[0], -1)  # [..., in] @ [in, out]
    return y if p.b is None else y + p.b.reshape(-1)


def layernorm(p: LayerNorm, x: np.ndarray) -> np.ndarray:
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + LN_EPS) * p.w
    return y if p.b is None else y + p.b


def norm(p: LayerNorm | RMSNorm, x: np.ndarray, eps: float) -> np.ndarray:
    if isinstance(p, LayerNorm):
        return layernorm(p, x)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * p.w  # RMSNorm


def gelu(x: np.ndarray) -> np.ndarray:  # GPT-2's tanh form
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def rope(x: np.ndarray, theta: float) -> np.ndarray:
    """x [B, H, T, hs] rotated by position 0..T-1: transformers' rotate-half layout."""
    T, hs = x.shape[-2:]
    angles = np.outer(np.arange(T), theta ** -(np.arange(0, hs, 2) / hs))  # [T, hs/2]
    cos, sin = np.cos(np.concatenate([angles, angles], -1)), np.sin(np.concatenate([angles, angles], -1))
    x1, x2 = x[..., : hs // 2], x[..., hs // 2 :]
    return x * cos + np.concatenate([-x2, x1], -1) * sin


def attention(p: Attention | GQAttention, x: np.ndarray, cfg: GPTConfig) -> np.ndarray:
    B, T, C = x.shape
    H, hs = cfg.n_head, cfg.head_size
    if isinstance(p, Attention):
        q, k, v = linear(p.qkv, x).reshape(B, T, 3, H, hs).transpose(2, 0, 3, 1, 4)  # 3 × [B, H, T, hs]
    else:
        q = linear(p.q, x).reshape(B, T, H, hs).transpose(0, 2, 1, 3)  # [B, H, T, hs]
        k, v = (linear(w, x).reshape(B, T, cfg.kv_heads, hs).transpose(0, 2, 1, 3) for w in (p.k, p.v))
    if cfg.positions == "rotary":
        q, k = rope(q, cfg.rope_theta), rope(k, cfg.rope_theta)
    g = H // cfg.kv_heads  # each kv head serves g query heads: repeat it (the kernel does not)
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)  # [B, H, T, hs]
    att = q @ k.swapaxes(-1, -2) / math.sqrt(hs)  # [B, H, T, T]
    att = np.where(np.tri(T, dtype=bool), att, -np.inf)  # causal: no key after its query
    att = np.exp(att - att.max(-1, keepdims=True))
    att /= att.sum(-1, keepdims=True)
    y = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, C)  # [B, H, T, hs] -> [B, T, C]
    return linear(p.proj, y)


def mlp(p: MLP, x: np.ndarray) -> np.ndarray:
    if p.gate is None:
        return linear(p.proj, gelu(linear(p.fc, x)))  # [B, T, C] -> [B, T, F] -> [B, T, C]
    a = linear(p.gate, x)
    return linear(p.proj, a / (1.0 + np.exp(-a)) * linear(p.fc, x))  # SwiGLU: silu(gate) * up


def block_fwd(p: Block, x: np.ndarray, cfg: GPTConfig) -> np.ndarray:
    """One transformer block on x [B, T, C]."""
    x = x + attention(p.attn, norm(p.ln1, x, cfg.norm_eps), cfg)
    return x + mlp(p.mlp, norm(p.ln2, x, cfg.norm_eps))


def logits(params: GPT, idx: np.ndarray, cfg: GPTConfig) -> np.ndarray:
    """The whole dense model's logits [B, T, V] for ids [B, T] (whole, unsharded params)."""
    x = params.wte[idx]
    if params.wpe is not None:
        x = x + params.wpe[: idx.shape[1]]
    for p in params.blocks:
        x = block_fwd(p, x, cfg)
    head = params.wte if params.lm_head is None else params.lm_head
    return norm(params.ln_f, x, cfg.norm_eps) @ head[: cfg.vocab_size].T
