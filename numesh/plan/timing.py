"""Predicted step time of a layout: compute, exposed communication per axis, pipeline
bubble and optimiser, from a hardware profile and `numesh.formulas`.

Compute is the sum of a stage's GEMMs (each timed by the profile at its exact shape) and
numesh's element-wise kernels, per micro-batch and action kind (F, B = input grads, W =
weight grads). Tensor-parallel all-reduces and ZeRO-3's parameter gathers sit inside F and
B (blocking); pipeline sends are the cross-rank delay of `simulate`, which turns the
slowest stage's F/B/W costs into the schedule's makespan (its idle part is the bubble).
Data-parallel reduction overlaps the backward when the profile says collectives progress
on their own, and is exposed otherwise; the post-step all-gathers of ZeRO 1-3 are exposed.

Not modelled: a single rank with several threads runs each block as row chunks, one per
thread (numesh.nn.stage); the model times its GEMMs with multi-threaded BLAS instead. The
Python overhead of a step outside the timed kernels (the executor, slicing, allocation) is
not counted either.
"""

from __future__ import annotations

import attrs

from numesh import formulas
import functools

from numesh.pipeline.schedules import simulate
from numesh.plan.hardware import Profile
from numesh.plan.layout import Layout, ModelSpec, schedule_of
from numesh.plan.memory import unit_sizes


@attrs.frozen
class ActionCost:
    """Seconds of one micro-batch's F, B and W through a chunk, and the tp part of each."""

    f: float
    b: float
    w: float
    tp: float  # of f + b: the exposed tensor-parallel communication
    zero3: float  # of f + b + w: ZeRO-3's parameter gathers

    def __add__(self, o: "ActionCost") -> "ActionCost":
        return ActionCost(self.f + o.f, self.b + o.b, self.w + o.w, self.tp + o.tp, self.zero3 + o.zero3)


@attrs.frozen
class StepTime:
    """A predicted training step on the slowest rank (seconds)."""

    compute: float  # busy time of the slowest pipeline rank, less its tp communication
    comm: dict[str, float]  # exposed communication by axis: tp, pp, dp (with ZeRO-3's gathers), other
    bubble: float  # idle time of the pipeline schedule
    optimizer: float  # gradient norm and AdamW on this rank's state
    total: float


@attrs.frozen
class Placement:
    """Which axes stay inside a node (ranks are numbered tp fastest, then dp, then pp)."""

    ranks_on_node: int
    tp_intra: bool
    dp_intra: bool
    pp_intra: bool


def placement(layout: Layout, profile: Profile) -> Placement:
    node = profile.devices_per_node if not profile.measured else max(layout.ranks, 1)
    t, d, p = layout.tp, layout.dp, layout.pp
    return Placement(min(layout.ranks, node), t <= node, t * d <= node, t * d * p <= node)


def _gemms(profile: Profile, shapes: list[tuple[int, int, int, int]], ron: int) -> float:
    return sum(profile.gemm_time(b, m, k, n, ron) for b, m, k, n in shapes)


def block_cost(model: ModelSpec, layout: Layout, profile: Profile, place: Placement, split: bool) -> ActionCost:
    """One transformer block, one micro-batch (shapes as numesh/nn/transformer.py runs them)."""
    b, T, C, tp = layout.rows(model), model.block_size, model.n_embd, layout.tp
    h, hs, bt, ron = model.n_head // tp, C // model.n_head, layout.rows(model) * model.block_size, place.ranks_on_node
    ew = profile.elementwise_time
    f = _gemms(profile, [(1, bt, C, 3 * C // tp), (b * h, T, hs, T), (b * h, T, T, hs), (1, bt, C // tp, C),
                         (1, bt, C, 4 * C // tp), (1, bt, 4 * C // tp, C)], ron)
    f += 2 * ew("layernorm_fwd", bt * C, ron) + ew("softmax_fwd", b * h * T * T, ron) + ew("gelu_fwd", 4 * bt * C // tp, ron)
    f += ew("copy", 2 * bt * C + 2 * bt * C // tp, ron)  # q scaled, heads merged, two residual adds
    bw = _gemms(profile, [(1, bt, C, 4 * C // tp), (1, bt, 4 * C // tp, C), (1, bt, C, C // tp), (b * h, T, T, hs),
                          (b * h, T, hs, T), (b * h, T, T, hs), (b * h, T, T, hs), (1, bt, 3 * C // tp, C)], ron)
    bw += 2 * ew("layernorm_bwd", bt * C, ron) + ew("softmax_bwd", b * h * T * T, ron) + ew("gelu_bwd", 4 * bt * C // tp, ron)
    bw += ew("copy", 2 * bt * C + 5 * bt * C // tp, ron)  # dq, dk, dv packed, heads split, dq scaled, two adds
    w = _gemms(profile, [(1, C, bt, 3 * C // tp), (1, C // tp, bt, C), (1, C, bt, 4 * C // tp), (1, 4 * C // tp, bt, C)], ron)
    ar = profile.comm_time("all_reduce", bt * C * profile.itemsize, tp, place.tp_intra, ron)  # one g or f
    gather = 0.0
    if layout.zero == 3 and layout.dp > 1:
        unit = -(-formulas.block_params(C, tp, model.bias) // layout.dp) * layout.dp * profile.itemsize
        gather = profile.comm_time("all_gather", unit, layout.dp, place.dp_intra, ron)
    w_gather = gather if split else 0.0  # the deferred W gathers the block again
    return ActionCost(f + 2 * ar + gather, bw + 2 * ar + gather, w + w_gather, 4 * ar, 2 * gather + w_gather)


def outer_cost(model: ModelSpec, layout: Layout, profile: Profile, place: Placement, first: bool, last: bool) -> ActionCost:
    """The embedding (first stage) and the final LayerNorm, tied head and vocab-parallel
    cross-entropy (last stage) for one micro-batch; their weight grads are part of B."""
    bt, C, tp, ron = layout.rows(model) * model.block_size, model.n_embd, layout.tp, place.ranks_on_node
    k, ew = profile.itemsize, profile.elementwise_time
    v_local = formulas.padded_vocab(model.vocab_size, tp) // tp
    f = b = tp_s = 0.0
    if first:
        f += ew("copy", bt * C, ron)  # the lookup and the position add
        b += ew("copy", 3 * bt * C, ron)  # wpe's sum and the sorted row sums of wte
        t = profile.comm_time("all_reduce", bt * C * k, tp, place.tp_intra, ron)
        f, tp_s = f + t, tp_s + t
    if last:
        f += ew("layernorm_fwd", bt * C, ron) + profile.gemm_time(1, bt, C, v_local, ron) + ew("softmax_fwd", bt * v_local, ron)
        b += (ew("softmax_bwd", bt * v_local, ron) + profile.gemm_time(1, v_local, bt, C, ron)
              + profile.gemm_time(1, bt, v_local, C, ron) + ew("layernorm_bwd", bt * C, ron))
        t_f = profile.comm_time("all_reduce", bt * k, tp, place.tp_intra, ron) + profile.comm_time(
            "all_reduce", 2 * bt * k, tp, place.tp_intra, ron)  # the row maxima; [sum-exp, target logit]
        t_b = profile.comm_time("all_reduce", bt * C * k, tp, place.tp_intra, ron)
        f, b, tp_s = f + t_f, b + t_b, tp_s + t_f + t_b
    gather = 0.0
    if layout.zero == 3 and layout.dp > 1 and (first or last):
        n = formulas.outer_params(C, model.vocab_size, model.block_size, tp, first, last, model.bias)
        gather = profile.comm_time("all_gather", -(-n // layout.dp) * layout.dp * k, layout.dp, place.dp_intra, ron)
    return ActionCost(f + gather, b + gather, 0.0, tp_s, 2 * gather)


def chunk_costs(model: ModelSpec, layout: Layout, profile: Profile, place: Placement, split: bool) -> list[ActionCost]:
    """Per model stage (pp·v of them), one micro-batch's costs through it."""
    stages = layout.pp * layout.virtual_stages
    per = model.n_layer // stages
    block = block_cost(model, layout, profile, place, split)
    if layout.recompute == "full":  # each block's forward runs again before its backward
        block = ActionCost(block.f, block.b + block.f, block.w, block.tp * 1.5, block.zero3 + block.zero3 / 2)
    elif layout.recompute != "none":
        raise ValueError(f"recompute={layout.recompute!r}: the time model knows none and full")
    blocks = ActionCost(block.f * per, block.b * per, block.w * per, block.tp * per, block.zero3 * per)
    return [blocks + outer_cost(model, layout, profile, place, k == 0, k == stages - 1) for k in range(stages)]


def _dp_calls(model: ModelSpec, layout: Layout, sizes: list[int], itemsize: int, bucket_bytes: int) -> dict[str, int]:
    """How many calls carry formulas.dp_bytes' payload per op: ZeRO 0 one all-reduce per
    bucket (contiguous ready units of at least `bucket_bytes`), 1 a reduce-scatter and an
    all-gather per unit, 2/3 a reduce-scatter per block and micro-batch (the outer unit once)."""
    units = len(sizes)
    m = layout.micro_batches
    if layout.zero == 0:
        calls, acc = 0, 0
        for n in sizes:  # layout order: blocks last to first, then the outer unit
            acc += -(-n // layout.dp) * layout.dp * itemsize
            if acc >= bucket_bytes:
                calls, acc = calls + 1, 0
        return {"all_reduce": calls + (acc > 0)}
    if layout.zero == 1:
        return {"reduce_scatter": units, "all_gather": units}
    rs = m * (units - 1) + 1
    return {"reduce_scatter": rs, "all_gather": units if layout.zero == 2 else 0}


@functools.lru_cache(maxsize=4096)
def _simulated(name: str, pp: int, m: int, v: int, t_f: float, t_b: float, t_w: float, hop: float) -> tuple[float, float]:
    """(makespan, busy time of the busiest rank) of `simulate`; cached, as layouts that differ
    only in what the pipeline does not see (ZeRO 0-2, say) ask for the same."""
    tl = simulate(schedule_of(name, pp, m, v), t_f=t_f, t_b=t_b, t_w=t_w, comm=hop)
    return tl.makespan, max(tl.busy(r) for r in range(pp))


def predict_time(model: ModelSpec, layout: Layout, profile: Profile, bucket_bytes: int = 1 << 20) -> StepTime:
    """The predicted step of the slowest rank."""
    place = placement(layout, profile)
    ron, k = place.ranks_on_node, profile.itemsize
    sched = layout.sched
    costs = chunk_costs(model, layout, profile, place, sched.split_backward)
    worst = max(costs, key=lambda c: c.f + c.b + c.w)
    act = layout.rows(model) * model.block_size * model.n_embd * k
    hop = profile.comm_time("send", act, 2, place.pp_intra, ron) if layout.pp > 1 else 0.0
    makespan, busy = _simulated(layout.schedule, layout.pp, layout.micro_batches, layout.virtual_stages,
                                worst.f, worst.b, worst.w, hop)
    per_mb = layout.micro_batches * layout.virtual_stages
    tp_time, z3_time = worst.tp * per_mb, worst.zero3 * per_mb
    # data parallel: formulas.dp_bytes' payload, split over its calls, on the pp rank with the most
    dp_exposed = 0.0
    if layout.dp > 1:
        sizes = unit_sizes(model, layout, 0)
        padded = [-(-n // layout.dp) * layout.dp for n in sizes]
        total = formulas.dp_bytes(layout.zero, layout.micro_batches, sum(padded[:-1]), padded[-1], k, sched.split_backward)
        calls = _dp_calls(model, layout, sizes, k, bucket_bytes)
        backward = layout.micro_batches * (worst.b + worst.w) if layout.zero >= 2 else worst.b + worst.w
        for op, nbytes in total.items():
            if op == "all_gather" and layout.zero == 3:
                continue  # inside F and B (worst.zero3)
            n = calls.get(op, 0)
            if not n or not nbytes:
                continue
            one = profile.comm_time(op, nbytes / n, layout.dp, place.dp_intra, ron)
            if op == "all_gather" or not profile.overlap:
                dp_exposed += n * one  # after the optimiser step / no progress during backward
            else:
                dp_exposed += max(one, n * one - backward)
    other = 0.0
    if layout.pp > 1:  # the tied embedding's gradient, summed between the first and last stage
        tied = formulas.padded_vocab(model.vocab_size, layout.tp) // layout.tp * model.n_embd * k
        other += profile.comm_time("all_reduce", tied, 2, place.pp_intra, ron)
    for group in (layout.pp * layout.dp, layout.pp * layout.tp * (layout.dp if layout.zero else 1)):  # loss, norm
        other += profile.comm_time("all_reduce", formulas.SCALAR, group, place.pp_intra and place.dp_intra, ron)
    sizes0 = unit_sizes(model, layout, 0)
    state = sum(-(-n // layout.dp) for n in sizes0) if layout.zero >= 1 else sum(sizes0)
    optimizer = profile.elementwise_time("adamw", state, ron) + profile.elementwise_time("copy", state, ron)  # + the norm's dot
    pp_exposed = max(0.0, makespan - busy) if layout.pp > 1 else 0.0
    bubble_ideal = _simulated(layout.schedule, layout.pp, layout.micro_batches, layout.virtual_stages,
                              worst.f, worst.b, worst.w, 0.0)[0] - busy
    pp_comm = max(0.0, pp_exposed - bubble_ideal)
    compute = busy - tp_time - z3_time
    total = makespan + dp_exposed + other + optimizer
    return StepTime(
        compute=compute,
        comm={"tp": tp_time, "pp": pp_comm, "dp": dp_exposed + z3_time, "other": other},
        bubble=max(0.0, bubble_ideal),
        optimizer=optimizer,
        total=total,
    )
