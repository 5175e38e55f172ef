"""Context parallelism's layout and communication: which tokens a cp rank holds, and the
ring that passes K/V blocks (and their gradients) between the cp ranks.

Load balancing (the "zigzag" layout of Megatron's context parallelism, `numesh.mesh.zigzag`):
a sequence of T tokens is cut into 2·cp chunks of T/(2cp); cp rank r holds chunk r and its
mirror chunk 2cp-1-r. Under a causal mask the front chunk of rank r sees few keys and the
back chunk many, so every rank does the same attention work (see `numesh.nn.ring_attention`).

The ring's communication is kept apart from the attention math (picotron's layout): the
math asks a `Ring` to start passing some arrays to the next rank and later waits for what
the previous rank passed it. `MeshRing` does that with the mesh's nonblocking sends and
receives along cp, so the byte counter, the tracer and the flight recorder see every block.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import attrs
import numpy as np

from numesh.mesh import Handle, Mesh, irecv, isend
from numesh.mesh.zigzag import chunk_ids, chunk_len, positions, take_local

__all__ = ["CpSlice", "DKV_TAG", "KV_TAG", "MeshRing", "Ring", "Transfer", "chunk_ids", "chunk_len", "positions",
           "take_local"]

# tags of the ring's two message streams (K/V blocks, and dK/dV accumulators going home)
KV_TAG, DKV_TAG = 71, 72


@attrs.frozen
class CpSlice:
    """A cp rank's place in the ring: what dropout masks and position embeddings need to
    take this rank's tokens out of whole-sequence arrays."""

    size: int = 1
    index: int = 0

    def positions(self, local_len: int) -> np.ndarray:
        """Global positions of this rank's `local_len` tokens."""
        return positions(local_len * self.size, self.size, self.index)

    @classmethod
    def of(cls, mesh: Mesh) -> "CpSlice":
        return cls(mesh.size("cp"), mesh.index("cp"))


class Transfer(Protocol):
    """Arrays on their way around the ring; `wait()` returns the ones that arrived."""

    def wait(self) -> list[np.ndarray]: ...


class Ring(Protocol):
    """A cp ring as the attention math sees it: `size`, this rank's `index`, and `shift`:
    start sending `arrays` to the next rank while receiving the previous rank's."""

    size: int
    index: int

    def shift(self, arrays: Sequence[np.ndarray], tag: int) -> Transfer: ...


class _MeshTransfer:
    def __init__(self, sends: list[Handle], recvs: list[Handle]):
        self.sends, self.recvs = sends, recvs

    def wait(self) -> list[np.ndarray]:
        out = [h.wait() for h in self.recvs]
        for h in self.sends:
            h.wait()
        return out


class MeshRing:
    """The cp axis of a mesh as a ring (nonblocking sends to the next rank, receives from
    the previous one, through the mesh's collectives so that they are counted and traced)."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.size, self.index = mesh.size("cp"), mesh.index("cp")
        self.next, self.prev = (self.index + 1) % self.size, (self.index - 1) % self.size

    def shift(self, arrays: Sequence[np.ndarray], tag: int) -> Transfer:
        # receives are posted first so the sends can complete into them
        recvs = [irecv(np.empty_like(a), self.mesh, "cp", self.prev, tag) for a in arrays]
        sends = [isend(a, self.mesh, "cp", self.next, tag) for a in arrays]
        return _MeshTransfer(sends, recvs)
