"""The one walk over the model: a pipeline stage's forward, backward (B) and weight (W).

A stage is some contiguous blocks, plus the embedding if it is the first stage and the
final LayerNorm, head and loss if it is the last. With pp=1 the whole model is one stage,
so the single-process path (`loss_and_grads`) and the pipeline executor run the same code.

Parameters come from a `ParamUnits` (all resident, or the ZeRO optimiser, which may gather
a unit before use and free it after), and every unit's gradient goes back to it as soon as
it is final, so gradient reduction can start during backward.

Thread splitting wraps the block functions here and is not written into them. Without tp
or cp a block does not communicate, and a block on enough tokens is cut into fixed pieces
of its sequences (`block_pieces`, from the shape alone): inside a block call every matmul
over tokens makes its BLAS calls piece by piece and every sum over tokens adds the pieces
in one fixed tree (`numesh.host.threads.token_pieces`). One thread runs the block once on all
pieces; several threads each run it on a run of pieces (`numesh.host.threads.chunked_*`), so
the cores meet once per block instead of once per matmul, and the runs' weight gradients
are added by the same tree. Either way the same calls and the same additions: every thread
count gives the same bits (numesh/threads.py says why that needs fixed tiles). Other
blocks run whole on the main thread, their ops split over fixed row tiles
(`numesh.host.threads.matmul`, `over_rows`). On one rank, where nothing between blocks
talks over MPI, each run goes through all of a stage's blocks in one hand-off each way
(`stage_blocks_fwd`, `stage_blocks_bwd`): the same pieces, the same tree, fewer meetings.

Activation recomputation wraps the block functions here too (`Recompute`): "full" keeps
only the block's input (`BlockInput`, with its dropout key) and reruns the block's forward, tp
all-reduces included, right before its backward. Dropout masks are functions of (seed,
step, site, rows), so the rerun redraws the same ones, and the recomputed context is bit
for bit the forward's: every mode gives the same losses and gradients. A zero-bubble B
recomputes and leaves W the recomputed inputs it needs; under ZeRO-3 the rerun uses the
parameters that backward gathers anyway; run as pieces, each run reruns its own
rows.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import attrs
import numpy as np

from numesh.base.errors import ConfigError
from numesh.base.padding import ceil_div
from numesh.base.tree import tree_leaves
from numesh.host.threads import (
    RowChunks,
    add_into,
    chunked_bwd,
    chunked_bwd_sum,
    chunked_fwd,
    chunked_sum,
    cores,
    runs_for,
    threads,
    tiles,
    token_pieces,
)
from numesh.mesh import Mesh
from numesh.nn.dropout import DropoutKey
from numesh.nn.gpt import GPT, Block, GPTConfig, empty_outer, outer_parts
from numesh.nn.inputs import check_inputs
from numesh.nn.transformer import (
    BlockCtx,
    EmbedCtx,
    HeadCtx,
    block_bwd_input,
    block_bwd_weight,
    block_fwd,
    embed_bwd,
    embed_fwd,
    head_bwd,
    head_fwd,
    reduce_tp_partial,
)
from numesh.nn.units import OUTER, Unit, join_units


class ParamUnits(Protocol):
    """Where the walk gets each unit's parameters and leaves each unit's gradients.

    `get` may gather a unit (ZeRO-3) and `release` free it; `grads_ready` receives a unit's
    gradient summed over `count` micro-batches once it is final. `grad_slot` may offer a
    tree shaped like the unit to write that gradient into (asked afresh for each
    micro-batch): where the walk adds the threads' runs' gradients (`chunked_bwd_sum`,
    `chunked_sum`) the last addition lands there, and where a block runs whole its
    Linears' weight GEMMs write into the slot's leaves; `grads_ready` copies nothing of
    the tree that is the slot, and none of the leaves that are its own."""

    def get(self, unit: Unit) -> Any: ...

    def release(self, unit: Unit) -> None: ...

    def grad_slot(self, unit: Unit) -> Any: ...

    def grads_ready(self, unit: Unit, grads: Any, count: int = 1) -> None: ...


class ResidentParams:
    """All parameters held on this rank; gradients collected per unit."""

    def __init__(self, params: GPT):
        self.params = params
        self.grads: dict[Unit, Any] = {}

    def get(self, unit: Unit) -> Any:
        return self.params if unit.is_outer else self.params.blocks[unit.block]

    def release(self, unit: Unit) -> None:
        pass

    def grad_slot(self, unit: Unit) -> None:
        return None  # it keeps the trees it is given

    def grads_ready(self, unit: Unit, grads: Any, count: int = 1) -> None:
        self.grads[unit] = grads

    def grad_tree(self) -> GPT:
        return join_units(self.grads)


@attrs.frozen
class Stage:
    """What one model stage runs: (global layer, this rank's unit) of each block in forward
    order; `first` holds the embedding, `last` the final LayerNorm, head and loss."""

    blocks: tuple[tuple[int, Unit], ...]
    first: bool
    last: bool


def activation_shape(rows: int, seq: int, cfg: GPTConfig, mesh: Mesh) -> tuple[int, int, int]:
    """Shape of the activation between blocks (and stages) for `rows` sequences of `seq`
    tokens: [B, T, C], or this rank's sequence slice [B, T/tp, C] with sequence parallelism."""
    return rows, seq // mesh.size("tp") if mesh.sequence_parallel else seq, cfg.n_embd


def whole_model(n_layer: int) -> Stage:
    """The single stage of pp=1."""
    return Stage(tuple((i, Unit(i)) for i in range(n_layer)), first=True, last=True)


@attrs.frozen
class StageCtx:
    """A stage's saved forward state for one micro-batch."""

    embed: EmbedCtx | None
    blocks: list  # BlockCtx, or RowChunks of them when run as pieces
    head: HeadCtx | None
    moe: tuple = ()  # the MoE blocks' RoutingStats, in forward order


# ---------------------------------------------------------------------------------------
# activation recomputation

Recompute = Literal["none", "full"]
RECOMPUTE: tuple[str, ...] = ("none", "full")
# "selective" (Korthikanti et al.: drop the attention core's T×T softmax and dropout mask,
# rebuild them in backward) was retired with the fused attention kernel, which keeps
# nothing T×T: it would keep exactly what "none" keeps.
RETIRED = {"selective": "attention keeps nothing T×T since its fused kernel (numesh/nn/attention.py), so "
                        "selective would keep exactly what none keeps: use --recompute none, or full to keep only "
                        "each block's input"}


def check_recompute(mode: str) -> None:
    """Raise a one-line ConfigError unless `mode` is one of `RECOMPUTE`."""
    if mode in RETIRED:
        raise ConfigError(f"--recompute {mode} is retired: {RETIRED[mode]}")
    if mode not in RECOMPUTE:
        raise ConfigError(f"--recompute must be one of {', '.join(RECOMPUTE)}, got '{mode}'")


@attrs.frozen
class BlockInput:
    """A block's saved state under full recomputation: its input x [B, T, C] and what its
    forward drew dropout from; backward reruns the forward from them."""

    x: np.ndarray
    drop: DropoutKey | None
    layer: int
    moe_stats: Any = None  # an MoE block's RoutingStats (its forward's, for metrics)


def _saved(mode: Recompute, ctx: BlockCtx, x: np.ndarray, drop: DropoutKey | None, layer: int) -> BlockCtx | BlockInput:
    """What a block keeps for backward under recomputation `mode`."""
    if mode == "full":
        return BlockInput(x, drop, layer, ctx.moe_stats)
    return ctx


def _restored(p: Block, saved: BlockCtx | BlockInput, cfg: GPTConfig, mesh: Mesh) -> BlockCtx:
    """The whole context `block_fwd` returned, rebuilt from what `_saved` kept."""
    if isinstance(saved, BlockInput):
        return block_fwd(p, saved.x, cfg, mesh, saved.layer, saved.drop, transient=True)[1]
    return saved


# ---------------------------------------------------------------------------------------
# blocks, whole or split over the threads


# Pieces of at least 256 tokens: a matmul made piece by piece then costs 0-5 % over one
# call, and a weight gradient summed over pieces about as much (benchmarks/bench_tiles.py).
PIECE_TOKENS = 256


def block_pieces(tp: int, cp: int, rows: int, seq: int, cores: int) -> tuple[slice, ...]:
    """The fixed pieces of its `rows` sequences (of `seq` tokens) a block runs as: one (the
    whole) with tp or cp inside, else `numesh.host.threads.tiles` of at least PIECE_TOKENS
    tokens, at most `cores` (the cores the rank may use). A function of the shape, mesh and
    machine, never of the thread count. Not with cp: every thread's run would go around its
    own ring over the one cp communicator, with the same tags, so their K/V blocks could be
    matched to each other."""
    if tp > 1 or cp > 1:
        return (slice(0, rows),)
    return tiles(rows, ceil_div(PIECE_TOKENS, max(1, seq)), cores)


def row_chunks(n_threads: int, tp: int, cp: int, rows: int, seq: int) -> int:
    """How many runs of pieces a block on [rows, seq, C] runs as on a rank with `n_threads`
    threads and as many cores (what the planner's memory model asks: each run keeps its own
    LayerNorm gradients for W)."""
    return len(runs_for(n_threads, block_pieces(tp, cp, rows, seq, n_threads)))


def _pieces(mesh: Mesh, x: np.ndarray) -> tuple[slice, ...]:
    """`block_pieces` for a block on x [B, T, C] on this mesh and rank."""
    return block_pieces(mesh.size("tp"), mesh.size("cp"), x.shape[0], x.shape[1], cores())


def _tokens(pieces: tuple[slice, ...], seq: int) -> tuple[slice, ...]:
    """Pieces of sequences as token rows ([B*T] rows of [B, T, C])."""
    return tuple(slice(p.start * seq, p.stop * seq) for p in pieces)


def run_block_fwd(p: Block, x: np.ndarray, cfg: GPTConfig, mesh: Mesh, layer: int, drop: DropoutKey | None = None,
                  recompute: Recompute = "none"):
    """`block_fwd`, whole or as runs of pieces over the threads (its context says which),
    keeping what `recompute` says (each run its own)."""

    def run(rows: slice, pieces: tuple[slice, ...]) -> tuple[np.ndarray, Any]:
        xr, dr = x[rows], drop and drop.shifted(rows)
        with token_pieces(_tokens(pieces, x.shape[1])):
            y, ctx = block_fwd(p, xr, cfg, mesh, layer, dr)
        return y, _saved(recompute, ctx, xr, dr, layer)

    # an MoE block runs whole: one all-to-all per direction over ep, and one GEMM per expert
    pieces = (slice(0, x.shape[0]),) if cfg.moe(layer) else _pieces(mesh, x)
    if len(pieces) == 1:
        y, ctx = block_fwd(p, x, cfg, mesh, layer, drop)
        return y, _saved(recompute, ctx, x, drop, layer)
    return chunked_fwd(run, pieces)


def run_block_bwd_input(p: Block, ctx: BlockCtx | BlockInput | RowChunks, dx: np.ndarray, cfg: GPTConfig, mesh: Mesh,
                        loss_scale: float | None = None):
    """`block_bwd_input` of a `run_block_fwd` context (recomputing what it did not keep)."""
    if not isinstance(ctx, RowChunks):
        return block_bwd_input(p, _restored(p, ctx, cfg, mesh), dx, cfg, mesh, loss_scale)

    def run(c: BlockCtx | BlockInput, rows: slice, pieces: tuple[slice, ...]) -> tuple[np.ndarray, Any]:
        with token_pieces(_tokens(pieces, dx.shape[1])):
            return block_bwd_input(p, _restored(p, c, cfg, mesh), dx[rows], cfg, mesh)

    return chunked_bwd(run, ctx)


def run_block_bwd_weight(p: Block, w: Any, out: Any = None) -> Block:
    """`block_bwd_weight` of a `run_block_bwd_input` context (the runs' grads added by the
    pieces' tree, the last addition into `out` where given: `ParamUnits.grad_slot`; a whole
    block's weight GEMMs write into `out`)."""
    if not isinstance(w, RowChunks):
        return block_bwd_weight(p, w, out)

    def run(c: Any, pieces: tuple[slice, ...]) -> Block:
        with token_pieces(_tokens(pieces, c.h1.shape[1])):
            return block_bwd_weight(p, c)

    return chunked_sum(run, w, out)


def run_block_bwd(p: Block, ctx: BlockCtx | BlockInput | RowChunks, dx: np.ndarray, cfg: GPTConfig,
                  mesh: Mesh, loss_scale: float | None = None, out: Any = None) -> tuple[np.ndarray, Block]:
    """B and W at once (each thread does both halves for its run); the runs' grads added as
    `run_block_bwd_weight` adds them, or a whole block's weight GEMMs writing into `out`."""

    def both(c: BlockCtx | BlockInput, rows: slice | None = None,
             into: Block | None = None) -> tuple[np.ndarray, Block]:
        d, w = block_bwd_input(p, _restored(p, c, cfg, mesh), dx if rows is None else dx[rows], cfg, mesh,
                               loss_scale)
        return d, block_bwd_weight(p, w, into)

    if not isinstance(ctx, RowChunks):
        return both(ctx, into=out)

    def run(c: BlockCtx | BlockInput, rows: slice, pieces: tuple[slice, ...]) -> tuple[np.ndarray, Block]:
        with token_pieces(_tokens(pieces, dx.shape[1])):
            return both(c, rows)

    return chunked_bwd_sum(run, ctx, out)


# ---------------------------------------------------------------------------------------
# a stage's blocks in one hand-off

# The most the runs' weight gradients of a whole stage may take for its backward to run in
# one hand-off (each run keeps its own of every block until the end, instead of handing
# each block's to the optimiser as soon as they are summed).
STAGE_GRAD_BYTES = 16 << 20


def _one_hand_off(stage: Stage, cfg: GPTConfig, mesh: Mesh) -> bool:
    """Whether the stage's blocks may run in one hand-off to the threads: on one rank only,
    where nothing between blocks talks over MPI (ZeRO-3's gathers, dp's overlapped
    reductions, tp, cp, ep), and with no MoE block (it runs whole)."""
    return bool(stage.blocks) and not mesh.axes_of_size_gt1() and not any(cfg.moe(layer) for layer, _ in stage.blocks)


def _stage_pieces(stage: Stage, x: np.ndarray, cfg: GPTConfig, mesh: Mesh) -> tuple[slice, ...]:
    """The pieces all of the stage's blocks run as in one hand-off (those each would run as
    alone), or () where they run block by block: `_one_hand_off` says no, or one run."""
    if not _one_hand_off(stage, cfg, mesh):
        return ()
    pieces = _pieces(mesh, x)
    return pieces if len(runs_for(threads(), pieces)) > 1 else ()


def stage_blocks_fwd(params: list, stage: Stage, x: np.ndarray, pieces: tuple[slice, ...], cfg: GPTConfig,
                     mesh: Mesh, drop: DropoutKey | None, recompute: Recompute,
                     keep: bool = True) -> tuple[np.ndarray, list]:
    """Every block of the stage forward, each run of pieces through all of them on its own
    thread: each block gets the rows, pieces and dropout it gets from `run_block_fwd`, so
    the same bits, in one hand-off instead of one per block (each costs the Python that
    starts a run while the other thread waits for the GIL, `docs/benchmarks.md`). Returns
    the output and each block's context as `run_block_fwd` leaves it (None each, kept by
    no run, unless `keep`)."""

    def run(rows: slice, ps: tuple[slice, ...]) -> tuple[np.ndarray, list]:
        xr, dr, ctxs = x[rows], drop and drop.shifted(rows), []
        with token_pieces(_tokens(ps, x.shape[1])):
            for p, (layer, _) in zip(params, stage.blocks):
                y, ctx = block_fwd(p, xr, cfg, mesh, layer, dr)
                ctxs.append(_saved(recompute, ctx, xr, dr, layer) if keep else None)
                xr = y
        return xr, ctxs

    y, runs = chunked_fwd(run, pieces)
    if not keep:
        return y, [None] * len(params)
    return y, [RowChunks(runs.rows, runs.pieces, tuple(c[j] for c in runs.parts)) for j in range(len(params))]


def stage_blocks_bwd(params: list, stage: Stage, ctxs: list, dx: np.ndarray, cfg: GPTConfig, mesh: Mesh,
                     loss_scale: float | None, out: tuple | None = None) -> tuple[np.ndarray, tuple]:
    """Every block of the stage backward (B and W), each run through all of them on its own
    thread, as `run_block_bwd` runs each: (the stage's input grad, each block's weight
    grads in forward order, the runs' added by the pieces' tree, the last addition into
    `out`'s trees where given)."""
    first = ctxs[0]
    both = RowChunks(first.rows, first.pieces, tuple(tuple(c.parts[i] for c in ctxs) for i in range(len(first.rows))))

    def run(cs: tuple, rows: slice, ps: tuple[slice, ...]) -> tuple[np.ndarray, tuple]:
        d, grads = dx[rows], []
        with token_pieces(_tokens(ps, dx.shape[1])):
            for p, c in reversed(list(zip(params, cs))):
                d, w = block_bwd_input(p, _restored(p, c, cfg, mesh), d, cfg, mesh, loss_scale)
                grads.append(block_bwd_weight(p, w))
        return d, tuple(reversed(grads))

    return chunked_bwd_sum(run, both, out)


def _fused_params(units: ParamUnits, stage: Stage, ctx: StageCtx, split: bool, cfg: GPTConfig,
                  mesh: Mesh) -> list | None:
    """The stage's block parameters (got from `units`) where its backward runs in one
    hand-off: not split, run as its forward ran (`stage_blocks_fwd`), and the runs' weight
    grads of every block within STAGE_GRAD_BYTES; else None, nothing held."""
    if split or not _one_hand_off(stage, cfg, mesh) or not all(isinstance(c, RowChunks) for c in ctx.blocks):
        return None
    params = [units.get(unit) for _, unit in stage.blocks]
    if len(ctx.blocks[0].rows) * sum(leaf.nbytes for p in params for leaf in tree_leaves(p)) <= STAGE_GRAD_BYTES:
        return params
    for _, unit in stage.blocks:
        units.release(unit)
    return None


# ---------------------------------------------------------------------------------------
# the walk


def stage_forward(units: ParamUnits, stage: Stage, inp: np.ndarray, targets: np.ndarray | None, cfg: GPTConfig,
                  mesh: Mesh, drop: DropoutKey | None = None, keep: bool = True,
                  recompute: Recompute = "none") -> tuple[np.ndarray, StageCtx | None]:
    """Run a stage forward on `inp` (token ids [B, T] on the first stage, else activations
    [B, T, C], or this rank's [B, T/tp, C] with sequence parallelism). Returns the per-token
    losses [B*T] on the last stage, else the activations for the next, and the context for
    backward (None if not `keep`; its blocks' parts as `recompute` says: "none" or "full")."""
    check_recompute(recompute)
    emb = head = None
    x = inp
    if stage.first:
        x, emb = embed_fwd(units.get(OUTER), inp, cfg, mesh, drop)
        if not stage.last:  # the last stage keeps it for the head: ZeRO-3 gathers it once
            units.release(OUTER)
    ctxs = []
    pieces = _stage_pieces(stage, x, cfg, mesh)
    if pieces:
        params = [units.get(unit) for _, unit in stage.blocks]
        x, ctxs = stage_blocks_fwd(params, stage, x, pieces, cfg, mesh, drop, recompute, keep)
        for _, unit in stage.blocks:
            units.release(unit)
    else:
        for layer, unit in stage.blocks:
            x, c = run_block_fwd(units.get(unit), x, cfg, mesh, layer, drop, recompute if keep else "none")
            units.release(unit)
            ctxs.append(c if keep else None)
    if stage.last:
        x, head = head_fwd(units.get(OUTER), x, targets, cfg, mesh)
        units.release(OUTER)
    moe = tuple(c.moe_stats for c in ctxs if keep and getattr(c, "moe_stats", None) is not None)
    return x, (StageCtx(emb, ctxs, head, moe) if keep else None)


def stage_backward(units: ParamUnits, stage: Stage, ctx: StageCtx, dy: np.ndarray | float, cfg: GPTConfig, mesh: Mesh,
                   split: bool = False, loss_scale: float | None = None) -> tuple[np.ndarray | None, GPT, list]:
    """Backward of `stage_forward`. `dy` is the loss scale on the last stage, else the grad of
    the stage's output; `loss_scale` (default: `dy` on the last stage) weights the MoE
    blocks' router losses, so a pipeline passes it to every stage. Block grads go to
    `units.grads_ready` as they become final, unless `split` (zero-bubble), when only input
    grads are computed and the weight halves are returned for `stage_weight`. Returns (grad
    of the stage's input, or None on the first stage; this stage's share of the outer
    unit's grads, a GPT with None where it has none; the deferred weight contexts)."""
    outer = empty_outer()
    dx = dy
    if loss_scale is None and stage.last:
        loss_scale = float(dy)
    if stage.last:
        head = units.get(OUTER)
        dx, dhead, d_lnf = head_bwd(head, ctx.head, dy, mesh)
        if not stage.first:  # the first stage keeps it for the embedding: ZeRO-3 gathers it once
            units.release(OUTER)
        outer = attrs.evolve(outer, ln_f=d_lnf, **{"wte" if head.lm_head is None else "lm_head": dhead})
    deferred = []
    fused = _fused_params(units, stage, ctx, split, cfg, mesh)
    if fused is not None:
        slots = tuple(units.grad_slot(unit) for _, unit in stage.blocks)
        dx, grads = stage_blocks_bwd(fused, stage, ctx.blocks, dx, cfg, mesh, loss_scale,
                                     None if any(s is None for s in slots) else slots)
        for (_, unit), g in reversed(list(zip(stage.blocks, grads))):
            units.release(unit)
            units.grads_ready(unit, g)
    for (layer, unit), c in reversed(list(zip(stage.blocks, ctx.blocks)) if fused is None else []):
        params = units.get(unit)
        if split:
            dx, w = run_block_bwd_input(params, c, dx, cfg, mesh, loss_scale)
            deferred.append((unit, w))
            units.release(unit)
        else:
            dx, grads = run_block_bwd(params, c, dx, cfg, mesh, loss_scale, units.grad_slot(unit))
            units.release(unit)
            units.grads_ready(unit, grads)
    if stage.first:
        dwte, dwpe = embed_bwd(units.get(OUTER), ctx.embed, dx, mesh)
        units.release(OUTER)
        # a tied embedding's two [V, C] grads (the head's a GEMM's fresh output) added on the threads
        outer = attrs.evolve(outer, wte=dwte if outer.wte is None else add_into(outer.wte, dwte), wpe=dwpe)
        dx = None
    return dx, outer, deferred


def stage_weight(units: ParamUnits, deferred: list) -> None:
    """The deferred weight halves of a split backward (a zero-bubble "W")."""
    for unit, w in deferred:
        grads = run_block_bwd_weight(units.get(unit), w, units.grad_slot(unit))
        units.release(unit)
        units.grads_ready(unit, grads)


def add_outer(total: GPT | None, part: GPT) -> GPT:
    """Sum two stage shares of the outer unit's grads (None parts are absent)."""
    if total is None:
        return part
    return GPT(blocks=(), **{name: _add_parts(getattr(total, name), getattr(part, name)) for name in outer_parts()})


def _add_parts(a: Any, b: Any) -> Any:
    """a + b of two shares of one outer part (into a's arrays; None absent). A module
    function: a closure calling itself is a reference cycle, garbage every step."""
    if a is None or b is None:
        return b if a is None else a
    if isinstance(a, np.ndarray):
        return add_into(a, b)  # large ones (a tied embedding's [V, C]) on the threads
    kids = zip(attrs.astuple(a, recurse=False), attrs.astuple(b, recurse=False))
    return type(a)(*(_add_parts(x, y) for x, y in kids))


# ---------------------------------------------------------------------------------------
# the whole model on one rank's stage (pp=1)


def loss_and_grads(params: GPT, idx: np.ndarray, targets: np.ndarray, cfg: GPTConfig, mesh: Mesh, loss_scale: float,
                   drop: DropoutKey | None = None, recompute: Recompute = "none") -> tuple[float, GPT]:
    """Sum of per-token losses × `loss_scale`, and its gradient w.r.t. this rank's shards.

    With `loss_scale = 1 / (tokens in the global batch)`, summing the results over
    micro-batches and dp ranks gives the global mean loss and its gradient. With sequence
    parallelism the norm gradients, and GQA's k and v with tp, are summed over tp here (the
    training loop leaves that to the optimiser, once per step). A ConfigError line, before
    any communication, for params of another config or mesh and for ids or targets that are
    not int [B, T] arrays of one shape, B and T >= 1, with every id in [0, vocab_size)
    (`numesh.nn.inputs`). Dropout is `drop`'s: without a key none is applied, whatever
    `cfg.dropout` says (the training loop makes a key of rate cfg.dropout for each
    micro-batch; evaluation passes none)."""
    idx, targets = check_inputs(params, idx, targets, cfg, mesh, need_targets=True)
    units = ResidentParams(params)
    stage = whole_model(cfg.n_layer)
    loss, ctx = stage_forward(units, stage, idx, targets, cfg, mesh, drop, recompute=recompute)
    _, outer, _ = stage_backward(units, stage, ctx, loss_scale, cfg, mesh)
    units.grads_ready(OUTER, outer)
    return float(loss.sum()) * loss_scale, reduce_tp_partial(units.grad_tree(), mesh)


def forward_loss(params: GPT, idx: np.ndarray, targets: np.ndarray, cfg: GPTConfig, mesh: Mesh) -> np.ndarray:
    """Per-token losses [B*T], forward only (evaluation)."""
    idx, targets = check_inputs(params, idx, targets, cfg, mesh, need_targets=True)
    loss, _ = stage_forward(ResidentParams(params), whole_model(cfg.n_layer), idx, targets, cfg, mesh, keep=False)
    return loss
