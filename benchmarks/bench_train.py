#!/usr/bin/env python
"""Training speed: numesh next to PyTorch eager on the same model, data and threads.

    python benchmarks/bench_train.py --preset default            # nanoGPT's Shakespeare-char CPU quick start
    python benchmarks/bench_train.py --preset baby --iters 20    # 6x6x384, block 256
    python benchmarks/bench_train.py --no-torch --json

Both sides train the same nanoGPT architecture (tied embedding / LM head, pre-LN blocks,
GELU tanh, no biases, LayerNorm eps 1e-5), initialised the same way (N(0, 0.02), residual
projections N(0, 0.02/sqrt(2 n_layer)), LayerNorm weights 1), with AdamW (weight decay
only on >= 2-D parameters), global-norm clipping at 1.0 and numesh's cosine schedule, on
the same batches (numesh's step-keyed random offsets into the same uint16 train.bin).

What is timed, per iteration:
  numesh  Trainer.train_step(): batch draw, forward, backward, grad flatten, clip, AdamW.
  torch   batch draw, forward, backward, clip_grad_norm_, AdamW step, zero_grad, loss.item().
The batch draw (the same numpy code on both sides) is timed separately too and reported.

The process is set up as `numesh train` sets up a rank: `--threads` BLAS threads
(numesh.host.runtime.set_blas_threads; torch.set_num_threads on the torch side) and freed memory
kept for reuse (numesh.host.runtime.keep_freed_memory; `--malloc glibc` to leave glibc's
defaults and see the page faults they cost). Both run in one process, numesh first.
Beside the times, each row shows the CPU this process and *other* processes used while it
was timed, the kernel share of our CPU time and the page faults per iteration: on a small
shared machine, a row with "other cpu" well above 0 is not a clean measurement.
`--same-init` loads numesh's initial weights into the torch model: with the same batches
the two loss curves must then agree to float32 rounding (a check that the models match).

The torch model is numesh.testing.torch_nanogpt, the reference nanoGPT the tests use too.
torch is not a dependency of numesh: it is imported only when the comparison runs.
This is a benchmark script, not a test: it reports numbers and asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import numesh  # noqa: F401  # isort: skip  (before numpy: it sets up OpenBLAS, see numesh/__init__.py)
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    DEFAULT_SRC,
    LLAMA_PRESETS,
    PRESETS,
    blas_info,
    dataset_dir,
    log,
    machine,
    monitor_fields,
    timed_steps,
    torch_training,
)
from numesh.host.runtime import keep_freed_memory  # noqa: E402

TORCH_PIN = "torch==2.13.0"
TORCH_WHEEL_DIR = "/opt/wheels"


# --------------------------------------------------------------------------------------
# set-up shared with profile_train.py


def preset_config(preset: str, batch_size: int | None = None, block_size: int | None = None) -> dict[str, Any]:
    """The model and batch of `preset`: a nanoGPT one (PRESETS) or a Llama one (LLAMA_PRESETS)."""
    cfg = dict(PRESETS[preset] if preset in PRESETS else LLAMA_PRESETS[preset])
    if batch_size is not None:
        cfg["batch_size"] = batch_size
    if block_size is not None:
        cfg["block_size"] = block_size
    return cfg


def make_trainer(model_cfg: dict[str, Any], data: str, dtype: str = "float32", seed: int = 1337):
    """A single-process numesh Trainer for this model on this dataset."""
    from numesh.run.config import config_from
    from numesh.run.train import Trainer

    cfg = config_from({**model_cfg, "data": data, "dtype": dtype, "seed": seed, "dropout": 0.0, "bias": False,
                       "mesh": ""})
    return Trainer(cfg)


def summarize(times_s: list[float], tokens_per_iter: int) -> dict[str, float]:
    ms = [t * 1e3 for t in times_s]
    med = statistics.median(ms)
    return {
        "median_ms": med,
        "mean_ms": statistics.fmean(ms),
        "min_ms": min(ms),
        "max_ms": max(ms),
        "stdev_ms": statistics.stdev(ms) if len(ms) > 1 else 0.0,
        "tokens_per_s": tokens_per_iter / (med / 1e3),
        "iters": len(ms),
        "times_ms": [round(x, 3) for x in ms],
    }


# --------------------------------------------------------------------------------------
# numesh


def run_numesh(trainer, warmup: int, iters: int) -> dict[str, Any]:
    from numesh.data.batches import local_batch, train_key

    c = trainer.cfg
    losses: list[float] = []
    times, mon = timed_steps(lambda _i: losses.append(trainer.train_step()[0]), warmup, iters)
    # the batch draw alone (it is inside train_step)
    draw, _ = timed_steps(lambda i: local_batch(trainer.train_data, train_key(c.seed, i), c.batch_size, c.block_size,
                                                0, 1, 1), 0, iters)
    out = summarize(times, trainer.tokens_per_step)
    out.update(losses=losses, batch_draw_ms=statistics.median(draw) * 1e3, n_params=trainer.n_params,
               **monitor_fields(mon, iters))
    return out


# --------------------------------------------------------------------------------------
# PyTorch eager: the reference nanoGPT of numesh.testing.torch_nanogpt


def import_torch():
    """torch, or None with a note on how to install it (numesh never needs it)."""
    try:
        import torch
    except ImportError:
        wheels = sorted(Path(TORCH_WHEEL_DIR).glob("torch-*.whl")) if Path(TORCH_WHEEL_DIR).is_dir() else []
        log(f"torch is not installed, so only numesh is measured. To compare, install it into this environment:\n"
            f"    {sys.executable} -m pip install {TORCH_PIN}")
        if wheels:
            log(f"  (a local wheel is available: {sys.executable} -m pip install {wheels[-1]})")
        return None
    return torch


def copy_numesh_params(torch, model, params) -> None:
    """Load numesh's (tp=1) parameter tree into the torch model (for a loss-parity check)."""
    tr = model.transformer
    dtype = tr.wte.weight.dtype

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)

    with torch.no_grad():
        V = tr.wte.weight.shape[0]
        tr.wte.weight.copy_(t(params.wte[:V]))
        tr.wpe.weight.copy_(t(params.wpe))
        tr.ln_f.weight.copy_(t(params.ln_f.w))
        for blk, p in zip(tr.h, params.blocks):
            C = p.attn.qkv.w.shape[0]
            blk.ln_1.weight.copy_(t(p.ln1.w))
            blk.ln_2.weight.copy_(t(p.ln2.w))
            blk.attn.c_attn.weight.copy_(t(p.attn.qkv.w.reshape(C, -1).T))  # numesh w is [in, out]
            blk.attn.c_proj.weight.copy_(t(p.attn.proj.w.T))
            blk.mlp.c_fc.weight.copy_(t(p.mlp.fc.w.T))
            blk.mlp.c_proj.weight.copy_(t(p.mlp.proj.w.T))


def torch_trainer(torch, tc, vocab_size: int, train_data, attention: str, optim_impl: str, init_params=None):
    """(model, params, step function, losses list): the torch model and a step(i) that trains
    it on numesh's batch i with TrainConfig `tc`'s hyper-parameters, as nanoGPT does."""
    from numesh.testing.torch_nanogpt import nanogpt

    torch.manual_seed(tc.seed)
    model = nanogpt(vocab_size, tc.n_layer, tc.n_head, tc.n_embd, tc.block_size, bias=False, attention=attention)
    if init_params is not None:
        copy_numesh_params(torch, model, init_params)
    model.train()
    params, step, losses = torch_training(torch, model, tc, train_data, model, optim_impl)
    return model, params, step, losses


def run_torch(torch, tc, vocab_size: int, train_data, warmup: int, iters: int, attention: str,
              optim_impl: str, init_params=None) -> dict[str, Any]:
    """Time the torch model trained with TrainConfig `tc`'s hyper-parameters on numesh's batches."""
    _model, params, step, losses = torch_trainer(torch, tc, vocab_size, train_data, attention, optim_impl, init_params)
    times, mon = timed_steps(step, warmup, iters)
    out = summarize(times, tc.batch_size * tc.block_size)
    out.update(losses=losses, n_params=sum(p.numel() for p in params), **monitor_fields(mon, iters))
    return out


# --------------------------------------------------------------------------------------
# report


def env_info(threads: int) -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"),
        "OPENBLAS_THREAD_TIMEOUT": os.environ.get("OPENBLAS_THREAD_TIMEOUT"),
        "threads": threads,
        "cpu_count": os.cpu_count(),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "blas": blas_info(),
        "gemm": machine()["gemm"],
    }


def _cores(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def print_table(report: dict[str, Any]) -> None:
    r, e = report["results"], report["env"]
    c = report["config"]
    print(f"config: preset={c['preset']} n_layer={c['n_layer']} n_head={c['n_head']} n_embd={c['n_embd']} "
          f"block={c['block_size']} batch={c['batch_size']} dtype={c['dtype']} "
          f"tokens/iter={c['tokens_per_iter']} warmup={c['warmup']} iters={c['iters']}")
    kept = report.get("keep_freed_memory")
    reuse = "freed memory kept for reuse (numesh.host.runtime.keep_freed_memory)"
    print(f"malloc: {reuse if kept else 'glibc defaults'}")
    print(f"env: torch {report.get('torch_version') or '(not installed)'}, numpy {e['numpy']}, "
          f"OPENBLAS_CORETYPE={e['OPENBLAS_CORETYPE'] if e['OPENBLAS_CORETYPE'] is not None else '(unset)'}, "
          f"OPENBLAS_THREAD_TIMEOUT={e['OPENBLAS_THREAD_TIMEOUT']}, "
          f"threads={e['threads']} (cpus {e['cpu_count']}), load avg before/after "
          f"{report['load_before']} / {report['load_after']}")
    for b in e["blas"]:
        print(f"BLAS loaded: {b['internal_api']} {b['version']} {b['architecture']} num_threads={b['num_threads']}")
    print(f"numesh's GEMMs on: {e.get('gemm', '?')}")
    if "torch_blas" in report:
        print(f"torch: {report['torch_blas']}")
    print()
    head = (f"{'impl':<14} {'ms/iter (median)':>16} {'mean':>8} {'min':>8} {'tokens/s':>10} {'ratio':>7}"
            f" {'own cpu':>8} {'other cpu':>9} {'sys%':>5} {'faults/iter':>11}")
    print(head)
    print("-" * len(head))
    base = r["numesh"]["median_ms"]
    for name, v in r.items():
        ratio = v["median_ms"] / base if name != "numesh" else 1.0
        print(f"{name:<14} {v['median_ms']:>16.2f} {v['mean_ms']:>8.2f} {v['min_ms']:>8.2f} "
              f"{v['tokens_per_s']:>10,.0f} {ratio:>7.2f} "
              f"{_cores(v['own_cpu_cores']):>8} {_cores(v['other_cpu_cores']):>9}"
              f" {_pct(v['sys_share']):>5} {v['minor_faults_per_iter']:>11,.0f}")
    print("ratio = impl ms / numesh ms (median): > 1 means numesh is faster")
    print("own cpu / other cpu = cores busy in this process / in all other processes during the timed iterations;")
    print("sys% = share of this process's CPU time spent in the kernel; faults/iter = minor page faults per iteration")
    print()
    for name, v in r.items():
        ls = v["losses"]
        print(f"{name}: params {v['n_params']:,}, loss step 0 {ls[0]:.4f} -> step {len(ls) - 1} {ls[-1]:.4f}")
    if "loss_max_abs_diff" in report:
        print("same init + same batches: max |loss_numesh - loss_torch| over all steps = "
              f"{report['loss_max_abs_diff']:.2e}")
    print(f"batch draw (numpy, included in both timings): {r['numesh']['batch_draw_ms']:.3f} ms")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="default")
    ap.add_argument("--batch-size", type=int, default=None, help="override the preset's batch size")
    ap.add_argument("--block-size", type=int, default=None, help="override the preset's context length")
    ap.add_argument("--iters", type=int, default=50, help="timed iterations (default 50)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed iterations first (default 5)")
    ap.add_argument("--threads", type=int, default=2, help="BLAS / intra-op threads on both sides (default 2)")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--data", default=None, help="dataset dir from `numesh data` (default: prepare a temporary one)")
    ap.add_argument("--src", default=DEFAULT_SRC,
                    help=f"text to prepare the temporary dataset from (default {DEFAULT_SRC})")
    ap.add_argument("--no-torch", action="store_true", help="measure numesh only")
    ap.add_argument("--torch-attention", choices=("sdpa", "manual"), default="sdpa",
                    help="torch attention: scaled_dot_product_attention (nanoGPT's default) or explicit softmax")
    ap.add_argument("--torch-optim", choices=("default", "foreach", "fused"), default="default",
                    help="torch AdamW implementation (default: torch's own choice, as nanoGPT on CPU)")
    ap.add_argument("--same-init", action="store_true",
                    help="load numesh's initial weights into the torch model and report the loss difference")
    ap.add_argument("--malloc", choices=("keep", "glibc"), default="keep",
                    help="keep: keep freed memory for reuse as `numesh train` does (default); "
                         "glibc: the allocator's defaults, to see the page-fault cost")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    if args.iters < 1 or args.warmup < 0 or args.threads < 1:
        ap.error("--iters and --threads must be >= 1, --warmup >= 0")

    from numesh.host.runtime import set_blas_threads

    threads = set_blas_threads(args.threads)  # numpy's BLAS; torch.set_num_threads(threads) below
    kept = keep_freed_memory() if args.malloc == "keep" else False
    if args.malloc == "keep" and not kept:
        log("note: could not tune the allocator (needs glibc); running with its defaults")
    model_cfg = preset_config(args.preset, args.batch_size, args.block_size)
    load_before = [round(x, 2) for x in os.getloadavg()]
    report: dict[str, Any] = {"env": env_info(threads), "load_before": load_before, "keep_freed_memory": kept}
    results: dict[str, Any] = {}
    with dataset_dir(args.data, args.src, log=log) as data:
        trainer = make_trainer(model_cfg, data, args.dtype, args.seed)
        init_params = None
        if args.same_init:
            from numesh.base.tree import tree_map

            init_params = tree_map(np.copy, trainer.params)
        c = trainer.cfg
        report["config"] = {"preset": args.preset, **model_cfg, "dtype": args.dtype, "warmup": args.warmup,
                            "iters": args.iters, "tokens_per_iter": trainer.tokens_per_step,
                            "vocab_size": trainer.model.vocab_size}
        log(f"numesh: {args.warmup} + {args.iters} iterations ...")
        results["numesh"] = run_numesh(trainer, args.warmup, args.iters)
        torch = None if args.no_torch else import_torch()
        if torch is not None:
            if args.dtype != "float32":
                torch.set_default_dtype(torch.float64)
            torch.set_num_threads(threads)
            report["torch_version"] = torch.__version__
            report["torch_blas"] = (f"{torch.get_num_threads()} intra-op threads, "
                                    f"MKL={torch.backends.mkl.is_available()}, "
                                    f"mkldnn={torch.backends.mkldnn.is_available()}, "
                                    f"attention={args.torch_attention}, AdamW={args.torch_optim}")
            log(f"torch {torch.__version__}: {args.warmup} + {args.iters} iterations ...")
            name = "torch-eager"
            results[name] = run_torch(torch, c, trainer.model.vocab_size, trainer.train_data, args.warmup, args.iters,
                                      args.torch_attention, args.torch_optim, init_params)
            results[name]["batch_draw_ms"] = results["numesh"]["batch_draw_ms"]
            if init_params is not None:
                a, b = np.array(results["numesh"]["losses"]), np.array(results[name]["losses"])
                report["loss_max_abs_diff"] = float(np.max(np.abs(a - b)))
            results[name]["ratio"] = results[name]["median_ms"] / results["numesh"]["median_ms"]
        elif not args.no_torch:
            report["torch_version"] = None
            report["torch_install"] = f"{sys.executable} -m pip install {TORCH_PIN}"
    report["load_after"] = [round(x, 2) for x in os.getloadavg()]
    report["results"] = results
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
