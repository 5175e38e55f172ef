"""Each matrix whole on one rank: how a `MatrixRule` (Muon) runs under ZeRO and tp.

A matrix rule's function needs the whole matrix, and the whole of its accumulated
gradient: ZeRO's flat shards cut matrices anywhere, and tp splits them by rows or columns.
The leaves of a matrix rule are cut into slabs (`interface.matrix_view`: one per expert,
q, k and v of a fused leaf together, being interleaved in storage), and the slabs of a
rank's units are dealt to the dp ranks (`assign_owners`: each in turn to the least loaded
so far, by the rule's FLOPs), so no rank does all the work. Each step, after the
gradients are reduced and the elementwise `direction` (momentum) ran on each rank's shard:

1. every rank sends each owner the piece of its slabs that lies in its shard, one
   all-to-all over dp (`MatrixExchange.gather`); the owner assembles each slab whole over
   dp from the summed gradient of the step (every micro-batch's: never one alone);
2. the owner's slabs are dealt again to its replicas, the ep x cp x tp ranks that hold
   them alike, each tp rank its part, an expert's slabs only on the cp x tp ranks of its ep
   rank (`replica_owners`): the tp ranks beside a slab's computing replica (its ep and cp
   coordinates) send it their parts of a tp-split slab, one all-to-all (`to_replicas`);
   each replica computes the function on its slabs, whole, and sends every other replica
   holding the slab its tp part of each result (all of it for a slab tp does not split),
   another all-to-all (`from_replicas`). (Before, every tp, cp and ep rank computed every
   owned slab it held.)
3. the owner returns each shard's piece of the result (`scatter`), another all-to-all.

Under ZeRO 0 nothing is sharded: every rank holds every slab whole already, so step 1 moves
nothing; the slabs are still dealt to the dp ranks, each iterates on its own, and step 3 is
one all-gather over dp of the results (`share`): every rank would otherwise repeat all of
Newton–Schulz, a third of a Muon step (benchmarks/bench_optim.py measures the share).

Over ep each rank has its own experts (their slabs are its own). Pipeline stages each
handle their own units. The bytes are `numesh.perf.formulas.matrix_exchange_bytes`.
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping, Sequence

import attrs
import numpy as np

from numesh.host.threads import over_batch, threads
from numesh.mesh import Mesh, all_gather_v, all_to_all_v
from numesh.optim.flat import FlatLayout
from numesh.optim.interface import MatrixRule, MatrixView


@attrs.frozen
class Slab:
    """One contiguous slab of a matrix-rule leaf in the flat layout.

    Attributes:
        key: its unit.
        start: its first value among the unit's values.
        view: its tp-local shape, the input/output dims, the dim split over tp.
        fan: (in, out) of its whole matrices.
        cost: the rule's FLOPs for it (all its matrices).
        owner: the dp rank that computes it.
    """

    key: Any
    start: int
    view: MatrixView
    fan: tuple[int, int]
    cost: float
    owner: int = 0

    @property
    def size(self) -> int:
        return self.view.size


def assign_owners(costs: Sequence[float], ranks: int, loads: Sequence[float] | None = None) -> list[int]:
    """Owners of items of `costs`, in order: each to the rank with the least cost so far
    (the lowest such rank on a tie), starting from `loads` (default none). A pure function
    of its inputs: every rank deals alike."""
    loads = [0.0] * ranks if loads is None else list(loads)
    owners = []
    for c in costs:
        r = min(range(ranks), key=lambda i: (loads[i], i))
        owners.append(r)
        loads[r] += c
    return owners


def deal_matrices(flops: list[float], k: int) -> list[list[int]]:
    """The matrices' indices dealt to `k` threads by `assign_owners`, largest first, so a few
    big matrices do not all land on one thread."""
    order = sorted(range(len(flops)), key=lambda j: (-flops[j], j))
    bins: list[list[int]] = [[] for _ in range(k)]
    for j, owner in zip(order, assign_owners([flops[j] for j in order], k)):
        bins[owner].append(j)
    return bins


def run_matrices(rule: MatrixRule, pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """dst ← rule.matrix(src) for each (src, dst). Several matrices run side by side on
    numesh's threads, each whole on one thread, single-threaded: the default model's are
    128 rows, too small for `threads.matmul` to split, so one thread would do all of
    Newton–Schulz (benchmarks/bench_optim.py --share-only measures the share). A matrix's
    operations do not depend on the thread it runs on, so the bits do not either."""
    k = min(threads(), len(pairs))
    if k <= 1:
        for src, dst in pairs:
            dst[...] = rule.matrix(src)
        return
    bins = deal_matrices([rule.flops(src.shape[0], src.shape[1]) for src, _ in pairs], k)

    def work(r: slice) -> None:
        for b in range(r.start, r.stop):
            for j in bins[b]:
                pairs[j][1][...] = rule.matrix(pairs[j][0])

    over_batch(work, k, k)


def replica_axes(shape: Mapping[str, int]) -> tuple[str, ...]:
    """The axes over which a dp owner's matrices are held alike, each tp rank its part
    (ep: those not experts): ep, cp and tp, those of size > 1 (tp alone when none is), the
    axes of the exchange with the replica that computes a matrix."""
    return tuple(a for a in ("ep", "cp", "tp") if shape.get(a, 1) > 1) or ("tp",)


def replica_owners(costs: Sequence[float], experts: Sequence[bool], ep: int, cp: int, tp: int,
                   ep_rank: int) -> list[int]:
    """The replica (ep, cp, tp position (e·cp + c)·tp + t) that computes each of an owner's
    slabs: its experts dealt over the cp·tp replicas of its own ep rank (every ep rank deals
    its experts alike), then the other slabs over all the replicas, from those loads."""
    row = cp * tp
    ex = [i for i, e in enumerate(experts) if e]
    out = [0] * len(costs)
    loads = [0.0] * row
    for i, j in zip(ex, assign_owners([costs[i] for i in ex], row)):
        out[i] = ep_rank * row + j
        loads[j] += costs[i]
    rest = [i for i, e in enumerate(experts) if not e]
    for i, r in zip(rest, assign_owners([costs[i] for i in rest], ep * row, loads * ep)):
        out[i] = r
    return out


def pieces(start: int, size: int, shard: int, ranks: int) -> list[tuple[int, int]]:
    """[lo, hi) of a slab [start, start + size) of a unit in each rank's shard of it (the
    rank-th `shard` values; lo == hi where they do not meet)."""
    out = []
    for q in range(ranks):
        lo, hi = max(start, q * shard), min(start + size, (q + 1) * shard)
        out.append((lo, max(lo, hi)))
    return out


class MatrixExchange:
    """Moves the slabs of a rank's units between shard owners and slab owners (module docstring).

    `sharded`: whether each rank holds only its dp shard of the state (ZeRO >= 1); if not
    (ZeRO 0), every rank holds every slab whole, iterates on those it owns and gets the
    others' results by `share`. `dtype`: the state's, which a rank that owns no slab still
    receives in."""

    def __init__(self, layout: FlatLayout, slabs: Sequence[Slab], mesh: Mesh, sharded: bool, dtype=np.float64):
        self.mesh, self.slabs, self.sharded, self.dtype = mesh, list(slabs), sharded, np.dtype(dtype)
        self.dp, self.rank = layout.dp, layout.rank
        self.mine = [i for i, s in enumerate(self.slabs) if s.owner == self.rank]
        self.owned = [[i for i, s in enumerate(self.slabs) if s.owner == q] for q in range(self.dp)]
        # the owned slabs dealt again over the replicas, the ep x cp x tp ranks that hold them
        # (each tp rank its part; experts only the cp x tp of their ep rank): replica r is
        # (ep, cp, tp) = (r // (cp·tp), r // tp % cp, r % tp)
        self.rep_axes, self.tp = replica_axes(mesh.shape), mesh.size("tp")
        self.nrep, self.rep = mesh.size(self.rep_axes), mesh.index(self.rep_axes)
        self.row = mesh.size("cp") * self.tp  # the replicas of one ep rank
        mine = [self.slabs[i] for i in self.mine]
        owners = replica_owners([s.cost for s in mine], [s.view.experts for s in mine], mesh.size("ep"),
                                mesh.size("cp"), self.tp, mesh.index("ep"))
        self.rep_owner = dict(zip(self.mine, owners))
        self.computes = [i for i in self.mine if self.rep_owner[i] == self.rep]
        if not sharded:  # every slab whole here: nothing below is needed (`gather` slices, `share` gathers)
            return
        shard = {k: u.shard_size for k, u in layout.units.items()}
        self.offset = {k: self.rank * n for k, n in shard.items()}  # where this rank's slice starts in each unit
        self.cut = [pieces(s.start, s.size, shard[s.key], self.dp) for s in self.slabs]
        # this rank's pieces of every slab, in slab order: (slab, lo, hi) in unit coordinates
        self.local = [(i, *self.cut[i][self.rank]) for i in range(len(self.slabs))
                      if self.cut[i][self.rank][1] > self.cut[i][self.rank][0]]
        # values this rank sends each owner in `gather`, and receives from each rank (ints, not
        # arrays: nothing held between steps beside ZeroOptimizer.memory()'s buffers)
        self.send = [0] * self.dp
        for i, lo, hi in self.local:
            self.send[self.slabs[i].owner] += hi - lo
        self.recv = [sum(self._len(i, q) for i in self.mine) for q in range(self.dp)]

    def _len(self, i: int, q: int) -> int:
        lo, hi = self.cut[i][q]
        return hi - lo

    def _by_owner(self) -> list[tuple[int, int, int]]:
        """`local` grouped by the slab's owner (dp order), slab order within."""
        return sorted(self.local, key=lambda t: (self.slabs[t[0]].owner, t[0]))

    def gather(self, values: Mapping[Hashable, np.ndarray]) -> dict[int, np.ndarray]:
        """The slabs this rank owns, whole over dp (flat, tp-local): `values[key]` is this
        rank's slice of unit `key` (its shard, or the whole unit when not sharded)."""
        if not self.sharded:  # each slab is whole here already
            return {i: values[self.slabs[i].key][self.slabs[i].start: self.slabs[i].start + self.slabs[i].size]
                    for i in self.mine}
        send = [values[self.slabs[i].key][lo - self.offset[self.slabs[i].key]: hi - self.offset[self.slabs[i].key]]
                for i, lo, hi in self._by_owner()]
        dtype = next(iter(values.values())).dtype
        buf = np.concatenate(send) if send else np.zeros(0, dtype)
        got = all_to_all_v(buf, self.send, self.recv, self.mesh, "dp") if self.dp > 1 else buf
        out = {i: np.empty(self.slabs[i].size, dtype) for i in self.mine}
        pos = 0
        for q in range(self.dp):
            for i in self.mine:
                lo, hi = self.cut[i][q]
                out[i][lo - self.slabs[i].start: hi - self.slabs[i].start] = got[pos: pos + hi - lo]
                pos += hi - lo
        return out

    def scatter(self, results: Mapping[int, np.ndarray]) -> list[tuple[int, int, int, np.ndarray]]:
        """Each owned slab's result (flat, tp-local) back to the shard owners: this rank's
        pieces as (slab, lo, hi, values), lo and hi in the coordinates of its slice of the unit."""
        if not self.sharded:
            return self.share(results)
        send = []
        for q in range(self.dp):
            for i in self.mine:
                lo, hi = self.cut[i][q]
                send.append(results[i][lo - self.slabs[i].start: hi - self.slabs[i].start])
        buf = np.concatenate(send) if send else np.zeros(0, self.dtype)
        got = all_to_all_v(buf, self.recv, self.send, self.mesh, "dp") if self.dp > 1 else buf
        out, pos = [], 0
        for i, lo, hi in self._by_owner():
            off = self.offset[self.slabs[i].key]
            out.append((i, lo - off, hi - off, got[pos: pos + hi - lo]))
            pos += hi - lo
        return out

    def share(self, results: Mapping[int, np.ndarray]) -> list[tuple[int, int, int, np.ndarray]]:
        """ZeRO 0: every slab's result on every rank, each from its owner, in one all-gather
        over dp: (slab, lo, hi, values) for every slab, lo and hi in unit coordinates."""
        buf = np.concatenate([results[i] for i in self.mine]) if self.mine else np.zeros(0, self.dtype)
        counts = [sum(self.slabs[i].size for i in owned) for owned in self.owned]
        got = all_gather_v(buf, counts, self.mesh, "dp") if self.dp > 1 else buf
        out, pos = [], 0
        for owned in self.owned:
            for i in owned:
                s = self.slabs[i]
                out.append((i, s.start, s.start + s.size, got[pos: pos + s.size]))
                pos += s.size
        return out

    def to_replicas(self, parts: Mapping[int, np.ndarray]) -> dict[int, np.ndarray]:
        """The owned slabs this rank computes (`computes`), whole and shaped [in, ..., out].
        A slab split over tp: the parts of the tp ranks beside its computing rank (the same
        ep and cp coordinates) go to it, all such parts in one all-to-all over the replicas; a slab
        whole on every tp rank is there already. `parts`: this rank's tp-local part of every
        owned slab, flat."""
        out = {i: parts[i].reshape(self.slabs[i].view.shape) for i in self.computes}
        split = [i for i in self.mine if self.slabs[i].view.tp_dim is not None]
        if self.tp == 1 or not split:
            return out
        row = self.rep // self.tp  # my (ep, cp) coordinates: the tp ranks of my row send me their parts
        send = [parts[i] for r in range(self.nrep) if r // self.tp == row for i in split if self.rep_owner[i] == r]
        counts = [sum(self.slabs[i].size for i in split if self.rep_owner[i] == r) if r // self.tp == row else 0
                  for r in range(self.nrep)]
        mine = [i for i in split if self.rep_owner[i] == self.rep]
        n = sum(self.slabs[i].size for i in mine)
        recv = [n if r // self.tp == row else 0 for r in range(self.nrep)]
        buf = np.concatenate(send) if send else np.zeros(0, parts[split[0]].dtype)  # all computed in other rows
        got = all_to_all_v(buf, counts, recv, self.mesh, self.rep_axes)
        pos = 0
        blocks: dict[int, list[np.ndarray]] = {i: [] for i in mine}
        for _ in range(self.tp):  # tp rank t's parts of my slabs, in slab order
            for i in mine:
                v = self.slabs[i].view
                blocks[i].append(got[pos: pos + v.size].reshape(v.shape))
                pos += v.size
        for i in mine:
            out[i] = np.concatenate(blocks[i], axis=self.slabs[i].view.tp_dim)
        return out

    def from_replicas(self, results: Mapping[int, np.ndarray]) -> dict[int, np.ndarray]:
        """This rank's tp part of every owned slab's result (flat), from the replica that
        computed it (`results`: the whole results of `computes`): each sends every other
        replica its tp part of each split result and the whole of each other, one all-to-all."""
        if self.nrep == 1:
            return {i: results[i].reshape(-1) for i in self.mine}
        send, counts = [], []
        for r in range(self.nrep):  # an expert's result only to the replicas of its ep rank
            part = [self._part(i, results[i], r % self.tp) for i in self.computes
                    if not self.slabs[i].view.experts or r // self.row == self.rep // self.row]
            send += part
            counts.append(sum(x.size for x in part))
        recv = [sum(self.slabs[i].size for i in self.mine if self.rep_owner[i] == r) for r in range(self.nrep)]
        buf = np.concatenate(send) if send else np.zeros(0, self.dtype)
        got = all_to_all_v(buf, counts, recv, self.mesh, self.rep_axes)
        out, pos = {}, 0
        for r in range(self.nrep):
            for i in self.mine:
                if self.rep_owner[i] == r:
                    out[i] = got[pos: pos + self.slabs[i].size]
                    pos += self.slabs[i].size
        return out

    def _part(self, i: int, whole: np.ndarray, t: int) -> np.ndarray:
        """Tp rank t's part of slab `i`'s whole result, flat (all of it if tp does not split it)."""
        v = self.slabs[i].view
        if v.tp_dim is None:
            return whole.reshape(-1)
        n = v.shape[v.tp_dim]
        index = [slice(None)] * len(v.shape)
        index[v.tp_dim] = slice(t * n, (t + 1) * n)
        return np.ascontiguousarray(whole[tuple(index)]).reshape(-1)
