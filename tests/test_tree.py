"""Pytrees: mapping with paths, leaf order, None as an empty node, flat views."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from conftest import self_mesh, tiny_config
from numesh.base.tree import (
    flatten,
    tree_leaves,
    tree_leaves_with_path,
    tree_map,
    tree_map_with_path,
    tree_size,
    tree_unflatten_leaves,
    unflatten,
)
from numesh.mesh import P
from numesh.nn.gpt import gpt_specs, init_gpt
from numesh.nn.layers import LayerNorm, Linear


@attrs.frozen
class Pair:
    second: object  # declared first: attrs field order, not alphabetical, is the leaf order
    first: object


def test_tree_map_over_attrs_keeps_classes_and_none() -> None:
    lin = Linear(np.ones((2, 3)), None)
    out = tree_map(lambda x: x * 2, lin)
    assert type(out) is Linear
    assert out.b is None
    np.testing.assert_array_equal(out.w, 2 * np.ones((2, 3)))
    # the input is untouched (a new tree is built)
    np.testing.assert_array_equal(lin.w, np.ones((2, 3)))


def test_tree_map_multiple_trees() -> None:
    a = {"x": np.arange(3.0), "y": (1.0, [2.0, 3.0])}
    b = {"x": np.ones(3), "y": (10.0, [20.0, 30.0])}
    out = tree_map(lambda u, v: u + v, a, b)
    np.testing.assert_array_equal(out["x"], np.arange(3.0) + 1)
    assert out["y"] == (11.0, [22.0, 33.0])
    assert type(out["y"]) is tuple and type(out["y"][1]) is list


def test_paths_of_gpt_tree() -> None:
    cfg = tiny_config(bias=True)
    params = init_gpt(cfg, self_mesh(), seed=0)
    seen: list[str] = []
    tree_map_with_path(lambda path, x: seen.append(path), params)
    assert seen[:2] == ["wte", "wpe"]
    assert "blocks.0.attn.qkv.w" in seen
    assert "blocks.0.attn.qkv.b" in seen
    assert "blocks.1.mlp.proj.w" in seen
    assert seen[-2:] == ["ln_f.w", "ln_f.b"]
    # per block, attrs field order: ln1, attn (qkv, proj), ln2, mlp (fc, proj); w before b
    block0 = [p for p in seen if p.startswith("blocks.0.")]
    assert block0 == [
        "blocks.0.ln1.w", "blocks.0.ln1.b",
        "blocks.0.attn.qkv.w", "blocks.0.attn.qkv.b",
        "blocks.0.attn.proj.w", "blocks.0.attn.proj.b",
        "blocks.0.ln2.w", "blocks.0.ln2.b",
        "blocks.0.mlp.fc.w", "blocks.0.mlp.fc.b",
        "blocks.0.mlp.proj.w", "blocks.0.mlp.proj.b",
    ]
    # the same paths come from tree_leaves_with_path, in the same order, with the same leaves
    pairs = tree_leaves_with_path(params)
    assert [p for p, _ in pairs] == seen
    assert all(a is b for (_, a), b in zip(pairs, tree_leaves(params)))


def test_paths_without_bias_skip_none() -> None:
    cfg = tiny_config(bias=False)
    params = init_gpt(cfg, self_mesh(), seed=0)
    paths = [p for p, _ in tree_leaves_with_path(params)]
    assert not any(p.endswith(".b") for p in paths)
    assert len(paths) == 2 + 1 + cfg.n_layer * 6


def test_leaf_order_attrs_fields_dicts_sorted_sequences_in_order() -> None:
    tree = {"b": [1, 2], "a": Pair(second=3, first=(4, 5)), "c": None}
    assert tree_leaves(tree) == [3, 4, 5, 1, 2]
    assert [p for p, _ in tree_leaves_with_path(tree)] == ["a.second", "a.first.0", "a.first.1", "b.0", "b.1"]
    # mapping rebuilds the dict with sorted keys and keeps None
    out = tree_map(lambda x: -x, tree)
    assert out == {"a": Pair(second=-3, first=(-4, -5)), "b": [-1, -2], "c": None}


def test_none_is_an_empty_node() -> None:
    assert tree_leaves(None) == []
    ln = LayerNorm(np.zeros(2), None)
    leaves = tree_leaves(ln)
    assert len(leaves) == 1 and leaves[0] is ln.w
    assert len(tree_leaves([None, (None,), {"k": None}])) == 0
    calls = []
    assert tree_map(lambda x: calls.append(x), None) is None
    assert calls == []


def test_specs_are_leaves() -> None:
    specs = gpt_specs(tiny_config())
    leaves = tree_leaves(specs)
    assert all(isinstance(s, P) for s in leaves)
    assert specs.blocks[0].attn.qkv.w == P(None, None, "tp")
    assert specs.wte == P("tp", None)
    assert specs.blocks[0].mlp.proj.w == P("tp", None)
    # a spec tree maps alongside a parameter tree leaf by leaf
    params = init_gpt(tiny_config(), self_mesh(), seed=0)
    ok = tree_leaves(tree_map(lambda x, s: x.ndim >= len(s), params, specs))
    assert len(ok) == len(tree_leaves(params)) and all(ok)


def test_flatten_unflatten_round_trip_and_views() -> None:
    tree = {"a": np.arange(6.0).reshape(2, 3), "b": Linear(np.arange(4.0) + 10, None), "c": [np.array(7.0)]}
    flat = flatten(tree)
    want = np.concatenate([np.ravel(x) for x in tree_leaves(tree)])
    np.testing.assert_array_equal(flat, want)
    np.testing.assert_array_equal(flat, [0, 1, 2, 3, 4, 5, 10, 11, 12, 13, 7])
    assert tree_size(tree) == flat.size == 11
    back = unflatten(flat, tree)
    for x, y in zip(tree_leaves(back), tree_leaves(tree)):
        assert x.shape == np.shape(y)
        np.testing.assert_array_equal(x, y)
    assert back["b"].b is None
    # views: writing into the flat vector changes the leaves, and the other way round
    flat[0] = -1.0
    flat[-1] = 99.0
    assert back["a"][0, 0] == -1.0
    assert back["c"][0] == 99.0
    back["b"].w[2] = 123.0
    assert flat[8] == 123.0
    for leaf in tree_leaves(back):
        assert np.shares_memory(leaf, flat)


def test_flatten_into_out_and_dtype() -> None:
    tree = [np.ones(3, dtype=np.float32), np.full((2, 2), 2.0, dtype=np.float32)]
    out = np.zeros(10, dtype=np.float64)
    got = flatten(tree, out=out)
    assert got is out
    np.testing.assert_array_equal(out[:7], [1, 1, 1, 2, 2, 2, 2])
    assert flatten(tree, dtype=np.float64).dtype == np.float64
    assert flatten(tree).dtype == np.float32
    with pytest.raises(ValueError):
        flatten(tree, out=np.zeros(6))


def test_unflatten_too_small_buffer_raises() -> None:
    with pytest.raises(ValueError):
        unflatten(np.zeros(3), [np.zeros(2), np.zeros(2)])


def test_unflatten_leaves() -> None:
    tree = Linear(np.zeros((2, 2)), np.zeros(2))
    out = tree_unflatten_leaves(tree, ["w", "b"])
    assert out == Linear("w", "b")
    with pytest.raises(ValueError):
        tree_unflatten_leaves(tree, ["w", "b", "extra"])


def test_unflatten_leaves_too_few_raises_value_error() -> None:
    with pytest.raises(ValueError):
        tree_unflatten_leaves(Linear(np.zeros((2, 2)), np.zeros(2)), ["w"])


@pytest.mark.parametrize(
    "a, b",
    [
        ((1, 2), [1, 2]),  # tuple vs list
        ((1, 2), (1, 2, 3)),  # different lengths
        ({"x": 1}, {"x": 1, "y": 2}),  # different dict sizes
        (Linear(1, None), LayerNorm(1, None)),  # different attrs classes
        (None, Linear(1, None)),  # empty node vs node
        ([None], [np.zeros(2)]),  # empty node vs leaf
    ],
)
def test_structure_mismatch_raises(a: object, b: object) -> None:
    with pytest.raises(ValueError):
        tree_map(lambda *xs: xs[0], a, b)


@pytest.mark.parametrize("a, b", [([np.zeros(2)], [None]), ([np.zeros(2)], [(np.zeros(2),)])])
def test_a_leaf_first_and_a_node_second_raises_too(a: object, b: object) -> None:
    """A tree with a bias mapped with one without: f must never be handed None for a leaf."""
    with pytest.raises(ValueError, match=r"tree structures differ at '0': a leaf \(ndarray\) vs "):
        tree_map(lambda *xs: xs[0], a, b)


def test_structure_mismatch_names_the_lengths() -> None:
    with pytest.raises(ValueError, match=r"differ at 'x': tuple of 2 vs tuple of 3"):
        tree_map(lambda *xs: xs[0], {"x": (1, 2)}, {"x": (1, 2, 3)})


def test_dict_key_mismatch_raises() -> None:
    with pytest.raises(ValueError):
        tree_map(lambda x, y: x + y, {"a": 1}, {"b": 2})


def test_walking_a_tree_keeps_none_of_its_arrays_alive() -> None:
    """`tree_leaves`, `flatten` and `held_buffers` let go of the arrays they walked as soon as
    their results are dropped, without waiting for the cyclic garbage collector (a walk
    written as a closure calling itself is a reference cycle holding what it collected:
    a SmolLM2 block's gradients lived on through the rest of each backward)."""
    import gc
    import weakref

    from numesh.base.tree import flatten, held_buffers, tree_leaves

    was = gc.isenabled()
    gc.disable()
    try:
        for walk in (tree_leaves, flatten, held_buffers):
            arr = np.ones(4)
            ref = weakref.ref(arr)
            result = walk({"a": (arr, None), "b": [np.zeros(2)]})
            del arr, result
            assert ref() is None, walk.__name__
    finally:
        if was:
            gc.enable()
