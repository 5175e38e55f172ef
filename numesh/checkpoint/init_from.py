"""`numesh train --init-from`: the weights a run starts from, as fine-tuning does.

From a Hugging Face transformers directory (a Llama, Mistral or Mixtral, or a GPT-2; `numesh
export --format hf` writes one) or a `numesh export` file, checked against the run's model
(every key of the model's shape must match: for a GPT-2 directory or an export file one
line names every option to change; a Llama-family directory fills those options itself)
and its dataset's tokenizer (the same ids must mean the same text), then sharded for any
mesh like a checkpoint's. A Llama-family directory is read leaf by leaf, each rank only the
leaves of its pipeline stage, each leaf whole once and then cut to the rank's shard: no rank
holds more than its shards and one tensor (`numesh.checkpoint.hf_files`). GPT-2 directories
and export files are small and read whole.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import numpy as np

from numesh.base.errors import CheckpointError, ConfigError
from numesh.base.tree import tree_map
from numesh.checkpoint.common import read_meta
from numesh.checkpoint.export import import_nanogpt
from numesh.checkpoint.format import LATEST, META_FILE, full_region, run_checkpoints, vocab_difference
from numesh.checkpoint.hf import import_hf, weights_route
from numesh.checkpoint.hf_files import open_weights, read_json_file
from numesh.checkpoint.hf_llama import (
    OPTIONS,
    check_has_config,
    check_weights,
    is_pretrained_dir,
    model_type,
    pretrained,
    read_leaf,
)
from numesh.checkpoint.model import (
    SHAPE_KEYS,
    differing_keys,
    gpt2_differences,
    gpt_leaves,
    local_paths,
    model_options,
    model_value,
    run_value,
    shard_params,
)
from numesh.data.tokenizer import CharTokenizer, HFTokenizer, directory_tokenizer, read_tokenizer_file
from numesh.host.kernels import float_dtype
from numesh.mesh import Mesh, shard
from numesh.nn.gpt import GPT, GPTConfig, gpt_specs
from numesh.pipeline.stages import StageLayout, stage_tree

# the option that sets each shape key, for the error that names a mismatch
OPTION = {"vocab_size": "the dataset's vocabulary (--data)", "block_size": "--block-size", "n_layer": "--n-layer",
          "n_head": "--n-head", "n_embd": "--n-embd", "bias": "--bias / --no-bias", "moe_experts": "--moe-experts",
          "moe_every": "--moe-every", **OPTIONS}
TOKENIZE = ("tokenise the corpus with its tokenizer.json (`numesh data tokenize --tokenizer`, or `numesh data char "
            "--tokenizer` for a character model)")


def check_init_kind(model: GPTConfig) -> None:
    """Raise unless a GPT-2 directory or a nanoGPT file can start `model`: they hold GPT-2's
    parts only (a Llama-family model starts from a Llama-family directory)."""
    if parts := gpt2_differences(model):
        raise ConfigError(f"--init-from a GPT-2 directory or a `numesh export` file holds GPT-2's parts, but this "
                          f"run's model has {', '.join(parts)}: train the GPT-2 kind (--arch gpt2), or start from a "
                          "transformers Llama, Mistral or Mixtral directory")


def check_not_checkpoint(init_from: str) -> None:
    """One-line ConfigError where --init-from names a numesh checkpoint (its meta.json) or a
    run directory (its ckpt/), which it does not read: say what does (resuming it, or its
    weights exported first, as `check_optimizer`'s error says too)."""
    p = Path(init_from)
    ckdir = run_checkpoints(p)
    ckpt = p if (p / META_FILE).is_file() else ckdir / LATEST if ckdir else None
    if ckpt is None:
        return
    try:
        route = weights_route(read_meta(ckpt).model, ckpt)
    except CheckpointError:  # unreadable: say what resuming it says
        route = "see what `--resume` says of it"
    raise ConfigError(f"--init-from {init_from} is a numesh {'checkpoint' if ckpt == p else 'run'}, not a transformers "
                      f"directory or a `numesh export` file: continue its run with --resume "
                      f"{shlex.quote(str(ckpt))}, or {route}")


def start_vocab(init_from: str, resume: str) -> int | None:
    """The vocabulary rows of the weights a run starts from, as their description says
    (the checkpoint it resumes, else its --init-from), or None where there are none, they
    cannot be read yet (resuming or importing them says why), or their source records no
    tokenizer (an older checkpoint or export file: its rows must then equal --data's
    entries, as before). A transformers model may pad its embedding past its tokenizer's
    entries, to a multiple of 64 or 128: a run from it (and every checkpoint and export of
    that run, which record the tokenizer that reading them checks) keeps those rows."""
    for source in (resume, init_from):
        if source and Path(source).exists():
            try:
                return _described_vocab(Path(source))
            except (OSError, ValueError, KeyError, TypeError):  # a UserError is a ValueError
                return None
    return None


def start_dtype(resume: str) -> str | None:
    """The dtype ("float32", "float64") of the checkpoint a run resumes, as its meta.json
    says, or None where there is none or it cannot be read yet (resuming it says why): a
    resume continues in it unless --dtype is given (`numesh.run.config.config_from`)."""
    if not resume or not Path(resume).exists():
        return None
    try:
        return read_meta(Path(resume)).dtype
    except (OSError, ValueError, KeyError, TypeError):  # a UserError is a ValueError
        return None


def _described_vocab(p: Path) -> int:
    """The vocabulary a `numesh export` file, transformers directory or checkpoint says its
    model has: the file's metadata, config.json or meta.json, never the weights."""
    if p.is_file():
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(p), framework="numpy") as f:
                metadata = f.metadata() or {}
        except SafetensorError as e:
            raise ValueError(str(e)) from None
        if json.loads(metadata.get("tokenizer", "null")) is None:
            raise ValueError("no tokenizer recorded")
        return int(json.loads(metadata["model"])["vocab_size"])
    if is_pretrained_dir(p):  # its tokenizer.json, which must be --data's (`_check_pretrained`)
        return int(read_json_file(p / "config.json", "a transformers directory needs one")["vocab_size"])
    meta = read_meta(p)
    if meta.raw.get("tokenizer") is None:
        raise ValueError("no tokenizer recorded")
    return meta.model.vocab_size


def _same_tokenizer(tok_text: str, dataset: CharTokenizer | HFTokenizer) -> bool:
    """Whether a tokenizer.json gives the dataset tokenizer's ids (a character dataset's
    export holds a merge-free BPE over its characters)."""
    theirs = json.loads(tok_text)
    if isinstance(dataset, HFTokenizer):
        return theirs == json.loads(dataset.json_text)
    model = theirs.get("model")
    return isinstance(model, dict) and model.get("vocab") == {c: i for i, c in enumerate(dataset.chars)}


def _tokenizer_text(file: Path) -> str:
    """The text of a directory's tokenizer.json, a JSON object: one line naming the file where
    it is missing or not one (a truncated copy), not a JSON parser's traceback."""
    directory_tokenizer(file.parent, "numesh tokenises with the model's own tokenizer; copy it there from the "
                        "model's source", ConfigError)
    text = read_tokenizer_file(file)
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{file} is not valid JSON ({e}): copy the model's tokenizer.json there again from its "
                          "source") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{file} is not a JSON object but {type(obj).__name__}: copy the model's tokenizer.json "
                          "there again from its source")
    return text


def load_init(path: str | Path, model: GPTConfig, dataset: CharTokenizer | HFTokenizer, dtype: Any) -> GPT:
    """The whole parameters at `path` in `dtype`, for a run of `model` on a dataset
    tokenised by `dataset`; ConfigError where they do not fit."""
    dtype = float_dtype(dtype)
    p = Path(path)
    if not p.is_dir():
        check_init_kind(model)  # before reading anything
    if p.is_dir():
        check_has_config(p)
        theirs, tok_text, params = import_hf(p)  # a directory that is none is its own error first
        check_init_kind(model)
        same, own = _same_tokenizer(tok_text, dataset), True
    elif p.is_file():
        theirs, tok, params, _, _ = import_nanogpt(p)
        own = tok is not None  # None: written before export files held their tokenizer
        same = not own or vocab_difference(tok, dataset) is None
    else:
        raise ConfigError(f"--init-from {p} does not exist: pass a transformers directory or a `numesh export` file")
    if not same:
        raise ConfigError(f"--init-from {p} was trained with another tokenizer than --data's: its token ids would "
                          f"mean other text; {TOKENIZE}")
    _check_vocab(p, rows=theirs.vocab_size, run=model.vocab_size, entries=dataset.vocab_size, own=own)
    if keys := differing_keys(theirs, model, SHAPE_KEYS):  # every mismatch at once, not one per attempt
        have = ", ".join(f"{k} {model_value(theirs, k)}" for k in keys)
        run = ", ".join(str(run_value(model, k)) for k in keys)
        raise ConfigError(f"--init-from {p} has {have}; this run {run}: pass {model_options(theirs, keys)}")
    return tree_map(lambda x: np.asarray(x, dtype=dtype), params)


def _check_pretrained(p: Path, model: GPTConfig, dataset: CharTokenizer | HFTokenizer) -> None:
    """A Llama-family directory against the run: its model, its context and its tokenizer."""
    pre = pretrained(p)
    theirs = pre.model(model.block_size)
    differ = [key for key in OPTIONS if key != "arch" and getattr(theirs, key) != getattr(model, key)
              and not _same_default(key, theirs, model)]
    if differ:  # all in one line: one run per mismatch otherwise
        has = ", ".join(f"{key} {getattr(theirs, key)}" for key in differ)
        run = ", ".join(f"{key} {getattr(model, key)}" for key in differ)
        flags = ", ".join(OPTION[k] for k in differ)
        raise ConfigError(f"--init-from {p} has {has}, this run has {run}: set {flags} to match (or leave them out: "
                          "the directory sets them)")
    if model.block_size > pre.max_positions:
        raise ConfigError(f"--block-size {model.block_size} is longer than {p}'s max_position_embeddings "
                          f"{pre.max_positions}: use at most {pre.max_positions}")
    if not _same_tokenizer(_tokenizer_text(p / "tokenizer.json"), dataset):
        raise ConfigError(f"--init-from {p} was trained with another tokenizer than --data's: its token ids would "
                          f"mean other text; {TOKENIZE}")
    _check_vocab(p, rows=pre.vocab_size, run=model.vocab_size, entries=dataset.vocab_size)


def _check_vocab(p: Path, *, rows: int, run: int, entries: int, own: bool = True) -> None:
    """The model's `rows` (its vocab_size) hold --data's tokenizer's `entries` (`own`: the
    model's own tokenizer, checked the same), and the run keeps them all (`run`): ids past
    the tokenizer never occur, and the rows stay for the export to write back."""
    if entries > rows:
        fix = f"{p} is inconsistent with its own tokenizer: use the model's own files" if own else TOKENIZE
        raise ConfigError(f"--data's tokenizer has {entries} entries, more than --init-from {p}'s vocab_size "
                          f"{rows}: ids from {rows} on would have no embedding row; {fix}")
    if not own and entries != rows:  # no tokenizer of its own to say its rows and --data's ids agree
        raise ConfigError(f"--init-from {p} has vocab_size {rows} and records no tokenizer, --data's has {entries} "
                          f"entries: {TOKENIZE}")
    if run != rows:
        raise ConfigError(f"--init-from {p} has vocab_size {rows}, this run's model {run}: {p} changed as the run "
                          "started, or this rank could not read it: start again")


def _same_default(key: str, theirs: GPTConfig, model: GPTConfig) -> bool:
    """Whether two configs differ in `key` only by spelling a default (0 kv heads = n_head)."""
    return key in ("n_kv_head", "ffn_hidden") and (theirs.kv_heads, theirs.hidden) == (model.kv_heads, model.hidden)


def initial_shards(path: str | Path, model: GPTConfig, dataset: CharTokenizer | HFTokenizer, mesh: Mesh,
                   layout: StageLayout, dtype: Any) -> GPT:
    """This rank's shards of the weights at `path`, the tree of its pipeline stage
    (`stage_tree`'s), for a run of `model` on a dataset tokenised by `dataset`; ConfigError
    (or CheckpointError) where they do not fit, the same on every rank."""
    p = Path(path)
    pp_rank = mesh.index("pp")
    if not (is_pretrained_dir(p) and model_type(p) != "gpt2"):
        whole = load_init(p, model, dataset, dtype)
        return stage_tree(shard_params(whole, model, mesh), layout, pp_rank)
    _check_pretrained(p, model, dataset)
    weights = open_weights(p)
    check_weights(weights, model)
    leaves, sizes = gpt_leaves(model), dict(mesh.shape)
    model.validate(mesh.size("tp"))

    def load(path: str, spec: Any) -> np.ndarray:
        leaf = leaves[path]
        whole = np.zeros(leaf.padded_shape(sizes), dtype)  # the vocabulary's padding rows stay zero
        read_leaf(weights, path, model, whole[full_region(leaf.shape)])
        return shard(whole, spec, mesh)

    try:
        return tree_map(load, local_paths(model, layout, pp_rank), stage_tree(gpt_specs(model), layout, pp_rank))
    except OSError as e:  # the files changed or vanished after their headers were read
        raise CheckpointError(f"cannot read the weights in {p}: {e.strerror or e}") from None
