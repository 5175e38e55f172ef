"""Helpers that save, load, reshard and export share, so none imports another's internals:
GPT checkpoints' `read_meta`, whole-leaf reads, and installing a finished temp directory."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from numesh.base.errors import CheckpointError
from numesh.base.files import resolved_or_none
from numesh.base.tree import tree_map
from numesh.checkpoint.format import BlockReader, Meta, fsync_dir, full_region
from numesh.checkpoint.format import read_meta as read_any_meta
from numesh.checkpoint.model import describe_gpt, global_paths
from numesh.checkpoint.state import checkpoint_groups
from numesh.nn.gpt import GPT

# name prefix of directories still being written (a save or reshard in progress or killed)
TMP_PREFIX = ".tmp-"


def read_meta(path: str | Path) -> Meta:
    """Read and check the meta.json of the GPT checkpoint at `path` (may be `latest`),
    its tokenizer included when it stores one (older checkpoints do not): every id of the
    tokenizer has a row in the model, which may have more (a run from a transformers model
    whose embedding is padded past its tokenizer keeps those rows)."""
    meta = read_any_meta(path, describe_gpt, checkpoint_groups)
    tok = meta.tokenizer()
    if tok is not None and tok.vocab_size > meta.model.vocab_size:
        raise CheckpointError(
            f"{meta.path}: its tokenizer has {tok.vocab_size} entries but its model vocab_size is only "
            f"{meta.model.vocab_size}: the checkpoint is inconsistent; use another one"
        )
    return meta


def read_group(meta: Meta, group: str) -> GPT:
    """The whole unpadded tree of one group ("params", or a state such as "m") of a
    checkpoint; None at the leaves the group does not hold."""
    reader = BlockReader(meta)
    held = frozenset(meta.groups[group])
    return tree_map(
        lambda path: reader.read(f"{group}/{path}", full_region(meta.defs[path].shape)) if path in held else None,
        global_paths(meta.model))


def read_params(root: Path) -> tuple[Meta, GPT]:
    """The metadata and the whole unpadded parameters of the checkpoint directory `root`."""
    meta = read_meta(root)
    return meta, read_group(meta, "params")


def install_dir(tmp: Path, final: Path) -> None:
    """Rename a finished temp dir into place (replacing an older copy of the same name)."""
    old = None
    if final.exists() or final.is_symlink():
        old = final.with_name(f"{TMP_PREFIX}old-{final.name}")
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def check_apart(out: str | Path, source: str | Path) -> None:
    """One CheckpointError line where an output `out` is the checkpoint `source` it is made
    from, inside it, or a directory that holds it: an export there with --force replaced
    the checkpoint's own files (its next read failed its checksums) or its run's
    config.json, and a reshard nested a checkpoint inside its source."""
    try:
        o, s = resolved_or_none(out), resolved_or_none(source)
    except OSError:  # the working directory deleted
        return
    if o is None or s is None:  # a symlink loop: the read or write says so
        return
    if o == s or s in o.parents:
        raise CheckpointError(f"--out {out} {'is' if o == s else 'is inside'} the checkpoint it is made from ({s}): "
                              "choose an --out outside it")
    if o in s.parents:
        raise CheckpointError(f"--out {out} holds the checkpoint it is made from ({s}): choose an --out that "
                              "does not")
