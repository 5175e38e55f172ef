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


def tp_sequence_parallel_bytes(chunk: Chunk, rows: int, block_size: int, n_embd: int, itemsize: int) -> dict[str, int]:
    """Payload bytes per op over tp of one micro-batch's forward and backward through a chunk
    with sequence parallelism (Korthikanti et al. 2022). Each all-reduce of an activation in
    `tp_all_reduce_bytes` becomes an all-gather and a reduce-scatter of the full activation
    (payload = the gathered output, the scattered input): per block the gathers before QKV
    and MLP-up forward and their reduce-scatters backward, the reduce-scatters after the
    out-projection and MLP-down forward and their gathers backward; the embedding's lookup
    is reduce-scattered (its gradient gathered), the head's input gathered (its gradient
    reduce-scattered). The cross-entropy's 3 values per token stay all-reduces.

    Bus bytes are those of plain tp: an all-reduce of S moves 2(n-1)/n·S, a gather plus a
    scatter (n-1)/n·S each. The LayerNorm grads' once-per-step all-reduce comes on top
    (`step_bytes`, `tp_partial_values`)."""
    act = rows * block_size * n_embd * itemsize
    pairs = 4 * chunk.blocks + int(chunk.first) + int(chunk.last)
    out = {"all_gather": pairs * act, "reduce_scatter": pairs * act}
    if chunk.last:
        out["all_reduce"] = 3 * rows * block_size * itemsize
    return out


def pp_send_bytes(chunk: Chunk, rows: int, block_size: int, n_embd: int, itemsize: int, seq_split: int = 1) -> int:
    """Payload bytes one micro-batch sends along pp from a chunk: its output activation
    forward (unless it is the last stage) and its input gradient backward (unless first);
    with sequence parallelism each tp rank sends its 1/tp of the sequence (`seq_split` = tp)."""
    act = rows * block_size // seq_split * n_embd * itemsize
    return act * (int(not chunk.last) + int(not chunk.first))


def loss_axes(shape: dict[str, int]) -> tuple[str, ...]:
    """Axes a step's loss (a sum of per-token losses) is all-reduced over: the last pipeline
    stage holds it, each dp rank for its rows and, with cp, each cp rank for its tokens."""
    return ("pp", "dp", "cp") if shape.get("cp", 1) > 1 else ("pp", "dp")


def cp_ring_bytes(chunk: Chunk, rows: int, block_size: int, n_embd: int, tp: int, cp: int, itemsize: int) -> int:
    """Payload bytes one micro-batch sends around the cp ring through a chunk (ring
    attention, `numesh.nn.ring_attention`). A K or V block is rows × T/cp tokens × C/tp
    (this tp rank's heads); per layer the forward passes cp-1 K and V blocks, the backward
    cp-1 K and V blocks again and cp dK and dV accumulators (the last hop takes each home)."""
    if cp == 1:
        return 0
    blk = rows * (block_size // cp) * (n_embd // tp) * itemsize
    return chunk.blocks * (2 * (cp - 1) + 2 * (cp - 1) + 2 * cp) * blk


def cp_grad_bytes(zero: int, micro_batches: int, padded_blocks: int, padded_outer: int, itemsize: int) -> int:
    """Payload bytes of gradients all-reduced over cp alone in one step under ZeRO 1-3 (ZeRO
    0 all-reduces over dp×cp jointly instead: `dp_bytes` on "dp+cp"): stage 1 each unit
    once, stages 2/3 each block per micro-batch and the outer unit once (see `dp_bytes`)."""
    if zero == 0:
        return 0
    if zero == 1:
        return (padded_blocks + padded_outer) * itemsize
    return (micro_batches * padded_blocks + padded_outer) * itemsize


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
    sequence_parallel: bool = False,
    tp_partial_values: int = 0,
) -> dict[tuple[str, str], int]:
    """Payload bytes per (axes, op) one rank moves in one training step (axes as "dp",
    "pp+dp", or "pp[0,3]" for the tied-embedding group), sends but not receives.

    `rows` is a micro-batch's sequences on this rank; `chunks` this rank's model chunks;
    `padded_*` its units' sizes padded to dp; `tied_bytes` its wte gradient's bytes, summed
    between the first and last pp rank when pp > 1 (0 on other ranks); `split_backward`
    whether the schedule runs W apart from B (zb-h1); `sequence_parallel` whether tp also
    splits the sequence, and then `tp_partial_values` the LayerNorm gradient values this
    rank holds (its dp shard of them under ZeRO >= 1), all-reduced over tp once per step.
    With cp, add the ring's K/V traffic and the gradients' sum over cp (`cp_ring_bytes`,
    `cp_grad_bytes`)."""
    out: dict[tuple[str, str], int] = {}
    cp = shape.get("cp", 1)

    def add(axes: str, op: str, n: int) -> None:
        if n:
            out[(axes, op)] = out.get((axes, op), 0) + n

    chunks = list(chunks)
    m = micro_batches
    if shape["dp"] > 1 or (cp > 1 and zero == 0):
        for op, n in dp_bytes(zero, m, padded_blocks, padded_outer, itemsize, split_backward).items():
            if shape["dp"] > 1 or op == "all_reduce":
                add("dp+cp" if cp > 1 and zero == 0 else "dp", op, n)
    if cp > 1:
        add("cp", "send", m * sum(cp_ring_bytes(c, rows, block_size, n_embd, shape["tp"], cp, itemsize) for c in chunks))
        add("cp", "all_reduce", cp_grad_bytes(zero, m, padded_blocks, padded_outer, itemsize))
    t = block_size // cp  # tokens of each sequence on this rank
    if shape["tp"] > 1 and sequence_parallel:
        for c in chunks:
            for op, n in tp_sequence_parallel_bytes(c, rows, t, n_embd, itemsize).items():
                add("tp", op, m * n)
        add("tp", "all_reduce", tp_partial_values * itemsize)
    elif shape["tp"] > 1:
        add("tp", "all_reduce", m * sum(tp_all_reduce_bytes(c, rows, t, n_embd, itemsize) for c in chunks))
    if shape["pp"] > 1:
        split = shape["tp"] if sequence_parallel else 1
        add("pp", "send", m * sum(pp_send_bytes(c, rows, t, n_embd, itemsize, split) for c in chunks))
        if tied_bytes:
            add(f"pp[0,{shape['pp'] - 1}]", "all_reduce", tied_bytes)
    if shape["pp"] * shape["dp"] * cp > 1:  # the step's loss
        add("+".join(loss_axes(shape)), "all_reduce", SCALAR)
    if axes := norm_axes(shape, zero):  # the gradient norm
        add("+".join(axes), "all_reduce", SCALAR)
    return out


def bubble(schedule: Schedule, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0,
           stage_costs: dict[tuple[str, int], float] | None = None) -> dict:
    """The schedule's idle time on an ideal machine (`simulate`, no communication cost):
    the fraction `1 - busy / (p · makespan)` and each rank's idle fraction of the makespan.
    `stage_costs` gives (kind, global stage) its own cost (see `simulate`)."""
    tl = simulate(schedule, t_f=t_f, t_b=t_b, t_w=t_w, stage_costs=stage_costs)
    per_rank = [tl.idle(r) / tl.makespan if tl.makespan > 0 else 0.0 for r in range(schedule.p)]
    return {"fraction": tl.bubble_fraction, "per_rank": per_rank, "makespan": tl.makespan}


# ---------------------------------------------------------------------------------------
# Memory per rank: parameter units, ZeRO buffers and saved activations
#
# Counted the way numesh measures them: `ZeroOptimizer.memory()` for the buffers held
# between steps, `StepStats.peak_bytes` (the `nbytes` of the contexts the executor holds)
# for activations. The planner (numesh.plan) builds its predictions from these.

TOKEN_ID_BYTES = 8  # token ids and targets are int64 (numesh.data.read_rows)


def padded_vocab(vocab: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of tp (GPTConfig.padded_vocab)."""
    return -(-vocab // tp) * tp


def block_params(n_embd: int, tp: int = 1, bias: bool = False) -> int:
    """Values of one transformer block on one tp rank: QKV, MLP-up (column-parallel) and
    attention-out, MLP-down (row-parallel) split over tp; the two LayerNorms replicated;
    row-parallel biases replicated, column-parallel ones split."""
    C = n_embd
    n = 12 * C * C // tp + 2 * C
    if bias:
        n += 2 * C + 3 * C // tp + C + 4 * C // tp + C
    return n


def outer_params(n_embd: int, vocab: int, block_size: int, tp: int = 1, first: bool = True, last: bool = True,
                 bias: bool = False) -> int:
    """Values of the outer unit on one rank: the vocab-parallel wte (first and last stage,
    tied), wpe (first stage) and the final LayerNorm (last stage)."""
    C = n_embd
    n = padded_vocab(vocab, tp) // tp * C if (first or last) else 0
    n += block_size * C if first else 0
    n += (2 * C if bias else C) if last else 0
    return n


def zero_buffer_bytes(unit_sizes: Iterable[int], dp: int, stage: int, itemsize: int = 4) -> dict[str, int]:
    """`ZeroOptimizer.memory()` of a rank whose units hold `unit_sizes` values: each unit
    padded to a multiple of dp; parameters, gradients and AdamW's two moments whole or as
    this rank's 1/dp as the stage says; the workspace is AdamW's scratch (one state-sized
    buffer) and the weight-decay and norm masks (a byte per state value each)."""
    padded = [-(-n // dp) * dp for n in unit_sizes]
    full, shard = sum(padded), sum(p // dp for p in padded)
    state = shard if stage >= 1 else full
    return {
        "params": (shard if stage >= 3 else full) * itemsize,
        "grads": (shard if stage >= 2 else full) * itemsize,
        "optimizer": 2 * state * itemsize,
        "workspace": state * itemsize + 2 * state,
    }


def activation_bytes(*, micro_batch: int, seq: int, n_embd: int, n_head: int, n_layer: int, vocab: int, tp: int = 1,
                     first: bool = True, last: bool = True, recompute: str = "none", dropout: bool = False,
                     itemsize: int = 4) -> int:
    """Bytes of saved activations one micro-batch leaves on a stage of `n_layer` blocks
    (what `numesh.nn.stage.StageCtx` holds after its forward, as `nbytes` counts it).

    Per block, with b·T tokens and H/tp local heads: LayerNorm 1 and 2 keep x̂ [bTC] and
    1/σ [bT] and give their output to a matmul [bTC]; attention keeps q, k, v [bTC/tp] and
    the softmax [b,H/tp,T,T] (and, with dropout, its mask of the same size); the attention
    output [bTC/tp]; GELU keeps its input and tanh [4bTC/tp each] and gives its output to
    MLP-down [4bTC/tp]. The first stage keeps the token ids (int64; with tp, the ids local to
    its vocabulary slice and a byte mask of those outside it); the last the final LayerNorm's x̂, 1/σ and output, the
    local logits [bT, V/tp], the sum-exp [bT], the local targets (int64) and a byte mask."""
    if recompute != "none":
        raise ValueError(f"recompute={recompute!r} is not implemented on this branch (only 'none')")
    b, T, C, k = micro_batch, seq, n_embd, itemsize
    bt = b * T
    heads = n_head // tp
    per_block = (4 * bt * C + 2 * bt + 16 * bt * C // tp + b * heads * T * T * (2 if dropout else 1)) * k
    total = n_layer * per_block
    if first:
        total += bt * TOKEN_ID_BYTES + (bt if tp > 1 else 0)
    if last:
        v_local = padded_vocab(vocab, tp) // tp
        total += (2 * bt * C + 2 * bt + bt * v_local) * k + bt * TOKEN_ID_BYTES + bt
    return total


def weight_grad_bytes(*, micro_batch: int, seq: int, n_embd: int, n_layer: int, tp: int = 1, bias: bool = False,
                      chunks: int = 1, itemsize: int = 4) -> int:
    """Bytes a split backward (zero-bubble B) keeps for the W of one micro-batch on a stage
    of `n_layer` blocks: per block each Linear's input and output gradient (QKV [bTC] and
    [3bTC/tp], attention-out [bTC/tp] and [bTC], MLP-up [bTC] and [4bTC/tp], MLP-down
    [4bTC/tp] and [bTC]) and the two LayerNorms' gradients, once per thread chunk."""
    bt, C = micro_batch * seq, n_embd
    ln = (4 if bias else 2) * C * chunks
    return n_layer * (4 * bt * C + 12 * bt * C // tp + ln) * itemsize
