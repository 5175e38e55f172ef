"""The on-disk checkpoint format: metadata schema, block geometry and safe reading.

A checkpoint is a directory. `meta.json` describes every leaf of the parameters and of
the optimiser's state by its global path, unpadded global shape, dtype and partition spec,
and lists the files that hold it: each file is one rectangular block of the global array
(`offset` + `shape`), stored as `.npy` with its sha256. Nothing here is pickled.

The groups are "params" and the optimiser's state names, each holding the leaves of the
rule that keeps it (AdamW's "m" and "v" every leaf; Muon's "momentum" its matrices, "m"
and "v" the rest): a `Groups` function given by the caller says which
(`numesh.checkpoint.state.checkpoint_groups`, from the optimiser's own declaration), so the
format knows no optimiser. meta.json names the optimiser ("optimizer"; a checkpoint without
one was written by AdamW, the only optimiser then).

This module knows no model: what leaves a checkpoint must hold comes in as a table of
`LeafDef`s (built for the GPT by `numesh.checkpoint.model`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shlex
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Mapping, Sequence

import attrs
import numpy as np

from numesh.base.errors import CheckpointError, DataError, check_path
from numesh.base.files import json_object_or_none
from numesh.base.padding import round_up
from numesh.data.tokenizer import CharTokenizer, HFTokenizer, tokenizer_from_meta
from numesh.mesh import AXES, P
from numesh.mesh.mesh import axis_names

FORMAT = "numesh-ckpt"
VERSION = 1
META_FILE = "meta.json"
PARAMS = "params"
LEGACY_OPTIMIZER = "adamw"  # what a meta.json without "optimizer" was trained with
DTYPES = ("float32", "float64")
STEP_DIR = re.compile(r"step_(\d+)")
MODEL_TYPES = ("llama", "mistral", "mixtral")  # the Llama-family transformers directories numesh reads (and gpt2)
LATEST = "latest"  # OUT/ckpt/latest: a symlink to the newest step_ directory
RUN_CKPT = "ckpt"  # a run's checkpoints live in OUT/ckpt
DATASET_KEY = "train_tokens"  # what every dataset's meta.json records (`numesh data`), and no checkpoint's
_SHA256 = re.compile(r"[0-9a-f]{64}")


def step_dirs(ckdir: Path) -> list[tuple[int, Path]]:
    """A run's step_N directories in `ckdir` (not `latest`, nor a symlink), as (N, path) by N."""
    return sorted((int(m.group(1)), p) for p in ckdir.iterdir()
                  if (m := STEP_DIR.fullmatch(p.name)) and p.is_dir() and not p.is_symlink())


def run_checkpoints(path: Path) -> Path | None:
    """`path`/ckpt where `path` is a run's directory (train --out), else None."""
    ckdir = path / RUN_CKPT
    return ckdir if ckdir.is_dir() else None


# ---------------------------------------------------------------------------------------
# geometry: pure functions of shapes, specs and mesh coordinates


Region = tuple[slice, ...]


def step_dir_name(step: int) -> str:
    """The directory name of the checkpoint of `step` ("step_000100")."""
    return f"step_{step:06d}"


def _dims(ndim: int, spec: Sequence) -> list:
    if len(spec) > ndim:
        raise ValueError(f"spec {spec!r} has {len(spec)} entries but the array has {ndim} dims")
    return list(spec) + [None] * (ndim - len(spec))


def block_region(padded_shape: Sequence[int], spec: Sequence, sizes: Mapping[str, int],
                 coords: Mapping[str, int]) -> Region:
    """Where the rank at `coords` of a mesh of `sizes` holds its shard of an array of
    (padded) global shape `padded_shape` split by `spec` (the pure form of `local_slices`)."""
    out = []
    for i, (n, d) in enumerate(zip(padded_shape, _dims(len(padded_shape), spec))):
        if d is None:
            out.append(slice(0, n))
            continue
        names = axis_names(d)
        k, idx = 1, 0
        for a in names:
            k *= sizes[a]
            idx = idx * sizes[a] + coords[a]
        if n % k:
            raise ValueError(f"dim {i} of size {n} does not divide by {d}={k} (spec {spec!r})")
        m = n // k
        out.append(slice(idx * m, (idx + 1) * m))
    return tuple(out)


def intersect(a: Region, b: Region) -> Region | None:
    """The overlap of two regions, or None if it is empty."""
    out = []
    for x, y in zip(a, b):
        lo, hi = max(x.start, y.start), min(x.stop, y.stop)
        if lo >= hi:
            return None
        out.append(slice(lo, hi))
    return tuple(out)


def relative(region: Region, origin: Region) -> Region:
    """`region` in the coordinates of a block that starts at `origin`."""
    return tuple(slice(r.start - o.start, r.stop - o.start) for r, o in zip(region, origin))


def region_of(offset: Sequence[int], shape: Sequence[int]) -> Region:
    """The region of a block stored at `offset` with `shape`."""
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def full_region(shape: Sequence[int]) -> Region:
    """The whole of an array of `shape` (its unpadded part, given the unpadded shape)."""
    return tuple(slice(0, n) for n in shape)


def shard_suffix(spec: Sequence, coords: dict[str, int]) -> str:
    """File-name part naming a block by the coordinates of the axes that split it ("tp1", "full")."""
    axes = P(*spec).axes()
    return "-".join(f"{a}{coords[a]}" for a in axes) if axes else "full"


def writes_leaf(spec: Sequence, coords: dict[str, int]) -> bool:
    """Whether the rank at `coords` writes its block of a leaf: among the ranks holding the
    same block (those differing only on axes the leaf is replicated over), the first."""
    split = set(P(*spec).axes())
    return all(coords.get(a, 0) == 0 for a in AXES if a != "pp" and a not in split)  # pp: stages hold other leaves


def leaf_blocks(global_shape: Sequence[int], padded_shape: Sequence[int], spec: Sequence,
                sizes: dict[str, int]) -> list[tuple[str, Region]]:
    """(file suffix, region of the unpadded global array) of every block the writing ranks
    of a mesh of `sizes` store for one leaf; blocks lying wholly in the padding are dropped."""
    axes = P(*spec).axes()
    out = []
    for idx in np.ndindex(*[sizes[a] for a in axes]):
        coords = {a: 0 for a in AXES} | dict(zip(axes, idx))
        region = intersect(block_region(padded_shape, spec, sizes, coords), full_region(global_shape))
        if region is not None:
            out.append((shard_suffix(spec, coords), region))
    return out


def leaf_file(group: str, path: str, suffix: str) -> str:
    """The file name of one block, relative to the checkpoint directory."""
    return f"{group}/{path}.{suffix}.npy"


@attrs.frozen
class LeafDef:
    """What the format needs of one model leaf: its unpadded global shape, its partition
    spec, and the dims a mesh rounds up to a multiple of their shard count (an embedding's
    vocabulary, so it splits evenly). Padding is zero, lives only in memory, never on disk."""

    shape: tuple[int, ...] = attrs.field(converter=lambda s: tuple(int(n) for n in s))
    spec: P = attrs.field(converter=lambda s: P(*s))
    pad_dims: tuple[int, ...] = attrs.field(default=(), converter=tuple)

    def padded_shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        """The global shape a mesh of axis `sizes` holds."""
        out = []
        for i, (n, d) in enumerate(zip(self.shape, _dims(len(self.shape), self.spec))):
            k = math.prod(sizes[a] for a in axis_names(d)) if i in self.pad_dims and d is not None else 1
            out.append(round_up(n, k))
        return tuple(out)

    def region(self, sizes: Mapping[str, int], coords: Mapping[str, int]) -> Region:
        """Where the rank at `coords` holds its shard, in padded global coordinates."""
        return block_region(self.padded_shape(sizes), self.spec, sizes, coords)


# the model config and leaf table (global path -> LeafDef) that meta.json's "model" entry
# describes; raises KeyError, TypeError or ValueError if the entry is bad
Describe = Callable[[Any], tuple[Any, dict[str, LeafDef]]]
# "params" and each state name of an optimiser (by name) -> the paths of the leaves it holds,
# for a leaf table; raises KeyError for an optimiser it does not know
Groups = Callable[[str, Mapping[str, LeafDef]], dict[str, tuple[str, ...]]]


def adamw_groups(optimizer: str, defs: Mapping[str, LeafDef]) -> dict[str, tuple[str, ...]]:
    """The groups of a checkpoint written by AdamW: params, m and v, each of every leaf."""
    if optimizer != LEGACY_OPTIMIZER:
        raise KeyError(optimizer)
    return {g: tuple(defs) for g in (PARAMS, "m", "v")}


# ---------------------------------------------------------------------------------------
# files


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """The sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


class _HashingWriter:
    """A file-like sink that hashes what it writes (np.save streams into it)."""

    def __init__(self, f: Any):
        self.f, self.h = f, hashlib.sha256()

    def write(self, b: bytes) -> int:
        self.h.update(b)
        return self.f.write(b)


def write_npy(path: Path, array: np.ndarray) -> str:
    """np.save `array` (contiguous, no pickle) to `path`, fsync it, return its sha256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        w = _HashingWriter(f)
        np.lib.format.write_array(w, np.ascontiguousarray(array), allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    return w.h.hexdigest()


def write_text_synced(path: Path, text: str) -> None:
    """Write `text` and fsync it, so a crash never leaves a half-written meta.json."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_file_atomic(path: Path, data: bytes, overwrite: bool = True) -> None:
    """Write `data` to `path` through a temporary sibling that is renamed into place, so
    readers never see half a file. The file is created by `open`, so it gets the mode any
    new file of the user's gets (0666 less the umask), not a temp file's 0600. Unless
    `overwrite`, an existing `path` is left alone and FileExistsError is raised (checked
    again at the rename, by a hard link, where the filesystem allows one)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # fails if path exists, atomically
            except FileExistsError:
                raise
            except OSError:  # no hard links here (some network or FAT filesystems)
                if path.exists() or path.is_symlink():
                    raise FileExistsError(path) from None
                os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def fsync_dir(path: Path) -> None:
    """Make renames inside `path` durable (best effort: not every filesystem allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def safe_relpath(rel: Any, meta_path: Path) -> str:
    """A file name from meta.json, rejected unless it is relative and stays inside the checkpoint."""
    if not isinstance(rel, str) or not rel:
        raise CheckpointError(f"{meta_path}: a file name is not a non-empty string: {rel!r}")
    pure = PurePosixPath(rel)
    if pure.is_absolute() or rel.startswith(("/", "\\")) or ".." in pure.parts or "\\" in rel or ":" in rel:
        raise CheckpointError(f"{meta_path}: file name '{rel}' is absolute or leaves the checkpoint directory")
    return rel


# ---------------------------------------------------------------------------------------
# metadata


@attrs.frozen
class FileRecord:
    """One file of a leaf, as meta.json lists it: a rectangular block of the global array.

    Attributes:
        file: its path, relative to the checkpoint directory.
        offset: where the block starts in the global array, per dim.
        shape: the block's shape.
        sha256: the file's checksum, verified on reading.
    """

    file: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    sha256: str

    @property
    def region(self) -> Region:
        return region_of(self.offset, self.shape)

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "offset": list(self.offset), "shape": list(self.shape), "sha256": self.sha256}


@attrs.frozen
class LeafInfo:
    """What meta.json records of one leaf: enough to read any region of it on any mesh.

    Attributes:
        key: the group and the leaf's path, e.g. "params/blocks.0.attn.qkv.w".
        shape: its unpadded global shape.
        dtype: its dtype name.
        spec: its partition spec when saved (one entry per dim: None, an axis or axes).
        files: the blocks that together hold the whole array.
    """

    key: str
    shape: tuple[int, ...]
    dtype: str
    spec: tuple
    files: tuple[FileRecord, ...]

    def to_json(self) -> dict[str, Any]:
        spec = [list(d) if isinstance(d, tuple) else d for d in self.spec]
        return {"shape": list(self.shape), "dtype": self.dtype, "spec": spec,
                "files": [r.to_json() for r in self.files]}


@attrs.frozen
class Meta:
    """A checkpoint's meta.json, read and checked (`read_meta`): what loading, resharding and
    exporting ask of a checkpoint before they read any array.

    Attributes:
        root: the checkpoint directory (symlinks resolved).
        raw: the meta.json document as parsed.
        model: the model config, as the `Describe` function given to `read_meta` built it.
        step: the training step it was saved at.
        opt_step: the optimiser's own step count (AdamW's bias correction).
        dtype: the arrays' dtype name.
        leaves: "params/wte" -> what meta.json records of that leaf.
        defs: "wte" -> what the model says that leaf is.
        optimizer: the optimiser's name ("adamw", "muon").
        groups: "params" and each state name -> the paths of the leaves it holds.
    """

    root: Path
    raw: dict[str, Any]
    model: Any
    step: int
    opt_step: int
    dtype: str
    leaves: dict[str, LeafInfo]
    defs: dict[str, LeafDef]
    optimizer: str = LEGACY_OPTIMIZER
    groups: dict[str, tuple[str, ...]] = attrs.field(factory=dict)

    @property
    def path(self) -> Path:
        return self.root / META_FILE

    def tokenizer(self) -> CharTokenizer | HFTokenizer | None:
        tok = self.raw.get("tokenizer")
        if tok is None:
            return None
        try:
            return tokenizer_from_meta(tok)
        except DataError as e:
            raise CheckpointError(f"{self.path}: bad tokenizer: {e}") from None


def vocab_difference(have: CharTokenizer | HFTokenizer, want: CharTokenizer | HFTokenizer) -> str | None:
    """None if the two tokenizers are the same, else how they differ, in words ("id 3 is
    'd' in the checkpoint, 'x' in the dataset; vocab 11 vs 11"): `have` is the
    checkpoint's, `want` the dataset's."""
    if have.kind != want.kind:
        return f"a {have.kind} tokenizer in the checkpoint, a {want.kind} one in the dataset"
    if isinstance(have, HFTokenizer) and isinstance(want, HFTokenizer):
        if have.sha256 == want.sha256:
            return None
        return (f"tokenizer.json sha256 {have.sha256[:12]}... in the checkpoint, {want.sha256[:12]}... in the "
                f"dataset; vocab {have.vocab_size} vs {want.vocab_size}")
    if have.chars == want.chars:
        return None
    i = next((i for i, (a, b) in enumerate(zip(have.chars, want.chars)) if a != b),
             min(have.vocab_size, want.vocab_size))

    def at(tok: CharTokenizer) -> str:
        return repr(tok.chars[i]) if i < tok.vocab_size else "absent"

    return (f"id {i} is {at(have)} in the checkpoint, {at(want)} in the dataset; "
            f"vocab {have.vocab_size} vs {want.vocab_size}")


def _int_list(x: Any, n: int | None, what: str, meta_path: Path) -> tuple[int, ...]:
    if not isinstance(x, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in x) or (
        n is not None and len(x) != n
    ):
        want = f"{n} " if n is not None else ""
        raise CheckpointError(f"{meta_path}: {what} must be a list of {want}non-negative integers, got {x!r}")
    return tuple(x)


def _spec(x: Any, meta_path: Path, key: str) -> tuple:
    try:
        if not isinstance(x, list):
            raise ValueError
        return tuple(P(*[tuple(d) if isinstance(d, list) else d for d in x]))
    except (ValueError, TypeError):
        raise CheckpointError(f"{meta_path}: leaf '{key}' has a malformed spec {x!r}") from None


def _parse_header(raw: Any, meta_path: Path, describe: Describe) -> tuple[Any, dict[str, LeafDef], int, int, str]:
    """(model, leaf table, step, opt_step, dtype) of a meta.json document, checked."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{meta_path}: not a JSON object")
    if raw.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path}: format is {raw.get('format')!r}, expected {FORMAT!r}: "
                              "not a numesh checkpoint")
    if raw.get("version") != VERSION:
        raise CheckpointError(
            f"{meta_path}: checkpoint format version {raw.get('version')!r} is not supported "
            f"(this numesh reads version {VERSION})"
        )
    try:
        model, defs = describe(raw["model"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{meta_path}: bad model config: {e}") from None
    step, opt_step = raw.get("step"), raw.get("opt_step", raw.get("step"))
    for name, v in (("step", step), ("opt_step", opt_step)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise CheckpointError(f"{meta_path}: {name} must be a non-negative integer, got {v!r}")
    dtype = raw.get("dtype")
    if dtype not in DTYPES:
        raise CheckpointError(f"{meta_path}: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return model, defs, step, opt_step, dtype


def _parse_files(key: str, files_raw: Any, shape: tuple[int, ...], meta_path: Path) -> list[FileRecord]:
    """The file records of leaf `key`, each a block inside its global `shape`."""
    if not isinstance(files_raw, list):
        raise CheckpointError(f"{meta_path}: leaf '{key}' has no file list")
    files = []
    for rec in files_raw:
        if not isinstance(rec, dict):
            raise CheckpointError(f"{meta_path}: leaf '{key}' has a malformed file record {rec!r}")
        rel = safe_relpath(rec.get("file"), meta_path)
        off = _int_list(rec.get("offset"), len(shape), f"offset of {rel}", meta_path)
        shp = _int_list(rec.get("shape"), len(shape), f"shape of {rel}", meta_path)
        if any(o + n > g for o, n, g in zip(off, shp, shape)) or 0 in shp:
            raise CheckpointError(f"{meta_path}: block {rel} (offset {list(off)}, shape {list(shp)}) "
                                  f"lies outside '{key}' {list(shape)}")
        digest = rec.get("sha256")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise CheckpointError(f"{meta_path}: file {rel} has no valid sha256")
        files.append(FileRecord(rel, off, shp, digest))
    return files


def _parse_leaf(key: str, info: Any, shape: tuple[int, ...], meta_path: Path) -> LeafInfo:
    """One entry of meta.json's leaf table, checked against the model's `shape`."""
    if not isinstance(info, dict):
        raise CheckpointError(f"{meta_path}: leaf '{key}' is missing")
    got_shape = _int_list(info.get("shape"), len(shape), f"shape of '{key}'", meta_path)
    if got_shape != shape:
        raise CheckpointError(f"{meta_path}: leaf '{key}' has shape {list(got_shape)}, the model needs {list(shape)}")
    if info.get("dtype") not in DTYPES:
        raise CheckpointError(f"{meta_path}: leaf '{key}' has dtype {info.get('dtype')!r}")
    files = _parse_files(key, info.get("files"), shape, meta_path)
    _check_tiling(key, shape, files, meta_path)
    return LeafInfo(key, shape, info["dtype"], _spec(info.get("spec"), meta_path, key), tuple(files))


def parse_meta(raw: Any, root: Path, describe: Describe, state_groups: Groups = adamw_groups) -> Meta:
    """Check everything in meta.json that can be checked without the array files; `describe`
    turns its "model" entry into the model config and the leaves that model has,
    `state_groups` its "optimizer" into the groups it must hold."""
    meta_path = root / META_FILE
    model, defs, step, opt_step, dtype = _parse_header(raw, meta_path, describe)
    leaves_raw = raw.get("leaves")
    if not isinstance(leaves_raw, dict):
        raise CheckpointError(f"{meta_path}: no 'leaves' table")
    optimizer = raw.get("optimizer", LEGACY_OPTIMIZER)
    try:
        groups = state_groups(optimizer, defs)
    except (KeyError, TypeError):
        raise CheckpointError(f"{meta_path}: optimizer {optimizer!r} is not one this numesh knows") from None
    want_keys = {f"{g}/{p}" for g, paths in groups.items() for p in paths}
    extra = sorted(set(leaves_raw) - want_keys)
    if extra:
        raise CheckpointError(f"{meta_path}: leaf '{extra[0]}' is not a parameter of the model it describes "
                              f"or a state of its optimizer {optimizer}")
    leaves = {
        f"{g}/{p}": _parse_leaf(f"{g}/{p}", leaves_raw.get(f"{g}/{p}"), defs[p].shape, meta_path)
        for g, paths in groups.items()
        for p in paths
    }
    return Meta(root, raw, model, step, opt_step, dtype, leaves, defs, optimizer, groups)



def _check_tiling(key: str, shape: tuple[int, ...], files: list[FileRecord], meta_path: Path) -> None:
    """The blocks of a leaf must cover it exactly once."""
    total = sum(math.prod(r.shape) for r in files)
    for i, a in enumerate(files):
        for b in files[i + 1 :]:
            if intersect(a.region, b.region) is not None:
                raise CheckpointError(f"{meta_path}: blocks {a.file} and {b.file} of '{key}' overlap")
    if total != math.prod(shape):
        raise CheckpointError(f"{meta_path}: the blocks of '{key}' cover {total} of its {math.prod(shape)} values")


def checkpoint_path(path: Any) -> Path:
    """The checkpoint directory a reader is given, or one CheckpointError line where it is
    None or empty (`check_path`): the one check of every entry point that reads one."""
    return Path(check_path("the checkpoint path", path, CheckpointError,
                           "pass a checkpoint directory such as RUN/ckpt/latest"))


def read_meta(path: str | Path, describe: Describe, state_groups: Groups = adamw_groups) -> Meta:
    """Read and check `path/meta.json` (`path` may be the `latest` symlink) for the model
    `describe` builds from it and the groups `state_groups` says its optimiser keeps (see
    `parse_meta`)."""
    given = checkpoint_path(path)
    if not given.exists():
        raise CheckpointError(f"no checkpoint at {given}: pass a checkpoint directory such as RUN/ckpt/latest")
    if not given.is_dir():
        raise CheckpointError(_a_file(given))
    root = given.resolve()
    meta_path = root / META_FILE
    if not meta_path.is_file():
        if run_checkpoints(root):  # a run's directory (train --out), not one of its checkpoints
            raise CheckpointError(f"{given} is a run's directory, not a checkpoint: pass one of its checkpoints, "
                                  f"such as {shlex.quote(str(given / RUN_CKPT / LATEST))}")
        if (root / LATEST).exists() or step_dirs(root):  # the run's ckpt/ itself
            raise CheckpointError(f"{given} holds a run's checkpoints, it is not one: pass one of them, such as "
                                  f"{shlex.quote(str(given / LATEST))}")
        if (kind := _transformers_model(root)) is not None:
            what = f"{given} is a transformers model directory (model_type {kind!r}), not a numesh checkpoint"
            if kind not in (*MODEL_TYPES, "gpt2"):
                raise CheckpointError(f"{what}, and not of a type numesh reads ({', '.join(MODEL_TYPES)} and gpt2)")
            raise CheckpointError(f"{what}: `numesh train --init-from {given}` starts a run from its weights and "
                                  f"`numesh sample {given}` samples from it")
        raise CheckpointError(f"{meta_path} is missing: {given} is not a complete numesh checkpoint")
    try:
        raw = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_path} cannot be read: {e}") from None
    if isinstance(raw, dict) and raw.get("format") != FORMAT and DATASET_KEY in raw:
        raise CheckpointError(f"{given} is a dataset (`numesh data` wrote it), not a checkpoint: `numesh train "
                              f"--data {given}` trains on it; pass a checkpoint directory such as RUN/ckpt/latest")
    return parse_meta(raw, root, describe, state_groups)


def _a_file(given: Path) -> str:
    """Why the file `given` is no checkpoint (a directory), and what reads it where it may
    be a `numesh export` file."""
    if given.suffix != ".safetensors":
        return f"{given} is a file, not a checkpoint directory: pass one such as RUN/ckpt/latest"
    return (f"{given} is a file (an exported model?), not a checkpoint directory: `numesh train --init-from {given}` "
            f"starts a run from a `numesh export` file's weights and `numesh sample {given}` samples from it; "
            "pass a checkpoint directory such as RUN/ckpt/latest")


def _transformers_model(root: Path) -> str | None:
    """The model_type of the transformers model directory `root` (its config.json, which
    save_pretrained writes with one), else None (a run's config.json names none)."""
    kind = (json_object_or_none(root / "config.json") or {}).get("model_type")
    return kind if isinstance(kind, str) and kind else None


# ---------------------------------------------------------------------------------------
# reading blocks


class BlockReader:
    """Reads regions of stored leaves through memory maps, verifying each file's sha256
    the first time it is used (only the files actually touched are read)."""

    def __init__(self, meta: Meta):
        self.meta = meta
        self.root = meta.root
        self.verified: set[str] = set()

    def open(self, leaf: LeafInfo, rec: FileRecord) -> np.ndarray:
        path = self.root / rec.file
        try:
            real = path.resolve()
        except OSError as e:
            raise CheckpointError(f"{path} cannot be opened: {e}") from None
        if not real.is_relative_to(self.root):
            raise CheckpointError(f"{path} leaves the checkpoint directory {self.root}")
        if not real.is_file():
            raise CheckpointError(f"{path} is missing from the checkpoint")
        if rec.file not in self.verified:
            try:
                digest = sha256_file(real)
            except OSError as e:
                raise CheckpointError(f"{path} cannot be read: {e}") from None
            if digest != rec.sha256:
                raise CheckpointError(f"{path} is corrupted or truncated: "
                                      f"sha256 {digest} does not match the recorded {rec.sha256}")
            self.verified.add(rec.file)
        try:
            arr = np.load(real, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise CheckpointError(f"{path} is not a readable .npy file: {e}") from None
        if not isinstance(arr, np.ndarray) or arr.shape != rec.shape or arr.dtype != np.dtype(leaf.dtype):
            raise CheckpointError(
                f"{path} holds {getattr(arr, 'dtype', '?')} {getattr(arr, 'shape', '?')}, "
                f"meta.json says {leaf.dtype} {rec.shape}"
            )
        return arr

    def read(self, key: str, region: Region, dtype: Any = None) -> np.ndarray:
        """The values of leaf `key` in `region` of its global array; parts of the region past
        the stored (unpadded) shape, i.e. vocabulary padding, are zero."""
        leaf = self.meta.leaves[key]
        out = np.zeros(tuple(r.stop - r.start for r in region), dtype=dtype or leaf.dtype)
        for rec in leaf.files:
            common = intersect(region, rec.region)
            if common is None:
                continue
            arr = self.open(leaf, rec)
            out[relative(common, region)] = arr[relative(common, rec.region)]
        return out
