"""Inference with a KV cache: the logits of new tokens given the keys and values of the
positions already seen. The blocks are training's own (`block_fwd`) with a cached
attention core; no dropout, no backward."""

from __future__ import annotations

import math

import attrs
import numpy as np

from numesh.base.errors import ConfigError
from numesh.mesh import Mesh, all_gather
from numesh.nn.attention import attend_fwd
from numesh.nn.gpt import GPT, GPTConfig
from numesh.nn.parts import local_kv_heads, norm_fwd
from numesh.nn.transformer import block_fwd, embed_fwd, head_weight


@attrs.define
class KVCache:
    """Per layer, keys and values [B, kv heads read on this tp rank, block_size, hs] of the
    positions seen so far (grouped-query attention keeps only its kv heads)."""

    k: list[np.ndarray]
    v: list[np.ndarray]
    length: int = 0


def new_kv_cache(cfg: GPTConfig, mesh: Mesh, batch: int, dtype) -> KVCache:
    if mesh.sequence_parallel:  # a step decodes one token: there is no sequence to split
        raise ConfigError("generation does not use sequence parallelism: make its mesh without sequence_parallel")
    kv = local_kv_heads(cfg, mesh)
    shape = (batch, kv.stop - kv.start, cfg.block_size, cfg.head_size)
    return KVCache([np.zeros(shape, dtype) for _ in range(cfg.n_layer)],
                   [np.zeros(shape, dtype) for _ in range(cfg.n_layer)])


@attrs.frozen
class CachedAttention:
    """`block_fwd`'s attention core for decoding: the new tokens' keys and values (at
    positions pos0..) appended to the cache, and their queries attending over every cached
    key up to them: the training kernel with the diagonal moved by pos0."""

    cache: KVCache
    pos0: int

    def __call__(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, y: np.ndarray) -> None:
        end = self.pos0 + q.shape[2]
        self.cache.k[layer][:, :, self.pos0 : end] = k
        self.cache.v[layer][:, :, self.pos0 : end] = v
        attend_fwd(q, self.cache.k[layer][:, :, :end], self.cache.v[layer][:, :, :end], y,
                   scale=1.0 / math.sqrt(q.shape[-1]), diag=self.pos0)


def _logits(params: GPT, x: np.ndarray, cfg: GPTConfig, mesh: Mesh) -> np.ndarray:
    """Full-vocabulary logits [B, V] of the last position of x [B, T, C]: the final norm, the
    vocab-parallel head, its shards gathered over tp."""
    xf, _ = norm_fwd(params.ln_f, x[:, -1], cfg.norm_eps)
    return all_gather(xf @ head_weight(params).T, mesh, "tp", dim=1)[:, : cfg.vocab_size]  # [B, V]


def logits_cached(params: GPT, idx: np.ndarray, cache: KVCache, cfg: GPTConfig, mesh: Mesh) -> np.ndarray:
    """Full-vocabulary logits [B, V] of the last of `idx` (new tokens), appending them to the
    cache: the training blocks (`block_fwd`), their attention over the cache."""
    pos0 = cache.length
    x, _ = embed_fwd(params, idx, cfg, mesh, pos0=pos0)
    attend = CachedAttention(cache, pos0)
    for layer, p in enumerate(params.blocks):
        x, _ = block_fwd(p, x, cfg, mesh, layer, attend=attend)
    cache.length = pos0 + idx.shape[1]
    return _logits(params, x, cfg, mesh)


def logits_last(params: GPT, idx: np.ndarray, model: GPTConfig, mesh: Mesh) -> np.ndarray:
    """Full-vocabulary logits [B, V] at the last position, by a full forward of `idx` (no cache)."""
    x, _ = embed_fwd(params, idx, model, mesh)
    for layer, bp in enumerate(params.blocks):
        x, _ = block_fwd(bp, x, model, mesh, layer)
    return _logits(params, x, model, mesh)
