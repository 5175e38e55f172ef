"""Token shards: a dataset's ids as numbered files, written while a corpus streams by and
read back as one memory-mapped stream per split.

A sharded dataset directory holds `train-00000.bin, ...` and `val-00000.bin, ...` (raw
little-endian uint16 ids when the vocabulary fits, else uint32) and `meta.json`, whose
"shards" entry lists each split's files and their token counts; meta.json is written last,
so its presence means the files it names are complete.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from numesh.errors import DataError

SHARD_TOKENS = 1 << 26  # ids per shard file: 128 MiB of uint16, 256 MiB of uint32


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32; a larger vocabulary is a DataError."""
    if vocab_size <= 1 << 16:
        return np.dtype("<u2")
    if vocab_size <= 1 << 32:
        return np.dtype("<u4")
    raise DataError(f"a vocabulary of {vocab_size:,} does not fit uint32 token ids: use at most {1 << 32:,}")


class ShardWriter:
    """Appends ids to `{split}-NNNNN.bin` files of at most `shard_tokens` ids each."""

    def __init__(self, out: Path, split: str, dtype: np.dtype, shard_tokens: int | None = None):
        self.out, self.split, self.dtype = Path(out), split, np.dtype(dtype)
        self.shard_tokens = shard_tokens or SHARD_TOKENS
        self.shards: list[dict[str, Any]] = []
        self._file = None

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards)

    def add(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids).astype(self.dtype, copy=False)
        while ids.size:
            if self._file is None or self.shards[-1]["tokens"] == self.shard_tokens:
                self._open()
            room = self.shard_tokens - self.shards[-1]["tokens"]
            part, ids = ids[:room], ids[room:]
            part.tofile(self._file)
            self.shards[-1]["tokens"] += int(part.size)

    def _open(self) -> None:
        self.close()
        name = f"{self.split}-{len(self.shards):05d}.bin"
        try:
            self._file = open(self.out / name, "wb")
        except OSError as e:
            raise DataError(f"cannot write {self.out / name} ({e.strerror or e}): choose a writable --out") from None
        self.shards.append({"file": name, "tokens": 0})

    def close(self) -> list[dict[str, Any]]:
        """Close the current file; the shards written so far."""
        if self._file is not None:
            self._file.close()
            self._file = None
        return self.shards


class TokenStream:
    """One split's shards as one read-only sequence of ids: `len` and integer-array
    indexing (what `numesh.data.read_rows` uses), each shard memory-mapped, so only the
    pages holding the indexed ids are read."""

    def __init__(self, paths: list[Path], counts: list[int], dtype: np.dtype):
        self.dtype = np.dtype(dtype)
        self._maps = [np.memmap(p, dtype=self.dtype, mode="r") for p, n in zip(paths, counts) if n]
        sizes = np.array([len(m) for m in self._maps], dtype=np.int64)
        self._ends = np.cumsum(sizes)
        self._starts = self._ends - sizes

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def __getitem__(self, index: Any) -> np.ndarray:
        idx = np.asarray(index, dtype=np.int64)
        flat = idx.reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(f"token index outside the {len(self)}-token stream")
        which = np.searchsorted(self._ends, flat, side="right")
        out = np.empty(flat.shape, self.dtype)
        for s in np.unique(which):
            sel = which == s
            out[sel] = self._maps[s][flat[sel] - self._starts[s]]
        return out.reshape(idx.shape)


def open_split(data_dir: Path, meta: dict[str, Any], split: str) -> TokenStream:
    """`split`'s shards as listed in a sharded dataset's meta.json, checked against the files."""
    d = Path(data_dir)
    again = "prepare the dataset again with `numesh data bpe` or `numesh data tokenize`"
    try:
        dtype = np.dtype({"uint16": "<u2", "uint32": "<u4"}[meta["dtype"]])
        shards = meta["shards"][split]
        paths, counts = [d / s["file"] for s in shards], [int(s["tokens"]) for s in shards]
    except (KeyError, TypeError, ValueError):
        raise DataError(f"{d / 'meta.json'} does not describe the {split} shards: {again}") from None
    for p, n in zip(paths, counts):
        if not p.is_file():
            raise DataError(f"shard {p} is missing: {again}")
        if p.stat().st_size != n * dtype.itemsize:
            raise DataError(f"shard {p} has {p.stat().st_size} bytes, meta.json says {n} ids of "
                            f"{dtype.itemsize} bytes: {again}")
    if sum(counts) == 0:
        raise DataError(f"the {split} split of {d} holds no tokens: {again}")
    return TokenStream(paths, counts, dtype)
