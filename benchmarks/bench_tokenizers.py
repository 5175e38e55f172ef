#!/usr/bin/env python
"""Character-level against byte-level BPE on the same text, for the same training FLOPs,
compared in bits per byte.

    python benchmarks/bench_tokenizers.py                         # tiny Shakespeare, 2000 char steps
    python benchmarks/bench_tokenizers.py --steps 500 --plot tok.png

Prepares tiny Shakespeare (--src) twice, as a character dataset (`numesh data char`) and as
a byte-level BPE of --vocab-size entries (`numesh data bpe --split-on` a blank line), and
trains the default model (4 layers x 128, block 64, batch 12, `numesh train` defaults) on
each: the character run for --steps steps, the BPE run for as many steps as give the same
training FLOPs (`numesh.perf.formulas.flops_per_token` of each model: the BPE's larger
embedding costs more per token). Each run is a fresh `numesh train` process. Prints the
val loss in bits per byte at every evaluation beside the FLOPs spent, and the final
values; `--plot` draws both runs with `numesh plot` (loss, val bits per byte, tokens/s).
A benchmark: it asserts nothing. docs/benchmarks.md holds a run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import DEFAULT_SRC, PRESETS, log, metrics, numesh_cli, work_dir  # noqa: E402


def flops_per_token(data: Path) -> float:
    """Training FLOPs per token of the default model on this dataset's vocabulary, counted as
    `numesh train` counts them for MFU."""
    import math

    from numesh.base.tree import tree_leaves
    from numesh.data.dataset import load_tokenizer
    from numesh.nn.gpt import GPTConfig, gpt_global_shapes
    from numesh.perf import formulas

    m = PRESETS["default"]
    model = GPTConfig(vocab_size=load_tokenizer(data).vocab_size, block_size=m["block_size"], n_layer=m["n_layer"],
                      n_head=m["n_head"], n_embd=m["n_embd"])
    n_params = sum(math.prod(s) for s in tree_leaves(gpt_global_shapes(model)))
    return formulas.flops_per_token(model.n_layer, model.n_embd, model.block_size, n_params)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default=DEFAULT_SRC, help="the text (default: tiny Shakespeare beside the repository)")
    ap.add_argument("--steps", type=int, default=2000, help="steps of the character run (default 2000)")
    ap.add_argument("--vocab-size", type=int, default=1024, help="BPE size (default 1024)")
    ap.add_argument("--eval-interval", type=int, default=250, help="character steps between evaluations")
    ap.add_argument("--plot", default=None, help="write both runs' curves here (.png or .svg)")
    ap.add_argument("--keep", default=None, help="keep the datasets and runs in this directory")
    args = ap.parse_args(argv)
    with work_dir(args.keep, "numesh-tok-") as root:
        char, bpe = root / "data-char", root / "data-bpe"
        numesh_cli("data", "char", "--src", args.src, "--out", str(char))
        numesh_cli("data", "bpe", "--src", args.src, "--vocab-size", str(args.vocab_size), "--split-on", "\n\n",
               "--out", str(bpe))
        ratio = flops_per_token(char) / flops_per_token(bpe)
        plan = {"char": (char, args.steps, args.eval_interval),
                "bpe": (bpe, round(args.steps * ratio), max(1, round(args.eval_interval * ratio)))}
        for name, (data, steps, every) in plan.items():
            log(f"training {name}: {steps} steps, evaluating every {every}")
            numesh_cli("train", "--data", str(data), "--out", str(root / f"run-{name}"), "--max-iters", str(steps),
                   "--eval-interval", str(every), "--overwrite")
        print(f"same training FLOPs: char {args.steps} steps, BPE-{args.vocab_size} {plan['bpe'][1]} steps "
              f"(its FLOPs per token are {1 / ratio:.3f}x the char model's)")
        print("| run | step | training TFLOP | val loss (nats/token) | val bits per byte |")
        print("|---|---|---|---|---|")
        for name, (data, _, _) in plan.items():
            tokens = 12 * PRESETS["default"]["block_size"]
            for r in (r for r in metrics(root / f"run-{name}") if "val_bpb" in r):
                tflop = r["step"] * tokens * flops_per_token(data) / 1e12
                print(f"| {name} | {r['step']} | {tflop:.2f} | {r['val_loss']:.4f} | {r['val_bpb']:.4f} |")
        if args.plot:
            numesh_cli("plot", str(root / "run-char"), str(root / "run-bpe"), "--out", args.plot)
            print(f"curves: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
