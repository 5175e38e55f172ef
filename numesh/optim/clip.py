"""Global-norm gradient clipping that counts every parameter exactly once across the mesh."""

from __future__ import annotations

import math

import numpy as np

from numesh.mesh import Mesh, P, psum_scalar, replicated_axes
from numesh.tree import Tree, tree_leaves

# Axes whose ranks hold different parameters (or different slices of them). Over dp the
# synchronised gradients are identical copies, so dp never enters the norm. Over pp every
# rank holds its own stage's leaves; the one pp duplicate (the tied embedding on the first
# and last stage) is left out by the caller.
_MODEL_AXES = ("pp", "tp")


def counted_once(spec: P, mesh: Mesh) -> bool:
    """Whether this rank's copy of a leaf enters the norm: one copy over tp when the leaf
    is replicated there (its spec does not split it over tp)."""
    return "tp" not in replicated_axes(spec, mesh) or mesh.index("tp") == 0


def global_norm(grads: Tree, specs: Tree, mesh: Mesh) -> float:
    """sqrt of the sum of squares of the global gradient: sharded leaves summed over their
    axes, replicated leaves counted on one rank only."""
    axes = tuple(a for a in _MODEL_AXES if mesh.shape[a] > 1)
    total = 0.0
    for g, spec in zip(tree_leaves(grads), tree_leaves(specs)):
        if counted_once(spec, mesh):
            flat = g.reshape(-1)
            total += float(np.dot(flat, flat))
    if axes:
        total = psum_scalar(total, mesh, axes)
    return math.sqrt(total)


def clip_scale(norm: float, max_norm: float) -> float:
    """Factor to multiply gradients by so their global norm is at most `max_norm` (1 if it is)."""
    if max_norm <= 0.0 or norm <= max_norm:
        return 1.0
    return max_norm / (norm + 1e-6)
