"""How a sequence is split over the cp axis: the load-balanced ("zigzag") layout.

A sequence of T tokens is cut into 2·cp chunks of T/(2cp); cp rank r holds chunk r and its
mirror chunk 2cp-1-r, in that order. Under a causal mask the front chunk of rank r sees few
keys and the back chunk many, so every rank has the same attention work. Pure functions:
the data loader, the position embedding, dropout and ring attention all take their tokens
by these positions (a sequence dim sharded over cp, as a `P` spec shards a parameter dim).
"""

from __future__ import annotations

import numpy as np


def chunk_len(seq_len: int, cp: int) -> int:
    """Tokens per chunk: a sequence of `seq_len` is cut into 2·cp chunks."""
    return seq_len // (2 * cp)


def chunk_ids(cp: int, r: int) -> tuple[int, int]:
    """The two chunks cp rank `r` holds: its front chunk r and the mirrored back chunk."""
    return r, 2 * cp - 1 - r


def positions(seq_len: int, cp: int, r: int) -> np.ndarray:
    """Global positions [T/cp] of the tokens cp rank `r` holds, in its local order."""
    if cp == 1:
        return np.arange(seq_len)
    c = chunk_len(seq_len, cp)
    a, b = chunk_ids(cp, r)
    return np.concatenate([np.arange(a * c, (a + 1) * c), np.arange(b * c, (b + 1) * c)])


def take_local(x: np.ndarray, cp: int, r: int, axis: int = 1) -> np.ndarray:
    """cp rank `r`'s tokens of `x` (whole sequences along `axis`), contiguous."""
    if cp == 1:
        return x
    return np.ascontiguousarray(np.take(x, positions(x.shape[axis], cp, r), axis=axis))
