"""The loss head's cross-entropy, forward and backward, beside torch's, at real vocabularies.

    python benchmarks/bench_cross_entropy.py                       # 2,048 tokens × 65 ... 49,152; 1,024 × 128,256
    python benchmarks/bench_cross_entropy.py --shapes 2048x49152 --rounds 9

For each tokens × vocabulary (float32 logits, 2 threads): numesh's vocab-parallel
cross-entropy on a 1-rank mesh (numesh.nn.parallel: the fused row kernels,
numesh.host.kernels' `ce_rows` and `ce_bwd`, rows over the threads), the same function on
its NumPy passes (the kernels switched off), and torch's `F.cross_entropy` forward and
autograd backward on the same logits and targets (mean over tokens, as numesh's trainer
scales its loss). The vocabularies: 65 (the character-level benchmarks' tiny Shakespeare),
21,528 (the BPE `numesh data bpe --vocab-size 49152` makes of it), 49,152 (SmolLM2) and
128,256 (Llama 3). Interleaved rounds; the median and minimum of each in ms, and the
largest difference of the per-token losses from torch's. Asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Callable

import numesh  # noqa: F401  # isort: skip  (before numpy: it sets up OpenBLAS, see numesh/__init__.py)
import numpy as np

from numesh.host import kernels as K
from numesh.host.runtime import configure_process
from numesh.mesh import Mesh
from numesh.nn.parallel import vocab_parallel_cross_entropy_bwd, vocab_parallel_cross_entropy_fwd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import describe, machine, ns_per_element  # noqa: E402


def _sides(n: int, v: int, threads: int) -> tuple[dict[str, Callable[[], None]], float | None]:
    """The sides, each one forward + backward from fresh logits, and torch's loss gap."""
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((n, v)) * 3).astype(np.float32)
    targets = rng.integers(0, v, n)
    work = np.empty_like(logits)
    mesh = Mesh.create()

    def numesh_side(kernels: bool) -> Callable[[], None]:
        def run() -> None:
            np.copyto(work, logits)  # the forward overwrites its logits, as the model's head lets it
            with K.switched(kernels):
                _, ctx = vocab_parallel_cross_entropy_fwd(work, targets, v, mesh)
                vocab_parallel_cross_entropy_bwd(ctx, 1.0 / n)
        return run

    sides = {"numesh, fused row kernels": numesh_side(True), "numesh, NumPy passes": numesh_side(False)}
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return sides, None
    torch.set_num_threads(threads)
    tl, tt = torch.from_numpy(logits), torch.from_numpy(targets)

    def torch_side() -> None:
        x = tl.clone().requires_grad_(True)
        F.cross_entropy(x, tt).backward()

    sides["torch F.cross_entropy"] = torch_side
    np.copyto(work, logits)
    loss, _ = vocab_parallel_cross_entropy_fwd(work, targets, v, mesh)
    ref = F.cross_entropy(tl, tt, reduction="none").numpy()
    return sides, float(np.max(np.abs(loss - ref)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="2048x65,2048x21528,2048x49152,1024x128256",
                    help="tokens x vocabulary, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    configure_process(args.threads, None)
    print(describe(machine()))
    for shape in args.shapes.split(","):
        n, v = (int(x) for x in shape.split("x"))
        sides, gap = _sides(n, v, args.threads)
        times = ns_per_element(sides, n * v, args.rounds, reps=1)
        print(f"\ncross-entropy forward + backward, {n:,} tokens × {v:,} logits, float32, {args.threads} threads, "
              f"{args.rounds} rounds" + ("" if gap is None else f"; per-token loss within {gap:.1e} of torch's"))
        print("| side | median ms | min ms | ns a logit |")
        print("|---|---|---|---|")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"| {name} | {med * n * v / 1e6:.2f} | {min(ts) * n * v / 1e6:.2f} | {med:.3f} |")


if __name__ == "__main__":
    main()
