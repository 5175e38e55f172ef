"""Predicted memory of every rank of a layout, from `numesh.formulas`.

Parameters, gradients, optimiser state and workspace are what `ZeroOptimizer.memory()`
measures (exact: the same units, padding and sharding); activations are the peak of the
saved contexts along the rank's action list, as the executor counts `peak_bytes` (exact
for the contexts numesh holds today); communication buffers are the transient copies a
step makes besides them (not measured by numesh: ZeRO-3's gathered unit, ZeRO-2/3's
per-unit reduce-scatter input).
"""

from __future__ import annotations

import functools

import attrs

from numesh import formulas
from numesh.nn.walk import row_chunks as stage_row_chunks
from numesh.padding import round_up
from numesh.pipeline.schedules import Schedule
from numesh.plan.layout import Layout, ModelSpec, schedule_of

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


def unit_sizes(model: ModelSpec, layout: Layout, pp_rank: int) -> list[int]:
    """Values of each parameter unit on pipeline rank `pp_rank` (its blocks, then the outer unit)."""
    blocks = model.n_layer // layout.pp
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    outer = formulas.outer_params(model.n_embd, model.vocab_size, model.block_size, layout.tp, first, last, model.bias)
    return [formulas.block_params(model.n_embd, layout.tp, model.bias)] * blocks + [outer]


def row_chunks(model: ModelSpec, layout: Layout, threads: int) -> int:
    """Runs of pieces a block of this layout runs as on `threads` (numesh.nn.walk.row_chunks)."""
    return stage_row_chunks(threads, layout.tp, layout.cp, layout.rows(model), model.block_size // layout.cp)


def _chunk_bytes(model: ModelSpec, layout: Layout, sched: Schedule, pp_rank: int, chunk: int, itemsize: int,
                 threads: int) -> tuple[int, int]:
    """(bytes after F, bytes kept after a split B) of one micro-batch through one chunk."""
    k = sched.stage(pp_rank, chunk)
    per_chunk = model.n_layer // (layout.pp * layout.virtual_stages)
    rows = layout.rows(model)
    # activation_bytes takes the whole sequence and cp (each rank keeps seq/cp tokens);
    # the W contexts are Linear inputs and output grads, so this rank's tokens
    f = formulas.activation_bytes(
        micro_batch=rows, seq=model.block_size, n_embd=model.n_embd, n_head=model.n_head, n_layer=per_chunk,
        vocab=model.vocab_size, tp=layout.tp, first=k == 0, last=k == sched.num_stages - 1,
        recompute=layout.recompute, dropout=model.dropout, itemsize=itemsize, sp=layout.sp, cp=layout.cp,
    )
    w = formulas.weight_grad_bytes(micro_batch=rows, seq=model.block_size // layout.cp, n_embd=model.n_embd,
                                   n_layer=per_chunk, tp=layout.tp, bias=model.bias,
                                   chunks=row_chunks(model, layout, threads), itemsize=itemsize)
    return f, w


def peak_activation_bytes(model: ModelSpec, layout: Layout, pp_rank: int, itemsize: int = 4, threads: int = 1,
                          sched: Schedule | None = None) -> int:
    """The most saved-activation bytes rank `pp_rank` holds at once: its action list walked
    as the executor walks it (F adds a context, B frees it or, when the backward is split,
    keeps the W's inputs until W)."""
    sched = sched or layout.sched
    cost = tuple(_chunk_bytes(model, layout, sched, pp_rank, c, itemsize, threads)
                 for c in range(layout.virtual_stages))
    return _walk(sched.name, sched.p, sched.m, sched.v, pp_rank, cost)


@functools.lru_cache(maxsize=4096)
def _walk(name: str, pp: int, m: int, v: int, pp_rank: int, cost: tuple[tuple[int, int], ...]) -> int:
    """`peak_activation_bytes`' walk, cached: layouts that differ only in their ZeRO stage
    hold the same activations (a walk of a 98k-action schedule is milliseconds)."""
    sched = schedule_of(name, pp, m, v)
    live: dict[tuple[int, int], int] = {}
    peak = 0
    for a in sched.actions[pp_rank]:
        key = (a.mb, a.chunk)
        if a.kind == "F":
            live[key] = cost[a.chunk][0]
        elif a.kind == "B" and sched.split_backward:
            live[key] = cost[a.chunk][1]
        else:
            live.pop(key, None)
        peak = max(peak, sum(live.values()))
    return peak


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
    (`ZeroOptimizer`'s flat layout: cp ranks sum their gradients, then dp shards them)."""
    sizes = unit_sizes(model, layout, pp_rank)
    buffers = formulas.zero_buffer_bytes(sizes, layout.dp, layout.zero, itemsize)
    return RankMemory(
        **buffers,
        activations=peak_activation_bytes(model, layout, pp_rank, itemsize, threads, sched),
        comm_buffers=comm_buffer_bytes(model, layout, sizes, itemsize),
    )


def layout_memory(model: ModelSpec, layout: Layout, itemsize: int = 4, threads: int = 1) -> list[RankMemory]:
    """Predicted bytes of the pipeline ranks that can hold the most: the first (embedding),
    the last (head) and the second (the middle rank that starts the most micro-batches
    before its first backward: the schedules warm up less on every later rank)."""
    return [rank_memory(model, layout, r, itemsize, threads, layout.sched)
            for r in sorted({0, min(1, layout.pp - 1), layout.pp - 1})]
