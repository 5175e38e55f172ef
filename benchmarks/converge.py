"""Does numesh learn as well as PyTorch? Train both for a whole run and compare val loss.

    python benchmarks/converge.py [--iters 2000] [--eval-batches 400] [--same-init]

Runs `numesh train`'s default config (nanoGPT's CPU quick start) on one process, then the
PyTorch nanoGPT (numesh.testing.torch_nanogpt, trained as bench_train.py trains it) with the
same hyper-parameters on the same batches, and evaluates both on the same `--eval-batches`
val and train batches (more than training's 20, so the comparison is not within the noise
of the eval sample). `--same-init` also starts
torch from numesh's initial weights. A benchmark script: it prints numbers, asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numesh  # noqa: F401  # isort: skip  (before numpy: it sets up OpenBLAS, see numesh/__init__.py)
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import import_torch, torch_trainer  # noqa: E402
from common import DEFAULT_SRC, dataset_dir, log  # noqa: E402


def eval_batches(data: np.ndarray, seed: int, split: str, n: int, batch: int, block: int) -> list:
    from numesh.data.batches import eval_key, local_batch

    return [local_batch(data, eval_key(seed, split, i), batch, block, 0, 1, 1)[0] for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=2000, help="training steps (default: the config's 2000)")
    ap.add_argument("--eval-batches", type=int, default=400, help="val/train batches for the final comparison")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--same-init", action="store_true", help="start torch from numesh's initial weights")
    ap.add_argument("--data", default=None, help="dataset dir from `numesh data` (default: prepared from --src)")
    ap.add_argument("--src", default=DEFAULT_SRC)
    args = ap.parse_args(argv)

    from mpi4py import MPI

    from numesh.base.tree import tree_map
    from numesh.host.runtime import keep_freed_memory, set_blas_threads
    from numesh.run.config import config_from
    from numesh.run.train import Trainer

    threads = set_blas_threads(args.threads)
    keep_freed_memory()
    torch = import_torch()
    with dataset_dir(args.data, args.src, log=log) as data:
        cfg = config_from({"data": data, "max_iters": args.iters, "out": "/dev/null/unused"})
        print(f"config: numesh train defaults, {args.iters} steps, threads={threads}, "
              f"final eval on {args.eval_batches} batches per split")
        trainer = Trainer(cfg, MPI.COMM_SELF)
        init = tree_map(np.copy, trainer.gathered_params())  # the trainer updates its arrays in place
        t0 = time.perf_counter()
        for i in range(args.iters):
            trainer.train_step()
            if (i + 1) % 500 == 0:
                log(f"numesh step {i + 1}")
        t_numesh = time.perf_counter() - t0
        rows = [("numesh", t_numesh, _numesh_eval(trainer, cfg, args.eval_batches))]

        if torch is not None:
            torch.set_num_threads(threads)
            model, _params, step, _losses = torch_trainer(
                torch, cfg, trainer.model.vocab_size, trainer.train_data, "sdpa", "default",
                init if args.same_init else None,
            )
            t0 = time.perf_counter()
            for i in range(args.iters):
                step(i)
                if (i + 1) % 500 == 0:
                    log(f"torch step {i + 1}")
            t_torch = time.perf_counter() - t0
            rows.append(("torch", t_torch, _torch_eval(torch, model, trainer, cfg, args.eval_batches)))

    print(f"{'':8} {'train s':>8} {'train loss':>11} {'val loss':>9}   (mean over {args.eval_batches} batches; "
          f"the first 20 = training's eval: train/val)")
    for name, secs, ev in rows:
        print(f"{name:8} {secs:8.1f} {ev['train']:11.4f} {ev['val']:9.4f}   "
              f"first 20: {ev['train20']:.4f}/{ev['val20']:.4f}")
    return 0


def _summary(per_batch: dict[str, list[float]]) -> dict[str, float]:
    out = {}
    for split, losses in per_batch.items():
        out[split] = float(np.mean(losses))
        out[split + "20"] = float(np.mean(losses[:20]))
    return out


def _numesh_eval(trainer, cfg, n: int) -> dict[str, float]:
    per_batch = {}
    for split, data in (("train", trainer.train_data), ("val", trainer.val_data)):
        batches = eval_batches(data, cfg.seed, split, n, cfg.batch_size, cfg.block_size)
        per_batch[split] = [trainer.pipeline.forward_losses([b]) / trainer.tokens_per_step for b in batches]
    return _summary(per_batch)


def _torch_eval(torch, model, trainer, cfg, n: int) -> dict[str, float]:
    model.eval()
    per_batch = {}
    with torch.no_grad():
        for split, data in (("train", trainer.train_data), ("val", trainer.val_data)):
            batches = eval_batches(data, cfg.seed, split, n, cfg.batch_size, cfg.block_size)
            per_batch[split] = [float(model(torch.from_numpy(x), torch.from_numpy(y))) for x, y in batches]
    return _summary(per_batch)


if __name__ == "__main__":
    raise SystemExit(main())
