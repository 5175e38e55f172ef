"""Data-parallel gradient sync and ZeRO stages 0-3: a thin driver over flat buffers.

The caller gives the parameters as an ordered mapping of units (opaque keys, each a tree;
the order backward finishes them). `FlatLayout` places each unit in a flat buffer padded
to a multiple of dp; a `GradSync` strategy reduces the gradients; a `Residency` holds the
parameters; the optimiser (numesh/optim/interface.py: AdamW, Muon, ...) updates this
rank's part. The stage picks the strategy and the residency once; nothing below asks for
it again.

| stage | parameters | gradients | optimiser state | gradient collective |
|---|---|---|---|---|
| 0 | full | full | full | all-reduce (bucketed) |
| 1 | full | full | 1/dp | reduce-scatter, then all-gather of updated params |
| 2 | full | 1/dp | 1/dp | reduce-scatter, then all-gather of updated params |
| 3 | 1/dp | 1/dp | 1/dp | reduce-scatter; params all-gathered per unit for forward and again for backward |

The optimiser's state follows the gradient: the values this rank updates, each rule's
state buffers holding only the values of the leaves that rule updates (AdamW's m and v
two per value, Muon's momentum one), packed run after run. An elementwise rule runs on
this rank's runs as they lie; a matrix rule (Muon) also needs each matrix whole, which
`MatrixExchange` brings to one dp rank per matrix and back (numesh/optim/matrices.py).

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
import time
from typing import Collection, Generic, Hashable, Mapping, TypeVar

import numpy as np

from numesh.base.errors import ConfigError, ReplicaError
from numesh.base.tree import Tree, flatten, tree_leaves, tree_leaves_with_path, tree_map, tree_map_with_path
from numesh.host.kernels import float_dtype, sum_squares
from numesh.host.threads import one_hand_off, over_tiles, scale_into, worth_splitting
from numesh.mesh import Mesh, pmax, psum, psum_scalar
from numesh.optim import adamw
from numesh.optim.adamw import decays
from numesh.optim.clip import counted_once
from numesh.optim.flat import FlatLayout, Span
from numesh.optim.grad_sync import make_grad_sync
from numesh.optim.interface import Elementwise, Leaf, MatrixRule, Optimizer, fan, matrix_view
from numesh.optim.matrices import MatrixExchange, Slab, assign_owners, run_matrices
from numesh.optim.residency import gather_full, make_residency

K = TypeVar("K", bound=Hashable)


def _one_float_dtype(units: Mapping[K, Tree]) -> np.dtype:
    """The parameters' one dtype, float32 or float64 (one ConfigError line otherwise)."""
    kinds = {np.asarray(x).dtype for t in units.values() for x in tree_leaves(t)}
    if len(kinds) > 1:
        raise ConfigError(f"the parameters mix dtypes {sorted(map(str, kinds))}: give the optimiser one, "
                          f"float32 or float64")
    if not kinds:
        raise ConfigError("the optimiser was given no parameters")
    return float_dtype(kinds.pop(), "the parameters' dtype")


class ZeroOptimizer(Generic[K]):
    """This rank's parameters, gradients and optimiser state for a ZeRO `stage` over dp,
    served unit by unit to the model loop (it is a `ParamUnits`)."""

    def __init__(
        self,
        units: Mapping[K, Tree],
        specs: Mapping[K, Tree],
        mesh: Mesh,
        stage: int = 0,
        optimizer: Optimizer | None = None,
        bucket_bytes: int = 1 << 20,
        overlap: bool = True,
        uncounted: Collection[tuple[K, str]] = (),
        tp_partial: Collection[tuple[K, str]] = (),
        paths: Mapping[K, str] | None = None,
    ):
        """`units`: this rank's tp/pp-local parameter trees, in the order backward finishes
        them; `specs`: their partition specs. `optimizer`: AdamW with its defaults unless
        given. `paths`: each unit's leaves' path prefix in the model ("blocks.3.", "" for
        the outer unit; default: the key and a dot), what the optimiser chooses rules by.
        `uncounted`: (unit, leaf path in the unit)
        pairs left out of the gradient norm (the last pipeline stage's tied wte, whose
        copy is counted on the first). `tp_partial`: (unit, leaf path) pairs whose
        gradients are partial sums over tp (the LayerNorms under sequence parallelism):
        `wait` sums them over tp once per step, after the dp reduction, so the norm and the
        update see whole, tp-replicated gradients. With ep > 1, the leaves whose spec does not
        name "ep" (all but the experts) are summed over ep the same way (module docstring)."""
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
        self.mesh, self.stage = mesh, stage
        self.optimizer = optimizer if optimizer is not None else adamw.define({})
        self.specs = dict(specs)
        self.layout: FlatLayout[K] = FlatLayout(units, mesh.size("dp"), mesh.index("dp"))
        self.dtype = _one_float_dtype(units)
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
        self._place_rules(units, paths)
        n = self.layout.shard_total if sharded else self.layout.total
        self.scratch = np.empty(n, self.dtype)
        self._norm_runs: dict[K, list[tuple[int, int]]] | None = None
        self.opt_step = 0  # optimiser steps taken (saved in checkpoints: AdamW's bias correction)
        self.matrix_seconds = 0.0  # time in the matrix rules' functions (Newton–Schulz) in the last step

    def _place_rules(self, units: Mapping[K, Tree], paths: Mapping[K, str] | None) -> None:
        """Each leaf's rule; this rank's runs of values per rule and their packed state
        buffers; the matrix rules' slabs and exchanges."""
        opt, sharded = self.optimizer, self.sync.sharded
        prefix = {k: (paths[k] if paths is not None else f"{k}.") for k in units}
        self._leaf_rules = {k: tree_map_with_path(
            lambda path, x, s, k=k: opt.rule_index(Leaf(prefix[k] + path, np.shape(x), s)), t, self.specs[k])
            for k, t in units.items()}
        sizes = [0] * len(opt.rules)
        self._runs: dict[K, list[tuple[int, int, int, int]]] = {}  # (rule, start, stop, offset in its state)
        for key, u in self.layout.units.items():
            lo = self.layout.rank * u.shard_size if sharded else 0
            runs = []
            for rule, a, b in _rule_runs(self._leaf_rules[key], u):
                a, b = max(a, lo) - lo, min(b, lo + (u.shard_size if sharded else u.padded)) - lo
                if b > a:
                    runs.append((rule, a, b, sizes[rule]))
                    sizes[rule] += b - a
            self._runs[key] = runs
        self.state = {name: np.zeros(sizes[i], self.dtype) for i, r in enumerate(opt.rules) for name in r.state}
        self._exchanges = {i: MatrixExchange(self.layout, self._slabs(i, units, r), self.mesh, sharded, self.dtype)
                           for i, r in enumerate(opt.rules) if isinstance(r, MatrixRule)}

    def _slabs(self, rule: int, units: Mapping[K, Tree], r: MatrixRule) -> list[Slab]:
        """The slabs of the leaves of matrix rule `rule`, in layout order, dealt to the dp
        ranks (under ZeRO 0 too: each rank iterates on its own, `MatrixExchange.share`)."""
        tp, out = self.mesh.size("tp"), []
        for key, t in units.items():
            start = 0
            for (path, x), spec, ri in zip(tree_leaves_with_path(t), tree_leaves(self.specs[key]),
                                           tree_leaves(self._leaf_rules[key])):
                if ri == rule:
                    view = matrix_view(Leaf(path, np.shape(x), spec))
                    f = fan(view, tp)
                    cost = view.matrices_per_slab * r.flops(*f)
                    out += [Slab(key, start + j * view.size, view, f, cost) for j in range(view.batch)]
                start += int(np.size(x))
        owners = assign_owners([s.cost for s in out], self.layout.dp)
        return [Slab(s.key, s.start, s.view, s.fan, s.cost, o) for s, o in zip(out, owners)]

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
    def matrix_slabs(self) -> list[Slab]:
        """The slabs of every matrix rule, in layout order, each with its dp owner."""
        return [slab for ex in self._exchanges.values() for slab in ex.slabs]

    def rule_runs(self) -> dict[K, list[tuple[int, int, int]]]:
        """(rule, start, stop) of each run of values of one rule in each unit's full layout
        (padding is rule 0's): what the state's size depends on."""
        return {k: _rule_runs(self._leaf_rules[k], u) for k, u in self.layout.units.items()}

    # ------------------------------------------------------------------ ParamUnits

    def get(self, key: K) -> Tree:
        """Unit `key`'s parameters (gathered over dp under ZeRO-3)."""
        return self.residency.get(key)

    def release(self, key: K) -> None:
        """Done with unit `key` for now (ZeRO-3 frees its gathered copy)."""
        self.residency.release(key)

    def grad_slot(self, key: K) -> Tree | None:
        """Where the walk may write unit `key`'s next gradient so that `grads_ready` takes it
        without a copy (the gradient buffer's views, `GradSync.slot`), or None."""
        return self.sync.slot(key)

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
        # a few contiguous runs per unit (no masked copy of g), each summed whole in float64
        # lanes (no BLAS-dependent bits, no float32 overflow) on some thread, then added in order
        runs = [self.sync.grad(key)[a:b] for key, rs in self._norm_runs.items() for a, b in rs]
        total = 0.0
        big = worth_splitting(sum(r.size for r in runs))
        for part in over_tiles(lambda i: sum_squares(runs[i]), len(runs), None if big else 1):
            total += part
        axes = [a for a in ("pp", "ep", "tp") if self.mesh.shape[a] > 1]  # other leaves, or one copy of each
        if self.sync.sharded and self.layout.dp > 1:
            axes.append("dp")  # each dp rank holds a different shard of the gradient
        if axes:
            total = psum_scalar(total, self.mesh, tuple(axes))
        return math.sqrt(total)

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """The optimiser on this rank's part of the state (each rule at `lr` times its
        ratio), then share updated parameters if sharded."""
        self.wait()
        t = self.opt_step + 1
        grads = {key: self.sync.grad(key) for key in self.state_slices}
        if grad_scale != 1.0:
            for g in grads.values():
                scale_into(g, grad_scale)
        # the rules' passes over every unit in one hand-off to the threads: each reads and
        # writes its own run of the buffers only
        with one_hand_off():
            for key, s in self.state_slices.items():
                g = grads[key]
                p = self.residency.update_view(key)
                for i, a, b, c in self._runs[key]:
                    rule = self.optimizer.rules[i]
                    states = [self.state[name][c : c + b - a] for name in rule.state]
                    if isinstance(rule, Elementwise):
                        rule.step(p[a:b], g[a:b], states, lr * rule.lr_ratio, t, self.decay[s][a:b],
                                  self.scratch[s][a:b])
                    else:
                        rule.direction(g[a:b], states)
        self.matrix_seconds = 0.0
        for i, ex in self._exchanges.items():
            self._matrix_step(self.optimizer.rules[i], ex, grads, lr)
        self.opt_step = t
        self.residency.after_step()

    def _matrix_step(self, rule: MatrixRule, ex: MatrixExchange, grads: Mapping[K, np.ndarray], lr: float) -> None:
        """A matrix rule's function on each slab this rank owns, whole (the directions of
        every shard gathered over dp, and over tp), and each piece of the results applied
        where it belongs."""
        whole = ex.to_replicas(ex.gather(grads))
        t0 = time.perf_counter()
        results = {i: np.empty_like(x) for i, x in whole.items()}
        pairs = [pair for i, x in whole.items()
                 for pair in zip(ex.slabs[i].view.matrices(x), ex.slabs[i].view.matrices(results[i]))]
        run_matrices(rule, pairs)
        self.matrix_seconds += time.perf_counter() - t0
        mine = ex.from_replicas(results)
        for i, a, b, values in ex.scatter(mine):
            slab = ex.slabs[i]
            rule.apply(self.residency.update_view(slab.key)[a:b], values, lr * rule.lr_ratio, slab.fan)

    # ------------------------------------------------------------------ inspection and checkpoints

    def local_params(self) -> dict[K, Tree]:
        """This rank's tp/pp-local parameter trees by unit (gathered over dp for stage 3)."""
        return self.residency.local_trees()

    def _trees(self, buffer: np.ndarray, sharded: bool) -> dict[K, Tree]:
        """Unit trees of a full-layout copy of `buffer`, gathered over dp when it is sharded."""
        full = gather_full(self.layout, buffer, self.mesh) if sharded else buffer.copy()
        return self.layout.unflatten(full)

    def _state_buffer(self, name: str) -> np.ndarray:
        """State buffer `name` laid out like this rank's gradient slices (zero where another
        rule's values or padding lie)."""
        rule = self.optimizer.owner_of(name)
        out = np.zeros(self.scratch.size, self.dtype)
        for key, s in self.state_slices.items():
            view = out[s]
            for i, a, b, c in self._runs[key]:
                if i == rule:
                    view[a:b] = self.state[name][c : c + b - a]
        return out

    def state_trees(self) -> dict[str, dict[K, Tree]]:
        """"params" and each state name of the optimiser -> {unit: tree of this rank's
        tp-local leaves}, whole over dp (a collective over dp when the stage shards them);
        a state tree holds only its rule's leaves (None elsewhere)."""
        out = {"params": self._trees(self.residency.buffer, self.residency.sharded)}
        for name in self.optimizer.state_names:
            rule = self.optimizer.owner_of(name)
            trees = self._trees(self._state_buffer(name), self.sync.sharded)
            out[name] = {k: tree_map(lambda x, r, rule=rule: x if r == rule else None, t, self._leaf_rules[k])
                         for k, t in trees.items()}
        return out

    def load_state_trees(self, trees: Mapping[str, Mapping[K, Tree]], step: int) -> None:
        """Set parameters, optimiser state and its step count from trees as `state_trees` gives."""
        full = self._flatten(trees["params"])
        self.residency.buffer[...] = self.layout.take_shard(full) if self.residency.sharded else full
        for name in self.optimizer.state_names:
            full = self._flatten(trees[name])
            mine = self.layout.take_shard(full) if self.sync.sharded else full
            rule = self.optimizer.owner_of(name)
            for key, s in self.state_slices.items():
                for i, a, b, c in self._runs[key]:
                    if i == rule:
                        self.state[name][c : c + b - a] = mine[s][a:b]
        self.opt_step = step

    def _flatten(self, trees: Mapping[K, Tree]) -> np.ndarray:
        """A full buffer of unit trees whose leaves may be None (a state another rule holds: zero)."""
        full = np.zeros(self.layout.total, dtype=self.dtype)
        for key, u in self.layout.units.items():
            have = dict(tree_leaves_with_path(trees[key]))
            leaves = [have.get(path, np.zeros(np.shape(x))) for path, x in tree_leaves_with_path(u.template)]
            flatten(leaves, out=full[u.real])
        return full

    def memory(self) -> dict[str, int]:
        """Bytes of the buffers this rank holds between steps: parameters, gradients and
        optimiser state (the ZeRO paper's three), and the workspace beside them (the
        elementwise rules' scratch, one state-slice of values; the weight-decay and norm
        masks, a byte per value each)."""
        return {
            "params": self.residency.buffer.nbytes,
            "grads": self.sync.nbytes,
            "optimizer": sum(b.nbytes for b in self.state.values()),
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


def _rule_runs(rules: Tree, u: Span) -> list[tuple[int, int, int]]:
    """(rule, start, stop) runs of a unit's full layout from its tree of leaf rules (the
    padding after its values is rule 0's), neighbours of one rule merged."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    sizes = [int(np.size(x)) for x in tree_leaves(u.template)] + [u.padded - u.size]
    for rule, n in zip(tree_leaves(rules) + [0], sizes):
        if n and runs and runs[-1][0] == rule:
            runs[-1] = (rule, runs[-1][1], start + n)
        elif n:
            runs.append((rule, start, start + n))
        start += n
    return runs


def _true_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) of each run of True in a 1-D bool mask."""
    edges = np.flatnonzero(np.diff(np.concatenate(([False], mask, [False])).astype(np.int8)))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def _checksums(x: np.ndarray) -> np.ndarray:
    """Sum and a position-weighted sum, in float64, so a permutation also shows."""
    x = x.astype(np.float64, copy=False)
    return np.array([x.sum(), np.dot(x, np.arange(1, x.size + 1, dtype=np.float64) % 97.0)])

