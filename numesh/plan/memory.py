"""Predicted memory of every rank of a layout, from `numesh.perf.formulas`.

Parameters, gradients, optimiser state and workspace are what `ZeroOptimizer.memory()`
measures (exact: the same units, padding and sharding; the state of an optimiser with
several rules, Muon's, is their expected share of a ZeRO slice: numesh/plan/optimizer.py);
activations are the peak of the saved contexts along the rank's action list, as the executor counts `peak_bytes` (exact
for the contexts numesh holds today); communication buffers are the transient copies a
step makes besides them (not measured by numesh: ZeRO-3's gathered unit, ZeRO-2/3's
per-unit reduce-scatter input).
"""

from __future__ import annotations

import functools

import attrs
import numpy as np

from numesh.base.padding import round_up
from numesh.nn.walk import row_chunks as stage_row_chunks
from numesh.perf import formulas
from numesh.pipeline.schedules import Schedule
from numesh.pipeline.stages import StageLayout
from numesh.plan.layout import Layout, ModelSpec, schedule_of
from numesh.plan.optimizer import rank_units, state_values

PARTS = ("params", "grads", "optimizer", "workspace", "activations", "comm_buffers")


@attrs.frozen
class RankMemory:
    """Bytes one rank holds, by part (`PARTS`)."""

    params: int
    grads: int
    optimizer: int
    workspace: int
    activations: int
    comm_buffers: int

    @property
    def total(self) -> int:
        return sum(attrs.astuple(self))

    @property
    def measured_parts(self) -> int:
        """What numesh measures: `ZeroOptimizer.memory()` plus `StepStats.peak_bytes`."""
        return self.total - self.comm_buffers


def moe_block_rank_params(n_embd: int, experts: int, ep: int, tp: int, bias: bool,
                          parts: formulas.Parts = formulas.GPT2) -> int:
    """Values of one MoE block on one (ep, tp) rank: the router and the dense block's attention
    and norms (replicated over ep) and E/ep experts, each tp-split like the dense MLP.
    ep = tp = 1 gives `formulas.moe_block_params`."""
    return (formulas.moe_block_other_values(n_embd, experts, tp, bias, parts)
            + formulas.moe_expert_values(n_embd, experts, ep, tp, bias, parts))


def block_sizes(model: ModelSpec, layout: Layout, layers: range | list[int]) -> list[int]:
    """Values of each block unit among `layers` on one rank of the layout."""
    dense = formulas.block_params(model.n_embd, layout.tp, model.bias, model.parts)
    moe = (moe_block_rank_params(model.n_embd, model.moe_experts, layout.ep, layout.tp, model.bias, model.parts)
           if model.moe_experts else dense)
    return [moe if model.is_moe(i) else dense for i in layers]


def rank_layers(model: ModelSpec, layout: Layout, pp_rank: int) -> list[int]:
    """The global blocks pipeline rank `pp_rank` holds (stage chunk·pp + rank of each chunk)."""
    return StageLayout(model.n_layer, layout.pp, layout.virtual_stages).owned(pp_rank)


def unit_sizes(model: ModelSpec, layout: Layout, pp_rank: int) -> list[int]:
    """Values of each parameter unit on pipeline rank `pp_rank` (its blocks, then the outer unit)."""
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    outer = formulas.outer_params(model.n_embd, model.vocab_size, model.block_size, layout.tp, first, last, model.bias,
                                  model.parts)
    if not model.moe_experts:  # the dense model's blocks all alike
        block = formulas.block_params(model.n_embd, layout.tp, model.bias, model.parts)
        return [block] * (model.n_layer // layout.pp) + [outer]
    return list(_moe_block_units(model, layout.tp, layout.ep, layout.pp, layout.virtual_stages, pp_rank)) + [outer]


@functools.lru_cache(maxsize=4096)
def _moe_block_units(model: ModelSpec, tp: int, ep: int, pp: int, v: int, pp_rank: int) -> tuple[int, ...]:
    """`unit_sizes`' blocks of a model with experts, once per mesh (a plan asks for each many times)."""
    lay = Layout(1, tp, pp, 0, "1f1b", 1, v, ep=ep)
    return tuple(block_sizes(model, lay, rank_layers(model, lay, pp_rank)))


def activation_shape(model: ModelSpec, layout: Layout, itemsize: int) -> formulas.ActivationShape:
    """The sizes of one micro-batch's activations on a rank of the layout (the formulas' `ActivationShape`)."""
    return formulas.ActivationShape(layout.rows(model), model.block_size, model.n_embd, model.n_head, layout.tp,
                                    layout.cp, layout.sp, layout.recompute, itemsize, model.parts)


def moe_activation_delta(model: ModelSpec, layout: Layout, itemsize: int) -> int:
    """An MoE block's saved bytes (`formulas.moe_activation_parts`) less a dense block's
    (`formulas.activation_bytes`), on one micro-batch of N = b·T/cp tokens. Routing is
    assumed balanced: every expert gets N·ep·k/E of its ep group's assignments, so this
    rank's E/ep experts receive the N·k rows it sends (exact on ep = 1, dropless); a capacity
    factor's drops are not counted (fewer rows)."""
    shape = activation_shape(model, layout, itemsize)
    rows = shape.micro_batch * shape.tokens * model.moe_top_k
    moe = formulas.moe_activation_parts(shape, formulas.ExpertShape(model.moe_experts, model.moe_top_k, layout.ep),
                                        rows_sent=rows, rows_received=rows)
    dense = formulas.activation_bytes(shape, formulas.Chunk(1, first=False, last=False), model.vocab_size)
    return sum(moe.values()) - dense


def moe_weight_delta(model: ModelSpec, layout: Layout, itemsize: int, chunks: int) -> int:
    """A zero-bubble W context of an MoE block less a dense one's (`formulas.weight_ctx_bytes`):
    no MLP Linear inputs and output gradients (h2, dz [b,s,C]; MLP-up's F/tp output
    gradient and the activation's output, and SwiGLU's gate output gradient), the MoE MLP's
    weight gradients instead (all made in B: the router and this rank's experts), its norm
    gradients once (an MoE block runs whole)."""
    n = layout.rows(model) * (model.block_size // layout.cp)
    C, tp, parts = model.n_embd, layout.tp, model.parts
    mlp_io = itemsize * (2 * n * C + parts.mlp_matrices * n * parts.ffn(C) // tp)
    experts = formulas.moe_expert_values(C, model.moe_experts, layout.ep, tp, model.bias, parts)
    grads = (C * model.moe_experts + experts) * itemsize
    ln = (chunks - 1) * 2 * parts.norm_values(C, model.bias) * itemsize
    return grads - mlp_io - ln


def row_chunks(model: ModelSpec, layout: Layout, threads: int) -> int:
    """Runs of pieces a block of this layout runs as on `threads` (numesh.nn.walk.row_chunks)."""
    return stage_row_chunks(threads, layout.tp, layout.cp, layout.rows(model), model.block_size // layout.cp)


def _saved_bytes(model: ModelSpec, layout: Layout, pp_rank: int, chunk: int, itemsize: int) -> int:
    """Bytes one micro-batch's F leaves through one chunk of rank `pp_rank` (global stage
    chunk·pp + rank, as `Schedule.stage` numbers them)."""
    k, stages = chunk * layout.pp + pp_rank, layout.pp * layout.virtual_stages
    per_chunk = model.n_layer // stages
    shape = activation_shape(model, layout, itemsize)
    f = formulas.activation_bytes(shape, formulas.Chunk(per_chunk, k == 0, k == stages - 1), model.vocab_size)
    if model.moe_experts:
        f += model.moe_blocks(k * per_chunk, (k + 1) * per_chunk) * moe_activation_delta(model, layout, itemsize)
    return f


def _chunk_bytes(model: ModelSpec, layout: Layout, pp_rank: int, chunk: int, itemsize: int,
                 threads: int) -> tuple[int, int]:
    """(bytes after F, bytes kept after a split B) of one micro-batch through one chunk."""
    k, per_chunk = chunk * layout.pp + pp_rank, model.n_layer // (layout.pp * layout.virtual_stages)
    shape = activation_shape(model, layout, itemsize)
    w = formulas.weight_grad_bytes(shape, per_chunk, model.bias, row_chunks(model, layout, threads))
    if model.moe_experts:
        w += model.moe_blocks(k * per_chunk, (k + 1) * per_chunk) * moe_weight_delta(
            model, layout, itemsize, row_chunks(model, layout, threads))
    return _saved_bytes(model, layout, pp_rank, chunk, itemsize), w


def peak_activation_bytes(model: ModelSpec, layout: Layout, pp_rank: int, itemsize: int = 4, threads: int = 1,
                          sched: Schedule | None = None) -> int:
    """The most saved-activation bytes rank `pp_rank` holds at once: its action list walked
    as the executor walks it (F adds a context, B frees it or, when the backward is split,
    keeps the W's inputs until W)."""
    sched = sched or layout.sched
    cost = tuple(_chunk_bytes(model, layout, pp_rank, c, itemsize, threads)
                 for c in range(layout.virtual_stages))
    return _walk(sched.name, sched.p, sched.m, sched.v, pp_rank, cost, shared_bytes(model, layout, itemsize))


def shared_bytes(model: ModelSpec, layout: Layout, itemsize: int) -> tuple[int, int]:
    """What every F context and every deferred W of a rank hold in common, counted once
    (`formulas.peak_activation_bytes`' `shared`): the rotary tables, which a fully
    recomputed block's F does not keep."""
    tables = formulas.rotary_table_bytes(activation_shape(model, layout, itemsize))
    return (0 if layout.recompute == "full" else tables), tables


@functools.lru_cache(maxsize=4096)
def _walk(name: str, pp: int, m: int, v: int, pp_rank: int, cost: tuple[tuple[int, int], ...],
          shared: tuple[int, int] = (0, 0)) -> int:
    """`formulas.peak_activation_bytes` (as the executor holds them) of one rank, cached:
    layouts that differ only in their ZeRO stage hold the same activations. Vectorised over
    the rank's actions (`_events`): the formula's loop in Python was a third of a 64-rank
    plan's time (`python -m cProfile`); tests/test_plan.py holds the two equal."""
    chunk, f, b, w = _events(name, pp, m, v, pp_rank)
    if not len(chunk):
        return 0
    split = schedule_of(name, pp, m, v).split_backward
    keep = np.array([c[0] for c in cost], np.int64)[chunk]  # an F's context, by chunk
    defer = np.array([c[1] for c in cost], np.int64)[chunk] if split else np.zeros(len(chunk), np.int64)
    held = np.cumsum(np.where(f, keep, 0) - np.where(b, keep - defer, 0) - np.where(w, defer, 0))
    contexts = np.cumsum(f.astype(np.int64) - b)  # live F contexts after each action
    waiting = np.cumsum(b.astype(np.int64) - w) if split else np.zeros(len(chunk), np.int64)
    common = np.maximum(np.where(contexts > 0, shared[0], 0), np.where(waiting > 0, shared[1], 0))
    return int((held + common).max())


@functools.lru_cache(maxsize=64)
def _events(name: str, pp: int, m: int, v: int, pp_rank: int) -> tuple[np.ndarray, ...]:
    """One rank's actions in order as arrays: chunk, and whether each is an F, a B or a W."""
    acts = schedule_of(name, pp, m, v).actions[pp_rank]
    kinds = np.array([a.kind for a in acts])
    return (np.array([a.chunk for a in acts], np.int64), kinds == "F", kinds == "B", kinds == "W")


def comm_buffer_bytes(model: ModelSpec, layout: Layout, sizes: list[int], itemsize: int) -> int:
    """Transient buffers beside the measured ones: the largest unit gathered whole (ZeRO-3),
    and the largest unit's reduce-scatter input (ZeRO 2/3 keep no full gradient)."""
    if layout.dp == 1:
        return 0
    largest = max(round_up(n, layout.dp) for n in sizes) * itemsize
    return {0: 0, 1: 0, 2: largest, 3: 2 * largest}[layout.zero]


def rank_memory(model: ModelSpec, layout: Layout, pp_rank: int, itemsize: int = 4, threads: int = 1,
                sched: Schedule | None = None) -> RankMemory:
    """Predicted bytes of pipeline rank `pp_rank` (every dp, cp and tp rank of it holds the
    same). Parameters are replicated over cp and ZeRO shards over dp alone
    (`ZeroOptimizer`'s flat layout: cp ranks sum their gradients, then dp shards them); an
    MoE block holds E/ep experts on each ep rank, ZeRO still sharding over dp only."""
    buffers, comm = rank_buffers(model, layout, pp_rank, itemsize)
    return RankMemory(
        **buffers,
        activations=peak_activation_bytes(model, layout, pp_rank, itemsize, threads, sched),
        comm_buffers=comm,
    )


def rank_buffers(model: ModelSpec, layout: Layout, pp_rank: int, itemsize: int = 4) -> tuple[dict[str, int], int]:
    """`rank_memory`'s parts that no schedule changes: (params, grads, optimizer and
    workspace bytes, communication buffer bytes) of pipeline rank `pp_rank`. They depend on
    the mesh, ZeRO stage and virtual stages alone, so they are worked out once for all the
    layouts that differ in the rest (schedule, micro-batches, cp, sp, recomputation)."""
    key = attrs.evolve(layout, schedule="1f1b", micro_batches=1, recompute="none", cp=1, sp=False)
    buffers, comm = _rank_buffers(model, key, pp_rank, itemsize)
    return dict(buffers), comm


@functools.lru_cache(maxsize=4096)
def _rank_buffers(model: ModelSpec, layout: Layout, pp_rank: int, itemsize: int) -> tuple[tuple[tuple[str, int], ...],
                                                                                          int]:
    sizes = unit_sizes(model, layout, pp_rank)
    rules = rank_units(model, layout, rank_layers(model, layout, pp_rank), pp_rank == 0, pp_rank == layout.pp - 1)
    buffers = formulas.zero_buffer_bytes(sizes, layout.dp, layout.zero, itemsize, state_values(model, layout, rules))
    return tuple(buffers.items()), comm_buffer_bytes(model, layout, sizes, itemsize)


def largest_ranks(layout: Layout) -> list[int]:
    """The pipeline ranks that can hold the most: the first (embedding), the last (head) and
    the second (the middle rank that starts the most micro-batches before its first
    backward: the schedules warm up less on every later rank)."""
    return sorted({0, min(1, layout.pp - 1), layout.pp - 1})


def layout_memory(model: ModelSpec, layout: Layout, itemsize: int = 4, threads: int = 1) -> list[RankMemory]:
    """Predicted bytes of the `largest_ranks`."""
    return [rank_memory(model, layout, r, itemsize, threads, layout.sched) for r in largest_ranks(layout)]


def blocks_floor(model: ModelSpec, layout: Layout, itemsize: int = 4) -> int:
    """A lower bound of the largest `layout_memory` total in a few multiplications, listing
    nothing per block: the parameters and gradients of a rank's n_layer/pp blocks, each of
    the smallest block's values, as one unit through `formulas.zero_buffer_bytes` (one unit
    pads no more than many), sharded as the ZeRO stage says. `memory_floor` and
    `layout_memory` list every block of a rank: for `--n-layer 1000000000` that list alone
    was a MemoryError, so this is asked first and such a model is refused in one line."""
    dense = formulas.block_params(model.n_embd, layout.tp, model.bias, model.parts)
    smallest = min(dense, moe_block_rank_params(model.n_embd, model.moe_experts, layout.ep, layout.tp, model.bias,
                                                model.parts)) if model.moe_experts else dense
    buffers = formulas.zero_buffer_bytes([model.n_layer // layout.pp * smallest], layout.dp, layout.zero, itemsize)
    return buffers["params"] + buffers["grads"]


def memory_floor(model: ModelSpec, layout: Layout, itemsize: int = 4) -> int:
    """A lower bound of the largest `layout_memory` total, found without building the
    schedule: each rank's buffers, exactly (no schedule changes them), and one micro-batch's
    context through its smallest chunk (each rank's first F holds one until its B frees it).
    The planner drops a layout whose floor is over the memory limit before it builds the
    layout's schedule: for a big model on few ranks, schedules of 300k actions that could
    never run."""
    v = layout.virtual_stages
    # a dense model's chunks differ only in holding the first or the last stage: 0, 1 and v - 1 cover them
    chunks = range(v) if model.moe_experts else sorted({0, min(1, v - 1), v - 1})

    def floor(pp_rank: int) -> int:
        buffers, comm = rank_buffers(model, layout, pp_rank, itemsize)
        one = min(_saved_bytes(model, layout, pp_rank, c, itemsize) for c in chunks)
        return sum(buffers.values()) + one + comm

    return max(floor(r) for r in largest_ranks(layout))
