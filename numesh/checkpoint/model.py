"""All the checkpoint layer knows about the GPT: its leaf table, its config in meta.json,
how a pipeline rank's tree maps to global leaf paths, vocabulary padding, and which export
format holds it (`gpt2_differences` for nanoGPT's, `hf_kind` for transformers').

Everything else in numesh/checkpoint works from the `LeafDef` table built here, so the
format, block geometry and metadata parsing are the same for any model.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from numesh.base.errors import CheckpointError
from numesh.base.flags import flag_value
from numesh.base.tree import tree_leaves_with_path, tree_map_with_path
from numesh.checkpoint.format import LeafDef, Meta, full_region
from numesh.nn.gpt import GPT, GPTConfig, check_tp, gpt_global_shapes, gpt_specs
from numesh.pipeline.stages import StageLayout, stage_tree

# model-config keys that change the shape or the meaning of some parameter (dropout and the
# MoE router's settings do not): the norm (LayerNorm's w and b, or RMSNorm's w), the
# positions (a wpe table, or none), the MLP (GELU's fc, or SwiGLU's gate and up), its hidden
# size, the kv heads (one fused qkv, or q, k, v) and a tied or untied LM head
SHAPE_KEYS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "bias", "moe_experts", "moe_every",
              "norm", "positions", "mlp", "ffn_hidden", "n_kv_head", "tie_embeddings")
# keys that change no leaf but the function the weights compute: resuming must keep them too
# (a resume continues the same run, and weights trained under one rotary base, norm epsilon
# or number of experts per token compute another function under another; a run that means
# to change them, as a long-context fine-tune raises rope_theta, starts from the weights,
# not from a resume). The MoE capacity factor is not one: it only drops token-assignments
# while training (sample and the weights' function are dropless), a run-time knob like the
# learning rate or the router losses' coefficients, so a resume may change it.
MATH_KEYS = ("rope_theta", "norm_eps", "moe_top_k")
# keys whose 0 means a size derived from another key (the MLP's from n_embd, the kv heads'
# from n_head): left to 0 on both sides, a difference in them is that other key's
DERIVED = ("ffn_hidden", "n_kv_head")
# leaves whose dim 0 is the vocabulary, padded to a multiple of tp on a mesh (lm_head: the
# untied LM head, absent when tied)
VOCAB_LEAVES = ("wte", "lm_head")


def tied_leaves(model: GPTConfig) -> tuple[str, ...]:
    """Leaves held by both the first and the last pipeline stage (the first one writes them):
    wte when it is also the LM head, none when the head is its own `lm_head`."""
    return ("wte",) if model.tie_embeddings else ()


def model_value(model: GPTConfig, key: str) -> object:
    """What a config key means for the parameters: ffn_hidden and n_kv_head resolved (0 is
    the default, the same tree as that default given), rope_theta only with rotary positions,
    norm_eps only with RMSNorm and moe_top_k and moe_every only with experts (else nothing
    reads them: an older dense run that recorded --moe-every 2 is not asked for an option
    a dense run now refuses)."""
    if key == "ffn_hidden":
        return model.hidden
    if key == "n_kv_head":
        return model.kv_heads
    if (key == "rope_theta" and model.positions != "rotary") or (key == "norm_eps" and model.norm != "rmsnorm") or (
            key in ("moe_top_k", "moe_every") and not model.moe_experts):
        return None
    return getattr(model, key)


def gpt_leaves(model: GPTConfig) -> dict[str, LeafDef]:
    """Global path -> LeafDef of every parameter (unpadded shapes), in tree order."""
    specs = dict(tree_leaves_with_path(gpt_specs(model)))
    return {
        path: LeafDef(shape, specs[path], (0,) if path in VOCAB_LEAVES else ())
        for path, shape in tree_leaves_with_path(gpt_global_shapes(model, 1))
    }


def describe_gpt(raw_model: Any) -> tuple[GPTConfig, dict[str, LeafDef]]:
    """The GPT config in meta.json's "model" entry and its leaf table (the format's `Describe`)."""
    model = GPTConfig(**raw_model)
    model.validate(1)
    return model, gpt_leaves(model)


def check_model(meta: Meta, model: GPTConfig) -> None:
    """Raise if the checkpoint's model has other parameters than `model`, or computes
    another function with them (`SHAPE_KEYS`, `MATH_KEYS`): every difference in one line,
    with the options that resume it."""
    keys = differing_keys(meta.model, model, SHAPE_KEYS + MATH_KEYS)
    if keys:
        have = ", ".join(f"{k}={model_value(meta.model, k)}" for k in keys)
        want = ", ".join(f"{k}={run_value(model, k)}" for k in keys)
        raise CheckpointError(f"{meta.path}: the checkpoint's model has {have} but this run has {want}: resume with "
                              f"the same model config ({model_options(meta.model, keys)})")


def differing_keys(theirs: GPTConfig, model: GPTConfig, keys: Sequence[str]) -> list[str]:
    """The `keys` in which `model` must change to be `theirs`, all of them (one error names
    every option to change, not one per attempt): where their `model_value` differs, a
    derived size left to 0 on both sides apart (that is its source's difference, n_embd's or
    n_head's). A setting of a part only `theirs` has counts at `model`'s option value: a
    Llama checkpoint resumed with GPT-2's options names --rope-theta and --norm-eps with
    --positions and --norm, not in a second refusal once those are fixed. One of a part only
    `model` has is not named: dropping the part (its own key) is the change."""
    return [k for k in keys if model_value(theirs, k) is not None and model_value(theirs, k) != run_value(model, k)
            and not (k in DERIVED and getattr(theirs, k) == getattr(model, k) == 0)]


def run_value(model: GPTConfig, key: str) -> object:
    """`model_value`, or where the model has no part that reads `key` (rope_theta with
    learned positions), the option's value, which that part would read once added."""
    value = model_value(model, key)
    return getattr(model, key) if value is None else value


def model_options(model: GPTConfig, keys: Sequence[str]) -> str:
    """The `numesh train` options that set `keys` to `model`'s values, e.g. "--n-layer 2
    --bias" (the vocabulary is --data's)."""
    return " ".join(_option(k, model_value(model, k)) for k in keys)


def _option(key: str, value: object) -> str:
    """The `numesh train` option that sets a model key to `value` (the vocabulary is --data's)."""
    return f"--data tokenised to {value} entries" if key == "vocab_size" else flag_value(key, value)


def gpt2_differences(model: GPTConfig) -> list[str]:
    """The parts of `model` that GPT-2's layout (nanoGPT's GPT, transformers'
    GPT2LMHeadModel) lacks, in words: empty for the GPT-2 kind. What export and
    `--init-from`, which know only that layout, refuse."""
    out = []
    if model.norm != "layernorm":
        out.append(f"{model.norm} norms")
    if model.positions != "learned":
        out.append(f"{model.positions} positions")
    if model.mlp != "gelu":
        out.append(f"a {model.mlp} MLP")
    elif model.hidden != 4 * model.n_embd:
        out.append(f"an MLP {model.hidden} wide (GPT-2's is 4 x n_embd = {4 * model.n_embd})")
    if model.kv_heads != model.n_head:
        out.append(f"{model.kv_heads} kv heads for {model.n_head} query heads")
    if not model.tie_embeddings:
        out.append("an untied LM head")
    return out


GPT2_PARTS = ("layernorm", "learned", "gelu")  # (norm, positions, mlp) of GPT-2's kind
LLAMA_PARTS = ("rmsnorm", "rotary", "swiglu")  # and of Llama's
# the class each `hf_kind` names, for messages
HF_CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}

# transformers' MoE decoders (Mixtral, Qwen2-MoE, OLMoE, ...) are Llama-shaped: RMSNorm,
# rotary positions and gated SiLU experts (w1, w3, w2). GPT-2's kind with experts has
# LayerNorm, learned positions and GELU experts, and GPT2LMHeadModel has no experts: no class
# transformers ships computes it, and a directory needing custom code is what the export
# avoids. The Llama kind with experts is a Mixtral (`hf_kind`).
MOE_REFUSAL = ("this checkpoint is a mixture of experts ({} experts) and transformers has no model class for it: "
               "its MoE models (Mixtral and kin) use RMSNorm, rotary positions and gated SiLU experts where this "
               "model has LayerNorm, learned positions and GELU experts (a Llama-kind MoE, --arch llama, exports "
               "as MixtralForCausalLM); sample or resume it with numesh instead")


def hf_kind(model: GPTConfig) -> str:
    """The transformers class a numesh model exports to: "gpt2", "llama" or "mixtral"; a
    one-line CheckpointError says what no class of transformers computes, and never offers
    --format hf (the format refusing) nor nanoGPT's, which holds GPT-2's parts only, for a
    model that is not GPT-2's kind in every part and shape."""
    parts = (model.norm, model.positions, model.mlp)
    if parts == GPT2_PARTS:
        if differs := gpt2_differences(model):
            raise CheckpointError(f"transformers' GPT2LMHeadModel, as numesh exports GPT-2's kind, has a tied head, "
                                  f"as many kv heads as heads and an MLP 4 x n_embd wide, and this model has "
                                  f"{', '.join(differs)}: neither export format holds it (nanoGPT's has GPT-2's "
                                  "shapes too); sample or resume it with numesh instead")
        if model.moe_experts:
            raise CheckpointError(MOE_REFUSAL.format(model.moe_experts))
        return "gpt2"
    if parts != LLAMA_PARTS:
        raise CheckpointError(f"this checkpoint's model mixes GPT-2's and Llama's parts (norm {model.norm}, positions "
                              f"{model.positions}, mlp {model.mlp}): no transformers class computes it, and nanoGPT's "
                              "format holds GPT-2's parts only; sample or resume it with numesh instead (what exports "
                              "has GPT-2's parts throughout, layernorm, learned, gelu, or Llama's, rmsnorm, rotary, "
                              "swiglu)")
    if not model.moe_experts:
        return "llama"
    differs = [why for why, bad in (
        (f"experts in one block of every {model.moe_every} (Mixtral has them in every block)", model.moe_every != 1),
        (f"a capacity factor {model.moe_capacity_factor} (Mixtral is dropless)", model.moe_capacity_factor > 0),
        ("biases (Mixtral's Linears have none)", model.bias)) if bad]
    if differs:
        raise CheckpointError(f"this mixture of experts is not a Mixtral: it has {differs[0]}, and nanoGPT's format "
                              "holds no experts; sample or resume it with numesh instead")
    return "mixtral"


# ---------------------------------------------------------------------------------------
# pipeline stages: local trees and global paths


def global_path(local_path: str, owned: Sequence[int]) -> str:
    """The global leaf path of a pipeline rank's local path: local block j is global layer owned[j]."""
    parts = local_path.split(".")
    if parts[0] == "blocks":
        if len(parts) < 2 or not parts[1].isdigit() or int(parts[1]) >= len(owned):
            raise ValueError(f"local path '{local_path}' names no block of the {len(owned)} this rank owns")
        parts[1] = str(owned[int(parts[1])])
    return ".".join(parts)


def global_paths(model: GPTConfig) -> GPT:
    """The whole-model tree whose leaves are their own global paths."""
    return tree_map_with_path(lambda path, _shape: path, gpt_global_shapes(model, 1))


def local_paths(model: GPTConfig, layout: StageLayout, pp_rank: int) -> GPT:
    """The tree a pipeline rank holds (`stage_tree`'s cut), its leaves their global paths."""
    return stage_tree(global_paths(model), layout, pp_rank)


def written_leaves(tree: GPT, model: GPTConfig, layout: StageLayout,
                   pp_rank: int) -> Iterator[tuple[str, np.ndarray]]:
    """(global path, local array) of each leaf of a pipeline rank's tree that this stage
    writes: a tied copy is written by the first stage only."""
    owned, tied = layout.owned(pp_rank), tied_leaves(model)
    for local, x in tree_leaves_with_path(tree):
        path = global_path(local, owned)
        if path in tied and not layout.is_first(pp_rank):
            continue
        yield path, x


# ---------------------------------------------------------------------------------------
# vocabulary padding: the one pad/unpad pair, driven by the leaf table


def _pad_leaf(x: np.ndarray, leaf: LeafDef, sizes: Mapping[str, int]) -> np.ndarray:
    """A whole unpadded leaf zero-padded to the shape a mesh of axis `sizes` holds."""
    shape = leaf.padded_shape(sizes)
    if shape == x.shape:
        return x
    out = np.zeros(shape, dtype=x.dtype)
    out[full_region(x.shape)] = x
    return out


def _unpad_leaf(x: np.ndarray, leaf: LeafDef) -> np.ndarray:
    """A whole padded leaf cut back to its true global shape."""
    return x[full_region(leaf.shape)]


def pad_vocab(params: GPT, model: GPTConfig, tp: int) -> GPT:
    """Whole unpadded parameters padded for tensor-parallel size `tp` (zero rows); a tp that
    is no integer >= 1 is a one-line ConfigError (-1 padded nothing, 2.5 made float shapes)."""
    leaves = gpt_leaves(model)
    sizes = {"pp": 1, "dp": 1, "ep": 1, "cp": 1, "tp": check_tp(tp)}
    return tree_map_with_path(lambda path, x: _pad_leaf(x, leaves[path], sizes), params)


def unpad_vocab(params: GPT, model: GPTConfig) -> GPT:
    """Whole (gathered) parameters with the vocabulary padding rows dropped."""
    leaves = gpt_leaves(model)
    return tree_map_with_path(lambda path, x: _unpad_leaf(x, leaves[path]), params)



def shard_params(params: GPT, model: GPTConfig, mesh: Any) -> GPT:
    """This rank's shards of whole unpadded parameters on `mesh` (vocabulary padded for tp)."""
    from numesh.base.tree import tree_map
    from numesh.mesh import shard

    model.validate(mesh.size("tp"))
    padded = pad_vocab(params, model, mesh.size("tp"))
    return tree_map(lambda x, spec: shard(x, spec, mesh), padded, gpt_specs(model))
