"""Reading a checkpoint onto any mesh, or whole into one process."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

import numpy as np

from numesh.base.errors import CheckpointError
from numesh.base.tree import tree_leaves_with_path, tree_map
from numesh.checkpoint.common import read_group, read_meta, read_params
from numesh.checkpoint.format import STEP_DIR, BlockReader, Meta, step_dirs, vocab_difference
from numesh.checkpoint.hf import weights_route
from numesh.checkpoint.hf_source import recorded_source
from numesh.checkpoint.model import check_model, gpt_leaves, local_paths
from numesh.checkpoint.pinned import read_pinned, read_pinned_on
from numesh.checkpoint.state import LocalState
from numesh.data.tokenizer import CharTokenizer, HFTokenizer
from numesh.mesh import Mesh
from numesh.nn.gpt import GPT, GPTConfig
from numesh.pipeline.stages import StageLayout


def _read_local_trees(meta: Meta, mesh: Mesh, model: GPTConfig, layout: StageLayout, dtype: Any) -> dict[str, GPT]:
    """This rank's blocks of every group, cut for its pipeline stage and padded for its tp."""
    leaves = gpt_leaves(model)
    reader = BlockReader(meta)
    template = local_paths(model, layout, mesh.index("pp"))

    def read(group: str, path: str) -> np.ndarray | None:
        if path not in held[group]:
            return None  # a state another rule of the optimiser keeps
        return reader.read(f"{group}/{path}", leaves[path].region(mesh.shape, mesh.coords), np.dtype(dtype))

    held = {g: frozenset(paths) for g, paths in meta.groups.items()}
    return {g: tree_map(lambda path, g=g: read(g, path), template) for g in meta.groups}


def check_tokenizer(meta: Meta, tokenizer: CharTokenizer | HFTokenizer, dataset: str = "this run's dataset") -> None:
    """Raise unless the checkpoint was trained on `tokenizer`'s vocabulary: with another one
    (even of the same size) every token id would silently change meaning. A checkpoint
    that stores no tokenizer (written by an older numesh) cannot be checked and passes."""
    have = meta.tokenizer()
    if have is None:
        return
    diff = vocab_difference(have, tokenizer)
    if diff is not None:
        raise CheckpointError(
            f"{meta.root} was trained on another vocabulary than {dataset} ({diff}): "
            "resume with --data set to the dataset the checkpoint was trained on"
        )


def check_optimizer(meta: Meta, optimizer: str) -> None:
    """Raise unless the checkpoint was trained with `optimizer`: another optimiser's state
    (Muon's momentum, AdamW's moments) cannot continue this one's."""
    if meta.optimizer != optimizer:
        raise CheckpointError(
            f"{meta.root} was trained with --optimizer {meta.optimizer}, this run has --optimizer {optimizer}: "
            f"resume with --optimizer {meta.optimizer}, or {weights_route(meta.model, meta.root)}")


def read_local_state(path: str | Path, mesh: Mesh, model: GPTConfig, layout: StageLayout, dtype: Any,
                     tokenizer: CharTokenizer | HFTokenizer | None = None,
                     dataset: str = "this run's dataset", optimizer: str | None = None) -> LocalState:
    """This rank's part of a checkpoint written on any mesh: trees shaped like
    `TrainState.trees` for `mesh` and `layout`, in `dtype`, and the steps to continue from.
    With `tokenizer` (that of the run's data, described as `dataset` in errors), the
    checkpoint must have been trained on the same vocabulary (see `check_tokenizer`); with
    `optimizer`, by that optimiser (its state is another one's: see `check_optimizer`).

    Collective over `mesh`: every rank reads only the blocks it needs, all of one step
    directory even while a job moves `latest` on (numesh/checkpoint/pinned.py), and every
    rank raises the same CheckpointError if any rank finds a problem."""

    def read(root: Path) -> LocalState:
        meta = read_meta(root)
        if tokenizer is not None:
            check_tokenizer(meta, tokenizer, dataset)
        check_model(meta, model)
        if optimizer is not None:
            check_optimizer(meta, optimizer)
        recorded = meta.raw.get("train")
        return LocalState(_read_local_trees(meta, mesh, model, layout, dtype), meta.step, meta.opt_step,
                          meta.optimizer, recorded_source(meta.raw, meta.root), meta.dtype,
                          recorded if isinstance(recorded, dict) else None)

    return read_pinned_on(mesh.world, path, read)


def read_global(path: str | Path, comm: Any = None) -> tuple[Meta, GPT]:
    """The metadata and whole unpadded parameters of a checkpoint, both of one step directory
    even while a job moves `latest` on (numesh/checkpoint/pinned.py). With `comm` of several
    ranks, a collective: every rank reads the whole of the same step."""

    if comm is not None and comm.Get_size() > 1:
        return read_pinned_on(comm, path, read_params)
    return read_pinned(path, read_params)


def read_global_params(path: str | Path) -> tuple[GPTConfig, Any, GPT]:
    """(model config, tokenizer or None, whole unpadded parameters) of a checkpoint, in one process."""
    meta, params = read_global(path)
    return meta.model, meta.tokenizer(), params


def read_state(path: str | Path) -> tuple[Meta, dict[str, GPT]]:
    """The metadata and the whole unpadded trees of every group of a checkpoint (params and
    the optimiser's state: None at the leaves a state does not hold), in one process."""

    def read(root: Path) -> tuple[Meta, dict[str, GPT]]:
        meta = read_meta(root)
        return meta, {g: read_group(meta, g) for g in meta.groups}

    return read_pinned(path, read)


def read_params_dict(path: str | Path) -> dict[str, np.ndarray]:
    """The whole unpadded parameters keyed by leaf path ("wte", "blocks.0.attn.qkv.w", ...)."""
    _, params = read_global(path)
    return dict(tree_leaves_with_path(params))


def _intact(root: Path) -> bool:
    """Whether `root`'s meta.json reads and every file it lists is there (checksums unread)."""
    try:
        meta = read_meta(root)
    except CheckpointError:
        return False
    return all((meta.root / r.file).is_file() for leaf in meta.leaves.values() for r in leaf.files)


def _step(path: Path) -> int | None:
    """N of a step_N directory name, else None."""
    m = STEP_DIR.fullmatch(path.name)
    return int(m.group(1)) if m else None


def intact_before(ckdir: Path, step: int | None) -> Path | None:
    """The newest intact step directory in `ckdir` before `step` (any step if None), or None."""
    found = [p for n, p in step_dirs(ckdir) if step is None or n < step]
    return next((p for p in reversed(found) if _intact(p)), None)


def broken_latest(latest: Path, error: Exception) -> str | None:
    """When OUT/ckpt/`latest` leads nowhere or to a checkpoint with a file missing, and an
    older step is intact: the one line that names that step and how to resume it
    (`--resume auto` must not start over, nor leave the user to find it). Else None."""
    if latest.exists() and _intact(latest):
        return None  # the error is of another kind (a vocabulary, an optimiser): no older step helps
    target = Path(os.readlink(latest)) if latest.is_symlink() else None
    older = intact_before(latest.parent, _step(target) if target else None)
    if older is None:
        return None
    what = f"points at a missing {target}" if not latest.exists() else f"leads to a broken checkpoint ({error})"
    return f"--resume auto: {latest} {what}; resume the intact {older.name} with --resume {shlex.quote(str(older))}"
