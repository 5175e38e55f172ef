"""The optimiser interface: an optimiser is named data and pure functions.

An `Optimizer` is a name, its hyper-parameters (`config`, a frozen attrs instance), its
rules, and `choose`, which says which rule updates a leaf. The choice is declared once, by
the leaf's model path and the rank of its shape (never its sizes), so a tp-local leaf and
the global leaf a checkpoint stores get the same rule, and new leaves of a new model fall in
place by what they are. Two kinds of rule:

- `Elementwise` (AdamW; Lion would be one): each value from its gradient and its own
  state values alone, so ZeRO can run it on any slice of the flat buffers.
- `MatrixRule` (Muon): an elementwise `direction` (momentum) on the same slices, then
  `matrix`, a function of each whole matrix, then an elementwise `apply`. ZeroOptimizer
  brings each matrix whole to one rank for `matrix` (numesh/optim/matrices.py).

A rule's state is a few named buffers, one value per parameter value it updates (AdamW "m"
and "v", Muon "momentum"); checkpoints store each name as a group of the leaves the rule
holds, and the formulas count `len(rule.state)` values per parameter.

How a leaf is cut into matrices (`matrix_view`) is part of the interface too: dims the
leaf's spec splits over ep are a batch of separate matrices (experts); of the others the
first is the input and the last the output, and any between stack separate matrices, as
q, k and v are stored [C, 3, C].
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import attrs
import numpy as np

from numesh.mesh import P

# one run of values: (parameters, gradients, state buffers, lr, step count t >= 1, decay mask, scratch)
ElementwiseStep = Callable[[np.ndarray, np.ndarray, Sequence[np.ndarray], float, int, np.ndarray, np.ndarray], None]


@attrs.frozen
class Leaf:
    """What a rule is chosen by: a leaf's path in the model ("blocks.3.attn.qkv.w"), its
    shape (tp-local in the optimiser, global in a checkpoint: only its rank may matter) and
    its partition spec."""

    path: str
    shape: tuple[int, ...] = attrs.field(converter=lambda s: tuple(int(n) for n in s))
    spec: P = attrs.field(default=P(), converter=lambda s: P(*s))

    @property
    def name(self) -> str:
        """The last part of the path ("w", "b")."""
        return self.path.rsplit(".", 1)[-1]


@attrs.frozen
class Elementwise:
    """A rule that updates each value from its own gradient and state values.

    Attributes:
        name: the rule's name, printed at start-up ("adamw").
        state: the names of its state buffers, one value per parameter value each.
        step: `step(p, g, states, lr, t, decay, scratch)` updates a run of values in place
            (p, and the states in `state`'s order); `t` counts this step from 1; `decay` is 1
            where weight decay applies; `scratch` is a buffer of p's size to use.
        lr_ratio: its learning rate over the run's scheduled one.
    """

    name: str
    state: tuple[str, ...]
    step: ElementwiseStep
    lr_ratio: float = 1.0


@attrs.frozen
class MatrixRule:
    """A rule whose update is a function of each whole matrix (Muon).

    Attributes:
        name: the rule's name ("muon").
        state: the names of its state buffers, one value per parameter value each.
        direction: `direction(g, states)` turns a run of gradients, in place, into the
            values the matrix function takes (and updates the states: momentum).
        matrix: one whole matrix [in, out] -> its update, the same shape.
        apply: `apply(p, update, lr, fan)` puts a run of a matrix's update into its
            parameters in place; `fan` = (in, out) of the whole matrix.
        flops: the matrix function's FLOPs for a matrix of (in, out): how the matrices are
            dealt to the ranks, and what the planner prices.
        lr_ratio: its learning rate over the run's scheduled one.
    """

    name: str
    state: tuple[str, ...]
    direction: Callable[[np.ndarray, Sequence[np.ndarray]], None]
    matrix: Callable[[np.ndarray], np.ndarray]
    apply: Callable[[np.ndarray, np.ndarray, float, tuple[int, int]], None]
    flops: Callable[[int, int], float]
    lr_ratio: float = 1.0


Rule = Elementwise | MatrixRule


@attrs.frozen
class Optimizer:
    """An optimiser: its name, hyper-parameters, rules and the rule of each leaf.

    Attributes:
        name: what `--optimizer` calls it, and what a checkpoint records.
        config: its hyper-parameters (a frozen attrs instance).
        rules: its rules; rules[0] is elementwise and also takes the padding of the flat
            buffers (values of no leaf, which stay zero).
        choose: a leaf's rule, an index into `rules` (by path and shape rank only).
    """

    name: str
    config: Any
    rules: tuple[Rule, ...]
    choose: Callable[[Leaf], int]

    def __attrs_post_init__(self) -> None:
        if not self.rules or not isinstance(self.rules[0], Elementwise):
            raise ValueError(f"optimizer {self.name}: rules[0] must be elementwise (it takes the padding)")
        names = [s for r in self.rules for s in r.state]
        if len(set(names)) != len(names) or "params" in names:
            raise ValueError(f"optimizer {self.name}: state names must be unique and not 'params', got {names}")

    @property
    def state_names(self) -> tuple[str, ...]:
        """Every state buffer's name, rule by rule."""
        return tuple(s for r in self.rules for s in r.state)

    def rule_index(self, leaf: Leaf) -> int:
        i = self.choose(leaf)
        if not 0 <= i < len(self.rules):
            raise ValueError(f"optimizer {self.name} chose rule {i} for {leaf.path}: it has {len(self.rules)}")
        return i

    def owner_of(self, state: str) -> int:
        """The index of the rule that holds state buffer `state`."""
        return next(i for i, r in enumerate(self.rules) if state in r.state)

    def groups(self, leaves: Mapping[str, Leaf]) -> dict[str, tuple[str, ...]]:
        """"params" and each state name -> the paths of the leaves it holds (checkpoint groups)."""
        rule = {path: self.rule_index(leaf) for path, leaf in leaves.items()}
        out = {"params": tuple(leaves)}
        for i, r in enumerate(self.rules):
            for s in r.state:
                out[s] = tuple(p for p in leaves if rule[p] == i)
        return out

    @property
    def state_per_value(self) -> tuple[int, ...]:
        """State values per parameter value, rule by rule (the formulas' counts)."""
        return tuple(len(r.state) for r in self.rules)


@attrs.frozen
class MatrixView:
    """How a leaf is cut into matrices (`matrix_view`): `batch` slabs of separate matrices
    (the product of the leading dims split over ep: experts, one contiguous slab each),
    then per slab its `shape`, whose dim
    `inp` is the input, `out` the output, the dims between stacking separate matrices;
    `tp_dim`, the slab dim split over tp (None: whole on every tp rank); `experts`: whether
    its slabs are experts (the leaf's leading dims split over ep: each ep rank its own)."""

    batch: int
    shape: tuple[int, ...]
    tp_dim: int | None
    experts: bool = False

    @property
    def matrices_per_slab(self) -> int:
        return math.prod(self.shape[1:-1])

    @property
    def size(self) -> int:
        """Values of one slab."""
        return math.prod(self.shape)

    def matrices(self, slab: np.ndarray) -> list[np.ndarray]:
        """The [in, out] matrices of one slab (views)."""
        inner = slab.reshape(slab.shape[0], -1, slab.shape[-1])
        return [inner[:, j, :] for j in range(inner.shape[1])]


def matrix_view(leaf: Leaf) -> MatrixView:
    """The matrices of a leaf: dims its spec splits over "ep" (leading) are a batch of
    separate matrices; the first other dim is the input, the last the output, any between
    stack separate matrices (q, k, v of a fused [C, 3, C]). At most one dim may be split
    over tp, and it must not be a batch dim. ValueError if the leaf is no matrix."""
    dims = list(leaf.spec) + [None] * (len(leaf.shape) - len(leaf.spec))
    names = [() if d is None else ((d,) if isinstance(d, str) else tuple(d)) for d in dims]
    nb = 0
    while nb < len(names) and "ep" in names[nb]:
        nb += 1
    if any("ep" in n for n in names[nb:]) or any(set(n) - {"ep"} for n in names[:nb]):
        raise ValueError(f"{leaf.path}: spec {leaf.spec!r} splits a matrix dim over ep, "
                         "or an expert dim over another axis")
    shape = leaf.shape[nb:]
    if len(shape) < 2:
        raise ValueError(f"{leaf.path}: shape {leaf.shape} has no matrix (two dims past the expert dims)")
    split = [i for i, n in enumerate(names[nb:]) if n]
    if len(split) > 1 or any(set(names[nb + i]) != {"tp"} for i in split):
        raise ValueError(f"{leaf.path}: spec {leaf.spec!r} splits a matrix over more than tp alone")
    return MatrixView(math.prod(leaf.shape[:nb]), shape, split[0] if split else None, nb > 0)


def fan(view: MatrixView, tp: int) -> tuple[int, int]:
    """(in, out) of the whole matrices of a view whose slabs are tp-local."""
    shape = list(view.shape)
    if view.tp_dim is not None:
        shape[view.tp_dim] *= tp
    return shape[0], shape[-1]
