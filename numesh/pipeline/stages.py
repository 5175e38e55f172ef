"""Which layers each pipeline rank owns, and its part of the parameter tree.

With pp ranks and v virtual stages (chunks) per rank there are pp·v model stages of
n_layer/(pp·v) contiguous layers each; model stage k = chunk·pp + rank. Model stage 0
also owns the embedding (wte, wpe), the last one the final norm and the LM head: its own
`lm_head`, or wte when they are tied, and then the first and last ranks both hold wte and
sum its gradients.
A rank's tree is a `GPT` whose `blocks` are its layers in chunk order and whose parts
it does not own are None.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from numesh.base.errors import ConfigError
from numesh.base.tree import tree_map
from numesh.mesh import Mesh, broadcast
from numesh.nn.gpt import GPT, is_tied, outer_held, outer_parts
from numesh.nn.units import Unit
from numesh.nn.walk import Stage


@attrs.frozen
class StageLayout:
    """Which layers each of `pp` pipeline ranks owns with `v` chunks (virtual stages) per
    rank: model stage k = chunk·pp + rank holds n_layer/(pp·v) contiguous layers. Building
    one checks that the layers split evenly (a one-line `ConfigError` if not).

    Attributes:
        n_layer: the model's transformer blocks.
        pp: pipeline ranks.
        v: model chunks per rank (more than 1 only for the interleaved schedule).
    """

    n_layer: int
    pp: int = 1
    v: int = 1

    def __attrs_post_init__(self) -> None:
        if self.pp < 1 or self.v < 1:
            raise ConfigError(f"pp and virtual stages must be >= 1, got pp={self.pp}, v={self.v}")
        if self.n_layer % (self.pp * self.v):
            raise ConfigError(
                f"n_layer={self.n_layer} is not divisible by pp x virtual stages = {self.pp} x {self.v}: "
                f"use an n_layer that is a multiple of {self.pp * self.v}"
            )

    @property
    def per_stage(self) -> int:
        return self.n_layer // (self.pp * self.v)

    def layers(self, rank: int, chunk: int = 0) -> range:
        """Global layer indices of model stage chunk·pp + rank."""
        k = chunk * self.pp + rank
        return range(k * self.per_stage, (k + 1) * self.per_stage)

    def owned(self, rank: int) -> list[int]:
        """Every global layer of `rank`, chunk by chunk: local block j is global layer owned[j]."""
        return [i for c in range(self.v) for i in self.layers(rank, c)]

    def stage(self, rank: int, chunk: int = 0) -> Stage:
        """What `rank` runs for its chunk `chunk` (model stage chunk·pp + rank): its blocks as
        (global layer, local unit), and whether it is the model's first or last stage."""
        local = {layer: j for j, layer in enumerate(self.owned(rank))}
        k = chunk * self.pp + rank
        blocks = tuple((layer, Unit(local[layer])) for layer in self.layers(rank, chunk))
        return Stage(blocks, first=k == 0, last=k == self.pp * self.v - 1)

    def is_first(self, rank: int) -> bool:
        return rank == 0

    def is_last(self, rank: int) -> bool:
        return rank == self.pp - 1

    def holds_tied(self, rank: int) -> bool:
        """Whether `rank` holds one of the tied embedding's two copies (wte on the first rank,
        the LM head on the last), whose gradients are summed: only with pp > 1."""
        return self.pp > 1 and (self.is_first(rank) or self.is_last(rank))


def stage_tree(full: GPT, layout: StageLayout, rank: int) -> GPT:
    """The part of a whole-model tree (params, grads or specs) that pipeline rank `rank` holds."""
    first, last, tied = layout.is_first(rank), layout.is_last(rank), is_tied(full)
    return GPT(blocks=tuple(full.blocks[i] for i in layout.owned(rank)),
               **{name: getattr(full, name) if outer_held(name, first, last, tied) else None
                  for name in outer_parts()})


def gather_stages(mine: GPT, shapes: GPT, layout: StageLayout, mesh: Mesh, dtype: Any) -> GPT:
    """The whole model's tree on every pp rank, from each rank's `stage_tree` part (leaves
    whole over dp and tp, global `shapes`): each leaf is broadcast along pp from the rank
    that owns it (buffer-based and counted; a one-off for tests and export, not a hot path)."""
    rank = mesh.index("pp")
    held = dict(zip(layout.owned(rank), mine.blocks))
    owner = {layer: r for r in range(layout.pp) for layer in layout.owned(r)}

    def from_rank(src: int, tree: Any, shape_tree: Any) -> Any:
        if rank != src:
            tree = tree_map(lambda s: np.empty(s, dtype=dtype), shape_tree)
        return tree_map(lambda x: broadcast(np.ascontiguousarray(x), mesh, "pp", root=src), tree)

    def outer_owner(name: str) -> int:  # the first stage where it is held there, else the last
        return 0 if outer_held(name, True, False, is_tied(shapes)) else layout.pp - 1

    return GPT(blocks=tuple(from_rank(owner[i], held.get(i), shapes.blocks[i]) for i in range(layout.n_layer)),
               **{name: from_rank(outer_owner(name), getattr(mine, name), getattr(shapes, name))
                  for name in outer_parts()})
