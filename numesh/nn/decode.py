"""Inference with a KV cache: the logits of new tokens given the keys and values of the
positions already seen (the same block math as training, without dropout or backward)."""

from __future__ import annotations

import math

import attrs
import numpy as np

from numesh.base.errors import ConfigError
from numesh.mesh import Mesh, all_gather
from numesh.nn.attention import attend_fwd
from numesh.nn.gpt import GPT, GPTConfig
from numesh.nn.layers import Linear, layernorm_fwd, linear_fwd
from numesh.nn.parallel import reduce_from_tp
from numesh.nn.transformer import bias_add, block_fwd, embed_fwd, local_heads, mlp_fwd


@attrs.define
class KVCache:
    """Per layer, keys and values [B, n_local_heads, block_size, hs] of the positions seen so far."""

    k: list[np.ndarray]
    v: list[np.ndarray]
    length: int = 0


def new_kv_cache(cfg: GPTConfig, mesh: Mesh, batch: int, dtype) -> KVCache:
    if mesh.sequence_parallel:  # a step decodes one token: there is no sequence to split
        raise ConfigError("generation does not use sequence parallelism: make its mesh without sequence_parallel")
    nh, hs, _ = local_heads(cfg, mesh)
    shape = (batch, nh, cfg.block_size, hs)
    return KVCache([np.zeros(shape, dtype) for _ in range(cfg.n_layer)],
                   [np.zeros(shape, dtype) for _ in range(cfg.n_layer)])


def _attend_cached(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos0: int) -> np.ndarray:
    """Attention of new queries at positions pos0.. over every cached key up to them: the
    training kernel with the diagonal moved by pos0 (one query row per generated token)."""
    y = np.empty(q.shape, q.dtype)
    attend_fwd(q, k, v, y, scale=1.0 / math.sqrt(q.shape[-1]), diag=pos0)
    return y


def logits_cached(params: GPT, idx: np.ndarray, cache: KVCache, cfg: GPTConfig, mesh: Mesh) -> np.ndarray:
    """Full-vocabulary logits [B, V] of the last of `idx` (new tokens), appending them to the cache."""
    pos0 = cache.length
    x, _ = embed_fwd(params, idx, cfg, mesh, pos0=pos0)
    B, T, C = x.shape
    nh, hs, _ = local_heads(cfg, mesh)
    for layer, p in enumerate(params.blocks):
        h1, _ = layernorm_fwd(p.ln1, x)
        qkv, _ = linear_fwd(p.attn.qkv, h1)
        qkv = qkv.reshape(B, T, 3, nh, hs).transpose(2, 0, 3, 1, 4)  # [3, B, nh, T, hs]
        cache.k[layer][:, :, pos0 : pos0 + T] = qkv[1]
        cache.v[layer][:, :, pos0 : pos0 + T] = qkv[2]
        a = _attend_cached(qkv[0], cache.k[layer][:, :, : pos0 + T], cache.v[layer][:, :, : pos0 + T], pos0)
        a = a.transpose(0, 2, 1, 3).reshape(B, T, nh * hs)
        y, _ = linear_fwd(Linear(p.attn.proj.w), a)
        x = x + bias_add(reduce_from_tp(y, mesh), p.attn.proj.b)
        h2, _ = layernorm_fwd(p.ln2, x)
        x = x + mlp_fwd(p.mlp, h2, cfg, mesh, layer)[0]
    cache.length = pos0 + T
    xf, _ = layernorm_fwd(params.ln_f, x[:, -1])
    local = xf @ params.wte.T  # [B, V/tp]
    full = all_gather(local, mesh, "tp", dim=1)
    return full[:, : cfg.vocab_size]


def logits_last(params: GPT, idx: np.ndarray, model: GPTConfig, mesh: Mesh) -> np.ndarray:
    """Full-vocabulary logits [B, V] at the last position, by a full forward of `idx` (no cache)."""
    x, _ = embed_fwd(params, idx, model, mesh)
    for layer, bp in enumerate(params.blocks):
        x, _ = block_fwd(bp, x, model, mesh, layer)
    xf, _ = layernorm_fwd(params.ln_f, x[:, -1])
    return all_gather(xf @ params.wte.T, mesh, "tp", dim=1)[:, : model.vocab_size]
