"""Sharded datasets from a corpus and a tokenizer: what `numesh data bpe` and `numesh data
tokenize` write.

The corpus streams by in batches of documents, each tokenised on all cores (`tokenizers`'
batch encoding) and followed by the end-of-text token, into the train or val shards: a
document goes to val when a hash of its index falls under `val_fraction`, so the split is
by documents and the same for the same corpus. meta.json (written last) records the
tokenizer (its JSON and hash), every corpus file with its size and sha256, and the
documents, UTF-8 bytes and tokens of each split (bytes per token give bits per byte).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from numesh.corpus import Reading, describe, documents, expand
from numesh.errors import DataError
from numesh.files import write_atomic
from numesh.shards import ShardWriter, token_dtype
from numesh.tokenizer import HFTokenizer, train_bpe

META_FILE = "meta.json"
BATCH_DOCS = 512  # documents per batch encoding: enough to keep every core busy
Progress = Callable[[int, int], None]  # (corpus bytes done, total)


def _is_val(index: int, val_fraction: float) -> bool:
    """Whether document `index` goes to val: splitmix64 of the index against the fraction."""
    z = (index * 0x9E3779B97F4A7C15 + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 31
    return z < val_fraction * 2.0**64


def corpus_documents(paths: Sequence[Path], how: Reading) -> Iterator[str]:
    """Every non-empty document of the corpus, in order."""
    for p in paths:
        for doc in documents(p, how):
            if doc:
                yield doc


def prepare_bpe(sources: Sequence[str | Path], vocab_size: int, out: str | Path, how: Reading = Reading(),
                val_fraction: float = 0.1, progress: Progress | None = None) -> dict[str, Any]:
    """Train a byte-level BPE of `vocab_size` on the corpus (a first pass), then tokenise it
    (a second): OUT/tokenizer.json and the sharded dataset."""
    paths = expand(sources)
    tok = train_bpe(corpus_documents(paths, how), vocab_size)
    return prepare_tokenized(paths, tok, out, how, val_fraction, progress)


def prepare_tokenized(sources: Sequence[str | Path], tok: HFTokenizer, out: str | Path, how: Reading = Reading(),
                      val_fraction: float = 0.1, progress: Progress | None = None) -> dict[str, Any]:
    """Tokenise the corpus with `tok` into OUT: shards, tokenizer.json, meta.json."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"--val-fraction must be between 0 and 1, got {val_fraction}")
    paths = expand(sources)
    files = describe(paths)
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create dataset directory {out} ({e.strerror or e}): choose another --out") from None
    (out / META_FILE).unlink(missing_ok=True)  # the old dataset, if any, is no longer complete
    dtype = token_dtype(tok.vocab_size)
    writers = {s: ShardWriter(out, s, dtype) for s in ("train", "val")}
    stats = {s: {"documents": 0, "bytes": 0} for s in writers}
    total, done, index, batch = sum(f["bytes"] for f in files), 0, 0, []

    def flush() -> None:
        nonlocal done, index
        for doc, ids in zip(batch, tok.encode_batch(batch)):
            split = "val" if _is_val(index, val_fraction) else "train"
            writers[split].add(np.append(ids, np.uint32(tok.eot_id)))
            n = len(doc.encode("utf-8"))
            stats[split]["documents"] += 1
            stats[split]["bytes"] += n
            done, index = done + n, index + 1
        batch.clear()
        if progress is not None:
            progress(min(done, total), total)

    for doc in corpus_documents(paths, how):
        batch.append(doc)
        if len(batch) == BATCH_DOCS:
            flush()
    flush()
    shards = {s: w.close() for s, w in writers.items()}
    _check_splits(stats, writers, val_fraction)
    return _write_meta(out, tok, dtype, shards, stats, writers, files, how, val_fraction)


def _check_splits(stats: dict, writers: dict[str, ShardWriter], val_fraction: float) -> None:
    docs = sum(s["documents"] for s in stats.values())
    if docs == 0:
        raise DataError("the corpus yields no tokens (every document is empty): check --src, --split-on and "
                        "--text-field")
    for split in ("train", "val"):
        if writers[split].tokens == 0:
            raise DataError(f"the {docs:,} documents leave the {split} split empty at --val-fraction "
                            f"{val_fraction}: add documents, split them (--split-on) or change --val-fraction")


def _write_meta(out: Path, tok: HFTokenizer, dtype: np.dtype, shards: dict, stats: dict,
                writers: dict[str, ShardWriter], files: list, how: Reading, val_fraction: float) -> dict[str, Any]:
    write_atomic(out / "tokenizer.json", tok.json_text)
    meta = {
        "format": "shards-1", "vocab_size": tok.vocab_size, "tokenizer": tok.to_meta(),
        "dtype": "uint16" if dtype.itemsize == 2 else "uint32", "shards": shards,
        "train_tokens": writers["train"].tokens, "val_tokens": writers["val"].tokens,
        "splits": {s: stats[s] | {"tokens": writers[s].tokens} for s in stats},
        "corpus": {"name": "files", "files": files, "split_on": how.split_on, "text_field": how.text_field,
                   "val_fraction": val_fraction},
    }
    write_atomic(out / META_FILE, json.dumps(meta, ensure_ascii=False, indent=1))
    return {"vocab_size": tok.vocab_size, "train_tokens": meta["train_tokens"], "val_tokens": meta["val_tokens"],
            "out_dir": str(out), "documents": {s: stats[s]["documents"] for s in stats}}
