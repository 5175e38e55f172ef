"""Predicted step time of a layout: compute, exposed communication per axis, pipeline
bubble and optimiser, from a hardware profile and `numesh.perf.formulas`.

Compute is the sum of a stage's GEMMs (each timed by the profile at its exact shape) and
numesh's element-wise kernels, per micro-batch and action kind (F, B = input grads, W =
weight grads). Tensor-parallel all-reduces and ZeRO-3's parameter gathers sit inside F and
B (blocking); pipeline sends are the cross-rank delay of `simulate`, which turns the
slowest stage's F/B/W costs into the schedule's makespan (its idle part is the bubble).
Data-parallel reduction overlaps the backward when the profile says collectives progress
on their own, and is exposed otherwise; the post-step all-gathers of ZeRO 1-3 are exposed.

Context parallelism (cp) gives each rank T/cp tokens of every sequence: its GEMMs and
element-wise work shrink by cp, and ring attention runs one causal block and cp-1 half
blocks of scores per rank (`numesh.nn.ring_attention`), through the fused kernel that,
with or without cp, recomputes the scores in backward from the kept log-sum-exp; each
K/V hop (`formulas.cp_ring_bytes`) is posted before the block it overlaps, so only what a
hop takes beyond one block's attention is exposed. The
gradients are summed over cp: ZeRO 0 all-reduces over dp x cp at once, ZeRO 1-3 all-reduce
over cp (blocking, `formulas.cp_grad_bytes`) before the dp reduce-scatter. Sequence
parallelism (sp) moves tp's traffic as `formulas.tp_sequence_parallel_bytes` counts it
(all-gathers and reduce-scatters of whole activations), runs LayerNorms and residual adds
on 1/tp of the tokens, and all-reduces the LayerNorm gradients over tp once per step.
Full recomputation reruns the whole block forward, its communication included, before its
backward. An MoE block (a model with experts) runs the router and its rank's E/ep experts on
the N·k rows balanced routing brings them, with blocking all-to-alls over ep
(`all_to_all_time`), and the ep-replicated gradients are all-reduced over ep once a step.

The model's parts (`ModelSpec.parts`) set the shapes: grouped-query attention's q, k and v
GEMMs at their own widths (`projection_columns`), SwiGLU's three GEMMs of the MLP's hidden
size, the rotation of q and k as passes over them; with tp > 1 the k and v gradients,
partial over tp, are all-reduced once per step with sp's norm gradients
(`tp_partial_values`), and an untied head has no embedding gradient to sum across pp.
RMSNorm is priced as the LayerNorm kernel and SwiGLU's activation as GELU's plus passes:
neither is calibrated apart.

Not modelled: a single rank with several threads runs each block as runs of pieces, one per
thread (numesh.nn.walk); the model times its GEMMs with multi-threaded BLAS instead. The
Python overhead of a step outside the timed kernels (the executor, slicing, allocation) is
not counted either, nor an MoE block's small all-reduces of its routing (its combine
weights' gradient over tp, each sequence's routing over cp: `formulas.moe_tp_bytes`,
`moe_cp_bytes`).
"""

from __future__ import annotations

import functools
import math

import attrs

from numesh.base.padding import ceil_div, padded_vocab, round_up
from numesh.nn.attention import QUERY_TILE
from numesh.optim import MatrixRule
from numesh.perf import formulas
from numesh.plan.hardware import Measured, Profile
from numesh.plan.layout import Layout, ModelSpec, schedule_of
from numesh.plan.memory import block_sizes, rank_layers, unit_sizes
from numesh.plan.optimizer import matrix_bytes, matrix_work, optimizer_of, rank_units
from numesh.plan.pipesim import makespan_and_busy


@attrs.frozen
class ActionCost:
    """Seconds of one micro-batch's F, B and W through a chunk, and the tp part of each."""

    f: float
    b: float
    w: float
    tp: float  # of f + b: the exposed tensor-parallel communication
    zero3: float  # of f + b + w: ZeRO-3's parameter gathers
    cp: float = 0.0  # of f + b: ring attention's exposed K/V hops
    ep: float = 0.0  # of f + b: the MoE blocks' all-to-alls over ep (blocking)

    def __add__(self, o: "ActionCost") -> "ActionCost":
        return ActionCost(self.f + o.f, self.b + o.b, self.w + o.w, self.tp + o.tp, self.zero3 + o.zero3,
                          self.cp + o.cp, self.ep + o.ep)

    def times(self, n: int) -> "ActionCost":
        return ActionCost(self.f * n, self.b * n, self.w * n, self.tp * n, self.zero3 * n, self.cp * n, self.ep * n)


@attrs.frozen
class StepTime:
    """A predicted training step on the slowest rank (seconds)."""

    compute: float  # busy time of the slowest pipeline rank, less its tp communication
    comm: dict[str, float]  # exposed communication by axis: tp, cp, ep, pp, dp (with ZeRO-3's gathers), other, and
    # "wait": blocking calls waiting for their groups' last members (measured profiles)
    bubble: float  # idle time of the pipeline schedule
    optimizer: float  # gradient norm and the optimiser on this rank's state (Muon's matrices and exchange too)
    total: float


@attrs.frozen
class Placement:
    """Which axes stay inside a node (ranks are numbered tp fastest, then cp, ep, dp, pp:
    AXES; an ep group spans ranks strided by cp·tp, a dp group by ep·cp·tp)."""

    ranks_on_node: int
    tp_intra: bool
    dp_intra: bool
    pp_intra: bool
    cp_intra: bool = True
    ep_intra: bool = True


def placement(layout: Layout, profile: Profile) -> Placement:
    node = profile.devices_per_node if not profile.measured else max(layout.ranks, 1)
    t, c, e, d, p = layout.tp, layout.cp, layout.ep, layout.dp, layout.pp
    return Placement(min(layout.ranks, node), t <= node, t * c * e * d <= node, t * c * e * d * p <= node,
                     t * c <= node, t * c * e <= node)


def _gemms(profile: Profile, shapes: list[tuple[int, int, int, int]], ron: int) -> float:
    return sum(profile.gemm_time(b, m, k, n, ron) for b, m, k, n in shapes)


@attrs.frozen
class Attention:
    """One block's attention on one rank for one micro-batch: forward and backward seconds,
    and the exposed cp hops forward and backward."""

    f: float
    b: float
    cp_f: float
    cp_b: float


def score_pairs(layout: Layout, T: int) -> list[tuple[int, int, int]]:
    """(stripes, query rows, keys) of the score tiles one rank computes for one sequence, as
    the fused kernel runs them (numesh.nn.attention): QUERY_TILE-query stripes, each against
    the keys up to its last query (a causal block), or whole half blocks. (Where tile_gemm
    multiplies the tiles the kernel's stripes are TILE_QUERIES rows, which waste less on
    the diagonal; the model keeps QUERY_TILE's, a function of nothing but the model, so a
    plan does not depend on the CPU it is made on.) Without cp, the
    causal T x T; with ring attention its own causal block of T/cp tokens and cp-1 half
    blocks (`numesh.nn.ring_attention.block_pairs`: the load balance). Stripes of a causal
    block are grouped by the keys they see, pooled into one mean size."""
    t = T // layout.cp
    qt = min(QUERY_TILE, t)
    n = -(-t // qt)
    mean_keys = sum(min(t, (i + 1) * qt) for i in range(n)) // n
    own = [(n, qt, mean_keys)]
    if layout.cp == 1:
        return own
    return own + [(1, t, t // 2)] * (layout.cp - 1)


def ring_hop_bytes(model: ModelSpec, layout: Layout, itemsize: int) -> tuple[list[int], list[int]]:
    """Payload of each ring hop of one block, forward (K and V, cp-1 hops) and backward (K, V
    and the dK, dV accumulators, the last hop the accumulators alone): they add up to
    `formulas.cp_ring_bytes`."""
    cp = layout.cp
    blk = layout.rows(model) * (model.block_size // cp) * model.parts.local_kv(model.n_embd, layout.tp) * itemsize
    return [2 * blk] * (cp - 1), [4 * blk] * (cp - 1) + [2 * blk] * (cp > 1)


def attention_cost(model: ModelSpec, layout: Layout, profile: Profile, place: Placement) -> Attention:
    """The fused kernel's tiles (`score_pairs`): scores, softmax passes and weighted values
    forward; backward recomputes the scores from the kept log-sum-exp and makes the four
    gradients (dP, dV, dK, dQ), with its own softmax passes; ring attention also merges each
    pair's output."""
    b, hs, ron = layout.rows(model), model.n_embd // model.n_head, place.ranks_on_node
    bh = b * model.n_head // layout.tp
    pairs = score_pairs(layout, model.block_size)
    ring = layout.cp > 1
    qk = sum(profile.gemm_time(bh * n, k, hs, q, ron) for n, q, k in pairs)  # k·qᵀ: [keys, queries]
    pv = sum(profile.gemm_time(bh * n, q, k, hs, ron) for n, q, k in pairs)
    grads = sum(3 * profile.gemm_time(bh * n, k, q, hs, ron) + profile.gemm_time(bh * n, k, hs, q, ron)
                for n, q, k in pairs)  # dV, dK, dQ; dP
    elems = bh * sum(n * q * k for n, q, k in pairs)
    ew = profile.elementwise_time
    f = qk + pv + ew("softmax_fwd", elems, ron)
    bw = qk + grads + ew("softmax_bwd", elems, ron)
    if ring:  # each pair's output and log-sum-exp merged into the running ones
        f += ew("copy", len(pairs) * bh * (model.block_size // layout.cp) * hs, ron)
    cp_f = cp_b = 0.0
    if ring:
        fwd, bwd = ring_hop_bytes(model, layout, profile.itemsize)
        # a hop's transfer hides behind a block of attention where transfers progress on their
        # own (NCCL); MPICH moves a large nonblocking message only inside MPI calls, so there it
        # is exposed whole. Waiting for the partner to arrive (`exchange` less `send`: what
        # predict_time counts blocking calls by) is never hidden.
        hide = 1.0 if profile.overlap else 0.0
        per_pair_f, per_pair_b = hide * f / len(pairs), hide * bw / len(pairs)
        send = lambda n: profile.comm_time("send", n, 2, place.cp_intra, ron)  # noqa: E731
        wait = lambda n: profile.comm_time("exchange", n, 2, place.cp_intra, ron) - send(n)  # noqa: E731
        cp_f = sum(max(0.0, send(n) - per_pair_f) + wait(n) for n in fwd)
        cp_b = sum(max(0.0, send(n) - per_pair_b) + wait(n) for n in bwd)
    return Attention(f + cp_f, bw + cp_b, cp_f, cp_b)


def projection_columns(model: ModelSpec, layout: Layout) -> list[int]:
    """Output columns of a block's q, k, v projections on one tp rank, one GEMM each: the
    fused QKV's 3C/tp in one, or grouped-query attention's q (C/tp) and the kv columns of
    k and v its query heads read (`formulas.Parts.local_kv`)."""
    C, tp = model.n_embd, layout.tp
    if not model.parts.kv_heads:
        return [3 * C // tp]
    return [C // tp] + [model.parts.local_kv(C, tp)] * 2


def tp_block_comm(model: ModelSpec, layout: Layout, profile: Profile, place: Placement,
                  chunk: formulas.Chunk) -> float:
    """Seconds of tp communication of one micro-batch's forward and backward through `chunk`
    besides the cross-entropy's all-reduces: 4 activation all-reduces per block (and one each
    for the embedding and the head) without sp; with sp whatever
    `formulas.tp_sequence_parallel_bytes` counts, as calls of one whole activation each."""
    if layout.tp == 1:
        return 0.0
    t, k, ron = model.block_size // layout.cp, profile.itemsize, place.ranks_on_node
    act = layout.rows(model) * t * model.n_embd * k
    if not layout.sp:
        calls = 4 * chunk.blocks + int(chunk.first) + int(chunk.last)
        return calls * profile.comm_time("all_reduce", act, layout.tp, place.tp_intra, ron)
    parts = formulas.tp_sequence_parallel_bytes(chunk, layout.rows(model), t, model.n_embd, k)
    return sum(n / act * profile.comm_time(op, act, layout.tp, place.tp_intra, ron)
               for op, n in parts.items() if op != "all_reduce")


# What sequence parallelism adds to a micro-batch's forward and backward, in whole-sequence
# activations [B, T, C] written once each (numesh/nn/transformer.py, numesh/mesh/collectives.py):
# a gather along the sequence concatenates the ranks' slices (a copy), a reduce-scatter first
# lays the sequence out rank-major (a copy), and a LayerNorm's output is its gathered x̂
# times w (a pass over the whole sequence), in forward and again in backward (norm_regather).
# Per block, F: 2 LayerNorm gathers (gather + affine) and 2 reduce-scatters; B: 2 gathers of
# the output gradients, 2 reduce-scatters of the input gradients, 2 regathers (gather + affine;
# none under full recomputation, whose rerun keeps the gathered outputs).
# The first stage's embedding is reduce-scattered (F) and its gradient gathered (B); the
# last's final LayerNorm gathers (F), regathers and reduce-scatters its input gradient (B).
SP_COPIES = {"block": (6, 8), "first": (1, 1), "last": (2, 3)}


def all_to_all_time(model: ModelSpec, layout: Layout, profile: Profile, place: Placement) -> tuple[float, float]:
    """Seconds of one MoE block's all-to-alls over ep for one micro-batch, (forward,
    backward), as numesh.nn.moe runs them: forward exchanges the per-expert counts (E int64)
    and then sends the rows to their experts and the outputs back; backward sends the
    gradients both ways again. Balanced routing assumed: each rank's buffer is its N·k rows
    (C values each, N = b·T/cp tokens) and it sends (ep-1)/ep of them, receiving as many (the
    bytes `formulas.moe_all_to_all_bytes` counts for a uniform routing). Each call is priced as
    the profile prices an all-to-all (`costs.ring_time`: ep-1 steps of 1/ep of the buffer), on
    the ep group's link (ranks strided by cp·tp) or its calibrated curves."""
    if layout.ep == 1:
        return 0.0, 0.0
    n = layout.rows(model) * (model.block_size // layout.cp)
    rows = n * model.moe_top_k * model.n_embd * profile.itemsize
    call = lambda nbytes: profile.comm_time("all_to_all", nbytes, layout.ep, place.ep_intra,  # noqa: E731
                                            place.ranks_on_node)
    return call(model.moe_experts * 8) + 2 * call(rows), 2 * call(rows)


@attrs.frozen
class Mlp:
    """One block's MLP (dense or MoE), one micro-batch: its kernels' seconds in F, B and W,
    and the exposed ep all-to-alls of F and B."""

    f: float
    b: float
    w: float
    ep_f: float = 0.0
    ep_b: float = 0.0


def activation_time(model: ModelSpec, profile: Profile, values: int, ron: int) -> tuple[float, float]:
    """(forward, backward) seconds of the MLP's activation over `values` hidden values: GELU's
    kernels, or SwiGLU's (gate and up together, per hidden value)."""
    act = "swiglu" if model.parts.gated else "gelu"
    return profile.elementwise_time(f"{act}_fwd", values, ron), profile.elementwise_time(f"{act}_bwd", values, ron)


def dense_mlp_cost(model: ModelSpec, layout: Layout, profile: Profile, place: Placement) -> Mlp:
    """The dense MLP: C -> F/tp (column-parallel; SwiGLU's gate too), the activation,
    F/tp -> C (row-parallel); F = 4C for GPT-2."""
    C, ron = model.n_embd, place.ranks_on_node
    bt, h = layout.rows(model) * (model.block_size // layout.cp), model.parts.ffn(C) // layout.tp
    ups = model.parts.mlp_matrices - 1  # fc, and SwiGLU's gate
    act_f, act_b = activation_time(model, profile, bt * h, ron)
    f = _gemms(profile, [(1, bt, C, h)] * ups + [(1, bt, h, C)], ron) + act_f
    b = _gemms(profile, [(1, bt, C, h)] * ups + [(1, bt, h, C)], ron) + act_b
    w = _gemms(profile, [(1, C, bt, h)] * ups + [(1, h, bt, C)], ron)
    return Mlp(f, b, w)


def moe_mlp_cost(model: ModelSpec, layout: Layout, profile: Profile, place: Placement) -> Mlp:
    """An MoE MLP (numesh.nn.moe): the router GEMM and softmax over the E experts, then this
    rank's E/ep experts on R = N·k rows (balanced routing: N·k·ep/E each), the same GEMMs as
    the dense MLP's per expert; the rows gathered, sent, returned and combined (copies); the
    weight gradients all in B (the block's W has no MLP part); the all-to-alls
    (`all_to_all_time`)."""
    C, tp, ron, E = model.n_embd, layout.tp, place.ranks_on_node, model.moe_experts
    bt, ew = layout.rows(model) * (model.block_size // layout.cp), profile.elementwise_time
    local = E // layout.ep
    r = bt * model.moe_top_k
    re = max(1, r // local)  # rows of each local expert
    h = model.parts.ffn(C) // tp
    ups = model.parts.mlp_matrices - 1  # fc, and SwiGLU's gate
    act_f, act_b = activation_time(model, profile, r * h, ron)
    f = _gemms(profile, [(1, bt, C, E), *[(local, re, C, h)] * ups, (local, re, h, C)], ron)
    f += ew("softmax_fwd", bt * E, ron) + act_f + ew("copy", 3 * r * C, ron)
    b = _gemms(profile, [*[(local, re, C, h)] * ups, (local, re, h, C), *[(local, C, re, h)] * ups, (local, h, re, C),
                         (1, bt, E, C), (1, C, bt, E)], ron)
    b += ew("softmax_bwd", bt * E, ron) + act_b + ew("copy", 3 * r * C, ron)
    a2a_f, a2a_b = all_to_all_time(model, layout, profile, place)
    return Mlp(f + a2a_f, b + a2a_b, 0.0, a2a_f, a2a_b)


def block_cost(model: ModelSpec, layout: Layout, profile: Profile, place: Placement, split: bool,
               moe: bool = False) -> ActionCost:
    """One transformer block, one micro-batch (shapes as numesh/nn/transformer.py runs them),
    with the layout's recomputation: full adds F's kernels and communication to B (not its
    action's overhead). `moe`: the block's MLP is the model's experts (`moe_mlp_cost`)."""
    b, C, tp = layout.rows(model), model.n_embd, layout.tp
    bt, ron = b * (model.block_size // layout.cp), place.ranks_on_node
    ln = bt * C // tp if layout.sp else bt * C  # sp: LayerNorms and residual adds on this rank's tokens only
    ew = profile.elementwise_time
    att = attention_cost(model, layout, profile, place)
    mlp = (moe_mlp_cost if moe else dense_mlp_cost)(model, layout, profile, place)
    qkv = projection_columns(model, layout)
    f = _gemms(profile, [*[(1, bt, C, n) for n in qkv], (1, bt, C // tp, C)], ron) + att.f + mlp.f
    norm = "rmsnorm" if model.parts.rmsnorm else "layernorm"
    f += 2 * ew(f"{norm}_fwd", ln, ron)
    f += ew("copy", 2 * ln + 2 * bt * C // tp, ron)  # q scaled, heads merged, two residual adds
    bw = _gemms(profile, [(1, bt, C, C // tp), *[(1, bt, n, C) for n in qkv]], ron) + att.b + mlp.b
    bw += 2 * ew(f"{norm}_bwd", ln, ron)
    bw += ew("copy", 2 * ln + 5 * bt * C // tp, ron)  # dq, dk, dv packed, heads split, dq scaled, two adds
    w = _gemms(profile, [*[(1, C, bt, n) for n in qkv], (1, C // tp, bt, C)], ron) + mlp.w
    if model.parts.rotary:  # q and k rotated forward, their gradients back: ~4 passes each (numesh.nn.rotary)
        rotated = 4 * bt * (C // tp + model.parts.local_kv(C, tp))
        f, bw = f + ew("copy", rotated, ron), bw + ew("copy", rotated, ron)
    if layout.sp:
        sp_f, sp_b = SP_COPIES["block"]
        sp_b -= 4 if layout.recompute == "full" else 0  # the rerun forward keeps its gathered outputs: no regathers
        f += ew("copy", sp_f * bt * C, ron)
        bw += ew("copy", sp_b * bt * C, ron)
    call = profile.call_overhead(ron)  # each of F, B (and W apart) pays it once
    f, bw, w = f + call, bw + call, w + (call if split else 0.0)
    tp_half = tp_block_comm(model, layout, profile, place, formulas.Chunk(1, False, False)) / 2  # half F, half B
    gather = 0.0
    if layout.zero == 3 and layout.dp > 1:
        values = block_sizes(model, layout, [0])[0] if moe else formulas.block_params(C, tp, model.bias, model.parts)
        unit = round_up(values, layout.dp) * profile.itemsize
        gather = profile.comm_time("all_gather", unit, layout.dp, place.dp_intra, ron)
    w_gather = gather if split else 0.0  # the deferred W gathers the block again
    f_all = f + tp_half + gather
    if layout.recompute == "full":  # the forward runs again, communication included, before B
        # inside B's action: its kernels, not another action's overhead (priced as a whole F,
        # full recomputation came out +35-43 % on 2 ranks where alternating runs measured
        # +27 % at tp=2, m=4 and m=16; a share of F fitted on a one-rank step with it was 0.95)
        rerun = f - call + tp_half + gather
        return ActionCost(f_all, bw + tp_half + gather + rerun, w + w_gather, 3 * tp_half, 3 * gather + w_gather,
                          2 * att.cp_f + att.cp_b, 2 * mlp.ep_f + mlp.ep_b)
    return ActionCost(f_all, bw + tp_half + gather, w + w_gather, 2 * tp_half, 2 * gather + w_gather,
                      att.cp_f + att.cp_b, mlp.ep_f + mlp.ep_b)


def outer_cost(model: ModelSpec, layout: Layout, profile: Profile, place: Placement, first: bool,
               last: bool) -> ActionCost:
    """The embedding (first stage) and the final norm, LM head (tied or its own: the same
    GEMMs) and vocab-parallel cross-entropy (last stage) for one micro-batch; their weight
    grads are part of B."""
    bt, C, tp, ron = layout.rows(model) * (model.block_size // layout.cp), model.n_embd, layout.tp, place.ranks_on_node
    k, ew = profile.itemsize, profile.elementwise_time
    v_local = padded_vocab(model.vocab_size, tp) // tp
    ln = bt * C // tp if layout.sp else bt * C
    tp_s = tp_block_comm(model, layout, profile, place, formulas.Chunk(0, first, last))
    # the lookup's all-reduce is in F, the head input gradient's in B; with sp each is a
    # reduce-scatter and an all-gather, one in F and one in B
    f = tp_s / 2 if (layout.sp or last) and first else (tp_s if first else 0.0)
    b = tp_s - f
    if first:
        f += ew("copy", bt * C, ron)  # the lookup and the position add
        b += ew("copy", (2 if model.parts.rotary else 3) * bt * C, ron)  # wpe's sum (learned) and wte's sorted row sums
    for end, here in (("first", first), ("last", last)):
        if layout.sp and here:
            f += ew("copy", SP_COPIES[end][0] * bt * C, ron)
            b += ew("copy", SP_COPIES[end][1] * bt * C, ron)
    if last:
        norm = "rmsnorm" if model.parts.rmsnorm else "layernorm"
        f += (ew(f"{norm}_fwd", ln, ron) + profile.gemm_time(1, bt, C, v_local, ron)
              + ew("softmax_fwd", bt * v_local, ron))
        b += (ew("softmax_bwd", bt * v_local, ron) + profile.gemm_time(1, v_local, bt, C, ron)
              + profile.gemm_time(1, bt, v_local, C, ron) + ew(f"{norm}_bwd", ln, ron))
        t_f = profile.comm_time("all_reduce", bt * k, tp, place.tp_intra, ron) + profile.comm_time(
            "all_reduce", 2 * bt * k, tp, place.tp_intra, ron)  # the row maxima; [sum-exp, target logit]
        f, tp_s = f + t_f, tp_s + t_f
    gather = 0.0
    if layout.zero == 3 and layout.dp > 1 and (first or last):
        n = formulas.outer_params(C, model.vocab_size, model.block_size, tp, first, last, model.bias, model.parts)
        gather = profile.comm_time("all_gather", round_up(n, layout.dp) * k, layout.dp, place.dp_intra, ron)
    return ActionCost(f + gather, b + gather, 0.0, tp_s, 2 * gather)


def chunk_costs(model: ModelSpec, layout: Layout, profile: Profile, place: Placement, split: bool) -> list[ActionCost]:
    """Per model stage (pp·v of them), one micro-batch's costs through it."""
    stages = layout.pp * layout.virtual_stages
    per = model.n_layer // stages
    dense = block_cost(model, layout, profile, place, split)
    moe = block_cost(model, layout, profile, place, split, moe=True) if model.moe_experts else dense
    out = []
    for k in range(stages):
        n_moe = model.moe_blocks(k * per, (k + 1) * per)
        blocks = dense.times(per - n_moe) + moe.times(n_moe)
        out.append(blocks + outer_cost(model, layout, profile, place, k == 0, k == stages - 1))
    return out


def _dp_calls(model: ModelSpec, layout: Layout, sizes: list[int], itemsize: int, bucket_bytes: int) -> dict[str, int]:
    """How many calls carry formulas.dp_bytes' payload per op: ZeRO 0 one all-reduce per
    bucket (contiguous ready units of at least `bucket_bytes`), 1 a reduce-scatter and an
    all-gather per unit, 2/3 a reduce-scatter per block and micro-batch (the outer unit once)."""
    units = len(sizes)
    m = layout.micro_batches
    if layout.zero == 0:
        calls, acc = 0, 0
        for n in sizes:  # layout order: blocks last to first, then the outer unit
            acc += round_up(n, layout.dp) * itemsize
            if acc >= bucket_bytes:
                calls, acc = calls + 1, 0
        return {"all_reduce": calls + (acc > 0)}
    if layout.zero == 1:
        return {"reduce_scatter": units, "all_gather": units}
    rs = m * (units - 1) + 1
    return {"reduce_scatter": rs, "all_gather": units if layout.zero == 2 else 0}


@functools.lru_cache(maxsize=4096)
def _simulated(name: str, pp: int, m: int, v: int, t_f: float, t_b: float, t_w: float,
               hop: float) -> tuple[float, float]:
    """(makespan, busy time of the busiest rank) of `simulate`, by `pipesim` (the same
    numbers, once the schedule's dependencies are laid out); cached, as layouts that differ
    only in what the pipeline does not see (ZeRO 0-2, say) ask for the same."""
    return makespan_and_busy(schedule_of(name, pp, m, v), t_f, t_b, t_w, hop)


# what `predict_time` adds to each blocking call to count them (small: the count is the
# derivative of the step time, and nothing in the model is non-linear in it)
PROBE_S = 1e-6


def predict_time(model: ModelSpec, layout: Layout, profile: Profile, bucket_bytes: int = 1 << 20,
                 place: Placement | None = None) -> StepTime:
    """The predicted step of the slowest rank (`place`: where its ranks sit, by default as
    `placement` puts them; calibration passes the rank count it measured with), with the
    waits of its blocking calls for their groups' last members on a measured profile
    (`Measured.sync_s`, `sync_share`) as comm["wait"]."""
    place = placement(layout, profile) if place is None else place
    step = _predict_time(model, layout, profile, bucket_bytes, place)
    meas, _ = profile.for_ranks(place.ranks_on_node)
    if meas is None or layout.ranks == 1 or not (meas.sync_s or meas.sync_share):
        return step
    calls = _calls(model, layout, profile, meas, bucket_bytes, place, step.total)
    wait = min(meas.sync_s * calls, meas.sync_share * step.compute)
    return attrs.evolve(step, comm={**step.comm, "wait": wait}, total=step.total + wait)


def blocking_calls(model: ModelSpec, layout: Layout, profile: Profile, place: Placement) -> float:
    """How many blocking calls (collectives and ring hops, not pipeline sends) lie on the
    predicted step's critical path, as `predict_time` counts them on a measured profile."""
    meas, _ = profile.for_ranks(place.ranks_on_node)
    if meas is None:
        return 0.0
    bare = _probing(profile, meas, 0.0)
    return _calls(model, layout, bare, meas, 1 << 20, place, _predict_time(model, layout, bare, 1 << 20, place).total)


def _calls(model: ModelSpec, layout: Layout, profile: Profile, meas: Measured, bucket_bytes: int, place: Placement,
           unprobed_s: float) -> float:
    """Blocking calls of the step predicted at `unprobed_s`: how much PROBE_S per call adds."""
    probed = _predict_time(model, layout, _probing(profile, meas, PROBE_S), bucket_bytes, place).total
    return max(0.0, probed - unprobed_s) / PROBE_S


def _probing(profile: Profile, meas: Measured, probe_s: float) -> Profile:
    return attrs.evolve(profile, measured={**profile.measured, meas.ranks: attrs.evolve(meas, call_probe_s=probe_s)})


def _predict_time(model: ModelSpec, layout: Layout, profile: Profile, bucket_bytes: int, place: Placement) -> StepTime:
    ron, k = place.ranks_on_node, profile.itemsize
    sched = layout.sched
    costs = chunk_costs(model, layout, profile, place, sched.split_backward)
    worst = max(costs, key=lambda c: c.f + c.b + c.w)
    act = formulas.pp_send_bytes(formulas.Chunk(0, True, False), layout.rows(model), model.block_size // layout.cp,
                                 model.n_embd, k, layout.tp if layout.sp else 1)  # one activation, forward
    hop = profile.comm_time("send", act, 2, place.pp_intra, ron) if layout.pp > 1 else 0.0
    makespan, busy = _simulated(layout.schedule, layout.pp, layout.micro_batches, layout.virtual_stages,
                                worst.f, worst.b, worst.w, hop)
    per_mb = layout.micro_batches * layout.virtual_stages
    tp_time, z3_time, cp_time, ep_time = worst.tp * per_mb, worst.zero3 * per_mb, worst.cp * per_mb, worst.ep * per_mb
    sizes = unit_sizes(model, layout, 0)
    padded = [round_up(n, layout.dp) for n in sizes]
    calls = _dp_calls(model, layout, sizes, k, bucket_bytes)
    # data parallel: formulas.dp_bytes' payload, split over its calls, on the pp rank with the most;
    # ZeRO 0 all-reduces over dp x cp in one group, ZeRO 1-3 first all-reduce over cp (blocking)
    dp_group = layout.dp * (layout.cp if layout.zero == 0 else 1)
    if layout.cp > 1 and layout.zero >= 1:
        cp_time += _cp_grad_sum_time(layout, profile, place, padded, calls)
    dp_exposed = 0.0
    if dp_group > 1:
        dp_exposed = _dp_exposed(layout, profile, place, padded, calls, worst, dp_group)
    other = _scalar_and_tied_time(model, layout, profile, place)
    ep_grads = _ep_grad_sum_time(model, layout, profile, place)
    if partial := tp_partial_values(model, layout):  # all-reduced over tp once per step (this dp shard's)
        tp_time += profile.comm_time("all_reduce", ceil_div(partial, layout.dp) * k if layout.zero else partial * k,
                                     layout.tp, place.tp_intra, ron)
    optimizer = _optimizer_time(model, layout, profile, place, sizes)
    pp_exposed = max(0.0, makespan - busy) if layout.pp > 1 else 0.0
    bubble_ideal = _simulated(layout.schedule, layout.pp, layout.micro_batches, layout.virtual_stages,
                              worst.f, worst.b, worst.w, 0.0)[0] - busy
    pp_comm = max(0.0, pp_exposed - bubble_ideal)
    compute = busy - (worst.tp + worst.zero3 + worst.cp + worst.ep) * per_mb
    ln_tp = tp_time - worst.tp * per_mb  # the once-per-step all-reduce of the tp-partial grads, after the pipeline
    cp_grads = cp_time - worst.cp * per_mb  # ZeRO 1-3's cp gradient sums, after the backward
    total = makespan + dp_exposed + other + optimizer + ln_tp + cp_grads + ep_grads
    return StepTime(
        compute=compute,
        comm={"tp": tp_time, "cp": cp_time, "ep": ep_time + ep_grads, "pp": pp_comm, "dp": dp_exposed + z3_time,
              "other": other, "wait": 0.0},
        bubble=max(0.0, bubble_ideal),
        optimizer=optimizer,
        total=total,
    )


def tp_partial_values(model: ModelSpec, layout: Layout) -> int:
    """Gradient values of pipeline rank 0 that are partial over tp and all-reduced over it
    once per step (before ZeRO's dp shard): the norms' under sequence parallelism (each
    rank sums over its own tokens), grouped-query attention's k and v with tp > 1 (each
    rank's zero off the kv heads its query heads read; `numesh.nn.transformer.tp_partial`)."""
    if layout.tp == 1:
        return 0
    C, parts, blocks = model.n_embd, model.parts, model.n_layer // layout.pp
    n = (2 * blocks + int(layout.pp == 1)) * parts.norm_values(C, model.bias) if layout.sp else 0
    if parts.kv_heads:
        kv = parts.kv_width(C)
        n += blocks * 2 * (C * kv + (kv if model.bias else 0))
    return n


def _optimizer_time(model: ModelSpec, layout: Layout, profile: Profile, place: Placement, sizes: list[int]) -> float:
    """The optimiser step on pipeline rank 0's slice: its elementwise passes (as AdamW's
    kernel, and the norm's), and a matrix rule's (Muon's) function on its share of the whole
    matrices, each priced at the profile's GEMM rate for its shape, with the exchange that
    brings them whole over dp and tp (numesh/plan/optimizer.py)."""
    ron, k = place.ranks_on_node, profile.itemsize
    state = sum(ceil_div(n, layout.dp) for n in sizes) if layout.zero >= 1 else sum(sizes)
    t = profile.elementwise_time("adamw", state, ron) + profile.elementwise_time("copy", state, ron)
    units = rank_units(model, layout, rank_layers(model, layout, 0), True, layout.pp == 1)
    rule = next((r for r in optimizer_of(model).rules if isinstance(r, MatrixRule)), None)
    if rule is None:
        return t
    for m, count in matrix_work(model, layout, units):
        s, big = min(m.fan_in, m.fan_out), max(m.fan_in, m.fan_out)
        gemm = profile.gemm_time(1, s, big, s, ron)  # X·Xᵀ's shape: the rate of the iteration's GEMMs
        t += count * rule.flops(m.fan_in, m.fan_out) * gemm / (2.0 * s * big * s)
    nbytes = matrix_bytes(model, layout, units, k)
    t += 2 * profile.comm_time("all_to_all", nbytes["dp"] / 2, layout.dp, place.dp_intra, ron)
    t += profile.comm_time("all_gather", nbytes["dp_gather"], layout.dp, place.dp_intra, ron)
    n = layout.ep * layout.cp * layout.tp
    intra = place.tp_intra and (layout.cp == 1 or place.cp_intra) and (layout.ep == 1 or place.ep_intra)
    return t + 2 * profile.comm_time("all_to_all", nbytes["replicas"] / 2, n, intra, ron)


def _cp_grad_sum_time(layout: Layout, profile: Profile, place: Placement, padded: list[int],
                      calls: dict[str, int]) -> float:
    """ZeRO 1-3 with cp: the blocking all-reduce over cp before each unit's reduce-scatter."""
    k, ron = profile.itemsize, place.ranks_on_node
    cp_bytes = formulas.cp_grad_bytes(layout.zero, layout.micro_batches, sum(padded[:-1]), padded[-1], k)
    n = calls["reduce_scatter"]  # one per unit reduced: the cp sum comes just before each
    return n * profile.comm_time("all_reduce", cp_bytes / n, layout.cp, place.cp_intra, ron)


def ep_replicated_values(model: ModelSpec, layout: Layout) -> int:
    """Values of the leaves replicated over ep (all but the experts) that pipeline rank 0
    all-reduces over ep each step, as `ZeroOptimizer.ep_replicated_values` counts them: all
    of its units' under ZeRO 0; under ZeRO >= 1 those in its dp shard, which depend on where
    the shard's cut falls in each unit (`formulas.shard_values`): the most any dp rank holds
    (the all-reduce of the slowest dp index is the one the step waits for)."""
    return _ep_replicated(model, layout.tp, layout.ep, layout.pp, layout.virtual_stages,
                          layout.dp if layout.zero >= 1 else 1)


@functools.lru_cache(maxsize=4096)
def _ep_replicated(model: ModelSpec, tp: int, ep: int, pp: int, v: int, shards: int) -> int:
    lay = Layout(1, tp, pp, 0, "1f1b", 1, v, ep=ep)
    units = formulas.moe_rank_units(
        n_embd=model.n_embd, vocab=model.vocab_size, block_size=model.block_size, experts=model.moe_experts,
        moe_layers=[model.is_moe(i) for i in rank_layers(model, lay, 0)], ep=ep, tp=tp, bias=model.bias,
        first=True, last=pp == 1, parts=model.parts)
    return max(formulas.shard_values(units, shards, r)["other"] for r in range(shards))


def _ep_grad_sum_time(model: ModelSpec, layout: Layout, profile: Profile, place: Placement) -> float:
    """The once-per-step all-reduce over ep of the ep-replicated leaves' gradients, after the
    dp reduction (blocking: `formulas.ep_grad_bytes`)."""
    if layout.ep == 1:
        return 0.0
    nbytes = formulas.ep_grad_bytes(ep_replicated_values(model, layout), profile.itemsize)
    return profile.comm_time("all_reduce", nbytes, layout.ep, place.ep_intra, place.ranks_on_node)


def _dp_exposed(layout: Layout, profile: Profile, place: Placement, padded: list[int], calls: dict[str, int],
                worst: ActionCost, dp_group: int) -> float:
    """The data-parallel reduction's time not hidden behind the backward (ZeRO-3's gathers are
    inside F and B: `worst.zero3`)."""
    k, ron = profile.itemsize, place.ranks_on_node
    total = formulas.dp_bytes(layout.zero, layout.micro_batches, sum(padded[:-1]), padded[-1], k,
                              layout.sched.split_backward)
    backward = layout.micro_batches * (worst.b + worst.w) if layout.zero >= 2 else worst.b + worst.w
    dp_exposed = 0.0
    for op, nbytes in total.items():
        if op == "all_gather" and layout.zero == 3:
            continue  # inside F and B (worst.zero3)
        n = calls.get(op, 0)
        if not n or not nbytes:
            continue
        one = profile.comm_time(op, nbytes / n, dp_group, place.dp_intra, ron)
        if op == "all_gather" or not profile.overlap:
            dp_exposed += n * one  # after the optimiser step / no progress during backward
        else:
            dp_exposed += max(one, n * one - backward)
    return dp_exposed


def _scalar_and_tied_time(model: ModelSpec, layout: Layout, profile: Profile, place: Placement) -> float:
    """The tied embedding's gradient sum (pp > 1) and the step's two scalar all-reduces."""
    k, ron = profile.itemsize, place.ranks_on_node
    other = 0.0
    if layout.pp > 1 and model.parts.tied:  # the tied embedding's gradient, summed between the first and last stage
        tied = padded_vocab(model.vocab_size, layout.tp) // layout.tp * model.n_embd * k
        other += profile.comm_time("all_reduce", tied, 2, place.pp_intra, ron)
    shape = layout.shape
    for axes in (formulas.loss_axes(shape), formulas.norm_axes(shape, layout.zero)):  # the loss, the gradient norm
        group = math.prod(shape[a] for a in axes)
        other += profile.comm_time("all_reduce", formulas.SCALAR, group, place.pp_intra and place.dp_intra, ron)
    return other
