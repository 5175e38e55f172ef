"""Token shards: a dataset's ids as numbered files, written while a corpus streams by and
read back as one stream per split (`TokenStream`, which a character dataset's one file per
split uses too).

A sharded dataset directory holds `train-00000.bin, ...` and `val-00000.bin, ...` (raw
little-endian uint16 ids when the vocabulary fits, else uint32) and `meta.json`, whose
"shards" entry lists each split's files and their token counts (the dataset is written
whole: numesh/dataset_write.py).
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import os
from pathlib import Path
from typing import Any, Sequence

import attrs
import numpy as np

from numesh.base.errors import DataError

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


@attrs.frozen
class _File:
    """One open token file of a stream: where it is, its handle, and its size and
    modification time when opened (a change of either means another process wrote it)."""

    path: Path
    fd: int
    tokens: int
    size: int
    mtime_ns: int


class TokenStream:
    """One split's token files as one read-only sequence of ids, read with explicit reads at
    offsets (`os.pread`, one per row of a batch), never memory-mapped: a memory map of a
    file that another process truncates kills the reader with SIGBUS ("Bus error", exit 135,
    not a word), while a short read is a DataError naming the file. A file whose size or
    modification time changes under the stream is one too (checked with one fstat per file
    a read touches). `hint` ends those messages: how to rebuild the dataset.

    `rows(offsets, length)` is what `numesh.data.batches.read_rows` uses; `read`, `len`, indexing
    and `np.asarray` (the whole stream) serve everything else."""

    def __init__(self, files: Sequence[tuple[Path, int]], dtype: np.dtype, hint: str = "",
                 dir_fd: int | None = None):
        self.dtype, self.hint = np.dtype(dtype), hint
        self._files: list[_File] = []
        try:
            for path, n in files:
                if n:
                    self._files.append(self._open(Path(path), n, dir_fd))
        except BaseException:
            self.close()
            raise
        self._ends = list(itertools.accumulate(f.tokens for f in self._files))
        self._starts = [e - f.tokens for e, f in zip(self._ends, self._files)]
        self._ends_array = np.array(self._ends, dtype=np.int64)  # for searchsorted over a batch's rows

    def _open(self, path: Path, tokens: int, dir_fd: int | None) -> _File:
        try:
            fd = os.open(path.name if dir_fd is not None else path, os.O_RDONLY, dir_fd=dir_fd)
        except OSError as e:
            raise DataError(f"cannot read {path} ({e.strerror or e}): {self.hint}") from None
        st = os.fstat(fd)
        if st.st_size != tokens * self.dtype.itemsize:
            os.close(fd)
            raise DataError(f"{path} holds {st.st_size:,} bytes, not the {tokens:,} ids meta.json says (it changed "
                            f"as it was opened): {self.hint}")
        return _File(path, fd, tokens, st.st_size, st.st_mtime_ns)

    @property
    def handles(self) -> dict[str, int]:
        """File name -> the open handle this stream reads (for `numesh.data.check.verify`)."""
        return {f.path.name: f.fd for f in self._files}

    def close(self) -> None:
        for f in self._files:
            with contextlib.suppress(OSError):
                os.close(f.fd)
        self._files = []

    def __del__(self) -> None:
        self.close()

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def _changed(self, f: _File) -> DataError | None:
        st = os.fstat(f.fd)
        if st.st_size < f.size:
            return DataError(f"{f.path} shrank from {f.size:,} to {st.st_size:,} bytes while this run read it: "
                             f"another process truncated or rewrote it; {self.hint}, then resume")
        if st.st_size != f.size or st.st_mtime_ns != f.mtime_ns:
            return DataError(f"{f.path} changed while this run read it (another process wrote to it): "
                             f"{self.hint}, then resume")
        return None

    def _fill(self, out: memoryview, start: int, touched: set[int]) -> None:
        """Read ids start, start+1, ... into `out` (bytes), across files as needed."""
        isz, k = self.dtype.itemsize, bisect.bisect_right(self._ends, start)
        pos, done = start, 0
        while done < len(out):
            f = self._files[k]
            want = min(len(out) - done, (self._ends[k] - pos) * isz)
            got, off = 0, (pos - self._starts[k]) * isz
            while got < want:
                n = os.preadv(f.fd, [out[done + got: done + want]], off + got)
                if n == 0:  # the file ends before meta.json says it does
                    raise self._changed(f) or DataError(f"{f.path} ends early: {self.hint}")
                got += n
            touched.add(k)
            done, pos, k = done + want, pos + want // isz, k + 1

    def _check(self, touched: set[int]) -> None:
        for k in touched:
            if err := self._changed(self._files[k]):
                raise err

    def read(self, start: int, count: int) -> np.ndarray:
        """Ids start ... start+count-1 as a new array."""
        if start < 0 or count < 0 or start + count > len(self):
            raise IndexError(f"ids {start}..{start + count - 1} outside the {len(self)}-token stream")
        out, touched = np.empty(count, self.dtype), set()
        self._fill(memoryview(out).cast("B"), start, touched)
        self._check(touched)
        return out

    def rows(self, offsets: np.ndarray, length: int) -> np.ndarray:
        """[len(offsets), length] ids: row i is ids offsets[i] ... offsets[i]+length-1, one
        read per row (more where a row crosses a file's end)."""
        offs = np.asarray(offsets, dtype=np.int64).reshape(-1)
        if offs.size and (offs.min() < 0 or offs.max() + length > len(self)):
            raise IndexError(f"rows of {length} ids from offsets {offs.min()}..{offs.max()} leave the "
                             f"{len(self)}-token stream")
        isz, touched = self.dtype.itemsize, set()
        row, pieces = length * isz, []
        # one os.pread per row and one join (a syscall per row: on the 2-core VM 19 us for 12
        # rows of 65 ids and 72 us for 64 of 257, against a memmap's fancy index's 4 and 29 us;
        # docs/data.md has what a whole batch costs, under 0.1 % of a training step)
        for o, k in zip(offs.tolist(), np.searchsorted(self._ends_array, offs, side="right").tolist()):
            inside = o + length <= self._ends[k]
            piece = os.pread(self._files[k].fd, row, (o - self._starts[k]) * isz) if inside else b""
            if len(piece) == row:
                touched.add(k)
            else:  # across a file's end, or a short read (which _fill explains)
                buf = bytearray(row)
                self._fill(memoryview(buf), o, touched)
                piece = bytes(buf)
            pieces.append(piece)
        self._check(touched)
        return np.frombuffer(b"".join(pieces), self.dtype).reshape(offs.size, length)

    def __getitem__(self, index: Any) -> np.ndarray | np.integer:
        n = len(self)
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            return self.read(start, max(0, stop - start))[::step] if step > 0 else np.asarray(self)[index]
        idx = np.asarray(index)
        if not np.issubdtype(idx.dtype, np.integer):
            raise IndexError(f"index a TokenStream with integers or a slice, not {idx.dtype}")
        flat = np.where(idx < 0, idx + n, idx).astype(np.int64).reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= n):
            raise IndexError(f"token index outside the {n}-token stream")
        if flat.size == 0:
            return np.empty(idx.shape, self.dtype)
        lo = int(flat.min())
        out = self.read(lo, int(flat.max()) - lo + 1)[flat - lo].reshape(idx.shape)
        return out[()] if idx.ndim == 0 else out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self.read(0, len(self))
        return whole if dtype is None else whole.astype(dtype)


def open_split(data_dir: Path, meta: dict[str, Any], split: str, hint: str, dir_fd: int | None = None) -> TokenStream:
    """`split`'s shards as a sharded dataset's meta.json lists them (their sizes checked by
    `numesh.data.check.check`), opened in `data_dir` or the directory `dir_fd` holds open."""
    d = Path(data_dir)
    try:
        dtype = np.dtype({"uint16": "<u2", "uint32": "<u4"}[meta["dtype"]])
        files = [(d / s["file"], int(s["tokens"])) for s in meta["shards"][split]]
    except (KeyError, TypeError, ValueError):
        raise DataError(f"{d / 'meta.json'} does not describe the {split} shards: {hint}") from None
    if sum(n for _, n in files) == 0:
        raise DataError(f"the {split} split of {d} holds no tokens: {hint}")
    return TokenStream(files, dtype, hint, dir_fd)
