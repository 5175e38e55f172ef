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
(Linear C -> 4C, GELU, Linear 4C -> C). Dropless: every token reaches its k experts.

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
multiplied by its weights in BLAS calls over fixed row tiles (`numesh.threads.tiles`, from
the shape and the rank's cores), the (expert, tile) jobs dealt to numesh's threads: no
per-token Python, and the same bits for any thread count.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs
import numpy as np

from numesh.nn.layers import Linear, gelu_bwd, gelu_fwd
from numesh.threads import MIN_CHUNK_FLOPS, TILE_ROWS, cores, matmul, over_tiles, tiles


@attrs.frozen
class MoEConfig:
    """One MoE layer's settings: E experts, top-k routing, the two loss coefficients."""

    experts: int
    top_k: int = 2
    aux_coef: float = 1e-2
    z_coef: float = 0.0


@attrs.frozen
class MoE:
    """An MoE MLP's parameters: the router and the E experts' two Linears, stacked on dim 0."""

    router: Linear  # w [C, E], no bias
    fc: Linear  # w [E, C, 4C], b [E, 4C] or None
    proj: Linear  # w [E, 4C, C], b [E, C] or None


@attrs.frozen
class RoutingStats:
    """What one MoE layer's routing did, for metrics."""

    tokens: np.ndarray  # [E] token-assignments per expert (sums to N·k)
    aux_loss: float  # α·E·Σ f·P, as added to the loss
    z_loss: float  # β·mean(logsumexp²), as added to the loss


@attrs.frozen
class Routing:
    """The router's decisions for N tokens."""

    probs: np.ndarray  # [N, E] softmax of the logits
    lse: np.ndarray  # [N] logsumexp of the logits
    top: np.ndarray  # [N, k] chosen experts, most probable first (ties: lowest index)
    weights: np.ndarray  # [N, k] combine weights: chosen probabilities over their sum
    order: np.ndarray  # [N·k] assignment (t·k + j) of each expert-sorted row
    bounds: np.ndarray  # [E + 1] expert e's rows are bounds[e]:bounds[e+1] of the sorted block


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


def routing_stats(r: Routing, cfg: MoEConfig) -> RoutingStats:
    """Tokens per expert and the two losses' values (with their coefficients)."""
    n, k = r.top.shape
    tokens = np.diff(r.bounds)
    f = tokens / (n * k)
    aux = cfg.aux_coef * cfg.experts * float(np.dot(f, r.probs.mean(axis=0)))
    z = cfg.z_coef * float(np.mean(r.lse * r.lse))
    return RoutingStats(tokens, aux, z)


def _jobs(bounds: np.ndarray) -> list[tuple[int, slice]]:
    """(expert, rows of the sorted block) of every row tile of every expert with tokens:
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
    bias: [M, N] in the expert-sorted row order."""
    n_out = w.shape[1] if transpose else w.shape[2]
    out = np.empty((a.shape[0], n_out), a.dtype)  # dropless: every row is in some job

    def job(i: int) -> None:
        e, r = jobs[i]
        _gemm(a[r], w[e].T if transpose else w[e], out[r])
        if b is not None:
            out[r] += b[e]

    _run(job, len(jobs), 2.0 * a.shape[0] * a.shape[1] * n_out)
    return out


@attrs.frozen
class MoECtx:
    """What `moe_bwd` needs from `moe_fwd`."""

    x: np.ndarray  # [N, C] the layer's input
    routing: Routing
    xs: np.ndarray  # [N·k, C] input rows sorted by expert
    gelu: Any  # GELU context of the sorted hidden rows [N·k, 4C]
    g: np.ndarray  # [N·k, 4C] GELU output, sorted by expert
    ya: np.ndarray  # [N, k, C] each assignment's expert output, in token order
    jobs: list  # (expert, sorted rows) tiles
    stats: RoutingStats
    shape: tuple[int, ...]  # the input's shape [..., C]


def moe_fwd(p: MoE, x: np.ndarray, cfg: MoEConfig) -> tuple[np.ndarray, MoECtx]:
    """The MoE MLP on x [..., C]: (output like x, context). The aux and z losses are in
    the context's `stats` and in `moe_bwd`'s gradient."""
    shape = x.shape
    x2 = np.ascontiguousarray(x.reshape(-1, shape[-1]))  # [N, C]
    n, c = x2.shape
    k = cfg.top_k
    r = route(matmul(x2, p.router.w), k)
    jobs = _jobs(r.bounds)
    xs = x2[r.order // k]  # [N·k, C]: the tokens of each assignment, grouped by expert
    u = _expert_matmul(xs, p.fc.w, p.fc.b, jobs)  # [N·k, 4C]
    g, gelu = gelu_fwd(u)
    ys = _expert_matmul(g, p.proj.w, p.proj.b, jobs)  # [N·k, C]
    ya = np.empty_like(ys)
    ya[r.order] = ys  # back to assignment order t·k + j
    ya = ya.reshape(n, k, c)  # [N, k, C]
    y = ya[:, 0] * r.weights[:, :1]
    for j in range(1, k):  # a fixed order of the k terms
        y += ya[:, j] * r.weights[:, j : j + 1]
    return y.reshape(shape), MoECtx(x2, r, xs, gelu, g, ya, jobs, routing_stats(r, cfg), shape)


def _router_logits_grad(r: Routing, dw: np.ndarray, cfg: MoEConfig) -> np.ndarray:
    """d(loss)/d(logits) [N, E] from the combine weights' gradient dw [N, k], plus the aux
    and z losses' gradients."""
    n, e = r.probs.shape
    k = r.top.shape[1]
    chosen = np.take_along_axis(r.probs, r.top, axis=1)  # [N, k]
    # w = chosen / S: d chosen_j = (dw_j - Σ_l dw_l w_l) / S
    dchosen = (dw - (dw * r.weights).sum(axis=1, keepdims=True)) / chosen.sum(axis=1, keepdims=True)
    dprobs = np.zeros_like(r.probs)
    np.put_along_axis(dprobs, r.top, dchosen, axis=1)  # a row's k experts are distinct
    f = np.diff(r.bounds) / (n * k)  # [E], a count: no gradient of its own
    dprobs += (cfg.aux_coef * e / n) * f  # d(α·E·Σ f_i·mean_t p_ti) / d p_ti
    dlogits = r.probs * (dprobs - (dprobs * r.probs).sum(axis=1, keepdims=True))  # softmax backward
    if cfg.z_coef:
        dlogits += r.probs * ((2.0 * cfg.z_coef / n) * r.lse)[:, None]  # d(β·mean lse²) / d logits
    return dlogits


def _expert_weight_grads(p: MoE, ctx: MoECtx, du: np.ndarray, dys: np.ndarray) -> tuple[Linear, Linear]:
    """Each expert's weight and bias gradients, one GEMM per expert and matrix, the
    experts dealt to the threads (zeros for an expert without tokens)."""
    b = ctx.routing.bounds
    d_fc, d_proj = np.empty_like(p.fc.w), np.empty_like(p.proj.w)
    db_fc = None if p.fc.b is None else np.empty_like(p.fc.b)
    db_proj = None if p.proj.b is None else np.empty_like(p.proj.b)

    def expert(e: int) -> None:
        r = slice(int(b[e]), int(b[e + 1]))
        if r.start == r.stop:  # no tokens: no gradient
            for d in (d_fc, d_proj, db_fc, db_proj):
                if d is not None:
                    d[e] = 0
            return
        _gemm(ctx.xs[r].T, du[r], d_fc[e])
        _gemm(ctx.g[r].T, dys[r], d_proj[e])
        if db_fc is not None:
            du[r].sum(axis=0, out=db_fc[e])
        if db_proj is not None:
            dys[r].sum(axis=0, out=db_proj[e])

    _run(expert, len(b) - 1, 4.0 * du.shape[0] * du.shape[1] * ctx.xs.shape[1])
    return Linear(d_fc, db_fc), Linear(d_proj, db_proj)


def moe_bwd(p: MoE, ctx: MoECtx, dy: np.ndarray, cfg: MoEConfig) -> tuple[np.ndarray, MoE]:
    """(grad of the input, grads of the parameters) from the output's grad dy [..., C]; the
    aux and z losses' gradients are included (each with weight 1 in the loss)."""
    r = ctx.routing
    n, k, c = ctx.ya.shape
    dy2 = dy.reshape(n, c)  # [N, C]
    dw = np.einsum("nc,nkc->nk", dy2, ctx.ya)  # [N, k]
    dya = r.weights[:, :, None] * dy2[:, None, :]  # [N, k, C]
    dys = dya.reshape(n * k, c)[r.order]  # [N·k, C] sorted by expert
    dg = _expert_matmul(dys, p.proj.w, None, ctx.jobs, transpose=True)  # [N·k, 4C]
    du = gelu_bwd(ctx.gelu, dg)
    dxs = _expert_matmul(du, p.fc.w, None, ctx.jobs, transpose=True)  # [N·k, C]
    d_fc, d_proj = _expert_weight_grads(p, ctx, du, dys)
    dxa = np.empty_like(dxs)
    dxa[r.order] = dxs
    dxa = dxa.reshape(n, k, c)  # [N, k, C] in token order
    dlogits = _router_logits_grad(r, dw, cfg)  # [N, E]
    dx = matmul(dlogits, p.router.w.T)  # [N, C]
    for j in range(k):  # a fixed order of the k terms
        dx += dxa[:, j]
    d_router = Linear(matmul(ctx.x.T, dlogits))
    return dx.reshape(ctx.shape), MoE(d_router, d_fc, d_proj)


def moe_metrics(stats: Sequence[RoutingStats]) -> dict[str, float | int]:
    """A step's metrics from its MoE layers' stats ({} without any): the aux and z losses
    summed over the layers (what the step added to the loss), and the fewest and most
    token-assignments any expert of any layer received."""
    if not stats:
        return {}
    tokens = np.concatenate([s.tokens for s in stats])
    return {"moe_aux_loss": sum(s.aux_loss for s in stats), "moe_z_loss": sum(s.z_loss for s in stats),
            "moe_tokens_min": int(tokens.min()), "moe_tokens_max": int(tokens.max())}
