"""Writing a sharded checkpoint from a running job, atomically.

Every rank writes the blocks it is the first holder of into `OUT/ckpt/.tmp-step_NNNNNN/`;
rank 0 collects the file records, writes `meta.json`, renames the directory to
`OUT/ckpt/step_NNNNNN/` and then repoints the `OUT/ckpt/latest` symlink. A save killed
part-way leaves only a `.tmp-` directory, which the next save removes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from numesh.base.errors import CheckpointError, check_path
from numesh.checkpoint.common import TMP_PREFIX, install_dir
from numesh.checkpoint.format import (
    FORMAT,
    LATEST,
    META_FILE,
    RUN_CKPT,
    STEP_DIR,
    VERSION,
    FileRecord,
    LeafDef,
    LeafInfo,
    fsync_dir,
    full_region,
    intersect,
    leaf_file,
    relative,
    shard_suffix,
    step_dir_name,
    step_dirs,
    write_npy,
    write_text_synced,
    writes_leaf,
)
from numesh.checkpoint.hf_source import SOURCE_KEY
from numesh.checkpoint.model import gpt_leaves, written_leaves
from numesh.checkpoint.state import TrainState, checkpoint_groups, state_groups
from numesh.mesh import AXES

# one written block: (leaf key "group/path", its file record as JSON, its dtype name)
Written = tuple[str, dict[str, Any], str]


@attrs.frozen(eq=False)
class Block:
    """One block of a leaf that this rank writes: the leaf ("group/path"), its file
    (relative to the checkpoint directory), its offset in the global array, its values."""

    key: str
    file: str
    offset: tuple[int, ...]
    data: np.ndarray


def rank_blocks(state: TrainState, leaves: dict[str, LeafDef]) -> list[Block]:
    """The blocks of `state` this rank is the first holder of (views of its arrays)."""
    mesh = state.mesh
    out = []
    for group in state_groups(state.optimizer):
        for path, x in written_leaves(state.trees[group], state.model, state.layout, mesh.index("pp")):
            leaf = leaves[path]
            if not writes_leaf(leaf.spec, mesh.coords):
                continue
            held = leaf.region(mesh.shape, mesh.coords)
            if (want := tuple(r.stop - r.start for r in held)) != x.shape:
                raise CheckpointError(f"rank {mesh.rank}: leaf {group}/{path} has local shape {x.shape}, "
                                      f"the model's is {want}")
            region = intersect(held, full_region(leaf.shape))
            if region is None:
                continue  # wholly vocabulary padding
            rel = leaf_file(group, path, shard_suffix(leaf.spec, mesh.coords))
            out.append(Block(f"{group}/{path}", rel, tuple(r.start for r in region), x[relative(region, held)]))
    return out


def write_blocks(blocks: list[Block], tmp: Path) -> list[Written]:
    """Write `blocks` under `tmp`; return what was written (with each file's sha256)."""
    out = []
    for b in blocks:
        digest = write_npy(tmp / b.file, b.data)
        out.append((b.key, FileRecord(b.file, b.offset, b.data.shape, digest).to_json(), b.data.dtype.name))
    return out


def build_meta(state: TrainState, leaves: dict[str, LeafDef], written: list[Written]) -> dict[str, Any]:
    """The meta.json document of `state`, whose ranks wrote the blocks `written`."""
    records: dict[str, list[dict]] = {}
    leaf_dtypes: dict[str, str] = {}
    for key, rec, dt in written:
        records.setdefault(key, []).append(rec)
        leaf_dtypes[key] = dt
    table = {}
    for group, paths in checkpoint_groups(state.optimizer, leaves).items():
        for path in paths:
            leaf, key = leaves[path], f"{group}/{path}"
            files = sorted(records.get(key, []), key=lambda r: (r["offset"], r["file"]))
            info = LeafInfo(key, leaf.shape, leaf_dtypes.get(key, state.dtype), tuple(leaf.spec), ())
            table[key] = info.to_json() | {"files": files}
    seed, step = state.seed, state.step
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "opt_step": state.opt_step,
        "optimizer": state.optimizer,
        "dtype": state.dtype,
        "mesh": {a: state.mesh.shape[a] for a in AXES},
        "virtual_stages": state.layout.v,
        "model": attrs.asdict(state.model),
        "seed": seed,
        # every random draw is a pure function of (seed, step, ...): restoring the
        # step restores the data position and the dropout stream exactly
        "rng": {"kind": "counter-based numpy default_rng", "dropout_key": "[seed, step, site]", "seed": seed},
        "data": {"batch_key": "[seed, 0, step]", "next_step": step},
        "train": state.run_config,
        "tokenizer": state.tokenizer,
        **({} if state.source is None else {SOURCE_KEY: state.source}),
        "leaves": table,
    }


def point_latest(ckdir: Path, name: str) -> None:
    """Atomically make `ckdir/latest` a relative symlink to `name`."""
    latest = ckdir / LATEST
    if latest.exists() and not latest.is_symlink():
        shutil.rmtree(latest) if latest.is_dir() else latest.unlink()  # an old-style "latest" directory
    link = ckdir / f"{TMP_PREFIX}latest-{os.getpid()}"
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(name, link)
    os.replace(link, latest)
    fsync_dir(ckdir)


def prune(ckdir: Path, keep: int, current: Path) -> list[Path]:
    """Delete all but the `keep` newest step_ directories (by step), never `current`. Steps
    past `current`'s are an abandoned future (the run was resumed from an earlier step):
    they rank below every other, so they go first and never push out the continued run's."""
    own = STEP_DIR.fullmatch(current.name)
    now = int(own.group(1)) if own else float("inf")
    steps = sorted(((n <= now, n), p) for n, p in step_dirs(ckdir) if p != current)
    doomed = [p for _, p in steps[: max(0, len(steps) - (keep - 1))]]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def save_leftover(name: str) -> bool:
    """Whether `name` in OUT/ckpt is what a killed save left: `.tmp-step_NNNNNN` (a save in
    progress) or `.tmp-old-step_NNNNNN` (a step being replaced). Only those: another
    process may be writing there meanwhile, e.g. `numesh reshard latest` into its sibling
    `.tmp-step_NNNNNN-tp4`, which a save used to delete under it."""
    for prefix in (TMP_PREFIX, f"{TMP_PREFIX}old-"):
        if name.startswith(prefix) and STEP_DIR.fullmatch(name[len(prefix):]):
            return True
    return False


def _prepare(ckdir: Path, tmp: Path, groups: tuple[str, ...]) -> None:
    ckdir.mkdir(parents=True, exist_ok=True)
    for p in ckdir.iterdir():  # leftovers of killed saves
        if save_leftover(p.name) and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
    for group in groups:
        (tmp / group).mkdir(parents=True)


def save_checkpoint(state: TrainState, out_dir: str | Path, keep: int | None = None) -> Path:
    """Write `state` (parameters, optimiser state, step) to OUT/ckpt/step_NNNNNN and point
    OUT/ckpt/latest at it; keep only the `keep` newest step dirs if given (> 0).

    Collective over the state's mesh: every rank writes its own blocks, nobody gathers
    arrays. Returns the step directory."""
    tmp, final = prepare_save(state, out_dir)
    written: list[Written] = []
    err = None
    try:
        written = write_blocks(rank_blocks(state, gpt_leaves(state.model)), tmp)
    except (OSError, ValueError) as e:
        err = f"rank {state.mesh.rank}: cannot write checkpoint {tmp}: {e}"
    return finish_save(state, written, err, tmp, final, keep)


def prepare_save(state: TrainState, out_dir: str | Path) -> tuple[Path, Path]:
    """(temporary, final) directory of `state`'s checkpoint, the temporary one made empty
    on rank 0 (leftovers of killed saves removed). Collective: the same error on every rank."""
    comm = state.mesh.world
    ckdir = Path(check_path("out_dir", out_dir, CheckpointError, "name the run directory to save into")) / RUN_CKPT
    name = step_dir_name(state.step)
    tmp, final = ckdir / f"{TMP_PREFIX}{name}", ckdir / name
    err = None
    if comm.Get_rank() == 0:
        try:
            _prepare(ckdir, tmp, state_groups(state.optimizer))
        except OSError as e:
            err = f"cannot create checkpoint directory {tmp}: {e}"
    err = comm.bcast(err, root=0)
    if err:
        raise CheckpointError(err)
    return tmp, final


def finish_save(state: TrainState, written: list[Written], err: str | None, tmp: Path, final: Path,
                keep: int | None) -> Path:
    """Once every rank wrote its blocks to `tmp` (or failed with `err`): rank 0 writes
    meta.json, installs `final` and moves `latest`. Collective: the same error on every rank."""
    comm = state.mesh.world
    gathered = comm.gather((written, err), root=0)
    result = finish_on_root(state, gpt_leaves(state.model), gathered, tmp, final, keep) if comm.Get_rank() == 0 \
        else None
    status, msg = comm.bcast(result, root=0)
    if status != "ok":
        raise CheckpointError(msg)
    return final


def finish_on_root(state: TrainState, leaves: dict[str, LeafDef], gathered: list[tuple[list[Written], str | None]],
                   tmp: Path, final: Path, keep: int | None) -> tuple[str, str]:
    """On rank 0: write meta.json, install the step dir, move `latest`, prune;
    ("ok", dir) or ("error", message)."""
    errors = [e for _, e in gathered if e]
    if errors:
        shutil.rmtree(tmp, ignore_errors=True)
        return ("error", errors[0])
    try:
        meta = build_meta(state, leaves, [w for written, _ in gathered for w in written])
        write_text_synced(tmp / META_FILE, json.dumps(meta, indent=1))
        fsync_dir(tmp)
        install_dir(tmp, final)
        point_latest(final.parent, final.name)
        if keep:
            prune(final.parent, keep, final)
        return ("ok", str(final))
    except OSError as e:
        return ("error", f"cannot finish checkpoint {final}: {e}")
