"""The transformer block in a dozen lines, for readers: nanoGPT's `Block.forward` in NumPy.

No mesh, no dropout, no backward, no contexts: what `numesh.nn.transformer.block_fwd`
computes on the 1-rank mesh, written as nanoGPT writes it (tests/test_reference.py holds the
two equal). The real block adds what this one leaves out: the tp and sp collectives, the cp
ring, dropout, the saved contexts its hand-written backward needs, and the fused kernels.
"""

from __future__ import annotations

import math

import numpy as np

from numesh.nn.gpt import MLP, Attention, Block
from numesh.nn.layers import LN_EPS, LayerNorm, Linear


def linear(p: Linear, x: np.ndarray) -> np.ndarray:
    y = x @ p.w.reshape(p.w.shape[0], -1)  # [..., in] @ [in, out]
    return y if p.b is None else y + p.b.reshape(-1)


def layernorm(p: LayerNorm, x: np.ndarray) -> np.ndarray:
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + LN_EPS) * p.w
    return y if p.b is None else y + p.b


def gelu(x: np.ndarray) -> np.ndarray:  # GPT-2's tanh form
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def attention(p: Attention, x: np.ndarray, n_head: int) -> np.ndarray:
    B, T, C = x.shape
    q, k, v = linear(p.qkv, x).reshape(B, T, 3, n_head, C // n_head).transpose(2, 0, 3, 1, 4)  # 3 × [B, H, T, hs]
    att = q @ k.swapaxes(-1, -2) / math.sqrt(C // n_head)  # [B, H, T, T]
    att = np.where(np.tri(T, dtype=bool), att, -np.inf)  # causal: no key after its query
    att = np.exp(att - att.max(-1, keepdims=True))
    att /= att.sum(-1, keepdims=True)
    y = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, C)  # [B, H, T, hs] -> [B, T, C]
    return linear(p.proj, y)


def mlp(p: MLP, x: np.ndarray) -> np.ndarray:
    return linear(p.proj, gelu(linear(p.fc, x)))  # [B, T, C] -> [B, T, 4C] -> [B, T, C]


def block_fwd(p: Block, x: np.ndarray, n_head: int) -> np.ndarray:
    """One transformer block on x [B, T, C]."""
    x = x + attention(p.attn, layernorm(p.ln1, x), n_head)
    return x + mlp(p.mlp, layernorm(p.ln2, x))
