"""`numesh plan` at scale against published runs: predicted throughput per GPU beside the
published figure, for the paper's own layout on a profile of its hardware.

    python benchmarks/bench_plan_scale.py

Runs of Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", Table 1 (weak scaling on NVIDIA Selene, DGX A100 80 GB nodes;
vocabulary 51,200, sequence 2048, mixed precision, activation recomputation). The paper
reports teraFLOP/s per GPU counting 96·B·s·l·h²·(1 + s/6h + V/16lh) FLOPs per iteration
(recomputation's extra forward included); tokens/s per GPU = that / FLOPs per token.
What the table does not give and we assume: one sequence per micro-batch, the 1F1B
schedule (not interleaved), no ZeRO (Megatron's optimiser was not sharded then).
"""

from __future__ import annotations

import argparse

import numesh  # noqa: F401  (before numpy: it sets up OpenBLAS, see numesh/__init__.py)
from numesh.plan.hardware import load_profile
from numesh.plan.layout import Layout, ModelSpec
from numesh.plan.timing import predict_time

# (name, params, heads, hidden, layers, tp, pp, gpus, batch, published TFLOP/s per GPU)
RUNS = [
    ("18.4B", 18.4e9, 48, 6144, 40, 8, 1, 256, 1024, 135.0),
    ("145.6B", 145.6e9, 96, 12288, 80, 8, 8, 1536, 2304, 148.0),
    ("1008B", 1008e9, 160, 25600, 128, 8, 64, 3072, 3072, 163.0),
]
SEQ, VOCAB = 2048, 51200


def paper_flops_per_token(layers: int, hidden: int) -> float:
    """Narayanan et al.'s FLOPs per token (with recomputation): 96·l·h²·(1 + s/6h + V/16lh) / s per sequence token."""
    return 96 * layers * hidden**2 * (1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hardware", default="a100-80gb")
    args = ap.parse_args()
    prof = load_profile(args.hardware)
    print(f"{'run':>7} {'GPUs':>5} {'tp,pp,dp':>9} {'published':>10} {'predicted':>10} {'error':>7}   "
          f"(TFLOP/s per GPU, paper's count; tokens/s per GPU)")
    for name, _, heads, hidden, layers, tp, pp, gpus, batch, published in RUNS:
        dp = gpus // (tp * pp)
        model = ModelSpec(layers, heads, hidden, SEQ, VOCAB, batch)
        layout = Layout(dp, tp, pp, 0, "1f1b", batch // dp, recompute="full")
        t = predict_time(model, layout, prof)
        tok_per_gpu = model.tokens_per_step / t.total / gpus
        ours = tok_per_gpu * paper_flops_per_token(layers, hidden) / 1e12
        theirs_tok = published * 1e12 / paper_flops_per_token(layers, hidden)
        err = (ours - published) / published * 100
        print(f"{name:>7} {gpus:>5} {f'{tp},{pp},{dp}':>9} {published:>10.0f} {ours:>10.0f} {err:>+6.1f}%   "
              f"({theirs_tok:.0f} vs {tok_per_gpu:.0f} tokens/s; step {t.total:.1f} s: compute {t.compute:.1f}, "
              f"tp {t.comm['tp']:.2f}, pp {t.comm['pp']:.2f}, dp {t.comm['dp']:.2f}, bubble {t.bubble:.2f})")


if __name__ == "__main__":
    main()
