"""The model: its config (an architecture's parts as data), parameter tree, specs and init.

One code path serves every kind: a config names its parts (the norm, the positions, the
MLP, the key/value heads, a tied or untied head) and the tree holds the leaves those parts
need; `ARCHS` names the kinds (GPT-2's parts, Llama's). docs/design.md says where a third
kind's part goes.

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
from typing import Any

import attrs
import numpy as np

from numesh.base.errors import ConfigError, check_scalar, field_type
from numesh.base.padding import padded_vocab
from numesh.base.tree import tree_map, tree_map_with_path
from numesh.host.kernels import float_dtype
from numesh.mesh import Mesh, P, shard
from numesh.nn.layers import LN_EPS, LayerNorm, Linear, RMSNorm
from numesh.nn.moe import MoE, MoEConfig

NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rotary")
MLPS = ("gelu", "swiglu")

# The kinds: each a set of part values (`numesh train --arch NAME`; an option given
# explicitly wins over its kind's value). GPT-2: LayerNorm, learned positions, a GELU MLP,
# the LM head tied to the embedding. Llama: RMSNorm, rotary positions, SwiGLU, an untied head.
ARCHS: dict[str, dict[str, object]] = {
    "gpt2": dict(norm="layernorm", positions="learned", mlp="gelu", tie_embeddings=True),
    "llama": dict(norm="rmsnorm", positions="rotary", mlp="swiglu", tie_embeddings=False),
}


def check_tp(tp: Any) -> int:
    """`tp` unless it is no tensor-parallel size (an integer >= 1; no bool), then a one-line
    ConfigError: what splitting or padding over tp asks first (-1 and 2.5 padded nothing)."""
    if check_scalar("tp", tp, int) < 1:
        raise ConfigError(f"tp must be >= 1, got {tp}")
    return tp


def swiglu_hidden(n_embd: int) -> int:
    """SwiGLU's default hidden size: 8C/3 (the GELU MLP's 4C parameters in three matrices, as
    Llama sizes it) rounded up to a multiple of 32."""
    return -(-(8 * n_embd // 3) // 32) * 32




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
        norm: "layernorm" (GPT-2) or "rmsnorm" (Llama), before attention, the MLP and the head.
        norm_eps: the norm's epsilon (LayerNorm's is fixed at `LN_EPS` by its fused kernel).
        positions: "learned" (a `wpe` table of block_size rows) or "rotary" (RoPE on q and k,
            transformers' rotate-half layout, `numesh.nn.rotary`).
        rope_theta: the rotary base.
        mlp: "gelu" (fc, GELU, proj) or "swiglu" (silu(gate) * up, then proj), also each
            expert's MLP in an MoE block.
        ffn_hidden: the MLP's hidden size F; 0 = 4C for GELU, `swiglu_hidden(C)` for SwiGLU.
        n_kv_head: key/value heads (grouped-query attention: each serves n_head / n_kv_head
            query heads); 0 = n_head. With fewer than n_head, q, k and v are separate Linears.
        tie_embeddings: the LM head is the token embedding (else its own vocab-parallel `lm_head`).
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
    norm: str = "layernorm"
    norm_eps: float = LN_EPS
    positions: str = "learned"
    rope_theta: float = 10000.0
    mlp: str = "gelu"
    ffn_hidden: int = 0
    n_kv_head: int = 0
    tie_embeddings: bool = True

    @property
    def kv_heads(self) -> int:
        """Key/value heads (n_head without grouped-query attention)."""
        return self.n_kv_head or self.n_head

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    @property
    def hidden(self) -> int:
        """The MLP's (and each expert's) hidden size F."""
        if self.ffn_hidden:
            return self.ffn_hidden
        return 4 * self.n_embd if self.mlp == "gelu" else swiglu_hidden(self.n_embd)

    @property
    def fused_qkv(self) -> bool:
        """q, k and v in one Linear [C, 3, C] (every head its own k and v), else three."""
        return self.kv_heads == self.n_head

    def moe(self, layer: int) -> MoEConfig | None:
        """Block `layer`'s MoE settings, or None where its MLP is dense."""
        if self.moe_experts == 0 or layer % self.moe_every:
            return None
        return MoEConfig(self.moe_experts, self.moe_top_k, self.moe_aux_coef, self.moe_z_coef,
                         self.moe_capacity_factor, gated=self.mlp == "swiglu")

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
        return padded_vocab(self.vocab_size, check_tp(tp))

    def validate(self, tp: int = 1) -> None:
        """Raise ConfigError if this model cannot run with tensor-parallel size `tp`."""
        self._validate_types(tp)
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}: change one of them")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        self._validate_parts()
        problem = self.tp_problem(tp)
        if problem is not None:
            raise ConfigError(": ".join(problem))
        self._validate_moe(tp)

    def _validate_types(self, tp: Any) -> None:
        """Each field of its annotated type (`check_scalar`: an int is a Python or NumPy
        integer, no bool; a float is finite; a bool is True or False), and `tp` an integer
        >= 1: checked first, so that a range or divisibility check below names the right field."""
        for f in attrs.fields(GPTConfig):
            check_scalar(f.name, getattr(self, f.name), field_type(f))
        check_tp(tp)

    def tp_problem(self, tp: int) -> tuple[str, str] | None:
        """Why the heads or the MLP do not split over tensor-parallel size `tp`, and what a
        training run changes, (why, fix), or None: a command that cannot change the model
        (sample, reshard) says its own fix after the why, naming `tp_sizes`."""
        kv = self.kv_heads
        if self.n_head % tp:
            return f"n_head={self.n_head} is not divisible by tp={tp}", "use a tp that divides the heads"
        if kv % tp and tp % kv:
            return (f"tp={tp} splits the {kv} kv heads' query groups across ranks",
                    f"use a tp that divides n_kv_head={kv} or a multiple of it that divides n_head={self.n_head}")
        if self.hidden % tp:
            return (f"the MLP's hidden size {self.hidden} is not divisible by tp={tp}",
                    "use a tp that divides it or set --ffn-hidden")
        return None

    def check_tp_of_fixed_model(self, tp: int, fix: str) -> None:
        """A ConfigError where the model does not split over `tp` for a command that cannot
        change the model (sample, reshard): the why, then `fix` with the tp sizes that do
        in its `{sizes}`."""
        problem = self.tp_problem(tp)
        if problem is not None:
            raise ConfigError(f"{problem[0]}: {fix.format(sizes=self.tp_sizes())}")

    def tp_sizes(self) -> str:
        """The tensor-parallel sizes this model splits over, in words ("1, 2 or 4"): tp
        divides n_head, so none is larger."""
        sizes = [str(tp) for tp in range(1, self.n_head + 1) if self.tp_problem(tp) is None]
        return sizes[0] if len(sizes) == 1 else f"{', '.join(sizes[:-1])} or {sizes[-1]}"

    def _validate_parts(self) -> None:
        """The architecture's parts (norm, positions, MLP, kv heads)."""
        for name, allowed in (("norm", NORMS), ("positions", POSITIONS), ("mlp", MLPS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"--{name} must be one of {', '.join(allowed)}, got '{getattr(self, name)}'")
        if not self.norm_eps > 0:
            raise ConfigError(f"norm_eps must be > 0, got {self.norm_eps}")
        if self.norm == "layernorm" and self.norm_eps != LN_EPS:
            raise ConfigError(f"LayerNorm's epsilon is {LN_EPS} (fixed in its fused kernel), got --norm-eps "
                              f"{self.norm_eps}: keep {LN_EPS} or use --norm rmsnorm")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.positions == "rotary" and self.head_size % 2:
            raise ConfigError(f"rotary positions rotate pairs: the head size n_embd/n_head={self.head_size} must "
                              "be even")
        if self.ffn_hidden < 0:
            raise ConfigError(f"ffn_hidden must be >= 0 (0 = the MLP's default), got {self.ffn_hidden}")
        if self.n_kv_head < 0 or self.n_head % self.kv_heads:
            raise ConfigError(f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head} "
                              "(each kv head serves a group of query heads; 0 = n_head)")

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
            default = " (the default): give at least 2 experts or moe_top_k 1" if self.moe_top_k == 2 else ""
            raise ConfigError(f"moe_top_k must be between 1 and moe_experts={self.moe_experts}, got {self.moe_top_k}"
                              + default)


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
class GQAttention:
    """Grouped-query attention's parameters: n_head query heads, n_kv_head key/value heads.

    Attributes:
        q: w [C, n_head*hs], column-parallel: each tp rank owns whole query heads.
        k: w [C, n_kv_head*hs], replicated over tp: each rank computes only the kv heads its
            query heads read, and the ranks' gradients (zero off those heads) are summed over
            tp (`tp_partial`). One spec for every tp, so a checkpoint reshards to any tp, and
            tp may exceed n_kv_head.
        v: w [C, n_kv_head*hs], as k.
        proj: w [C, C], row-parallel.
    """

    q: Linear
    k: Linear
    v: Linear
    proj: Linear


@attrs.frozen
class MLP:
    """The dense MLP's parameters, split over tp as Megatron does: proj(act(fc(x))) with
    GELU, or proj(silu(gate(x)) * fc(x)) with SwiGLU (fc is then Llama's up_proj).

    Attributes:
        fc: w [C, F], column-parallel.
        proj: w [F, C], row-parallel.
        gate: w [C, F], column-parallel (SwiGLU only, else None): kept apart from fc so a
            checkpoint reshards to any tp.
    """

    fc: Linear
    proj: Linear
    gate: Linear | None = None


@attrs.frozen
class Block:
    """One pre-norm transformer block: x + attn(ln1(x)), then + mlp(ln2(x)).

    Attributes:
        ln1: the norm before attention.
        attn: the attention's Linears (fused QKV, or GQA's separate q, k, v).
        ln2: the norm before the MLP.
        mlp: a dense `MLP`, or an `MoE` in the blocks `GPTConfig.moe` names.
    """

    ln1: LayerNorm | RMSNorm
    attn: Attention | GQAttention
    ln2: LayerNorm | RMSNorm
    mlp: MLP | MoE


@attrs.frozen
class GPT:
    """The whole model's parameter tree (or its gradients, specs or shapes: every tree of
    the model has this structure). On a mesh its leaves are this rank's shards; a pipeline
    rank's tree keeps its own blocks and None for the parts it does not hold
    (`numesh.pipeline.stages.stage_tree`).

    Attributes:
        wte: [V_padded, C] token embedding, vocab-parallel over tp; the LM head too when tied.
        wpe: [block_size, C] position embedding; None with rotary positions.
        blocks: the transformer blocks, in order.
        ln_f: the final norm before the LM head.
        lm_head: [V_padded, C] the untied LM head, vocab-parallel over tp; None when tied.
    """

    wte: np.ndarray
    wpe: np.ndarray | None
    blocks: tuple[Block, ...]
    ln_f: LayerNorm | RMSNorm
    lm_head: np.ndarray | None = None


# The outer unit: every part of the model but its blocks, and which pipeline stage holds
# each ("first": beside the embedding, "last": beside the loss; a tied wte is on both, its
# two gradients summed over pp, an untied one only on the first). A new outer part is one
# entry here: stage trees, their gathering and the sum of stage gradients follow it.
OUTER_STAGES: dict[str, tuple[str, ...]] = {"wte": ("first", "last"), "wpe": ("first",), "ln_f": ("last",),
                                            "lm_head": ("last",)}


def outer_parts() -> tuple[str, ...]:
    """The names of the outer unit's parts, in the tree's order."""
    return tuple(f.name for f in attrs.fields(GPT) if f.name != "blocks")


def empty_outer() -> GPT:
    """A GPT tree with no blocks and None for every outer part: a stage's share of the outer
    unit's gradients before it has any."""
    return GPT(blocks=(), **{name: None for name in outer_parts()})


def outer_held(name: str, first: bool, last: bool, tied: bool = True) -> bool:
    """Whether a pipeline stage (the first, the last, or both) holds outer part `name`;
    `tied`: the model's LM head is its wte (the last stage then holds wte too)."""
    stages = OUTER_STAGES[name]
    if name == "wte" and not tied:
        stages = ("first",)
    return (first and "first" in stages) or (last and "last" in stages)


def is_tied(tree: GPT) -> bool:
    """Whether a whole-model tree (params, specs, shapes) ties its LM head to wte."""
    return tree.lm_head is None


class _Leaf:
    """How one parameter is laid out and initialised (a tree leaf, not a node)."""

    __slots__ = ("init", "shape", "spec")

    def __init__(self, init: str, shape: tuple[int, ...], spec: P):
        self.init, self.shape, self.spec = init, shape, spec


def _layout(cfg: GPTConfig, tp: int) -> GPT:
    C, H = cfg.n_embd, cfg.hidden
    col, row = P(None, "tp"), P("tp", None)
    gated = cfg.mlp == "swiglu"

    def lin(init: str, shape: tuple[int, ...], spec: P, bshape: tuple[int, ...], bspec: P) -> Linear:
        return Linear(_Leaf(init, shape, spec), _Leaf("zeros", bshape, bspec) if cfg.bias else None)

    def norm() -> LayerNorm | RMSNorm:
        if cfg.norm == "rmsnorm":
            return RMSNorm(_Leaf("ones", (C,), P()))
        return LayerNorm(_Leaf("ones", (C,), P()), _Leaf("zeros", (C,), P()) if cfg.bias else None)

    def mlp(layer: int) -> MLP | MoE:
        if (moe := cfg.moe(layer)) is None:
            return MLP(fc=lin("normal", (C, H), col, (H,), P("tp")), proj=lin("residual", (H, C), row, (C,), P()),
                       gate=lin("normal", (C, H), col, (H,), P("tp")) if gated else None)
        # ep rank r holds experts r*E/ep ... (r+1)*E/ep - 1, each tp-split like the dense MLP
        # (column- then row-parallel); the router is replicated. Checkpoints hold whole
        # [E, ...] arrays, whatever the mesh
        E = moe.experts
        expert_in = P("ep", None, "tp"), (E, H), P("ep", "tp")
        return MoE(router=Linear(_Leaf("normal", (C, E), P())),
                   fc=lin("normal", (E, C, H), *expert_in),
                   proj=lin("residual", (E, H, C), P("ep", "tp", None), (E, C), P("ep", None)),
                   gate=lin("normal", (E, C, H), *expert_in) if gated else None)

    def attention() -> Attention | GQAttention:
        proj = lin("residual", (C, C), row, (C,), P())
        if cfg.fused_qkv:
            return Attention(qkv=lin("normal", (C, 3, C), P(None, None, "tp"), (3, C), P(None, "tp")), proj=proj)
        kv = cfg.kv_heads * cfg.head_size  # k and v replicated over tp (`GQAttention`)
        return GQAttention(q=lin("normal", (C, C), col, (C,), P("tp")), k=lin("normal", (C, kv), P(), (kv,), P()),
                           v=lin("normal", (C, kv), P(), (kv,), P()), proj=proj)

    def block(layer: int) -> Block:
        return Block(ln1=norm(), attn=attention(), ln2=norm(), mlp=mlp(layer))

    vocab = _Leaf("embedding", (cfg.padded_vocab(tp), C), P("tp", None))
    return GPT(
        wte=vocab,
        wpe=_Leaf("normal", (cfg.block_size, C), P()) if cfg.positions == "learned" else None,
        blocks=tuple(block(i) for i in range(cfg.n_layer)),
        ln_f=norm(),
        lm_head=None if cfg.tie_embeddings else vocab,
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
    """This rank's shards of the mesh-independent initial parameters, in `dtype` (float32
    or float64)."""
    cfg.validate(mesh.size("tp"))
    if check_scalar("seed", seed, int) < 0:  # np.random's seeds are >= 0; "1" and None were not refused as such
        raise ConfigError(f"seed must be >= 0, got {seed}")
    dtype = float_dtype(dtype)
    return tree_map_with_path(
        lambda path, leaf: shard(global_init(cfg, seed, path, leaf.init, leaf.shape, dtype), leaf.spec, mesh),
        _layout(cfg, mesh.size("tp")),
    )
