"""The GPT's pieces as forward/backward pairs: embedding, transformer block, head + loss.

Each `*_fwd` returns (output, a named context) and each backward takes that context. The
block's backward comes in two halves, so a zero-bubble pipeline can defer the second:
`block_bwd_input` (a "B": the input gradient, plus the cheap LayerNorm grads) and
`block_bwd_weight` (a "W": the four Linear weight grads). Tensor parallelism is Megatron's:
the only tp communication is the f/g pair around each half of the block (`copy_to_tp_bwd`,
`reduce_from_tp`) and the vocab-parallel embedding and cross-entropy.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from numesh.errors import ConfigError
from numesh.mesh import Mesh
from numesh.nn.dropout import EMBED, DropoutKey, Site
from numesh.nn.gpt import GPT, MLP, Attention, Block, GPTConfig
from numesh.nn.layers import (
    LayerNorm,
    Linear,
    causal_attention_bwd,
    causal_attention_fwd,
    causal_attention_probs,
    gelu_bwd,
    gelu_fwd,
    layernorm_bwd,
    layernorm_fwd,
    linear_bwd_input,
    linear_bwd_weight,
    linear_fwd,
)
from numesh.nn.parallel import (
    copy_to_tp_bwd,
    reduce_from_tp,
    vocab_parallel_cross_entropy_bwd,
    vocab_parallel_cross_entropy_fwd,
    vocab_parallel_embedding_bwd,
    vocab_parallel_embedding_fwd,
)


def local_heads(cfg: GPTConfig, mesh: Mesh) -> tuple[int, int, slice]:
    """(heads on this tp rank, head size, this rank's slice of all heads)."""
    n_local = cfg.n_head // mesh.size("tp")
    h0 = mesh.index("tp") * n_local
    return n_local, cfg.n_embd // cfg.n_head, slice(h0, h0 + n_local)


def bias_add(y: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    """y += b in place when there is a bias (row-parallel biases go after the tp reduction)."""
    if b is not None:
        y += b
    return y


# ---------------------------------------------------------------------------------------
# transformer block


@attrs.frozen
class BlockCtx:
    """What a block's backward needs from its forward (residual dropout masks are redrawn)."""

    ln1: Any  # LayerNorm 1's context
    h1: np.ndarray  # LayerNorm 1's output = the QKV matmul's input [B, T, C]
    attn: Any  # attention core's context
    a: np.ndarray  # attention output = the out-projection's input [B, T, C/tp]
    ln2: Any
    h2: np.ndarray  # LayerNorm 2's output = the MLP-up matmul's input [B, T, C]
    gelu: Any
    g: np.ndarray  # GELU output = the MLP-down matmul's input [B, T, 4C/tp]
    drop: DropoutKey | None
    layer: int


@attrs.frozen
class LinearIO:
    """A Linear's input and output gradient: all its weight gradient needs."""

    x: np.ndarray
    dy: np.ndarray


@attrs.frozen
class BlockWeightCtx:
    """What `block_bwd_weight` needs: LayerNorm grads (done in B) and each Linear's IO."""

    d_ln1: LayerNorm
    d_ln2: LayerNorm
    qkv: LinearIO
    attn_proj: LinearIO
    fc: LinearIO
    mlp_proj: LinearIO


def _drop_residual(y: np.ndarray, drop: DropoutKey | None, site: Site) -> np.ndarray:
    """y times `site`'s residual-dropout mask (a new array), or y itself without dropout."""
    if drop is None:
        return y
    return y * drop.mask(site, y.shape[0], y.shape[1:]).astype(y.dtype)


def block_fwd(p: Block, x: np.ndarray, cfg: GPTConfig, mesh: Mesh, layer: int,
              drop: DropoutKey | None = None) -> tuple[np.ndarray, BlockCtx]:
    """One transformer block on x [B, T, C], replicated over tp."""
    B, T, C = x.shape
    nh, hs, _ = local_heads(cfg, mesh)
    h1, ln1 = layernorm_fwd(p.ln1, x)  # f: identity forward
    qkv, _ = linear_fwd(p.attn.qkv, h1)
    qkv = qkv.reshape(B, T, 3, nh, hs).transpose(2, 0, 3, 1, 4)  # [3, B, nh, T, hs]
    att_mask = attention_drop_mask(drop, layer, B, T, cfg, mesh, x.dtype)
    a, attn = causal_attention_fwd(qkv[0], qkv[1], qkv[2], att_mask)
    a = a.transpose(0, 2, 1, 3).reshape(B, T, nh * hs)  # [B, T, C/tp]
    y, _ = linear_fwd(Linear(p.attn.proj.w), a)
    y = bias_add(reduce_from_tp(y, mesh), p.attn.proj.b)  # g
    if drop:
        y *= drop.mask(Site("attn_out", layer), B, (T, C))
    x = x + y
    h2, ln2 = layernorm_fwd(p.ln2, x)
    u, _ = linear_fwd(p.mlp.fc, h2)
    g, gelu = gelu_fwd(u)
    z, _ = linear_fwd(Linear(p.mlp.proj.w), g)
    z = bias_add(reduce_from_tp(z, mesh), p.mlp.proj.b)
    if drop:
        z *= drop.mask(Site("mlp_out", layer), B, (T, C))
    x += z
    return x, BlockCtx(ln1, h1, attn, a, ln2, h2, gelu, g, drop, layer)


def attention_drop_mask(drop: DropoutKey | None, layer: int, B: int, T: int, cfg: GPTConfig, mesh: Mesh,
                        dtype) -> np.ndarray | None:
    """This tp rank's heads of block `layer`'s attention-probability dropout mask [B, nh, T, T]
    (None without dropout): a function of the key alone, so recomputation redraws it."""
    if not drop:
        return None
    _, _, heads = local_heads(cfg, mesh)
    return drop.mask(Site("attn", layer), B, (cfg.n_head, T, T), (heads,)).astype(dtype)


@attrs.frozen
class AttnInputs:
    """The attention core's context without its T×T tensors (selective recomputation):
    the scaled queries, keys and values [B, nh, T, hs] and each score row's maximum and
    1/Σexp [B, nh, T, 1], which rebuild them."""

    qs: np.ndarray
    k: np.ndarray
    v: np.ndarray
    mx: np.ndarray
    inv: np.ndarray


def without_scores(ctx: BlockCtx) -> BlockCtx:
    """`ctx` keeping q, k, v instead of the softmax probabilities and their dropout mask."""
    qs, k, v, _, _, mx, inv = ctx.attn
    return attrs.evolve(ctx, attn=AttnInputs(qs, k, v, mx, inv))


def with_scores(ctx: BlockCtx, cfg: GPTConfig, mesh: Mesh) -> BlockCtx:
    """A `without_scores` context made whole again: the probabilities recomputed from q and
    k and the mask redrawn from the dropout key, bit for bit what the forward had."""
    if not isinstance(ctx.attn, AttnInputs):
        return ctx
    c = ctx.attn
    B, _, T, _ = c.qs.shape
    att = causal_attention_probs(c.qs, c.k, c.mx, c.inv)
    mask = attention_drop_mask(ctx.drop, ctx.layer, B, T, cfg, mesh, c.qs.dtype)
    return attrs.evolve(ctx, attn=(c.qs, c.k, c.v, att, mask, c.mx, c.inv))


def block_bwd_input(p: Block, ctx: BlockCtx, dx: np.ndarray, cfg: GPTConfig, mesh: Mesh) -> tuple[np.ndarray, BlockWeightCtx]:
    """Input-gradient half of the block's backward (a zero-bubble "B"): (grad of the input,
    what `block_bwd_weight` needs). LayerNorm and bias grads are cheap and done here."""
    B, T, C = dx.shape
    nh, hs, _ = local_heads(cfg, mesh)
    # MLP half
    dz = _drop_residual(dx, ctx.drop, Site("mlp_out", ctx.layer))
    du = gelu_bwd(ctx.gelu, linear_bwd_input(p.mlp.proj, dz))
    dh2 = copy_to_tp_bwd(linear_bwd_input(p.mlp.fc, du), mesh)
    dx2, d_ln2 = layernorm_bwd(p.ln2, ctx.ln2, dh2)
    dx = dx + dx2
    # attention half
    dy = _drop_residual(dx, ctx.drop, Site("attn_out", ctx.layer))
    da = linear_bwd_input(p.attn.proj, dy).reshape(B, T, nh, hs).transpose(0, 2, 1, 3)  # [B, nh, T, hs]
    dq, dk, dv = causal_attention_bwd(ctx.attn, da)
    dqkv = np.empty((B, T, 3, nh, hs), dtype=dx.dtype)
    dqkv[:, :, 0] = dq.transpose(0, 2, 1, 3)
    dqkv[:, :, 1] = dk.transpose(0, 2, 1, 3)
    dqkv[:, :, 2] = dv.transpose(0, 2, 1, 3)
    dqkv = dqkv.reshape(B, T, 3 * nh * hs)
    dh1 = copy_to_tp_bwd(linear_bwd_input(p.attn.qkv, dqkv), mesh)
    dx1, d_ln1 = layernorm_bwd(p.ln1, ctx.ln1, dh1)
    dx1 += dx  # not in place on dx: it may be `dy`, which the weight half still needs
    io = BlockWeightCtx(d_ln1, d_ln2, LinearIO(ctx.h1, dqkv), LinearIO(ctx.a, dy), LinearIO(ctx.h2, du), LinearIO(ctx.g, dz))
    return dx1, io


def _row_parallel_grad(lin: Linear, io: LinearIO) -> Linear:
    """A row-parallel Linear's grads: its bias is added after the tp reduction, so the bias
    grad is the full upstream grad summed over tokens."""
    dw = linear_bwd_weight(Linear(lin.w), io.x, io.dy).w
    return Linear(dw, None if lin.b is None else io.dy.reshape(-1, io.dy.shape[-1]).sum(axis=0))


def block_bwd_weight(p: Block, w: BlockWeightCtx) -> Block:
    """Weight-gradient half of the block's backward (a zero-bubble "W"): the Linear grads."""
    return Block(
        ln1=w.d_ln1,
        attn=Attention(qkv=linear_bwd_weight(p.attn.qkv, w.qkv.x, w.qkv.dy), proj=_row_parallel_grad(p.attn.proj, w.attn_proj)),
        ln2=w.d_ln2,
        mlp=MLP(fc=linear_bwd_weight(p.mlp.fc, w.fc.x, w.fc.dy), proj=_row_parallel_grad(p.mlp.proj, w.mlp_proj)),
    )


# ---------------------------------------------------------------------------------------
# embedding and head


@attrs.frozen
class EmbedCtx:
    tok: Any  # the vocab-parallel lookup's context
    drop: DropoutKey | None
    T: int


def embed_fwd(params: GPT, idx: np.ndarray, cfg: GPTConfig, mesh: Mesh, drop: DropoutKey | None = None,
              pos0: int = 0) -> tuple[np.ndarray, EmbedCtx]:
    """Token + position embedding of ids [B, T] starting at position `pos0`: x [B, T, C]."""
    T = idx.shape[1]
    if pos0 + T > cfg.block_size:
        raise ConfigError(f"sequence of {pos0 + T} tokens is longer than block_size={cfg.block_size}")
    tok, tok_ctx = vocab_parallel_embedding_fwd(params.wte, idx, mesh)
    x = tok + params.wpe[pos0 : pos0 + T]
    if drop:
        x *= drop.mask(EMBED, x.shape[0], x.shape[1:])
    return x, EmbedCtx(tok_ctx, drop, T)


def embed_bwd(params: GPT, ctx: EmbedCtx, dx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(grad of wte from the lookup, grad of wpe)."""
    dx = _drop_residual(dx, ctx.drop, EMBED)
    dwpe = np.zeros_like(params.wpe)
    dwpe[: ctx.T] = dx.sum(axis=0)
    return vocab_parallel_embedding_bwd(params.wte, ctx.tok, dx), dwpe


@attrs.frozen
class HeadCtx:
    ln_f: Any
    xf: np.ndarray  # final LayerNorm output [B*T, C]
    ce: Any  # the vocab-parallel cross-entropy's context
    shape: tuple[int, ...]  # the head input's shape [B, T, C]


def head_fwd(params: GPT, x: np.ndarray, targets: np.ndarray, cfg: GPTConfig, mesh: Mesh) -> tuple[np.ndarray, HeadCtx]:
    """Final LayerNorm, tied LM head and vocab-parallel cross-entropy: per-token losses [B*T]."""
    xf, lnf_ctx = layernorm_fwd(params.ln_f, x)  # f: identity forward
    xf2 = xf.reshape(-1, xf.shape[-1])
    logits = xf2 @ params.wte.T  # [B*T, V/tp]
    loss, ce_ctx = vocab_parallel_cross_entropy_fwd(logits, targets, cfg.vocab_size, mesh)
    return loss, HeadCtx(lnf_ctx, xf2, ce_ctx, x.shape)


def head_bwd(params: GPT, ctx: HeadCtx, dloss: np.ndarray | float, mesh: Mesh) -> tuple[np.ndarray, np.ndarray, LayerNorm]:
    """(grad of the head's input, grad of wte from the head, grads of ln_f)."""
    dlogits = vocab_parallel_cross_entropy_bwd(ctx.ce, dloss)
    dwte = dlogits.T @ ctx.xf
    dxf = copy_to_tp_bwd(dlogits @ params.wte, mesh).reshape(ctx.shape)
    dx, d_lnf = layernorm_bwd(params.ln_f, ctx.ln_f, dxf)
    return dx, dwte, d_lnf
