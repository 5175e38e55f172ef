"""The mesh on one rank: parsing, sizes, identity collectives, partition specs."""

from __future__ import annotations

import re

import attrs
import numpy as np
import pytest
from mpi4py import MPI

from conftest import self_mesh
from numesh.mesh import (
    AXES,
    ByteCounter,
    Mesh,
    MeshError,
    P,
    all_gather,
    broadcast,
    ipsum,
    ipsum_scatter,
    irecv,
    isend,
    local_shape,
    local_slices,
    parse_mesh,
    pmax,
    psum,
    psum_scatter,
    recv,
    replicated_axes,
    send,
    sendrecv,
    shard,
    unshard,
)

# ---------------------------------------------------------------------------------------
# parse_mesh


@pytest.mark.parametrize(
    "spec, n, want",
    [
        ("", 1, dict(pp=1, dp=1, ep=1, cp=1, tp=1)),
        (None, 1, dict(pp=1, dp=1, ep=1, cp=1, tp=1)),
        ("", 4, dict(pp=1, dp=4, ep=1, cp=1, tp=1)),  # no mesh on 4 ranks: all of them on dp
        (None, 2, dict(pp=1, dp=2, ep=1, cp=1, tp=1)),
        ("dp=2,tp=2,pp=2", 8, dict(pp=2, dp=2, ep=1, cp=1, tp=2)),
        ("tp=4", 4, dict(pp=1, dp=1, ep=1, cp=1, tp=4)),
        (" dp = 2 , tp = 2 ", 4, dict(pp=1, dp=2, ep=1, cp=1, tp=2)),
        ("dp=-1,tp=2", 8, dict(pp=1, dp=4, ep=1, cp=1, tp=2)),
        ("tp=-1", 8, dict(pp=1, dp=1, ep=1, cp=1, tp=8)),
        ("pp=2,dp=-1,tp=2", 8, dict(pp=2, dp=2, ep=1, cp=1, tp=2)),
        ("dp=-1", 1, dict(pp=1, dp=1, ep=1, cp=1, tp=1)),
        ({"dp": -1, "tp": 2}, 8, dict(pp=1, dp=4, ep=1, cp=1, tp=2)),
        ("dp=2,cp=2,tp=2", 8, dict(pp=1, dp=2, ep=1, cp=2, tp=2)),
        ("cp=-1,tp=2", 8, dict(pp=1, dp=1, ep=1, cp=4, tp=2)),
        ("ep=2", 2, dict(pp=1, dp=1, ep=2, cp=1, tp=1)),
        ("dp=2,ep=2", 4, dict(pp=1, dp=2, ep=2, cp=1, tp=1)),
        ("ep=-1,dp=2", 8, dict(pp=1, dp=2, ep=4, cp=1, tp=1)),
    ],
)
def test_parse_mesh(spec: object, n: int, want: dict) -> None:
    assert parse_mesh(spec, n) == want


@pytest.mark.parametrize(
    "spec, n, match",
    [
        ("dp=2,tp=2", 8, "needs 4 ranks"),  # product != ranks
        ("dp=2", 1, "needs 2 ranks"),
        ("xp=2", 2, "unknown mesh axis 'xp': the axes are pp, dp, ep, cp, tp"),
        ("dp=2,ep=2", 2, "needs 4 ranks"),
        ("dp=0", 1, ">= 1"),
        ("tp=-2", 2, ">= 1"),
        ("dp2", 2, "malformed"),
        ("=2", 2, "malformed"),
        ("dp=two", 2, "malformed"),
        ("dp=1.5", 2, "malformed"),
        ("dp=-1,tp=-1", 4, "only one mesh axis may be -1"),
        ("dp=2,dp=2", 4, "twice"),
        ("dp=-1,tp=3", 8, "cannot infer dp"),
        ({"xx": 1}, 1, "unknown mesh axis"),
    ],
)
def test_parse_mesh_errors(spec: object, n: int, match: str) -> None:
    with pytest.raises(MeshError, match=match):
        parse_mesh(spec, n)


def test_a_mesh_from_a_file_names_it_and_asks_for_mesh_over_it() -> None:
    with pytest.raises(MeshError, match=r"^mesh pp=1,dp=2,ep=1,cp=1,tp=1 \(in r.toml\) needs 2 ranks but the job has "
                                        r"1: run with mpirun -n 2 or pass --mesh$"):
        parse_mesh("dp=2", 1, " (in r.toml)")


@pytest.mark.parametrize("size", ["2", 2.0, True, None])
def test_mesh_sizes_must_be_ints_not_strings_floats_or_bools(size: object) -> None:
    with pytest.raises(MeshError, match=r"sizes must be positive ints"):
        parse_mesh({"dp": size}, 1)
    with pytest.raises(MeshError, match=r"sizes must be positive ints"):
        Mesh.create(MPI.COMM_SELF, dp=size)


def test_mesh_sizes_may_be_numpy_ints() -> None:
    assert parse_mesh({"dp": np.int64(1)}, 1)["dp"] == 1
    assert type(parse_mesh({"dp": np.int64(1)}, 1)["dp"]) is int


def test_mesh_error_is_value_error() -> None:
    assert issubclass(MeshError, ValueError)


# ---------------------------------------------------------------------------------------
# the 1x1x1 mesh


def test_mesh_on_comm_self() -> None:
    mesh = self_mesh()
    assert mesh.shape == {"pp": 1, "dp": 1, "ep": 1, "cp": 1, "tp": 1}
    for axes in (*AXES, ("dp", "tp"), ("pp", "dp", "tp"), ("tp", "pp")):
        assert mesh.size(axes) == 1
        assert mesh.index(axes) == 0
        assert mesh.comm(axes).Get_size() == 1
    assert mesh.rank == 0
    assert mesh.coords == {"pp": 0, "dp": 0, "ep": 0, "cp": 0, "tp": 0}
    assert mesh.neighbors("pp") == (MPI.PROC_NULL, MPI.PROC_NULL)
    assert mesh.axes_of_size_gt1() == ()
    assert mesh.comm(("tp", "dp")) is mesh.comm(("dp", "tp"))  # one cached sub-communicator per axis set
    assert repr(mesh) == "Mesh(pp=1, dp=1, ep=1, cp=1, tp=1)"
    with pytest.raises(MeshError):
        mesh.size("xp")
    with pytest.raises(MeshError):
        mesh.comm("xp")


def test_mesh_parse_and_create_check_the_rank_count() -> None:
    assert Mesh.parse("dp=-1", MPI.COMM_SELF).shape == {"pp": 1, "dp": 1, "ep": 1, "cp": 1, "tp": 1}
    with pytest.raises(MeshError):
        Mesh.parse("tp=2", MPI.COMM_SELF)
    with pytest.raises(MeshError):
        Mesh.create(comm=MPI.COMM_SELF, dp=2)


def _fake_mesh(**sizes: int) -> Mesh:
    """A Mesh's size/index logic on given axis sizes and coordinates, with no communicator
    (local_shape and local_slices only read `shape` and `coords`)."""
    m = Mesh.__new__(Mesh)
    m.shape = {a: sizes.get(a, 1) for a in AXES}
    m.coords = {a: sizes.get(a + "_i", 0) for a in AXES}
    return m


def test_merged_axis_size_and_index_are_row_major_in_axis_order() -> None:
    m = _fake_mesh(pp=2, dp=3, tp=4, pp_i=1, dp_i=2, tp_i=3)
    assert m.size(("dp", "tp")) == 12
    assert m.size(("tp", "dp")) == 12
    assert m.index(("dp", "tp")) == 2 * 4 + 3
    assert m.index(("tp", "dp")) == 2 * 4 + 3  # canonical pp, dp, tp order whatever the order given
    assert m.index(("pp", "dp", "tp")) == (1 * 3 + 2) * 4 + 3
    assert m.neighbors("dp") == (1, MPI.PROC_NULL)
    assert m.neighbors("tp") == (2, MPI.PROC_NULL)
    m2 = _fake_mesh(pp=3, pp_i=1)
    assert m2.neighbors("pp") == (0, 2)
    m3 = _fake_mesh(dp=2, cp=2, tp=2, dp_i=1, cp_i=1, tp_i=0)  # cp sits between dp and tp
    assert m3.index(("dp", "cp", "tp")) == (1 * 2 + 1) * 2 + 0
    assert m3.index(("cp", "dp")) == 1 * 2 + 1
    assert _fake_mesh(pp=3).neighbors("pp") == (MPI.PROC_NULL, 1)


def test_ep_sits_between_dp_and_cp() -> None:
    """Axis order pp, dp, ep, cp, tp: the batch's rows split over dp×ep with dp outer."""
    assert AXES == ("pp", "dp", "ep", "cp", "tp")
    m = _fake_mesh(dp=2, ep=3, cp=2, dp_i=1, ep_i=2, cp_i=1)
    assert m.size(("dp", "ep")) == 6
    assert m.index(("dp", "ep")) == 1 * 3 + 2
    assert m.index(("ep", "dp")) == 1 * 3 + 2  # canonical order whatever the order given
    assert m.index(("dp", "ep", "cp")) == (1 * 3 + 2) * 2 + 1
    assert m.index(("ep", "cp")) == 2 * 2 + 1


def test_ep_coords_follow_cart_create_with_tp_fastest() -> None:
    """World rank -> coordinates on pp=1,dp=2,ep=2,cp=1,tp=2 (what Cart_create gives with
    reorder=False): tp fastest, then ep, then dp."""
    from numesh.observe.diagnosis import grid_coords

    got = grid_coords({"dp": 2, "ep": 2, "tp": 2})
    assert [(c["dp"], c["ep"], c["tp"]) for _, c in sorted(got.items())] == [
        (d, e, t) for d in range(2) for e in range(2) for t in range(2)]


# ---------------------------------------------------------------------------------------
# collectives on size-1 axes: the identity, and nothing counted

AXIS_SETS = ["pp", "dp", "tp", ("dp", "tp"), ("pp", "dp", "tp")]


@pytest.mark.parametrize("axes", AXIS_SETS)
def test_collectives_on_size_one_axes_are_identity(axes: object) -> None:
    mesh = self_mesh()
    x = np.arange(12.0).reshape(3, 4)
    before = x.copy()
    assert psum(x, mesh, axes) is x
    assert psum(x, mesh, axes, inplace=True) is x
    assert pmax(x, mesh, axes) is x
    assert all_gather(x, mesh, axes, 0) is x
    assert all_gather(x, mesh, axes, 1) is x
    assert psum_scatter(x, mesh, axes, 0) is x
    assert psum_scatter(x, mesh, axes, 1) is x
    assert ipsum(x, mesh, axes).wait() is x
    assert ipsum_scatter(x, mesh, axes, 1).wait() is x
    assert broadcast(x, mesh, axes) is x
    np.testing.assert_array_equal(x, before)
    assert mesh.counter.total() == 0
    assert mesh.counter.total(kind="payload") == 0
    assert mesh.counter.total(kind="calls") == 0


@pytest.mark.parametrize("op", [psum, pmax])
def test_out_is_written_on_a_size_one_axis_too(op) -> None:
    x, out = np.arange(3.0), np.zeros(3)
    assert op(x, self_mesh(), "dp", out=out) is out
    np.testing.assert_array_equal(out, x)


@pytest.mark.parametrize("op", [all_gather, psum_scatter, lambda x, m, a, dim: ipsum_scatter(x, m, a, dim).wait()])
def test_a_dim_out_of_range_raises_on_every_mesh(op) -> None:
    mesh = self_mesh()
    with pytest.raises(ValueError, match=r"dim 5 is out of range for an array of 1 dims: pass one in -1..0"):
        op(np.ones(4), mesh, "dp", 5)
    with pytest.raises(ValueError, match="a 0-d array has no dimension"):
        op(np.array(1.0), mesh, "dp", 0)
    assert op(np.ones((2, 4)), mesh, "dp", -1).shape == (2, 4)


@pytest.mark.parametrize("axis", AXES)
def test_point_to_point_with_proc_null_on_one_rank(axis: str) -> None:
    mesh = self_mesh()
    prev, nxt = mesh.neighbors(axis)
    x = np.arange(4.0)
    buf = np.full(4, -7.0)
    send(x, mesh, axis, nxt)
    assert recv(buf, mesh, axis, prev) is buf
    np.testing.assert_array_equal(buf, -7.0)  # a receive from PROC_NULL leaves the buffer alone
    assert sendrecv(x, buf, mesh, axis, nxt, prev) is buf
    np.testing.assert_array_equal(buf, -7.0)
    h_send = isend(x, mesh, axis, nxt)
    h_recv = irecv(buf, mesh, axis, prev)
    h_send.wait()
    assert h_recv.wait() is buf
    np.testing.assert_array_equal(buf, -7.0)
    assert mesh.counter.total(kind="payload") == 0


def test_send_to_self_along_size_one_axis() -> None:
    """Index 0 along a size-1 axis is this rank: a message to it arrives."""
    mesh = self_mesh()
    x = np.arange(5.0)
    buf = np.zeros(5)
    h = irecv(buf, mesh, "pp", 0, tag=3)
    send(x, mesh, "pp", 0, tag=3)
    h.wait()
    np.testing.assert_array_equal(buf, x)
    assert mesh.counter.total("pp", "send", kind="payload") == x.nbytes


def test_byte_counter_formulas() -> None:
    c = ByteCounter()
    c.add(("tp",), "all_reduce", 1000, 4)
    c.add(("tp",), "all_gather", 800, 4)
    c.add(("dp", "tp"), "reduce_scatter", 400, 8)
    c.add(("pp",), "send", 64, 2)
    assert c.total("tp", "all_reduce", kind="payload") == 1000
    assert c.total("tp", "all_reduce") == pytest.approx(2 * 3 / 4 * 1000)
    assert c.total("tp", "all_gather") == pytest.approx(3 / 4 * 800)
    assert c.total(("tp", "dp"), "reduce_scatter") == pytest.approx(7 / 8 * 400)
    assert c.total("pp", kind="bus") == 64
    assert c.total("tp", kind="payload") == 1800  # only the tp-alone group
    assert c.total(kind="payload") == 1000 + 800 + 400 + 64
    assert c.total(kind="calls") == 4
    with pytest.raises(MeshError):
        c.total("xp")
    c.reset()
    assert c.total() == 0 and c.total(kind="calls") == 0


# ---------------------------------------------------------------------------------------
# partition specs


def test_partition_spec_validation() -> None:
    assert P(None, "tp") == (None, "tp")
    assert P(None, "tp").axes() == ("tp",)
    assert P(("tp", "dp"), None).axes() == ("dp", "tp")
    assert P().axes() == ()
    assert P("ep", None).axes() == ("ep",)
    assert P(("ep", "dp"), None).axes() == ("dp", "ep")
    for bad in (("EP",), (None, "TP"), (("dp", "xx"),), ("dp", "dp"), (("dp", "tp"), "dp"), (("tp", "tp"),)):
        with pytest.raises(MeshError):
            P(*bad)


@pytest.mark.parametrize("entry", [0, 1.5, ("tp", 0)])
def test_a_spec_entry_that_is_no_axis_name_is_one_line(entry: object) -> None:
    """P(0) was a TypeError, 'int' object is not iterable."""
    with pytest.raises(MeshError, match=f"^partition spec entry {re.escape(repr(entry))} must be None, an axis name "
                                        r"\(pp, dp, ep, cp, tp\) or a tuple of them"):
        P(None, entry)
    assert P(["tp"]).axes() == ("tp",)  # a list of names is one too


@pytest.mark.parametrize("spec", [1, 2.0, ["dp=1"]])
def test_a_mesh_that_is_no_string_is_one_line(spec: object) -> None:
    """Mesh.parse(1) was an AttributeError ('int' object has no attribute 'replace')."""
    with pytest.raises(MeshError, match=f"^a mesh is a string of comma-separated axis=size, e.g. 'dp=2,tp=2', got "
                                        f"{re.escape(repr(spec))}$"):
        Mesh.parse(spec, MPI.COMM_SELF)


def test_a_spec_naming_an_axis_twice_is_refused() -> None:
    """P("dp", "dp") once unsharded to a wrong array: an axis splits one dimension, once."""
    with pytest.raises(MeshError, match="names axis dp more than once"):
        P(("dp", "tp"), "dp")


def test_replicated_axes() -> None:
    assert replicated_axes(P(None, "tp")) == ("pp", "dp", "ep", "cp")
    assert replicated_axes(P("ep", None), _fake_mesh(dp=2, ep=2)) == ("dp",)
    assert replicated_axes(P(("dp", "tp"))) == ("pp", "ep", "cp")
    assert replicated_axes(P()) == AXES
    assert replicated_axes(P(None, "tp"), self_mesh()) == ()  # with a mesh: only axes of size > 1
    assert replicated_axes(P(None, "tp"), _fake_mesh(dp=2, tp=2)) == ("dp",)
    assert replicated_axes(P("dp"), _fake_mesh(pp=2, dp=2, tp=2)) == ("pp", "tp")


def test_local_shape_and_slices() -> None:
    m = _fake_mesh(dp=2, tp=4, dp_i=1, tp_i=2)
    assert local_shape((8, 6), P("tp", None), m) == (2, 6)
    assert local_shape((8, 6), P(None, None), m) == (8, 6)
    assert local_shape((8, 6), P(), m) == (8, 6)  # missing trailing entries are replicated
    assert local_shape((3, 8), P(None, ("dp", "tp")), m) == (3, 1)
    assert local_shape((4, 8), P("dp", "tp"), m) == (2, 2)
    assert local_slices((8, 6), P("tp", None), m) == (slice(4, 6), slice(0, 6))
    assert local_slices((3, 16), P(None, ("dp", "tp")), m) == (slice(0, 3), slice(12, 14))
    assert local_slices((4, 8), P("dp", "tp"), m) == (slice(2, 4), slice(4, 6))


@pytest.mark.parametrize(
    "shape, spec",
    [((6, 4), P("tp", None)), ((4, 6), P(None, "tp")), ((12, 8), P(("dp", "tp"))), ((3,), P("dp"))],
)
def test_local_shape_not_divisible_raises(shape: tuple, spec: P) -> None:
    m = _fake_mesh(dp=2, tp=4)
    with pytest.raises(ValueError, match="does not divide"):
        local_shape(shape, spec, m)


def test_spec_longer_than_array_raises() -> None:
    with pytest.raises(ValueError):
        local_shape((4,), P(None, "tp"), self_mesh())


@pytest.mark.parametrize("spec", [P("tp", None), P(None, "tp"), P(("dp", "tp")), P()])
def test_shard_unshard_on_one_rank(spec: P) -> None:
    mesh = self_mesh()
    x = np.arange(24.0).reshape(4, 6)
    local = shard(x, spec, mesh)
    np.testing.assert_array_equal(local, x)
    assert local.flags.c_contiguous
    np.testing.assert_array_equal(unshard(local, spec, mesh), x)


def test_shard_returns_an_owned_copy() -> None:
    x = np.arange(24.0).reshape(4, 6)
    local = shard(x, P("tp", None), self_mesh())
    x[0, 0] = 100.0
    assert local[0, 0] == 0.0


def test_chained_observers_each_see_every_call_and_the_first_waits() -> None:
    from numesh.observe import Chain, Observer, Recorder, attach

    class Waiter(Recorder):
        waited = 0

        def wait(self, request, token) -> None:
            Waiter.waited += 1
            request.Wait()

    class Req:
        def Wait(self) -> None: ...

    a, b = Waiter(), Recorder()
    chain = Chain(a, b)
    tok = chain.begin("all_reduce", "dp", 8)
    chain.wait(Req(), tok)
    chain.end(tok)
    assert Waiter.waited == 1 and [c.op for c in a.calls] == [c.op for c in b.calls] == ["all_reduce"]
    assert a.calls[0].end is not None and b.calls[0].end is not None

    class M:
        observer = None

    m = M()
    attach(m, a)
    assert m.observer is a
    attach(m, b)
    assert isinstance(m.observer, Chain) and m.observer.observers == (a, b)
    assert isinstance(Observer(), Observer)


def test_sequence_parallel_formulas_move_plain_tp_bus_bytes_plus_the_regathers() -> None:
    """Megatron's claim, on the formulas: an all-reduce of S is a reduce-scatter of S plus an
    all-gather into S, so sp's f/g pairs move plain tp's bus bytes; the LayerNorms' slices
    gathered again in backward add one all-gather of S each (2 per block, 1 for the head),
    and full recomputation's rerun forward adds its pairs, as it adds plain tp's all-reduces
    (the LayerNorm grads' once-per-step all-reduce aside). Pipeline sends are 1/tp."""
    from numesh.perf.formulas import (
        Chunk,
        RankUnits,
        StepShape,
        bus_bytes,
        pp_send_bytes,
        step_bytes,
        tp_all_reduce_bytes,
        tp_sequence_parallel_bytes,
    )

    for n in (2, 4, 8):
        for chunk in (Chunk(3, True, True), Chunk(2, True, False), Chunk(1, False, True), Chunk(4, False, False)):
            act = 4 * 16 * 32 * 8
            for mode in ("none", "full"):
                plain = bus_bytes("all_reduce", tp_all_reduce_bytes(chunk, 4, 16, 32, 8, mode), n)
                sp = sum(bus_bytes(op, b, n) for op, b in tp_sequence_parallel_bytes(chunk, 4, 16, 32, 8, mode).items())
                regathers = (0 if mode == "full" else 2 * chunk.blocks) + int(chunk.last)
                assert sp == pytest.approx(plain + regathers * bus_bytes("all_gather", act, n), rel=1e-14)
            assert pp_send_bytes(chunk, 4, 16, 32, 8, seq_split=n) * n == pp_send_bytes(chunk, 4, 16, 32, 8)
    step = StepShape({"pp": 2, "dp": 1, "tp": 2}, zero=0, micro_batches=3, rows=2, block_size=8, n_embd=16, itemsize=4)
    units = RankUnits([Chunk(2, True, False)], padded_blocks=100, padded_outer=50, tied_bytes=64)
    plain = step_bytes(step, units)
    sp = step_bytes(attrs.evolve(step, sequence_parallel=True), attrs.evolve(units, tp_partial_values=96))
    act = 2 * 8 * 16 * 4
    assert sp[("tp", "reduce_scatter")] == 3 * (4 * 2 + 1) * act
    assert sp[("tp", "all_gather")] == 3 * (4 * 2 + 1 + 2 * 2) * act
    assert sp[("tp", "all_reduce")] == 96 * 4  # the LayerNorm grads, once per step
    assert plain[("tp", "all_reduce")] == 3 * (4 * 2 + 1) * act
    assert sp[("pp", "send")] * 2 == plain[("pp", "send")]


def test_ep_formulas_add_the_replicated_leaves_all_reduce_and_ep_to_the_loss_and_norm() -> None:
    """ep is data parallelism for the batch: the loss is summed over it and the norm too (its
    ranks hold other experts); the leaves replicated over ep add one all-reduce over ep of the
    values this rank holds; the dp gradient traffic is that of the same mesh without ep."""
    from numesh.perf.formulas import (
        SCALAR,
        Chunk,
        RankUnits,
        StepShape,
        ep_grad_bytes,
        loss_axes,
        norm_axes,
        step_bytes,
    )

    assert loss_axes({"pp": 1, "dp": 1, "ep": 1, "cp": 1, "tp": 1}) == ("pp", "dp")
    assert loss_axes({"pp": 1, "dp": 2, "ep": 2, "cp": 2, "tp": 1}) == ("pp", "dp", "ep", "cp")
    assert norm_axes({"pp": 2, "dp": 2, "ep": 2, "cp": 1, "tp": 2}, 1) == ("pp", "dp", "ep", "tp")
    assert norm_axes({"pp": 1, "dp": 2, "tp": 1}, 0) == ()  # a trace from before ep
    kw = dict(zero=1, micro_batches=2, rows=2, block_size=8, n_embd=16, itemsize=8)
    units = RankUnits([Chunk(2, True, True)], padded_blocks=100, padded_outer=50, ep_replicated_values=70)
    dense = step_bytes(StepShape({"pp": 1, "dp": 2, "ep": 1, "cp": 1, "tp": 1}, **kw), units)
    ep = step_bytes(StepShape({"pp": 1, "dp": 2, "ep": 2, "cp": 1, "tp": 1}, **kw), units)
    assert ep_grad_bytes(70, 8) == 560
    assert ep.pop(("ep", "all_reduce")) == 560
    assert ep.pop(("pp+dp+ep", "all_reduce")) == SCALAR and dense.pop(("pp+dp", "all_reduce")) == SCALAR
    assert ep.pop(("dp+ep", "all_reduce")) == SCALAR and dense.pop(("dp", "all_reduce")) == SCALAR  # the norm
    assert ep == dense and ("dp", "reduce_scatter") in ep


def test_a_collective_refuses_on_one_rank_what_two_ranks_would() -> None:
    """A Python number, a list or a boolean array to a sum, or a broadcast root past the
    axis, came back unchanged on a 1-rank axis and failed only on 2 ranks (no `nbytes`,
    "Invalid MPI_Op", "Invalid root"): the same one-line error on every mesh now."""
    from numesh.mesh import Mesh, broadcast, pmax, psum

    m = Mesh.parse("tp=1")
    with pytest.raises(TypeError, match="psum takes a numpy array, got float"):
        psum(1.5, m, "tp")
    with pytest.raises(TypeError, match="psum takes a numpy array, got list"):
        psum([1.0, 2.0], m, "tp")
    with pytest.raises(TypeError, match="psum sums numbers, got an array of bool"):
        psum(np.ones(2, bool), m, "tp")
    with pytest.raises(TypeError, match="pmax takes the maximum of numbers, got an array of complex128"):
        pmax(np.ones(2, complex), m, "tp")
    with pytest.raises(ValueError, match="broadcast's root is an index along tp, 0..0, got 5"):
        broadcast(np.ones(2), m, "tp", root=5)
    assert psum(np.ones(2, np.int32), m, "tp").dtype == np.int32
    assert psum(np.float64(1.5), m, "tp").shape == () and pmax(np.int64(3), m, "tp") == 3  # 0-d, as on 2 ranks
