"""The GPT's pieces as forward/backward pairs: embedding, transformer block, head + loss.

Each `*_fwd` returns (output, a named context) and each backward takes that context. The
block's backward comes in two halves, so a zero-bubble pipeline can defer the second:
`block_bwd_input` (a "B": the input gradient, plus the cheap LayerNorm grads) and
`block_bwd_weight` (a "W": the four Linear weight grads). Tensor parallelism is Megatron's:
the only tp communication is the f/g pair around each half of the block (`copy_to_tp_bwd`,
`reduce_from_tp`) and the vocab-parallel embedding and cross-entropy.

With sequence parallelism (`mesh.sequence_parallel`) the residual stream, LayerNorms and
residual dropout work on this tp rank's sequence slice [B, T/tp, C]; the f/g pair becomes
all-gather before the column-parallel matmuls and reduce-scatter after the row-parallel
ones (numesh/nn/parallel.py), and the head gathers the final LayerNorm before the
vocab-parallel logits. As in Korthikanti et al. (2022), a LayerNorm keeps only its own
slice of x̂ and 1/σ for backward; the gathered output is used by the forward matmul and
dropped, and backward gathers the x̂ slices again for the matmul's weight gradient
(`norm_regather`): one more all-gather of an activation per LayerNorm, the price of
holding every activation of the block 1/tp (keeping the gathered x̂ instead moves exactly
plain tp's bytes but holds 2·B·T·C values per block replicated, which at tp=2 leaves most
of plain tp's activations: compare the block terms of `numesh.perf.formulas.activation_parts`;
`mpirun -n 2 python benchmarks/bench_parallel.py --meshes tp=2 --sequence-parallel` measures
what each rank holds with and without sp). LayerNorm weight and bias gradients are sums
over this rank's tokens only: partial over tp, summed by `reduce_tp_partial` or by
the optimiser (`tp_partial_leaves`).
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs
import numpy as np

from numesh.base.errors import ConfigError
from numesh.base.tree import tree_leaves_with_path
from numesh.host.threads import add_into, matmul, token_sum
from numesh.mesh import Mesh, psum
from numesh.nn.attention import AttnDropout
from numesh.nn.context_parallel import CpSlice
from numesh.nn.dropout import EMBED, DropoutKey, Site
from numesh.nn.gpt import GPT, MLP, Block, GPTConfig
from numesh.nn.layers import (
    Linear,
    gelu_bwd,
    gelu_fwd,
    linear_bwd_input,
    linear_bwd_input_sum,
    linear_bwd_weight,
    linear_fwd,
    linear_fwd_many,
    swiglu_bwd,
    swiglu_fwd,
)
from numesh.nn.moe import MoE, MoECtx, RoutingStats, moe_bwd, moe_fwd
from numesh.nn.parallel import (
    copy_to_tp_bwd,
    gather_from_sequence_parallel_region,
    gather_from_sequence_parallel_region_bwd,
    reduce_from_tp,
    reduce_scatter_to_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region_bwd,
    sequence_slice,
    vocab_parallel_cross_entropy_bwd,
    vocab_parallel_cross_entropy_fwd,
    vocab_parallel_embedding_bwd,
    vocab_parallel_embedding_fwd,
)
from numesh.nn.parts import (
    Norm,
    QKVCtx,
    QKVGrads,
    attention_grads,
    local_heads,
    norm_bwd,
    norm_fwd,
    norm_output,
    qkv_bwd_input,
    qkv_bwd_weight,
    qkv_fwd,
    qkv_grad_buffers,
    rotary_for,
)
from numesh.nn.ring_attention import attention_bwd, attention_fwd


def norm_gather_fwd(p: Norm, x: np.ndarray, eps: float,
                    mesh: Mesh) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """The norm (LayerNorm or RMSNorm), then f: the input [B, T, C] of a column-parallel
    matmul, and the context.

    Plain tp: `norm_fwd`; the context is (xhat, rstd) and the caller keeps the output.
    Sequence parallel (x is [B, T/tp, C]): the LayerNorm on this rank's slice, its
    normalised slice all-gathered (the bytes of gathering the output) and the affine
    applied to the whole sequence. The context is this rank's slice (xhat [B, T/tp, C],
    rstd [B, T/tp, 1]) and the output is not kept: `norm_regather` rebuilds it for the
    weight gradient. Per LayerNorm that keeps B·T/tp·(C + 1) values where plain tp keeps
    2·B·T·C + B·T (xhat and the output)."""
    h, ctx = norm_fwd(p, x, eps)
    if not mesh.sequence_parallel:
        return h, ctx
    return norm_regather(p, ctx, mesh), ctx


def norm_regather(p: Norm, ctx: tuple[np.ndarray, np.ndarray], mesh: Mesh) -> np.ndarray:
    """The sequence-parallel LayerNorm's whole output [B, T, C] again, for a weight
    gradient: its context's x̂ slices all-gathered over tp, the affine applied."""
    return norm_output(p, gather_from_sequence_parallel_region(ctx[0], mesh))


def norm_gather_bwd(p: Norm, ctx: tuple[np.ndarray, np.ndarray], dh: np.ndarray,
                    mesh: Mesh) -> tuple[np.ndarray, Norm]:
    """Backward of `norm_gather_fwd` from the column-parallel matmul's partial input grad
    [B, T, C]: (grad of x, the norm's grads, partial over tp with sp)."""
    if not mesh.sequence_parallel:
        return norm_bwd(p, ctx, copy_to_tp_bwd(dh, mesh))
    return norm_bwd(p, ctx, gather_from_sequence_parallel_region_bwd(dh, mesh))  # dh: [B, T/tp, C]


def reduce_seq(y: np.ndarray, mesh: Mesh) -> np.ndarray:
    """g after a row-parallel matmul: all-reduce, or reduce-scatter to this rank's slice."""
    if mesh.sequence_parallel:
        return reduce_scatter_to_sequence_parallel_region(y, mesh)
    return reduce_from_tp(y, mesh)


def reduce_seq_bwd(dy: np.ndarray, mesh: Mesh) -> np.ndarray:
    """Backward of `reduce_seq`: identity, or the sequence all-gather."""
    return reduce_scatter_to_sequence_parallel_region_bwd(dy, mesh) if mesh.sequence_parallel else dy


def global_seq(mesh: Mesh, t_local: int) -> int:
    """The sequence length when an activation holds `t_local` positions on this rank."""
    return t_local * mesh.size("tp") if mesh.sequence_parallel else t_local


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

    ln1: Any  # norm 1's context: xhat [B, T, C] and rstd [B, T, 1] ([B, T/tp, ...] with sp)
    h1: np.ndarray | None  # norm 1's output = the QKV matmuls' input [B, T, C]; None with sp (regathered)
    qkv: QKVCtx  # the projections' rotary tables and kv columns
    attn: Any  # attention core's context
    a: np.ndarray  # attention output = the out-projection's input [B, T, C/tp]
    ln2: Any
    h2: np.ndarray | None  # norm 2's output = the MLP-up matmul's input [B, T, C]; None with sp
    act: Any  # the MLP activation's context (GELU's or SwiGLU's); None in an MoE block
    g: np.ndarray | None  # the activation's output = the MLP-down matmul's input [B, T, F/tp]; None in an MoE block
    drop: DropoutKey | None
    layer: int
    moe: MoECtx | None = None  # the MoE MLP's context in an MoE block

    @property
    def moe_stats(self) -> RoutingStats | None:
        return None if self.moe is None else self.moe.stats


@attrs.frozen
class LinearIO:
    """A Linear's input and output gradient: all its weight gradient needs."""

    x: np.ndarray
    dy: np.ndarray


@attrs.frozen
class BlockWeightCtx:
    """What `block_bwd_weight` needs: norm grads (done in B) and each Linear's IO."""

    d_ln1: Norm
    d_ln2: Norm
    h1: np.ndarray  # the projections' input [B, T, C]
    qkv: QKVCtx
    dqkv: QKVGrads
    attn_proj: LinearIO
    fc: LinearIO | None  # None in an MoE block
    mlp_proj: LinearIO | None
    d_moe: MoE | None = None  # an MoE block's MLP grads, all computed in B
    gate: LinearIO | None = None  # SwiGLU's gate


def token_positions(mesh: Mesh, t_local: int, pos0: int = 0, gathered: bool = False) -> slice | np.ndarray:
    """Global positions of this rank's `t_local` residual-stream tokens (starting at `pos0`):
    with cp its two chunks of each sequence, with sp this tp rank's slice of those, or all of
    them when `gathered` over the sp slices."""
    t = global_seq(mesh, t_local)  # this rank's tokens of each sequence before any sp split
    seq = slice(0, t) if gathered else sequence_slice(mesh, t_local)
    cp = CpSlice.of(mesh)
    if cp.size == 1:
        return slice(pos0 + seq.start, pos0 + seq.stop)
    return cp.positions(t)[seq] + pos0


def _residual_mask(drop: DropoutKey, site: Site, y: np.ndarray, mesh: Mesh) -> np.ndarray:
    """`site`'s mask for a residual-stream activation y [B, t, C]: the whole sequence's mask
    at this rank's positions (cp chunks, sp slice), so the masks do not depend on the mesh."""
    B, t, C = y.shape
    T = global_seq(mesh, t) * mesh.size("cp")
    return drop.mask(site, B, (T, C), (token_positions(mesh, t),))


def _drop_residual(y: np.ndarray, drop: DropoutKey | None, site: Site, mesh: Mesh) -> np.ndarray:
    """y times `site`'s residual-dropout mask (a new array), or y itself without dropout."""
    if drop is None:
        return y
    return y * _residual_mask(drop, site, y, mesh).astype(y.dtype)


class Attend(Protocol):
    """An attention core for `block_fwd` in place of training's (cached decoding's, in
    numesh/nn/decode.py): block `layer`'s q [B, nh, T, hs], k, v [B, nkv, T, hs] into
    y [B, nh, T, hs]; `pos0` is the position of the first of the T tokens."""

    pos0: int

    def __call__(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, y: np.ndarray) -> Any: ...


def _residual(own: np.ndarray, other: np.ndarray) -> np.ndarray:
    """own + other, into `own` (an array the block itself made) by `add_into`, split over
    the threads, where own is C-contiguous; else a fresh array, as `+` gives. Sequence
    parallelism's reduce-scatter returns [B, T/tp, C] views of a [T/tp, B, C] buffer, and
    what reads the residual stream next wants its rows contiguous."""
    return add_into(own, other) if own.flags.c_contiguous else own + other


def block_fwd(p: Block, x: np.ndarray, cfg: GPTConfig, mesh: Mesh, layer: int,
              drop: DropoutKey | None = None, transient: bool = False,
              attend: Attend | None = None) -> tuple[np.ndarray, BlockCtx]:
    """One transformer block on x [B, T, C], replicated over tp, or with sequence
    parallelism this rank's sequence slice [B, T/tp, C] (with cp, T is this rank's two
    chunks of each sequence and attention runs around the cp ring). A `transient` context
    (full recomputation's rerun, used at once by backward) keeps the gathered norm
    outputs under sp instead of gathering them again. `attend` replaces the attention core
    (decoding over a KV cache: the same block, its context then unused)."""
    B, T = x.shape[0], global_seq(mesh, x.shape[1])
    nh, hs, _ = local_heads(cfg, mesh)
    h1, ln1 = norm_gather_fwd(p.ln1, x, cfg.norm_eps, mesh)  # f: [B, T, C]
    pos0 = 0 if attend is None else attend.pos0
    rot = rotary_for(cfg, token_positions(mesh, x.shape[1], pos0, gathered=True), x.dtype)
    q, k, v, qkv = qkv_fwd(p.attn, h1, cfg, mesh, rot)  # q [B, nh, T, hs], k and v [B, nkv, T, hs]
    a = np.empty((B, T, nh, hs), x.dtype)
    if attend is None:
        attn = attention_fwd(q, k, v, a.transpose(0, 2, 1, 3), attention_dropout(drop, layer, T, cfg, mesh), mesh)
    else:
        attn = attend(layer, q, k, v, a.transpose(0, 2, 1, 3))
    a = a.reshape(B, T, nh * hs)  # [B, T, C/tp], the same memory as attn.y
    y, _ = linear_fwd(Linear(p.attn.proj.w), a)
    y = bias_add(reduce_seq(y, mesh), p.attn.proj.b)  # g: [B, T, C] or [B, T/tp, C]
    if drop:
        y *= _residual_mask(drop, Site("attn_out", layer), y, mesh)
    x = _residual(y, x)  # x is the caller's: not in place on it
    h2, ln2 = norm_gather_fwd(p.ln2, x, cfg.norm_eps, mesh)
    z, act, g, moe = mlp_fwd(p.mlp, h2, cfg, mesh, layer)
    if drop:
        z *= _residual_mask(drop, Site("mlp_out", layer), z, mesh)
    add_into(x, z)
    keep = transient or not mesh.sequence_parallel  # with sp backward gathers them again (norm_regather)
    return x, BlockCtx(ln1, h1 if keep else None, qkv, attn, a, ln2, h2 if keep else None, act, g, drop, layer, moe)


def mlp_fwd(p: MLP | MoE, h2: np.ndarray, cfg: GPTConfig, mesh: Mesh,
            layer: int) -> tuple[np.ndarray, Any, np.ndarray | None, MoECtx | None]:
    """A block's MLP on its norm output h2 [B, T, C]: (output, activation context,
    activation output, MoE context): the dense MLP (column- then row-parallel; GELU, or
    SwiGLU's silu(gate) * up) or, in the blocks `cfg.moe` names, the MoE MLP (its output
    partial over tp as the row-parallel one's)."""
    if (moe_cfg := cfg.moe(layer)) is not None:
        z, moe = moe_fwd(p, h2, moe_cfg, mesh, layer)
        return reduce_seq(z, mesh), None, None, moe
    if p.gate is None:
        g, act = gelu_fwd(linear_fwd(p.fc, h2)[0])  # [B, T, F/tp]
    else:
        u, gate = linear_fwd_many([p.fc, p.gate], h2)  # [B, T, F/tp] each
        g, act = swiglu_fwd(gate, u)
    z, _ = linear_fwd(Linear(p.proj.w), g)
    return bias_add(reduce_seq(z, mesh), p.proj.b), act, g, None


def attention_dropout(drop: DropoutKey | None, layer: int, T: int, cfg: GPTConfig, mesh: Mesh) -> AttnDropout | None:
    """Block `layer`'s attention dropout on this rank's heads (None without dropout), for
    sequences of T tokens here (T·cp in all): a stream the kernel hashes, not a mask."""
    if not drop:
        return None
    _, _, heads = local_heads(cfg, mesh)
    return drop.attention(layer, cfg.n_head, heads, T * mesh.size("cp"))


def block_bwd_input(p: Block, ctx: BlockCtx, dx: np.ndarray, cfg: GPTConfig, mesh: Mesh,
                    loss_scale: float | None = None) -> tuple[np.ndarray, BlockWeightCtx]:
    """Input-gradient half of the block's backward (a zero-bubble "B"): (grad of the input,
    what `block_bwd_weight` needs). LayerNorm and bias grads are cheap and done here.
    `dx` is shaped like the block's input (this rank's sequence slice with sp).
    `loss_scale` (1 / tokens in the global batch) weights an MoE block's router losses."""
    B, T = dx.shape[0], global_seq(mesh, dx.shape[1])
    nh, hs, _ = local_heads(cfg, mesh)
    # MLP half
    dz = reduce_seq_bwd(_drop_residual(dx, ctx.drop, Site("mlp_out", ctx.layer), mesh), mesh)  # [B, T, C]
    du = da = d_moe = None
    if ctx.moe is None:
        dg = linear_bwd_input(p.mlp.proj, dz)  # [B, T, F/tp]
        if p.mlp.gate is None:
            du = gelu_bwd(ctx.act, dg)
            dh2 = linear_bwd_input(p.mlp.fc, du)
        else:
            da, du = swiglu_bwd(ctx.act, dg)
            dh2 = linear_bwd_input_sum([(p.mlp.fc, du), (p.mlp.gate, da)])
    else:  # the experts' and router's weight grads are done here too
        dh2, d_moe = moe_bwd(p.mlp, ctx.moe, dz, cfg.moe(ctx.layer), mesh, loss_scale)
    dx2, d_ln2 = norm_gather_bwd(p.ln2, ctx.ln2, dh2, mesh)  # like dx
    dx = _residual(dx2, dx)  # dx is the caller's: not in place on it
    # attention half
    dy = reduce_seq_bwd(_drop_residual(dx, ctx.drop, Site("attn_out", ctx.layer), mesh), mesh)  # [B, T, C]
    dattn = linear_bwd_input(p.attn.proj, dy).reshape(B, T, nh, hs).transpose(0, 2, 1, 3)  # [B, nh, T, hs]
    views, storage = qkv_grad_buffers(p.attn, (B, T), cfg, mesh, dx.dtype)
    attention_bwd(ctx.attn, dattn, *views, mesh)  # into views [B, n, T, hs]
    dh1, dqkv = qkv_bwd_input(p.attn, ctx.qkv, storage)
    dx1, d_ln1 = norm_gather_bwd(p.ln1, ctx.ln1, dh1, mesh)
    add_into(dx1, dx)  # not in place on dx: it may be `dy`, which the weight half still needs
    h1 = norm_regather(p.ln1, ctx.ln1, mesh) if ctx.h1 is None else ctx.h1  # [B, T, C]
    h2 = norm_regather(p.ln2, ctx.ln2, mesh) if ctx.h2 is None else ctx.h2
    mlp_io = (None, None) if d_moe is not None else (LinearIO(h2, du), LinearIO(ctx.g, dz))
    gate = None if da is None else LinearIO(h2, da)
    io = BlockWeightCtx(d_ln1, d_ln2, h1, ctx.qkv, dqkv, LinearIO(ctx.a, dy), *mlp_io, d_moe, gate)
    return dx1, io


def _row_parallel_grad(lin: Linear, io: LinearIO, into: Linear | None = None) -> Linear:
    """A row-parallel Linear's grads: its bias is added after the tp reduction, so the bias
    grad is the full upstream grad summed over tokens (with sp `io.dy` is the gathered
    [B, T, C], so this sum is over every token and needs no tp reduction). `into`: where
    the weight's GEMM may write (`linear_bwd_weight`'s `out`), or None."""
    dw = linear_bwd_weight(Linear(lin.w), io.x, io.dy, into).w
    if lin.b is None:
        return Linear(dw, None)
    dy2 = io.dy.reshape(-1, io.dy.shape[-1])
    return Linear(dw, token_sum(lambda r: dy2[r].sum(axis=0), dy2.shape[0]))


def block_bwd_weight(p: Block, w: BlockWeightCtx, into: Block | None = None) -> Block:
    """Weight-gradient half of the block's backward (a zero-bubble "W"): the Linear grads.
    `into` (the block's place in the optimiser's gradient buffer, `ParamUnits.grad_slot`):
    where the weights' GEMMs may write instead of into arrays of their own."""
    attn = attention_grads(p.attn, qkv_bwd_weight(p.attn, w.h1, w.qkv, w.dqkv, into and into.attn),
                           _row_parallel_grad(p.attn.proj, w.attn_proj, into and into.attn.proj))
    if w.d_moe is not None:
        mlp = w.d_moe
    else:
        dest = into.mlp if into is not None and isinstance(into.mlp, MLP) else None
        gate = None if w.gate is None else linear_bwd_weight(p.mlp.gate, w.gate.x, w.gate.dy, dest and dest.gate)
        mlp = MLP(fc=linear_bwd_weight(p.mlp.fc, w.fc.x, w.fc.dy, dest and dest.fc),
                  proj=_row_parallel_grad(p.mlp.proj, w.mlp_proj, dest and dest.proj), gate=gate)
    return Block(ln1=w.d_ln1, attn=attn, ln2=w.d_ln2, mlp=mlp)


# ---------------------------------------------------------------------------------------
# embedding and head


@attrs.frozen
class EmbedCtx:
    """What `embed_bwd` needs from `embed_fwd`.

    Attributes:
        tok: the vocab-parallel lookup's context.
        drop: the embedding dropout's key, or None without dropout.
        pos: the positions of the (sp-gathered) tokens in wpe.
    """

    tok: Any
    drop: DropoutKey | None
    pos: slice | np.ndarray


def embed_fwd(params: GPT, idx: np.ndarray, cfg: GPTConfig, mesh: Mesh, drop: DropoutKey | None = None,
              pos0: int = 0) -> tuple[np.ndarray, EmbedCtx]:
    """Token + position embedding of ids [B, T] starting at position `pos0`: x [B, T, C],
    or with sequence parallelism this rank's sequence slice [B, T/tp, C]. With cp, `idx` is
    this rank's two chunks of each sequence, at their own positions."""
    T = idx.shape[1]
    cp = CpSlice.of(mesh)
    if pos0 + T * cp.size > cfg.block_size:
        raise ConfigError(f"sequence of {pos0 + T * cp.size} tokens is longer than block_size={cfg.block_size}")
    tok, tok_ctx = vocab_parallel_embedding_fwd(params.wte, idx, mesh)
    x = tok if params.wpe is None else tok + params.wpe[token_positions(mesh, tok.shape[1], pos0)]
    if drop:
        x *= _residual_mask(drop, EMBED, x, mesh)
    return x, EmbedCtx(tok_ctx, drop, token_positions(mesh, tok.shape[1], pos0, gathered=True))


def embed_bwd(params: GPT, ctx: EmbedCtx, dx: np.ndarray, mesh: Mesh) -> tuple[np.ndarray, np.ndarray | None]:
    """(grad of wte from the lookup, grad of wpe or None with rotary positions). With sp the
    gradient is gathered over the sequence first (the backward of the lookup's
    reduce-scatter), so both are whole."""
    dx = reduce_seq_bwd(_drop_residual(dx, ctx.drop, EMBED, mesh), mesh)  # [B, T, C]
    dwpe = None
    if params.wpe is not None:
        dwpe = np.zeros_like(params.wpe)
        dwpe[ctx.pos] = dx.sum(axis=0)
    return vocab_parallel_embedding_bwd(params.wte, ctx.tok, dx), dwpe


@attrs.frozen
class HeadCtx:
    """What `head_bwd` needs from `head_fwd`.

    Attributes:
        ln_f: the final LayerNorm's context (this rank's sequence slice with sp).
        xf: the final LayerNorm's output [B*T, C]; None with sp (regathered in backward).
        ce: the vocab-parallel cross-entropy's context.
        shape: the head input's shape [B, T, C].
    """

    ln_f: Any
    xf: np.ndarray | None
    ce: Any
    shape: tuple[int, ...]


def head_weight(params: GPT) -> np.ndarray:
    """The LM head's vocab-parallel weight [V/tp, C]: lm_head, or wte when they are tied."""
    return params.wte if params.lm_head is None else params.lm_head


def head_fwd(params: GPT, x: np.ndarray, targets: np.ndarray, cfg: GPTConfig, mesh: Mesh) -> tuple[np.ndarray, HeadCtx]:
    """Final norm, LM head (tied or not) and vocab-parallel cross-entropy: per-token losses
    [B*T]. With sp the norm runs on this rank's slice and is gathered (`norm_gather_fwd`)."""
    xf, lnf_ctx = norm_gather_fwd(params.ln_f, x, cfg.norm_eps, mesh)  # [B, T, C]
    xf2 = xf.reshape(-1, xf.shape[-1])
    logits = matmul(xf2, head_weight(params).T)  # [B*T, V/tp]
    loss, ce_ctx = vocab_parallel_cross_entropy_fwd(logits, targets, cfg.vocab_size, mesh)
    return loss, HeadCtx(lnf_ctx, None if mesh.sequence_parallel else xf2, ce_ctx, xf.shape)


def head_bwd(params: GPT, ctx: HeadCtx, dloss: np.ndarray | float,
             mesh: Mesh) -> tuple[np.ndarray, np.ndarray, Norm]:
    """(grad of the head's input, grad of the head's weight (`head_weight`), grads of ln_f)."""
    dlogits = vocab_parallel_cross_entropy_bwd(ctx.ce, dloss)
    xf = norm_regather(params.ln_f, ctx.ln_f, mesh).reshape(-1, ctx.shape[-1]) if ctx.xf is None else ctx.xf
    dhead = matmul(dlogits.T, xf)
    dx, d_lnf = norm_gather_bwd(params.ln_f, ctx.ln_f, matmul(dlogits, head_weight(params)).reshape(ctx.shape), mesh)
    return dx, dhead, d_lnf


# ---------------------------------------------------------------------------------------
# gradients partial over tp: the norms' under sequence parallelism, GQA's k and v


def tp_partial(path: str, mesh: Mesh) -> bool:
    """Whether the leaf at `path` (in a GPT, a Block, or a unit tree) gets a gradient that
    is partial over tp on `mesh`, to be summed over tp once per step:
    - with sequence parallelism, the norms' weights and biases, which each rank sums over
      its own tokens only;
    - with tp > 1, GQA's k and v (replicated over tp, `GQAttention`), each rank's gradient
      zero off the kv heads its query heads read.
    Every other leaf's gradient is already whole: the Linear and embedding grads are taken
    on gathered [B, T, ...] activations."""
    parts = path.split(".")
    if mesh.sequence_parallel and any(part in ("ln1", "ln2", "ln_f") for part in parts):
        return True
    return mesh.size("tp") > 1 and "attn" in parts[:-1] and parts[parts.index("attn") + 1] in ("k", "v")


def reduce_tp_partial(grads: GPT, mesh: Mesh) -> GPT:
    """`grads` with the `tp_partial` gradients summed over tp (in place; one all-reduce of
    all of them); `grads` unchanged when there are none."""
    parts = [x for path, x in tree_leaves_with_path(grads) if x is not None and tp_partial(path, mesh)]
    if not parts:
        return grads
    flat = psum(np.concatenate([x.reshape(-1) for x in parts]), mesh, "tp", inplace=True)
    i = 0
    for x in parts:
        x.reshape(-1)[...] = flat[i : i + x.size]
        i += x.size
    return grads
