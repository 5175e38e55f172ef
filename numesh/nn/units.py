"""Units: the groups of parameters that are fetched, freed and reduced together.

A unit is one transformer block (by its index in this rank's tree) or the outer unit
(the embeddings, the final norm and an untied LM head). ZeRO-3 gathers a unit before use
and frees it after; gradient reduction starts as soon as a unit's gradient is final.
The optimiser sees units as opaque keys of an ordered dict: it never imports the model.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from numesh.base.tree import tree_leaves_with_path
from numesh.mesh import Mesh
from numesh.nn.gpt import GPT
from numesh.nn.transformer import tp_partial


@attrs.frozen
class Unit:
    """A block (`block` = its local index) or the outer unit (`block` = None)."""

    block: int | None = None

    @property
    def is_outer(self) -> bool:
        return self.block is None

    def __str__(self) -> str:
        return "outer" if self.block is None else f"blocks.{self.block}"


OUTER = Unit()


def unit_order(n_blocks: int) -> list[Unit]:
    """Units in the order backward finishes their gradients: last block first, outer last."""
    return [Unit(i) for i in reversed(range(n_blocks))] + [OUTER]


def split_units(tree: GPT) -> dict[Unit, Any]:
    """A parameter-shaped tree (params, grads, specs) as units, in `unit_order`.
    The outer unit is the GPT with no blocks."""
    out: dict[Unit, Any] = {Unit(i): tree.blocks[i] for i in reversed(range(len(tree.blocks)))}
    out[OUTER] = attrs.evolve(tree, blocks=())
    return out


def join_units(units: Mapping[Unit, Any]) -> GPT:
    """Inverse of `split_units`."""
    n = sum(1 for u in units if not u.is_outer)
    return attrs.evolve(units[OUTER], blocks=tuple(units[Unit(i)] for i in range(n)))


def tp_partial_leaves(units: Mapping[Unit, Any], mesh: Mesh) -> set[tuple[Unit, str]]:
    """(unit, leaf path) of every leaf whose gradient is partial over tp on `mesh` (the
    norms under sequence parallelism, GQA's k and v: `tp_partial`), for the optimiser to
    sum over tp once per step."""
    return {(u, path) for u, tree in units.items() for path, _ in tree_leaves_with_path(tree)
            if tp_partial(path, mesh)}
