"""Formulas in one place: memory per rank, bytes per axis per step, FLOPs per token and the
pipeline bubble, as pure functions. The tests check measurements against them (measured ==
formula), `numesh report` puts them beside what a traced run measured.

Bytes are payloads, the local buffer each call is given (`ByteCounter`'s "payload"): an
all-reduce of S bytes, an all-gather into S bytes, a reduce-scatter of S bytes, a send of S
bytes. `bus_bytes` turns them into NCCL-tests bus bytes.
"""

from __future__ import annotations

from typing import Callable, Iterable

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


def tp_all_reduce_bytes(chunk: Chunk, rows: int, block_size: int, n_embd: int, itemsize: int,
                        recompute: str = "none") -> int:
    """Payload bytes all-reduced over tp by one micro-batch's forward and backward through
    a chunk (Megatron): per block the g of attention and MLP forward and the f of both
    halves backward (4 activations), 6 under full recomputation (backward reruns the
    forward, its two g's included; selective recomputes no communicating op); the
    vocab-parallel embedding lookup (forward) and the LM head's input gradient (backward),
    one activation each; the cross-entropy's row maxima (pmax) and [sum-exp, target logit]
    (psum), 3 values per token."""
    act = rows * block_size * n_embd * itemsize
    total = (6 if recompute == "full" else 4) * chunk.blocks * act
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
    recompute: str = "none",
) -> dict[tuple[str, str], int]:
    """Payload bytes per (axes, op) one rank moves in one training step (axes as "dp",
    "pp+dp", or "pp[0,3]" for the tied-embedding group), sends but not receives.

    `rows` is a micro-batch's sequences on this rank; `chunks` this rank's model chunks;
    `padded_*` its units' sizes padded to dp; `tied_bytes` its wte gradient's bytes, summed
    between the first and last pp rank when pp > 1 (0 on other ranks); `split_backward`
    whether the schedule runs W apart from B (zb-h1); `recompute` the activation
    recomputation ("full" reruns each block's forward tp all-reduces in backward)."""
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
        add("tp", "all_reduce",
            m * sum(tp_all_reduce_bytes(c, rows, block_size, n_embd, itemsize, recompute) for c in chunks))
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


# ---------------------------------------------------------------------------------------
# activation memory


ID_BYTES = 8  # token ids and targets are int64 (numesh.data.read_rows)


def activation_parts(*, micro_batch: int, seq: int, n_embd: int, n_head: int, n_layer: int, vocab: int, tp: int = 1,
                     first: bool = True, last: bool = True, recompute: str = "none", dropout: bool = False,
                     itemsize: int = 4) -> dict[str, int]:
    """`activation_bytes` part by part: what numesh's forward saves for backward, in bytes,
    for one micro-batch of b = `micro_batch` sequences of s = `seq` tokens, width h =
    `n_embd`, a = `n_head` heads, t = `tp`, k = `itemsize` (the activation dtype's).

    Per block (numesh.nn.transformer.BlockCtx, each array counted once):
      "block_replicated"  k·(4·sbh + 2·sb): LayerNorm 1 and 2 each keep x̂ [b,s,h] and 1/σ
                          [b,s,1], and their outputs h1, h2 [b,s,h] (the QKV and MLP-up
                          inputs). Replicated over tp: Megatron sequence parallelism
                          divides this part by t (`sp` plugs in here).
      "block_sharded"     k·17·sbh/t: the scaled queries (1), the QKV output that k and v
                          are views of (3), the attention output (1), the MLP-up output,
                          GELU's tanh and GELU's output (4 each).
      "block_stats"       k·2·a·sb/t: each score row's maximum and 1/Σexp, which let
                          selective recomputation rebuild the probabilities without the
                          row reductions.
      "block_scores"      k·(1 + d)·a·s²·b/t: the softmax probabilities [b, a/t, s, s] and,
                          with dropout (d = 1), their mask. Selective recomputation drops
                          this part.
      "block_input"       k·sbh: full recomputation keeps only the block's input, instead
                          of the four parts above.
    Residual and embedding dropout masks are redrawn in backward, never kept. So a block
    holds k·(sbh·(4 + 17/t) + 2·sb + 2·a·sb/t + (1 + d)·a·s²·b/t) bytes (Korthikanti et
    al. count 34·sbh + 5·a·s²·b for fp16 with byte masks: numesh keeps x̂ beside the
    LayerNorm output, and neither the residual masks nor the dropped-out probabilities),
    k·(sbh·(4 + 17/t) + 2·sb + 2·a·sb/t) under selective recomputation (no s² term) and
    k·sbh under full.

    Outside the blocks:
      "embed"  (first stage) the token ids, int64 [b,s]; with tp > 1 instead the ids
               relative to this rank's vocabulary slice (int64) and which fall outside it
               (bool), 9·sb.
      "head"   (last stage) the final LayerNorm's x̂, 1/σ and output, k·(2·sbh + sb); the
               exponentiated logits [b·s, V/t] (V padded to a multiple of t) and the
               [sum-exp, target logit] pair, k·(sb·V/t + 2·sb); the targets relative to the
               vocabulary slice (int64) and whether they are inside it (bool), 9·sb.

    Context parallelism (a `cp` axis splitting the sequence) divides s by cp in every
    term linear in s; the s² term becomes (s/cp)·s for the queries' keys, or whatever
    ring attention keeps: it plugs in as s → s/cp here and in "block_scores"."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    b, s, h, a, t, k = micro_batch, seq, n_embd, n_head, tp, itemsize
    sb, sbh = s * b, s * b * h
    parts: dict[str, int] = {}
    if recompute == "full":
        parts["block_input"] = n_layer * k * sbh
    else:
        parts["block_replicated"] = n_layer * k * (4 * sbh + 2 * sb)
        parts["block_sharded"] = n_layer * k * 17 * sbh // t
        parts["block_stats"] = n_layer * k * 2 * a * sb // t
        if recompute == "none":
            parts["block_scores"] = n_layer * k * (1 + int(dropout)) * a * s * s * b // t
    if first:
        parts["embed"] = sb * ID_BYTES + (sb if t > 1 else 0)
    if last:
        v_local = -(-vocab // t)  # the vocabulary padded to a multiple of t, this rank's slice
        parts["head"] = k * (2 * sbh + sb) + k * (sb * v_local + 2 * sb) + sb * (ID_BYTES + 1)
    return parts


def activation_bytes(*, micro_batch: int, seq: int, n_embd: int, n_head: int, n_layer: int, vocab: int, tp: int = 1,
                     first: bool = True, last: bool = True, recompute: str = "none", dropout: bool = False,
                     itemsize: int = 4) -> int:
    """Bytes of saved activations one micro-batch leaves on a pipeline stage holding
    `n_layer` blocks (plus the embedding if `first`, the final LayerNorm, head and loss if
    `last`) between its forward and its backward: the sum of `activation_parts`."""
    return sum(activation_parts(micro_batch=micro_batch, seq=seq, n_embd=n_embd, n_head=n_head, n_layer=n_layer,
                                vocab=vocab, tp=tp, first=first, last=last, recompute=recompute, dropout=dropout,
                                itemsize=itemsize).values())


def weight_ctx_bytes(*, micro_batch: int, seq: int, n_embd: int, n_layer: int, tp: int = 1, bias: bool = False,
                     itemsize: int = 4, chunks: int = 1) -> int:
    """Bytes a zero-bubble B leaves for its W (numesh.nn.transformer.BlockWeightCtx) over
    `n_layer` blocks, for any recomputation: per block the four Linears' inputs (h1, h2
    [b,s,h]; attention output sbh/t, GELU output 4·sbh/t) and output gradients (QKV's
    3·sbh/t, MLP-up's 4·sbh/t, the two row-parallel ones sbh each), so k·(4·sbh + 12·sbh/t),
    plus both LayerNorms' weight (and bias) gradients, once per thread chunk."""
    sbh, k = seq * micro_batch * n_embd, itemsize
    ln_grads = chunks * 2 * n_embd * (2 if bias else 1) * k
    return n_layer * (k * (4 * sbh + 12 * sbh // tp) + ln_grads)


def peak_activation_bytes(schedule: Schedule, rank: int, saved: Callable[[int], int],
                          deferred: Callable[[int], int] | None = None) -> int:
    """The most activation bytes `rank` holds between two of its actions: F adds the
    micro-batch's `saved(chunk)` bytes, B frees them (or, when the schedule splits the
    backward, leaves `deferred(chunk)` bytes until W). What the executor's `peak_bytes`
    measures; with every chunk alike it is peak_activations(schedule)[rank] × saved(0)
    for schedules that do not split the backward."""
    live: dict[tuple[int, int], int] = {}
    peak = 0
    for a in schedule.actions[rank]:
        key = (a.mb, a.chunk)
        if a.kind == "F":
            live[key] = saved(a.chunk)
        elif a.kind == "B" and schedule.split_backward:
            live[key] = deferred(a.chunk) if deferred is not None else 0
        else:
            live.pop(key, None)
        peak = max(peak, sum(live.values()))
    return peak
