"""Sharded, mesh-independent checkpoints: save from any mesh, load onto any mesh,
reshard offline, export to a nanoGPT safetensors file.

Layout of OUT/ckpt/ (format "numesh-ckpt", version 1)::

    step_000100/meta.json           format, version, step, opt_step, optimizer, dtype, mesh,
                                    model and training config, seed, tokenizer, and per leaf
                                    ("params/…", and the optimiser's state: "m/…", "v/…" for
                                    AdamW, "momentum/…" too for Muon): global unpadded shape,
                                    dtype, spec and files [{file, offset, shape, sha256}]
    step_000100/params/wte.tp0.npy  one rectangular block of a global array (np.save)
    latest -> step_000100           relative symlink, replaced atomically after each save

Modules: `format` (the model-independent format: geometry, files, meta.json schema),
`model` (the GPT's leaf table, pipeline paths, vocabulary padding), `state` (what is saved
and loaded), `common` (helpers the others share), `save`, `background` (saving while
training goes on), `load`, `reshard`, `export`.
"""

from numesh.base.errors import CheckpointError
from numesh.checkpoint.common import read_meta
from numesh.checkpoint.export import export_nanogpt, from_nanogpt, import_nanogpt, to_nanogpt
from numesh.checkpoint.format import FORMAT, VERSION, LeafDef, Meta
from numesh.checkpoint.hf import export_hf, to_hf
from numesh.checkpoint.load import (
    check_optimizer,
    check_tokenizer,
    read_global,
    read_global_params,
    read_local_state,
    read_params_dict,
    read_state,
)
from numesh.checkpoint.model import global_path, gpt_leaves, pad_vocab, unpad_vocab
from numesh.checkpoint.reshard import reshard
from numesh.checkpoint.save import save_checkpoint
from numesh.checkpoint.state import LocalState, TrainState

__all__ = [
    "FORMAT", "VERSION", "CheckpointError", "LeafDef", "LocalState", "Meta", "TrainState", "check_optimizer",
    "check_tokenizer",
    "export_hf", "export_nanogpt", "from_nanogpt", "global_path", "gpt_leaves", "import_nanogpt", "pad_vocab",
    "read_global", "read_global_params",
    "read_local_state", "read_meta", "read_params_dict", "read_state", "reshard", "save_checkpoint",
    "to_hf", "to_nanogpt", "unpad_vocab",
]
