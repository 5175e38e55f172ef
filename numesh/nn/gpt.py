"""The GPT model (nanoGPT's architecture), written once for every mesh.

Parameters are stored as this rank's shards of the global arrays; `gpt_specs` says how.
Tensor parallelism follows Megatron: QKV and MLP-up are column-parallel, attention-out
and MLP-down row-parallel, heads split over tp, the tied embedding/LM head split over the
vocabulary. On tp=1 every tp collective is the identity, so this is also the serial model.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, NamedTuple, Protocol
import attrs
import numpy as np

from numesh.mesh import Mesh, P, all_gather, shard
from numesh.nn.layers import (
    LayerNorm,
    Linear,
    causal_attention_bwd,
    causal_attention_fwd,
    dropout_mask,
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
from numesh.threads import over_batch, threads
from numesh.tree import tree_map, tree_map_with_path
from numesh.errors import ConfigError
from numesh.nn.units import OUTER, Unit, join_units


@attrs.frozen
class GPTConfig:
    vocab_size: int = 65
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False

    def padded_vocab(self, tp: int) -> int:
        """The vocabulary rounded up to a multiple of tp (padding rows never get probability)."""
        return -(-self.vocab_size // tp) * tp

    def validate(self, tp: int = 1) -> None:
        """Raise ConfigError if this model cannot run with tensor-parallel size `tp`."""
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}: change one of them")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.n_head % tp:
            raise ConfigError(f"n_head={self.n_head} is not divisible by tp={tp}: use a tp that divides the heads")
        if (4 * self.n_embd) % tp:
            raise ConfigError(f"4*n_embd={4 * self.n_embd} is not divisible by tp={tp}: use a tp that divides it")


@attrs.frozen
class Attention:
    qkv: Linear  # w [C, 3, C]: column-parallel, so each tp rank owns whole heads of q, k and v
    proj: Linear  # w [C, C]: row-parallel


@attrs.frozen
class MLP:
    fc: Linear  # w [C, 4C]: column-parallel
    proj: Linear  # w [4C, C]: row-parallel


@attrs.frozen
class Block:
    ln1: LayerNorm
    attn: Attention
    ln2: LayerNorm
    mlp: MLP


@attrs.frozen
class GPT:
    wte: np.ndarray  # [V_padded, C], vocab-parallel; tied to the LM head
    wpe: np.ndarray  # [block_size, C]
    blocks: tuple[Block, ...]
    ln_f: LayerNorm


class _Leaf:
    """How one parameter is laid out and initialised (a tree leaf, not a node)."""

    __slots__ = ("init", "shape", "spec")

    def __init__(self, init: str, shape: tuple[int, ...], spec: P):
        self.init, self.shape, self.spec = init, shape, spec


def _layout(cfg: GPTConfig, tp: int) -> GPT:
    C, H = cfg.n_embd, 4 * cfg.n_embd
    col, row = P(None, "tp"), P("tp", None)

    def lin(init: str, shape: tuple[int, ...], spec: P, bshape: tuple[int, ...], bspec: P) -> Linear:
        return Linear(_Leaf(init, shape, spec), _Leaf("zeros", bshape, bspec) if cfg.bias else None)

    def ln() -> LayerNorm:
        return LayerNorm(_Leaf("ones", (C,), P()), _Leaf("zeros", (C,), P()) if cfg.bias else None)

    def block() -> Block:
        return Block(
            ln1=ln(),
            attn=Attention(
                qkv=lin("normal", (C, 3, C), P(None, None, "tp"), (3, C), P(None, "tp")),
                proj=lin("residual", (C, C), row, (C,), P()),
            ),
            ln2=ln(),
            mlp=MLP(fc=lin("normal", (C, H), col, (H,), P("tp")), proj=lin("residual", (H, C), row, (C,), P())),
        )

    return GPT(
        wte=_Leaf("embedding", (cfg.padded_vocab(tp), C), P("tp", None)),
        wpe=_Leaf("normal", (cfg.block_size, C), P()),
        blocks=tuple(block() for _ in range(cfg.n_layer)),
        ln_f=ln(),
    )


def gpt_specs(cfg: GPTConfig) -> GPT:
    """The partition spec of every parameter (the same tree shape as the parameters)."""
    return tree_map(lambda leaf: leaf.spec, _layout(cfg, 1))


class Shape(tuple):
    """A shape stored as a tree leaf (a tuple subclass, so trees do not walk into it)."""


def gpt_global_shapes(cfg: GPTConfig, tp: int = 1) -> GPT:
    """The global shape of every parameter (vocabulary padded for `tp`)."""
    return tree_map(lambda leaf: Shape(leaf.shape), _layout(cfg, tp))


def global_init(cfg: GPTConfig, seed: int, path: str, init: str, shape: tuple[int, ...], dtype) -> np.ndarray:
    """A parameter's global value: a function of (seed, path, shape) only, never of the mesh."""
    if init == "zeros":
        return np.zeros(shape, dtype=dtype)
    if init == "ones":
        return np.ones(shape, dtype=dtype)
    rng = np.random.default_rng([seed, zlib.crc32(path.encode())])
    std = 0.02 / math.sqrt(2 * cfg.n_layer) if init == "residual" else 0.02
    if init == "embedding":  # padding rows past the true vocabulary stay zero
        out = np.zeros(shape, dtype=dtype)
        out[: cfg.vocab_size] = rng.standard_normal((cfg.vocab_size, *shape[1:])) * std
        return out
    return (rng.standard_normal(shape) * std).astype(dtype)


def init_gpt(cfg: GPTConfig, mesh: Mesh, seed: int = 0, dtype=np.float32) -> GPT:
    """This rank's shards of the mesh-independent initial parameters."""
    cfg.validate(mesh.size("tp"))
    return tree_map_with_path(
        lambda path, leaf: shard(global_init(cfg, seed, path, leaf.init, leaf.shape, dtype), leaf.spec, mesh),
        _layout(cfg, mesh.size("tp")),
    )


# ---------------------------------------------------------------------------------------
# Dropout that does not depend on the mesh: each site's mask is drawn for the whole
# global batch (and all heads), and every rank keeps its own slice.


@attrs.frozen
class DropoutKey:
    """Identifies the random stream of one micro-batch: rows [row0, row0+rows) of `global_rows`."""

    p: float
    seed: int
    step: int
    row0: int
    global_rows: int

    def mask(self, site: int, rows: int, inner_shape: tuple[int, ...], inner_index: tuple = ()) -> np.ndarray:
        """This micro-batch's slice of site `site`'s mask over [global_rows, *inner_shape]."""
        rng = np.random.default_rng([self.seed, self.step, site])
        full = dropout_mask(rng, (self.global_rows, *inner_shape), self.p, np.float64)
        return full[(slice(self.row0, self.row0 + rows), *inner_index)]


def _heads(cfg: GPTConfig, mesh: Mesh) -> tuple[int, int, slice]:
    n_local = cfg.n_head // mesh.size("tp")
    h0 = mesh.index("tp") * n_local
    return n_local, cfg.n_embd // cfg.n_head, slice(h0, h0 + n_local)


# ---------------------------------------------------------------------------------------
# Forward and backward


def _bias_add(y: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    if b is not None:
        y += b
    return y


def _block_fwd(p: Block, x: np.ndarray, cfg: GPTConfig, mesh: Mesh, layer: int, drop: DropoutKey | None):
    B, T, C = x.shape
    nh, hs, heads = _heads(cfg, mesh)
    h1, ln1_ctx = layernorm_fwd(p.ln1, x)  # f: identity forward
    qkv, _ = linear_fwd(p.attn.qkv, h1)
    qkv = qkv.reshape(B, T, 3, nh, hs).transpose(2, 0, 3, 1, 4)  # [3, B, nh, T, hs]
    att_mask = drop.mask(1 + 3 * layer, B, (cfg.n_head, T, T), (heads,)).astype(x.dtype) if drop else None
    a, att_ctx = causal_attention_fwd(qkv[0], qkv[1], qkv[2], att_mask)
    a = a.transpose(0, 2, 1, 3).reshape(B, T, nh * hs)
    y, _ = linear_fwd(Linear(p.attn.proj.w), a)
    y = _bias_add(reduce_from_tp(y, mesh), p.attn.proj.b)  # g
    if drop:
        y *= drop.mask(2 + 3 * layer, B, (T, C))
    x = x + y
    h2, ln2_ctx = layernorm_fwd(p.ln2, x)
    u, _ = linear_fwd(p.mlp.fc, h2)
    g, gelu_ctx = gelu_fwd(u)
    z, _ = linear_fwd(Linear(p.mlp.proj.w), g)
    z = _bias_add(reduce_from_tp(z, mesh), p.mlp.proj.b)
    if drop:
        z *= drop.mask(3 + 3 * layer, B, (T, C))
    x += z
    # residual dropout masks are redrawn from the key in backward rather than stored
    return x, (ln1_ctx, h1, att_ctx, a, ln2_ctx, h2, gelu_ctx, g, drop, layer)


def _block_bwd_input(p: Block, ctx: tuple, dx: np.ndarray, cfg: GPTConfig, mesh: Mesh) -> tuple[np.ndarray, tuple]:
    ln1_ctx, h1, att_ctx, a, ln2_ctx, h2, gelu_ctx, g, drop, layer = ctx
    B, T, C = dx.shape
    nh, hs, _ = _heads(cfg, mesh)
    # MLP half
    dz = dx if drop is None else dx * drop.mask(3 + 3 * layer, B, (T, C)).astype(dx.dtype)
    du = gelu_bwd(gelu_ctx, linear_bwd_input(p.mlp.proj, dz))
    dh2 = copy_to_tp_bwd(linear_bwd_input(p.mlp.fc, du), mesh)
    dx2, d_ln2 = layernorm_bwd(p.ln2, ln2_ctx, dh2)
    dx = dx + dx2
    # attention half
    dy = dx if drop is None else dx * drop.mask(2 + 3 * layer, B, (T, C)).astype(dx.dtype)
    da = linear_bwd_input(p.attn.proj, dy).reshape(B, T, nh, hs).transpose(0, 2, 1, 3)
    dq, dk, dv = causal_attention_bwd(att_ctx, da)
    dqkv = np.empty((B, T, 3, nh, hs), dtype=dx.dtype)
    dqkv[:, :, 0] = dq.transpose(0, 2, 1, 3)
    dqkv[:, :, 1] = dk.transpose(0, 2, 1, 3)
    dqkv[:, :, 2] = dv.transpose(0, 2, 1, 3)
    dqkv = dqkv.reshape(B, T, 3 * nh * hs)
    dh1 = copy_to_tp_bwd(linear_bwd_input(p.attn.qkv, dqkv), mesh)
    dx1, d_ln1 = layernorm_bwd(p.ln1, ln1_ctx, dh1)
    dx1 += dx  # not in place on dx: it may be `dy`, which the weight half still needs
    return dx1, (d_ln1, d_ln2, (h1, dqkv), (a, dy), (h2, du), (g, dz))


def _block_bwd_weight(p: Block, wctx: tuple) -> Block:
    d_ln1, d_ln2, qkv_io, attn_proj_io, fc_io, mlp_proj_io = wctx

    def row_parallel(lin: Linear, io: tuple[np.ndarray, np.ndarray]) -> Linear:
        # the bias is added after the tp reduction, so its grad is the full upstream grad
        x, dy = io
        dw = linear_bwd_weight(Linear(lin.w), x, dy).w
        return Linear(dw, None if lin.b is None else dy.reshape(-1, dy.shape[-1]).sum(axis=0))

    return Block(
        ln1=d_ln1,
        attn=Attention(qkv=linear_bwd_weight(p.attn.qkv, *qkv_io), proj=row_parallel(p.attn.proj, attn_proj_io)),
        ln2=d_ln2,
        mlp=MLP(fc=linear_bwd_weight(p.mlp.fc, *fc_io), proj=row_parallel(p.mlp.proj, mlp_proj_io)),
    )


class _Split(NamedTuple):
    """Context of a block run as row chunks, one per thread: each chunk's rows and context."""

    rows: tuple[slice, ...]
    parts: tuple


def _over_parts(fn, n: int) -> list:
    """`fn(i)` for i in range(n), spread over the threads like the chunks they came from."""
    return [y for ys in over_batch(lambda r: [fn(i) for i in range(r.start, r.stop)], n) for y in ys]


def _sum_grads(grads: list[Block]) -> Block:
    """Chunk gradients summed in chunk order (into the first chunk's fresh arrays)."""
    total = grads[0]
    for g in grads[1:]:
        tree_map(lambda a, b: a.__iadd__(b), total, g)
    return total


def block_fwd(p: Block, x: np.ndarray, cfg: GPTConfig, mesh: Mesh, layer: int, drop: DropoutKey | None = None):
    """One transformer block; x [B, T, C] is replicated over tp.

    With several threads and no tp (so no communication inside), the sequences are split
    over the threads and each runs the whole block on its rows (`over_batch`)."""
    if threads() == 1 or mesh.size("tp") > 1 or x.shape[0] == 1:
        return _block_fwd(p, x, cfg, mesh, layer, drop)

    def part(r: slice):
        rows_drop = None if drop is None else attrs.evolve(drop, row0=drop.row0 + r.start)
        return (r, *_block_fwd(p, x[r], cfg, mesh, layer, rows_drop))

    parts = over_batch(part, x.shape[0])
    y = np.concatenate([y for _, y, _ in parts])
    return y, _Split(tuple(r for r, _, _ in parts), tuple(c for _, _, c in parts))


def block_bwd_input(p: Block, ctx: tuple, dx: np.ndarray, cfg: GPTConfig, mesh: Mesh) -> tuple[np.ndarray, tuple]:
    """Input-gradient half of the block's backward (a zero-bubble "B"): (grad of the input,
    what `block_bwd_weight` needs). LayerNorm and bias grads are cheap and done here."""
    if not isinstance(ctx, _Split):
        return _block_bwd_input(p, ctx, dx, cfg, mesh)
    parts = _over_parts(lambda i: _block_bwd_input(p, ctx.parts[i], dx[ctx.rows[i]], cfg, mesh), len(ctx.rows))
    return np.concatenate([d for d, _ in parts]), _Split(ctx.rows, tuple(w for _, w in parts))


def block_bwd_weight(p: Block, wctx: tuple) -> Block:
    """Weight-gradient half of the block's backward (a zero-bubble "W"): the Linear grads."""
    if not isinstance(wctx, _Split):
        return _block_bwd_weight(p, wctx)
    return _sum_grads(_over_parts(lambda i: _block_bwd_weight(p, wctx.parts[i]), len(wctx.rows)))


def _block_bwd(p: Block, ctx: tuple, dx: np.ndarray, cfg: GPTConfig, mesh: Mesh) -> tuple[np.ndarray, Block]:
    dx, wctx = _block_bwd_input(p, ctx, dx, cfg, mesh)
    return dx, _block_bwd_weight(p, wctx)


def block_bwd(p: Block, ctx: tuple, dx: np.ndarray, cfg: GPTConfig, mesh: Mesh) -> tuple[np.ndarray, Block]:
    """Backward of `block_fwd`: (grad of its input, grads of its parameters)."""
    if not isinstance(ctx, _Split):
        return _block_bwd(p, ctx, dx, cfg, mesh)
    parts = _over_parts(lambda i: _block_bwd(p, ctx.parts[i], dx[ctx.rows[i]], cfg, mesh), len(ctx.rows))
    return np.concatenate([d for d, _ in parts]), _sum_grads([g for _, g in parts])


def embed_fwd(params: GPT, idx: np.ndarray, cfg: GPTConfig, mesh: Mesh, drop: DropoutKey | None = None, pos0: int = 0):
    """Token + position embedding of ids [B, T] starting at position `pos0`."""
    T = idx.shape[1]
    if pos0 + T > cfg.block_size:
        raise ConfigError(f"sequence of {pos0 + T} tokens is longer than block_size={cfg.block_size}")
    tok, tok_ctx = vocab_parallel_embedding_fwd(params.wte, idx, mesh)
    x = tok + params.wpe[pos0 : pos0 + T]
    if drop:
        x *= drop.mask(0, x.shape[0], x.shape[1:])
    return x, (tok_ctx, drop, T)


def embed_bwd(params: GPT, ctx: tuple, dx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(grad of wte from the lookup, grad of wpe)."""
    tok_ctx, drop, T = ctx
    if drop:
        dx = dx * drop.mask(0, dx.shape[0], dx.shape[1:]).astype(dx.dtype)
    dwpe = np.zeros_like(params.wpe)
    dwpe[:T] = dx.sum(axis=0)
    return vocab_parallel_embedding_bwd(params.wte, tok_ctx, dx), dwpe


def head_fwd(params: GPT, x: np.ndarray, targets: np.ndarray, cfg: GPTConfig, mesh: Mesh):
    """Final LayerNorm, tied LM head and vocab-parallel cross-entropy: per-token losses [B*T]."""
    xf, lnf_ctx = layernorm_fwd(params.ln_f, x)  # f: identity forward
    xf2 = xf.reshape(-1, xf.shape[-1])
    logits = xf2 @ params.wte.T
    loss, ce_ctx = vocab_parallel_cross_entropy_fwd(logits, targets, cfg.vocab_size, mesh)
    return loss, (lnf_ctx, xf2, ce_ctx, x.shape)


def head_bwd(params: GPT, ctx: tuple, dloss: np.ndarray | float, mesh: Mesh) -> tuple[np.ndarray, np.ndarray, LayerNorm]:
    """(grad of the head's input, grad of wte from the head, grads of ln_f)."""
    lnf_ctx, xf2, ce_ctx, shape = ctx
    dlogits = vocab_parallel_cross_entropy_bwd(ce_ctx, dloss)
    dwte = dlogits.T @ xf2
    dxf = copy_to_tp_bwd(dlogits @ params.wte, mesh).reshape(shape)
    dx, d_lnf = layernorm_bwd(params.ln_f, lnf_ctx, dxf)
    return dx, dwte, d_lnf


class ParamUnits(Protocol):
    """Where the model loop gets each unit's parameters and leaves each unit's gradients.

    Units are `OUTER` (wte, wpe, ln_f: a GPT with no blocks) and `Unit(i)` (block i). `get`
    may gather a unit (ZeRO-3) and `release` free it; `grads_ready` is called once per unit
    as soon as its gradient is final, so its reduction can start during backward."""

    def get(self, unit: Unit) -> Any: ...

    def release(self, unit: Unit) -> None: ...

    def grads_ready(self, unit: Unit, grads: Any) -> None: ...


class ResidentParams:
    """All parameters held on this rank (no ZeRO-3); gradients collected into one tree."""

    def __init__(self, params: GPT):
        self.params = params
        self.grads: dict[Unit, Any] = {}

    def get(self, unit: Unit) -> Any:
        if unit.is_outer:
            return self.params
        return self.params.blocks[unit.block]

    def release(self, unit: Unit) -> None:
        pass

    def grads_ready(self, unit: Unit, grads: Any) -> None:
        self.grads[unit] = grads

    def grad_tree(self) -> GPT:
        return join_units(self.grads)


def run_backward(
    units: ParamUnits,
    idx: np.ndarray,
    targets: np.ndarray,
    cfg: GPTConfig,
    mesh: Mesh,
    loss_scale: float,
    drop: DropoutKey | None = None,
) -> float:
    """Forward and backward of one micro-batch, unit by unit; returns sum of token losses × `loss_scale`.

    Every parameter unit is fetched once for the forward and once for the backward."""
    outer = units.get(OUTER)
    x, emb_ctx = embed_fwd(outer, idx, cfg, mesh, drop)
    ctxs = []
    for layer in range(cfg.n_layer):
        name = Unit(layer)
        x, c = block_fwd(units.get(name), x, cfg, mesh, layer, drop)
        units.release(name)
        ctxs.append(c)
    loss, head_ctx = head_fwd(outer, x, targets, cfg, mesh)
    units.release(OUTER)
    outer = units.get(OUTER)
    dx, dwte_head, d_lnf = head_bwd(outer, head_ctx, loss_scale, mesh)
    for layer in reversed(range(cfg.n_layer)):
        name = Unit(layer)
        dx, grads = block_bwd(units.get(name), ctxs[layer], dx, cfg, mesh)
        units.release(name)
        units.grads_ready(name, grads)
        ctxs[layer] = None
    dwte, dwpe = embed_bwd(outer, emb_ctx, dx)
    units.release(OUTER)
    dwte += dwte_head
    units.grads_ready(OUTER, GPT(wte=dwte, wpe=dwpe, blocks=(), ln_f=d_lnf))
    return float(loss.sum()) * loss_scale


def loss_and_grads(
    params: GPT,
    idx: np.ndarray,
    targets: np.ndarray,
    cfg: GPTConfig,
    mesh: Mesh,
    loss_scale: float,
    drop: DropoutKey | None = None,
) -> tuple[float, GPT]:
    """Sum of per-token losses × `loss_scale`, and its gradient w.r.t. this rank's shards.

    With `loss_scale = 1 / (tokens in the global batch)`, summing the results over
    micro-batches and dp ranks gives the global mean loss and its gradient."""
    units = ResidentParams(params)
    loss = run_backward(units, idx, targets, cfg, mesh, loss_scale, drop)
    return loss, units.grad_tree()


def forward_loss(params: GPT | ParamUnits, idx: np.ndarray, targets: np.ndarray, cfg: GPTConfig, mesh: Mesh) -> np.ndarray:
    """Per-token losses [B*T], forward only (evaluation)."""
    units = ResidentParams(params) if isinstance(params, GPT) else params
    outer = units.get(OUTER)
    x, _ = embed_fwd(outer, idx, cfg, mesh)
    for layer in range(cfg.n_layer):
        x, _ = block_fwd(units.get(Unit(layer)), x, cfg, mesh, layer)
        units.release(Unit(layer))
    loss, _ = head_fwd(outer, x, targets, cfg, mesh)
    units.release(OUTER)
    return loss


# ---------------------------------------------------------------------------------------
# Inference with a KV cache


@attrs.define
class KVCache:
    """Per layer, keys and values [B, n_local_heads, block_size, hs] of the positions seen so far."""

    k: list[np.ndarray]
    v: list[np.ndarray]
    length: int = 0


def new_kv_cache(cfg: GPTConfig, mesh: Mesh, batch: int, dtype) -> KVCache:
    nh, hs, _ = _heads(cfg, mesh)
    shape = (batch, nh, cfg.block_size, hs)
    return KVCache([np.zeros(shape, dtype) for _ in range(cfg.n_layer)], [np.zeros(shape, dtype) for _ in range(cfg.n_layer)])


def _attend_cached(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos0: int) -> np.ndarray:
    """Attention of new queries at positions pos0.. over every cached key up to them."""
    T, S = q.shape[-2], k.shape[-2]
    att = q @ k.swapaxes(-1, -2) / math.sqrt(q.shape[-1])
    visible = np.arange(S)[None, :] <= (pos0 + np.arange(T))[:, None]
    att = np.where(visible, att, -np.inf)
    att -= att.max(axis=-1, keepdims=True)
    np.exp(att, out=att)
    att /= att.sum(axis=-1, keepdims=True)
    return att @ v


def logits_cached(params: GPT, idx: np.ndarray, cache: KVCache, cfg: GPTConfig, mesh: Mesh) -> np.ndarray:
    """Full-vocabulary logits [B, V] of the last of `idx` (new tokens), appending them to the cache."""
    pos0 = cache.length
    x, _ = embed_fwd(params, idx, cfg, mesh, pos0=pos0)
    B, T, C = x.shape
    nh, hs, _ = _heads(cfg, mesh)
    for layer, p in enumerate(params.blocks):
        h1, _ = layernorm_fwd(p.ln1, x)
        qkv, _ = linear_fwd(p.attn.qkv, h1)
        qkv = qkv.reshape(B, T, 3, nh, hs).transpose(2, 0, 3, 1, 4)
        cache.k[layer][:, :, pos0 : pos0 + T] = qkv[1]
        cache.v[layer][:, :, pos0 : pos0 + T] = qkv[2]
        a = _attend_cached(qkv[0], cache.k[layer][:, :, : pos0 + T], cache.v[layer][:, :, : pos0 + T], pos0)
        a = a.transpose(0, 2, 1, 3).reshape(B, T, nh * hs)
        y, _ = linear_fwd(Linear(p.attn.proj.w), a)
        x = x + _bias_add(reduce_from_tp(y, mesh), p.attn.proj.b)
        h2, _ = layernorm_fwd(p.ln2, x)
        g, _ = gelu_fwd(linear_fwd(p.mlp.fc, h2)[0])
        z, _ = linear_fwd(Linear(p.mlp.proj.w), g)
        x = x + _bias_add(reduce_from_tp(z, mesh), p.mlp.proj.b)
    cache.length = pos0 + T
    xf, _ = layernorm_fwd(params.ln_f, x[:, -1])
    local = xf @ params.wte.T
    full = all_gather(local, mesh, "tp", dim=1)
    return full[:, : cfg.vocab_size]


def unpad_vocab(params: GPT, cfg: GPTConfig) -> GPT:
    """Drop the vocabulary padding rows from a gathered (global) parameter tree."""
    return attrs.evolve(params, wte=params.wte[: cfg.vocab_size])
