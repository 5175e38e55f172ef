"""Where the parameters live between uses: all resident (ZeRO 0-2) or sharded (ZeRO 3).

A residency serves each unit's parameter tree to the model loop (`get`/`release`), gives
the optimiser the flat values this rank updates (`update_view`), and makes every rank's
copy whole again after the step where the update was sharded (`after_step`).

Shards and gathers are over dp only, whatever cp and ep are: cp and ep ranks of one dp
index hold one layout (under ep, E/ep experts each, so the same sizes) and update their
replicated values identically, so they stay exact copies without a gather of their own.
"""

from __future__ import annotations

from typing import Any, Hashable, Protocol

import numpy as np

from numesh.base.tree import Tree, tree_map, unflatten
from numesh.mesh import Mesh, all_gather_inplace
from numesh.optim.flat import FlatLayout


class Residency(Protocol):
    """This rank's parameters, served unit by unit."""

    buffer: np.ndarray  # the full buffer, or this rank's shard buffer
    sharded: bool  # whether `buffer` is the shard buffer

    def get(self, key: Hashable) -> Tree: ...

    def release(self, key: Hashable) -> None: ...

    def update_view(self, key: Hashable) -> np.ndarray: ...

    def after_step(self) -> None: ...

    def held(self, key: Hashable) -> np.ndarray: ...

    def local_trees(self) -> dict[Any, Tree]: ...


class AllResident:
    """ZeRO 0-2: every parameter in one full buffer; the units' trees are views into it.

    With `sharded_update` (stages 1 and 2) each rank updates its 1/dp, and `after_step`
    all-gathers each unit so every rank again holds all of it: the all-gather's
    (n-1)/n·Ψ bus bytes plus the reduce-scatter's equal plain DP's all-reduce."""

    sharded = False

    def __init__(self, layout: FlatLayout, mesh: Mesh, full: np.ndarray, sharded_update: bool):
        self.layout, self.mesh, self.sharded_update = layout, mesh, sharded_update
        self.buffer = full
        self.views = layout.unflatten(full)

    def get(self, key: Any) -> Tree:
        return self.views[key]

    def release(self, key: Any) -> None:
        pass

    def update_view(self, key: Any) -> np.ndarray:
        if self.sharded_update:
            return self.buffer[self.layout.mine(key)]
        return self.buffer[self.layout.units[key].full]

    def after_step(self) -> None:
        if self.sharded_update:
            for u in self.layout.units.values():
                all_gather_inplace(self.buffer[u.full], self.mesh, "dp")

    def held(self, key: Any) -> np.ndarray:
        """The unit's real values as this rank holds them."""
        return self.buffer[self.layout.units[key].real]

    def local_trees(self) -> dict[Any, Tree]:
        """Every unit's tree (views into the buffer, no copy)."""
        return dict(self.views)


class ShardResident:
    """ZeRO 3: only this rank's 1/dp of each unit is held. `get` all-gathers a unit
    (once per forward and once per backward of each micro-batch: with the gradients'
    reduce-scatter, 1.5x plain DP's bytes); `release` frees it."""

    sharded = True

    def __init__(self, layout: FlatLayout, mesh: Mesh, full: np.ndarray):
        self.layout, self.mesh = layout, mesh
        self.buffer = layout.take_shard(full)
        self.gathered: dict[Any, Tree] = {}

    def get(self, key: Any) -> Tree:
        if key not in self.gathered:
            u = self.layout.units[key]
            buf = np.empty(u.padded, dtype=self.buffer.dtype)
            r = self.layout.rank
            buf[r * u.shard_size : (r + 1) * u.shard_size] = self.buffer[u.shard]
            all_gather_inplace(buf, self.mesh, "dp")
            self.gathered[key] = unflatten(buf[: u.size], u.template)
        return self.gathered[key]

    def release(self, key: Any) -> None:
        self.gathered.pop(key, None)

    def update_view(self, key: Any) -> np.ndarray:
        return self.buffer[self.layout.units[key].shard]

    def after_step(self) -> None:
        pass  # nothing to share: the next `get` gathers the updated shards

    def held(self, key: Any) -> np.ndarray:
        """This rank's shard of the unit."""
        return self.buffer[self.layout.units[key].shard]

    def local_trees(self) -> dict[Any, Tree]:
        """Every unit's tree, gathered over dp (a collective) into arrays of its own."""
        trees = {}
        for key in self.layout.units:
            trees[key] = tree_map(np.copy, self.get(key))
            self.release(key)
        return trees


def make_residency(stage: int, layout: FlatLayout, mesh: Mesh, full: np.ndarray) -> Residency:
    """The residency for ZeRO `stage`, starting from the parameters in full buffer `full`."""
    if stage == 3:
        return ShardResident(layout, mesh, full)
    return AllResident(layout, mesh, full, sharded_update=stage >= 1)


def gather_full(layout: FlatLayout, shard: np.ndarray, mesh: Mesh) -> np.ndarray:
    """A full buffer from every dp rank's shard buffer (a collective over dp)."""
    full = np.zeros(layout.total, dtype=shard.dtype)
    for key, u in layout.units.items():
        full[layout.mine(key)] = shard[u.shard]
        all_gather_inplace(full[u.full], mesh, "dp")
    return full
