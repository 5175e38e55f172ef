"""Gradient sync over dp (and cp) on a flat layout: the strategies behind ZeRO stages 0-3.

Every strategy takes each unit's gradient as it becomes final (`grads_ready`), starts its
collective at once so it runs during the rest of backward (unless `overlap` is off), and
after `wait()` serves this rank's reduced gradient per unit (`grad`): the whole unit when
the optimiser state is replicated (stage 0), this rank's 1/dp of it when it is sharded.

| strategy | stages | gradient buffer | collective |
|---|---|---|---|
| `AllReduceSync` | 0 | full | all-reduce of contiguous buckets of ready units |
| `ScatterIntoFullSync` | 1 | full | reduce-scatter of each unit after its last micro-batch, into the full buffer |
| `ScatterToShardSync` | 2, 3 | 1/dp | reduce-scatter of every micro-batch's gradient, summed into the shard |

Stage 1 keeps the full gradient buffer (the ZeRO paper's Pos shards only the moments), so
its memory and bytes moved per step are those of plain DP; the tests check both.

Context parallelism: parameters are replicated over cp and each cp rank's gradient is
its tokens' share, so gradients are summed over cp as over dp. Stage 0 all-reduces over
dp×cp jointly (one collective per bucket, the same ring algorithm over dp·cp ranks, as
Megatron's data-parallel group includes cp). Stages 1-3 keep their dp shards (the
optimiser state is sharded over dp only, so cp ranks stay exact replicas of each other)
and first all-reduce the gradient over cp, then reduce-scatter it over dp: one extra
all-reduce on the (small, usually intra-node) cp group, but no second layout sharded
over dp·cp to keep in step with checkpoints and ZeRO-3's parameter gathers.

Expert parallelism: the sync is over dp (and cp) only, for every leaf. The ep ranks of one
dp index hold other experts, so their buffers are not replicas and no collective here can
span ep; the leaves replicated over ep (all but the experts) are summed over ep afterwards
by `ZeroOptimizer.wait`, on the values each rank holds after this reduction.
"""

from __future__ import annotations

from typing import Any, Hashable, Protocol

import numpy as np

from numesh.base.tree import Tree, flatten, tree_leaves, unflatten
from numesh.host.threads import add_into, copy_into
from numesh.mesh import Handle, Mesh, ipsum, ipsum_scatter, psum
from numesh.optim.flat import FlatLayout


class GradSync(Protocol):
    """Takes unit gradients during backward; serves this rank's reduced part of each."""

    nbytes: int  # bytes of gradient buffer held between steps
    sharded: bool  # whether `grad` is this rank's 1/dp of the unit (else the whole unit)

    def begin_step(self, n_micro: int) -> None: ...

    def grads_ready(self, key: Hashable, grads: Tree, count: int = 1) -> None: ...

    def slot(self, key: Hashable) -> Tree | None: ...

    def wait(self) -> None: ...

    def grad(self, key: Hashable) -> np.ndarray: ...


class _Sync:
    """What every strategy shares: the collectives in flight and the step's counters."""

    sharded = True

    def __init__(self, layout: FlatLayout, mesh: Mesh, overlap: bool, buffer: np.ndarray):
        self.layout, self.mesh, self.overlap = layout, mesh, overlap
        self.buffer = buffer
        self.nbytes = buffer.nbytes
        self.pending: list[tuple[Handle, Any]] = []  # (handle, unit key or None)
        self._slots: dict[Any, Tree] = {}  # each unit's views of the full buffer, made once (`slot`)
        self._slot_leaves: dict[Any, list] = {}  # and their leaves, in `tree_leaves` order
        self.begin_step(1)

    def begin_step(self, n_micro: int) -> None:
        """Start a step whose every unit will receive `n_micro` micro-batch gradients."""
        self.wait()
        self.n_micro = n_micro
        self.received = dict.fromkeys(self.layout.units, 0)
        self.reduced = dict.fromkeys(self.layout.units, 0)

    def _launch(self, handle: Handle, key: Any) -> None:
        self.pending.append((handle, key))
        if not self.overlap:
            self.wait()

    def wait(self) -> None:
        """Complete every gradient collective in flight."""
        for handle, key in self.pending:
            result = handle.wait()
            if key is not None:
                self._land(key, result)
                self.reduced[key] += 1
        self.pending = []

    def _land(self, key: Any, result: np.ndarray) -> None:
        """Put a finished reduce-scatter's shard of unit `key` in place."""
        raise NotImplementedError

    def slot(self, key: Any) -> Tree | None:
        """Where unit `key`'s gradient may be written so that `grads_ready` need not copy it:
        a tree of views of its place in the buffer, shaped like the unit (the same tree
        object every step), while the step has none of its gradient yet; else None. Only
        the strategies that keep a full buffer have one (stages 0 and 1)."""
        if self.received[key]:
            return None
        if key not in self._slots:
            u = self.layout.units[key]
            self._slots[key] = unflatten(self.buffer[u.real], u.template)
            self._slot_leaves[key] = tree_leaves(self._slots[key])
        return self._slots[key]

    def _accumulate(self, key: Any, grads: Tree, count: int) -> bool:
        """Sum `grads` into the full buffer; True once all the step's micro-batches are in.
        A gradient written into the unit's `slot` is in place already: nothing to copy,
        whether the whole tree is the slot or only some of its leaves are the slot's."""
        first = self.received[key] == 0
        leaves = tree_leaves(grads)  # `flatten`'s order
        placed = self._slot_leaves.get(key, ())
        in_place = [j < len(placed) and leaf is placed[j] for j, leaf in enumerate(leaves)]
        if not first and any(in_place):
            raise ValueError(f"unit {key!r}: a later micro-batch's gradient was written into the unit's slot, "
                             "which holds the sum so far: ask `slot` before each one")
        view = self.buffer[self.layout.units[key].real]
        into = copy_into if first else add_into
        i = 0
        for leaf, done in zip(leaves, in_place):  # large leaves over the threads
            arr = np.asarray(leaf)
            if not done:
                into(view[i:i + arr.size], arr.reshape(-1))
            i += arr.size
        if i != view.size:
            raise ValueError(f"unit {key!r}: the gradient has {i} values, its buffer {view.size}")
        self.received[key] += count
        return self.received[key] == self.n_micro


class AllReduceSync(_Sync):
    """ZeRO 0: full gradients, all-reduced in buckets of ready units in layout order.

    A bucket is a contiguous span of at least `bucket_bytes` (or the rest), so a few large
    all-reduces replace one per unit and the first starts while backward still runs."""

    sharded = False

    def __init__(self, layout: FlatLayout, mesh: Mesh, dtype: Any, overlap: bool, bucket_bytes: int):
        self.bucket_bytes = bucket_bytes
        self.order = list(layout.units)
        self.axes = ("dp", "cp") if mesh.size("cp") > 1 else "dp"  # one all-reduce over both
        super().__init__(layout, mesh, overlap, np.zeros(layout.total, dtype=dtype))

    def begin_step(self, n_micro: int) -> None:
        super().begin_step(n_micro)
        self.ready: set[Any] = set()
        self.next_ready = 0  # units before it are in a bucket already
        self.bucket: list[Any] = []

    def grads_ready(self, key: Any, grads: Tree, count: int = 1) -> None:
        if self._accumulate(key, grads, count):
            self.ready.add(key)
            self._fill_buckets()

    def _fill_buckets(self) -> None:
        """Move ready units, in layout order, into the bucket; launch it when it is full."""
        units = self.layout.units
        while self.next_ready < len(self.order) and self.order[self.next_ready] in self.ready:
            self.bucket.append(self.order[self.next_ready])
            self.next_ready += 1
            nbytes = sum(units[k].padded for k in self.bucket) * self.buffer.itemsize
            if nbytes >= self.bucket_bytes or self.next_ready == len(self.order):
                span = slice(units[self.bucket[0]].start, units[self.bucket[-1]].full.stop)
                self.bucket = []
                self._launch(ipsum(self.buffer[span], self.mesh, self.axes), None)

    def grad(self, key: Any) -> np.ndarray:
        return self.buffer[self.layout.units[key].full]


class ScatterIntoFullSync(_Sync):
    """ZeRO 1: full gradients summed over micro-batches, then each unit reduce-scattered
    once; this rank's reduced shard goes back into its place in the full buffer."""

    def __init__(self, layout: FlatLayout, mesh: Mesh, dtype: Any, overlap: bool):
        super().__init__(layout, mesh, overlap, np.zeros(layout.total, dtype=dtype))

    def grads_ready(self, key: Any, grads: Tree, count: int = 1) -> None:
        if self._accumulate(key, grads, count):
            full = psum(self.buffer[self.layout.units[key].full], self.mesh, "cp", inplace=True)
            self._launch(ipsum_scatter(full, self.mesh, "dp"), key)

    def _land(self, key: Any, result: np.ndarray) -> None:
        self.buffer[self.layout.mine(key)] = result

    def grad(self, key: Any) -> np.ndarray:
        return self.buffer[self.layout.mine(key)]


class ScatterToShardSync(_Sync):
    """ZeRO 2/3: only this rank's 1/dp of the gradients is kept. With no full buffer to
    accumulate into, every micro-batch's gradient is reduce-scattered and summed into the
    shard (m times the reduce-scatter bytes of stage 1 for m micro-batches)."""

    def __init__(self, layout: FlatLayout, mesh: Mesh, dtype: Any, overlap: bool):
        super().__init__(layout, mesh, overlap, np.zeros(layout.shard_total, dtype=dtype))

    def grads_ready(self, key: Any, grads: Tree, count: int = 1) -> None:
        u = self.layout.units[key]
        if self.received[key]:
            self.wait()  # at most one micro-batch of transient gradient buffers in flight
        self.received[key] += count
        buf = np.zeros(u.padded, dtype=self.buffer.dtype)
        flatten(grads, out=buf[: u.size])
        self._launch(ipsum_scatter(psum(buf, self.mesh, "cp", inplace=True), self.mesh, "dp"), key)

    def slot(self, key: Any) -> Tree | None:
        """None: this strategy keeps no full buffer to write a unit's gradient into."""
        return None

    def _land(self, key: Any, result: np.ndarray) -> None:
        shard = self.buffer[self.layout.units[key].shard]
        if self.reduced[key] == 0:
            shard[...] = result
        else:
            shard += result

    def grad(self, key: Any) -> np.ndarray:
        return self.buffer[self.layout.units[key].shard]


def make_grad_sync(stage: int, layout: FlatLayout, mesh: Mesh, dtype: Any, overlap: bool,
                   bucket_bytes: int) -> GradSync:
    """The strategy for ZeRO `stage`."""
    if stage == 0:
        return AllReduceSync(layout, mesh, dtype, overlap, bucket_bytes)
    if stage == 1:
        return ScatterIntoFullSync(layout, mesh, dtype, overlap)
    return ScatterToShardSync(layout, mesh, dtype, overlap)
