"""Data-parallel gradient sync and ZeRO stages 0-3: a thin driver over flat buffers.

The caller gives the parameters as an ordered mapping of units (opaque keys, each a tree;
the order backward finishes them). `FlatLayout` places each unit in a flat buffer padded
to a multiple of dp; a `GradSync` strategy reduces the gradients; a `Residency` holds the
parameters; AdamW updates this rank's part. The stage picks the strategy and the
residency once; nothing below asks for it again.

| stage | parameters | gradients | AdamW moments | gradient collective |
|---|---|---|---|---|
| 0 | full | full | full | all-reduce (bucketed) |
| 1 | full | full | 1/dp | reduce-scatter, then all-gather of updated params |
| 2 | full | 1/dp | 1/dp | reduce-scatter, then all-gather of updated params |
| 3 | 1/dp | 1/dp | 1/dp | reduce-scatter; params all-gathered per unit for forward and again for backward |

Expert parallelism (ep): ep is data parallelism for every leaf but the MoE experts, which
it splits (their specs name "ep"). A leaf replicated over ep gets each ep rank's tokens'
share of its gradient, so it must be summed over dp×ep×cp; an expert leaf only over dp×cp
(the token all-to-all already brought every token of the ep group to its expert). The dp
(and cp) reduction and the ZeRO shards stay over dp alone for every leaf, as with cp: the
ep ranks of one dp index then hold one layout (each holds E/ep experts, so equal sizes)
and the replicated leaves stay exact copies over ep; `wait` adds one all-reduce over ep of
the replicated leaves' values this rank holds (its dp shard of them under ZeRO >= 1), once
per step, as it does over tp for the tp-partial LayerNorm gradients under sp. No second
layout sharded over dp·ep has to be kept in step with checkpoints and ZeRO-3's gathers.
"""

from __future__ import annotations

import math
from typing import Collection, Generic, Hashable, Mapping, TypeVar

import numpy as np

from numesh.base.errors import ReplicaError
from numesh.base.tree import Tree, tree_leaves, tree_map, tree_map_with_path
from numesh.mesh import Mesh, pmax, psum, psum_scalar
from numesh.optim.adamw import AdamWConfig, AdamWState, adamw_step, decays
from numesh.optim.clip import counted_once
from numesh.optim.flat import FlatLayout, Span
from numesh.optim.grad_sync import make_grad_sync
from numesh.optim.residency import gather_full, make_residency

K = TypeVar("K", bound=Hashable)


class ZeroOptimizer(Generic[K]):
    """This rank's parameters, gradients and AdamW state for a ZeRO `stage` over dp,
    served unit by unit to the model loop (it is a `ParamUnits`)."""

    def __init__(
        self,
        units: Mapping[K, Tree],
        specs: Mapping[K, Tree],
        mesh: Mesh,
        stage: int = 0,
        adamw: AdamWConfig = AdamWConfig(),
        bucket_bytes: int = 1 << 20,
        overlap: bool = True,
        uncounted: Collection[tuple[K, str]] = (),
        tp_partial: Collection[tuple[K, str]] = (),
    ):
        """`units`: this rank's tp/pp-local parameter trees, in the order backward finishes
        them; `specs`: their partition specs. `uncounted`: (unit, leaf path in the unit)
        pairs left out of the gradient norm (the last pipeline stage's tied wte, whose
        copy is counted on the first). `tp_partial`: (unit, leaf path) pairs whose
        gradients are partial sums over tp (the LayerNorms under sequence parallelism):
        `wait` sums them over tp once per step, after the dp reduction, so the norm and the
        update see whole, tp-replicated gradients. With ep > 1, the leaves whose spec does not
        name "ep" (all but the experts) are summed over ep the same way (module docstring)."""
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
        self.mesh, self.stage, self.adamw = mesh, stage, adamw
        self.specs = dict(specs)
        self.layout: FlatLayout[K] = FlatLayout(units, mesh.size("dp"), mesh.index("dp"))
        self.dtype = next(x for t in units.values() for x in tree_leaves(t)).dtype
        full = self.layout.flatten(units, self.dtype)
        decay, counted = self._masks(units, frozenset(uncounted))
        partial = {"tp": self.layout.leaf_mask(
            {k: tree_map_with_path(lambda path, _x, k=k: (k, path) in tp_partial, t) for k, t in units.items()})}
        if mesh.shape["ep"] > 1:  # the leaves replicated over ep: their gradients are each ep rank's tokens' share
            partial["ep"] = self.layout.leaf_mask(
                {k: tree_map(lambda _x, s: "ep" not in s.axes(), t, self.specs[k]) for k, t in units.items()})
        self.residency = make_residency(stage, self.layout, mesh, full)
        self.sync = make_grad_sync(stage, self.layout, mesh, self.dtype, overlap, bucket_bytes)
        # the optimiser state follows the gradient: whole units, or this rank's shards
        sharded = self.sync.sharded
        self.state_slices = {k: (u.shard if sharded else u.full) for k, u in self.layout.units.items()}
        part = self.layout.take_shard if sharded else (lambda x: x)
        self.decay, self.counted = part(decay), part(counted)
        # per axis, runs of values to sum over it per unit, in the gradient buffer the sync keeps
        self._partial_runs: dict[str, dict[K, list[tuple[int, int]]]] = {
            axis: {k: r for k, s in self.state_slices.items() if (r := _true_runs(part(mask)[s]))}
            for axis, mask in partial.items()}
        self._partial_pending = False
        n = self.layout.shard_total if sharded else self.layout.total
        self.adam = AdamWState(np.zeros(n, self.dtype), np.zeros(n, self.dtype))
        self.scratch = np.empty_like(self.adam.m)
        self._norm_runs: dict[K, list[tuple[int, int]]] | None = None

    def _masks(self, units: Mapping[K, Tree], uncounted: frozenset) -> tuple[np.ndarray, np.ndarray]:
        """Full-layout masks: weight decay, and "this rank counts it in the norm" (one
        copy of a tp-replicated leaf, and not the `uncounted` leaves)."""
        decay = {k: tree_map_with_path(decays, t) for k, t in units.items()}
        counted = {
            k: tree_map_with_path(
                lambda path, _x, s, k=k: counted_once(s, self.mesh) and (k, path) not in uncounted, t, self.specs[k]
            )
            for k, t in units.items()
        }
        return self.layout.leaf_mask(decay), self.layout.leaf_mask(counted)

    @property
    def units(self) -> dict[K, Span]:
        """Where each unit sits in the flat buffers (size, padded size, offsets), in layout order."""
        return self.layout.units

    @property
    def tp_partial_values(self) -> int:
        """How many gradient values `wait` all-reduces over tp each step (0 without sp)."""
        return self._partial_values("tp")

    @property
    def ep_replicated_values(self) -> int:
        """How many gradient values `wait` all-reduces over ep each step (0 when ep is 1)."""
        return self._partial_values("ep")

    def _partial_values(self, axis: str) -> int:
        return sum(b - a for runs in self._partial_runs.get(axis, {}).values() for a, b in runs)

    @property
    def adam_step(self) -> int:
        """AdamW steps taken (saved in checkpoints: bias correction depends on it)."""
        return self.adam.step

    # ------------------------------------------------------------------ ParamUnits

    def get(self, key: K) -> Tree:
        """Unit `key`'s parameters (gathered over dp under ZeRO-3)."""
        return self.residency.get(key)

    def release(self, key: K) -> None:
        """Done with unit `key` for now (ZeRO-3 frees its gathered copy)."""
        self.residency.release(key)

    def grads_ready(self, key: K, grads: Tree, count: int = 1) -> None:
        """The gradient of unit `key` summed over `count` micro-batches; its reduction
        starts once the step's micro-batches are in (stages 0/1) or at once (2/3)."""
        self.sync.grads_ready(key, grads, count)
        self._partial_pending = any(self._partial_runs.values())

    def begin_step(self, n_micro: int) -> None:
        """Start a step whose every unit will receive `n_micro` micro-batch gradients."""
        self.sync.begin_step(n_micro)

    def wait(self) -> None:
        """Complete every gradient collective in flight; then, once the step's gradients
        are all in, sum the tp-partial ones over tp and the ep-replicated ones over ep (once:
        later calls find nothing to do)."""
        self.sync.wait()
        if self._partial_pending:
            self._partial_pending = False
            for axis, runs in self._partial_runs.items():
                if runs:
                    self._sum_partial(axis, runs)

    def _sum_partial(self, axis: str, runs: Mapping[K, list[tuple[int, int]]]) -> None:
        """One all-reduce over `axis` of the gradient values in `runs` this rank holds (its
        dp shard of them under ZeRO >= 1: the tp, or ep, ranks of one dp index hold the same
        layout)."""
        pieces = [(self.sync.grad(k), a, b) for k, rs in runs.items() for a, b in rs]
        buf = psum(np.concatenate([g[a:b] for g, a, b in pieces]), self.mesh, axis, inplace=True)
        i = 0
        for g, a, b in pieces:
            g[a:b] = buf[i : i + b - a]
            i += b - a

    # ------------------------------------------------------------------ the step

    def global_norm(self) -> float:
        """Norm of the whole model's gradient: each value counted once across the mesh."""
        self.wait()
        if self._norm_runs is None:
            self._norm_runs = {k: _true_runs(self.counted[s]) for k, s in self.state_slices.items()}
        total = 0.0
        for key, runs in self._norm_runs.items():
            g = self.sync.grad(key)
            for a, b in runs:  # a few contiguous runs per unit: no masked copy of g
                total += float(np.dot(g[a:b], g[a:b]))
        axes = [a for a in ("pp", "ep", "tp") if self.mesh.shape[a] > 1]  # other leaves, or one copy of each
        if self.sync.sharded and self.layout.dp > 1:
            axes.append("dp")  # each dp rank holds a different shard of the gradient
        if axes:
            total = psum_scalar(total, self.mesh, tuple(axes))
        return math.sqrt(total)

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """AdamW on this rank's part of the state, then share updated parameters if sharded."""
        self.wait()
        t = self.adam.step
        for key, s in self.state_slices.items():
            g = self.sync.grad(key)
            if grad_scale != 1.0:
                g *= grad_scale
            state = AdamWState(self.adam.m[s], self.adam.v[s], t)
            adamw_step(self.residency.update_view(key), g, state, lr, self.adamw, self.decay[s], self.scratch[s])
        self.adam.step = t + 1
        self.residency.after_step()

    # ------------------------------------------------------------------ inspection and checkpoints

    def local_params(self) -> dict[K, Tree]:
        """This rank's tp/pp-local parameter trees by unit (gathered over dp for stage 3)."""
        return self.residency.local_trees()

    def _trees(self, buffer: np.ndarray, sharded: bool) -> dict[K, Tree]:
        """Unit trees of a full-layout copy of `buffer`, gathered over dp when it is sharded."""
        full = gather_full(self.layout, buffer, self.mesh) if sharded else buffer.copy()
        return self.layout.unflatten(full)

    def _state_buffers(self) -> dict[str, tuple[np.ndarray, bool]]:
        """(buffer, whether it is this rank's shard buffer) of the parameters and moments."""
        return {
            "params": (self.residency.buffer, self.residency.sharded),
            "m": (self.adam.m, self.sync.sharded),
            "v": (self.adam.v, self.sync.sharded),
        }

    def state_trees(self) -> dict[str, dict[K, Tree]]:
        """{"params", "m", "v"} -> {unit: tree of this rank's tp-local leaves}, whole over
        dp (a collective over dp when the stage shards them)."""
        return {name: self._trees(buf, sharded) for name, (buf, sharded) in self._state_buffers().items()}

    def load_state_trees(self, trees: Mapping[str, Mapping[K, Tree]], step: int) -> None:
        """Set parameters, moments and the AdamW step count from trees as `state_trees` gives."""
        for name, (target, sharded) in self._state_buffers().items():
            full = self.layout.flatten(trees[name], self.adam.m.dtype)
            target[...] = self.layout.take_shard(full) if sharded else full
        self.adam.step = step

    def memory(self) -> dict[str, int]:
        """Bytes of the buffers this rank holds between steps: parameters, gradients and
        optimiser state (the ZeRO paper's three), and the workspace beside them (AdamW's
        scratch, one optimiser-state shard; the weight-decay and norm masks, a byte per value each)."""
        return {
            "params": self.residency.buffer.nbytes,
            "grads": self.sync.nbytes,
            "optimizer": self.adam.m.nbytes + self.adam.v.nbytes,
            "workspace": self.scratch.nbytes + self.decay.nbytes + self.counted.nbytes,
        }

    # ------------------------------------------------------------------ replica check

    def check_replicas(self) -> None:
        """Raise ReplicaError if copies that must be identical differ (over dp, and over tp
        and ep for the leaves replicated there). Cheap: two checksums per unit, one all-reduce."""
        local = np.concatenate([_checksums(self.residency.held(k)) for k in self.layout.units])
        self._compare(local, ["cp"] if self.residency.sharded else ["dp", "cp"], [str(k) for k in self.layout.units])
        for axis in ("ep", "tp"):
            if self.mesh.shape[axis] > 1:
                self._check_replicated(axis)

    def _check_replicated(self, axis: str) -> None:
        """Leaves a spec does not split over `axis` must also agree across it."""
        leaves = []
        for key in self.layout.units:
            tree = self.get(key)
            leaves += [
                _checksums(x.reshape(-1))
                for x, s in zip(tree_leaves(tree), tree_leaves(self.specs[key]))
                if axis not in s.axes()
            ]
            self.release(key)
        if leaves:
            self._compare(np.concatenate(leaves), [axis], [f"{axis}-replicated leaves"])

    def _compare(self, local: np.ndarray, axes: list[str], names: list[str]) -> None:
        if not axes or self.mesh.size(tuple(axes)) == 1:
            return
        both = np.concatenate([local, -local])
        hi = pmax(both, self.mesh, tuple(axes))
        n = local.size
        bad = np.nonzero(hi[:n] != -hi[n:])[0]
        if bad.size:
            which = names[min(bad[0] // 2, len(names) - 1)]
            raise ReplicaError(f"replicas differ over {'x'.join(axes)} in {which}: a rank has diverged")


def _true_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) of each run of True in a 1-D bool mask."""
    edges = np.flatnonzero(np.diff(np.concatenate(([False], mask, [False])).astype(np.int8)))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def _checksums(x: np.ndarray) -> np.ndarray:
    """Sum and a position-weighted sum, in float64, so a permutation also shows."""
    x = x.astype(np.float64, copy=False)
    return np.array([x.sum(), np.dot(x, np.arange(1, x.size + 1, dtype=np.float64) % 97.0)])

