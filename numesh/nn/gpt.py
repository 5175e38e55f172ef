"""The GPT model (nanoGPT's architecture): its config, parameter tree, specs and init.

Parameters are stored as this rank's shards of the global arrays; `gpt_specs` says how.
The forward and backward math is in `numesh.nn.transformer`, the walk over a pipeline
stage (pp=1: the whole model) in `numesh.nn.walk`, cached inference in `numesh.nn.decode`.
Tensor parallelism follows Megatron: QKV and MLP-up are column-parallel, attention-out
and MLP-down row-parallel, heads split over tp, the tied embedding/LM head split over the
vocabulary. On tp=1 every tp collective is the identity, so this is also the serial model.
"""

from __future__ import annotations

import math
import zlib

import attrs
import numpy as np

from numesh.base.errors import ConfigError
from numesh.base.padding import padded_vocab
from numesh.base.tree import tree_map, tree_map_with_path
from numesh.mesh import Mesh, P, shard
from numesh.nn.layers import LayerNorm, Linear
from numesh.nn.moe import MoE, MoEConfig


@attrs.frozen
class GPTConfig:
    """The model's shape, nanoGPT's fields plus the mixture of experts: all that the
    parameter tree, its specs and the math need, and nothing of the mesh (so one config
    serves every layout; `validate(tp)` says whether a tp fits it).

    Attributes:
        vocab_size: tokens in the vocabulary (the embedding is padded to a multiple of tp).
        block_size: the longest sequence, in tokens (rows of `wpe`).
        n_layer: transformer blocks.
        n_head: attention heads (tp splits them, so tp must divide them).
        n_embd: the residual stream's width C (a multiple of `n_head`).
        dropout: dropout probability on the embedding, the attention probabilities and each
            block's attention and MLP outputs (`numesh.nn.dropout.Site`).
        bias: biases in every Linear and LayerNorm (GPT-2 has them; nanoGPT's default not).
        moe_experts: E expert MLPs in each MoE block (`numesh.nn.moe`); 0 = every block dense.
        moe_every: block i has experts when i % moe_every == 0 (Megatron's layer frequency).
        moe_top_k: experts per token.
        moe_aux_coef: the load-balancing loss's coefficient.
        moe_z_coef: the router z-loss's coefficient.
        moe_capacity_factor: each expert's capacity per sequence; 0 = dropless.
    """

    vocab_size: int = 65
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False
    moe_experts: int = 0
    moe_every: int = 1
    moe_top_k: int = 2
    moe_aux_coef: float = 1e-2
    moe_z_coef: float = 0.0
    moe_capacity_factor: float = 0.0

    def moe(self, layer: int) -> MoEConfig | None:
        """Block `layer`'s MoE settings, or None where its MLP is dense."""
        if self.moe_experts == 0 or layer % self.moe_every:
            return None
        return MoEConfig(self.moe_experts, self.moe_top_k, self.moe_aux_coef, self.moe_z_coef,
                         self.moe_capacity_factor)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The blocks with experts, in order."""
        return tuple(i for i in range(self.n_layer) if self.moe(i) is not None)

    @property
    def moe_blocks(self) -> int:
        """How many blocks have experts."""
        return len(self.moe_layers)

    def padded_vocab(self, tp: int) -> int:
        """The vocabulary rounded up to a multiple of tp (padding rows never get probability)."""
        return padded_vocab(self.vocab_size, tp)

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
        self._validate_moe(tp)

    def _validate_moe(self, tp: int) -> None:
        """The mixture-of-experts settings."""
        if self.moe_experts < 0:
            raise ConfigError(f"moe_experts must be >= 0 (0 = dense), got {self.moe_experts}")
        if self.moe_every < 1:
            raise ConfigError(f"moe_every must be >= 1, got {self.moe_every}")
        for name in ("moe_aux_coef", "moe_z_coef"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.moe_capacity_factor < math.inf:
            raise ConfigError(
                f"moe_capacity_factor must be finite and >= 0 (0 = dropless), got {self.moe_capacity_factor}")
        if self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts:
            raise ConfigError(f"moe_top_k must be between 1 and moe_experts={self.moe_experts}, got {self.moe_top_k}")


@attrs.frozen
class Attention:
    """Causal self-attention's parameters, laid out as Megatron splits them over tp (the
    specs are `gpt_specs`'s): q, k and v in one Linear so that one GEMM computes them.

    Attributes:
        qkv: w [C, 3, C], column-parallel: each tp rank owns whole heads of q, k and v.
        proj: w [C, C], row-parallel: each tp rank's output is a partial sum over tp.
    """

    qkv: Linear
    proj: Linear


@attrs.frozen
class MLP:
    """The dense MLP's parameters (GELU between two Linears), split over tp as Megatron does.

    Attributes:
        fc: w [C, 4C], column-parallel.
        proj: w [4C, C], row-parallel.
    """

    fc: Linear
    proj: Linear


@attrs.frozen
class Block:
    """One pre-LayerNorm transformer block: x + attn(ln1(x)), then + mlp(ln2(x)).

    Attributes:
        ln1: the LayerNorm before attention.
        attn: the attention's Linears.
        ln2: the LayerNorm before the MLP.
        mlp: a dense `MLP`, or an `MoE` in the blocks `GPTConfig.moe` names.
    """

    ln1: LayerNorm
    attn: Attention
    ln2: LayerNorm
    mlp: MLP | MoE


@attrs.frozen
class GPT:
    """The whole model's parameter tree (or its gradients, specs or shapes: every tree of
    the model has this structure). On a mesh its leaves are this rank's shards; a pipeline
    rank's tree keeps its own blocks and None for the parts it does not hold
    (`numesh.pipeline.stages.stage_tree`).

    Attributes:
        wte: [V_padded, C] token embedding, vocab-parallel over tp; tied to the LM head.
        wpe: [block_size, C] position embedding.
        blocks: the transformer blocks, in order.
        ln_f: the final LayerNorm before the LM head.
    """

    wte: np.ndarray
    wpe: np.ndarray
    blocks: tuple[Block, ...]
    ln_f: LayerNorm


# The outer unit: every part of the model but its blocks, and which pipeline stage holds
# each ("first": beside the embedding, "last": beside the loss; the tied wte is on both, its
# two gradients summed over pp). A new outer part (an untied LM head, say) is one entry
# here: stage trees, their gathering and the sum of stage gradients follow it.
OUTER_STAGES: dict[str, tuple[str, ...]] = {"wte": ("first", "last"), "wpe": ("first",), "ln_f": ("last",)}


def outer_parts() -> tuple[str, ...]:
    """The names of the outer unit's parts, in the tree's order."""
    return tuple(f.name for f in attrs.fields(GPT) if f.name != "blocks")


def empty_outer() -> GPT:
    """A GPT tree with no blocks and None for every outer part: a stage's share of the outer
    unit's gradients before it has any."""
    return GPT(blocks=(), **{name: None for name in outer_parts()})


def outer_held(name: str, first: bool, last: bool) -> bool:
    """Whether a pipeline stage (the first, the last, or both) holds outer part `name`."""
    stages = OUTER_STAGES[name]
    return (first and "first" in stages) or (last and "last" in stages)


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

    def mlp(layer: int) -> MLP | MoE:
        if (moe := cfg.moe(layer)) is None:
            return MLP(fc=lin("normal", (C, H), col, (H,), P("tp")), proj=lin("residual", (H, C), row, (C,), P()))
        # ep rank r holds experts r*E/ep ... (r+1)*E/ep - 1, each tp-split like the dense MLP
        # (column- then row-parallel); the router is replicated. Checkpoints hold whole
        # [E, ...] arrays, whatever the mesh
        E = moe.experts
        return MoE(router=Linear(_Leaf("normal", (C, E), P())),
                   fc=lin("normal", (E, C, H), P("ep", None, "tp"), (E, H), P("ep", "tp")),
                   proj=lin("residual", (E, H, C), P("ep", "tp", None), (E, C), P("ep", None)))

    def block(layer: int) -> Block:
        return Block(
            ln1=ln(),
            attn=Attention(
                qkv=lin("normal", (C, 3, C), P(None, None, "tp"), (3, C), P(None, "tp")),
                proj=lin("residual", (C, C), row, (C,), P()),
            ),
            ln2=ln(),
            mlp=mlp(layer),
        )

    return GPT(
        wte=_Leaf("embedding", (cfg.padded_vocab(tp), C), P("tp", None)),
        wpe=_Leaf("normal", (cfg.block_size, C), P()),
        blocks=tuple(block(i) for i in range(cfg.n_layer)),
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
