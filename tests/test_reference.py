"""The reader's block (numesh.nn.reference, nanoGPT's shape) computes what the real block
computes on the 1-rank mesh, for GPT-2's parts and Llama's."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import self_mesh, tiny_config
from numesh.nn import reference
from numesh.nn.gpt import ARCHS, init_gpt
from numesh.nn.transformer import block_fwd

KINDS = {
    "gpt2": ARCHS["gpt2"],
    "llama": dict(ARCHS["llama"], n_kv_head=2, norm_eps=1e-6, rope_theta=500.0),
    "llama-mqa": dict(ARCHS["llama"], n_kv_head=1),  # one kv head for all four query heads
    "llama-mha": ARCHS["llama"],  # kv heads = heads: the fused QKV Linear, rotated
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_reference_block_equals_the_block(kind: str, bias: bool, fused: bool) -> None:
    from numesh.host import kernels

    cfg = tiny_config(bias=bias, n_embd=32, n_head=4, block_size=16, **KINDS[kind])
    mesh = self_mesh()
    params = init_gpt(cfg, mesh, seed=5, dtype=np.float64)
    rng = np.random.default_rng(1)
    block = params.blocks[0]
    if bias:  # non-zero biases and LayerNorm affines, so a dropped term would show
        block = type(block)(*(_jitter(part, rng) for part in (block.ln1, block.attn, block.ln2, block.mlp)))
    else:  # norm scales off 1, so a norm applied without its weight would show
        block = type(block)(_jitter(block.ln1, rng), block.attn, _jitter(block.ln2, rng), block.mlp)
    x = rng.standard_normal((3, cfg.block_size, cfg.n_embd))
    with kernels.switched(fused):
        want, _ = block_fwd(block, x, cfg, mesh, layer=0)
    np.testing.assert_allclose(reference.block_fwd(block, x, cfg), want, rtol=1e-12, atol=1e-12)


def _jitter(tree, rng):
    from numesh.base.tree import tree_map

    return tree_map(lambda a: a + 0.1 * rng.standard_normal(a.shape), tree)
