"""The optimiser on an expert-parallel mesh (dp=2, ep=2 on 4 ranks), ZeRO stages 0-3.

A leaf whose spec does not name "ep" (attention, LayerNorms, router, embeddings) is
replicated over ep, and each ep rank's gradient of it is its own tokens' share: summed over
dp×ep. An expert leaf (P("ep", ...)) holds this ep rank's block of experts, whose gradient
already counts every token of the ep group: summed over dp only. With known per-rank
gradients, the reduced gradient, the global norm and an AdamW step (clipped) must equal
those of one rank holding every expert and the summed gradient; the bytes of the ep
all-reduce and the norm's axes follow `numesh.perf.formulas`; `check_replicas` catches an ep
replica that diverged, and lets the experts differ.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI

from conftest import WORLD
from numesh.base.errors import ReplicaError
from numesh.base.tree import tree_map
from numesh.mesh import Mesh, P
from numesh.nn.gpt import Shape
from numesh.observe.diagnosis import grid_coords
from numesh.optim.clip import clip_scale
from numesh.optim.registry import make_optimizer
from numesh.optim.zero import ZeroOptimizer
from numesh.perf import formulas

pytestmark = [pytest.mark.mpi(min_size=4),
              pytest.mark.skipif(WORLD.Get_size() != 4, reason="dp=2 x ep=2 runs on 4 ranks")]
E = 4  # experts; each of the 2 ep ranks holds 2
SPECS = {
    "blocks": {"ln": {"w": P(), "b": P()}, "attn": {"w": P()}, "router": {"w": P()},
               "fc": {"w": P("ep", None), "b": P("ep")}},
    "outer": {"wte": P()},
}
SHAPES = {  # Shape: a tuple that trees do not walk into
    "blocks": {"ln": {"w": Shape((3,)), "b": Shape((3,))}, "attn": {"w": Shape((3, 4))},
               "router": {"w": Shape((3, E))}, "fc": {"w": Shape((E, 3)), "b": Shape((E,))}},
    "outer": {"wte": Shape((5, 3))},
}
REPLICATED_VALUES = 3 + 3 + 12 + 3 * E + 15  # every leaf but fc


def ep_mesh() -> Mesh:
    return Mesh.create(WORLD, dp=2, ep=2)


def block(x: np.ndarray, spec: P, e: int, ep: int) -> np.ndarray:
    """Ep rank e's part of a global leaf: its block of experts, or all of a replicated one."""
    if "ep" not in spec.axes():
        return x
    n = x.shape[0] // ep
    return x[e * n : (e + 1) * n]


def global_params() -> dict:
    rng = np.random.default_rng(7)
    return tree_map(lambda s: rng.standard_normal(s), SHAPES)


def rank_grads(d: int, e: int, ep: int) -> dict:
    """What rank (dp d, ep e) feeds: a replicated leaf's share of its tokens (any values),
    and for an expert leaf its block of a gradient that differs by dp rank only."""
    def one(path_shape: tuple, spec: P, salt: int) -> np.ndarray:
        if "ep" in spec.axes():
            g = np.random.default_rng([salt, d]).standard_normal(path_shape)
            return block(g, spec, e, ep)
        return np.random.default_rng([salt, d, e]).standard_normal(path_shape)

    salts = iter(range(100))
    return tree_map(lambda s, spec: one(s, spec, next(salts)), SHAPES, SPECS)


def summed_grads(dp: int, ep: int) -> dict:
    """The one-rank gradient: replicated leaves summed over dp×ep, experts over dp (their
    blocks side by side)."""
    def total(spec: P, parts: list) -> np.ndarray:
        if "ep" not in spec.axes():
            return sum(parts)
        return np.concatenate([sum(parts[d * ep + e] for d in range(dp)) for e in range(ep)])

    every = [rank_grads(d, e, ep) for d in range(dp) for e in range(ep)]
    return tree_map(lambda spec, *parts: total(spec, list(parts)), SPECS, *every)


def norm_of(tree: dict) -> float:
    leaves: list[np.ndarray] = []
    tree_map(lambda x: leaves.append(np.ravel(x)), tree)
    return math.sqrt(sum(float(x @ x) for x in leaves))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ep_reduces_replicated_leaves_over_dp_ep_and_experts_over_dp(stage: int) -> None:
    mesh = ep_mesh()
    dp, ep = mesh.size("dp"), mesh.size("ep")
    d, e = mesh.index("dp"), mesh.index("ep")
    assert mesh.coords == grid_coords(mesh.shape)[mesh.rank]  # Cart_create's layout: tp fastest, then cp, ep, dp
    assert mesh.index(("dp", "ep")) == d * ep + e
    adamw = make_optimizer("adamw", {"weight_decay": 0.1})
    params = global_params()
    mine = tree_map(lambda x, s: block(x, s, e, ep).copy(), params, SPECS)
    opt = ZeroOptimizer(mine, SPECS, mesh, stage, adamw, bucket_bytes=64)
    ref = ZeroOptimizer(tree_map(np.copy, params), SPECS, Mesh.create(MPI.COMM_SELF), 0, adamw)
    opt.check_replicas()
    held = opt.ep_replicated_values  # its dp shard of them under ZeRO >= 1
    assert (mesh.comm("dp").allreduce(held) if opt.sync.sharded else held) == REPLICATED_VALUES
    assert ref.ep_replicated_values == 0  # ep = 1: nothing to sum

    mesh.counter.reset()
    grads = rank_grads(d, e, ep)
    opt.begin_step(1)
    for key in ("blocks", "outer"):  # backward's order
        opt.grads_ready(key, grads[key])
    norm = opt.global_norm()
    want = summed_grads(dp, ep)
    assert norm == pytest.approx(norm_of(want), rel=1e-12)
    norm_axes = formulas.norm_axes(mesh.shape, stage)
    assert norm_axes == (("dp", "ep") if stage >= 1 else ("ep",))
    expected = {("ep",): formulas.ep_grad_bytes(held, 8)}  # the gradients' sum over ep, then the norm's
    expected[norm_axes] = expected.get(norm_axes, 0) + formulas.SCALAR
    assert {a: v for (a, op), v in mesh.counter.payload.items() if "ep" in a and op == "all_reduce"} == expected
    assert {a for a, _ in mesh.counter.payload} <= {("dp",), ("ep",), ("dp", "ep")}
    opt.global_norm()  # a second wait sums nothing again (the gradients below would be 2x)

    _check_reduced_grads(opt, tree_map(lambda x, s: block(x, s, e, ep), want, SPECS))

    ref.begin_step(1)
    for key in ("blocks", "outer"):
        ref.grads_ready(key, want[key])
    assert ref.global_norm() == pytest.approx(norm, rel=1e-12)
    scale = clip_scale(norm, 0.5 * norm)  # clipping on, so the norm's value matters
    for o in (opt, ref):
        o.step(1e-2, scale)
    got, whole = opt.local_params(), ref.local_params()
    tree_map(lambda g, w, s: np.testing.assert_allclose(g, block(w, s, e, ep), rtol=1e-12, atol=1e-15),
             got, whole, SPECS)
    opt.check_replicas()
    mesh.free()


def _check_reduced_grads(opt: ZeroOptimizer, want: dict) -> None:
    """This rank's reduced gradient per unit (its dp shard under ZeRO >= 1) against `want`
    (this ep rank's leaves of the one-rank gradient)."""
    lay = opt.layout
    for key, u in lay.units.items():
        leaves: list[np.ndarray] = []
        tree_map(lambda x: leaves.append(np.ravel(x)), want[key])
        full = np.concatenate([*leaves, np.zeros(u.padded - u.size)])
        got = opt.sync.grad(key)
        if opt.sync.sharded:
            np.testing.assert_allclose(got, full[lay.rank * u.shard_size : (lay.rank + 1) * u.shard_size],
                                       rtol=1e-12, atol=1e-14)
        else:
            np.testing.assert_allclose(got[: u.size], full[: u.size], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("leaf, diverges", [(("blocks", "router", "w"), True), (("blocks", "fc", "w"), False)])
def test_check_replicas_compares_replicated_leaves_across_ep(stage: int, leaf: tuple, diverges: bool) -> None:
    """A router that differs between the ep ranks is a diverged replica; experts differ by design."""
    mesh = ep_mesh()
    e = mesh.index("ep")
    params = tree_map(lambda x, s: block(x, s, e, mesh.size("ep")).copy(), global_params(), SPECS)
    opt = ZeroOptimizer(params, SPECS, mesh, stage)
    unit, *path = leaf
    x = params[unit]
    for p in path[:-1]:
        x = x[p]
    x[path[-1]] = x[path[-1]] + (1e-9 if e == 1 else 0.0)  # expert blocks already differ over ep
    zeros = tree_map(np.zeros_like, params)
    opt.load_state_trees({"params": params, "m": zeros, "v": zeros}, 0)
    if diverges:
        with pytest.raises(ReplicaError, match="over ep in ep-replicated leaves"):
            opt.check_replicas()
    else:
        opt.check_replicas()
    mesh.free()
