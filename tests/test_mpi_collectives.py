"""Collectives, point-to-point, specs and the byte counter on real multi-rank meshes.

Run with: mpirun -n N python -m mpi4py -m pytest --with-mpi -p no:cacheprovider -q tests/
(N = 2, 4 or 8; every test adapts to the world size.)
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pytest
from mpi4py import MPI

from conftest import WORLD, world_mesh
from numesh.mesh import (
    Mesh,
    P,
    all_gather,
    broadcast,
    ipsum,
    ipsum_scatter,
    irecv,
    isend,
    local_shape,
    local_slices,
    pmax,
    psum,
    psum_scatter,
    recv,
    send,
    sendrecv,
    shard,
    unshard,
)

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture
def tp_mesh() -> Iterator[Mesh]:
    """tp = the world size."""
    yield from world_mesh(f"tp={WORLD.Get_size()}")


@pytest.fixture
def dp_tp_mesh() -> Iterator[Mesh]:
    """dp=2 x tp=n/2 when the world is 4 or more ranks (else dp=2 x tp=1)."""
    n = WORLD.Get_size()
    if n % 2:
        pytest.skip("needs an even number of ranks")
    yield from world_mesh(f"dp=2,tp={n // 2}")


def rank_array(r: int, shape: tuple[int, ...]) -> np.ndarray:
    """Rank r's contribution: integers, so sums are exact in float64."""
    return np.random.default_rng(100 + r).integers(-50, 50, shape).astype(np.float64)


def test_mesh_layout(tp_mesh: Mesh) -> None:
    n = WORLD.Get_size()
    assert tp_mesh.size("tp") == n
    assert tp_mesh.index("tp") == WORLD.Get_rank()  # tp varies fastest, ranks in order
    assert tp_mesh.comm("tp").Get_size() == n
    assert tp_mesh.comm("dp").Get_size() == 1
    assert tp_mesh.axes_of_size_gt1() == ("tp",)


def test_psum_and_pmax(tp_mesh: Mesh) -> None:
    n, r = WORLD.Get_size(), WORLD.Get_rank()
    x = rank_array(r, (3, 4))
    want_sum = sum(rank_array(i, (3, 4)) for i in range(n))
    want_max = np.max([rank_array(i, (3, 4)) for i in range(n)], axis=0)
    got = psum(x, tp_mesh, "tp")
    np.testing.assert_array_equal(x, rank_array(r, (3, 4)))  # out-of-place leaves x alone
    np.testing.assert_array_equal(got, want_sum)
    out = np.empty_like(x)
    assert psum(x, tp_mesh, "tp", out=out) is out
    np.testing.assert_array_equal(out, want_sum)
    y = x.copy()
    assert psum(y, tp_mesh, "tp", inplace=True) is y
    np.testing.assert_array_equal(y, want_sum)
    np.testing.assert_array_equal(pmax(x, tp_mesh, "tp"), want_max)
    # size-1 axes of the same mesh are still the identity
    assert psum(x, tp_mesh, "dp") is x


@pytest.mark.parametrize("op", ["psum", "pmax"])
def test_psum_pmax_of_non_contiguous_input(tp_mesh: Mesh, op: str) -> None:
    n, r = WORLD.Get_size(), WORLD.Get_rank()
    arrays = [rank_array(i, (3, 4)) for i in range(n)]
    want = sum(arrays) if op == "psum" else np.max(arrays, axis=0)
    f = psum if op == "psum" else pmax
    np.testing.assert_array_equal(f(rank_array(r, (3, 4)).T, tp_mesh, "tp"), want.T)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_all_gather(tp_mesh: Mesh, dim: int) -> None:
    n, r = WORLD.Get_size(), WORLD.Get_rank()
    got = all_gather(rank_array(r, (2, 3)), tp_mesh, "tp", dim)
    want = np.concatenate([rank_array(i, (2, 3)) for i in range(n)], axis=dim)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dim", [0, 1])
def test_psum_scatter(tp_mesh: Mesh, dim: int) -> None:
    n, r = WORLD.Get_size(), WORLD.Get_rank()
    shape = (2 * n, 3) if dim == 0 else (3, 2 * n)
    total = sum(rank_array(i, shape) for i in range(n))
    want = np.split(total, n, axis=dim)[r]
    got = psum_scatter(rank_array(r, shape), tp_mesh, "tp", dim)
    np.testing.assert_array_equal(got, want)
    h = ipsum_scatter(rank_array(r, shape), tp_mesh, "tp", dim)
    np.testing.assert_array_equal(h.wait(), want)
    np.testing.assert_array_equal(h.wait(), want)  # waiting twice is harmless


def test_psum_scatter_not_divisible_raises_on_every_rank(tp_mesh: Mesh) -> None:
    n = WORLD.Get_size()
    with pytest.raises(ValueError, match="does not divide"):
        psum_scatter(np.zeros((n + 1, 2)), tp_mesh, "tp", 0)
    with pytest.raises(ValueError, match="does not divide"):
        ipsum_scatter(np.zeros((2, n + 1)), tp_mesh, "tp", 1)
    assert tp_mesh.counter.total(kind="calls") == 0


def test_ipsum_handle(tp_mesh: Mesh) -> None:
    n, r = WORLD.Get_size(), WORLD.Get_rank()
    x = rank_array(r, (5,))
    h = ipsum(x, tp_mesh, "tp")
    got = h.wait()
    assert got is x  # in place
    np.testing.assert_array_equal(x, sum(rank_array(i, (5,)) for i in range(n)))


@pytest.mark.parametrize("root", ["first", "last"])
def test_broadcast(tp_mesh: Mesh, root: str) -> None:
    n, r = WORLD.Get_size(), WORLD.Get_rank()
    root_i = 0 if root == "first" else n - 1
    x = rank_array(r, (4,))
    assert broadcast(x, tp_mesh, "tp", root=root_i) is x
    np.testing.assert_array_equal(x, rank_array(root_i, (4,)))


def test_send_recv_chain_with_proc_null_ends(tp_mesh: Mesh) -> None:
    """Each rank receives from prev then sends to next: the ends talk to PROC_NULL."""
    n, r = WORLD.Get_size(), WORLD.Get_rank()
    prev, nxt = tp_mesh.neighbors("tp")
    assert (prev == MPI.PROC_NULL) == (r == 0)
    assert (nxt == MPI.PROC_NULL) == (r == n - 1)
    buf = np.full(3, -1.0)
    recv(buf, tp_mesh, "tp", prev, tag=5)
    token = buf + 1.0 if r > 0 else np.zeros(3)
    send(token, tp_mesh, "tp", nxt, tag=5)
    if r == 0:
        np.testing.assert_array_equal(buf, -1.0)  # untouched
    else:
        np.testing.assert_array_equal(buf, r - 1)  # the token counts the hops
    sent = 0 if r == n - 1 else token.nbytes
    assert tp_mesh.counter.total("tp", "send", kind="payload") == sent


def test_sendrecv_shift(tp_mesh: Mesh) -> None:
    n, r = WORLD.Get_size(), WORLD.Get_rank()
    prev, nxt = tp_mesh.neighbors("tp")
    fwd = sendrecv(rank_array(r, (4,)), np.full(4, np.nan), tp_mesh, "tp", dest=nxt, source=prev)
    bwd = sendrecv(rank_array(r, (4,)), np.full(4, np.nan), tp_mesh, "tp", dest=prev, source=nxt, tag=1)
    if r == 0:
        assert np.isnan(fwd).all()
    else:
        np.testing.assert_array_equal(fwd, rank_array(r - 1, (4,)))
    if r == n - 1:
        assert np.isnan(bwd).all()
    else:
        np.testing.assert_array_equal(bwd, rank_array(r + 1, (4,)))


def test_isend_irecv(tp_mesh: Mesh) -> None:
    r = WORLD.Get_rank()
    prev, nxt = tp_mesh.neighbors("tp")
    buf = np.full(6, np.nan)
    hr = irecv(buf, tp_mesh, "tp", prev, tag=9)
    hs = isend(rank_array(r, (6,)), tp_mesh, "tp", nxt, tag=9)
    hs.wait()
    assert hr.wait() is buf
    if r == 0:
        assert np.isnan(buf).all()
    else:
        np.testing.assert_array_equal(buf, rank_array(r - 1, (6,)))


# ---------------------------------------------------------------------------------------
# merged axes


def test_merged_axes(dp_tp_mesh: Mesh) -> None:
    mesh = dp_tp_mesh
    n, r = WORLD.Get_size(), WORLD.Get_rank()
    tp = n // 2
    assert mesh.index(("dp", "tp")) == r
    assert mesh.index("dp") == r // tp and mesh.index("tp") == r % tp
    assert mesh.size(("dp", "tp")) == n and mesh.comm(("dp", "tp")).Get_size() == n
    x = rank_array(r, (2, 2))
    np.testing.assert_array_equal(psum(x, mesh, ("dp", "tp")), sum(rank_array(i, (2, 2)) for i in range(n)))
    np.testing.assert_array_equal(psum(x, mesh, ("tp", "dp")), sum(rank_array(i, (2, 2)) for i in range(n)))
    # over tp alone: the ranks of my dp row; over dp alone: my tp column
    row = [i for i in range(n) if i // tp == r // tp]
    col = [i for i in range(n) if i % tp == r % tp]
    np.testing.assert_array_equal(psum(x, mesh, "tp"), sum(rank_array(i, (2, 2)) for i in row))
    np.testing.assert_array_equal(psum(x, mesh, "dp"), sum(rank_array(i, (2, 2)) for i in col))
    # gathers and scatters over merged axes follow the row-major merged index
    got = all_gather(x, mesh, ("dp", "tp"), 1)
    np.testing.assert_array_equal(got, np.concatenate([rank_array(i, (2, 2)) for i in range(n)], axis=1))
    big = rank_array(r, (n, 3))
    total = sum(rank_array(i, (n, 3)) for i in range(n))
    np.testing.assert_array_equal(psum_scatter(big, mesh, ("dp", "tp"), 0), total[r : r + 1])
    assert mesh.counter.total(("dp", "tp"), "all_reduce", kind="calls") == 2
    assert mesh.counter.total("tp", "all_reduce", kind="calls") == (1 if tp > 1 else 0)


def test_three_axis_mesh_pipeline_neighbors() -> None:
    n, r = WORLD.Get_size(), WORLD.Get_rank()
    if n != 8:
        pytest.skip("the pp x dp x tp mesh needs 8 ranks")
    mesh = Mesh.create(WORLD, pp=2, dp=2, tp=2)
    try:
        assert mesh.coords == {"pp": r // 4, "dp": (r // 2) % 2, "ep": 0, "cp": 0, "tp": r % 2}
        prev, nxt = mesh.neighbors("pp")
        got = sendrecv(np.array([float(r)]), np.array([-1.0]), mesh, "pp", dest=nxt, source=prev)
        assert got[0] == (r - 4 if r >= 4 else -1.0)
        x = np.array([float(r)])
        assert psum(x, mesh, ("pp", "dp", "tp"))[0] == sum(range(8))
        assert psum(x, mesh, ("pp", "tp"))[0] == sum(i for i in range(8) if (i // 2) % 2 == (r // 2) % 2)
    finally:
        mesh.free()


def test_cp_sits_between_dp_and_tp() -> None:
    """Megatron's order pp, dp, cp, tp (tp fastest): a cp group is ranks tp apart."""
    n, r = WORLD.Get_size(), WORLD.Get_rank()
    if n != 8:
        pytest.skip("the dp x cp x tp mesh needs 8 ranks")
    mesh = Mesh.parse("dp=2,cp=2,tp=2", WORLD)
    try:
        assert mesh.coords == {"pp": 0, "dp": r // 4, "ep": 0, "cp": (r // 2) % 2, "tp": r % 2}
        x = np.array([float(r)])
        assert psum(x, mesh, "cp")[0] == sum(i for i in range(8) if i // 4 == r // 4 and i % 2 == r % 2)
        assert psum(x, mesh, ("dp", "cp"))[0] == sum(i for i in range(8) if i % 2 == r % 2)
        assert mesh.counter.total("cp", "all_reduce", kind="calls") == 1
    finally:
        mesh.free()


# ---------------------------------------------------------------------------------------
# specs


@pytest.mark.parametrize(
    "spec, shape",
    [(P("tp", None), (8, 3)), (P(None, "tp"), (3, 8)), (P(("dp", "tp")), (8, 2)), (P("dp", "tp"), (4, 8)),
     (P(None, ("dp", "tp")), (2, 16)), (P(), (3, 2))],
)
def test_shard_unshard_round_trip(dp_tp_mesh: Mesh, spec: P, shape: tuple) -> None:
    mesh = dp_tp_mesh
    g = np.arange(float(np.prod(shape))).reshape(shape)  # the same global array on every rank
    local = shard(g, spec, mesh)
    assert local.shape == local_shape(shape, spec, mesh)
    np.testing.assert_array_equal(local, g[local_slices(shape, spec, mesh)])
    # the shards of all ranks tile the global array exactly once per replica
    cover = np.zeros(shape)
    cover[local_slices(shape, spec, mesh)] += 1
    cover = psum(cover, mesh, ("pp", "dp", "tp"))
    n_split = 1
    for d in spec:
        if d is not None:
            n_split *= mesh.size(d)
    np.testing.assert_array_equal(cover, WORLD.Get_size() // n_split)
    np.testing.assert_array_equal(unshard(local, spec, mesh), g)


def test_shard_unshard_on_tp_mesh(tp_mesh: Mesh) -> None:
    n = WORLD.Get_size()
    for spec, shape in ((P("tp", None), (2 * n, 3)), (P(None, "tp"), (3, 2 * n)), (P(("dp", "tp")), (n, 2))):
        g = np.arange(float(np.prod(shape))).reshape(shape)
        local = shard(g, spec, tp_mesh)
        np.testing.assert_array_equal(unshard(local, spec, tp_mesh), g)


# ---------------------------------------------------------------------------------------
# byte counter


def test_byte_counter(tp_mesh: Mesh) -> None:
    n, r = WORLD.Get_size(), WORLD.Get_rank()
    c = tp_mesh.counter
    c.reset()
    x = rank_array(r, (10, 3))
    S = x.nbytes
    psum(x, tp_mesh, "tp")
    assert c.total("tp", "all_reduce", kind="payload") == S
    assert c.total("tp", "all_reduce", kind="bus") == pytest.approx(2 * (n - 1) / n * S, rel=1e-15)
    assert c.total("tp", "all_reduce", kind="calls") == 1
    assert c.total("dp", kind="payload") == 0
    c.reset()
    all_gather(x, tp_mesh, "tp", 0)  # NCCL-tests convention: S = the gathered size
    assert c.total("tp", "all_gather", kind="payload") == n * S
    assert c.total("tp", "all_gather") == pytest.approx((n - 1) / n * n * S, rel=1e-15)
    c.reset()
    psum_scatter(rank_array(r, (2 * n, 3)), tp_mesh, "tp", 0)  # S = the input size
    S2 = 2 * n * 3 * 8
    assert c.total("tp", "reduce_scatter", kind="payload") == S2
    assert c.total("tp", "reduce_scatter") == pytest.approx((n - 1) / n * S2, rel=1e-15)
    c.reset()
    ipsum(x.copy(), tp_mesh, "tp").wait()
    pmax(x, tp_mesh, "tp")
    assert c.total("tp", "all_reduce", kind="payload") == 2 * S
    assert c.total(kind="calls") == 2


def _every_call(mesh: Mesh) -> list[np.ndarray]:
    """One of each collective and point-to-point call on the dp axis, results in order."""
    r, n = mesh.index("dp"), mesh.size("dp")
    x = np.arange(4 * n, dtype=np.float64) + 10 * r
    out = [psum(x, mesh, "dp"), psum(x.copy(), mesh, "dp", inplace=True), pmax(x, mesh, "dp"),
           all_gather(x, mesh, "dp"), psum_scatter(x, mesh, "dp"), broadcast(x.copy(), mesh, "dp", root=n - 1),
           ipsum(x.copy(), mesh, "dp").wait(), ipsum_scatter(x, mesh, "dp").wait()]
    prev, nxt = (r - 1) % n, (r + 1) % n
    out.append(sendrecv(x, np.empty_like(x), mesh, "dp", nxt, prev))
    h = isend(x, mesh, "dp", nxt, tag=5)
    out.append(irecv(np.empty_like(x), mesh, "dp", prev, tag=5).wait())
    h.wait()
    if r % 2 == 0 and nxt != r:
        send(x, mesh, "dp", nxt, tag=6)
    if r % 2 == 1:
        out.append(recv(np.empty_like(x), mesh, "dp", prev, tag=6))
    if n % 2 == 1 and r == 0:  # odd n: rank n-1 (even) sent to rank 0 as well
        out.append(recv(np.empty_like(x), mesh, "dp", prev, tag=6))
    return out


def test_observer_sees_every_call_and_changes_no_result() -> None:
    from numesh.observe import Recorder

    mesh = Mesh.parse("dp=-1")
    plain = _every_call(mesh)
    counted = sum(mesh.counter.calls.values())
    mesh.counter.reset()
    rec = Recorder()
    mesh.observer = rec
    observed = _every_call(mesh)
    mesh.observer = None
    for a, b in zip(plain, observed, strict=True):
        np.testing.assert_array_equal(a, b)
    ops = [c.op for c in rec.calls]
    assert ops[:8] == ["all_reduce", "all_reduce", "all_reduce", "all_gather", "reduce_scatter", "broadcast",
                       "all_reduce", "reduce_scatter"]
    assert ops[8:11] == ["sendrecv", "send", "recv"]
    assert all(c.axes == ("dp",) and c.end is not None and c.end >= c.start for c in rec.calls)
    # every counted call was observed (receives are observed but not counted)
    assert sum(mesh.counter.calls.values()) == counted == len([o for o in ops if o != "recv"])
