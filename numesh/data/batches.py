"""Mesh-independent batches (the *mesh-independent data* rule of docs/design.md).

The global batch of a step depends only on its key (derived from seed and step):
data-parallel rank r takes rows r*B/dp ... (r+1)*B/dp of it, micro-batches split those rows in
order, and context-parallel ranks take their zigzag chunks of each row, so every mesh sees the
same global batch.

Pure NumPy: no MPI here.
"""

from __future__ import annotations

import numpy as np

from numesh.base.errors import DataError
from numesh.data.dataset import SPLITS
from numesh.data.shards import TokenStream
from numesh.mesh.zigzag import take_local


def train_key(seed: int, step: int) -> tuple[int, ...]:
    """Key of the global training batch of `step`."""
    return (int(seed), 0, int(step))


def eval_key(seed: int, split: str, i: int) -> tuple[int, ...]:
    """Key of eval batch `i` of `split`: the same at every eval, apart from the training stream."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}: use one of {', '.join(SPLITS)}")
    return (int(seed), 1 if split == "train" else 2, int(i))


def batch_offsets(key: tuple[int, ...], n_tokens: int, batch_size: int, block_size: int) -> np.ndarray:
    """Start offsets (int64, shape (batch_size,)) of the global batch for `key`.

    Depends only on (key, n_tokens, batch_size, block_size), never on the mesh.
    """
    if block_size < 1:
        raise DataError(f"block_size must be positive, got {block_size}: pass a positive --block-size")
    if batch_size < 1:
        raise DataError(f"batch_size must be positive, got {batch_size}: pass a positive --batch-size")
    if n_tokens <= block_size:
        raise DataError(
            f"block_size {block_size} needs a split of at least {block_size + 1} tokens, this one has {n_tokens}: "
            + ("use a --block-size below it" if n_tokens > 1 else "too small for any --block-size: use a larger corpus")
        )
    parts = [int(k) for k in key]
    if not parts or min(parts) < 0:
        raise DataError(f"batch key {tuple(key)} must be non-empty and non-negative: use a seed >= 0")
    rng = np.random.default_rng(parts)
    return rng.integers(0, n_tokens - block_size, size=batch_size, dtype=np.int64)


def read_rows(data: np.ndarray | TokenStream, offsets: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs x = data[o:o+T] and targets y = data[o+1:o+1+T] for each offset, as int64.

    From a `TokenStream` (a dataset's split) one read per row, of only these rows; from an
    array one fancy index.
    """
    offs = np.asarray(offsets, dtype=np.int64).reshape(-1)
    if offs.size and (offs.min() < 0 or offs.max() + block_size + 1 > len(data)):
        raise DataError(
            f"row offsets reach outside the {len(data)}-token split for block_size {block_size}: "
            "compute them with batch_offsets on this split"
        )
    if isinstance(data, TokenStream):
        rows = data.rows(offs, block_size + 1).astype(np.int64)
    else:
        rows = np.asarray(data[offs[:, None] + np.arange(block_size + 1)], dtype=np.int64)
    return np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:])


def local_batch(
    data: np.ndarray | TokenStream,
    key: tuple[int, ...],
    batch_size: int,
    block_size: int,
    dp_rank: int,
    dp_size: int,
    micro_batches: int,
    cp_rank: int = 0,
    cp_size: int = 1,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """This dp rank's share of the global batch for `key`, split in order into micro-batches.

    Rank r takes global rows r*B/dp ... (r+1)*B/dp; only those rows are read from `data`.
    Returns `micro_batches` pairs (x, y), each of shape (B/(dp*micro_batches), block_size/cp):
    with context parallelism, cp rank c keeps of each sequence its chunks c and 2cp-1-c of
    2cp (`numesh.mesh.zigzag.positions`), inputs and targets alike.
    """
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise DataError(f"dp rank {dp_rank} is not in 0..{dp_size - 1}: check the mesh's dp axis")
    if micro_batches < 1:
        raise DataError(f"micro_batches must be positive, got {micro_batches}: pass a positive --micro-batches")
    if batch_size % (dp_size * micro_batches):
        raise DataError(
            f"batch_size {batch_size} is not divisible by dp {dp_size} x micro_batches {micro_batches}: "
            f"use a --batch-size that is a multiple of {dp_size * micro_batches} or change dp / --micro-batches"
        )
    offsets = batch_offsets(key, len(data), batch_size, block_size)
    per_rank = batch_size // dp_size
    mine = offsets[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    x, y = read_rows(data, mine, block_size)
    if cp_size > 1:
        if block_size % (2 * cp_size):
            raise DataError(f"block_size {block_size} does not split into 2*cp={2 * cp_size} chunks: "
                            f"use a --block-size that is a multiple of {2 * cp_size}")
        x, y = take_local(x, cp_size, cp_rank), take_local(y, cp_size, cp_rank)  # [B/dp, T/cp]
    per_micro = per_rank // micro_batches
    # each micro-batch its own arrays (not views of the rank's rows), so what a micro-batch's
    # saved state holds (the embedding keeps its ids) is its own rows: activation accounting
    return [
        (x[m * per_micro : (m + 1) * per_micro].copy(), y[m * per_micro : (m + 1) * per_micro].copy())
        for m in range(micro_batches)
    ]
