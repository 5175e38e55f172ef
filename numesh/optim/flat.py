"""A flat layout of an ordered mapping of unit trees, and its dp shards. Pure: no MPI.

Each unit (an opaque key and a tree of arrays) is one contiguous stretch of the full
buffer, padded to a multiple of dp so that dp rank r owns the r-th 1/dp of every unit.
Units sit in the mapping's order, which callers make the order backward finishes them:
a run of ready units is then one contiguous span for a bucketed reduction. The shard
buffer (what a rank keeps under ZeRO) holds each unit's 1/dp, in the same order.
"""

from __future__ import annotations

from typing import Any, Generic, Hashable, Mapping, TypeVar

import attrs
import numpy as np

from numesh.base.padding import round_up
from numesh.base.tree import Tree, flatten, tree_leaves, tree_map, unflatten

K = TypeVar("K", bound=Hashable)


@attrs.frozen
class Span:
    """Where one unit sits in the full buffer and in the shard buffer."""

    template: Tree  # the unit's tree of shape-only placeholders, to rebuild views
    start: int  # offset in the full buffer
    size: int  # real values
    padded: int  # size rounded up to a multiple of dp
    shard_start: int  # offset of this unit's shard in the shard buffer
    shard_size: int  # padded // dp

    @property
    def real(self) -> slice:
        """The unit's real values in the full buffer."""
        return slice(self.start, self.start + self.size)

    @property
    def full(self) -> slice:
        """The unit's values and padding in the full buffer."""
        return slice(self.start, self.start + self.padded)

    @property
    def shard(self) -> slice:
        """The unit's shard in the shard buffer."""
        return slice(self.shard_start, self.shard_start + self.shard_size)


class FlatLayout(Generic[K]):
    """Offsets of every unit in the full and shard buffers, for dp rank `rank` of `dp`."""

    def __init__(self, units: Mapping[K, Tree], dp: int, rank: int):
        if not 0 <= rank < dp:
            raise ValueError(f"rank {rank} is not in 0..{dp - 1}")
        self.dp, self.rank = dp, rank
        self.units: dict[K, Span] = {}
        start = shard_start = 0
        for key, tree in units.items():
            size = sum(int(np.size(x)) for x in tree_leaves(tree))
            padded = round_up(size, dp)
            # placeholders, not the arrays: the caller's arrays would stay alive
            self.units[key] = Span(tree_map(_placeholder, tree), start, size, padded, shard_start, padded // dp)
            start += padded
            shard_start += padded // dp
        self.total, self.shard_total = start, shard_start

    def mine(self, key: K) -> slice:
        """This rank's shard of unit `key`, in the full buffer."""
        u = self.units[key]
        return slice(u.start + self.rank * u.shard_size, u.start + (self.rank + 1) * u.shard_size)

    def take_shard(self, full: np.ndarray) -> np.ndarray:
        """This rank's shard buffer cut from a full buffer (a copy)."""
        out = np.empty(self.shard_total, dtype=full.dtype)
        for key, u in self.units.items():
            out[u.shard] = full[self.mine(key)]
        return out

    def flatten(self, trees: Mapping[K, Tree], dtype: Any) -> np.ndarray:
        """A full buffer holding every unit's tree (padding zero)."""
        full = np.zeros(self.total, dtype=dtype)
        for key, u in self.units.items():
            flatten(trees[key], out=full[u.real])
        return full

    def unflatten(self, full: np.ndarray) -> dict[K, Tree]:
        """Every unit's tree as views into a full buffer (no copy)."""
        return {key: unflatten(full[u.real], u.template) for key, u in self.units.items()}

    def leaf_mask(self, flags: Mapping[K, Tree]) -> np.ndarray:
        """A bool per value of the full buffer: each leaf's flag (`flags` has a bool per
        leaf, trees shaped like the units) repeated over the leaf's values; padding False.
        Bool, not float: a byte per value."""
        mask = np.zeros(self.total, dtype=bool)
        for key, u in self.units.items():
            sizes = [x.size for x in tree_leaves(u.template)]
            mask[u.real] = np.repeat(np.array(tree_leaves(flags[key]), dtype=bool).reshape(-1), sizes)
        return mask


def _placeholder(x: np.ndarray) -> np.ndarray:
    """An array of `x`'s shape and dtype that holds no memory (every element one value)."""
    return np.broadcast_to(np.zeros((), dtype=np.asarray(x).dtype), np.shape(x))
