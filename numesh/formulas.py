"""Formulas in one place: memory per rank, bytes per axis per step, FLOPs per token and the
pipeline bubble, as pure functions. The tests check measurements against them (measured ==
formula), `numesh report` puts them beside what a traced run measured.

Bytes are payloads, the local buffer each call is given (`ByteCounter`'s "payload"): an
all-reduce of S bytes, an all-gather into S bytes, a reduce-scatter of S bytes, a send of S
bytes. `bus_bytes` turns them into NCCL-tests bus bytes.
"""

from __future__ import annotations

from typing import Iterable

import attrs

from numesh.pipeline.schedules import Schedule, simulate

SCALAR = 8  # one float64 all-reduced (loss, gradient norm)


def bus_bytes(op: str, payload: float, n: int) -> float:
    """NCCL-tests bus bytes of a call on n ranks: all-reduce 2(n-1)/n·S, all-gather and
    reduce-scatter (n-1)/n·S, anything else S."""
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}
    return payload * factor.get(op, 1.0)


def memory_formula(psi: int, dp: int, stage: int, itemsize: int = 4) -> dict[str, float]:
    """The ZeRO paper's bytes per rank for single-precision AdamW over Ψ parameters:
    params 4Ψ, grads 4Ψ, moments 8Ψ, each divided by N = dp where the stage shards it."""
    k = itemsize
    return {
        "params": k * psi / (dp if stage >= 3 else 1),
        "grads": k * psi / (dp if stage >= 2 else 1),
        "optimizer": 2 * k * psi / (dp if stage >= 1 else 1),
    }


def flops_per_token(n_layer: int, n_embd: int, block_size: int, n_params: int) -> float:
    """Training FLOPs per token: 6 per parameter plus attention (PaLM's appendix B)."""
    return 6.0 * n_params + 12.0 * n_layer * n_embd * block_size


def model_gemm_shapes(rows: int, n_embd: int, vocab_local: int, tp: int) -> list[tuple[int, int, int]]:
    """(m, k, n) of the model's own matrix multiplies on one rank for `rows` tokens: QKV,
    attention out, MLP up, MLP down (Megatron-split over tp) and the vocab-parallel head."""
    C = n_embd
    return [(rows, C, 3 * C // tp), (rows, C // tp, C), (rows, C, 4 * C // tp), (rows, 4 * C // tp, C),
            (rows, C, vocab_local)]


def mfu(achieved_flops: float, peak_flops: float) -> float:
    """Model FLOPs utilisation, never above 1: the peak is at least what was achieved (a
    step faster than the measured peak means the peak was measured low, not MFU > 1)."""
    if achieved_flops <= 0.0:
        return 0.0
    return achieved_flops / max(peak_flops, achieved_flops)


def dp_bytes(stage: int, micro_batches: int, padded_blocks: int, padded_outer: int, itemsize: int,
             split_backward: bool = False) -> dict[str, int]:
    """Payload bytes per op on the dp axis in one step for ZeRO `stage`, for this rank's
    units padded to a multiple of dp (blocks, and the embedding/head unit), with m micro-batches.

    Stage 0 all-reduces every gradient once; 1 reduce-scatters them and all-gathers the
    updated parameters; 2 reduce-scatters each block's gradient per micro-batch (it keeps no
    full gradient to accumulate into) and the outer unit's once (the executor sums it over
    micro-batches); 3 also gathers every unit for each micro-batch's forward and backward,
    and each block once more for its weight gradient when the schedule splits the backward
    (zero-bubble: W runs later, after the block was freed)."""
    m, k = micro_batches, itemsize
    P = padded_blocks + padded_outer
    per_mb = (m * padded_blocks + padded_outer) * k
    return {
        0: {"all_reduce": P * k},
        1: {"reduce_scatter": P * k, "all_gather": P * k},
        2: {"reduce_scatter": per_mb, "all_gather": P * k},
        3: {"reduce_scatter": per_mb, "all_gather": (2 * m * P + m * padded_blocks * split_backward) * k},
    }[stage]


@attrs.frozen
class Chunk:
    """What a rank's model chunk holds: its blocks, and whether it is the model's first
    (embedding) or last (head and loss) stage."""

    blocks: int
    first: bool
    last: bool


def tp_all_reduce_bytes(chunk: Chunk, rows: int, block_size: int, n_embd: int, itemsize: int) -> int:
    """Payload bytes all-reduced over tp by one micro-batch's forward and backward through
    a chunk (Megatron): per block the g of attention and MLP forward and the f of both
    halves backward (4 activations); the vocab-parallel embedding lookup (forward) and the
    LM head's input gradient (backward), one activation each; the cross-entropy's row
    maxima (pmax) and [sum-exp, target logit] (psum), 3 values per token."""
    act = rows * block_size * n_embd * itemsize
    total = 4 * chunk.blocks * act
    if chunk.first:
        total += act
    if chunk.last:
        total += act + 3 * rows * block_size * itemsize
    return total


def pp_send_bytes(chunk: Chunk, rows: int, block_size: int, n_embd: int, itemsize: int) -> int:
    """Payload bytes one micro-batch sends along pp from a chunk: its output activation
    forward (unless it is the last stage) and its input gradient backward (unless first)."""
    act = rows * block_size * n_embd * itemsize
    return act * (int(not chunk.last) + int(not chunk.first))


def norm_axes(shape: dict[str, int], zero: int) -> tuple[str, ...]:
    """Axes the gradient norm's partial sums are all-reduced over."""
    axes = [a for a in ("pp", "tp") if shape[a] > 1]
    if zero >= 1 and shape["dp"] > 1:
        axes.append("dp")
    return tuple(a for a in ("pp", "dp", "tp") if a in axes)


def step_bytes(
    shape: dict[str, int],
    zero: int,
    micro_batches: int,
    rows: int,
    block_size: int,
    n_embd: int,
    itemsize: int,
    chunks: Iterable[Chunk],
    padded_blocks: int,
    padded_outer: int,
    tied_bytes: int,
    split_backward: bool = False,
) -> dict[tuple[str, str], int]:
    """Payload bytes per (axes, op) one rank moves in one training step (axes as "dp",
    "pp+dp", or "pp[0,3]" for the tied-embedding group), sends but not receives.

    `rows` is a micro-batch's sequences on this rank; `chunks` this rank's model chunks;
    `padded_*` its units' sizes padded to dp; `tied_bytes` its wte gradient's bytes, summed
    between the first and last pp rank when pp > 1 (0 on other ranks); `split_backward`
    whether the schedule runs W apart from B (zb-h1)."""
    out: dict[tuple[str, str], int] = {}

    def add(axes: str, op: str, n: int) -> None:
        if n:
            out[(axes, op)] = out.get((axes, op), 0) + n

    chunks = list(chunks)
    m = micro_batches
    if shape["dp"] > 1:
        for op, n in dp_bytes(zero, m, padded_blocks, padded_outer, itemsize, split_backward).items():
            add("dp", op, n)
    if shape["tp"] > 1:
        add("tp", "all_reduce", m * sum(tp_all_reduce_bytes(c, rows, block_size, n_embd, itemsize) for c in chunks))
    if shape["pp"] > 1:
        add("pp", "send", m * sum(pp_send_bytes(c, rows, block_size, n_embd, itemsize) for c in chunks))
        if tied_bytes:
            add(f"pp[0,{shape['pp'] - 1}]", "all_reduce", tied_bytes)
    if shape["pp"] * shape["dp"] > 1:  # the step's loss
        add("pp+dp", "all_reduce", SCALAR)
    if axes := norm_axes(shape, zero):  # the gradient norm
        add("+".join(axes), "all_reduce", SCALAR)
    return out


def bubble(schedule: Schedule, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> dict:
    """The schedule's idle time on an ideal machine (`simulate`, no communication cost):
    the fraction `1 - busy / (p · makespan)` and each rank's idle fraction of the makespan."""
    tl = simulate(schedule, t_f=t_f, t_b=t_b, t_w=t_w)
    per_rank = [tl.idle(r) / tl.makespan if tl.makespan > 0 else 0.0 for r in range(schedule.p)]
    return {"fraction": tl.bubble_fraction, "per_rank": per_rank, "makespan": tl.makespan}
