"""Reading a Hugging Face transformers directory's files: its config.json and its weights.

Weights are read by a small safetensors reader of numesh's own, one tensor at a time: the
format is an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range, then the raw bytes. A tensor is read from its byte range in blocks
of rows (`_BLOCK_BYTES`) converted straight into the array the caller gives, so reading a
model never holds more than that destination and one block beside it: a rank that imports
a 70 GB model holds its own shards and one tensor, never the whole file. (Not a memmap:
the pages of a mapping that a read touched stay in the process's resident memory until it
is unmapped, a second copy of the tensor beside the destination.) Both layouts
transformers saves are read: one `model.safetensors`, or `model.safetensors.index.json`
naming the shard file of every tensor; where a directory has both, the one file, which is
what transformers loads. F32, F64, F16 and BF16 tensors convert exactly into float32 or
float64 (bfloat16 is float32's upper 16 bits: shifted back into place).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import struct
from pathlib import Path, PurePosixPath
from typing import Any

import attrs
import numpy as np

from numesh.base.errors import CheckpointError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
TORCH_INDEX = "pytorch_model.bin.index.json"
# the weight files transformers' save_pretrained names: one file, or numbered shards
_WEIGHT_NAME = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|pytorch_model(-\d{5}-of-\d{5})?\.bin")
_RAW = {"F32": np.dtype("<f4"), "F64": np.dtype("<f8"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
_BLOCK_BYTES = 16 << 20  # conversion works this many bytes of a tensor at a time
_MAX_HEADER = 100 << 20  # a larger header is a corrupt file (safetensors' own limit)


@attrs.frozen
class TensorInfo:
    """Where one tensor lies: its file, stored dtype, shape and the absolute byte offset."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        """The stored bytes."""
        return math.prod(self.shape) * _RAW[self.dtype].itemsize


def read_json_file(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from `path`; a missing, unreadable or non-object file is one CheckpointError."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path.parent} has no {path.name}: {what}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path} ({getattr(e, 'strerror', None) or e}): {what}") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} is not a JSON object: {what}")
    return obj


def _header_length(file: Path, size: int, head: bytes) -> int:
    """The header length a file of `size` bytes starts with (`head`, its first 8 bytes), or
    one line where it is no safetensors file's: empty or cut short (a copy or download that
    stopped), which copying it again mends, told apart from a file of another kind."""
    again = "copy it again from the model's source"
    if size == 0:
        raise CheckpointError(f"{file} is empty (0 bytes): {again}")
    if len(head) < 8:
        raise CheckpointError(f"{file} is truncated: it has {size} bytes, fewer than the 8 of a safetensors header "
                              f"length; {again}")
    n = struct.unpack("<Q", head)[0]
    if not 0 < n <= _MAX_HEADER:
        raise CheckpointError(f"{file} is not a safetensors file (its header length is {n})")
    if n > size - 8:
        raise CheckpointError(f"{file} is truncated: its header is {n} bytes but only {size - 8} follow its length; "
                              f"{again}")
    return n


def read_header(file: Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, checked against the file's size."""
    try:
        with open(file, "rb") as f:
            size = file.stat().st_size
            head = f.read(8)
            n = _header_length(file, size, head)
            header = json.loads(f.read(n))
    except OSError as e:
        raise CheckpointError(f"cannot read {file}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{file} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file} is not a safetensors file (its header is not a JSON object)")
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = entry["dtype"], tuple(int(d) for d in entry["shape"])
            start, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: tensor '{name}' has a malformed header entry") from None
        if dtype not in _RAW:
            raise CheckpointError(f"{file}: tensor '{name}' is {dtype}; numesh reads F32, F64, F16 and BF16")
        if end - start != math.prod(shape) * _RAW[dtype].itemsize or not 0 <= start <= end <= size - 8 - n:
            raise CheckpointError(f"{file}: tensor '{name}' has byte range {start}..{end}, which does not hold "
                                  f"its shape {list(shape)} within the file: the file is truncated or corrupt")
        out[name] = TensorInfo(file, dtype, shape, 8 + n + start)
    return out


def _shard_files(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a directory, chosen as transformers' `from_pretrained` does:
    the one model file when there is one (even beside an index, which a model saved over a
    sharded one may have left), else the index's shards; and the index's weight_map when
    it was read."""
    if (directory / SINGLE).exists():
        return [directory / SINGLE], None
    if (directory / INDEX).exists():
        named = _weight_map(directory)
        return [directory / name for name in dict.fromkeys(named.values())], named
    raise CheckpointError(f"{directory} holds no weights: it needs {SINGLE} or {INDEX} with its shards "
                          "(save the model with save_pretrained(..., safe_serialization=True))")


def _weight_map(directory: Path) -> dict[str, str]:
    """The index's weight_map: tensor name -> shard file, as a path inside `directory`
    (`_shard_name`)."""
    index = read_json_file(directory / INDEX, "rewrite it with save_pretrained")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{directory / INDEX} has no weight_map of tensor names to files")
    return {name: _shard_name(file, directory / INDEX) for name, file in weight_map.items()}


def _shard_name(entry: str, index: Path) -> str:
    """One weight_map file name, spelled one way ("./a" and "a" are one file, read once),
    refused unless it is a relative path that stays in the index's directory: a model's
    index names its own shards, and numesh reads no other file it points to. The name alone
    is checked, not where it resolves: the Hugging Face cache's shards are links out of it."""
    pure = PurePosixPath(entry)
    if not entry or pure.is_absolute() or ".." in pure.parts or "\\" in entry:
        raise CheckpointError(f"{index} names shard file '{entry}', which is not a file name inside "
                              f"{index.parent}: name each shard by its name in the model's directory")
    return str(pure)


def weight_files(directory: Path) -> list[Path]:
    """Every weight file of the model(s) saved in `directory`, its indexes first: the names
    transformers saves (`model.safetensors`, `model-00001-of-00002.safetensors`, the torch
    `pytorch_model*.bin`), the two indexes and any other weight file an index names. What a new
    model written there must replace, and nothing else a directory may hold."""
    indexes = [directory / name for name in (INDEX, TORCH_INDEX) if (directory / name).is_file()]
    named = set()
    for index in indexes:
        with contextlib.suppress(CheckpointError):  # a broken index names nothing: it goes all the same
            weight_map = read_json_file(index, "").get("weight_map")
            if isinstance(weight_map, dict):
                named |= {v for v in weight_map.values()
                          if isinstance(v, str) and v.endswith((".safetensors", ".bin"))}
    files = sorted(p for p in directory.iterdir() if (_WEIGHT_NAME.fullmatch(p.name) or p.name in named)
                   and p.is_file())
    return indexes + files


@attrs.frozen
class Weights:
    """The tensors of a transformers directory, by name (`open_weights`), read one at a time."""

    directory: Path
    tensors: dict[str, TensorInfo]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def read(self, name: str, out: np.ndarray, transpose: bool = False) -> np.ndarray:
        """Tensor `name` (transposed if asked, 2-D only) converted into `out`, whose dtype
        (float32 or float64) is the run's; returns `out`."""
        info = self.tensors[name]
        shape = info.shape[::-1] if transpose else info.shape
        if tuple(out.shape) != shape:
            raise CheckpointError(f"{self.directory}: tensor '{name}' has shape {list(info.shape)}, the model needs "
                                  f"{list(out.shape[::-1] if transpose else out.shape)}")
        if not out.size:
            return out
        raw = _RAW[info.dtype]
        row = math.prod(info.shape[1:])
        rows = max(1, _BLOCK_BYTES // max(1, row * raw.itemsize))
        with open(info.file, "rb") as f:
            f.seek(info.offset)
            for i in range(0, info.shape[0], rows):
                n = min(rows, info.shape[0] - i)
                block = _to_float(np.fromfile(f, dtype=raw, count=n * row).reshape(n, *info.shape[1:]), info.dtype)
                if transpose:
                    out[:, i:i + n] = block.T
                else:
                    out[i:i + n] = block
        return out


def _to_float(block: np.ndarray, dtype: str) -> np.ndarray:
    """A block of stored values as floats (bfloat16: its 16 bits are float32's upper half)."""
    if dtype == "BF16":
        return np.left_shift(block, 16, dtype=np.uint32).view(np.float32)
    return block


def open_weights(directory: Path) -> Weights:
    """Every tensor of `directory`'s safetensors file(s), from their headers alone; a missing
    file, a tensor in two files or one the index names but its file lacks is one line."""
    tensors: dict[str, TensorInfo] = {}
    files, named = _shard_files(directory)
    for file in files:
        if not file.exists():
            raise CheckpointError(f"{directory / INDEX} names {_inside(file, directory)}, which is missing from "
                                  f"{directory}")
        for name, info in read_header(file).items():
            if name in tensors:
                raise CheckpointError(f"{directory}: tensor '{name}' is in both "
                                      f"{_inside(tensors[name].file, directory)} and {_inside(file, directory)}: "
                                      "keep one copy of each tensor, in the file the index names")
            tensors[name] = info
    if named is not None:
        lost = sorted(k for k, v in named.items() if k not in tensors or tensors[k].file != directory / v)
        if lost:
            raise CheckpointError(f"{directory / INDEX} puts tensor '{lost[0]}' in {named[lost[0]]}, which does "
                                  "not hold it")
    return Weights(directory, tensors)


def _inside(file: Path, directory: Path) -> str:
    """A weight file's name as the model's index spells it: its path inside `directory`
    (a shard in a subdirectory named by its base name alone could seem to be another)."""
    return file.relative_to(directory).as_posix()


def weights_dtype(weights: Weights) -> str:
    """The numpy dtype that holds every tensor exactly: float64 if any is F64, else float32."""
    return "float64" if any(t.dtype == "F64" for t in weights.tensors.values()) else "float32"
