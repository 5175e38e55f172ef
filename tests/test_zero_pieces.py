"""The pieces ZeroOptimizer is built from, one process: the flat layout against offsets
worked out by hand, the gradient-sync strategies with their collectives replaced by what
dp identical ranks would compute, the residencies, and the driver over opaque unit keys."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from conftest import self_mesh
from numesh.base.tree import tree_leaves
from numesh.mesh import P
from numesh.mesh.collectives import Handle
from numesh.nn.units import OUTER, Unit
from numesh.optim import grad_sync as gs
from numesh.optim.adamw import AdamWConfig, AdamWState, adamw_rule, adamw_step
from numesh.optim.flat import FlatLayout
from numesh.optim.interface import Optimizer
from numesh.optim.residency import AllResident, ShardResident
from numesh.optim.zero import ZeroOptimizer


def three_units() -> dict[Any, Any]:
    """Units of 5, 7 and 4 values, in an order that is not sorted (layout order = this order)."""
    return {
        "c": [np.arange(5.0)],
        "a": {"w": np.arange(6.0).reshape(2, 3) + 10, "b": np.array([20.0])},
        "b": (np.arange(4.0) + 30,),
    }


# (padded, start, shard_size, shard_start) per unit and (total, shard_total), by dp
HAND = {
    1: ([(5, 0, 5, 0), (7, 5, 7, 5), (4, 12, 4, 12)], (16, 16)),
    2: ([(6, 0, 3, 0), (8, 6, 4, 3), (4, 14, 2, 7)], (18, 9)),
    3: ([(6, 0, 2, 0), (9, 6, 3, 2), (6, 15, 2, 5)], (21, 7)),
    4: ([(8, 0, 2, 0), (8, 8, 2, 2), (4, 16, 1, 4)], (20, 5)),
}


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_layout_offsets_padding_and_shards_by_hand(dp: int) -> None:
    spans, (total, shard_total) = HAND[dp]
    for rank in range(dp):
        lay = FlatLayout(three_units(), dp, rank)
        assert list(lay.units) == ["c", "a", "b"]  # the caller's order, not sorted
        assert (lay.total, lay.shard_total) == (total, shard_total)
        for (key, u), size, (padded, start, ss, sst) in zip(lay.units.items(), (5, 7, 4), spans):
            assert (u.size, u.padded, u.start, u.shard_size, u.shard_start) == (size, padded, start, ss, sst)
            assert padded % dp == 0 and padded - size < dp
            assert lay.mine(key) == slice(start + rank * ss, start + (rank + 1) * ss)
            assert u.shard == slice(sst, sst + ss) and u.full == slice(start, start + padded)


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_shards_of_every_rank_rebuild_the_full_buffer(dp: int) -> None:
    full = np.arange(HAND[dp][1][0], dtype=np.float64) + 1
    shards = [FlatLayout(three_units(), dp, r).take_shard(full) for r in range(dp)]
    lay = FlatLayout(three_units(), dp, 0)
    for u in lay.units.values():
        rebuilt = np.concatenate([s[u.shard] for s in shards])
        np.testing.assert_array_equal(rebuilt, full[u.full])


def test_take_shard_by_hand() -> None:
    full = np.arange(18.0)  # dp=2: units at [0, 6), [6, 14), [14, 18)
    np.testing.assert_array_equal(FlatLayout(three_units(), 2, 1).take_shard(full), [3, 4, 5, 10, 11, 12, 13, 16, 17])


@pytest.mark.parametrize("dp", [1, 3])
def test_flatten_unflatten_round_trip_with_unorderable_keys(dp: int) -> None:
    trees = three_units()
    units = {Unit(1): trees["c"], Unit(0): trees["a"], OUTER: trees["b"]}  # Unit keys do not sort
    lay = FlatLayout(units, dp, 0)
    full = lay.flatten(units, np.float64)
    assert full.shape == (lay.total,)
    pad = np.ones(lay.total, dtype=bool)
    for u in lay.units.values():
        pad[u.real] = False
    assert not full[pad].any()  # padding is zero
    back = lay.unflatten(full)
    assert list(back) == list(units)
    for key in units:
        for x, y in zip(tree_leaves(back[key]), tree_leaves(units[key])):
            np.testing.assert_array_equal(x, y)
            assert x.shape == y.shape and np.shares_memory(x, full)  # views, not copies
    back[OUTER][0][2] = -1.0
    assert full[lay.units[OUTER].start + 2] == -1.0


def test_layout_keeps_no_reference_to_the_arrays() -> None:
    units = three_units()
    lay = FlatLayout(units, 2, 0)
    for u in lay.units.values():
        for x in tree_leaves(u.template):
            assert not any(x.strides) and not np.shares_memory(x, tree_leaves(units)[0])


def test_leaf_mask_repeats_each_flag_and_leaves_padding_false() -> None:
    lay = FlatLayout(three_units(), 2, 0)
    flags = {"c": [True], "a": {"w": True, "b": False}, "b": (False,)}
    mask = lay.leaf_mask(flags)
    assert mask.dtype == bool
    want = np.zeros(18, dtype=bool)
    want[0:5] = True  # c at [0, 5), padding at 5
    want[7:13] = True  # a at [6, 13): a.b first (dict keys sorted) at 6, then a.w; b at [14, 18)
    np.testing.assert_array_equal(mask, want)


def test_rank_outside_dp_is_refused() -> None:
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        FlatLayout(three_units(), 2, 2)


# ---------------------------------------------------------------------------------------
# gradient sync, with the collectives replaced by what dp ranks holding the same gradient compute


@pytest.fixture
def fake_dp(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """ipsum and ipsum_scatter as dp identical ranks would see them; records each call's
    (offset in its buffer's base, length)."""
    calls: dict[str, list] = {"all_reduce": [], "reduce_scatter": []}

    def where(x: np.ndarray) -> tuple[int, int]:
        base = x.base if x.base is not None else x
        return ((x.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // x.itemsize, x.size)

    def ipsum(x: np.ndarray, mesh: Any, axes: str) -> Handle:
        calls["all_reduce"].append(where(x))
        x *= mesh.dp
        return Handle(None, x)

    def ipsum_scatter(x: np.ndarray, mesh: Any, axes: str) -> Handle:
        calls["reduce_scatter"].append(where(x))
        n = x.size // mesh.dp
        return Handle(None, mesh.dp * x[mesh.rank * n : (mesh.rank + 1) * n].copy())

    monkeypatch.setattr(gs, "ipsum", ipsum)
    monkeypatch.setattr(gs, "ipsum_scatter", ipsum_scatter)
    return calls


class FakeMesh:
    def __init__(self, dp: int, rank: int):
        self.dp, self.rank = dp, rank

    def size(self, axes: object) -> int:
        """dp as given; every other axis (cp: the gradients' sum over it) of size 1."""
        return self.dp if axes in ("dp", ("dp",)) else 1


def grads_of(units: dict) -> dict:
    return {k: [np.full(np.shape(x), i + 1.0) for x in tree_leaves(t)] for i, (k, t) in enumerate(units.items())}


def flat_grad(tree: Any, padded: int) -> np.ndarray:
    out = np.zeros(padded)
    n = sum(np.size(x) for x in tree_leaves(tree))
    out[:n] = np.concatenate([np.ravel(x) for x in tree_leaves(tree)])
    return out


def test_all_reduce_buckets_are_contiguous_and_launch_in_layout_order(fake_dp: dict) -> None:
    units = three_units()  # layout c [0, 6), a [6, 14), b [14, 18) for dp=2
    lay = FlatLayout(units, 2, 0)
    sync = gs.AllReduceSync(lay, FakeMesh(2, 0), np.float64, overlap=True, bucket_bytes=10 * 8)
    grads = grads_of(units)
    sync.grads_ready("a", grads["a"])  # not first in layout order: waits for c
    assert fake_dp["all_reduce"] == []
    sync.grads_ready("c", grads["c"])  # c + a = 14 values >= 10: one bucket
    assert fake_dp["all_reduce"] == [(0, 14)]
    sync.grads_ready("b", grads["b"])  # the rest
    assert fake_dp["all_reduce"] == [(0, 14), (14, 4)]
    sync.wait()
    assert not sync.sharded
    for k, u in lay.units.items():
        np.testing.assert_array_equal(sync.grad(k), 2 * flat_grad(grads[k], u.padded))


def test_all_reduce_waits_for_every_micro_batch(fake_dp: dict) -> None:
    units = {"x": [np.zeros(3)]}
    sync = gs.AllReduceSync(FlatLayout(units, 1, 0), FakeMesh(1, 0), np.float64, overlap=False, bucket_bytes=1)
    sync.begin_step(3)
    sync.grads_ready("x", [np.array([1.0, 2.0, 3.0])])
    sync.grads_ready("x", [np.array([1.0, 1.0, 1.0])], count=1)
    assert fake_dp["all_reduce"] == []
    sync.grads_ready("x", [np.array([0.0, 0.0, 5.0])])
    assert fake_dp["all_reduce"] == [(0, 3)]
    np.testing.assert_array_equal(sync.grad("x"), [2.0, 3.0, 9.0])


@pytest.mark.parametrize("rank", [0, 1])
def test_stage1_scatters_the_summed_gradient_back_into_the_full_buffer(fake_dp: dict, rank: int) -> None:
    units = three_units()
    lay = FlatLayout(units, 2, rank)
    sync = gs.ScatterIntoFullSync(lay, FakeMesh(2, rank), np.float64, overlap=True)
    assert sync.sharded and sync.nbytes == lay.total * 8  # the full buffer: plain DP's memory
    sync.begin_step(2)
    grads = grads_of(units)
    for k in units:
        sync.grads_ready(k, grads[k])
        sync.grads_ready(k, grads[k])
    assert fake_dp["reduce_scatter"] == [(0, 6), (6, 8), (14, 4)]  # once per unit, the whole padded unit
    sync.wait()
    for k, u in lay.units.items():
        ss = u.shard_size
        want = 2 * 2 * flat_grad(grads[k], u.padded)[rank * ss : (rank + 1) * ss]
        np.testing.assert_array_equal(sync.grad(k), want)
        np.testing.assert_array_equal(sync.buffer[lay.mine(k)], want)


@pytest.mark.parametrize("overlap", [True, False])
def test_stage2_scatters_every_micro_batch_into_the_shard(fake_dp: dict, overlap: bool) -> None:
    units = three_units()
    lay = FlatLayout(units, 2, 1)
    sync = gs.ScatterToShardSync(lay, FakeMesh(2, 1), np.float64, overlap=overlap)
    assert sync.nbytes == lay.shard_total * 8
    sync.begin_step(2)
    grads = grads_of(units)
    for k in units:
        sync.grads_ready(k, grads[k])
        sync.grads_ready(k, [3 * x for x in grads[k]])
    assert [n for _, n in fake_dp["reduce_scatter"]] == [6, 6, 8, 8, 4, 4]  # per micro-batch
    sync.wait()
    for k, u in lay.units.items():
        ss = u.shard_size
        want = 2 * 4 * flat_grad(grads[k], u.padded)[ss : 2 * ss]
        np.testing.assert_array_equal(sync.grad(k), want)
    sync.begin_step(1)  # a new step overwrites, it does not add
    sync.grads_ready("b", grads["b"])
    sync.wait()
    np.testing.assert_array_equal(sync.grad("b"), 2 * flat_grad(grads["b"], 4)[2:4])


# ---------------------------------------------------------------------------------------
# residency


def test_shard_residency_gathers_on_get_and_frees_on_release() -> None:
    units = three_units()
    mesh = self_mesh()
    lay = FlatLayout(units, 1, 0)
    res = ShardResident(lay, mesh, lay.flatten(units, np.float64))
    got = res.get("a")
    np.testing.assert_array_equal(got["w"], units["a"]["w"])
    assert res.get("a") is got and list(res.gathered) == ["a"]  # gathered once until released
    res.release("a")
    assert res.gathered == {}
    trees = res.local_trees()
    assert res.gathered == {} and not np.shares_memory(trees["c"][0], res.buffer)


def test_all_resident_serves_views_and_updates_its_part() -> None:
    units = three_units()
    lay = FlatLayout(units, 1, 0)
    res = AllResident(lay, self_mesh(), lay.flatten(units, np.float64), sharded_update=False)
    res.update_view("b")[:] = 7.0
    np.testing.assert_array_equal(res.get("b")[0], [7.0] * 4)
    assert np.shares_memory(res.local_trees()["a"]["w"], res.buffer)


# ---------------------------------------------------------------------------------------
# the driver over opaque keys


def specs_of(units: dict) -> dict:
    return {"c": [P()], "a": {"w": P(None, "tp"), "b": P()}, "b": (P(),)}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_driver_matches_adamw_on_the_flat_vector(stage: int) -> None:
    """Every stage on one rank: the same parameters as AdamW on the flattened tree, and
    state_trees / load_state_trees round-trip by unit key."""
    units, cfg = three_units(), AdamWConfig(weight_decay=0.1)
    adamw = Optimizer("adamw", cfg, (adamw_rule(cfg),), lambda _leaf: 0)
    opt = ZeroOptimizer(units, specs_of(units), self_mesh(), stage=stage, optimizer=adamw)
    p = np.concatenate([np.ravel(x) for t in units.values() for x in tree_leaves(t)])
    decay = np.array([0] * 5 + [0] + [1] * 6 + [0] * 4, dtype=float)  # only a.w is a matrix
    ref = AdamWState(np.zeros_like(p), np.zeros_like(p))
    rng = np.random.default_rng(0)
    for _ in range(3):
        grads = {k: [rng.standard_normal(np.shape(x)) for x in tree_leaves(t)] for k, t in units.items()}
        opt.begin_step(1)
        for k in ["b", "a", "c"]:
            opt.grads_ready(k, grads[k])
        opt.step(1e-2, 0.5)
        g = np.concatenate([np.ravel(x) for t in grads.values() for x in t]) * 0.5
        adamw_step(p, g, ref, 1e-2, cfg, decay)
    got = np.concatenate([np.ravel(x) for t in opt.local_params().values() for x in tree_leaves(t)])
    np.testing.assert_allclose(got, p, rtol=1e-14)
    assert opt.opt_step == 3
    state = opt.state_trees()
    assert list(state["m"]) == ["c", "a", "b"]
    other = ZeroOptimizer(three_units(), specs_of(units), self_mesh(), stage=stage)
    other.load_state_trees(state, opt.opt_step)
    for g in ("params", "m", "v"):
        for k in units:
            for x, y in zip(tree_leaves(other.state_trees()[g][k]), tree_leaves(state[g][k])):
                np.testing.assert_array_equal(x, y)
    assert other.opt_step == 3


def test_uncounted_leaves_stay_out_of_the_norm() -> None:
    units = three_units()
    grads = {"c": [np.full(5, 1.0)], "a": {"b": np.array([2.0]), "w": np.full((2, 3), 3.0)}, "b": (np.full(4, 4.0),)}
    everything = 5 * 1 + 4 + 6 * 9 + 4 * 16
    for uncounted, want in (((), everything), ({("a", "w")}, everything - 54),
                            ({("b", "0"), ("c", "0")}, everything - 69)):
        opt = ZeroOptimizer(units, specs_of(units), self_mesh(), uncounted=uncounted)
        for k in units:
            opt.grads_ready(k, grads[k])
        assert opt.global_norm() == pytest.approx(np.sqrt(want), rel=1e-15)
