"""numesh's Llama kind as transformers stores it: `LlamaForCausalLM` (and `mistral` without a
sliding window) and `MixtralForCausalLM`, both ways, exactly.

One table says where each numesh leaf lives in transformers' tensors (`pieces`): a leaf is
one or more (tensor name, index into the leaf, transposed?) pieces. transformers keeps a
Linear's weight [out, in], numesh [in, out], so every Linear is transposed; numesh's fused
q/k/v [C, 3, C] (kv heads = heads) is three pieces; numesh stacks the E experts of a MoE
block on dim 0 where Mixtral names each (`w1` = gate, `w3` = up, `w2` = down) and its
router is `block_sparse_moe.gate`. Rotary positions are transformers' rotate-half layout in
both, so no weight is permuted. Import reads the pieces into a leaf (`read_leaf`), export
cuts a leaf into them (`to_llama`): the same table, so export then import gives the same bits.

`pretrained` reads config.json into the model options it fixes (the run's `--n-layer` and
the rest) and refuses, in one line each, what numesh's Llama does not compute.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import numpy as np

from numesh.base.errors import CheckpointError
from numesh.base.tree import tree_leaves_with_path
from numesh.checkpoint.format import META_FILE, MODEL_TYPES, run_checkpoints
from numesh.checkpoint.hf_files import TensorInfo, Weights, read_json_file, weight_files
from numesh.nn.gpt import GPTConfig, gpt_global_shapes, swiglu_hidden

# transformers' defaults where config.json leaves a key out (each class's own)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=2048),
    "mistral": dict(rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, sliding_window=4096,
                    max_position_embeddings=4096 * 32),
    "mixtral": dict(rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=4096 * 32,
                    num_local_experts=8, num_experts_per_tok=2),
}
# the model options a pretrained directory fixes, and the option that sets each
OPTIONS = {"arch": "--arch", "n_layer": "--n-layer", "n_head": "--n-head", "n_embd": "--n-embd",
           "n_kv_head": "--n-kv-head", "ffn_hidden": "--ffn-hidden", "rope_theta": "--rope-theta",
           "norm_eps": "--norm-eps", "tie_embeddings": "--tie-embeddings / --no-tie-embeddings",
           "bias": "--bias / --no-bias", "norm": "--norm", "positions": "--positions", "mlp": "--mlp",
           "moe_experts": "--moe-experts", "moe_top_k": "--moe-top-k", "moe_every": "--moe-every"}
_IGNORED = ("rotary_emb.inv_freq",)  # buffers older transformers saved beside the weights


@attrs.frozen
class Pretrained:
    """What a transformers directory's config.json says of its model.

    Attributes:
        model_type: llama, mistral or mixtral.
        options: the `TrainConfig` (and `GPTConfig`) values it fixes, by field name.
        vocab_size: its embedding's rows: its tokenizer's entries or more (a padded vocabulary).
        max_positions: max_position_embeddings, the longest --block-size it allows.
        eos_token_id: the end-of-sequence token's id, or None.
    """

    model_type: str
    options: dict[str, Any]
    vocab_size: int
    max_positions: int
    eos_token_id: int | None

    def model(self, block_size: int) -> GPTConfig:
        """The numesh model of this directory at context `block_size`."""
        fields = {f.name for f in attrs.fields(GPTConfig)}
        return GPTConfig(vocab_size=self.vocab_size, block_size=block_size,
                         **{k: v for k, v in self.options.items() if k in fields})


def is_pretrained_dir(path: str | Path) -> bool:
    """Whether `path` is a transformers directory (its config.json) rather than a numesh
    checkpoint (its meta.json) or file."""
    p = Path(path)  # a run's directory (train --out) has a config.json and its ckpt/: not a model's
    return p.is_dir() and (p / "config.json").exists() and not (p / "meta.json").exists() \
        and not run_checkpoints(p)


def check_has_config(path: str | Path) -> None:
    """One line where `path` is a directory of model weights without config.json and
    without what a numesh checkpoint or run has (a copy of a transformers model that left
    config.json out): taken for a numesh checkpoint, it was said to lack meta.json."""
    p = Path(path)
    if not p.is_dir() or (p / "config.json").exists() or (p / META_FILE).exists() or run_checkpoints(p):
        return
    try:
        named, other = weight_files(p), sorted(p.glob("*.safetensors"))
    except OSError:  # unreadable: reading it says so
        return
    fix = "copy config.json there from the model's source (save_pretrained writes it)"
    if named:
        raise CheckpointError(f"{p} has {named[0].name} but no config.json, which a transformers directory needs "
                              f"beside its weights: {fix}")
    if other:  # no name transformers saves: perhaps a `numesh export` file, which is passed itself
        raise CheckpointError(f"{p} has {other[0].name} but no config.json: pass the file itself if it is a "
                              f"`numesh export` file, else {fix}")


def model_type(directory: Path) -> str:
    """config.json's model_type ("" when it names none)."""
    cfg = read_json_file(directory / "config.json", "a transformers directory needs one (save_pretrained writes it)")
    return str(cfg.get("model_type", ""))


def _rope_kind(section: Any) -> str:
    """The rope_type of a rope_scaling or rope_parameters entry ("default" when it has none)."""
    if not section:
        return "default"
    if not isinstance(section, dict):
        return "?"
    kind = section.get("rope_type", section.get("type"))
    if kind is None:  # no type: plain only if it says nothing but the base
        return "default" if set(section) <= {"rope_theta"} else "?"
    return str(kind)


def _refuse_rope_scaling(cfg: dict[str, Any], where: Path) -> None:
    """Scaled rotary positions (v4's rope_scaling, v5's rope_parameters) are refused; a
    "default" entry is plain rotary, as transformers reads it."""
    for kind in (_rope_kind(cfg.get("rope_scaling")), _rope_kind(cfg.get("rope_parameters"))):
        if kind != "default":
            raise CheckpointError(f"{where}: rope scaling {kind!r} is not implemented in numesh (its rotary positions "
                                  "are unscaled): use a model without rope_scaling")


def _rope_theta(cfg: dict[str, Any], default: float) -> float:
    """The rotary base: v5's rope_parameters' rope_theta, or v4's top-level one."""
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", default)) if isinstance(params, dict) else default
    return float(theta)


def _check_parts(cfg: dict[str, Any], kind: str, where: Path) -> bool:
    """The refusals of what numesh's Llama does not compute; returns whether it has biases."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act is {cfg.get('hidden_act')!r}, numesh's SwiGLU needs silu")
    window = cfg.get("sliding_window", _DEFAULTS[kind].get("sliding_window"))
    context = cfg.get("max_position_embeddings", _DEFAULTS[kind].get("max_position_embeddings"))
    if window is not None and not (isinstance(context, int) and isinstance(window, int) and window >= context):
        # a window as long as the longest context the model takes hides nothing: full causal
        raise CheckpointError(f"{where}: {kind} with a sliding window ({window} tokens) is not implemented in "
                              "numesh (its attention is full causal): use a model whose sliding_window is null")
    bias = (bool(cfg.get("attention_bias", False)), bool(cfg.get("mlp_bias", False)))
    if bias[0] != bias[1]:
        raise CheckpointError(f"{where}: attention_bias is {bias[0]} but mlp_bias {bias[1]}: numesh's biases are in "
                              "every Linear or none")
    return bias[0]


def pretrained(directory: str | Path) -> Pretrained:
    """The model of a transformers Llama, Mistral or Mixtral directory, or a one-line
    CheckpointError naming what numesh cannot compute (another model_type, rope scaling, a
    sliding window, a head_dim other than hidden_size / heads, ...)."""
    where = Path(directory)
    cfg = read_json_file(where / "config.json", "a transformers directory needs one (save_pretrained writes it)")
    kind = cfg.get("model_type")
    if kind not in MODEL_TYPES:
        raise CheckpointError(f"{where}: model_type {kind!r} is not one numesh reads: it reads "
                              f"{', '.join(MODEL_TYPES)} and gpt2")
    d = {**_DEFAULTS[kind], **{k: v for k, v in cfg.items() if v is not None or k == "sliding_window"}}
    bias = _check_parts(cfg, kind, where)
    _refuse_rope_scaling(cfg, where)  # before the try below, which would wrap its message as a mistyped key
    try:
        C, H = int(d["hidden_size"]), int(d["num_attention_heads"])
        options: dict[str, Any] = dict(
            arch="llama", norm="rmsnorm", positions="rotary", mlp="swiglu", n_layer=int(d["num_hidden_layers"]),
            n_head=H, n_embd=C, n_kv_head=int(d.get("num_key_value_heads", H)),
            ffn_hidden=int(d["intermediate_size"]), rope_theta=_rope_theta(cfg, d["rope_theta"]),
            norm_eps=float(d["rms_norm_eps"]), tie_embeddings=bool(d["tie_word_embeddings"]), bias=bias,
            moe_experts=int(d["num_local_experts"]) if kind == "mixtral" else 0)
        if kind == "mixtral":  # a dense model fixes no routing (an option for one is refused: config._check_unused)
            options.update(moe_top_k=int(d["num_experts_per_tok"]), moe_every=1)
        head_dim, vocab, max_pos = d.get("head_dim"), int(d["vocab_size"]), int(d["max_position_embeddings"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}/config.json lacks or mistypes {e}") from None
    if head_dim is not None and H and int(head_dim) * H != C:
        raise CheckpointError(f"{where}: head_dim is {head_dim} but hidden_size / num_attention_heads is {C}/{H}: "
                              "numesh's heads are hidden_size / heads wide")
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    return Pretrained(kind, options, vocab, max_pos, eos if isinstance(eos, int) else None)


def conflicts(theirs: dict[str, Any], given: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """Every option `given` sets to other than the directory's model (`theirs`), as (name,
    given, theirs): all of them, so one error names them all. 0 means the default for
    n_kv_head and ffn_hidden."""
    found = []
    for name, want in theirs.items():
        if name not in given or given[name] == want:
            continue
        if name == "n_kv_head" and given[name] == 0 and want == theirs["n_head"]:
            continue
        if name == "ffn_hidden" and given[name] == 0 and want == swiglu_hidden(theirs["n_embd"]):
            continue
        found.append((name, given[name], want))
    return found


# ---------------------------------------------------------------------------------------
# the table: numesh leaf -> transformers tensors


@attrs.frozen
class Piece:
    """One transformers tensor of a numesh leaf: its name, the leaf's part it fills
    (`leaf[index]`), and whether it is stored transposed ([out, in])."""

    name: str
    index: tuple
    transpose: bool


_OUTER = {"wte": "model.embed_tokens.weight", "lm_head": "lm_head.weight", "ln_f.w": "model.norm.weight"}
_BLOCK = {"ln1.w": "input_layernorm", "ln2.w": "post_attention_layernorm", "attn.q": "self_attn.q_proj",
          "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj", "attn.proj": "self_attn.o_proj",
          "mlp.gate": "mlp.gate_proj", "mlp.fc": "mlp.up_proj", "mlp.proj": "mlp.down_proj"}
_EXPERTS = {"mlp.gate": "w1", "mlp.fc": "w3", "mlp.proj": "w2"}  # Mixtral's names of numesh's expert matrices


def pieces(path: str, model: GPTConfig) -> tuple[Piece, ...]:
    """Where the numesh leaf at global `path` lives in a transformers Llama/Mixtral."""
    if path in _OUTER:
        return (Piece(_OUTER[path], (), False),)
    _, layer, rest = path.split(".", 2)
    h = f"model.layers.{layer}."
    part, leaf = rest.rsplit(".", 1)
    weight = leaf == "w"
    suffix = "weight" if weight else "bias"
    if part == "attn.qkv":  # kv heads = heads: q, k and v in one [C, 3, C] leaf
        return tuple(Piece(f"{h}self_attn.{n}_proj.{suffix}", (slice(None), j) if weight else (j,), weight)
                     for j, n in enumerate("qkv"))
    if model.moe(int(layer)) is not None and part.startswith("mlp."):
        if part == "mlp.router":
            return (Piece(f"{h}block_sparse_moe.gate.weight", (), True),)
        return tuple(Piece(f"{h}block_sparse_moe.experts.{e}.{_EXPERTS[part]}.{suffix}", (e,), weight)
                     for e in range(model.moe_experts))
    if rest in _BLOCK:  # the norms
        return (Piece(f"{h}{_BLOCK[rest]}.weight", (), False),)
    return (Piece(f"{h}{_BLOCK[part]}.{suffix}", (), weight),)


def _leaf_shapes(model: GPTConfig) -> dict[str, tuple[int, ...]]:
    return {p: tuple(s) for p, s in tree_leaves_with_path(gpt_global_shapes(model, 1))}


def _expected(model: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every transformers tensor of `model` and its shape as stored."""
    out = {}
    for path, shape in _leaf_shapes(model).items():
        for p in pieces(path, model):
            part = np.broadcast_to(np.empty((), np.bool_), shape)[p.index].shape  # no memory: a 0-stride view
            out[p.name] = part[::-1] if p.transpose else part
    return out


def check_weights(weights: Weights, model: GPTConfig) -> None:
    """Every tensor `model` needs is there with its shape, and no other: one line naming the
    first that is not, before anything is read."""
    want = _expected(model)
    have = {k: v for k, v in weights.tensors.items() if not k.endswith(_IGNORED)}
    if model.tie_embeddings and "lm_head.weight" in have:  # some saves keep the tied copy too
        if "model.embed_tokens.weight" in have:  # else the loop below names the missing one
            _check_tied_copy(weights)
        have.pop("lm_head.weight")
    for name, shape in want.items():
        if name not in have:
            raise CheckpointError(f"{weights.directory} has no tensor '{name}'")
        if have[name].shape != shape:
            raise CheckpointError(f"{weights.directory}: tensor '{name}' has shape {list(have[name].shape)}, the "
                                  f"model needs {list(shape)}")
    extra = sorted(set(have) - set(want))
    if extra:
        raise CheckpointError(f"{weights.directory}: unexpected tensor '{extra[0]}' for a {model.n_layer}-layer "
                              f"{'Mixtral' if model.moe_experts else 'Llama'} of this config.json")


def _check_tied_copy(weights: Weights) -> None:
    """A tied model's file may hold lm_head.weight as a copy of the embedding; one that
    differs is another model (transformers reads it and computes other logits than numesh,
    which ties), so it is refused in one line. Compared as stored bytes, a block at a time:
    every rank checks, and two float64 copies of a 128k-token embedding were gigabytes."""
    embed, head = (weights.tensors[n] for n in ("model.embed_tokens.weight", "lm_head.weight"))
    if not _same_bytes(embed, head):
        raise CheckpointError(f"{weights.directory}: config.json ties the LM head to the embedding, but its "
                              "lm_head.weight differs from model.embed_tokens.weight: set tie_word_embeddings to "
                              "false in config.json to load the head as it is, or drop lm_head.weight")


def _same_bytes(a: TensorInfo, b: TensorInfo, block: int = 1 << 24) -> bool:
    """Whether two stored tensors have one dtype, one shape and the same bytes."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    left = a.nbytes
    with open(a.file, "rb") as fa, open(b.file, "rb") as fb:
        fa.seek(a.offset)
        fb.seek(b.offset)
        while left > 0:
            n = min(block, left)
            if fa.read(n) != fb.read(n):
                return False
            left -= n
    return True


def read_leaf(weights: Weights, path: str, model: GPTConfig, out: np.ndarray) -> np.ndarray:
    """The leaf at global `path` read into `out` (its unpadded global shape, the run's dtype)."""
    for p in pieces(path, model):
        weights.read(p.name, out[p.index], p.transpose)
    return out


def to_llama(params: Any, model: GPTConfig) -> dict[str, np.ndarray]:
    """transformers' tensors of whole unpadded numesh parameters, by name."""
    out = {}
    for path, x in tree_leaves_with_path(params):
        for p in pieces(path, model):
            part = x[p.index]
            out[p.name] = np.ascontiguousarray(part.T if p.transpose else part)
    return out


def read_pretrained(directory: str | Path, dtype: Any, block_size: int | None = None) -> tuple[Pretrained, GPTConfig,
                                                                                                   Any]:
    """(what config.json says, the numesh model at `block_size` (default: the directory's
    max_position_embeddings), its whole unpadded parameters in `dtype`) of a Llama-family
    directory: for generation and tests; a training run reads only its shards
    (`numesh.checkpoint.init_from.initial_shards`)."""
    from numesh.base.tree import tree_map_with_path
    from numesh.checkpoint.hf_files import open_weights

    pre = pretrained(directory)
    model = pre.model(pre.max_positions if block_size is None else block_size)
    model.validate(1)
    weights = open_weights(Path(directory))
    check_weights(weights, model)
    params = tree_map_with_path(lambda path, shape: read_leaf(weights, path, model, np.empty(shape, dtype)),
                                gpt_global_shapes(model, 1))
    return pre, model, params
