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

from numesh.checkpoint.format import (
    FORMAT,
    GROUPS,
    META_FILE,
    STEP_DIR,
    VERSION,
    CheckpointError,
    FileRecord,
    LeafInfo,
    block_region,
    fsync_dir,
    full_region,
    global_path,
    intersect,
    leaf_file,
    model_leaves,
    padded_shape,
    relative,
    shard_suffix,
    step_dir_name,
    write_npy,
    write_text_synced,
    writes_leaf,
)
from numesh.mesh import AXES
from numesh.nn.units import join_units
from numesh.tree import tree_leaves_with_path

TMP_PREFIX = ".tmp-"
LATEST = "latest"


def layout_of(trainer: Any):
    from numesh.pipeline.stages import StageLayout

    return getattr(trainer, "layout", None) or StageLayout(trainer.model.n_layer)


def _write_rank_shards(trainer: Any, trees: dict[str, Any], tmp: Path) -> list[tuple[str, dict, str]]:
    """Write this rank's blocks; return (leaf key, file record, dtype) triples."""
    mesh, model = trainer.mesh, trainer.model
    layout = layout_of(trainer)
    pp_rank = mesh.index("pp")
    owned = layout.owned(pp_rank)
    leaves = model_leaves(model)
    tp = mesh.size("tp")
    out = []
    for group in GROUPS:
        for local, x in tree_leaves_with_path(trees[group]):
            path = global_path(local, owned)
            if path == "wte" and not layout.is_first(pp_rank):
                continue  # the tied copy on the last stage is written by the first
            shape, spec = leaves[path]
            if not writes_leaf(spec, mesh.coords):
                continue
            held = block_region(padded_shape(model, path, shape, tp), spec, mesh.shape, mesh.coords)
            if tuple(r.stop - r.start for r in held) != x.shape:
                raise CheckpointError(f"rank {mesh.rank}: leaf {group}/{path} has local shape {x.shape}, expected {held}")
            region = intersect(held, full_region(shape))
            if region is None:
                continue  # wholly vocabulary padding
            rel = leaf_file(group, path, shard_suffix(spec, mesh.coords))
            digest = write_npy(tmp / rel, x[relative(region, held)])
            rec = FileRecord(rel, tuple(r.start for r in region), tuple(r.stop - r.start for r in region), digest)
            out.append((f"{group}/{path}", rec.to_json(), x.dtype.name))
    return out


def build_meta(model: Any, step: int, opt_step: int, dtype: str, mesh_shape: dict[str, int], virtual_stages: int,
               records: dict[str, list[dict]], leaf_dtypes: dict[str, str], extra: dict[str, Any]) -> dict[str, Any]:
    """The meta.json document."""
    leaves = {}
    for group in GROUPS:
        for path, (shape, spec) in model_leaves(model).items():
            key = f"{group}/{path}"
            files = sorted(records.get(key, []), key=lambda r: (r["offset"], r["file"]))
            leaves[key] = LeafInfo(key, shape, leaf_dtypes.get(key, dtype), tuple(spec), ()).to_json() | {"files": files}
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "opt_step": opt_step,
        "dtype": dtype,
        "mesh": {a: mesh_shape[a] for a in AXES},
        "virtual_stages": virtual_stages,
        "model": attrs.asdict(model),
        **extra,
        "leaves": leaves,
    }


def install_dir(tmp: Path, final: Path) -> None:
    """Rename a finished temp dir into place (replacing an older copy of the same step)."""
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
    """Delete all but the `keep` newest step_ directories (by step), never `current`."""
    steps = sorted(
        (int(m.group(1)), p)
        for p in ckdir.iterdir()
        if (m := STEP_DIR.fullmatch(p.name)) and p.is_dir() and not p.is_symlink() and p != current
    )
    doomed = [p for _, p in steps[: max(0, len(steps) - (keep - 1))]]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def _prepare(ckdir: Path, tmp: Path) -> None:
    ckdir.mkdir(parents=True, exist_ok=True)
    for p in ckdir.iterdir():  # leftovers of killed saves
        if p.name.startswith(TMP_PREFIX) and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
    for group in GROUPS:
        (tmp / group).mkdir(parents=True)


def save_checkpoint(trainer: Any, out_dir: str | Path, keep: int | None = None) -> Path:
    """Write `trainer`'s parameters, AdamW moments and step to OUT/ckpt/step_NNNNNN and point
    OUT/ckpt/latest at it; keep only the `keep` newest step dirs if given (> 0).

    Collective over the trainer's mesh: every rank writes its own blocks, nobody gathers
    arrays. Returns the step directory."""
    mesh = trainer.mesh
    comm = mesh.world
    rank = comm.Get_rank()
    step = int(trainer.step)
    ckdir = Path(out_dir) / "ckpt"
    name = step_dir_name(step)
    tmp, final = ckdir / f"{TMP_PREFIX}{name}", ckdir / name

    trees = {g: join_units(t) for g, t in trainer.opt.state_trees().items()}  # collective over dp

    err = None
    if rank == 0:
        try:
            _prepare(ckdir, tmp)
        except OSError as e:
            err = f"cannot create checkpoint directory {tmp}: {e}"
    err = comm.bcast(err, root=0)
    if err:
        raise CheckpointError(err)

    records: list[tuple[str, dict, str]] = []
    try:
        records = _write_rank_shards(trainer, trees, tmp)
    except (OSError, ValueError) as e:
        err = f"rank {rank}: cannot write checkpoint {tmp}: {e}"
    gathered = comm.gather((records, err), root=0)

    result: tuple[str, str] | None = None
    if rank == 0:
        errors = [e for _, e in gathered if e]
        if errors:
            shutil.rmtree(tmp, ignore_errors=True)
            result = ("error", errors[0])
        else:
            try:
                by_leaf: dict[str, list[dict]] = {}
                leaf_dtypes: dict[str, str] = {}
                for recs, _ in gathered:
                    for key, rec, dt in recs:
                        by_leaf.setdefault(key, []).append(rec)
                        leaf_dtypes[key] = dt
                seed = getattr(trainer.cfg, "seed", None)
                extra: dict[str, Any] = {
                    "seed": seed,
                    # every random draw is a pure function of (seed, step, ...): restoring the
                    # step restores the data position and the dropout stream exactly
                    "rng": {"kind": "counter-based numpy default_rng", "dropout_key": "[seed, step, site]", "seed": seed},
                    "data": {"batch_key": "[seed, 0, step]", "next_step": step},
                }
                extra["train"] = attrs.asdict(trainer.cfg) if attrs.has(type(trainer.cfg)) else None
                extra["tokenizer"] = _tokenizer_meta(trainer)
                layout = layout_of(trainer)
                meta = build_meta(
                    trainer.model, step, int(trainer.opt.adam_step), trainer.cfg.dtype, mesh.shape, layout.v,
                    by_leaf, leaf_dtypes, extra,
                )
                write_text_synced(tmp / META_FILE, json.dumps(meta, indent=1))
                fsync_dir(tmp)
                install_dir(tmp, final)
                point_latest(ckdir, name)
                if keep:
                    prune(ckdir, keep, final)
                result = ("ok", str(final))
            except OSError as e:
                result = ("error", f"cannot finish checkpoint {final}: {e}")
    status, msg = comm.bcast(result, root=0)
    if status != "ok":
        raise CheckpointError(msg)
    return final


def _tokenizer_meta(trainer: Any) -> dict | None:
    from numesh import data as D

    try:
        return D.load_tokenizer(trainer.cfg.data).to_meta()
    except (D.DataError, OSError, AttributeError):
        return None
