"""Ring attention against the whole-sequence causal attention, in one process.

The cp ranks are simulated by threads that run the real `ring_attention_fwd`/`_bwd` and
pass their blocks through queues (`SimRing`), so the ring's order of transfers, the
load-balanced block pairs and the dK/dV accumulators' way home are all exercised without
MPI. float64, 1e-12 against `numesh.nn.attention.attention_reference` and its backward (the
plain whole-sequence definition), dropout included, plus finite differences of the ring itself.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Sequence

import numpy as np
import pytest

from numesh.nn.attention import AttnDropout, attention_reference, attention_reference_bwd
from numesh.nn.context_parallel import chunk_ids, positions, take_local
from numesh.nn.ring_attention import block_pairs, ring_attention_bwd, ring_attention_fwd


class _Arrival:
    def __init__(self, box: "queue.Queue", n: int):
        self.box, self.n = box, n

    def wait(self) -> list[np.ndarray]:
        return [self.box.get(timeout=30) for _ in range(self.n)]


class SimRing:
    """Rank `index` of a ring of `size` threads: `shift` puts copies of the arrays in the
    next rank's box and returns the arrival from the previous one (a copy, as MPI would)."""

    def __init__(self, boxes: dict, size: int, index: int):
        self.boxes, self.size, self.index = boxes, size, index
        self.sent = 0  # arrays sent, to check the transfer count

    def shift(self, arrays: Sequence[np.ndarray], tag: int) -> _Arrival:
        nxt = self.boxes[(tag, (self.index + 1) % self.size)]
        for a in arrays:
            nxt.put(np.array(a, copy=True))
        self.sent += len(arrays)
        return _Arrival(self.boxes[(tag, self.index)], len(arrays))


def run_ring(size: int, fn: Callable[[SimRing], object]) -> tuple[list, list[SimRing]]:
    """fn(ring) on `size` threads, one per simulated cp rank; their results in rank order."""
    boxes: dict = {}
    for tag in (71, 72):
        for r in range(size):
            boxes[(tag, r)] = queue.Queue()
    rings = [SimRing(boxes, size, r) for r in range(size)]
    out: list = [None] * size
    errors: list = []

    def work(r: int) -> None:
        try:
            out[r] = fn(rings[r])
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out, rings


def qkv(B: int, H: int, T: int, hs: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((B, H, T, hs)) for _ in range(4))  # q, k, v, dy


def _ring_fwd_bwd(ring: SimRing, cp: int, arrays, drop=None, overlap: bool = True):
    """This simulated rank's output and (dq, dk, dv) for the whole-sequence arrays (q, k, v, dy)."""
    q, k, v, dy = (take_local(a, cp, ring.index, axis=2) for a in arrays)
    y = np.empty_like(q)
    ctx = ring_attention_fwd(q, k, v, y, ring, drop, overlap)
    grads = [np.zeros_like(a) for a in (q, k, v)]
    ring_attention_bwd(ctx, dy, *grads, ring, overlap)
    return y, grads


def test_positions_are_the_zigzag_chunks() -> None:
    assert chunk_ids(4, 1) == (1, 6)
    np.testing.assert_array_equal(positions(16, 2, 0), [0, 1, 2, 3, 12, 13, 14, 15])
    np.testing.assert_array_equal(positions(16, 2, 1), [4, 5, 6, 7, 8, 9, 10, 11])
    # every position held exactly once
    allpos = np.sort(np.concatenate([positions(24, 3, r) for r in range(3)]))
    np.testing.assert_array_equal(allpos, np.arange(24))
    x = np.arange(2 * 16).reshape(2, 16)
    np.testing.assert_array_equal(take_local(x, 2, 1), x[:, 4:12])


def test_dropout_masks_of_a_cp_rank_are_its_positions_of_the_whole_mask() -> None:
    """Residual masks are slices of the whole sequence's; attention dropout's stream is the
    same object whatever the cp split (the kernel hashes global positions:
    tests/test_attention.py checks the pattern)."""
    from numesh.nn.context_parallel import CpSlice
    from numesh.nn.dropout import DropoutKey, Site

    key = DropoutKey(0.3, seed=1, step=2, row0=1, global_rows=3)
    T, C, cp = 8, 5, 2
    whole = key.seq_mask(Site("mlp_out", 1), 2, T, (C,), CpSlice())
    for r in range(cp):
        pos = positions(T, cp, r)
        np.testing.assert_array_equal(key.seq_mask(Site("mlp_out", 1), 2, T // cp, (C,), CpSlice(cp, r)), whole[:, pos])
    assert key.attention(1, 4, slice(2, 4), T) == key.attention(1, 4, slice(2, 4), T)
    assert key.attention(1, 4, slice(2, 4), T).key != key.attention(2, 4, slice(2, 4), T).key


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_every_rank_does_the_same_work(cp: int) -> None:
    """The load balance: off the diagonal every step is half a block on every rank, and the
    pairs computed are exactly the causal ones (each visible pair once, no hidden one)."""
    c = 3
    T = 2 * cp * c
    for r in range(cp):
        seen = np.zeros((T, T), int)
        work = 0
        for s in range(cp):
            src = (r - s) % cp
            rows, cols, causal = block_pairs(r, src, c)
            qp, kp = positions(T, cp, r)[rows], positions(T, cp, src)[cols]
            ok = qp[:, None] >= kp[None, :]
            assert causal or ok.all()  # off the diagonal no mask is needed
            seen[np.ix_(qp, kp)] += ok
            work += (rows.stop - rows.start) * (cols.stop - cols.start)
        assert work == (2 * c) ** 2 + (cp - 1) * 2 * c * c
        mine = positions(T, cp, r)
        np.testing.assert_array_equal(seen[mine], np.tri(T, dtype=int)[mine])


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("overlap", [True, False])
def test_ring_matches_whole_sequence_attention(cp: int, dropout: bool, overlap: bool) -> None:
    B, H, T, hs = 2, 3, 16, 5
    q, k, v, dy = qkv(B, H, T, hs, seed=cp)
    drop = AttnDropout(0.2, key=9, row0=0, n_head=H, head0=0, seq=T) if dropout else None
    want_y = attention_reference(q, k, v, drop=drop)
    want = attention_reference_bwd(q, k, v, dy, drop=drop)

    def rank(ring: SimRing):
        return _ring_fwd_bwd(ring, cp, (q, k, v, dy), drop, overlap)

    results, rings = run_ring(cp, rank)
    for r, (y, grads) in enumerate(results):
        pos = positions(T, cp, r)
        np.testing.assert_allclose(y, want_y[:, :, pos], rtol=1e-12, atol=1e-12)
        for got, w, name in zip(grads, want, "qkv"):
            np.testing.assert_allclose(got, w[:, :, pos], rtol=1e-11, atol=1e-12, err_msg=f"d{name} rank {r}")
    # K and V go around cp-1 times in each direction, dK and dV cp times (none when cp=1)
    for ring in rings:
        assert ring.sent == (0 if cp == 1 else 2 * (cp - 1) * 2 + 2 * cp)


def test_ring_backward_matches_finite_differences() -> None:
    """The ring's own gradients of sum(y·w) against central differences (cp=2, float64)."""
    cp, B, H, T, hs = 2, 1, 2, 8, 3
    q, k, v, w = qkv(B, H, T, hs, seed=4)

    def loss(qq: np.ndarray, kk: np.ndarray, vv: np.ndarray) -> float:
        def rank(ring: SimRing) -> float:
            loc = [take_local(a, cp, ring.index, axis=2) for a in (qq, kk, vv, w)]
            y = np.empty_like(loc[0])
            ring_attention_fwd(loc[0], loc[1], loc[2], y, ring)
            return float((y * loc[3]).sum())
        return sum(run_ring(cp, rank)[0])

    per_rank = [g for _, g in run_ring(cp, lambda ring: _ring_fwd_bwd(ring, cp, (q, k, v, w)))[0]]
    eps = 1e-6
    rng = np.random.default_rng(0)
    for which, name in enumerate("qkv"):
        full = np.zeros_like(q)
        for r, g in enumerate(per_rank):
            full[:, :, positions(T, cp, r)] = g[which]
        for _ in range(6):
            i = tuple(rng.integers(0, n) for n in q.shape)
            args = [q.copy(), k.copy(), v.copy()]
            args[which][i] += eps
            up = loss(*args)
            args[which][i] -= 2 * eps
            down = loss(*args)
            assert (up - down) / (2 * eps) == pytest.approx(full[i], rel=1e-6, abs=1e-9), f"d{name}{i}"
