"""Export to (and import from) a nanoGPT-style state dict in one safetensors file.

Names and layouts are nanoGPT's `GPT.state_dict()`: torch Linear weights are [out, in]
(ours are [in, out]), `c_attn` packs q, k, v along its output dim, `lm_head.weight` is
the tied `transformer.wte.weight`. The file's metadata holds the model config and the
tokenizer, so `numesh sample --ckpt model.safetensors` can use it directly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import attrs
import numpy as np

from numesh.base.errors import CheckpointError, DataError, check_path, check_scalar
from numesh.base.files import os_reason
from numesh.checkpoint.common import check_apart, read_group, read_meta
from numesh.checkpoint.format import DTYPES, Meta, checkpoint_path, write_file_atomic
from numesh.checkpoint.model import HF_CLASSES, gpt2_differences, hf_kind
from numesh.checkpoint.pinned import read_pinned
from numesh.data.tokenizer import tokenizer_from_meta
from numesh.nn.gpt import GPT, MLP, Attention, Block, GPTConfig
from numesh.nn.layers import LayerNorm, Linear

EXPORT_FORMAT = "numesh-nanogpt"
# weight-file suffixes that say the file holds something else than safetensors
OTHER_SUFFIXES = {".bin": "a PyTorch pickle", ".pt": "a PyTorch pickle", ".pth": "a PyTorch pickle",
                  ".ckpt": "a PyTorch pickle", ".pkl": "a pickle", ".npz": "numpy's .npz", ".gguf": "a GGUF file",
                  ".h5": "an HDF5 file", ".onnx": "an ONNX model", ".json": "a JSON file"}


def check_out_name(out: Path, fmt: str) -> None:
    """Refuse an export's `out` whose suffix says another format than `fmt` writes: nanogpt
    writes one safetensors file (an x.bin would be taken for a PyTorch pickle), hf a directory."""
    suffix = out.suffix.lower()
    if fmt == "nanogpt" and suffix in OTHER_SUFFIXES:
        raise CheckpointError(f"--out {out} names {OTHER_SUFFIXES[suffix]} ({suffix}) but --format nanogpt writes "
                              f"safetensors: name it {out.with_suffix('.safetensors')}")
    if fmt == "hf" and (suffix in OTHER_SUFFIXES or suffix == ".safetensors"):
        raise CheckpointError(f"--out {out} names a file ({suffix}) but --format hf writes a directory: name a "
                              f"directory such as {out.with_suffix('')} (or use --format nanogpt for one file)")


def export_paths(path: Any, out: Any, what: str) -> Path:
    """An export's output path, once it and the checkpoint's `path` are checked: None or
    empty (the current directory) is one line naming which."""
    checkpoint_path(path)
    return Path(check_path("--out", out, CheckpointError, f"name {what} to write"))


def check_nanogpt(model: GPTConfig) -> None:
    """Raise unless nanoGPT's format holds `model`: GPT-2's parts, every MLP dense."""
    if parts := gpt2_differences(model):
        raise CheckpointError(f"nanoGPT's format holds GPT-2's parts only, and this model has {', '.join(parts)}: "
                              f"{_hf_route(model)}")
    if model.moe_experts:
        raise CheckpointError(f"this checkpoint is a mixture of experts ({model.moe_experts} experts), which "
                              "nanoGPT's format cannot hold: sample or resume it with numesh instead")


def _hf_route(model: GPTConfig) -> str:
    """What a model nanoGPT's format refuses is told to do: export it with --format hf where
    a transformers class holds it, else use numesh (offering --format hf, which refuses it
    too, sent the user from one refusal to the other)."""
    try:
        kind = hf_kind(model)
    except CheckpointError:
        return "--format hf refuses it too; sample or resume it with numesh instead"
    return f"export it with --format hf (transformers' {HF_CLASSES[kind]}), or sample or resume it with numesh instead"


def to_nanogpt(params: GPT, model: GPTConfig) -> dict[str, np.ndarray]:
    """nanoGPT state-dict tensors of whole unpadded parameters (a dense GPT-2-kind model's only)."""
    check_nanogpt(model)
    C = model.n_embd
    sd: dict[str, np.ndarray] = {}

    def put(name: str, x: np.ndarray | None) -> None:
        if x is not None:
            sd[name] = np.ascontiguousarray(x)

    def ln(prefix: str, p: LayerNorm) -> None:
        put(prefix + ".weight", p.w)
        put(prefix + ".bias", p.b)

    put("transformer.wte.weight", params.wte)
    put("transformer.wpe.weight", params.wpe)
    for i, b in enumerate(params.blocks):
        h = f"transformer.h.{i}"
        ln(h + ".ln_1", b.ln1)
        put(h + ".attn.c_attn.weight", b.attn.qkv.w.reshape(C, 3 * C).T)
        put(h + ".attn.c_attn.bias", None if b.attn.qkv.b is None else b.attn.qkv.b.reshape(3 * C))
        put(h + ".attn.c_proj.weight", b.attn.proj.w.T)
        put(h + ".attn.c_proj.bias", b.attn.proj.b)
        ln(h + ".ln_2", b.ln2)
        put(h + ".mlp.c_fc.weight", b.mlp.fc.w.T)
        put(h + ".mlp.c_fc.bias", b.mlp.fc.b)
        put(h + ".mlp.c_proj.weight", b.mlp.proj.w.T)
        put(h + ".mlp.c_proj.bias", b.mlp.proj.b)
    ln("transformer.ln_f", params.ln_f)
    put("lm_head.weight", params.wte)
    return sd


def from_nanogpt(sd: dict[str, np.ndarray], model: GPTConfig, where: Path) -> GPT:
    """Whole unpadded parameters from nanoGPT state-dict tensors (checks names and shapes)."""
    C, V = model.n_embd, model.vocab_size
    used: set[str] = set()

    def get(name: str, shape: tuple[int, ...], optional: bool = False) -> np.ndarray | None:
        if optional and not model.bias:
            return None
        if name not in sd:
            raise CheckpointError(f"{where} has no tensor '{name}'")
        x = sd[name]
        if tuple(x.shape) != shape:
            raise CheckpointError(f"{where}: '{name}' has shape {list(x.shape)}, the model needs {list(shape)}")
        used.add(name)
        return x

    def ln(prefix: str) -> LayerNorm:
        return LayerNorm(get(prefix + ".weight", (C,)), get(prefix + ".bias", (C,), optional=True))

    def block(i: int) -> Block:
        h = f"transformer.h.{i}"
        qkv_b = get(h + ".attn.c_attn.bias", (3 * C,), optional=True)
        return Block(
            ln1=ln(h + ".ln_1"),
            attn=Attention(
                qkv=Linear(np.ascontiguousarray(get(h + ".attn.c_attn.weight", (3 * C, C)).T.reshape(C, 3, C)),
                           None if qkv_b is None else qkv_b.reshape(3, C)),
                proj=Linear(np.ascontiguousarray(get(h + ".attn.c_proj.weight", (C, C)).T),
                            get(h + ".attn.c_proj.bias", (C,), optional=True)),
            ),
            ln2=ln(h + ".ln_2"),
            mlp=MLP(
                fc=Linear(np.ascontiguousarray(get(h + ".mlp.c_fc.weight", (4 * C, C)).T),
                          get(h + ".mlp.c_fc.bias", (4 * C,), optional=True)),
                proj=Linear(np.ascontiguousarray(get(h + ".mlp.c_proj.weight", (C, 4 * C)).T),
                            get(h + ".mlp.c_proj.bias", (C,), optional=True)),
            ),
        )

    params = GPT(
        wte=get("transformer.wte.weight", (V, C)),
        wpe=get("transformer.wpe.weight", (model.block_size, C)),
        blocks=tuple(block(i) for i in range(model.n_layer)),
        ln_f=ln("transformer.ln_f"),
    )
    head = get("lm_head.weight", (V, C))
    if not np.array_equal(head, params.wte):
        raise CheckpointError(f"{where}: lm_head.weight differs from transformer.wte.weight (numesh ties them)")
    extra = sorted(set(sd) - used)
    if extra:
        raise CheckpointError(f"{where}: unexpected tensor '{extra[0]}' for this model config")
    return params


def exported_tensors(path: str | Path, dtype: str | None, convert: Callable[[GPT, GPTConfig], dict[str, np.ndarray]],
                     check: Callable[[GPTConfig], None]) -> tuple[Meta, dict[str, np.ndarray]]:
    """What every export writes: the checkpoint at `path`'s metadata and its whole
    parameters as `convert` names and lays them out (`to_nanogpt`, `to_hf`), in `dtype`
    ("float32"/"float64"; default: the checkpoint's). `dtype`, and the model by `check`
    (`check_nanogpt`, `check_hf`), are checked before any array is read, and the
    checkpoint is read from one step directory, even while a job moves `latest` on."""
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"--dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")

    def read(root: Path) -> tuple[Meta, GPT]:
        meta = read_meta(root)
        check(meta.model)
        return meta, read_group(meta, "params")

    meta, params = read_pinned(path, read)
    sd = convert(params, meta.model)
    if dtype is not None:
        sd = {k: v.astype(dtype) for k, v in sd.items()}
    return meta, sd


def export_nanogpt(path: str | Path, out_file: str | Path, dtype: str | None = None, force: bool = False) -> Path:
    """Write the checkpoint at `path` as one nanoGPT-named safetensors file (atomically,
    readable like any file the user creates). `dtype` ("float32"/"float64") converts the
    tensors; default: the checkpoint's. An existing `out_file` is replaced only if `force`."""
    from safetensors.numpy import save

    out = export_paths(path, out_file, "a .safetensors file")
    check_scalar("force", force, bool)  # "no" is truthy: it overwrote
    check_out_name(out, "nanogpt")
    check_apart(out, path)
    if out.is_dir():
        raise CheckpointError(f"{out} is a directory: pass --out a .safetensors file name")
    if not force and (out.exists() or out.is_symlink()):
        raise CheckpointError(f"{out} exists: pass --force to overwrite")
    meta, sd = exported_tensors(path, dtype, to_nanogpt, check_nanogpt)
    tok = meta.raw.get("tokenizer")
    metadata = {
        "format": EXPORT_FORMAT,
        "model": json.dumps(attrs.asdict(meta.model)),
        "tokenizer": json.dumps(tok) if tok is not None else "null",
        "step": str(meta.step),
        "gelu": "tanh",
        "source": str(meta.root),
    }
    # safetensors' own save_file writes through a 0600 temp file: serialise to bytes and
    # write them with open(), which gives the mode the user's umask says
    data = save(sd, metadata=metadata)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)  # FileExistsError here: a file where a directory should be
    except OSError as e:
        raise CheckpointError(f"cannot write {out}: {os_reason(e)}") from None
    try:
        write_file_atomic(out, data, overwrite=force)
    except FileExistsError:
        raise CheckpointError(f"{out} exists: pass --force to overwrite") from None
    except OSError as e:
        raise CheckpointError(f"cannot write {out}: {os_reason(e)}") from None
    return out


def import_nanogpt(file: str | Path) -> tuple[GPTConfig, Any, GPT, str, int]:
    """(model config, tokenizer or None, whole params, dtype name, step) of an exported file."""
    from safetensors import SafetensorError, safe_open

    where = Path(check_path("the export file path", file, CheckpointError, "pass a `numesh export` .safetensors file"))
    if not where.is_file():
        raise CheckpointError(f"no checkpoint file {where}")
    try:
        with safe_open(str(where), framework="numpy") as f:
            metadata = f.metadata() or {}
            sd = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{where} cannot be read as safetensors: {e}") from None
    if metadata.get("format") != EXPORT_FORMAT or "model" not in metadata:
        raise CheckpointError(f"{where} was not written by `numesh export`: its metadata has no numesh model config")
    try:
        model = GPTConfig(**json.loads(metadata["model"]))
        model.validate(1)
        tok_meta = json.loads(metadata.get("tokenizer", "null"))
        tok = None if tok_meta is None else tokenizer_from_meta(tok_meta)
        step = int(metadata.get("step", 0))
    except (TypeError, ValueError, DataError) as e:
        raise CheckpointError(f"{where}: bad metadata: {e}") from None
    if tok is not None and tok.vocab_size > model.vocab_size:  # fewer: a padded vocabulary's rows (read_meta)
        raise CheckpointError(
            f"{where}: its tokenizer has {tok.vocab_size} entries but its model vocab_size is only "
            f"{model.vocab_size}: the file is inconsistent; export it again with `numesh export`"
        )
    params = from_nanogpt(sd, model, where)
    dtypes = {x.dtype.name for x in sd.values()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in ("float32", "float64"):
        raise CheckpointError(f"{where}: tensors must all be float32 or all float64, got {sorted(dtypes)}")
    return model, tok, params, dtypes.pop(), step
