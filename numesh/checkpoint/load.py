"""Reading a checkpoint onto any mesh, or whole into one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from numesh.checkpoint.format import (
    GROUPS,
    BlockReader,
    CheckpointError,
    Meta,
    block_region,
    check_model,
    full_region,
    global_path,
    model_leaves,
    padded_shape,
    read_meta,
)
from numesh.checkpoint.save import layout_of
from numesh.nn.gpt import GPT, GPTConfig, gpt_global_shapes
from numesh.nn.units import split_units
from numesh.tree import tree_leaves_with_path, tree_map_with_path


def local_template(model: GPTConfig, layout: Any, pp_rank: int, tp: int) -> GPT:
    """The tree a pipeline rank holds (leaves are the global paths), as `stage_tree` cuts it."""
    from numesh.pipeline.stages import stage_tree

    paths = tree_map_with_path(lambda p, _x: p, gpt_global_shapes(model, tp))
    return stage_tree(paths, layout, pp_rank)


def _read_local_trees(trainer: Any, meta: Meta) -> dict[str, GPT]:
    mesh, model = trainer.mesh, trainer.model
    layout = layout_of(trainer)
    pp_rank = mesh.index("pp")
    owned = layout.owned(pp_rank)
    tp = mesh.size("tp")
    leaves = model_leaves(model)
    reader = BlockReader(meta)
    dtype = np.dtype(trainer.dtype)
    template = local_template(model, layout, pp_rank, tp)

    def read(group: str, local: str, path: str) -> np.ndarray:
        if global_path(local, owned) != path:
            raise AssertionError(f"pipeline mapping of {local} gives {global_path(local, owned)}, not {path}")
        shape, spec = leaves[path]
        region = block_region(padded_shape(model, path, shape, tp), spec, mesh.shape, mesh.coords)
        return reader.read(f"{group}/{path}", region, dtype)

    return {g: tree_map_with_path(lambda local, path, g=g: read(g, local, path), template) for g in GROUPS}


def agree(comm: Any, error: tuple[str, str] | None) -> None:
    """Raise the same error on every rank if any rank had one (a collective every rank reaches)."""
    errors = comm.allgather(error)
    for kind, msg in (e for e in errors if e):
        if kind == "checkpoint":
            raise CheckpointError(msg)
    for i, e in enumerate(errors):
        if e:
            raise RuntimeError(f"rank {i} failed reading the checkpoint: {e[1]}")


def load_checkpoint_into(trainer: Any, path: str | Path) -> None:
    """Set `trainer`'s parameters, AdamW moments, step and optimiser step from a checkpoint
    written on any mesh. Collective: every rank reads only the blocks it needs, and every
    rank raises the same CheckpointError if any rank finds a problem."""
    comm = trainer.mesh.world
    error = None
    trees = meta = None
    try:
        meta = read_meta(path)
        check_model(meta, trainer.model)
        trees = _read_local_trees(trainer, meta)
    except CheckpointError as e:
        error = ("checkpoint", str(e))
    except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others would hang
        error = ("other", f"{type(e).__name__}: {e}")
    agree(comm, error)
    trainer.opt.load_state_trees({g: split_units(t) for g, t in trees.items()}, meta.opt_step)
    trainer.step = meta.step


def read_global_params(path: str | Path) -> tuple[GPTConfig, Any, GPT]:
    """(model config, tokenizer or None, whole unpadded parameters) of a checkpoint, in one process."""
    meta = read_meta(path)
    params = _read_group(meta, "params")
    return meta.model, meta.tokenizer(), params


def _read_group(meta: Meta, group: str) -> GPT:
    reader = BlockReader(meta)
    return tree_map_with_path(
        lambda path, shape: reader.read(f"{group}/{path}", full_region(shape)), gpt_global_shapes(meta.model, 1)
    )


def read_state(path: str | Path) -> tuple[Meta, dict[str, GPT]]:
    """The metadata and the whole unpadded params, m and v trees of a checkpoint (one process)."""
    meta = read_meta(path)
    return meta, {g: _read_group(meta, g) for g in GROUPS}


def read_params_dict(path: str | Path) -> dict[str, np.ndarray]:
    """The whole unpadded parameters keyed by leaf path ("wte", "blocks.0.attn.qkv.w", ...)."""
    _, _, params = read_global_params(path)
    return dict(tree_leaves_with_path(params))
