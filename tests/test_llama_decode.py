"""Generation from the Llama kind on one rank: the KV cache's logits equal the full forward
(`logits_last`, and the plain reference model) at every position, rotary angles at the
cached tokens' true positions, for grouped-query attention with an untied head and
multi-query attention with a tied one; `generate` draws the same tokens with and without
the cache, past the context where the window slides. (tp=2 with fewer kv heads than tp:
tests/test_mpi_tensor_parallel.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import random_global_params, self_mesh, tiny_config
from numesh.base.tree import tree_map
from numesh.nn import reference
from numesh.nn.decode import logits_cached, logits_last, new_kv_cache
from numesh.nn.gpt import ARCHS, GPTConfig
from numesh.run.sample import generate

KINDS = {
    "gqa-untied": dict(n_kv_head=2),  # kv heads < heads: q, k, v apart; the head its own lm_head
    "mqa-tied": dict(n_kv_head=1, tie_embeddings=True),
    "gqa-bias": dict(n_kv_head=2, bias=True, ffn_hidden=24),
}


def llama(kind: str, **overrides: object) -> GPTConfig:
    """A tiny Llama: 2 layers, 16 wide, 4 query heads of size 4, block 8."""
    kw: dict = dict(ARCHS["llama"], n_embd=16, n_head=4, bias=False, rope_theta=100.0, norm_eps=1e-6)
    kw.update(KINDS[kind], **overrides)
    return tiny_config(**kw)


@pytest.mark.parametrize("kind", list(KINDS))
def test_kv_cache_logits_equal_the_full_forward(kind: str) -> None:
    cfg = llama(kind)
    mesh = self_mesh()
    params = random_global_params(cfg, seed=4)
    assert (params.lm_head is None) == cfg.tie_embeddings and params.wpe is None
    idx = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, cfg.block_size))
    plain = reference.logits(params, idx, cfg)  # [B, T, V], rotary at positions 0..T-1
    cache = new_kv_cache(cfg, mesh, 2, np.float64)
    assert cache.k[0].shape == (2, cfg.kv_heads, cfg.block_size, cfg.head_size)  # kv heads only, not repeated
    steps = [(0, 3)] + [(t, t + 1) for t in range(3, cfg.block_size)]  # a prompt of 3, then one token at a time
    for t0, t1 in steps:
        got = logits_cached(params, idx[:, t0:t1], cache, cfg, mesh)
        want = logits_last(params, idx[:, :t1], cfg, mesh)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13, err_msg=f"position {t1 - 1}")
        np.testing.assert_allclose(got, plain[:, t1 - 1], rtol=1e-10, atol=1e-12, err_msg=f"position {t1 - 1}")
    assert cache.length == cfg.block_size


@pytest.mark.parametrize("kind", ["gqa-untied", "mqa-tied"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_generate_draws_the_same_tokens_with_and_without_the_cache(kind: str, dtype: type) -> None:
    """Past the context (block_size 8, 3 + 10 tokens) the window slides and is recomputed
    from position 0 on both paths. float32 too: the cache takes the parameters' dtype."""
    cfg = llama(kind)
    params = tree_map(lambda x: x.astype(dtype), random_global_params(cfg, seed=6, scale=1.0))
    prompt = np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 3))
    runs = [generate(params, cfg, self_mesh(), prompt, 10, temperature=1.0, top_k=None, seed=7, kv_cache=kv)
            for kv in (True, False)]
    np.testing.assert_array_equal(runs[0], runs[1])
    assert runs[0].shape == (2, 13) and len(np.unique(runs[0])) > 2  # drawn, not one token repeated

