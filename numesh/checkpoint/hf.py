"""Export to a Hugging Face transformers directory, no custom code: GPT-2 for GPT-2's kind,
`LlamaForCausalLM` for the Llama kind and `MixtralForCausalLM` for a Llama with experts
(their tensors: `numesh.checkpoint.hf_llama`).

`transformers.AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(
DIR)` load what this writes, offline. For GPT-2: `config.json` (a `GPT2LMHeadModel`: numesh's GELU is
GPT-2's tanh form, `gelu_new`; LayerNorm epsilon 1e-5; `n_positions` = the block size;
tied embeddings), `model.safetensors` in transformers' names and layouts (GPT-2's `Conv1D`
weights are [in, out], as numesh's; biases written as zeros where numesh has none, which
config.json's `numesh_bias` says), the tokenizer (a BPE dataset's `tokenizer.json`; for a
character dataset an equivalent one, `CharTokenizer.to_hf_json`) with its
`tokenizer_config.json`, and `generation_config.json`. For Llama and Mixtral: their
config.json (`max_position_embeddings` = the block size, or the `--init-from` directory's if longer
where the run started from one; Mixtral's router is numesh's: softmax over every expert,
top-k, renormalised), their tensor names and layouts, and the same tokenizer and
generation files. A model trained from a transformers directory gets that directory's
special tokens, chat template and token ids back (`numesh.checkpoint.hf_source`). A model
of mixed parts (LayerNorm with rotary positions, say), or a Mixtral that numesh's options
make other than Mixtral (experts in every other block, a capacity, biases), has no
transformers class: a one-line refusal.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from numesh.base.errors import CheckpointError, check_scalar
from numesh.base.files import os_reason
from numesh.checkpoint.common import check_apart
from numesh.checkpoint.export import check_nanogpt, check_out_name, export_paths, exported_tensors, to_nanogpt
from numesh.checkpoint.format import META_FILE, Meta, run_checkpoints
from numesh.checkpoint.hf_files import SINGLE, read_header, weight_files
from numesh.checkpoint.hf_llama import to_llama
from numesh.checkpoint.hf_source import (
    CHAT_TEMPLATE_FILE,
    config_ids,
    generation_ids,
    max_positions,
    recorded_source,
    tokenizer_fields,
)
from numesh.checkpoint.model import MOE_REFUSAL, hf_kind
from numesh.data.tokenizer import CharTokenizer, HFTokenizer, tokenizer_from_meta
from numesh.nn.gpt import GPTConfig
from numesh.nn.layers import LN_EPS

_LINEARS = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
NUMESH_BIAS = "numesh_bias"  # config.json's record of a numesh export's --bias (transformers keeps unknown keys)
_BIASES = {".ln_1.bias": 1, ".attn.c_attn.bias": 3, ".attn.c_proj.bias": 1, ".ln_2.bias": 1, ".mlp.c_fc.bias": 4,
           ".mlp.c_proj.bias": 1}  # per block: name -> width in units of n_embd


def to_hf(params: Any, model: GPTConfig) -> dict[str, np.ndarray]:
    """transformers' GPT2LMHeadModel tensors: nanoGPT's names with the Linear weights back
    in [in, out] (Conv1D), zero biases where numesh has none, the tied head left out."""
    if model.moe_experts:
        raise CheckpointError(MOE_REFUSAL.format(model.moe_experts))
    sd = to_nanogpt(params, model)
    del sd["lm_head.weight"]  # tie_word_embeddings: transformers ties it to wte
    out = {k: np.ascontiguousarray(v.T) if k.endswith(_LINEARS) else v for k, v in sd.items()}
    dtype = params.wte.dtype
    for i in range(model.n_layer):
        for name, width in _BIASES.items():
            out.setdefault(f"transformer.h.{i}{name}", np.zeros(width * model.n_embd, dtype))
    out.setdefault("transformer.ln_f.bias", np.zeros(model.n_embd, dtype))
    return out


def hf_config(model: GPTConfig, eot_id: int | None, dtype: str) -> dict[str, Any]:
    """config.json of a GPT-2 with numesh's shapes."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": model.vocab_size,
        "n_positions": model.block_size, "n_ctx": model.block_size, "n_embd": model.n_embd,
        "n_layer": model.n_layer, "n_head": model.n_head, "n_inner": 4 * model.n_embd,
        "activation_function": "gelu_new", "layer_norm_epsilon": LN_EPS, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
        "attn_pdrop": 0.0, "tie_word_embeddings": True, "scale_attn_weights": True, "use_cache": True,
        "bos_token_id": eot_id, "eos_token_id": eot_id, "torch_dtype": dtype,
        NUMESH_BIAS: model.bias,  # GPT-2 always has biases: whether the zeros written are numesh's "none"
    }


def weights_route(model: GPTConfig, ckpt: str | Path) -> str:
    """How a new run starts from checkpoint `ckpt`'s weights, for a message: the export
    whose format holds its model, then --init-from; or that none does (a GPT-kind mixture
    of experts, a mix of kinds: numesh resumes or samples it only)."""
    try:
        check_nanogpt(model)
        return f"start a new run from its weights with `numesh export {ckpt} --out F.safetensors`, then " \
               "--init-from F.safetensors"
    except CheckpointError:
        pass
    try:
        hf_kind(model)
    except CheckpointError:
        return "no export format holds its model (numesh resumes or samples it only)"
    return f"start a new run from its weights with `numesh export {ckpt} --format hf --out DIR`, then --init-from DIR"


def llama_config(model: GPTConfig, kind: str, eot_id: int | None, dtype: str) -> dict[str, Any]:
    """config.json of a LlamaForCausalLM or MixtralForCausalLM with numesh's shapes (the
    rotary base both as transformers 5 spells it and as 4 did)."""
    cfg: dict[str, Any] = {
        "architectures": ["MixtralForCausalLM" if kind == "mixtral" else "LlamaForCausalLM"], "model_type": kind,
        "vocab_size": model.vocab_size, "hidden_size": model.n_embd, "intermediate_size": model.hidden,
        "num_hidden_layers": model.n_layer, "num_attention_heads": model.n_head,
        "num_key_value_heads": model.kv_heads, "head_dim": model.head_size, "hidden_act": "silu",
        "max_position_embeddings": model.block_size, "rms_norm_eps": model.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta}, "rope_theta": model.rope_theta,
        "tie_word_embeddings": model.tie_embeddings, "attention_dropout": 0.0, "use_cache": True,
        "bos_token_id": eot_id, "eos_token_id": eot_id, "dtype": dtype, "torch_dtype": dtype,
    }
    if kind == "mixtral":
        cfg.update(num_local_experts=model.moe_experts, num_experts_per_tok=model.moe_top_k,
                   router_aux_loss_coef=model.moe_aux_coef, router_jitter_noise=0.0, output_router_logits=False,
                   sliding_window=None)
    else:
        cfg.update(attention_bias=model.bias, mlp_bias=model.bias)
    return cfg


def _converted(params: Any, model: GPTConfig) -> dict[str, np.ndarray]:
    """transformers' tensors for the class `hf_kind` picks."""
    return to_hf(params, model) if hf_kind(model) == "gpt2" else to_llama(params, model)


def _tokenizer_files(tok: CharTokenizer | HFTokenizer, source: dict[str, Any] | None,
                     max_length: int) -> dict[str, str]:
    """tokenizer.json, tokenizer_config.json (the special tokens and chat template
    `tokenizer_fields` gives) and, for one chat template, chat_template.jinja (which
    transformers 5 reads before tokenizer_config.json's: an older one there must not win)."""
    hf = isinstance(tok, HFTokenizer)
    fields = tokenizer_fields(source, tok.eot if hf else None, max_length)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, **fields}
    files = {"tokenizer.json": tok.json_text if hf else tok.to_hf_json(),
             "tokenizer_config.json": json.dumps(config, indent=1)}
    if isinstance(fields.get("chat_template"), str):
        files[CHAT_TEMPLATE_FILE] = fields["chat_template"]
    return files


def _side_files(meta: Meta, tok: CharTokenizer | HFTokenizer, dtype: str) -> dict[str, str]:
    """Every file of the export but its weights: config.json, generation_config.json and the
    tokenizer's, with what the checkpoint recorded of its `--init-from` directory."""
    source = recorded_source(meta.raw, meta.root)
    eot = tok.eot_id if isinstance(tok, HFTokenizer) else None
    kind = hf_kind(meta.model)
    if kind == "gpt2":
        config, context = hf_config(meta.model, eot, dtype), meta.model.block_size  # a learned table: no longer
    else:
        context = max_positions(source, meta.model.block_size)
        config = llama_config(meta.model, kind, eot, dtype) | {"max_position_embeddings": context}
    config |= config_ids(source, eot)
    return {"config.json": json.dumps(config, indent=1),
            "generation_config.json": json.dumps(generation_ids(source, eot), indent=1),
            **_tokenizer_files(tok, source, context)}


def export_hf(path: str | Path, out_dir: str | Path, dtype: str | None = None, force: bool = False) -> Path:
    """Write the checkpoint at `path` as a transformers directory `out_dir` (see the module
    docstring). An existing non-empty `out_dir` is written into only with `force`: the
    files of the export replaced, a model's other weight files there removed
    (`remove_old_weights`), anything else left."""
    from safetensors.numpy import save

    out = export_paths(path, out_dir, "a directory")
    check_scalar("force", force, bool)  # "no" is truthy: it overwrote
    check_out_name(out, "hf")
    check_apart(out, path)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} is a file: --format hf writes a directory, pass a directory as --out")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise CheckpointError(f"{out} is not empty: pass --force to overwrite")
    check_not_numesh(out)
    meta, sd = exported_tensors(path, dtype, _converted, hf_kind)  # the model checked before any array is read
    tok_meta = meta.raw.get("tokenizer")
    if tok_meta is None:
        raise CheckpointError(f"{meta.root} holds no tokenizer, which a transformers directory needs: resume it "
                              "once with --data set to its dataset, then export")
    files = _side_files(meta, tokenizer_from_meta(tok_meta), np.dtype(next(iter(sd.values())).dtype).name)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_all(out, {SINGLE: save(sd, metadata={"format": "pt"}), **files})
    except OSError as e:
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # as if never started: the rerun after freeing space needs no --force
        raise CheckpointError(f"cannot write {out}: {os_reason(e)}; nothing of this export "
                              "was left there") from None
    remove_old_weights(out)
    remove_stale_side_files(out, set(files))
    return out


def check_not_numesh(out: Path) -> None:
    """One line where `out` is a numesh run's directory or checkpoint (another than the one
    exported: `check_apart` refuses that one): --force there replaced the run's config.json
    with the export's, and --force promises to replace a model's files, nothing else."""
    if out.is_dir() and (run_checkpoints(out) or (out / META_FILE).is_file()):
        what = "a numesh run's directory" if run_checkpoints(out) else "a numesh checkpoint"
        raise CheckpointError(f"--out {out} is {what}, whose files an export would replace: choose another --out")


# files transformers reads besides tokenizer_config.json, ahead of it (a chat template, the
# special tokens, added tokens): one a previous model left in the directory would override
# what this export wrote, unless this export wrote it
TOKENIZER_SIDE_FILES = ("chat_template.jinja", "chat_template.json", "special_tokens_map.json", "added_tokens.json")


def remove_stale_side_files(out: Path, written: set[str]) -> None:
    """Remove the tokenizer side files (`TOKENIZER_SIDE_FILES`) this export did not write."""
    for name in TOKENIZER_SIDE_FILES:
        if name not in written:
            _remove(out / name)


def remove_old_weights(out: Path) -> None:
    """Remove the weight files a model saved in `out` before left beside the new
    model.safetensors (a sharded model's index and shards, torch .bin files): a reader
    that looked for the index first would load the old weights under the new config.
    Done after the new files are in place, so a failure leaves the new model whole (which
    transformers and numesh both read, model.safetensors before any index) and a
    failure before leaves the old one."""
    for file in weight_files(out):
        if file.name != SINGLE:
            _remove(file)


def _remove(file: Path) -> None:
    """Remove a previous model's file from an export's directory, or say in one line that the
    export is in place but that file must go."""
    try:
        file.unlink(missing_ok=True)
    except OSError as e:
        raise CheckpointError(f"the export is in {file.parent}, but the old file {file.name} there cannot be "
                              f"removed ({os_reason(e)}): remove it yourself") from None


def write_all(out: Path, files: dict[str, str | bytes]) -> None:
    """Write every file into `out` under a temporary name first (the slow part: the weights),
    then rename them all into place in a moment: a reader (or a kill) never finds the new
    weights beside the old config, nor half a file. The directory itself is not swapped,
    since `--force` into a directory that holds other files must not delete them."""
    staged = []
    try:
        for name, content in files.items():
            tmp = out / f".{name}.tmp-{os.getpid()}"
            staged.append((tmp, out / name))  # before writing: a write cut short (a full disk) is removed too
            if isinstance(content, str):
                tmp.write_text(content, encoding="utf-8")
            else:
                tmp.write_bytes(content)
        for tmp, final in staged:
            os.replace(tmp, final)
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------
# import: `numesh train --init-from`


def _hf_model(cfg: dict[str, Any], where: Path, bias: bool) -> GPTConfig:
    """numesh's GPTConfig for a transformers config.json, or a CheckpointError naming what
    numesh cannot hold."""
    def need(key: str, ok: Any, want: str) -> None:
        if not ok:
            raise CheckpointError(f"{where}: {key} is {cfg.get(key)!r}, numesh's GPT needs {want}")

    need("model_type", cfg.get("model_type") == "gpt2", "gpt2 (the GPT-2 architecture)")
    need("activation_function", cfg.get("activation_function", "gelu_new") == "gelu_new", "gelu_new (tanh GELU)")
    need("layer_norm_epsilon", abs(cfg.get("layer_norm_epsilon", 1e-5) - LN_EPS) < 1e-12, str(LN_EPS))
    need("n_inner", cfg.get("n_inner") in (None, 4 * cfg.get("n_embd", 0)), "4 × n_embd")
    need("tie_word_embeddings", cfg.get("tie_word_embeddings", True), "true (numesh ties them)")
    try:
        model = GPTConfig(vocab_size=int(cfg["vocab_size"]), block_size=int(cfg["n_positions"]),
                          n_layer=int(cfg["n_layer"]), n_head=int(cfg["n_head"]), n_embd=int(cfg["n_embd"]),
                          bias=bias)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: config.json lacks or mistypes {e}") from None
    model.validate(1)
    return model


def import_hf(directory: str | Path) -> tuple[GPTConfig, str, Any]:
    """(model config, tokenizer.json text, whole params) of a transformers GPT-2 directory
    (one written by `export_hf`, or any GPT-2-architecture model saved as safetensors, by
    GPT2LMHeadModel with `transformer.` names or GPT2Model without). The model has biases
    when the file holds them, whatever their values (a fresh GPT-2's are zero), except the
    zeros numesh's own export wrote for a model without them (config.json's `numesh_bias`
    false, the biases still all zero: not trained since)."""
    from safetensors import SafetensorError, safe_open

    from numesh.checkpoint.export import from_nanogpt

    d = Path(directory)
    try:
        cfg = json.loads((d / "config.json").read_text(encoding="utf-8"))
        tok_text = (d / "tokenizer.json").read_text(encoding="utf-8")
        objects = {"config.json": cfg, "tokenizer.json": json.loads(tok_text)}  # both JSON objects, checked here
        if (d / SINGLE).is_file():  # an empty or cut-short file named as such, not safetensors' own words
            read_header(d / SINGLE)
        with safe_open(str(d / SINGLE), framework="numpy") as f:
            sd = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, SafetensorError) as e:
        raise CheckpointError(f"{d} is not a transformers directory numesh reads ({e}): it needs config.json, "
                              "tokenizer.json and model.safetensors") from None
    for name, obj in objects.items():
        if not isinstance(obj, dict):
            raise CheckpointError(f"{d / name} is not a JSON object: export the directory again")
    sd = {k.removeprefix("model."): v for k, v in sd.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    sd = {k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}": v for k, v in sd.items()}
    biases = [v for k, v in sd.items() if k.endswith(".bias")]
    bias = bool(biases) and not (cfg.get(NUMESH_BIAS) is False and not any(np.any(v) for v in biases))
    model = _hf_model(cfg, d, bias)
    if not bias:
        sd = {k: v for k, v in sd.items() if not k.endswith(".bias")}
    sd = {k: np.ascontiguousarray(v.T) if k.endswith(_LINEARS) else v for k, v in sd.items()}
    sd.setdefault("lm_head.weight", sd.get("transformer.wte.weight"))
    if sd["lm_head.weight"] is None:
        raise CheckpointError(f"{d} has no tensor 'transformer.wte.weight'")
    return model, tok_text, from_nanogpt(sd, model, d)
