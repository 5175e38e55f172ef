"""A mixture-of-experts MLP on one rank: router, top-k routing, E GELU experts, and the two
router losses, forward and hand-written backward.

Routing. The router is a linear map x [N, C] -> logits [N, E] (no bias), p = softmax(logits)
over the E experts. Each token takes the k experts of highest probability, ties broken by the
lowest expert index (a stable sort of -p), so every mesh that computes the same p picks the
same experts. The k chosen probabilities are renormalised to sum to 1 (Mixtral's
convention: softmax, top-k, renormalise, which equals a softmax over the k chosen logits):
a token's output is then a convex combination of its experts, its scale independent of how
much probability fell outside its top k. With k = 1 the combine weight is therefore 1 and
the router learns only from the auxiliary and z losses (Switch Transformer keeps the
unnormalised p for that reason; numesh follows Mixtral's k = 2 default).

Output: y[t] = Σ_j w[t, j] · MLP_{e(t, j)}(x[t]), each expert the dense block's MLP
(Linear C -> F, GELU, Linear F -> C; or Mixtral's SwiGLU: proj(silu(gate(x)) * fc(x))).
Dropless by default: every token reaches its k experts.

Capacity (`capacity_factor` c > 0): each expert takes at most ceil(c·T·k/E) of each
sequence's token-assignments (T the whole sequence's length), those of highest router
probability (ties: the earlier position); the others are dropped: they contribute nothing
to the token's output (the kept ones' weights are not renormalised) and are not sent to
the expert. The rule is per sequence, the one unit whole on every mesh; under cp the
ranks of a sequence all-gather its (expert, probability, position) triples and decide the
same. fᵢ of the load-balancing loss counts assignments as routed, before dropping (Switch).

Losses (added to the training loss, reported apart from it):
- load balancing (Switch/GShard): aux = α·E·Σᵢ fᵢ·Pᵢ, fᵢ = (token-assignments routed to
  expert i) / (N·k), each of a token's k choices counting 1/k so Σ fᵢ = 1, and Pᵢ = the
  mean router probability of expert i over the N tokens. Balanced routing gives aux = α.
  fᵢ is a count (no gradient); the gradient flows through Pᵢ.
- router z-loss (ST-MoE): z = β·mean_t(logsumexp(logits_t)²), keeping the logits small.
Both are means over the N tokens of the call: on one rank with one micro-batch the whole
global batch, as the definition wants.

Compute. The N·k (token, choice) assignments are sorted by expert (stably: by token within
an expert), the rows gathered into one contiguous block per expert, and each expert's block
multiplied by its weights in BLAS calls over fixed row tiles (`numesh.host.threads.tiles`, from
the shape and the rank's cores), the (expert, tile) jobs dealt to numesh's threads: no
per-token Python, and the same bits for any thread count.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import attrs
import numpy as np

from numesh.host.threads import MIN_CHUNK_FLOPS, TILE_ROWS, cores, matmul, over_tiles, tiles
from numesh.mesh import Mesh, all_gather, all_to_all, all_to_all_v, psum
from numesh.mesh.zigzag import positions
from numesh.nn.layers import Linear, gelu_bwd, gelu_fwd, swiglu_bwd, swiglu_fwd


@attrs.frozen
class MoEConfig:
    """One MoE layer's settings: E experts, top-k routing, the two loss coefficients, and
    the capacity factor (0: dropless). `GPTConfig.moe` makes one for each MoE block.

    Attributes:
        experts: E, the expert MLPs (split over the mesh axis ep).
        top_k: experts per token; their router probabilities are renormalised to sum to 1.
        aux_coef: the Switch/GShard load-balancing loss's coefficient (per sequence and block).
        z_coef: the router z-loss's coefficient (mean squared logsumexp of the logits).
        capacity_factor: c > 0: each expert takes at most ceil(c·T·k/E) assignments of a
            sequence and drops the rest; 0 = dropless.
        gated: SwiGLU experts (a gate matrix beside fc) instead of GELU ones.
    """

    experts: int
    top_k: int = 2
    aux_coef: float = 1e-2
    z_coef: float = 0.0
    capacity_factor: float = 0.0
    gated: bool = False


@attrs.frozen
class MoE:
    """An MoE MLP's parameters, in place of a block's dense `MLP`: the router and the E
    experts' two Linears, stacked on dim 0 so that ep splits the experts by slicing it.

    Attributes:
        router: w [C, E], no bias; replicated on every rank.
        fc: w [E, C, F], b [E, F] or None: the experts over ep, each column-parallel over tp
            (SwiGLU's up matrix in gated experts).
        proj: w [E, F, C], b [E, C] or None: the experts over ep, each row-parallel over tp.
        gate: w [E, C, F], b [E, F] or None: SwiGLU's gate, split as fc (None: GELU experts).
    """

    router: Linear
    fc: Linear
    proj: Linear
    gate: Linear | None = None


@attrs.frozen
class RoutingStats:
    """What one MoE layer's routing did on this rank's tokens, as sums: adding them over
    every rank of the mesh and every micro-batch gives the step's totals (a rank whose
    tokens another rank also routes, a tp rank > 0, reports zeros; so does a cp rank > 0
    for the per-sequence terms, which every cp rank of a sequence computes whole)."""

    layer: int
    tokens: np.ndarray  # [E] token-assignments routed to each expert from this rank's tokens (before dropping)
    aux_sum: float  # Σ over this rank's sequences of α·E·Σᵢ fᵢ·Pᵢ
    z_sum: float  # Σ over this rank's tokens of β·logsumexp²
    sequences: int  # sequences counted in aux_sum
    positions: int  # tokens counted in z_sum
    dropped: int = 0  # this rank's token-assignments dropped by the capacity
    # the dispatch's rows over ep (`Dispatch.send`/`recv`, on every tp rank: each moves its
    # own copy): what `formulas.moe_all_to_all_bytes` needs. Tuples of ints, not arrays: what
    # a block keeps under full recomputation (its stats) stays the same bytes
    send: tuple[int, ...] = ()  # rows this rank sent to each ep rank
    recv: tuple[int, ...] = ()  # rows this rank received from each ep rank


@attrs.frozen
class Routing:
    """The router's decisions for N tokens."""

    probs: np.ndarray  # [N, E] softmax of the logits
    lse: np.ndarray  # [N] logsumexp of the logits
    top: np.ndarray  # [N, k] chosen experts, most probable first (ties: lowest index)
    weights: np.ndarray  # [N, k] combine weights: chosen probabilities over their sum
    order: np.ndarray  # [M] assignment (t·k + j) of each expert-sorted row (M = N·k less the dropped)
    bounds: np.ndarray  # [E + 1] expert e's rows are bounds[e]:bounds[e+1] of the sorted block
    kept: np.ndarray | None = None  # [N, k] which assignments the capacity kept (None: dropless)


def route(logits: np.ndarray, top_k: int) -> Routing:
    """Softmax, top-k (ties to the lowest index), renormalised weights, and the stable
    sort of the N·k assignments by expert."""
    n, e = logits.shape
    m = logits.max(axis=1, keepdims=True)
    ex = np.exp(logits - m)
    s = ex.sum(axis=1, keepdims=True)
    probs = ex / s
    lse = (m + np.log(s))[:, 0]
    top = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]  # [N, k]
    chosen = np.take_along_axis(probs, top, axis=1)
    weights = chosen / chosen.sum(axis=1, keepdims=True)
    flat = top.reshape(-1)  # [N·k]: assignment t·k + j -> its expert
    order = np.argsort(flat, kind="stable")
    bounds = np.zeros(e + 1, np.int64)
    np.cumsum(np.bincount(flat, minlength=e), out=bounds[1:])
    return Routing(probs, lse, top, weights, order, bounds)


def capacity(cfg: MoEConfig, seq_len: int) -> int:
    """The most token-assignments of one sequence of `seq_len` tokens an expert takes."""
    return math.ceil(cfg.capacity_factor * seq_len * cfg.top_k / cfg.experts)


def keep_by_rank(expert: np.ndarray, prob: np.ndarray, pos: np.ndarray, cap: int) -> np.ndarray:
    """[B, T', k] bool: of each sequence's assignments (expert, probability, position: any
    order along T'), each expert keeps the `cap` of highest probability (ties: the earlier
    position; a token's k experts are distinct, so no two of an expert's tie on both)."""
    b = expert.shape[0]
    seq = np.broadcast_to(np.arange(b)[:, None, None], expert.shape).reshape(-1)
    e, p, t = expert.reshape(-1), prob.reshape(-1), pos.reshape(-1)
    order = np.lexsort((t, -p, e, seq))  # by sequence, expert, probability down, position up
    group = seq[order] * (int(e.max(initial=0)) + 1) + e[order]
    start = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])  # first row of each (sequence, expert)
    rank = np.arange(order.size) - np.repeat(start, np.diff(np.r_[start, order.size]))
    keep = np.empty(order.size, bool)
    keep[order] = rank < cap
    return keep.reshape(expert.shape)


def apply_capacity(r: Routing, cfg: MoEConfig, batch: int, mesh: Mesh) -> Routing:
    """`r` with the assignments over capacity dropped from its rows (see the module's
    docstring). Under cp every rank of a sequence gathers the sequence's (expert,
    probability, global position) of each assignment and decides for all of it alike."""
    if not cfg.capacity_factor:
        return r
    n, k = r.top.shape
    t, cp, i = n // batch, mesh.size("cp"), mesh.index("cp")
    pos = positions(t * cp, cp, i)  # [t] global positions of this rank's tokens
    mine = np.empty((batch, t, k, 3))  # (expert, probability, position), exact in float64
    mine[..., 0] = r.top.reshape(batch, t, k)
    mine[..., 1] = np.take_along_axis(r.probs, r.top, axis=1).reshape(batch, t, k)
    mine[..., 2] = pos[None, :, None]
    whole = all_gather(mine, mesh, "cp", dim=1)  # [B, T, k, 3], cp rank j's tokens at j·t
    keep = keep_by_rank(whole[..., 0], whole[..., 1], whole[..., 2], capacity(cfg, t * cp))
    kept = np.ascontiguousarray(keep[:, i * t : (i + 1) * t].reshape(n, k))
    flat = kept.reshape(-1)
    order = r.order[flat[r.order]]  # the kept rows, still sorted by expert (then token)
    bounds = np.zeros_like(r.bounds)
    np.cumsum(np.bincount(r.top.reshape(-1)[order], minlength=len(r.bounds) - 1), out=bounds[1:])
    return attrs.evolve(r, order=order, bounds=bounds, kept=kept)


@attrs.frozen
class SeqBalance:
    """Each sequence's routing, summed over all its tokens (its cp chunks too): what the
    load-balancing loss of a sequence needs."""

    f: np.ndarray  # [B, E] fᵢ of each sequence: its token-assignments to expert i / (T·k)
    P: np.ndarray  # [B, E] Pᵢ of each sequence: its mean router probability of expert i


def seq_balance(r: Routing, batch: int, mesh: Mesh) -> SeqBalance:
    """f and P of each of the `batch` sequences whose tokens (this rank's positions of
    them: [B, t] flattened) `r` routed; summed over cp, where a sequence is split."""
    n, e = r.probs.shape
    k, t = r.top.shape[1], n // batch
    seq = np.repeat(np.arange(batch), t * k)  # [N·k]: the sequence of assignment t·k + j
    both = np.empty((2, batch, e))
    both[0] = np.bincount(seq * e + r.top.reshape(-1), minlength=batch * e).reshape(batch, e)
    both[1] = r.probs.reshape(batch, t, e).sum(axis=1)  # [B, E]
    both = psum(both, mesh, "cp")
    T = t * mesh.size("cp")
    return SeqBalance(both[0] / (T * k), both[1] / T)


def routing_stats(r: Routing, bal: SeqBalance, cfg: MoEConfig, layer: int, mesh: Mesh) -> RoutingStats:
    """This rank's share of the layer's tokens per expert and loss sums (see RoutingStats)."""
    e = cfg.experts
    if mesh.index("tp"):  # the tp ranks route the same tokens: the first reports them
        return RoutingStats(layer, np.zeros(e, np.int64), 0.0, 0.0, 0, 0, 0)
    first_cp = mesh.index("cp") == 0
    aux = cfg.aux_coef * e * float(np.sum(bal.f * bal.P)) if first_cp else 0.0
    z = cfg.z_coef * float(np.dot(r.lse, r.lse))
    routed = np.bincount(r.top.reshape(-1), minlength=e)  # before dropping
    dropped = 0 if r.kept is None else int(r.kept.size - np.count_nonzero(r.kept))
    return RoutingStats(layer, routed, aux, z, bal.f.shape[0] if first_cp else 0, r.probs.shape[0], dropped)


@attrs.frozen
class Dispatch:
    """How the expert-sorted assignment rows of this rank travel over ep and back: ep rank
    r holds experts r·E/ep ... (r+1)·E/ep - 1, so the sorted rows are already grouped by
    destination; the rows received are grouped by source, and `perm` regroups them by
    expert (by source within an expert) for one GEMM per expert."""

    send: np.ndarray  # [ep] rows to each ep rank
    recv: np.ndarray  # [ep] rows from each ep rank
    perm: np.ndarray | None  # [R] received row of each expert-grouped row (None: ep = 1)
    bounds: np.ndarray  # [E/ep + 1] local expert e's rows of the expert-grouped block


def plan_dispatch(bounds: np.ndarray, mesh: Mesh) -> Dispatch:
    """Exchange per-expert counts over ep (one small all-to-all) and plan the row moves."""
    ep = mesh.size("ep")
    counts = np.diff(bounds)
    if ep == 1:
        return Dispatch(counts[None].sum(1), counts[None].sum(1), None, bounds)
    got = all_to_all(np.ascontiguousarray(counts.reshape(ep, -1)), mesh, "ep")  # [ep, E/ep] rows for my experts
    local = got.shape[1]
    expert = np.repeat(np.tile(np.arange(local), ep), got.reshape(-1))  # [R] local expert of each received row
    lb = np.zeros(local + 1, np.int64)
    np.cumsum(got.sum(axis=0), out=lb[1:])
    return Dispatch(counts.reshape(ep, -1).sum(1), got.sum(1), np.argsort(expert, kind="stable"), lb)


def to_experts(rows: np.ndarray, d: Dispatch, mesh: Mesh) -> np.ndarray:
    """Expert-sorted rows [M, ...] to the ranks of their experts, grouped by local expert."""
    if d.perm is None:
        return rows
    return all_to_all_v(rows, d.send, d.recv, mesh, "ep")[d.perm]


def from_experts(rows: np.ndarray, d: Dispatch, mesh: Mesh) -> np.ndarray:
    """The inverse of `to_experts`: the experts' rows back to the ranks of their tokens."""
    if d.perm is None:
        return rows
    back = np.empty_like(rows)
    back[d.perm] = rows
    return all_to_all_v(back, d.recv, d.send, mesh, "ep")


def _jobs(bounds: np.ndarray) -> list[tuple[int, slice]]:
    """(expert, rows of the grouped block) of every row tile of every expert with tokens:
    `tiles` of its rows, from its count and the rank's cores only."""
    out = []
    for e in range(len(bounds) - 1):
        b0, n = int(bounds[e]), int(bounds[e + 1] - bounds[e])
        out.extend((e, slice(b0 + t.start, b0 + t.stop)) for t in tiles(n, TILE_ROWS, cores()) if n)
    return out


def _gemm(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out = a @ b, one BLAS call (every expert GEMM goes through here: the FLOP test counts them)."""
    np.matmul(a, b, out=out)


def _run(fn: Callable[[int], Any], count: int, flops: float) -> list:
    """`fn(i)` for i < count on numesh's threads, each given at least MIN_CHUNK_FLOPS."""
    return over_tiles(fn, count, int(flops // MIN_CHUNK_FLOPS))


def _expert_matmul(a: np.ndarray, w: np.ndarray, b: np.ndarray | None, jobs: list,
                   transpose: bool = False) -> np.ndarray:
    """Row block of each job times its expert's matrix (w[e] [K, N], or w[e].T), plus its
    bias: [M, N] in the expert-grouped row order."""
    n_out = w.shape[1] if transpose else w.shape[2]
    out = np.zeros((a.shape[0], n_out), a.dtype) if not jobs else np.empty((a.shape[0], n_out), a.dtype)

    def job(i: int) -> None:
        e, r = jobs[i]
        _gemm(a[r], w[e].T if transpose else w[e], out[r])
        if b is not None:
            out[r] += b[e]

    _run(job, len(jobs), 2.0 * a.shape[0] * a.shape[1] * n_out)
    return out


def by_assignment(rows: np.ndarray, r: Routing) -> np.ndarray:
    """Rows in this rank's expert-sorted order [M, C] back in token order [N, k, C]
    (assignment t·k + j); a dropped assignment's row is 0."""
    n, k = r.top.shape
    out = (np.empty if r.kept is None else np.zeros)((n * k, rows.shape[1]), rows.dtype)
    out[r.order] = rows
    return out.reshape(n, k, rows.shape[1])


@attrs.frozen
class MoECtx:
    """What `moe_bwd` needs from `moe_fwd`."""

    x: np.ndarray  # [N, C] the layer's input
    routing: Routing
    balance: SeqBalance
    dispatch: Dispatch
    xe: np.ndarray  # [R, C] the rows this rank's experts got, grouped by expert
    act: Any  # the activation's context (GELU's, or SwiGLU's) of the experts' hidden rows [R, F/tp]
    g: np.ndarray  # [R, F/tp] the activation's output
    ya: np.ndarray  # [N, k, C] each assignment's expert output, in token order (partial over tp)
    jobs: list  # (local expert, grouped rows) tiles
    stats: RoutingStats
    shape: tuple[int, ...]  # the input's shape [B, t, C]


def moe_fwd(p: MoE, x: np.ndarray, cfg: MoEConfig, mesh: Mesh, layer: int = 0) -> tuple[np.ndarray, MoECtx]:
    """The MoE MLP on this rank's tokens x [B, t, C] (whole over tp: gathered under sp):
    (output like x, context). With tp the output is partial over tp, like a row-parallel
    matmul's, and the caller reduces it; the expert biases are added on tp rank 0 only."""
    shape = x.shape
    x2 = np.ascontiguousarray(x.reshape(-1, shape[-1]))  # [N, C]
    k = cfg.top_k
    r = route(matmul(x2, p.router.w), k)
    bal = seq_balance(r, shape[0], mesh)  # f counts the assignments as routed, before any drop
    r = apply_capacity(r, cfg, shape[0], mesh)
    d = plan_dispatch(r.bounds, mesh)
    jobs = _jobs(d.bounds)
    xe = to_experts(x2[r.order // k], d, mesh)  # [R, C]: the rows of this rank's experts, by expert
    bias = mesh.index("tp") == 0
    u = _expert_matmul(xe, p.fc.w, p.fc.b, jobs)  # [R, F/tp]
    if p.gate is None:
        g, act = gelu_fwd(u)
    else:
        g, act = swiglu_fwd(_expert_matmul(xe, p.gate.w, p.gate.b, jobs), u)
    ye = _expert_matmul(g, p.proj.w, p.proj.b if bias else None, jobs)  # [R, C]
    ya = by_assignment(from_experts(ye, d, mesh), r)  # [N, k, C]
    y = ya[:, 0] * r.weights[:, :1]
    for j in range(1, k):  # a fixed order of the k terms
        y += ya[:, j] * r.weights[:, j : j + 1]
    stats = attrs.evolve(routing_stats(r, bal, cfg, layer, mesh), send=tuple(d.send.tolist()),
                          recv=tuple(d.recv.tolist()))
    return y.reshape(shape), MoECtx(x2, r, bal, d, xe, act, g, ya, jobs, stats, shape)


def _router_logits_grad(r: Routing, bal: SeqBalance, dw: np.ndarray, cfg: MoEConfig,
                        loss_scale: float) -> np.ndarray:
    """d(loss)/d(logits) [N, E] from the combine weights' gradient dw [N, k], plus the aux
    and z losses' gradients with the step's `loss_scale` (1 / tokens in the global batch)."""
    n, e = r.probs.shape
    b = bal.f.shape[0]
    chosen = np.take_along_axis(r.probs, r.top, axis=1)  # [N, k]
    # w = chosen / S: d chosen_j = (dw_j - Σ_l dw_l w_l) / S
    dchosen = (dw - (dw * r.weights).sum(axis=1, keepdims=True)) / chosen.sum(axis=1, keepdims=True)
    dprobs = np.zeros_like(r.probs)
    np.put_along_axis(dprobs, r.top, dchosen, axis=1)  # a row's k experts are distinct
    # the aux loss is (1/B)·Σ_s α·E·Σ_i f_si·P_si with P_si = (1/T)·Σ_{t in s} p_ti and
    # 1/(B·T) = loss_scale; f is a count (no gradient of its own)
    dprobs.reshape(b, n // b, e)[...] += (cfg.aux_coef * e * loss_scale) * bal.f[:, None, :]
    dlogits = r.probs * (dprobs - (dprobs * r.probs).sum(axis=1, keepdims=True))  # softmax backward
    if cfg.z_coef:
        dlogits += r.probs * ((2.0 * cfg.z_coef * loss_scale) * r.lse)[:, None]  # d(β·mean lse²) / d logits
    return dlogits


def _expert_weight_grads(ctx: MoECtx, mats: list[tuple[Linear, np.ndarray, np.ndarray]]) -> list[Linear]:
    """Each local expert's weight and bias gradients of each (matrix, its input rows, its
    output grad rows), one GEMM per expert and matrix, the experts dealt to the threads
    (zeros for an expert without tokens)."""
    b = ctx.dispatch.bounds
    out = [Linear(np.empty_like(p.w), None if p.b is None else np.empty_like(p.b)) for p, _, _ in mats]

    def expert(e: int) -> None:
        r = slice(int(b[e]), int(b[e + 1]))
        for d, (_, x, dy) in zip(out, mats):
            if r.start == r.stop:  # no tokens: no gradient
                d.w[e] = 0
                if d.b is not None:
                    d.b[e] = 0
                continue
            _gemm(x[r].T, dy[r], d.w[e])
            if d.b is not None:
                dy[r].sum(axis=0, out=d.b[e])

    _run(expert, len(b) - 1, sum(2.0 * max(dy.shape[0], 1) * dy.shape[1] * x.shape[1] for _, x, dy in mats))
    return out


def moe_bwd(p: MoE, ctx: MoECtx, dy: np.ndarray, cfg: MoEConfig, mesh: Mesh,
            loss_scale: float | None) -> tuple[np.ndarray, MoE]:
    """(grad of the input, grads of the parameters) from the output's grad dy [B, t, C]
    (whole: reduced over tp). The aux and z losses' gradients are included, weighted by
    the step's `loss_scale` as the LM loss is. With tp the input grad is partial over tp
    (the caller reduces it, as after a column-parallel matmul)."""
    if loss_scale is None and (cfg.aux_coef or cfg.z_coef):
        raise ValueError("an MoE block's backward needs the step's loss scale (1 / tokens in the global batch)")
    r, d = ctx.routing, ctx.dispatch
    n, k, c = ctx.ya.shape
    dy2 = dy.reshape(n, c)  # [N, C]
    dw = psum(np.einsum("nc,nkc->nk", dy2, ctx.ya), mesh, "tp")  # [N, k]: ya is partial over tp
    dya = r.weights[:, :, None] * dy2[:, None, :]  # [N, k, C]
    dye = to_experts(dya.reshape(n * k, c)[r.order], d, mesh)  # [R, C] grouped by local expert
    dg = _expert_matmul(dye, p.proj.w, None, ctx.jobs, transpose=True)  # [R, F/tp]
    mats = [(p.proj, ctx.g, dye)]
    if p.gate is None:
        du = gelu_bwd(ctx.act, dg)
    else:
        da, du = swiglu_bwd(ctx.act, dg)
        mats.append((p.gate, ctx.xe, da))
    mats.append((p.fc, ctx.xe, du))
    dxe = _expert_matmul(du, p.fc.w, None, ctx.jobs, transpose=True)  # [R, C]
    if p.gate is not None:
        dxe += _expert_matmul(da, p.gate.w, None, ctx.jobs, transpose=True)
    grads = _expert_weight_grads(ctx, mats)
    d_proj, d_gate, d_fc = grads[0], (grads[1] if p.gate is not None else None), grads[-1]
    dxa = by_assignment(from_experts(dxe, d, mesh), r)  # [N, k, C]: a dropped assignment sends no gradient
    dlogits = _router_logits_grad(r, ctx.balance, dw, cfg, loss_scale or 0.0)  # [N, E]
    dx = dxa[:, 0].copy()
    for j in range(1, k):  # a fixed order of the k terms
        dx += dxa[:, j]
    if mesh.index("tp") == 0:  # the router's input grad is whole on every tp rank: add it once
        dx += matmul(dlogits, p.router.w.T)
    d_router = Linear(matmul(ctx.x.T, dlogits))
    return dx.reshape(ctx.shape), MoE(d_router, d_fc, d_proj, d_gate)


def moe_metrics(totals: np.ndarray) -> dict[str, float | int]:
    """A step's metrics from its MoE layers' summed stats (`stats_vector` over every rank
    and micro-batch; {} without MoE layers): the aux and z losses summed over the layers
    (what the step added to the loss), the fewest and most token-assignments routed to any
    expert of any layer, and the assignments the capacity dropped, summed over the layers
    (0 when dropless)."""
    if totals.size == 0:
        return {}
    layers = totals.reshape(-1, totals.shape[-1])
    tokens = layers[:, 5:]
    return {"moe_aux_loss": float(np.sum(layers[:, 0] / np.maximum(layers[:, 2], 1))),
            "moe_z_loss": float(np.sum(layers[:, 1] / np.maximum(layers[:, 3], 1))),
            "moe_tokens_min": int(tokens.min()), "moe_tokens_max": int(tokens.max()),
            "moe_dropped": int(layers[:, 4].sum())}


def stats_vector(stats: Sequence[RoutingStats], layers: Sequence[int], experts: int) -> np.ndarray:
    """[L, 5 + E] float64: for each MoE layer of the model (`layers`, in order) the sums of
    this rank's stats of it (aux, z, sequences, positions, dropped, tokens per expert);
    zeros for layers on other pipeline stages. Summed over the mesh, it is what
    `moe_metrics` reads."""
    out = np.zeros((len(layers), 5 + experts))
    row = {layer: i for i, layer in enumerate(layers)}
    for s in stats:
        v = out[row[s.layer]]
        v[:5] += (s.aux_sum, s.z_sum, s.sequences, s.positions, s.dropped)
        v[5:] += s.tokens
    return out
