"""Data-parallel gradient sync and ZeRO stages 0-3 on flat, per-unit buffers.

The parameters of each unit (a transformer block, or the "outer" embedding/final-norm
group) form one contiguous stretch of a flat buffer, padded to a multiple of dp; dp rank
r owns the r-th 1/dp of every unit. Units sit in the order backward finishes them, so
a bucket of ready units is a contiguous range and its reduction starts during backward.

| stage | parameters | gradients | AdamW moments | gradient collective |
|---|---|---|---|---|
| 0 | full | full | full | all-reduce (bucketed) |
| 1 | full | full | 1/dp | reduce-scatter, then all-gather of updated params |
| 2 | full | 1/dp | 1/dp | reduce-scatter, then all-gather of updated params |
| 3 | 1/dp | 1/dp | 1/dp | reduce-scatter; params all-gathered per unit for forward and again for backward |
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np

from numesh.mesh import Handle, Mesh, all_gather_inplace, ipsum, ipsum_scatter, pmax, psum_scalar
from numesh.optim.clip import counted_once
from numesh.nn.gpt import GPT
from numesh.nn.units import join_units, split_units, unit_order
from numesh.optim.adamw import AdamWConfig, AdamWState, adamw_step, decays
from numesh.tree import flatten, tree_leaves, tree_map, tree_map_with_path, unflatten
from numesh.errors import ReplicaError


@attrs.frozen
class Unit:
    name: Any  # a numesh.nn.units.Unit
    template: Any  # tree of local shapes (memoryless placeholder arrays) used to rebuild views
    start: int  # offset in the full flat buffer
    size: int  # real elements
    padded: int  # size rounded up to a multiple of dp
    shard_start: int  # offset of this unit's shard in the shard buffers

    def shard_size(self, dp: int) -> int:
        return self.padded // dp


class ZeroOptimizer:
    """Holds this rank's parameters, gradients and AdamW state for a ZeRO `stage` over dp,
    and serves them to the model loop (it is a `ParamUnits`)."""

    def __init__(
        self,
        params: GPT,
        specs: GPT,
        mesh: Mesh,
        stage: int = 0,
        adamw: AdamWConfig = AdamWConfig(),
        bucket_bytes: int = 1 << 20,
        overlap: bool = True,
        uncounted: tuple[str, ...] = (),
    ):
        """`uncounted`: unit-relative leaf paths (e.g. "outer.wte" on the last pipeline
        stage, whose tied copy is counted on the first) left out of the gradient norm."""
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
        self.mesh, self.stage, self.adamw = mesh, stage, adamw
        self.bucket_bytes, self.overlap = bucket_bytes, overlap
        self.dp, self.r = mesh.size("dp"), mesh.index("dp")
        self.n_layer = len(params.blocks)
        dtype = self.dtype = tree_leaves(params)[0].dtype
        trees = split_units(params)
        spec_units = split_units(specs)
        self.units: dict[str, Unit] = {}
        start = shard_start = 0
        for name in unit_order(self.n_layer):
            size = sum(x.size for x in tree_leaves(trees[name]))
            padded = -(-size // self.dp) * self.dp
            shapes = tree_map(_placeholder, trees[name])  # not the arrays: they would stay alive
            self.units[name] = Unit(name, shapes, start, size, padded, shard_start)
            start += padded
            shard_start += padded // self.dp
        self.total, self.shard_total = start, shard_start
        full_init = np.zeros(self.total, dtype=dtype)
        for name, u in self.units.items():
            flatten(trees[name], out=full_init[u.start : u.start + u.size])
        # flat masks in the full layout (bool: a byte per value, not a float): weight decay,
        # and "this rank counts it" for the norm
        decay = np.zeros(self.total, dtype=bool)
        counted = np.zeros(self.total, dtype=bool)
        for name, u in self.units.items():
            d_tree = tree_map_with_path(lambda p, x: np.full(x.shape, decays(p, x)), trees[name])
            c_tree = tree_map_with_path(
                lambda path, x, s, unit=name: np.full(x.shape, counted_once(s, mesh) and f"{unit}.{path}" not in uncounted),
                trees[name], spec_units[name],
            )
            flatten(d_tree, out=decay[u.start : u.start + u.size])
            flatten(c_tree, out=counted[u.start : u.start + u.size])
        self.specs = specs
        if stage < 3:
            self.flat = full_init
            self.views = {name: unflatten(self.flat[u.start : u.start + u.size], u.template) for name, u in self.units.items()}
        else:
            self.param_shard = self._take_shard(full_init)
            self.gathered: dict[str, Any] = {}
        self.grad_full = np.zeros(self.total, dtype=dtype) if stage <= 1 else None
        self.grad_shard = np.zeros(self.shard_total, dtype=dtype) if stage >= 2 else None
        if stage == 0:
            self.decay, self.counted = decay, counted
            self.opt = AdamWState(np.zeros(self.total, dtype), np.zeros(self.total, dtype))
        else:
            self.decay, self.counted = self._take_shard(decay), self._take_shard(counted)
            self.opt = AdamWState(np.zeros(self.shard_total, dtype), np.zeros(self.shard_total, dtype))
        self.scratch = np.empty_like(self.opt.m)
        self._norm_runs: list[list[tuple[int, int]]] | None = None
        self.pending: list[tuple[Handle, Any]] = []
        self.bucket: list[Unit] = []
        self.begin_step(1)

    # ------------------------------------------------------------------ layout helpers

    def _mine(self, u: Unit) -> slice:
        """This rank's shard of unit `u` in the full layout."""
        s = u.shard_size(self.dp)
        return slice(u.start + self.r * s, u.start + (self.r + 1) * s)

    def _shard_slice(self, u: Unit) -> slice:
        return slice(u.shard_start, u.shard_start + u.shard_size(self.dp))

    def _take_shard(self, full: np.ndarray) -> np.ndarray:
        out = np.empty(self.shard_total, dtype=full.dtype)
        for u in self.units.values():
            out[self._shard_slice(u)] = full[self._mine(u)]
        return out

    # ------------------------------------------------------------------ ParamUnits

    def get(self, unit: str) -> Any:
        if self.stage < 3:
            return self.views[unit]
        if unit not in self.gathered:
            u = self.units[unit]
            buf = np.empty(u.padded, dtype=self.param_shard.dtype)
            s = u.shard_size(self.dp)
            buf[self.r * s : (self.r + 1) * s] = self.param_shard[self._shard_slice(u)]
            all_gather_inplace(buf, self.mesh, "dp")
            self.gathered[unit] = unflatten(buf[: u.size], u.template)
        return self.gathered[unit]

    def release(self, unit: str) -> None:
        if self.stage == 3:
            self.gathered.pop(unit, None)

    def grads_ready(self, unit: str, grads: Any, count: int = 1) -> None:
        """Accumulate the gradient of `unit` from `count` micro-batches; reduce once all have
        arrived (stages 0/1), or reduce-scatter each one into the shard (stages 2/3)."""
        u = self.units[unit]
        first = self.received[unit] == 0
        self.received[unit] += count
        if self.stage <= 1:
            view = self.grad_full[u.start : u.start + u.size]
            if first:
                flatten(grads, out=view)
            else:
                view += flatten(grads, dtype=view.dtype)
            if self.received[unit] == self.n_micro:
                if self.stage == 0:
                    self._bucket_add(u)
                else:
                    self._launch_scatter(u, self.grad_full[u.start : u.start + u.padded])
        else:
            if not first:
                self.wait()  # at most one micro-batch of transient gradient buffers in flight
            buf = np.zeros(u.padded, dtype=self.grad_shard.dtype)
            flatten(grads, out=buf[: u.size])
            self._launch_scatter(u, buf)

    # ------------------------------------------------------------------ gradient sync

    def _bucket_add(self, u: Unit) -> None:
        """Mark `u` reduced-ready; all-reduce the ready units in layout order, a bucket
        (a contiguous span of at least `bucket_bytes`, or the rest) at a time."""
        self.ready.add(u.name)
        order = list(self.units.values())
        while self.next_ready < len(order) and order[self.next_ready].name in self.ready:
            self.bucket.append(order[self.next_ready])
            self.next_ready += 1
            nbytes = sum(b.padded for b in self.bucket) * self.grad_full.itemsize
            if nbytes >= self.bucket_bytes or self.next_ready == len(order):
                first, last = self.bucket[0], self.bucket[-1]
                span = self.grad_full[first.start : last.start + last.padded]
                self.pending.append((ipsum(span, self.mesh, "dp"), None))
                self.bucket = []
                if not self.overlap:
                    self.wait()

    def _launch_scatter(self, u: Unit, buf: np.ndarray) -> None:
        self.pending.append((ipsum_scatter(buf, self.mesh, "dp"), u))
        if not self.overlap:
            self.wait()

    def wait(self) -> None:
        """Complete every gradient collective in flight."""
        for handle, u in self.pending:
            result = handle.wait()
            if u is None:
                continue
            if self.stage == 1:  # the reduced shard goes back into its place in the full buffer
                self.grad_full[self._mine(u)] = result
            elif self.reduced[u.name] == 0:
                self.grad_shard[self._shard_slice(u)] = result
            else:
                self.grad_shard[self._shard_slice(u)] += result
            self.reduced[u.name] += 1
        self.pending = []

    def begin_step(self, n_micro: int) -> None:
        """Start a step whose every unit will receive `n_micro` micro-batch gradients."""
        self.wait()
        self.n_micro = n_micro
        self.received = dict.fromkeys(self.units, 0)
        self.reduced = dict.fromkeys(self.units, 0)
        self.ready: set[str] = set()
        self.next_ready = 0

    # ------------------------------------------------------------------ the step

    def _grad_views(self) -> list[tuple[np.ndarray, slice, slice]]:
        """(gradient, where it sits in the full layout, where it sits in the moments) per unit."""
        out = []
        for u in self.units.values():
            if self.stage == 0:
                span = slice(u.start, u.start + u.padded)
                out.append((self.grad_full[span], span, span))
            elif self.stage == 1:
                out.append((self.grad_full[self._mine(u)], self._mine(u), self._shard_slice(u)))
            else:
                out.append((self.grad_shard[self._shard_slice(u)], self._mine(u), self._shard_slice(u)))
        return out

    def global_norm(self) -> float:
        """Norm of the whole model's gradient: each value counted once across the mesh."""
        self.wait()
        views = self._grad_views()
        if self._norm_runs is None:
            self._norm_runs = [_true_runs(self.counted[opt_slice]) for _, _, opt_slice in views]
        total = 0.0
        for (g, _, _), runs in zip(views, self._norm_runs):
            for a, b in runs:  # a few contiguous runs per unit: no masked copy of g
                total += float(np.dot(g[a:b], g[a:b]))
        axes = [a for a in ("pp", "tp") if self.mesh.shape[a] > 1]
        if self.stage >= 1 and self.dp > 1:
            axes.append("dp")
        if axes:
            total = psum_scalar(total, self.mesh, tuple(axes))
        return math.sqrt(total)

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """AdamW on this rank's part of the state, then share updated parameters if sharded."""
        self.wait()
        t = self.opt.step
        for g, full_slice, opt_slice in self._grad_views():
            if grad_scale != 1.0:
                g *= grad_scale
            if self.stage == 3:
                p = self.param_shard[opt_slice]
            else:
                p = self.flat[full_slice]
            state = AdamWState(self.opt.m[opt_slice], self.opt.v[opt_slice], t)
            adamw_step(p, g, state, lr, self.adamw, self.decay[opt_slice], self.scratch[opt_slice])
        self.opt.step = t + 1
        if self.stage in (1, 2):
            for u in self.units.values():
                all_gather_inplace(self.flat[u.start : u.start + u.padded], self.mesh, "dp")

    # ------------------------------------------------------------------ inspection

    def local_params(self) -> GPT:
        """This rank's tp/pp-local parameter tree (gathered over dp for stage 3)."""
        if self.stage < 3:
            return join_units(self.views)
        trees = {}
        for name in self.units:
            trees[name] = tree_map(np.copy, self.get(name))
            self.release(name)
        return join_units(trees)

    def _full_layout(self, flat_or_shard: np.ndarray, sharded: bool) -> np.ndarray:
        """A full-layout copy of a buffer, gathered over dp when it is sharded."""
        if not sharded:
            return flat_or_shard.copy()
        full = np.zeros(self.total, dtype=flat_or_shard.dtype)
        for u in self.units.values():
            full[self._mine(u)] = flat_or_shard[self._shard_slice(u)]
            all_gather_inplace(full[u.start : u.start + u.padded], self.mesh, "dp")
        return full

    def _trees(self, full: np.ndarray) -> GPT:
        return join_units({n: unflatten(full[u.start : u.start + u.size], u.template) for n, u in self.units.items()})

    def state_trees(self) -> dict[str, GPT]:
        """Parameters and both AdamW moments as trees of this rank's tp-local leaves,
        whole over dp (a collective over dp when the stage shards them)."""
        params = self.flat if self.stage < 3 else self.param_shard
        return {
            "params": self._trees(self._full_layout(params, self.stage == 3)),
            "m": self._trees(self._full_layout(self.opt.m, self.stage >= 1)),
            "v": self._trees(self._full_layout(self.opt.v, self.stage >= 1)),
        }

    def load_state_trees(self, trees: dict[str, GPT], step: int) -> None:
        """Set parameters, moments and step count from tp-local trees (as `state_trees` gives)."""
        for key in ("params", "m", "v"):
            full = np.zeros(self.total, dtype=self.opt.m.dtype)
            units = split_units(trees[key])
            for name, u in self.units.items():
                flatten(units[name], out=full[u.start : u.start + u.size])
            sharded = self.stage == 3 if key == "params" else self.stage >= 1
            target = {"params": self.flat if self.stage < 3 else self.param_shard, "m": self.opt.m, "v": self.opt.v}[key]
            target[...] = self._take_shard(full) if sharded else full
        self.opt.step = step

    def memory(self) -> dict[str, int]:
        """Bytes of the buffers this rank holds between steps: parameters, gradients and
        optimiser state (the ZeRO paper's three), and the workspace beside them (AdamW's
        scratch, one optimiser-state shard; the weight-decay and norm masks, a byte per value each)."""
        params = self.flat.nbytes if self.stage < 3 else self.param_shard.nbytes
        grads = self.grad_full.nbytes if self.grad_full is not None else self.grad_shard.nbytes
        return {
            "params": params,
            "grads": grads,
            "optimizer": self.opt.m.nbytes + self.opt.v.nbytes,
            "workspace": self.scratch.nbytes + self.decay.nbytes + self.counted.nbytes,
        }

    def check_replicas(self) -> None:
        """Raise ReplicaError if copies that must be identical differ (over dp, and over tp
        for tp-replicated leaves). Cheap: two checksums per unit, one all-reduce."""
        sums = []
        for name, u in self.units.items():
            x = self.flat[u.start : u.start + u.size] if self.stage < 3 else self.param_shard[self._shard_slice(u)]
            sums.append(_checksums(x))
        local = np.concatenate(sums)
        axes = ["dp"] if self.stage < 3 else []
        self._compare(local, axes, list(self.units))
        # tp-replicated leaves must also agree across tp
        if self.mesh.shape["tp"] > 1:
            leaves = []
            for name in self.units:
                tree = self.get(name)
                spec_tree = split_units(self.specs)[name]
                leaves += [
                    _checksums(x.reshape(-1))
                    for x, s in zip(tree_leaves(tree), tree_leaves(spec_tree))
                    if "tp" not in s.axes()
                ]
                self.release(name)
            if leaves:
                self._compare(np.concatenate(leaves), ["tp"], ["tp-replicated leaves"])

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


def _placeholder(x: np.ndarray) -> np.ndarray:
    """An array of `x`'s shape and dtype that holds no memory (every element one value)."""
    return np.broadcast_to(np.zeros((), dtype=x.dtype), x.shape)


def _checksums(x: np.ndarray) -> np.ndarray:
    """Sum and a position-weighted sum, in float64, so a permutation also shows."""
    x = x.astype(np.float64, copy=False)
    return np.array([x.sum(), np.dot(x, np.arange(1, x.size + 1, dtype=np.float64) % 97.0)])


def memory_formula(psi: int, dp: int, stage: int, itemsize: int = 4) -> dict[str, float]:
    """The ZeRO paper's bytes per rank for single-precision AdamW over Ψ parameters:
    params 4Ψ, grads 4Ψ, moments 8Ψ, each divided by N = dp where the stage shards it."""
    k = itemsize
    return {
        "params": k * psi / (dp if stage >= 3 else 1),
        "grads": k * psi / (dp if stage >= 2 else 1),
        "optimizer": 2 * k * psi / (dp if stage >= 1 else 1),
    }

