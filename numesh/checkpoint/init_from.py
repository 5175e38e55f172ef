"""`numesh train --init-from`: the weights a run starts from, as fine-tuning does.

From a Hugging Face GPT-2-architecture directory (`numesh export --format hf` writes one)
or a `numesh export` file: the whole unpadded parameters, checked against the run's model
(every shape key must match: a one-line error names the option to change) and its
dataset's tokenizer (the same ids must mean the same text), then sharded for any mesh like
a checkpoint's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from numesh.base.errors import ConfigError
from numesh.base.tree import tree_map
from numesh.checkpoint.export import import_nanogpt
from numesh.checkpoint.format import vocab_difference
from numesh.checkpoint.hf import import_hf
from numesh.checkpoint.model import SHAPE_KEYS, gpt2_differences, model_value
from numesh.data.tokenizer import CharTokenizer, HFTokenizer
from numesh.nn.gpt import GPT, GPTConfig

# the option that sets each shape key, for the error that names a mismatch
OPTION = {"vocab_size": "the dataset's vocabulary (--data)", "block_size": "--block-size", "n_layer": "--n-layer",
          "n_head": "--n-head", "n_embd": "--n-embd", "bias": "--bias / --no-bias", "moe_experts": "--moe-experts",
          "moe_every": "--moe-every", "norm": "--norm", "positions": "--positions", "mlp": "--mlp",
          "ffn_hidden": "--ffn-hidden", "n_kv_head": "--n-kv-head", "tie_embeddings": "--tie-embeddings"}


def check_init_kind(model: GPTConfig) -> None:
    """Raise unless `--init-from` can start `model`: the files it reads (transformers'
    GPT-2, nanoGPT's) hold GPT-2's parts only; the Llama kind's import is issue 41's."""
    if parts := gpt2_differences(model):
        raise ConfigError(f"--init-from for llama-kind models: not yet (issue 41): this run's model has "
                          f"{', '.join(parts)}, and --init-from reads GPT-2-architecture weights only; drop "
                          "--init-from, or train the GPT-2 kind (--arch gpt2)")


def _same_tokenizer(tok_text: str, dataset: CharTokenizer | HFTokenizer) -> bool:
    """Whether a tokenizer.json gives the dataset tokenizer's ids (a character dataset's
    export holds a merge-free BPE over its characters)."""
    theirs = json.loads(tok_text)
    if isinstance(dataset, HFTokenizer):
        return theirs == json.loads(dataset.json_text)
    model = theirs.get("model")
    return isinstance(model, dict) and model.get("vocab") == {c: i for i, c in enumerate(dataset.chars)}


def load_init(path: str | Path, model: GPTConfig, dataset: CharTokenizer | HFTokenizer, dtype: Any) -> GPT:
    """The whole parameters at `path` in `dtype`, for a run of `model` on a dataset
    tokenised by `dataset`; ConfigError where they do not fit."""
    check_init_kind(model)
    p = Path(path)
    if p.is_dir():
        theirs, tok_text, params = import_hf(p)
        same = _same_tokenizer(tok_text, dataset)
    elif p.is_file():
        theirs, tok, params, _, _ = import_nanogpt(p)
        same = tok is None or vocab_difference(tok, dataset) is None
    else:
        raise ConfigError(f"--init-from {p} does not exist: pass a transformers directory or a `numesh export` file")
    for key in SHAPE_KEYS:
        if model_value(theirs, key) != model_value(model, key):
            raise ConfigError(f"--init-from {p} has {key} {model_value(theirs, key)}, this run "
                              f"{model_value(model, key)}: set {OPTION[key]} to match")
    if not same:
        raise ConfigError(f"--init-from {p} was trained with another tokenizer than --data's: its token ids would "
                          "mean other text; tokenise the corpus with its tokenizer.json (`numesh data tokenize "
                          "--tokenizer`, or `numesh data char --tokenizer` for a character model)")
    return tree_map(lambda x: np.asarray(x, dtype=dtype), params)
