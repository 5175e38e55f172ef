"""Pytrees over frozen attrs classes, tuples, lists and dicts.

Parameters, gradients, optimiser state and partition specs are all trees of the same
structure; these helpers are the only code that walks them. Leaves are anything that is
not a node (arrays, scalars, `P` specs); `None` is an empty node (an absent bias).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import attrs
import numpy as np

Tree = Any


def _is_node(x: Any) -> bool:
    return x is None or type(x) in (tuple, list, dict) or attrs.has(type(x))


def _children(x: Any) -> list[tuple[str, Any]]:
    """(name, child) pairs of a node, in a fixed order."""
    if x is None:
        return []
    if type(x) in (tuple, list):
        return [(str(i), c) for i, c in enumerate(x)]
    if type(x) is dict:
        return [(str(k), x[k]) for k in sorted(x)]
    return [(name, getattr(x, name)) for name in _attrs_names(type(x))]


def _rebuild(x: Any, children: list[Any]) -> Any:
    if x is None:
        return None
    if type(x) in (tuple, list):
        return type(x)(children)
    if type(x) is dict:
        return dict(zip(sorted(x), children))
    if _positional(type(x)):
        return type(x)(*children)
    return attrs.evolve(x, **dict(zip(_attrs_names(type(x)), children)))


def tree_map_with_path(f: Callable[..., Any], tree: Tree, *rest: Tree, path: str = "") -> Tree:
    """Apply `f(path, leaf, *other_leaves)` to every leaf; `rest` trees share the structure."""
    if not _is_node(tree):
        if rest and any(_is_node(r) for r in rest):
            _check_same(tree, [], rest, [_children(r) if _is_node(r) else [] for r in rest], path)
        return f(path, tree, *rest)
    kids = _children(tree)
    rest_kids = [_children(r) for r in rest]
    _check_same(tree, kids, rest, rest_kids, path)
    out = []
    for i, (name, child) in enumerate(kids):
        sub = f"{path}.{name}" if path else name
        out.append(tree_map_with_path(f, child, *(rk[i][1] for rk in rest_kids), path=sub))
    return _rebuild(tree, out)


def _check_same(tree: Any, kids: list, rest: tuple, rest_kids: list, path: str) -> None:
    for r, rk in zip(rest, rest_kids):
        if type(r) is not type(tree) or [n for n, _ in rk] != [n for n, _ in kids]:
            raise ValueError(f"tree structures differ at '{path or '<root>'}': "
                             f"{_describe(tree, kids)} vs {_describe(r, rk)}")


def _describe(x: Any, kids: list) -> str:
    """A node or leaf in a few words, for a structure mismatch: 'tuple of 3', 'None', 'ndarray'."""
    if x is None:
        return "None (an absent part, e.g. no bias)"
    if not _is_node(x):
        return f"a leaf ({type(x).__name__})"
    if type(x) in (tuple, list):
        return f"{type(x).__name__} of {len(kids)}"
    if type(x) is dict:
        return f"dict with keys {sorted(map(str, x))}"
    return type(x).__name__


def tree_map(f: Callable[..., Any], tree: Tree, *rest: Tree) -> Tree:
    """Apply `f(leaf, *other_leaves)` to every leaf. (`tree_map_with_path` without the
    paths: ZeRO-3 rebuilds each unit's tree from its gathered buffer twice per micro-batch,
    and building the path strings made that 50 us a 6-leaf block, 8 % of a dp=2 step.)"""
    if rest:
        return tree_map_with_path(lambda _p, *xs: f(*xs), tree, *rest)
    if not _is_node(tree):
        return f(tree)
    return _rebuild(tree, [tree_map(f, child) for _, child in _children(tree)])


def tree_leaves_with_path(tree: Tree, path: str = "") -> list[tuple[str, Any]]:
    """All (path, leaf) pairs in a fixed depth-first order."""
    if not _is_node(tree):
        return [(path, tree)]
    out: list[tuple[str, Any]] = []
    for name, child in _children(tree):
        out.extend(tree_leaves_with_path(child, f"{path}.{name}" if path else name))
    return out


def tree_leaves(tree: Tree) -> list[Any]:
    """All leaves in a fixed depth-first order (`tree_leaves_with_path`'s, without the paths)."""
    out: list[Any] = []
    _collect(tree, out)
    return out


def _collect(x: Any, out: list[Any]) -> None:
    """`tree_leaves`' walk: a module function, not a closure calling itself, which would be
    a reference cycle (the function, its cell) holding `out`, so every leaf it listed (a
    block's gradients) lived on until the cyclic garbage collector ran: 14 MB a SmolLM2
    block held through the rest of a backward, `tests/test_tree.py` checks."""
    if not _is_node(x):
        out.append(x)
    else:
        for _, child in _children(x):
            _collect(child, out)


def tree_unflatten_leaves(tree: Tree, leaves: list[Any]) -> Tree:
    """A tree shaped like `tree` whose leaves are `leaves`, in `tree_leaves` order."""
    n = len(tree_leaves(tree))
    if len(leaves) != n:
        raise ValueError(f"the tree has {n} leaves, got {len(leaves)}")
    it = iter(leaves)
    return tree_map(lambda _x: next(it), tree)


def flatten(tree: Tree, out: np.ndarray | None = None, dtype: Any = None) -> np.ndarray:
    """Concatenate every array leaf (raveled) into one flat vector."""
    leaves = [np.asarray(x) for x in tree_leaves(tree)]
    n = sum(x.size for x in leaves)
    if out is None:
        out = np.empty(n, dtype=dtype or (leaves[0].dtype if leaves else np.float64))
    elif out.size < n:
        raise ValueError(f"flat buffer holds {out.size} values, the tree has {n}")
    i = 0
    for x in leaves:
        out[i : i + x.size] = x.ravel()
        i += x.size
    return out


def unflatten(flat: np.ndarray, like: Tree) -> Tree:
    """A tree shaped like `like` whose leaves are views into `flat` (no copy)."""
    pos = [0]

    def take(x: Any) -> np.ndarray:
        shape = np.shape(x)
        n = math.prod(shape)
        v = flat[pos[0] : pos[0] + n].reshape(shape)
        pos[0] += n
        return v

    out = tree_map(take, like)
    if pos[0] > flat.size:
        raise ValueError(f"flat buffer holds {flat.size} values, the tree needs {pos[0]}")
    return out


def tree_size(tree: Tree) -> int:
    """Total number of array elements in the tree."""
    return sum(int(np.size(x)) for x in tree_leaves(tree))


def held_bytes(*trees: Any) -> int:
    """Bytes of memory the arrays in `trees` keep alive, each buffer counted once: a view
    counts its base (whole, as the base stays allocated while the view lives), and arrays
    that share a base count it once. Walks attrs classes, tuples (named ones included),
    lists and dicts; anything else holds nothing. What the activation accounting measures."""
    return sum(held_buffers(*trees).values())


def held_buffers(*trees: Any) -> dict[int, int]:
    """{id of each buffer the arrays in `trees` keep alive: its bytes} (see `held_bytes`);
    the ids stay valid while the trees live. Merging such dicts counts shared buffers once."""
    seen: dict[int, int] = {}
    for t in trees:
        _held(t, seen)
    return seen


def _held(x: Any, seen: dict[int, int]) -> None:
    """`held_buffers`' walk (a module function: see `_collect`)."""
    if isinstance(x, np.ndarray):
        while isinstance(x.base, np.ndarray):
            x = x.base
        seen[id(x)] = x.nbytes
    elif isinstance(x, (tuple, list)):
        for c in x:
            _held(c, seen)
    elif isinstance(x, dict):
        for c in x.values():
            _held(c, seen)
    elif x is not None and not isinstance(x, (int, float, str)):
        for name in _attrs_names(type(x)):
            _held(getattr(x, name), seen)


_NAMES: dict[type, tuple[str, ...]] = {}
_POSITIONAL: dict[type, bool] = {}


def _positional(cls: type) -> bool:
    """Whether an attrs class is built by `cls(*fields)` in field order (every field in
    __init__, none keyword-only): then `_rebuild` calls it directly, ~4x faster than
    `attrs.evolve`, which looks every field up again."""
    if cls not in _POSITIONAL:
        _POSITIONAL[cls] = all(f.init and not f.kw_only for f in attrs.fields(cls))
    return _POSITIONAL[cls]


def _attrs_names(cls: type) -> tuple[str, ...]:
    """The field names of an attrs class (none for other classes), cached: asked for every
    node of every context the executor measures."""
    if cls not in _NAMES:
        _NAMES[cls] = tuple(f.name for f in attrs.fields(cls)) if attrs.has(cls) else ()
    return _NAMES[cls]
