"""The first validation loss of a fine-tuning run against transformers' loss on the same tokens.

Runs `numesh train --init-from DIR --data DATA --max-iters 1` (under mpiexec with --ranks N,
e.g. `--ranks 3 --mesh tp=3`), reads the step-0 evaluation from its metrics.jsonl (taken
before any update: the imported weights' loss), then loads DIR with transformers'
`AutoModelForCausalLM` (float32 unless --dtype float64) and computes the mean cross-entropy
of the same validation batches (`numesh.data.batches`: the same seed, block and batch size
give the same rows on every mesh). Prints both, their difference and ln(vocabulary), the
loss of a model that knows nothing.

    python benchmarks/finetune_loss.py --init-from DIR --data DATA [--ranks 3 --mesh tp=3]
        [--block-size 128 --batch-size 8 --eval-iters 4 --dtype float32]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def transformers_val_loss(directory: str, data: str, seed: int, block: int, batch: int, iters: int,
                          dtype: str) -> float:
    import torch
    import transformers

    from numesh.data.batches import batch_offsets, eval_key, read_rows
    from numesh.data.dataset import load_split

    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, local_files_only=True, dtype=getattr(torch, dtype), experts_implementation="eager").eval()
    val = load_split(data, "val")
    total = 0.0
    for i in range(iters):
        x, y = read_rows(val, batch_offsets(eval_key(seed, "val", i), len(val), batch, block), block)
        with torch.no_grad():
            logits = model(torch.tensor(x)).logits.double()
        total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.tensor(y).reshape(-1),
                                                   reduction="mean").item()
    return total / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--init-from", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--mesh", default="")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--eval-iters", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    a = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="numesh-ft-loss-")) / "run"
    cmd = [str(Path(sys.executable).parent / "numesh"), "train", "--init-from", a.init_from, "--data", a.data,
           "--out", str(out), "--max-iters", "1", "--eval-iters", str(a.eval_iters), "--block-size",
           str(a.block_size), "--batch-size", str(a.batch_size), "--seed", str(a.seed), "--dtype", a.dtype,
           "--peak-flops", "1e12", *(["--mesh", a.mesh] if a.mesh else [])]
    if a.ranks > 1:
        cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(a.ranks), *cmd]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    ours = first["val_loss"]
    theirs = transformers_val_loss(a.init_from, a.data, a.seed, a.block_size, a.batch_size, a.eval_iters, a.dtype)
    vocab = json.loads((Path(a.init_from) / "config.json").read_text())["vocab_size"]
    print(f"numesh {a.mesh or '1 rank'} step-0 val loss {ours:.6f}, transformers {theirs:.6f}, "
          f"difference {abs(ours - theirs):.1e} ({a.dtype}, {a.eval_iters} x {a.batch_size} x {a.block_size} tokens); "
          f"ln(vocab) = {math.log(vocab):.4f}")
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4 if a.dtype == "float32" else 1e-5)


if __name__ == "__main__":
    main()
