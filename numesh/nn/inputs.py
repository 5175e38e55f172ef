"""Entry checks of the model's library calls (`loss_and_grads`, `forward_loss`, `generate`):
the parameters fit the config and the mesh, the token ids and targets are int arrays of one
shape, every id in [0, vocab_size). Without them a wrong call failed deep inside with a raw
IndexError, or worse gave a loss that differed by mesh (a negative id wrapped to the last
row on one rank and was zeroed on tp=2).

They cost O(1) attribute reads, a walk over every leaf comparing its shape tuple with shapes
cached per (config, tp, ep) (a middle block's wrong leaf once went through to a NaN or a
wrong loss), and one min/max per id array.
"""

from __future__ import annotations

import functools

import numpy as np

from numesh.base.errors import ConfigError
from numesh.base.tree import tree_leaves, tree_leaves_with_path, tree_map
from numesh.host.kernels import FLOAT_DTYPES
from numesh.mesh import Mesh
from numesh.mesh.mesh import axis_names
from numesh.nn.gpt import GPT, GPTConfig, Shape, gpt_global_shapes, gpt_specs

# axes whose ranks hold different token ids and talk inside one model call (cp: chunks of
# each sequence; ep: rows of the batch, meeting in the MoE all-to-all)
_DIFFERENT_IDS = ("ep", "cp")


def _local(shape: tuple[int, ...], spec: tuple, sizes: dict[str, int]) -> Shape:
    """A global shape divided by the mesh axes its spec splits each dim over."""
    dims = list(spec) + [None] * (len(shape) - len(spec))
    return Shape(n // int(np.prod([sizes[a] for a in axis_names(d)])) if d else n for n, d in zip(shape, dims))


@functools.lru_cache(maxsize=16)
def _expected(cfg: GPTConfig, tp: int, ep: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(path, this rank's shape) of every leaf, in `tree_leaves` order."""
    sizes = {"tp": tp, "ep": ep}
    shapes = tree_map(lambda s, p: _local(s, p, sizes), gpt_global_shapes(cfg, tp), gpt_specs(cfg))
    return tuple(tree_leaves_with_path(shapes))


def check_params(params: GPT, cfg: GPTConfig, mesh: Mesh) -> None:
    """One ConfigError line if `params` are not this rank's shards of a `cfg` model on `mesh`
    (layer count, every leaf's shape, one float dtype)."""
    if not isinstance(params, GPT):
        raise ConfigError(f"params must be a GPT tree (init_gpt's), got {type(params).__name__}")
    if len(params.blocks) != cfg.n_layer:
        raise ConfigError(f"params have {len(params.blocks)} blocks but the config has n_layer={cfg.n_layer}: "
                          f"pass the config the params were made with")
    want = _expected(cfg, mesh.size("tp"), mesh.size("ep"))
    got = tree_leaves(params)
    if len(got) != len(want):
        raise ConfigError(f"params have {len(got)} leaves, the config expects {len(want)}{_first_odd(params, want)}: "
                          f"check bias, norm, mlp, positions and tie_embeddings")
    dtype = params.wte.dtype
    if dtype not in FLOAT_DTYPES:
        raise ConfigError(f"dtype must be float32 or float64, got params of {dtype}")
    for (path, shape), leaf in zip(want, got):
        if leaf.shape != shape:
            raise ConfigError(f"params' {path} is {leaf.shape} but n_embd={cfg.n_embd}, tp={mesh.size('tp')} "
                              f"and ep={mesh.size('ep')} make it {shape}: pass the config and mesh of the params")
        if leaf.dtype != dtype:
            raise ConfigError(f"params mix dtypes: {path} is {leaf.dtype}, wte {dtype}: give every leaf one dtype")


def _first_odd(params: GPT, want: tuple[tuple[str, tuple[int, ...]], ...]) -> str:
    """Where `params`' leaves first part from the config's, for the error line only."""
    got = [path for path, _ in tree_leaves_with_path(params)]
    for g, (w, _) in zip(got, want):
        if g != w:
            return f" (the first to differ: params have {g} where the config has {w})"
    if len(got) > len(want):
        return f" (the config has no {got[len(want)]})"
    return f" (params lack {want[len(got)][0]})"


def _id_problem(ids: np.ndarray, vocab: int, what: str) -> str | None:
    """Why `ids` are not token ids of a `vocab`-sized vocabulary, or None (one min and max)."""
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        return f"{what} holds ids from {ids.min()} to {ids.max()}, outside [0, {vocab}) (the model's vocab_size)"
    return None


def check_ids_shape(idx: np.ndarray, targets: np.ndarray | None, name: str = "idx",
                    need_targets: bool = False) -> None:
    """One ConfigError line unless `idx` (and `targets`, which `need_targets` requires) are
    int arrays [B, T] of one shape with B, T >= 1 (B=0 was a bare ValueError from max(),
    T=0 a ZeroDivisionError); `name`: what the caller calls `idx` (generate's "prompt")."""
    if need_targets and targets is None:
        raise ConfigError(f"targets must be an int numpy array of token ids [B, T] like {name}'s, got None: "
                          f"the loss needs the next tokens")
    for what, a in ((name, idx), ("targets", targets)):
        if a is None:
            continue
        if not isinstance(a, np.ndarray) or a.dtype.kind not in "iu":
            kind = a.dtype if isinstance(a, np.ndarray) else type(a).__name__
            raise ConfigError(f"{what} must be an int numpy array of token ids [B, T], got {kind}")
        if a.ndim != 2:
            raise ConfigError(f"{what} must be [B, T] (rows of token ids), got shape {a.shape}: add a batch dim")
    if targets is not None and targets.shape != idx.shape:
        raise ConfigError(f"targets {targets.shape} and {name} {idx.shape} must have one shape")
    if idx.size == 0:
        raise ConfigError(f"the {name} is empty (shape {idx.shape}): give at least one row of at least one token id")


def check_ids(idx: np.ndarray, targets: np.ndarray | None, cfg: GPTConfig, mesh: Mesh, name: str = "idx",
              problem: str | None = None) -> None:
    """One ConfigError line, on every rank alike, if an id or target is outside [0,
    vocab_size) (or `problem`, another entry check's, is not None). Where ranks hold
    different ids and meet inside the call (cp, ep) they first agree whether any rank has a
    problem, so none waits in a collective for one that left."""
    if problem is None:
        problem = _id_problem(idx, cfg.vocab_size, name)
    if problem is None and targets is not None:
        problem = _id_problem(targets, cfg.vocab_size, "targets")
    axes = tuple(a for a in _DIFFERENT_IDS if mesh.size(a) > 1)
    if axes:  # one small all-reduce, on these meshes only (every rank of the mesh is here)
        bad = mesh.comm(axes).allreduce(int(problem is not None))
        if bad and problem is None:
            problem = f"another rank's inputs are wrong (ids or targets outside [0, {cfg.vocab_size}), or params " \
                      "or arrays of the wrong shape): its error says which"
    if problem is not None:
        raise ConfigError(problem)


def _check_split(T: int, mesh: Mesh, name: str) -> None:
    """One ConfigError line unless this rank's T splits as the mesh splits sequences: cp's
    two zigzag chunks of each sequence per rank (T=3 was a broadcast error, T=1 a
    ZeroDivisionError) and sequence parallelism's T/tp rows per tp rank."""
    cp, tp = mesh.size("cp"), mesh.size("tp")
    if cp > 1 and T % 2:
        raise ConfigError(f"under cp={cp} each rank holds two chunks of every sequence: {name}'s T ({T}) must be even "
                          f"(this rank's 2 chunks of sequences of {T * cp} tokens)")
    if mesh.sequence_parallel and T % tp:
        raise ConfigError(f"with sequence parallelism over tp={tp} the sequence's tokens split over tp: {name}'s T "
                          f"({T}) must be a multiple of {tp}")


def _cp_shapes_agree(idx: np.ndarray, mesh: Mesh, name: str, problem: str | None) -> str | None:
    """`problem`, or where cp ranks hold arrays of other shapes (every cp rank holds chunks
    of the same B rows; a rank's extra row once aborted the job with MPI's "Message
    truncated") one line saying so: a small all-gather on cp meshes only, on every rank."""
    if mesh.size("cp") == 1:
        return problem
    shape = (-1, -1) if not isinstance(idx, np.ndarray) or idx.ndim != 2 else tuple(idx.shape)
    seen = mesh.comm("cp").allgather((problem is not None, shape))  # a small control message, as check_ids'
    if not any(bad for bad, _ in seen) and len({s for _, s in seen}) > 1:  # else check_ids names the rank's
        problem = f"the cp ranks' {name} arrays differ in shape (this rank's is {shape}): every cp rank passes " \
                  "its two chunks of the same rows, one shape on all of them"
    return problem


def check_inputs(params: GPT, idx: np.ndarray, targets: np.ndarray | None, cfg: GPTConfig,
                 mesh: Mesh, name: str = "idx", need_targets: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """Every entry check of a model call: the params, the ids' shapes and types, their range;
    a rank's failed check is agreed with the others where ranks hold different inputs (cp,
    ep: one rank's badly shaped array left the others waiting in the call's collectives).
    Returns idx and targets as int64 (no copy when they are): unsigned ids (a dataset's
    uint16 shards) wrapped tp's "not on this rank" -1 to 65535, an index out of bounds.
    `name`: what the caller calls `idx` (generate's "prompt"); `need_targets`: targets=None
    is an error (a loss's)."""
    try:
        check_params(params, cfg, mesh)
        check_ids_shape(idx, targets, name, need_targets)
        _check_split(idx.shape[1], mesh, name)
        problem = None
    except ConfigError as e:
        problem = str(e)
    problem = _cp_shapes_agree(idx, mesh, name, problem)
    check_ids(idx, targets, cfg, mesh, name, problem=problem)
    return idx.astype(np.int64, copy=False), None if targets is None else targets.astype(np.int64, copy=False)
