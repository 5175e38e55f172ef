#!/usr/bin/env python
"""Tokenising a large corpus: peak RSS and tokens/s of `numesh data tokenize`.

    python benchmarks/bench_tokenize.py                      # a 1 GB synthetic .jsonl corpus
    python benchmarks/bench_tokenize.py --gb 0.2 --keep /tmp/corpus.jsonl

Writes a synthetic .jsonl corpus of --gb gigabytes (documents of 1-20 paragraphs of
--src, tiny Shakespeare by default, in a seeded order), trains a byte-level BPE of
--vocab-size on its first 20 MB (`numesh data bpe`), then runs `numesh data tokenize` with
that tokenizer over the whole corpus in a fresh process and prints its wall time, tokens/s
and peak RSS (the process's ru_maxrss), beside the corpus size. The corpus streams, so the
peak should not grow with the corpus: this measures that it does not. A benchmark: it
asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import DEFAULT_SRC, numesh_cli  # noqa: E402


def write_corpus(src: Path, out: Path, size: int, seed: int = 0) -> int:
    """A .jsonl file of about `size` bytes; returns the documents written."""
    paragraphs = [p for p in src.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    rng = random.Random(seed)
    docs = 0
    with open(out, "w", encoding="utf-8") as f:
        while f.tell() < size:
            text = "\n\n".join(rng.choice(paragraphs) for _ in range(rng.randint(1, 20)))
            f.write(json.dumps({"text": text}) + "\n")
            docs += 1
    return docs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.0, help="corpus size in GB (default 1)")
    ap.add_argument("--vocab-size", type=int, default=1024, help="BPE size (default 1024)")
    ap.add_argument("--src", default=DEFAULT_SRC, help="text the documents are drawn from")
    ap.add_argument("--keep", default=None, help="write the corpus here and keep it (default: a temporary file)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="numesh-tok-") as tmp:
        corpus = Path(args.keep) if args.keep else Path(tmp) / "corpus.jsonl"
        t0 = time.perf_counter()
        docs = write_corpus(Path(args.src), corpus, int(args.gb * 1e9))
        size = corpus.stat().st_size
        print(f"corpus: {size / 1e9:.2f} GB, {docs:,} documents, written in {time.perf_counter() - t0:.0f} s")
        sample = Path(tmp) / "sample.jsonl"
        with open(corpus, encoding="utf-8") as f, open(sample, "w", encoding="utf-8") as g:
            while g.tell() < 20_000_000 and (line := f.readline()):
                g.write(line)
        numesh_cli("data", "bpe", "--src", str(sample), "--vocab-size", str(args.vocab_size),
                   "--out", str(Path(tmp) / "bpe"))
        wall, rss = numesh_cli("data", "tokenize", "--tokenizer", str(Path(tmp) / "bpe" / "tokenizer.json"),
                               "--src", str(corpus), "--out", str(Path(tmp) / "tok"))
        meta = json.loads((Path(tmp) / "tok" / "meta.json").read_text())
        tokens = meta["train_tokens"] + meta["val_tokens"]
        print(f"numesh data tokenize: {wall:.0f} s, {tokens:,} tokens, {tokens / wall:,.0f} tokens/s, "
              f"{size / wall / 1e6:.1f} MB/s, peak RSS {rss:.0f} MB ({os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
