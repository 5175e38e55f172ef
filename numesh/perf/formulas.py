"""Formulas in one place: memory per rank, bytes per axis per step, FLOPs per token and the
pipeline bubble, as pure functions. The tests check measurements against them (measured ==
formula), `numesh report` puts them beside what a traced run measured.

Bytes are payloads, the local buffer each call is given (`ByteCounter`'s "payload"): an
all-reduce of S bytes, an all-gather into S bytes, a reduce-scatter of S bytes, a send of S
bytes. `bus_bytes` turns them into NCCL-tests bus bytes.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Sequence

import attrs

from numesh.base.padding import padded_vocab, round_up
from numesh.pipeline.schedules import Schedule, simulate

SCALAR = 8  # one float64 all-reduced (loss, gradient norm)


@attrs.frozen
class Parts:
    """A model kind's parts, as far as they change what the formulas count
    (`numesh.nn.gpt.GPTConfig` names them; `Parts.of` takes them from one). The defaults are
    GPT-2's, so a formula given none counts GPT-2's model.

    Attributes:
        hidden: the MLP's (and each expert's) hidden size F; 0 = 4·C.
        gated: SwiGLU: a gate [C, F] beside fc (three matrices of C·F where GELU has two),
            and three [.., F] arrays kept for backward (gate, up, product) where GELU keeps
            two (its input and output; `ActivationShape.mlp_values`).
        kv_heads: key/value heads of grouped-query attention: q [C, C] column-parallel, k
            and v [C, kv_heads·head_size] replicated over tp (each tp rank computes the kv
            heads its query heads read, `numesh.nn.parts.local_kv_heads`); 0 = one per query
            head, q, k and v in one fused [C, 3, C] Linear.
        head_size: C / n_head (needed with kv_heads and rotary).
        rmsnorm: every norm is RMSNorm: one weight vector, no bias.
        rotary: rotary positions: no wpe; q and k rotated after their projections.
        tied: the LM head is wte; else its own vocab-parallel [V, C] on the last stage.
    """

    hidden: int = 0
    gated: bool = False
    kv_heads: int = 0
    head_size: int = 0
    rmsnorm: bool = False
    rotary: bool = False
    tied: bool = True

    @classmethod
    def of(cls, cfg: Any) -> "Parts":
        """The parts of a `GPTConfig` (or anything with its `norm`, `positions`, `mlp`,
        `hidden`, `kv_heads`, `head_size`, `fused_qkv` and `tie_embeddings`)."""
        gelu_default = cfg.mlp == "gelu" and cfg.hidden == 4 * cfg.n_embd
        rotary = cfg.positions == "rotary"
        return cls(hidden=0 if gelu_default else cfg.hidden, gated=cfg.mlp == "swiglu",
                   kv_heads=0 if cfg.fused_qkv else cfg.kv_heads,
                   head_size=0 if cfg.fused_qkv and not rotary else cfg.head_size,
                   rmsnorm=cfg.norm == "rmsnorm", rotary=rotary, tied=cfg.tie_embeddings)

    def ffn(self, n_embd: int) -> int:
        """The MLP's hidden size F."""
        return self.hidden or 4 * n_embd

    @property
    def mlp_matrices(self) -> int:
        """C×F matrices of one MLP: fc and proj, and SwiGLU's gate."""
        return 3 if self.gated else 2

    def kv_width(self, n_embd: int) -> int:
        """Columns of k (and of v): every head's, or the kv heads' only."""
        return self.kv_heads * self.head_size if self.kv_heads else n_embd

    def local_kv(self, n_embd: int, tp: int) -> int:
        """Columns of k (and of v) a tp rank computes and attends with: its heads' C/tp, or
        with grouped-query attention the kv heads its query heads read (one when tp > kv heads)."""
        if not self.kv_heads:
            return n_embd // tp
        return max(1, self.kv_heads // tp) * self.head_size

    def norm_values(self, n_embd: int, bias: bool) -> int:
        """Values of one norm: its weight, and a LayerNorm's bias."""
        return 2 * n_embd if bias and not self.rmsnorm else n_embd


GPT2 = Parts()


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
    """Training FLOPs per token as MFU counts them: 6 per parameter plus 12·L·H·Q·T for
    attention (H·Q = n_embd), the convention of PaLM's appendix B and nanoGPT's MFU. It
    counts attention's scores and weighted sum over all T keys; the fused kernel computes
    only the causal half (`attention_flops`), so like every causal trainer reporting this
    convention, MFU credits attention with about twice the FLOPs it executes."""
    return 6.0 * n_params + 12.0 * n_layer * n_embd * block_size


def attention_flops(seq: int, n_embd: int, query_tile: int = 1) -> float:
    """FLOPs one sequence's causal attention executes in one layer, forward and backward,
    summed over heads: each of the 7 head-size GEMMs (forward q·kᵀ and p·v; backward q·kᵀ
    again, dp, dv, dq, dk) covers each query's visible keys once, 2·n_embd FLOPs per
    (query, key) pair. The kernel multiplies whole stripes of `query_tile` queries by every
    key up to the stripe's last one, so a stripe's diagonal tile is computed whole."""
    t = max(1, query_tile)
    pairs = sum(min(seq, q0 + t) * (min(seq, q0 + t) - q0) for q0 in range(0, seq, t))
    return 7 * 2.0 * n_embd * pairs


def mfu(achieved_flops: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved over peak, never clamped (above 1 says the peak is
    wrong, and hiding that would hide it); 0 without a peak."""
    return achieved_flops / peak_flops if peak_flops > 0 else 0.0


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
    """What a rank's model chunk holds: its blocks (`moe_blocks` of them with experts), and
    whether it is the model's first (embedding) or last (head and loss) stage."""

    blocks: int
    first: bool
    last: bool
    moe_blocks: int = 0


def moe_cp_bytes(chunk: Chunk, rows: int, block_size: int, moe: ExpertShape, recompute: str = "none") -> dict[str, int]:
    """Payload bytes per op one micro-batch moves over cp in its MoE blocks' forwards (two
    under full recomputation), where a sequence's tokens are split over cp: each block sums
    its sequences' routing counts and mean probabilities over cp (2·rows·E float64,
    numesh.nn.moe.seq_balance) and, with a capacity, gathers each assignment's (expert,
    probability, position) of the whole sequence (rows·block_size·k·3 float64,
    `apply_capacity`)."""
    forwards = chunk.moe_blocks * (2 if recompute == "full" else 1)
    out = {"all_reduce": forwards * 2 * rows * moe.experts * INDEX_BYTES}
    if moe.capacity:
        out["all_gather"] = forwards * rows * block_size * moe.top_k * 3 * INDEX_BYTES
    return out


def moe_tp_bytes(chunk: Chunk, rows: int, block_size: int, top_k: int, itemsize: int) -> int:
    """Payload bytes one micro-batch all-reduces over tp in its MoE blocks beside the
    activations' (`tp_all_reduce_bytes`, `tp_sequence_parallel_bytes`): each block's
    backward sums the gradient of its combine weights [N, k] over tp, as the experts'
    outputs it is taken from are partial over tp (numesh.nn.moe.moe_bwd; N = rows ×
    block_size tokens, whole on every tp rank, with or without sp; once under full
    recomputation, whose rerun forward has none)."""
    return chunk.moe_blocks * rows * block_size * top_k * itemsize


def tp_all_reduce_bytes(chunk: Chunk, rows: int, block_size: int, n_embd: int, itemsize: int,
                        recompute: str = "none") -> int:
    """Payload bytes all-reduced over tp by one micro-batch's forward and backward through
    a chunk (Megatron): per block the g of attention and MLP forward and the f of both
    halves backward (4 activations), 6 under full recomputation (backward reruns the
    forward, its two g's included); the vocab-parallel embedding lookup (forward) and the
    LM head's input gradient (backward), one activation each; the cross-entropy's row
    maxima (pmax) and [sum-exp, target logit] (psum), 3 values per token."""
    act = rows * block_size * n_embd * itemsize
    total = (6 if recompute == "full" else 4) * chunk.blocks * act
    if chunk.first:
        total += act
    if chunk.last:
        total += act + 3 * rows * block_size * itemsize
    return total


def tp_sequence_parallel_bytes(chunk: Chunk, rows: int, block_size: int, n_embd: int, itemsize: int,
                               recompute: str = "none") -> dict[str, int]:
    """Payload bytes per op over tp of one micro-batch's forward and backward through a chunk
    with sequence parallelism (Korthikanti et al. 2022). Each all-reduce of an activation in
    `tp_all_reduce_bytes` becomes an all-gather and a reduce-scatter of the full activation
    (payload = the gathered output, the scattered input): per block the gathers before QKV
    and MLP-up forward and their reduce-scatters backward, the reduce-scatters after the
    out-projection and MLP-down forward and their gathers backward; the embedding's lookup
    is reduce-scattered (its gradient gathered), the head's input gathered (its gradient
    reduce-scattered). The cross-entropy's 3 values per token stay all-reduces.

    A LayerNorm keeps only its sequence slice, so backward gathers each one again for its
    matmul's weight gradient (numesh.nn.transformer.norm_regather): 2 more all-gathers per
    block and one for the head. Under full recomputation the rerun forward gathers and
    reduce-scatters twice per block more and keeps its gathered outputs (no regather in
    its blocks).

    Bus bytes of the pairs are those of plain tp (an all-reduce of S moves 2(n-1)/n·S, a
    gather plus a scatter (n-1)/n·S each); the regathers add (n-1)/n·S per LayerNorm. The
    LayerNorm grads' once-per-step all-reduce comes on top (`step_bytes`, `tp_partial_values`)."""
    act = rows * block_size * n_embd * itemsize
    pairs = 4 * chunk.blocks + int(chunk.first) + int(chunk.last)
    rerun = 2 * chunk.blocks if recompute == "full" else 0
    regather = (0 if recompute == "full" else 2 * chunk.blocks) + int(chunk.last)
    out = {"all_gather": (pairs + rerun + regather) * act, "reduce_scatter": (pairs + rerun) * act}
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
    stage holds it, each dp (and ep) rank for its rows and, with cp, each cp rank for its tokens."""
    return ("pp", "dp") + tuple(a for a in ("ep", "cp") if shape.get(a, 1) > 1)


def cp_ring_bytes(chunk: Chunk, rows: int, block_size: int, n_embd: int, tp: int, cp: int, itemsize: int,
                  parts: Parts = GPT2, recompute: str = "none") -> int:
    """Payload bytes one micro-batch sends around the cp ring through a chunk (ring
    attention, `numesh.nn.ring_attention`). A K or V block is rows × T/cp tokens × C/tp
    (this tp rank's heads; with grouped-query attention the columns of the kv heads its
    query heads read, `Parts.local_kv`); per layer the forward passes cp-1 K and V blocks
    (again in backward's rerun under full recomputation), the backward cp-1 K and V blocks
    again and cp dK and dV accumulators (the last hop takes each home)."""
    if cp == 1:
        return 0
    blk = rows * (block_size // cp) * parts.local_kv(n_embd, tp) * itemsize
    forwards = 2 if recompute == "full" else 1
    return chunk.blocks * (forwards * 2 * (cp - 1) + 2 * (cp - 1) + 2 * cp) * blk


def cp_grad_bytes(zero: int, micro_batches: int, padded_blocks: int, padded_outer: int, itemsize: int) -> int:
    """Payload bytes of gradients all-reduced over cp alone in one step under ZeRO 1-3 (ZeRO
    0 all-reduces over dp×cp jointly instead: `dp_bytes` on "dp+cp"): stage 1 each unit
    once, stages 2/3 each block per micro-batch and the outer unit once (see `dp_bytes`)."""
    if zero == 0:
        return 0
    if zero == 1:
        return (padded_blocks + padded_outer) * itemsize
    return (micro_batches * padded_blocks + padded_outer) * itemsize


def ep_grad_bytes(ep_replicated_values: int, itemsize: int) -> int:
    """Payload bytes of gradients all-reduced over ep alone in one step: every value of the
    leaves replicated over ep (all but the experts) that this rank holds after the dp
    reduction (its dp shard of them under ZeRO >= 1), once per step, as the tp-partial
    LayerNorm gradients under sequence parallelism."""
    return ep_replicated_values * itemsize


def norm_axes(shape: dict[str, int], zero: int) -> tuple[str, ...]:
    """Axes the gradient norm's partial sums are all-reduced over: ep too, whose ranks hold
    other experts (the leaves replicated over ep are counted on ep rank 0 only)."""
    axes = [a for a in ("pp", "ep", "tp") if shape.get(a, 1) > 1]
    if zero >= 1 and shape["dp"] > 1:
        axes.append("dp")
    return tuple(a for a in ("pp", "dp", "ep", "tp") if a in axes)


@attrs.frozen
class StepShape:
    """The layout and sizes that fix one training step's traffic, the same on every rank:
    the mesh's axis sizes (`mesh`, as `Mesh.shape` and the planner's `Layout.shape` give
    them), the ZeRO stage, `micro_batches` of `rows` sequences each on a rank (the batch is
    split over dp × ep), `block_size` tokens of width `n_embd` in `itemsize`-byte values;
    whether the schedule runs W apart from B (`split_backward`, zb-h1), whether tp also
    splits the sequence (`sequence_parallel`), the activation recomputation ("full"
    reruns each block's forward, its tp communication included, in backward), the
    model's `parts` (grouped-query attention's K/V blocks around the cp ring) and its MoE
    blocks' experts (`moe_tp_bytes`, `moe_cp_bytes`)."""

    mesh: dict[str, int]
    zero: int
    micro_batches: int
    rows: int
    block_size: int
    n_embd: int
    itemsize: int
    split_backward: bool = False
    sequence_parallel: bool = False
    recompute: str = "none"
    parts: Parts = GPT2
    moe: ExpertShape | None = None  # the MoE blocks' experts (`Chunk.moe_blocks`); None: dense


@attrs.frozen
class RankUnits:
    """What one rank holds that its step's traffic depends on: its model `chunks`; its
    units' values padded to a multiple of dp (`padded_blocks` over its blocks,
    `padded_outer` the embedding/head unit); its wte gradient's bytes (`tied_bytes`), summed
    between the first and last pp rank when pp > 1 (0 on other ranks); and the gradient
    values it holds (its dp shard of them under ZeRO >= 1) of the leaves reduced apart from
    the dp sum, once per step: over tp the norms' under sequence parallelism and
    grouped-query attention's k and v with tp > 1 (`tp_partial_values`), those replicated
    over ep (`ep_replicated_values`); the bytes a matrix rule (Muon) moves to have each
    matrix whole on one rank, over dp and over tp (`matrix_exchange_bytes`). A traced run
    records these fields as its ranks' metadata, from which `numesh report` computes them."""

    chunks: tuple[Chunk, ...] = attrs.field(converter=tuple)
    padded_blocks: int
    padded_outer: int
    tied_bytes: int = 0
    tp_partial_values: int = 0
    ep_replicated_values: int = 0
    matrix_all_to_all: int = 0  # a matrix rule's (Muon's) exchange over dp: `matrix_exchange_bytes`
    matrix_all_gather: int = 0  # ... its gather over tp, in traces before the matrices were dealt over tp
    matrix_dp_gather: int = 0  # ... and under ZeRO 0 its results' all-gather over dp
    matrix_replica_all_to_all: int = 0  # ... and its exchange over ep x cp x tp with the replica computing each


def step_bytes(step: StepShape, rank: RankUnits, all_to_all_bytes: int = 0) -> dict[tuple[str, str], int]:
    """Payload bytes per (axes, op) one rank moves in one training step (axes as "dp",
    "pp+dp", or "pp[0,3]" for the tied-embedding group), sends but not receives, for the
    step's layout and what the rank holds. With cp, add the ring's K/V traffic and the
    gradients' sum over cp (`cp_ring_bytes`, `cp_grad_bytes`); with tp the all-reduce of the
    gradients partial over it (the norms' under sequence parallelism, grouped-query
    attention's k and v: `tp_partial_values`); with ep the replicated leaves' all-reduce over
    ep (`ep_grad_bytes`) and `all_to_all_bytes`, the experts' token all-to-alls of the step,
    which depend on the routing (`moe_step_all_to_all_bytes` of the step's recorded counts;
    0 for dense meshes)."""
    shape, zero, m, itemsize = step.mesh, step.zero, step.micro_batches, step.itemsize
    rows, n_embd, recompute, chunks = step.rows, step.n_embd, step.recompute, rank.chunks
    padded_blocks, padded_outer = rank.padded_blocks, rank.padded_outer
    out: dict[tuple[str, str], int] = {}
    cp = shape.get("cp", 1)

    def add(axes: str, op: str, n: int) -> None:
        if n:
            out[(axes, op)] = out.get((axes, op), 0) + n

    if shape["dp"] > 1 or (cp > 1 and zero == 0):
        for op, n in dp_bytes(zero, m, padded_blocks, padded_outer, itemsize, step.split_backward).items():
            if shape["dp"] > 1 or op == "all_reduce":
                add("dp+cp" if cp > 1 and zero == 0 else "dp", op, n)
    if cp > 1:
        add("cp", "send",
            m * sum(cp_ring_bytes(c, rows, step.block_size, n_embd, shape["tp"], cp, itemsize, step.parts, recompute)
                    for c in chunks))
        add("cp", "all_reduce", cp_grad_bytes(zero, m, padded_blocks, padded_outer, itemsize))
        if step.moe is not None:
            for c in chunks:
                for op, n in moe_cp_bytes(c, rows, step.block_size, step.moe, recompute).items():
                    add("cp", op, m * n)
    t = step.block_size // cp  # tokens of each sequence on this rank
    if shape["tp"] > 1 and step.sequence_parallel:
        for c in chunks:
            for op, n in tp_sequence_parallel_bytes(c, rows, t, n_embd, itemsize, recompute).items():
                add("tp", op, m * n)
    elif shape["tp"] > 1:
        add("tp", "all_reduce", m * sum(tp_all_reduce_bytes(c, rows, t, n_embd, itemsize, recompute) for c in chunks))
    if shape["tp"] > 1:
        if step.moe is not None:  # the MoE blocks' combine-weight grads, per micro-batch
            add("tp", "all_reduce", m * sum(moe_tp_bytes(c, rows, t, step.moe.top_k, itemsize) for c in chunks))
        # the norms' grads under sp, GQA's k and v grads: partial over tp, summed once a step
        add("tp", "all_reduce", rank.tp_partial_values * itemsize)
    if shape["pp"] > 1:
        split = shape["tp"] if step.sequence_parallel else 1
        add("pp", "send", m * sum(pp_send_bytes(c, rows, t, n_embd, itemsize, split) for c in chunks))
        if rank.tied_bytes:
            add(f"pp[0,{shape['pp'] - 1}]", "all_reduce", rank.tied_bytes)
    add("dp", "all_to_all", rank.matrix_all_to_all)
    add("tp", "all_gather", rank.matrix_all_gather)
    # the axes of `matrices.replica_axes`, spelled here: importing it would import MPI
    add("+".join(a for a in ("ep", "cp", "tp") if shape.get(a, 1) > 1) or "tp", "all_to_all",
        rank.matrix_replica_all_to_all)
    add("dp", "all_gather", rank.matrix_dp_gather)
    if shape.get("ep", 1) > 1:
        add("ep", "all_reduce", ep_grad_bytes(rank.ep_replicated_values, itemsize))
        add("ep", "all_to_all", all_to_all_bytes)
    if shape["pp"] * shape["dp"] * shape.get("ep", 1) * cp > 1:  # the step's loss
        add("+".join(loss_axes(shape)), "all_reduce", SCALAR)
    if axes := norm_axes(shape, zero):  # the gradient norm
        add("+".join(axes), "all_reduce", SCALAR)
    return out


def bubble(schedule: Schedule, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0,
           stage_costs: dict[tuple[str, int], float] | None = None,
           action_costs: dict[tuple[str, int, int], float] | None = None) -> dict:
    """The schedule's idle time on an ideal machine (`simulate`, no communication cost):
    the fraction `1 - busy / (p · makespan)` and each rank's idle fraction of the makespan.
    `stage_costs` gives (kind, global stage) its own cost, `action_costs` (kind,
    micro-batch, global stage) its own (see `simulate`)."""
    tl = simulate(schedule, t_f=t_f, t_b=t_b, t_w=t_w, stage_costs=stage_costs, action_costs=action_costs)
    per_rank = [tl.idle(r) / tl.makespan if tl.makespan > 0 else 0.0 for r in range(schedule.p)]
    return {"fraction": tl.bubble_fraction, "per_rank": per_rank, "makespan": tl.makespan}


# ---------------------------------------------------------------------------------------
# Memory per rank: parameter units, ZeRO buffers and saved activations
#
# Counted the way numesh measures them: `ZeroOptimizer.memory()` for the buffers held
# between steps, `StepStats.peak_bytes` (the `nbytes` of the contexts the executor holds)
# for activations. The planner (numesh.plan) builds its predictions from these.

TOKEN_ID_BYTES = 8  # token ids and targets are int64 (numesh.data.batches.read_rows)


def attention_params(n_embd: int, tp: int = 1, bias: bool = False, parts: Parts = GPT2) -> int:
    """Values of one block's attention Linears on one tp rank: the fused QKV [C, 3, C]
    column-parallel (its bias split too), or grouped-query attention's q [C, C]
    column-parallel and k, v [C, kv] replicated over tp (biases likewise); the
    out-projection [C, C] row-parallel, its bias replicated."""
    C = n_embd
    if not parts.kv_heads:
        return 4 * C * C // tp + ((3 * C // tp + C) if bias else 0)
    kv = parts.kv_width(C)
    return 2 * C * C // tp + 2 * C * kv + ((C // tp + 2 * kv + C) if bias else 0)


def block_params(n_embd: int, tp: int = 1, bias: bool = False, parts: Parts = GPT2) -> int:
    """Values of one transformer block on one tp rank: its attention (`attention_params`),
    its MLP (`expert_params`: column-parallel fc and gate, row-parallel proj) and its two
    norms, replicated. GPT-2's is 12·C²/tp + 2·C (+ 2C + 3C/tp + C + 4C/tp + C of biases)."""
    return (attention_params(n_embd, tp, bias, parts) + expert_params(n_embd, bias, tp, parts)
            + 2 * parts.norm_values(n_embd, bias))


def expert_params(n_embd: int, bias: bool = False, tp: int = 1, parts: Parts = GPT2) -> int:
    """Values of one MLP (a dense block's, or one expert) on a tp rank: fc [C, F] (and
    SwiGLU's gate [C, F]) column-parallel with their biases, proj [F, C] row-parallel, its
    bias whole. GPT-2's (F = 4C): 8·C²/tp + 4C/tp + C."""
    C, F, mats = n_embd, parts.ffn(n_embd), parts.mlp_matrices
    return mats * C * F // tp + (((mats - 1) * F // tp + C) if bias else 0)


def moe_block_params(n_embd: int, experts: int, bias: bool = False, parts: Parts = GPT2) -> int:
    """Values of one MoE block (one rank): the dense block's attention and norms, the
    router C·E (no bias) and E experts in place of the MLP."""
    one = expert_params(n_embd, bias, 1, parts)
    return block_params(n_embd, 1, bias, parts) - one + n_embd * experts + experts * one


def active_params(n_params: int, n_embd: int, moe_blocks: int, experts: int, top_k: int, bias: bool = False,
                  parts: Parts = GPT2) -> int:
    """The parameters one token uses, of a model of `n_params` with `moe_blocks` MoE blocks:
    all but the E - k experts each MoE block does not route it to."""
    return n_params - moe_blocks * (experts - top_k) * expert_params(n_embd, bias, 1, parts)


def counted_params(n_params: int, vocab: int, n_embd: int, parts: Parts = GPT2) -> int:
    """The parameters `flops_per_token` counts 6 FLOPs each for, of a model of `n_params`
    (its active ones, with experts): all of them, less an untied token embedding, which
    is looked up, not multiplied (the untied LM head beside it is counted); tied, wte is
    also the head's matrix and counts once. torchtitan and Megatron-LM count a Llama so."""
    return n_params - (0 if parts.tied else vocab * n_embd)


def moe_mlp_flops_per_token(n_embd: int, experts: int, top_k: int, parts: Parts = GPT2) -> float:
    """Training FLOPs per token of one MoE MLP's matmuls: forward 2 per weight used (the
    router's C·E, and the C·F matrices of each of its k experts: two, three with SwiGLU),
    backward twice that (input and weight gradients). Bias adds, the activation and the
    softmax are not counted, as for the dense model (`flops_per_token` with
    `active_params` counts the same)."""
    return 6.0 * (n_embd * experts + top_k * parts.mlp_matrices * n_embd * parts.ffn(n_embd))


def moe_all_to_all_bytes(send: Sequence[int], recv: Sequence[int], rank: int, n_embd: int, experts: int,
                         itemsize: int, recompute: str = "none") -> int:
    """Bytes ep rank `rank` sends over ep in one MoE layer's forward and backward of one
    micro-batch, given its routing: `send[d]` token-assignment rows it routes to the experts
    of ep rank d, `recv[s]` rows it receives from ep rank s (row `rank` and column `rank`
    of the ep group's rows[s, d] matrix, `Dispatch.send`/`recv`: this rank's counts alone
    suffice). The counts first (E/ep int64 to each other rank), then the rows: forward
    sends its tokens' rows to the other ranks' experts and their outputs back to them (the
    rows it received), and backward does both again with the gradients. A rank's own rows
    stay (send[rank] = recv[rank]). Full recomputation reruns the forward, counts and
    rows there and back, in backward. Every tp rank moves the same bytes (tokens are
    whole on each)."""
    ep = len(send)
    moved = int(sum(int(n) for n in send)) + int(sum(int(n) for n in recv)) - 2 * int(send[rank])
    forwards = 2 if recompute == "full" else 1
    return (forwards + 1) * moved * n_embd * itemsize + forwards * (ep - 1) * (experts // ep) * 8


def moe_step_all_to_all_bytes(routing: Iterable[tuple[Sequence[int], Sequence[int]]], rank: int, n_embd: int,
                              experts: int, itemsize: int, recompute: str = "none") -> int:
    """Bytes a rank sends over ep in one training step: `moe_all_to_all_bytes` summed over
    the (send, recv) row counts of each MoE layer on its stage and each micro-batch (what
    `RoutingStats.send`/`recv` record, `StepStats.moe`); the `all_to_all_bytes` of `step_bytes`."""
    return sum(moe_all_to_all_bytes(s, r, rank, n_embd, experts, itemsize, recompute) for s, r in routing)


def moe_expert_values(n_embd: int, experts: int, ep: int = 1, tp: int = 1, bias: bool = False,
                      parts: Parts = GPT2) -> int:
    """Values of one MoE block's experts on one rank: its E/ep experts, each tp-split as the
    dense MLP: fc.w [E/ep, C, F/tp] (and gate.w), fc.b [E/ep, F/tp], proj.w [E/ep, F/tp, C],
    proj.b [E/ep, C] (the leaves whose spec names "ep")."""
    return experts // ep * expert_params(n_embd, bias, tp, parts)


def moe_block_other_values(n_embd: int, experts: int, tp: int = 1, bias: bool = False, parts: Parts = GPT2) -> int:
    """Values of one MoE block on one rank that are not experts (replicated over ep): the
    dense block's attention and norms (`block_params` less its MLP) and the router C·E."""
    return block_params(n_embd, tp, bias, parts) - expert_params(n_embd, bias, tp, parts) + n_embd * experts


def moe_rank_units(*, n_embd: int, vocab: int, block_size: int, experts: int, moe_layers: Sequence[bool], ep: int = 1,
                   tp: int = 1, bias: bool = False, first: bool = True, last: bool = True,
                   parts: Parts = GPT2) -> list[tuple[int, int]]:
    """(non-expert, expert) values of each parameter unit of a rank: one per block of its
    stage (`moe_layers`: whether each is an MoE block) and the outer unit. In the flat
    layout (numesh.optim.flat) a unit's expert values come after its others: an MoE
    block's experts (mlp.fc, mlp.proj, mlp.gate) are its last leaves."""
    units = [(moe_block_other_values(n_embd, experts, tp, bias, parts),
              moe_expert_values(n_embd, experts, ep, tp, bias, parts))
             if moe else (block_params(n_embd, tp, bias, parts), 0) for moe in moe_layers]
    units.append((outer_params(n_embd, vocab, block_size, tp, first, last, bias, parts), 0))
    return units


def shard_values(units: Iterable[tuple[int, int]], dp: int, rank: int | None) -> dict[str, int]:
    """Values of a flat buffer over `units` ((non-expert, expert) values each, in that order,
    each unit padded to a multiple of dp) by kind: "expert", "other" and "padding". With
    `rank` None the whole buffer; else dp rank `rank`'s shard, the rank-th 1/dp of every
    padded unit (so a rank's expert share depends on where the cut falls in each unit)."""
    out = {"expert": 0, "other": 0, "padding": 0}
    for o, x in units:
        padded = round_up(o + x, dp)
        a, b = (0, padded) if rank is None else (rank * padded // dp, (rank + 1) * padded // dp)
        out["other"] += max(0, min(b, o) - a)
        out["expert"] += max(0, min(b, o + x) - max(a, o))
        out["padding"] += max(0, b - max(a, o + x))
    return out


def moe_state_bytes(units: Iterable[tuple[int, int]], dp: int, rank: int, stage: int,
                    itemsize: int = 4) -> dict[str, dict[str, int]]:
    """`ZeroOptimizer.memory()`'s params, grads and optimizer (AdamW's m and v) of dp rank
    `rank`, each split into expert, non-expert and padding bytes (`shard_values` of the
    rank's `moe_rank_units`): whole buffers, or this rank's shard where the ZeRO stage
    shards them (as `memory_formula`: params from 3, grads from 2, moments from 1)."""
    units = list(units)
    whole, shard = shard_values(units, dp, None), shard_values(units, dp, rank)

    def part(sharded: bool, copies: int = 1) -> dict[str, int]:
        return {k: copies * v * itemsize for k, v in (shard if sharded else whole).items()}

    return {"params": part(stage >= 3), "grads": part(stage >= 2), "optimizer": part(stage >= 1, 2)}


def outer_params(n_embd: int, vocab: int, block_size: int, tp: int = 1, first: bool = True, last: bool = True,
                 bias: bool = False, parts: Parts = GPT2) -> int:
    """Values of the outer unit on one rank: the vocab-parallel wte (first stage, and the
    last when it is the tied head), wpe (first stage, learned positions only), the untied
    vocab-parallel lm_head and the final norm (last stage)."""
    C = n_embd
    vocab_rows = padded_vocab(vocab, tp) // tp * C
    n = vocab_rows if (first or (last and parts.tied)) else 0
    n += vocab_rows if last and not parts.tied else 0
    n += block_size * C if first and not parts.rotary else 0
    n += parts.norm_values(C, bias) if last else 0
    return n


def zero_buffer_bytes(unit_sizes: Iterable[int], dp: int, stage: int, itemsize: int = 4,
                      state_values: float | None = None) -> dict[str, int]:
    """`ZeroOptimizer.memory()` of a rank whose units hold `unit_sizes` values: each unit
    padded to a multiple of dp; parameters, gradients and the optimiser state whole or as
    this rank's 1/dp as the stage says; the workspace is the elementwise rules' scratch
    (one state-slice of values) and the weight-decay and norm masks (a byte per value of the
    slice each). The state is `state_values` values (`rule_state_values`; default AdamW's
    two moments of every value of the slice)."""
    padded = [round_up(n, dp) for n in unit_sizes]
    full, shard = sum(padded), sum(p // dp for p in padded)
    state = shard if stage >= 1 else full
    return {
        "params": (shard if stage >= 3 else full) * itemsize,
        "grads": (shard if stage >= 2 else full) * itemsize,
        "optimizer": int((2 * state if state_values is None else state_values) * itemsize),
        "workspace": state * itemsize + 2 * state,
    }


def rule_values(units: Iterable[Sequence[tuple[int, int]]], dp: int, rank: int | None) -> dict[int, int]:
    """Values of each optimiser rule in a rank's slice of the flat buffers: `units` are each
    unit's (rule, values) runs in layout order (its leaves'), each unit padded to a multiple
    of dp with rule 0's padding (numesh.optim.zero: the padding is the first rule's). With
    `rank` None the whole buffers (ZeRO 0), else dp rank `rank`'s 1/dp of every unit."""
    out: dict[int, int] = {}
    for runs in units:
        size = sum(n for _, n in runs)
        padded = round_up(size, dp)
        lo, hi = (0, padded) if rank is None else (rank * padded // dp, (rank + 1) * padded // dp)
        start = 0
        for rule, n in [*runs, (0, padded - size)]:
            out[rule] = out.get(rule, 0) + max(0, min(hi, start + n) - max(lo, start))
            start += n
    return out


def rule_state_values(units: Iterable[Sequence[tuple[int, int]]], dp: int, rank: int, stage: int,
                      per_value: Sequence[int]) -> int:
    """Optimiser state values a rank holds: each rule's values in its slice (`rule_values`:
    this rank's 1/dp from ZeRO 1 on, else whole) times that rule's state buffers
    (`per_value`: AdamW 2, Muon's matrix rule 1)."""
    values = rule_values(units, dp, rank if stage >= 1 else None)
    return sum(per_value[r] * n for r, n in values.items())


def matrix_exchange_bytes(unit_sizes: Sequence[int], slabs: Sequence[tuple[int, int, int, float, bool, bool]],
                          shape: Mapping[str, int], coords: Mapping[str, int], itemsize: int,
                          sharded: bool) -> dict[tuple[str, str], int]:
    """Payload bytes the rank at `coords` of a mesh of axis sizes `shape` sends in one step to
    have each matrix of a matrix rule (Muon) whole on one rank (numesh/optim/matrices.py):
    `slabs` are (unit index, first value in the unit, values, cost, whether split over tp,
    whether experts), tp-local, in layout order; `unit_sizes` the units' values. The slabs
    are dealt to the dp ranks by cost (`assign_owners`). Under ZeRO >= 1 (`sharded`) each
    rank sends every owner the part of its slabs that lies in its 1/dp shard of the unit
    (padded to a multiple of dp), and each owner the rest of its slabs back, all-to-alls
    over dp that count what leaves a rank; under ZeRO 0 the owners' results are all-gathered
    over dp, which counts the gathered buffer (every slab's values). An owner's slabs are
    dealt again to its ep x cp x tp replicas (`matrices.replica_owners`; experts over the cp
    x tp of their ep rank): the tp ranks beside a slab's computing replica send it their
    parts of a tp-split slab, and it sends every other replica holding the slab its tp part
    of the result (all of it for a slab tp does not split), two all-to-alls over the
    replicas."""
    from numesh.optim.matrices import assign_owners, pieces, replica_axes, replica_owners  # the others need no MPI

    dp, rank = shape["dp"], coords["dp"]
    ep, cp, tp = shape["ep"], shape["cp"], shape["tp"]
    n = dp if sharded else 1
    owners = assign_owners([s[3] for s in slabs], dp)
    out: dict[tuple[str, str], int] = {}
    moved = 0
    for (unit, start, size, _cost, _split, _experts), owner in zip(slabs, owners):
        if not sharded:
            continue
        shard = round_up(unit_sizes[unit], n) // n
        lo, hi = pieces(start, size, shard, n)[rank]
        moved += (hi - lo) if owner != rank else size - (hi - lo)  # my piece to its owner; the others' back
    if dp > 1:
        if sharded:
            out[("dp", "all_to_all")] = moved * itemsize
        elif slabs:
            out[("dp", "all_gather")] = sum(s[2] for s in slabs) * itemsize
    mine = [s for s, owner in zip(slabs, owners) if owner == rank]
    row, me, replicas = cp * tp, (coords["ep"] * cp + coords["cp"]) * tp + coords["tp"], 0
    for (_unit, _start, size, _cost, split, experts), r in zip(
            mine, replica_owners([s[3] for s in mine], [s[5] for s in mine], ep, cp, tp, coords["ep"])):
        if r == me:  # each other replica's tp part of the result (or all of it); an expert's: its ep rank's
            replicas += ((row if experts else ep * row) - 1) * size
        elif split and tp > 1 and r // tp == me // tp:
            replicas += size  # my part to the replica beside me that computes it
    if replicas:
        out[("+".join(replica_axes(shape)), "all_to_all")] = replicas * itemsize
    return out




@attrs.frozen
class ActivationShape:
    """The sizes that fix what one micro-batch's forward keeps on a rank, which every
    activation formula takes: `micro_batch` sequences of `seq` tokens (the whole sequence:
    under context parallelism each rank holds `tokens` = seq/cp of them), width `n_embd` in
    `n_head` heads split over `tp` (and the sequence too under sequence parallelism, `sp`),
    the recomputation mode, the activation dtype's `itemsize` and the model's `parts`."""

    micro_batch: int
    seq: int
    n_embd: int
    n_head: int
    tp: int = 1
    cp: int = 1
    sp: bool = False
    recompute: str = "none"
    itemsize: int = 4
    parts: Parts = GPT2

    @property
    def tokens(self) -> int:
        """Tokens of each sequence on this rank (seq/cp)."""
        return self.seq // self.cp

    @property
    def attention_values(self) -> int:
        """Values per token a block's attention keeps on a tp rank, as `activation_parts`
        counts them under "block_sharded": q, k and v (the fused QKV output they view,
        rotated in place with rotary positions; GQA's q and this rank's kv columns of k and
        v) and the attention output."""
        C, t, parts = self.n_embd, self.tp, self.parts
        if not parts.kv_heads:
            return 3 * C // t + C // t
        return 2 * C // t + 2 * parts.local_kv(C, t)

    def mlp_values(self, rows: int = 1) -> int:
        """Values per token (per expert row) an MLP keeps on a tp rank: GELU's input (the
        MLP-up output) and its output, 2·F/tp (its backward computes the exponential again); SwiGLU's
        gate and up outputs and the gated product, 3·F/tp (its backward computes the gate's
        sigmoid again)."""
        return rows * (3 if self.parts.gated else 2) * self.parts.ffn(self.n_embd) // self.tp


def rotary_table_bytes(shape: ActivationShape) -> int:
    """Bytes of the rotary cos and sin tables [s, 1, hs] of a rank's s = seq/cp tokens
    (`numesh.nn.parts.rotary_for`), which every block's context of every micro-batch holds:
    one cached pair, so counted once however many contexts are live (`peak_activation_bytes`'
    `shared`), not in `activation_parts`. 0 with learned positions."""
    if not shape.parts.rotary:
        return 0
    return 2 * shape.tokens * shape.parts.head_size * shape.itemsize


@attrs.frozen
class ExpertShape:
    """A mixture of experts' sizes as one MoE block's saved context sees them: E =
    `experts` split over `ep`, `top_k` of them per token, and whether a capacity factor
    caps what each takes (`capacity`: the block keeps which assignments it kept)."""

    experts: int
    top_k: int
    ep: int = 1
    capacity: bool = False


def check_recompute_mode(recompute: str) -> None:
    """ValueError unless `recompute` is none or full ("selective" was retired with the fused
    attention kernel: numesh.nn.walk.RETIRED)."""
    if recompute not in ("none", "full"):
        raise ValueError(f"recompute must be none or full, got {recompute!r}")


def activation_parts(shape: ActivationShape, chunk: Chunk, vocab: int) -> dict[str, int]:
    """`activation_bytes` part by part: what numesh's forward saves for backward, in bytes,
    for one micro-batch through `chunk` (its `blocks`, the embedding if `first`, the head
    and loss if `last`, over `vocab` tokens) of b = `micro_batch` sequences of s = `seq`
    tokens, width h = `n_embd`, a = `n_head` heads, t = `tp`, k = `itemsize` (the
    activation dtype's), all of them `shape`'s.

    Per block (numesh.nn.transformer.BlockCtx, each array counted once):
      "block_replicated"  k·(4·sbh + 2·sb): LayerNorm 1 and 2 each keep x̂ [b,s,h] and 1/σ
                          [b,s,1], and their outputs h1, h2 [b,s,h] (the QKV and MLP-up
                          inputs). Replicated over tp unless sequence-parallel (`sp`).
      "block_sharded"     k·12·sbh/t: the QKV output that q, k and v are views of (3), the
                          attention output (1, which attention's context views too), the
                          MLP-up output and GELU's output (4 each; GELU's backward computes
                          its exponential again). Other
                          kinds (`shape.parts`): k·sb·(`attention_values` + `mlp_values`):
                          rotary positions rotate q and k in place (no extra values);
                          grouped-query attention keeps q (h/t) and this
                          rank's kv columns of k and v (2·kv_local), rotated or not; SwiGLU
                          keeps gate, up and product (3·F/t; GELU 2·F/t, its input and output).
                          The rotary tables are one pair for every context: `rotary_table_bytes`.
      "block_lse"         k·a·sb/t: each query row's log-sum-exp [b, a/t, s], all the fused
                          attention keeps of its softmax (numesh/nn/attention.py): nothing
                          s×s, with or without dropout, whose pattern is a hash.
      "block_input"       k·sbh: full recomputation keeps only the block's input, instead
                          of the three parts above.
    Residual and embedding dropout masks are redrawn in backward, never kept. So a block
    holds k·(sbh·(4 + 12/t) + 2·sb + a·sb/t) bytes (Korthikanti et al. count 34·sbh +
    5·a·s²·b for fp16 with byte masks and the s×s softmax kept: numesh keeps x̂ beside the
    LayerNorm output, and neither the residual masks nor any s×s tensor) and k·sbh under
    full recomputation.

    Outside the blocks:
      "embed"  (first stage) the token ids, int64 [b,s]; with tp > 1 instead the ids
               relative to this rank's vocabulary slice (int64) and which fall outside it
               (bool), 9·sb.
      "head"   (last stage) the final LayerNorm's x̂, 1/σ and output, k·(2·sbh + sb); the
               exponentiated logits [b·s, V/t] (V padded to a multiple of t) and the
               [sum-exp, target logit] pair, k·(sb·V/t + 2·sb); the targets relative to the
               vocabulary slice (int64) and whether they are inside it (bool), 9·sb.

    Sequence parallelism (`sp`) keeps each LayerNorm's x̂ and 1/σ on this rank's slice
    [b,s/t,·] and not its output (gathered again in backward for the weight gradient):
    "block_replicated" becomes k·2·(sbh + sb)/t, the head's LayerNorm k·(sbh + sb)/t, and a
    fully recomputed block's input k·sbh/t: every part of a block is then divided by t.

    Context parallelism (`cp`) gives each rank s = seq/cp tokens of every sequence, so
    every term above is taken with that s (ring attention keeps the same output and
    log-sum-exp as one rank's). The first stage also keeps the s positions of its tokens
    (int64) for the position embedding's gradient. Dropout changes nothing here."""
    check_recompute_mode(shape.recompute)
    b, s, h, a, t, k = shape.micro_batch, shape.tokens, shape.n_embd, shape.n_head, shape.tp, shape.itemsize
    sp, cp, n_layer, first, last = shape.sp, shape.cp, chunk.blocks, chunk.first, chunk.last
    sb, sbh = s * b, s * b * h
    parts: dict[str, int] = {}
    if shape.recompute == "full":
        parts["block_input"] = n_layer * k * (sbh // t if sp else sbh)
    else:
        parts["block_replicated"] = n_layer * k * (2 * (sbh + sb) // t if sp else (4 * sbh + 2 * sb))
        parts["block_sharded"] = n_layer * k * sb * (shape.attention_values + shape.mlp_values())
        parts["block_lse"] = n_layer * k * a * sb // t
    if first:
        parts["embed"] = (sb * TOKEN_ID_BYTES + (sb if t > 1 else 0)
                          + (s * TOKEN_ID_BYTES if cp > 1 else 0))  # cp: positions
    if last:
        v_local = padded_vocab(vocab, t) // t
        ln_f = (sbh + sb) // t if sp else (2 * sbh + sb)
        parts["head"] = k * ln_f + k * (sb * v_local + 2 * sb) + sb * (TOKEN_ID_BYTES + 1)
    return parts


def activation_bytes(shape: ActivationShape, chunk: Chunk, vocab: int) -> int:
    """Bytes of saved activations one micro-batch leaves on a pipeline stage holding
    `chunk` (its blocks, plus the embedding if first, the final LayerNorm, head and loss if
    last) between its forward and its backward: the sum of `activation_parts`."""
    return sum(activation_parts(shape, chunk, vocab).values())


INDEX_BYTES = 8  # routing indices and counts are int64; the router's f and P float64 (numesh/nn/moe.py)


def moe_activation_parts(shape: ActivationShape, moe: ExpertShape, rows_sent: int,
                         rows_received: int) -> dict[str, int]:
    """What one MoE block's forward saves for backward on one rank (its `BlockCtx` with
    `MoECtx`, each buffer counted once as `numesh.base.tree.held_bytes` does), in bytes, for b =
    `micro_batch` sequences of s = `shape.tokens` tokens of this rank (seq/cp under cp), N =
    s·b tokens, h = `n_embd`, t = `tp`, q = `itemsize` (`shape`'s), E experts over ep, k =
    `top_k` (`moe`'s), M = `rows_sent` (Σ Dispatch.send: the assignments this rank's tokens
    kept, N·k less the dropped) and R = `rows_received` (Σ Dispatch.recv: the rows its E/ep
    experts got; routing decides both, so they differ by rank):
      "block_replicated"  q·(4·sbh + 2·sb) as the dense block's (the MoE input is LayerNorm
                          2's output, kept once); under sp q·2·(sbh + sb)/t + q·sbh, the
                          gathered MoE input.
      "block_attention"   q·4·sbh/t: the QKV output and the attention output
                          (q·sb·`attention_values` for other kinds).
      "block_lse"         q·a·sb/t, as the dense block's.
      "router"            the probabilities and logsumexp q·(N·E + N), the top-k order
                          8·N·E (a view of the whole argsort), the combine weights q·N·k,
                          the sorted rows 8·M and expert bounds 8·(E + 1), each sequence's
                          f and P 2·8·b·E, and with a capacity which assignments it kept N·k.
      "dispatch"          send and recv 2·8·ep; with ep > 1 the regrouping 8·R and local
                          bounds 8·(E/ep + 1).
      "experts"           q·R·h the rows the experts got, q·8·R·h/t their hidden layer and GELU's
                          output (SwiGLU experts: gate, up and product, q·R·3·F/t, `mlp_values`),
                          q·N·k·h each assignment's expert output.
      "stats"             the routing stats' tokens per expert, 8·E.
    Under full recomputation the block keeps its input, q·sbh (q·sbh/t under sp), and its
    stats, 8·E (`RoutingStats.send`/`recv` are int tuples: nothing more)."""
    check_recompute_mode(shape.recompute)
    b, s, h, a, t, q = shape.micro_batch, shape.tokens, shape.n_embd, shape.n_head, shape.tp, shape.itemsize
    E, k, ep, sp = moe.experts, moe.top_k, moe.ep, shape.sp
    sb, sbh, N, R, M = s * b, s * b * h, s * b, rows_received, rows_sent
    stats = INDEX_BYTES * E
    if shape.recompute == "full":
        return {"block_input": q * (sbh // t if sp else sbh), "stats": stats}
    return {
        "block_replicated": q * (2 * (sbh + sb) // t + sbh) if sp else q * (4 * sbh + 2 * sb),
        "block_attention": q * sb * shape.attention_values,
        "block_lse": q * a * sb // t,
        "router": (q * (N * E + N + N * k) + INDEX_BYTES * (N * E + M + E + 1 + 2 * b * E)
                   + (N * k if moe.capacity else 0)),
        "dispatch": INDEX_BYTES * (2 * ep + ((R + E // ep + 1) if ep > 1 else 0)),
        "experts": q * (R * h + shape.mlp_values(R) + N * k * h),
        "stats": stats,
    }


def weight_ctx_bytes(shape: ActivationShape, n_layer: int, bias: bool = False, chunks: int = 1) -> int:
    """Bytes a zero-bubble B leaves for its W (numesh.nn.transformer.BlockWeightCtx) over
    `n_layer` blocks, for any recomputation, of s = `shape.tokens` tokens of this rank: per
    block the four Linears' inputs (h1, h2 [b,s,h]; attention output sbh/t, GELU output
    4·sbh/t) and output gradients (QKV's 3·sbh/t, MLP-up's 4·sbh/t, the two row-parallel
    ones sbh each), so k·(4·sbh + 12·sbh/t), plus both LayerNorms' weight (and `bias`)
    gradients, once per thread chunk (`chunks`). Other kinds (`shape.parts`): GQA's q, k, v
    output gradients are h/t + 2·kv_local where the fused QKV's are 3·h/t; SwiGLU adds the
    gate's output gradient (3·F/t in all where GELU has 2·F/t); an RMSNorm has no bias
    gradient. The rotary tables, held too, are `rotary_table_bytes`, counted once."""
    parts, t, C = shape.parts, shape.tp, shape.n_embd
    sb, k = shape.tokens * shape.micro_batch, shape.itemsize
    dqkv = 3 * C // t if not parts.kv_heads else C // t + 2 * parts.local_kv(C, t)
    per_token = 4 * C + dqkv + C // t + parts.mlp_matrices * parts.ffn(C) // t
    ln_grads = chunks * 2 * parts.norm_values(C, bias) * k
    return n_layer * (k * sb * per_token + ln_grads)


def peak_activation_bytes(schedule: Schedule, rank: int, saved: Callable[[int], int],
                          deferred: Callable[[int], int] | None = None, shared: tuple[int, int] = (0, 0)) -> int:
    """The most activation bytes `rank` holds between two of its actions: F adds the
    micro-batch's `saved(chunk)` bytes, B frees them (or, when the schedule splits the
    backward, leaves `deferred(chunk)` bytes until W). What the executor's `peak_bytes`
    measures; with every chunk alike it is peak_activations(schedule)[rank] × saved(0)
    for schedules that do not split the backward. `shared`: the bytes of buffers that
    every F context (first) and every deferred W (second) holds in common, counted once
    while any context that holds them lives (the rotary tables, `rotary_table_bytes`: 0
    where a context holds none, as a fully recomputed block's F)."""
    live: dict[tuple[int, int], tuple[int, int]] = {}  # (mb, chunk) -> (bytes, 0: an F's context, 1: a W's)
    count = [0, 0]  # live contexts of each kind
    held = peak = 0  # held: the live contexts' own bytes, kept as they come and go (GPipe holds m at once)
    for a in schedule.actions[rank]:
        key = (a.mb, a.chunk)
        if key in live:
            n, kind = live.pop(key)
            held, count[kind] = held - n, count[kind] - 1
        if a.kind == "F":
            live[key] = (saved(a.chunk), 0)
        elif a.kind == "B" and schedule.split_backward:
            live[key] = (deferred(a.chunk) if deferred is not None else 0, 1)
        if key in live:
            n, kind = live[key]
            held, count[kind] = held + n, count[kind] + 1
        peak = max(peak, held + max(shared[0] if count[0] else 0, shared[1] if count[1] else 0))
    return peak


weight_grad_bytes = weight_ctx_bytes  # the planner's name for it
