"""Experts over the mesh reproduce the 1-rank MoE layer and model (float64, 1e-10).

* The layer (`moe_fwd`/`moe_bwd`) on every mesh of the world size that splits experts
  over ep, with dp, cp and tp beside it (`LAYER_MESHES`): each rank routes its batch rows
  (and its cp chunks of them), its experts get their tokens by all-to-all over ep, and its
  output and input gradient rows equal the 1-rank layer's; the router's gradient summed
  over dp×ep×cp and each expert's summed over dp×cp equal the 1-rank gradients, and the
  routing stats summed over the mesh equal the 1-rank stats. One case steers every token
  away from an expert, so its rank receives no rows for it; top-1 and top-2; and both with
  a capacity factor that drops assignments (decided per whole sequence: under cp from the
  gathered sequence), the drops counted alike.
* The all-to-all bytes the counter books equal `formulas.moe_all_to_all_bytes` of the
  routing counts; with a capacity, the dropped rows are not sent.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pytest
from mpi4py import MPI

from conftest import assert_close, self_mesh
from numesh import formulas
from numesh.mesh import AXES, Mesh, all_gather, psum
from numesh.mesh.zigzag import take_local
from numesh.nn.layers import Linear
from numesh.nn.moe import MoE, MoEConfig, moe_bwd, moe_fwd, stats_vector
from test_moe import make_moe

pytestmark = pytest.mark.mpi(min_size=2)

WORLD = MPI.COMM_WORLD
LAYER_MESHES = {
    2: ["ep=2"],
    4: ["ep=4", "dp=2,ep=2", "ep=2,cp=2", "ep=2,tp=2"],
    8: ["dp=2,ep=2,tp=2", "ep=2,cp=2,tp=2", "ep=4,cp=2", "ep=8"],
}
C, E, B, T = 8, 8, 8, 12


@pytest.fixture(params=range(4))
def mesh(request: pytest.FixtureRequest) -> Iterator[Mesh]:
    meshes = LAYER_MESHES.get(WORLD.Get_size(), [])
    if request.param >= len(meshes):
        pytest.skip("no such ep mesh on this world size")
    m = Mesh.parse(meshes[request.param], WORLD)
    yield m
    m.free()


def local_moe(p: MoE, mesh: Mesh) -> MoE:
    """This rank's experts (its ep block) and its tp slice of each expert's hidden units."""
    ep, tp = mesh.size("ep"), mesh.size("tp")
    ex = slice(mesh.index("ep") * E // ep, (mesh.index("ep") + 1) * E // ep)
    h = p.fc.w.shape[2] // tp
    hid = slice(mesh.index("tp") * h, (mesh.index("tp") + 1) * h)
    return MoE(router=p.router,
               fc=Linear(np.ascontiguousarray(p.fc.w[ex][:, :, hid]), np.ascontiguousarray(p.fc.b[ex][:, hid])),
               proj=Linear(np.ascontiguousarray(p.proj.w[ex][:, hid]), np.ascontiguousarray(p.proj.b[ex])))


def local_rows(x: np.ndarray, mesh: Mesh) -> np.ndarray:
    """This rank's batch rows (split over dp×ep) and cp chunks of each sequence."""
    n = mesh.size(("dp", "ep"))
    i = mesh.index(("dp", "ep"))
    rows = x[i * (x.shape[0] // n) : (i + 1) * (x.shape[0] // n)]
    return take_local(rows, mesh.size("cp"), mesh.index("cp"))


@pytest.mark.parametrize("top_k, starve, factor", [(1, False, 0.0), (2, False, 0.0), (2, True, 0.0), (1, False, 0.5),
                                                   (2, False, 0.5), (2, True, 1.0)],
                         ids=["top1", "top2", "top2-starved", "top1-cap0.5", "top2-cap0.5", "top2-starved-cap1"])
def test_layer_matches_one_rank(mesh: Mesh, top_k: int, starve: bool, factor: float) -> None:
    rng = np.random.default_rng(4)  # the same global arrays on every rank
    p = make_moe(rng, C, E, bias=True)
    x = rng.standard_normal((B, T, C))
    dy = rng.standard_normal((B, T, C))
    if starve:  # feature 0 is 1 everywhere and expert 5's logit far down: no token reaches it
        x[..., 0] = 1.0
        p.router.w[0, 5] = -40.0
    cfg = MoEConfig(experts=E, top_k=top_k, aux_coef=0.3, z_coef=0.05, capacity_factor=factor)
    scale = 1.0 / (B * T)
    one = self_mesh()
    y1, ctx1 = moe_fwd(p, x, cfg, one)
    dx1, g1 = moe_bwd(p, ctx1, dy / (B * T), cfg, one, scale)

    lp = local_moe(p, mesh)
    y, ctx = moe_fwd(lp, local_rows(x, mesh), cfg, mesh)
    dx, g = moe_bwd(lp, ctx, local_rows(dy, mesh) / (B * T), cfg, mesh, scale)
    y, dx = psum(y, mesh, "tp"), psum(dx, mesh, "tp")  # both partial over tp, as a row-/column-parallel matmul's
    assert_close(y, local_rows(y1, mesh), 1e-10, "output")
    assert_close(dx, local_rows(dx1, mesh), 1e-10, "input grad")
    assert_close(psum(g.router.w, mesh, ("dp", "ep", "cp")), g1.router.w, 1e-10, "router")
    want = local_moe(g1, mesh)
    for name in ("fc", "proj"):
        for leaf in ("w", "b"):
            got = psum(getattr(getattr(g, name), leaf), mesh, ("dp", "cp"))
            assert_close(got, getattr(getattr(want, name), leaf), 1e-10, f"{name}.{leaf}")
    if starve:
        assert ctx1.stats.tokens[5] == 0
        owner = 5 // (E // mesh.size("ep"))
        if mesh.index("ep") == owner:
            assert not g.fc.w[5 % (E // mesh.size("ep"))].any()
    total = psum(stats_vector([ctx.stats], [0], E), mesh, AXES)
    assert_close(total, stats_vector([ctx1.stats], [0], E), 1e-12, "stats")  # dropped among them
    assert (ctx1.stats.dropped > 0) == (factor > 0)  # the capacity cases do drop


@pytest.mark.parametrize("factor", [0.0, 0.5], ids=["dropless", "cap0.5"])
def test_all_to_all_bytes_equal_the_formula(mesh: Mesh, factor: float) -> None:
    """Forward and backward each move every kept assignment row whose expert lives on
    another ep rank there and back: the counter's all-to-all bytes equal the formula of
    the counts, and with a capacity the dropped rows are not among them."""
    rng = np.random.default_rng(6)
    p = make_moe(rng, C, E, bias=True)
    x, dy = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, C))
    cfg = MoEConfig(experts=E, top_k=2, capacity_factor=factor)
    lp, xl = local_moe(p, mesh), local_rows(x, mesh)
    mesh.counter.reset()
    _, ctx = moe_fwd(lp, xl, cfg, mesh)
    moe_bwd(lp, ctx, local_rows(dy, mesh), cfg, mesh, 1.0 / (B * T))
    measured = mesh.counter.total(("ep",), "all_to_all", kind="payload")
    rows = all_gather(ctx.dispatch.send[None], mesh, "ep")  # [ep, ep]: rows[s, d] from ep rank s to d
    want = formulas.moe_all_to_all_bytes(rows, mesh.index("ep"), C, E, 8)
    assert measured == want and (mesh.size("ep") == 1 or want > 0)
    sent, dropped = psum(np.array([ctx.dispatch.send.sum(), ctx.stats.dropped]), mesh, AXES)
    sent //= mesh.size("tp")  # every tp rank sends the same rows; only tp rank 0 counts the drops
    assert sent == B * T * 2 - dropped
    assert (sent < B * T * 2) == (factor > 0)
