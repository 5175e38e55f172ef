"""Rewriting a checkpoint as another mesh would have written it, one leaf at a time."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Callable

from numesh.base.errors import CheckpointError, ConfigError, check_path
from numesh.base.files import os_reason
from numesh.checkpoint.common import TMP_PREFIX, check_apart, install_dir, read_meta
from numesh.checkpoint.format import (
    META_FILE,
    BlockReader,
    FileRecord,
    Meta,
    checkpoint_path,
    fsync_dir,
    leaf_blocks,
    leaf_file,
    write_npy,
    write_text_synced,
)
from numesh.checkpoint.pinned import read_pinned
from numesh.mesh import AXES, MeshError, parse_mesh
from numesh.mesh.mesh import parse_axis_sizes
from numesh.pipeline.stages import StageLayout


def target_mesh(source: dict[str, int], to: str) -> tuple[dict[str, int], list[str]]:
    """The mesh `to` ("tp=4", "dp=2,tp=4"; axes not named keep the source's size) and the
    axes it names."""
    if not isinstance(to, str):
        raise MeshError(f"--to must be a mesh string of the axes to change, e.g. 'tp=4' or 'dp=2,tp=4', got {to!r}")
    given = parse_axis_sizes(to)
    for name, size in given.items():
        if size < 1:
            raise MeshError(f"mesh axis {name}={size}: sizes must be >= 1")
    sizes = {a: int(source.get(a, 1)) for a in AXES} | given
    named = list(given)
    if not named:
        raise MeshError("--to names no mesh axis: pass e.g. tp=4")
    n = math.prod(sizes[a] for a in AXES)
    return parse_mesh(sizes, n), named


def reshard(path: str | Path, to: str, out: str | Path | None = None,
            log: Callable[[str], None] | None = None) -> Path:
    """Write checkpoint `path` as the ranks of mesh `to` would have written it (same values,
    other blocks) to `out` (default: a sibling named like `step_000100-tp4`). Reads and
    writes one block at a time; the output appears atomically. Returns the output dir.
    `path` may be a running job's `latest`: one step directory is read, again from the
    next one if the job prunes it meanwhile (numesh/checkpoint/pinned.py). `log` is told
    when the output records fewer virtual stages than the source (`_target_virtual`)."""
    checkpoint_path(path)
    if out is not None:
        check_path("--out", out, CheckpointError, "name the directory to write, or leave it out")
        check_apart(out, path)
    return read_pinned(path, lambda root: _reshard(root, to, out, log))


def _target_virtual(meta: Meta, pp: int, log: Callable[[str], None] | None) -> int:
    """The virtual stages per pp rank the output records: the source's where `pp` splits
    n_layer into pp x v chunks, else 1 (said to `log`). The count is only a record of the
    layout that wrote the files, which hold leaves by global layer: any --virtual-stages
    that splits the layers resumes either. Raises where `pp` does not split n_layer at all
    (the checkpoint's layers are fixed: only pp can change)."""
    n, v = meta.model.n_layer, meta.raw.get("virtual_stages", 1)
    v = v if isinstance(v, int) and v >= 1 else 1
    if n % (pp * v) == 0:
        return v
    if n % pp:
        fits = [str(p) for p in range(1, n + 1) if n % p == 0]
        raise ConfigError(f"n_layer={n} does not split over pp x virtual stages = {pp} x 1: reshard --to another "
                          f"pp, one of {', '.join(fits)}")
    if log is not None:
        log(f"n_layer={n} does not split over pp x virtual stages = {pp} x {v}: the output records 1 virtual stage "
            f"(resume it with a --virtual-stages that splits the layers over pp={pp}, e.g. 1)")
    return 1


def _reshard(root: Path, to: str, out: str | Path | None, log: Callable[[str], None] | None) -> Path:
    """`reshard` of the step directory `root`."""
    meta = read_meta(root)
    src_mesh = meta.raw.get("mesh") if isinstance(meta.raw.get("mesh"), dict) else {}
    sizes, named = target_mesh(src_mesh, to)
    meta.model.check_tp_of_fixed_model(sizes["tp"], "reshard --to another tp, {sizes}")  # only the mesh can change
    meta.model.validate(sizes["tp"])
    _check_ep(meta.model.moe_experts, sizes["ep"])
    if sizes["cp"] > 1 and meta.model.block_size % (2 * sizes["cp"]):
        raise ConfigError(f"block_size={meta.model.block_size} does not split into 2*cp={2 * sizes['cp']} "
                          f"equal chunks: use a cp with 2*cp dividing {meta.model.block_size}")
    v = _target_virtual(meta, sizes["pp"], log)
    StageLayout(meta.model.n_layer, sizes["pp"], v)
    if out is None:
        out = meta.root.parent / (meta.root.name + "-" + "-".join(f"{a}{sizes[a]}" for a in AXES if a in named))
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise CheckpointError(f"{out} already exists: choose another --out or remove it")
    tmp = out.parent / f"{TMP_PREFIX}{out.name}"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        doc = dict(meta.raw)
        doc["mesh"] = dict(sizes)
        doc["virtual_stages"] = v
        doc["resharded_from"] = {"dir": meta.root.name, "mesh": src_mesh}
        doc["leaves"] = _write_blocks(meta, sizes, tmp)
        write_text_synced(tmp / META_FILE, json.dumps(doc, indent=1))
        fsync_dir(tmp)
        install_dir(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):  # a read-only or full filesystem, a file where a directory should be
            raise CheckpointError(f"cannot write --out {out}: {os_reason(e)}: choose another --out") from None
        raise
    return out


def _check_ep(experts: int, ep: int) -> None:
    """ep splits the experts (whole ones: E/ep per ep rank); a dense model has none to split."""
    if ep > 1 and not experts:
        raise ConfigError(f"--to ep={ep} splits the experts over ranks, but this checkpoint's model has none: "
                          f"drop ep from --to")
    if experts % ep:
        raise ConfigError(f"--to ep={ep}: the model's {experts} experts do not split over ep={ep}: "
                          f"use an ep that divides {experts}")


def _write_blocks(meta: Meta, sizes: dict[str, int], tmp: Path) -> dict[str, dict]:
    """Write every leaf of `meta` into `tmp` as the writing ranks of a mesh of `sizes` would;
    return meta.json's new leaf table."""
    reader = BlockReader(meta)
    leaves_out = {}
    for key, leaf in meta.leaves.items():
        group, leaf_path = key.split("/", 1)
        padded = meta.defs[leaf_path].padded_shape(sizes)
        records = []
        for suffix, region in leaf_blocks(leaf.shape, padded, leaf.spec, sizes):
            rel = leaf_file(group, leaf_path, suffix)
            digest = write_npy(tmp / rel, reader.read(key, region))
            records.append(FileRecord(rel, tuple(r.start for r in region), tuple(r.stop - r.start for r in region),
                                      digest))
        leaves_out[key] = leaf.to_json() | {"files": [r.to_json() for r in records]}
    return leaves_out
