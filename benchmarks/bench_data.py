#!/usr/bin/env python
"""What reading a dataset costs: batches per second, and checking its files.

    python benchmarks/bench_data.py                   # tiny Shakespeare and a 512 MiB split
    python benchmarks/bench_data.py --mib 2048 --repeats 500

Prepares a character dataset of tiny Shakespeare (--src) and one whose train split is
--mib MiB of random ids (written by hand, as a dataset of before the file records, so that
the same script runs on older numesh), then times `numesh.data.batches.local_batch` (the rows of
one training batch, what every step reads) at a few batch shapes on a warm page cache.
Where numesh has them, it then times the writer's records and checks
(`numesh.data.write.seal`) and a run's check at its start (`numesh.data.dataset.verify_dataset`:
the sha256 and the ids of every file) on the big split. A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import DEFAULT_SRC  # noqa: E402
from numesh.data.batches import local_batch, train_key
from numesh.data.char import prepare_char_dataset
from numesh.data.dataset import load_split, verify_dataset

SHAPES = ((12, 64), (64, 256), (8, 1024))  # (batch, block): the default run, a wider one, GPT-2's block
CHARS = [chr(c) for c in range(32, 97)]  # 65 symbols, as tiny Shakespeare has


def big_dataset(root: Path, mib: int) -> tuple[Path, np.ndarray]:
    """A character dataset whose train split is `mib` MiB of random ids, and those ids."""
    out = root / "big"
    out.mkdir()
    ids = np.random.default_rng(0).integers(0, len(CHARS), mib << 19, dtype=np.uint16)
    ids.tofile(out / "train.bin")
    ids[:100_000].tofile(out / "val.bin")
    meta = {"vocab_size": len(CHARS), "chars": CHARS, "train_tokens": int(ids.size), "val_tokens": 100_000}
    (out / "meta.json").write_text(json.dumps(meta))
    return out, ids


def batches_per_s(data, batch: int, block: int, repeats: int, rounds: int = 5) -> float:
    """The best of `rounds` rates over `repeats` batches each (other work on the cores only slows a round)."""
    local_batch(data, train_key(0, 0), batch, block, 0, 1, 1)  # warm
    best = 0.0
    for r in range(rounds):
        t0 = time.perf_counter()
        for step in range(repeats):
            local_batch(data, train_key(r, step), batch, block, 0, 1, 1)
        best = max(best, repeats / (time.perf_counter() - t0))
    return best


def time_checks(root: Path, ids: np.ndarray) -> None:
    """The writer's records (`seal`) and a run's check at its start (`verify_dataset`)."""
    from numesh.data import write as dw

    out = root / "sealed"
    meta = {"vocab_size": len(CHARS), "chars": CHARS, "train_tokens": int(ids.size), "val_tokens": 100_000}
    with dw.staging(out) as stage:
        ids.tofile(stage / "train.bin")
        ids[:100_000].tofile(stage / "val.bin")
        t0 = time.perf_counter()
        meta = dw.seal(stage, meta, {"train.bin": ids.size, "val.bin": 100_000}, np.dtype("<u2"), len(CHARS))
        sealed = time.perf_counter() - t0
        dw.publish(stage, out, meta, overwrite=False)
    size = ids.nbytes + 200_000
    t0 = time.perf_counter()
    verify_dataset(out)
    verified = time.perf_counter() - t0
    for what, dt in (("seal (writer: records and checks)", sealed), ("verify_dataset (a run's start)", verified)):
        print(f"{what:>34}: {size / 2**20:,.0f} MiB in {dt:.2f} s ({size / dt / 1e9:.2f} GB/s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, default=DEFAULT_SRC)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=1000, help="batches per round (best of 5 rounds)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        small = Path(tmp) / "small"
        prepare_char_dataset(args.src.read_text(encoding="utf-8"), small)
        big, ids = big_dataset(Path(tmp), args.mib)
        for name, d in (("tiny Shakespeare", small), (f"{args.mib} MiB", big)):
            data = load_split(d, "train")
            for b, t in SHAPES:
                rate = batches_per_s(data, b, t, args.repeats)
                print(f"{name:>16}  batch {b:>2} x block {t:>4}: {rate:>9,.0f} batches/s "
                      f"({rate * b * t / 1e6:,.1f} M tokens/s)")
        time_checks(Path(tmp), ids)


if __name__ == "__main__":
    main()
