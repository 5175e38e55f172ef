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
from numesh.checkpoint.model import SHAPE_KEYS
from numesh.data.tokenizer import CharTokenizer, HFTokenizer
from numesh.nn.gpt import GPT, GPTConfig

OPTION = {"vocab_size": "the dataset's vocabulary (--data)", "block_size": "--block-size", "n_layer": "--n-layer",
          "n_head": "--n-head", "n_embd": "--n-embd", "bias": "--bias / --no-bias"}


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
        if getattr(theirs, key) != getattr(model, key):
            raise ConfigError(f"--init-from {p} has {key} {getattr(theirs, key)}, this run {getattr(model, key)}: "
                              f"set {OPTION[key]} to match")
    if not same:
        raise ConfigError(f"--init-from {p} was trained with another tokenizer than --data's: its token ids would "
                          "mean other text; tokenise the corpus with its tokenizer.json (`numesh data tokenize "
                          "--tokenizer`, or `numesh data char --tokenizer` for a character model)")
    return tree_map(lambda x: np.asarray(x, dtype=dtype), params)
