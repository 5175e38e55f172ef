"""The MoE layer (numesh/nn/moe.py) on one rank in float64: its forward against a per-token
NumPy reference, its backward against finite differences (through the per-sequence aux and
the z losses), ties, an expert without tokens, and the aux loss on a hand-built routing."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import self_mesh
from numesh.host import threads
from numesh.nn.layers import Linear, gelu_fwd_reference
from numesh.nn.moe import MoE, MoEConfig, capacity, keep_by_rank, moe_bwd, moe_fwd, route, routing_stats, seq_balance
from test_layers import assert_fd, fd_grad


def make_moe(rng: np.random.Generator, c: int, e: int, bias: bool, scale: float = 0.5) -> MoE:
    h = 4 * c

    def b(*shape: int) -> np.ndarray | None:
        return scale * rng.standard_normal(shape) if bias else None

    return MoE(router=Linear(rng.standard_normal((c, e))),
               fc=Linear(scale * rng.standard_normal((e, c, h)), b(e, h)),
               proj=Linear(scale * rng.standard_normal((e, h, c)), b(e, c)))


def kept_reference(probs: np.ndarray, tops: list, b: int, cfg: MoEConfig) -> set:
    """The (token, expert) assignments the capacity keeps, sequence by sequence and expert
    by expert: the ceil(c·T·k/E) of highest probability, ties to the earlier token."""
    T = len(tops) // b
    cap = math.ceil(cfg.capacity_factor * T * cfg.top_k / cfg.experts) if cfg.capacity_factor else len(tops)
    kept = set()
    for s in range(b):
        for i in range(cfg.experts):
            chose = [t for t in range(s * T, (s + 1) * T) if i in tops[t]]
            kept.update((t, i) for t in sorted(chose, key=lambda t: (-probs[t, i], t))[:cap])
    return kept


def reference(p: MoE, x3: np.ndarray, cfg: MoEConfig) -> tuple[np.ndarray, float, float, np.ndarray, int]:
    """Token by token on x [B, T, C]: (output [B·T, C], aux loss: the mean over the B
    sequences of each one's α·E·Σ f·P, z loss, tokens routed per expert, assignments
    dropped by the capacity)."""
    x = x3.reshape(-1, x3.shape[-1])
    n, e, k = x.shape[0], cfg.experts, cfg.top_k
    b, T = x3.shape[0], x3.shape[1]
    seq_counts = np.zeros((b, e))
    out = np.zeros_like(x)
    probs = np.zeros((n, e))
    counts = np.zeros(e, np.int64)
    lse2 = 0.0
    tops = []
    for t in range(n):
        logits = x[t] @ p.router.w
        mx = max(logits)
        lse = mx + math.log(sum(math.exp(v - mx) for v in logits))
        lse2 += lse * lse
        pr = np.array([math.exp(v - lse) for v in logits])
        probs[t] = pr
        tops.append(sorted(range(e), key=lambda i: (-pr[i], i))[:k])
    kept = kept_reference(probs, tops, b, cfg)
    for t in range(n):
        total = sum(probs[t, i] for i in tops[t])
        for i in tops[t]:
            counts[i] += 1  # routed, dropped or not
            seq_counts[t // T, i] += 1
            if (t, i) not in kept:
                continue
            hid = x[t] @ p.fc.w[i] + (0 if p.fc.b is None else p.fc.b[i])
            y = gelu_fwd_reference(hid[None])[0][0] @ p.proj.w[i] + (0 if p.proj.b is None else p.proj.b[i])
            out[t] += probs[t, i] / total * y  # not renormalised over the kept ones
    aux = 0.0
    for s in range(b):
        f = seq_counts[s] / (T * k)
        aux += cfg.aux_coef * e * sum(f[i] * probs[s * T : (s + 1) * T, i].mean() for i in range(e)) / b
    return out, aux, cfg.z_coef * lse2 / n, counts, n * k - len(kept)


MESH = self_mesh()  # one: a mesh per finite-difference evaluation would run out of communicators


def run_fwd(p: MoE, x: np.ndarray, cfg: MoEConfig):
    """`moe_fwd` on the one-rank mesh."""
    return moe_fwd(p, x, cfg, MESH)


def run_bwd(p: MoE, ctx, dy: np.ndarray, cfg: MoEConfig):
    """`moe_bwd` on the one-rank mesh, the losses weighted as one batch: 1 / its tokens."""
    return moe_bwd(p, ctx, dy, cfg, MESH, 1.0 / int(np.prod(ctx.shape[:-1])))


def losses(ctx) -> tuple[float, float]:
    """(aux, z) as the layer's stats give them: sums over the rank's sequences and tokens."""
    s = ctx.stats
    return s.aux_sum / s.sequences, s.z_sum / s.positions


CASES = [(1, True), (2, True), (2, False)]
IDS = ["top1", "top2", "top2-no-bias"]
# (top_k, bias, capacity factor): small factors, so that drops happen (each case asserts some)
CAPACITY = [(1, True, 0.5), (2, True, 0.5), (2, False, 0.75), (1, True, 1.0), (2, True, 1.0)]
CAPACITY_IDS = ["top1-c0.5", "top2-c0.5", "top2-no-bias-c0.75", "top1-c1", "top2-c1"]


@pytest.mark.parametrize("top_k, bias, factor", [(*c, 0.0) for c in CASES] + CAPACITY, ids=IDS + CAPACITY_IDS)
def test_forward_matches_per_token_reference(top_k: int, bias: bool, factor: float) -> None:
    rng = np.random.default_rng(3)
    cfg = MoEConfig(experts=4, top_k=top_k, aux_coef=0.1, z_coef=0.01, capacity_factor=factor)
    p = make_moe(rng, 6, 4, bias)
    x = rng.standard_normal((3, 5, 6))
    y, ctx = run_fwd(p, x, cfg)
    want, aux, z, counts, dropped = reference(p, x, cfg)
    assert y.shape == x.shape
    np.testing.assert_allclose(y.reshape(-1, 6), want, rtol=0, atol=1e-12)
    got_aux, got_z = losses(ctx)
    assert abs(got_aux - aux) < 1e-12 and abs(got_z - z) < 1e-12
    np.testing.assert_array_equal(ctx.stats.tokens, counts)
    assert ctx.stats.dropped == dropped and (dropped > 0) == (factor > 0)


def _check_backward(p: MoE, x: np.ndarray, cfg: MoEConfig) -> None:
    """Every parameter's and the input's gradient of Σ y·R / N + aux + z (N tokens: the LM
    loss's weight) against finite differences."""
    rng = np.random.default_rng(11)
    r = rng.standard_normal(x.shape)

    def objective() -> float:
        y, ctx = run_fwd(p, x, cfg)
        return float((y * r).sum()) / n + sum(losses(ctx))

    n = int(np.prod(x.shape[:-1]))
    y, ctx = run_fwd(p, x, cfg)
    dx, dp = run_bwd(p, ctx, r / n, cfg)
    assert_fd(dx, fd_grad(objective, x), "dx")
    for name in ("router", "fc", "proj"):
        for leaf in ("w", "b"):
            got = getattr(getattr(dp, name), leaf)
            param = getattr(getattr(p, name), leaf)
            assert (got is None) == (param is None), f"{name}.{leaf}"
            if param is not None:
                assert_fd(got, fd_grad(objective, param), f"{name}.{leaf}")


@pytest.mark.parametrize("top_k, bias", CASES, ids=IDS)
def test_backward_matches_finite_differences(top_k: int, bias: bool) -> None:
    rng = np.random.default_rng(5)
    cfg = MoEConfig(experts=4, top_k=top_k, aux_coef=0.3, z_coef=0.05)
    _check_backward(make_moe(rng, 4, 4, bias), rng.standard_normal((2, 5, 4)), cfg)


@pytest.mark.parametrize("top_k, bias, factor", CAPACITY[:3], ids=CAPACITY_IDS[:3])
def test_backward_through_drops_matches_finite_differences(top_k: int, bias: bool, factor: float) -> None:
    """Dropped assignments: no output, no gradient to their expert; the kept ones' weights
    still depend on every chosen probability (no renormalisation), and the router learns
    through them. The finite differences are small enough that no drop decision flips."""
    rng = np.random.default_rng(5)
    cfg = MoEConfig(experts=4, top_k=top_k, aux_coef=0.3, z_coef=0.05, capacity_factor=factor)
    p, x = make_moe(rng, 4, 4, bias), rng.standard_normal((2, 5, 4))
    _, ctx = run_fwd(p, x, cfg)
    assert ctx.stats.dropped > 0
    _check_backward(p, x, cfg)


def test_a_token_whose_every_choice_was_dropped_passes_nothing() -> None:
    """All tokens prefer expert 0, top-1, capacity 1 per sequence: only the most probable
    token of each sequence reaches it; the others' outputs are exactly 0 and send no grad."""
    rng = np.random.default_rng(2)
    p = make_moe(rng, 4, 4, True)
    p.router.w[0, 0] = 30.0
    x = rng.standard_normal((2, 4, 4))
    x[..., 0] = 1.0
    cfg = MoEConfig(experts=4, top_k=1, capacity_factor=1.0)  # ceil(1·4·1/4) = 1
    y, ctx = run_fwd(p, x, cfg)
    assert ctx.stats.dropped == 6 and ctx.dispatch.bounds[-1] == 2
    best = np.take_along_axis(ctx.routing.probs, ctx.routing.top, 1).reshape(2, 4).argmax(axis=1)
    for s in range(2):
        for t in range(4):
            assert (np.abs(y[s, t]).max() > 0) == (t == best[s])
    dx, _ = run_bwd(p, ctx, np.ones_like(y), cfg)
    moved = np.abs(dx - run_bwd(p, ctx, np.zeros_like(y), cfg)[0]).reshape(2, 4, 4).max(axis=2)
    assert all((moved[s, t] > 0) == (t == best[s]) for s in range(2) for t in range(4))


def test_keep_by_rank_ties_go_to_the_earlier_position() -> None:
    expert = np.array([[[0], [0], [0], [1]]])
    prob = np.array([[[0.5], [0.7], [0.5], [0.2]]])
    pos = np.array([[[2], [0], [1], [3]]])  # any order along the sequence: the positions decide
    keep = keep_by_rank(expert, prob, pos, 2)
    np.testing.assert_array_equal(keep[0, :, 0], [False, True, True, True])
    assert capacity(MoEConfig(experts=8, top_k=2, capacity_factor=1.25), 12) == 4  # ceil(1.25·12·2/8) = ceil(3.75)


@pytest.mark.parametrize("top_k", [1, 2])
def test_an_expert_without_tokens(top_k: int) -> None:
    """Feature 0 is 1 on every token and pushes expert 3's logit far down: it gets no rows,
    its weights no gradient, and its router column still one (through softmax and aux)."""
    rng = np.random.default_rng(7)
    p = make_moe(rng, 4, 4, True)
    p.router.w[0, 3] = -30.0
    x = rng.standard_normal((2, 5, 4))
    x[..., 0] = 1.0
    cfg = MoEConfig(experts=4, top_k=top_k, aux_coef=0.5, z_coef=0.1)
    y, ctx = run_fwd(p, x, cfg)
    assert ctx.stats.tokens[3] == 0 and ctx.stats.tokens.sum() == 10 * top_k
    np.testing.assert_allclose(y.reshape(10, 4), reference(p, x, cfg)[0], rtol=0, atol=1e-12)
    _, dp = run_bwd(p, ctx, np.ones_like(y), cfg)
    assert not dp.fc.w[3].any() and not dp.proj.w[3].any() and not dp.fc.b[3].any() and not dp.proj.b[3].any()
    assert dp.router.w[:, 3].any()
    _check_backward(p, x, cfg)


def test_ties_go_to_the_lowest_index() -> None:
    logits = np.array([[1.0, 2.0, 2.0, 0.0], [3.0, 3.0, 3.0, 3.0], [0.0, 5.0, 5.0, 5.0], [2.0, 1.0, 2.0, 2.0]])
    np.testing.assert_array_equal(route(logits, 2).top, [[1, 2], [0, 1], [1, 2], [0, 2]])
    np.testing.assert_array_equal(route(logits, 1).top[:, 0], [1, 0, 1, 0])
    np.testing.assert_array_equal(route(logits, 2).weights, np.full((4, 2), 0.5))
    # a zero router ties every expert on every token: all go to experts 0 .. k-1
    rng = np.random.default_rng(0)
    p = make_moe(rng, 4, 4, False)
    p.router.w[:] = 0.0
    _, ctx = run_fwd(p, rng.standard_normal((2, 3, 4)), MoEConfig(experts=4, top_k=2))
    np.testing.assert_array_equal(ctx.stats.tokens, [6, 6, 0, 0])


def test_aux_loss_equals_its_formula_on_a_hand_built_routing() -> None:
    """4 tokens, 2 experts, top-1: probabilities (0.8, 0.2), (0.6, 0.4), (0.3, 0.7), (0.9, 0.1).
    Expert 0 takes 3 tokens (f = 3/4), expert 1 one (f = 1/4); P = (0.65, 0.35);
    aux = α·2·(3/4·0.65 + 1/4·0.35) = α·1.15. Top-2 counts each token for both: f = (1/2, 1/2),
    aux = α·2·(0.5·0.65 + 0.5·0.35) = α (the balanced value)."""
    probs = np.array([[0.8, 0.2], [0.6, 0.4], [0.3, 0.7], [0.9, 0.1]])
    logits = np.log(probs) + 1.5  # any shift: softmax gives the probabilities back
    alpha, mesh = 0.01, MESH

    def stats(top_k: int, batch: int = 1, **coefs: float):
        r = route(logits, top_k)
        return routing_stats(r, seq_balance(r, batch, mesh), MoEConfig(experts=2, top_k=top_k, **coefs), 0, mesh)

    s1 = stats(1, aux_coef=alpha)
    np.testing.assert_array_equal(s1.tokens, [3, 1])
    assert abs(s1.aux_sum - alpha * 1.15) < 1e-15 and s1.sequences == 1
    assert abs(stats(2, aux_coef=alpha).aux_sum - alpha) < 1e-15
    # as two sequences of two tokens: (0.8, 0.2), (0.6, 0.4) both to expert 0: f = (1, 0),
    # P = (0.7, 0.3), α·2·0.7; then expert 1 and 0: f = (1/2, 1/2), P = (0.6, 0.4), α·2·0.5
    s = stats(1, batch=2, aux_coef=alpha)
    assert s.sequences == 2 and abs(s.aux_sum - alpha * (1.4 + 1.0)) < 1e-15
    beta = 0.1
    lse = np.log(np.exp(logits).sum(axis=1))
    sz = stats(1, z_coef=beta)
    assert abs(sz.z_sum / sz.positions - beta * float(np.mean(lse**2))) < 1e-14 and abs(lse - 1.5).max() < 1e-14


def test_same_bits_on_any_thread_count() -> None:
    rng = np.random.default_rng(9)
    p = make_moe(rng, 32, 8, True, scale=0.1)
    x = rng.standard_normal((6, 100, 32))
    cfg = MoEConfig(experts=8, top_k=2, aux_coef=0.01, z_coef=0.001)
    runs = []
    saved = threads.threads()
    try:
        for n in (1, 2, 3):
            threads.set_threads(n)
            y, ctx = run_fwd(p, x, cfg)
            dx, dp = run_bwd(p, ctx, y, cfg)
            runs.append((y, dx, dp.router.w, dp.fc.w, dp.fc.b, dp.proj.w))
    finally:
        threads.set_threads(saved)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert np.array_equal(a, b)
