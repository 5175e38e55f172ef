"""Sharded, mesh-independent checkpoints: save from any mesh, load onto any mesh,
reshard offline, export to a nanoGPT safetensors file.

Layout of OUT/ckpt/ (format "numesh-ckpt", version 1)::

    step_000100/meta.json           format, version, step, opt_step, dtype, mesh, model and
                                    training config, seed, tokenizer, and per leaf
                                    ("params/…", "m/…", "v/…"): global unpadded shape, dtype,
                                    spec and files [{file, offset, shape, sha256}]
    step_000100/params/wte.tp0.npy  one rectangular block of a global array (np.save)
    latest -> step_000100           relative symlink, replaced atomically after each save
"""

from numesh.checkpoint.export import export_nanogpt, from_nanogpt, import_nanogpt, to_nanogpt
from numesh.checkpoint.format import FORMAT, VERSION, CheckpointError, Meta, global_path, read_meta
from numesh.checkpoint.load import load_checkpoint_into, read_global_params, read_params_dict, read_state
from numesh.checkpoint.reshard import reshard
from numesh.checkpoint.save import save_checkpoint

__all__ = [
    "FORMAT", "VERSION", "CheckpointError", "Meta", "export_nanogpt", "from_nanogpt", "global_path",
    "import_nanogpt", "load_checkpoint_into", "read_global_params", "read_meta", "read_params_dict",
    "read_state", "reshard", "save_checkpoint", "to_nanogpt",
]
