#!/usr/bin/env python
"""Mixture of experts: a dense model and an MoE of the same width, then the MoE step against
a dense step of the same active FLOPs per token, on one rank and on two (issue 32).

    python benchmarks/bench_moe.py                    # 500 steps each, 2 rounds (~8 min on 2 cores)
    python benchmarks/bench_moe.py --steps 100 --rounds 3
    python benchmarks/bench_moe.py --no-ep            # the one-rank runs only

Every configuration trains through `numesh train` in a fresh process, on tiny Shakespeare
(character level), the default preset's batch (12 x 64) and float32, with `--peak-flops`
given so no peak is measured. The rounds alternate the configurations (dense, MoE, matched
dense, dense, MoE, ...), and every run trains the same `--steps` steps, so:

  val loss      the last evaluation of round 1 (`--eval-iters` batches, at the last step)
  FLOPs/token   active training FLOPs per token (numesh.perf.formulas: 6 per parameter a token
                uses, only its k of E experts, plus attention), as MFU counts them
  step ms       median `dt_ms` of metrics.jsonl over the steps after `--skip` of every round
  load max/min  the MoE's most / fewest token-assignments of any expert in any block,
                median over the steps after `--warmup` (the learning-rate warm-up), of round 1

The matched dense model keeps the preset's depth and widens it (n_embd a multiple of
n_head) or keeps the width and deepens it, whichever comes closest to the MoE's active
FLOPs per token; both counts are printed. The issue's target: MoE step <= 1.5x that step.
On two ranks (`mpiexec -n 2`, one thread each) the MoE runs on `--mesh ep=2` (four experts
a rank, tokens to their experts by all-to-all) and the matched dense model on `dp=2`, the
same global batch; the same ratio is printed for them.
This is a benchmark script, not a test: it reports numbers and asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_SRC, PRESETS, dataset_dir, log, metrics, venv_tool  # noqa: E402

TARGET = 1.5  # issue 32: an MoE step at most 1.5x a dense step of the same active FLOPs


def model_flops(m: dict[str, Any], vocab: int) -> float:
    """Active training FLOPs per token of model `m` (numesh.perf.formulas, as MFU counts them)."""
    from numesh.perf import formulas as F

    C, L, E = m["n_embd"], m["n_layer"], m.get("moe_experts", 0)
    moe_blocks = len(range(0, L, m.get("moe_every", 1))) if E else 0
    n = F.outer_params(C, vocab, m["block_size"]) + (L - moe_blocks) * F.block_params(C)
    n += moe_blocks * F.moe_block_params(C, E) if E else 0
    active = F.active_params(n, C, moe_blocks, E, m.get("moe_top_k", 2)) if E else n
    return F.flops_per_token(L, C, m["block_size"], active)


def matched_dense(base: dict[str, Any], target: float, vocab: int) -> dict[str, Any]:
    """The dense model closest to `target` FLOPs per token: `base` widened (n_embd a multiple
    of n_head) at its depth, or deepened at its width."""
    h = base["n_head"]
    cands = [{**base, "n_embd": c} for c in range(h, 8 * base["n_embd"] + 1, h)]
    cands += [{**base, "n_layer": n} for n in range(1, 8 * base["n_layer"] + 1)]
    return min(cands, key=lambda m: abs(model_flops(m, vocab) / target - 1))


def train_args(m: dict[str, Any], data: str, out: str, args: argparse.Namespace) -> list[str]:
    a = [venv_tool("numesh"), "train", "--data", data, "--out", out, "--max-iters", str(args.steps),
         "--eval-interval", str(args.steps), "--eval-iters", str(args.eval_iters), "--peak-flops", "1e12",
         "--dtype", "float32", "--seed", str(args.seed), "--warmup-iters", str(args.warmup)]
    for k in ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "moe_experts", "moe_top_k", "moe_every"):
        if k in m:
            a += ["--" + k.replace("_", "-"), str(m[k])]
    return a


def run_one(m: dict[str, Any], data: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train `m` in a fresh `numesh train` process (or `mpiexec -n 2` ones when `m` names a
    mesh); its step times, last val loss, loads."""
    with tempfile.TemporaryDirectory(prefix="numesh-bench-moe-") as out:
        cmd = train_args(m, data, out, args)
        threads = args.threads
        if "mesh" in m:  # two ranks share the cores
            cmd = [venv_tool("mpiexec"), "-n", "2", *cmd, "--mesh", m["mesh"]]
            threads = max(1, args.threads // 2)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"numesh train failed ({p.returncode}):\n{p.stderr[-3000:]}")
        rows = metrics(out)
    steps = [r for r in rows if "dt_ms" in r]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    after = [r for r in steps if r["step"] >= args.warmup and "moe_tokens_min" in r]
    spread = [r["moe_tokens_max"] / r["moe_tokens_min"] if r["moe_tokens_min"] else float("inf") for r in after]
    return {"run_flops": steps[0]["flops_per_s"] / steps[0]["tokens_per_s"],
            "dt_ms": [r["dt_ms"] for r in steps if r["step"] >= args.skip], "val_loss": val[-1] if val else None,
            "tok_min": statistics.median(r["moe_tokens_min"] for r in after) if after else None,
            "tok_max": statistics.median(r["moe_tokens_max"] for r in after) if after else None,
            "spread": statistics.median(spread) if spread else None}


def describe(m: dict[str, Any]) -> str:
    s = f"{m['n_layer']}x{m['n_embd']}"
    s += f", {m['moe_experts']} experts top-{m['moe_top_k']}" if m.get("moe_experts") else ""
    return s + (f", {m['mesh']}" if "mesh" in m else "")


def print_report(models: dict[str, dict[str, Any]], res: dict[str, list[dict[str, Any]]],
                 flops: dict[str, float], args: argparse.Namespace) -> None:
    med = {k: statistics.median(statistics.median(r["dt_ms"]) for r in v) for k, v in res.items()}
    print(f"tiny Shakespeare (char), batch {args.batch_size} x {args.block_size}, float32, 1 rank, "
          f"{args.threads} threads, {args.steps} steps, {args.rounds} alternating rounds of fresh processes")
    head = f"{'model':<16} {'shape':<32} {'val loss':>8} {'FLOPs/token':>12} {'step ms':>8} {'load max/min':>22}"
    print(head)
    print("-" * len(head))
    for k, m in models.items():
        r0 = res[k][0]
        load = "-" if r0["spread"] is None else f"{r0['tok_max']:.0f}/{r0['tok_min']:.0f} = {r0['spread']:.2f}"
        print(f"{k:<16} {describe(m):<32} {r0['val_loss']:>8.4f} {flops[k] / 1e6:>11.2f}M {med[k]:>8.1f} "
              f"{load:>22}")
    print("step ms per round: " + "; ".join(
        f"{k} " + " ".join(f"{statistics.median(r['dt_ms']):.1f}" for r in v) for k, v in res.items()))
    pairs = (("moe", "dense-flops", "1 rank"), ("moe-ep2", "dense-flops-dp2", "2 ranks, ep=2 vs dp=2"))
    for moe, dense, where in pairs:
        if moe in med:
            ratio = med[moe] / med[dense]
            print(f"MoE step / dense step of the same active FLOPs ({flops[moe]:,.0f} vs {flops[dense]:,.0f} per "
                  f"token), {where}: {ratio:.2f}x (target <= {TARGET}x: {'met' if ratio <= TARGET else 'not met'})")
    print(f"load max/min: median over steps >= {args.warmup} of round 1 of the most / fewest "
          f"token-assignments of any expert in any block (ideal 1.00)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=500, help="optimiser steps of every run (default 500)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of the three runs (default 2)")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-every", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=100, help="learning-rate warm-up steps (default 100)")
    ap.add_argument("--skip", type=int, default=5, help="first steps left out of the step time (default 5)")
    ap.add_argument("--eval-iters", type=int, default=20, help="val batches of the evaluations (default 20)")
    ap.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of every run (default 2)")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--data", default=None, help="dataset dir from `numesh data` (default: prepare a temporary one)")
    ap.add_argument("--src", default=DEFAULT_SRC, help=f"text for the temporary dataset (default {DEFAULT_SRC})")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--no-ep", dest="ep", action="store_false", help="skip the two-rank runs (ep=2 against dp=2)")
    args = ap.parse_args(argv)
    if args.steps <= max(args.warmup, args.skip) or args.rounds < 1:
        ap.error("--steps must exceed --warmup and --skip, --rounds must be >= 1")
    base = dict(PRESETS["default"])
    args.batch_size, args.block_size = base["batch_size"], base["block_size"]
    moe = {**base, "moe_experts": args.experts, "moe_top_k": args.top_k, "moe_every": args.moe_every}
    with dataset_dir(args.data, args.src, log=log) as data:
        vocab = json.loads(Path(data, "meta.json").read_text())["vocab_size"]
        models = {"dense": base, "moe": moe}
        models["dense-flops"] = matched_dense(base, model_flops(moe, vocab), vocab)
        if args.ep:
            models["moe-ep2"] = {**moe, "mesh": "ep=2"}
            models["dense-flops-dp2"] = {**models["dense-flops"], "mesh": "dp=2"}
        flops = {k: model_flops(m, vocab) for k, m in models.items()}
        res: dict[str, list[dict[str, Any]]] = {k: [] for k in models}
        for i in range(args.rounds):
            for k, m in models.items():
                log(f"round {i + 1}/{args.rounds}: {k} ({describe(m)}), {args.steps} steps ...")
                res[k].append(run_one(m, data, args))
                if abs(res[k][-1]["run_flops"] / flops[k] - 1) > 1e-3:  # the run's own count (its MFU's)
                    log(f"note: {k}: numesh train counts {res[k][-1]['run_flops']:,.0f} FLOPs/token, "
                        f"the formulas here {flops[k]:,.0f}")
    if args.json:
        print(json.dumps({"models": models, "flops_per_token": flops, "results": res}))
    else:
        print_report(models, res, flops, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
