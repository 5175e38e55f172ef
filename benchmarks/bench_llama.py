#!/usr/bin/env python
"""A Llama-family model: numesh beside Hugging Face transformers' `LlamaForCausalLM` trained
in PyTorch eager, side by side in one run (issue 40's benchmark).

    python benchmarks/bench_llama.py                              # 512 x 4 and 2048 x 1, 2 threads, 2 rounds
    python benchmarks/bench_llama.py --rows 512x4 --rounds 3 --iters 8 --json
    python benchmarks/bench_llama.py --same-init --iters 3        # also: both sides' losses from one init
    python benchmarks/bench_llama.py --base /tmp/numesh-before    # also another numesh checkout: before/after
    python benchmarks/bench_llama.py --vocab 49152 --rounds 3     # SmolLM2-135M's vocabulary width

The model is SmolLM2-135M's block (HuggingFaceTB/SmolLM2-135M: 576 wide, 9 query heads
sharing 3 key/value heads, head size 64, SwiGLU of 1,536, RMSNorm eps 1e-5, rotary theta
1e5, LM head tied to the embedding, no biases) cut to --layers of its 30 blocks (default 4),
with the vocabulary of the data: tiny Shakespeare, character-level (65 tokens;
../shared/data/tinyshakespeare.txt, or --data a prepared dataset), or with `--vocab 49152`
SmolLM2-135M's own width: a byte-level BPE of the text (21,528 entries, all the merges tiny
Shakespeare holds) padded with reserved tokens to 49,152 (`common.padded_bpe_dataset`), so
the embedding, the tied LM head and the cross-entropy are the real model's. Rows are T x B,
~2048 tokens per step by default.

Both sides train on the same batches (numesh's step-keyed random windows of the same
token file: `numesh.data.batches.local_batch`) with the same hyper-parameters
(TrainConfig's defaults: AdamW lr 1e-3 with numesh's cosine schedule, betas (0.9, 0.99),
eps 1e-8, weight decay 0.1 on matrices and embeddings only, global-norm clipping at 1.0),
in float32 on --threads threads:
  numesh  `numesh.run.train.Trainer.train_step()` (`numesh train --arch llama`'s step).
  torch   transformers' LlamaForCausalLM(attn_implementation="sdpa", use_cache=False), the
          cross-entropy of its logits against the same targets, backward,
          clip_grad_norm_, torch.optim.AdamW step, zero_grad, loss.item();
          torch.set_num_threads(--threads).
Each measurement is a fresh process (so its ru_maxrss is its own peak RSS), numesh and
torch alternating for --rounds rounds; each reports the median step over --iters steps
after --warmup, its minor page faults per step (memory the allocator handed back and took
again), and the cores other processes used meanwhile ("other cpu": on a shared machine a
row well above 0 is not a clean measurement). The header names the CPU, its
vector ISA, numpy's BLAS (OpenBLAS's kernel family) and torch's CPU capability.

`--base DIR` measures a second numesh, the checkout at DIR (a `git worktree add DIR COMMIT`
of the code before a change), as a third side in each round: the same workers with DIR
first on PYTHONPATH (each run reports where its numesh came from), so before, after and
torch alternate on the same machine state.

Ratios are numesh tokens/s over torch's, per round (> 1: numesh faster). The target of
issue 40 is >= 1.25x at no more peak RSS. This is a benchmark: it asserts nothing;
tests/test_bench_llama.py runs one tiny step of each worker. docs/benchmarks.md holds its
output.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import numesh  # noqa: E402,F401  # isort: skip  (before numpy: it sets up OpenBLAS, see numesh/__init__.py)
from common import (  # noqa: E402
    DEFAULT_SRC,
    RESERVED,
    SMOLLM2,
    CpuMonitor,
    alternate,
    blas_info,
    dataset_dir,
    isa_flags,
    log,
    machine,
    monitor_fields,
    peak_rss_mb,
    ratio_span,
    run_json,
    span,
    timed_steps,
    torch_training,
    worker_env,
)

ROWS = "512x4,2048x1"


def train_config(model: dict[str, Any], data: str, seed: int = 1337):
    """The TrainConfig both sides train with: the model, float32, one rank."""
    from numesh.run.config import config_from

    return config_from({**model, "data": data, "dtype": "float32", "seed": seed, "mesh": ""})


def _result(times: list[float], mon: CpuMonitor, tokens: int, losses: list[float], **extra) -> dict[str, Any]:
    med = statistics.median(times)
    cpu = None if mon.own_cores is None else mon.own_cores * statistics.fmean(times) * 1e3
    return {"ms": med * 1e3, "ms_all": [round(t * 1e3, 1) for t in times], "tokens_per_s": tokens / med,
            "cpu_ms": cpu,
            "rss_mb": peak_rss_mb(), "losses": losses, **monitor_fields(mon, len(times)), **extra}


# --------------------------------------------------------------------------------------
# workers: one measurement each, in a fresh process, printing one JSON line


def worker_numesh(model: dict[str, Any], data: str, threads: int, warmup: int, iters: int) -> dict[str, Any]:
    from numesh.host import kernels
    from numesh.host.runtime import configure_process
    from numesh.run.train import Trainer

    n = configure_process(threads, None)
    trainer = Trainer(train_config(model, data))
    kernels.warm_up(trainer.dtype)
    try:
        from numesh.host import llama_kernels  # not in a --base from before it existed
    except ImportError:
        pass
    else:
        llama_kernels.warm_up(trainer.dtype)
    losses: list[float] = []
    times, mon = timed_steps(lambda _i: losses.append(trainer.train_step()[0]), warmup, iters)
    return _result(times, mon, trainer.tokens_per_step, losses, threads=n, n_params=trainer.n_params,
                   blas=blas_info(), numesh_path=str(Path(numesh.__file__).resolve().parents[1]))


def hf_llama(torch, transformers, tc, same_init: bool = False):
    """transformers' LlamaForCausalLM of TrainConfig `tc`'s model, SDPA attention, float32:
    its config.json as `numesh export --format hf` writes it, and with `same_init` numesh's
    initial parameters (its seed, one rank) through the export's own tensor names, so the
    two loss curves can be compared step by step (`--same-init`)."""
    from numesh.checkpoint.hf import llama_config
    from numesh.run.config import validate

    _, gcfg = validate(tc, 1)
    hf_cfg = transformers.LlamaConfig.from_dict(llama_config(gcfg, "llama", None, "float32"), use_cache=False,
                                                attn_implementation="sdpa")
    torch.manual_seed(tc.seed)
    model = transformers.LlamaForCausalLM(hf_cfg).float()
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    if same_init:  # one rank: the vocabulary is not padded (MPI only then: the measured side starts without it)
        import numpy as np
        from mpi4py import MPI

        from numesh.checkpoint.hf_llama import to_llama
        from numesh.mesh import Mesh
        from numesh.nn.gpt import init_gpt

        sd = to_llama(init_gpt(gcfg, Mesh.create(comm=MPI.COMM_SELF), tc.seed, np.float32), gcfg)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(torch.from_numpy(sd[name]))
    return model


def hf_training(torch, transformers, tc, train_data, same_init: bool = False):
    """(parameters, step, losses) of transformers' Llama for TrainConfig `tc` (hf_llama) trained
    on numesh's batches of `train_data` (common.torch_training)."""
    model = hf_llama(torch, transformers, tc, same_init)
    model.train()

    def loss_of(x, y):
        logits = model(input_ids=x.long()).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.long().reshape(-1))

    return torch_training(torch, model, tc, train_data, loss_of)


def worker_torch(model_spec: dict[str, Any], data: str, threads: int, warmup: int, iters: int,
                 same_init: bool = False) -> dict[str, Any]:
    import torch
    import transformers

    from numesh.data.dataset import load_split

    torch.set_num_threads(threads)
    tc = train_config(model_spec, data)
    params, step, losses = hf_training(torch, transformers, tc, load_split(data, "train"), same_init)
    times, mon = timed_steps(step, warmup, iters)
    return _result(times, mon, tc.batch_size * tc.block_size, losses, threads=torch.get_num_threads(),
                   n_params=sum(p.numel() for p in params), torch=torch.__version__,
                   transformers=transformers.__version__, torch_cpu=torch_cpu(torch))


def describe_tokenizer(meta: dict[str, Any]) -> str:
    """A dataset's tokenizer as the report names it: character-level, or a Hugging Face
    tokenizer and how many of its entries are `--vocab`'s reserved padding."""
    tok = meta.get("tokenizer", {})
    if tok.get("kind") != "hf":
        return "character-level"
    added = [t.get("content", "") for t in json.loads(tok["json"]).get("added_tokens", [])]
    reserved = sum(a.startswith(RESERVED) for a in added)
    return "a Hugging Face tokenizer" + (f" ({meta['vocab_size'] - reserved:,} learned entries and {reserved:,} "
                                         f"reserved ones the text never uses)" if reserved else "")


def torch_cpu(torch) -> str:
    """torch's CPU kernels: its vector capability and the BLAS it was built with."""
    cap = torch.backends.cpu.get_cpu_capability()
    return f"capability {cap}, MKL {torch.backends.mkl.is_available()}, oneDNN {torch.backends.mkldnn.is_available()}"


# --------------------------------------------------------------------------------------
# the driver


def run_worker(kind: str, model: dict[str, Any], data: str, threads: int, warmup: int, iters: int,
               same_init: bool = False, timeout: float = 3600, base: str | None = None) -> dict[str, Any]:
    """One measurement in a fresh process: its JSON, or {"error": ...}. Kind "base" is the
    numesh worker with the checkout `base` first on PYTHONPATH."""
    worker = "numesh" if kind == "base" else kind
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", worker, "--threads", str(threads),
           "--warmup", str(warmup), "--iters", str(iters), "--data", data, "--model", json.dumps(model)]
    if same_init:
        cmd.append("--same-init")
    res = run_json(cmd, worker_env(base if kind == "base" else None), timeout)
    if "error" not in res and kind == "base" and Path(res["numesh_path"]) != Path(base).resolve():
        return {"error": f"--base {base}: the worker imported numesh from {res['numesh_path']}"}
    return res


def parse_rows(spec: str) -> list[tuple[int, int]]:
    """'512x4,2048x1' -> [(512, 4), (2048, 1)]: block size x batch size."""
    rows = []
    for item in spec.split(","):
        t, _, b = item.strip().partition("x")
        if not (t.isdigit() and b.isdigit() and int(t) > 0 and int(b) > 0):
            raise SystemExit(f"error: --rows takes TxB,... (e.g. {ROWS}), got {item!r}")
        rows.append((int(t), int(b)))
    return rows


def _said(r: dict[str, Any]) -> str:
    """A measurement as the progress log says it."""
    return (f"{r['ms']:.0f} ms, {r['rss_mb']:.0f} MB, {r['minor_faults_per_iter']:,.0f} page faults/step, other cpu "
            f"{r['other_cpu_cores']:.2f}") if "ms" in r else r["error"]


def measure(args: argparse.Namespace, data: str) -> list[dict[str, Any]]:
    out = []
    for T, B in parse_rows(args.rows):
        model = dict(SMOLLM2, n_layer=args.layers, block_size=T, batch_size=B)
        runs = alternate(("base", "numesh", "torch") if args.base else ("numesh", "torch"), args.rounds,
                         lambda kind: run_worker(kind, model, data, args.threads, args.warmup, args.iters,
                                                 args.same_init, timeout=args.timeout, base=args.base),
                         f"{T}x{B}", _said)
        out.append({"T": T, "B": B, **runs})
    return out


def print_report(rep: dict[str, Any]) -> None:
    m = rep["machine"]
    print(f"machine: {m['cpu']}, {m['cpu_count']} cpus, ISA {' '.join(rep['isa']) or 'unknown'}; "
          f"python {m['python']}, numpy {m['numpy']}, numba {m['numba']}, torch {m['torch']}; {rep['date']}")
    for b in rep["numpy_blas"]:
        print(f"BLAS loaded: {b['internal_api']} {b['version']}, kernel {b['architecture']}")
    print(f"numesh's GEMMs on: {m.get('gemm', '?')}")
    print(f"torch: {rep.get('torch_cpu', '(no torch measurement)')}, transformers {rep.get('transformers', '?')}")
    print(f"load avg before / after: {rep['load_before']} / {rep['load_after']}")
    print(f"\nSmolLM2-135M's block x {rep['layers']} layers (576 wide, 9 heads, 3 kv heads, SwiGLU 1536, tied, "
          f"theta 1e5), {rep['data']} (vocab {rep['vocab_size']:,}); float32, {rep['threads']} threads, "
          f"{rep['iters']} timed steps after {rep['warmup']}, fresh process per measurement, {rep['rounds']} "
          f"round(s) alternating")
    print("| T × B | numesh ms | torch ms | numesh / torch tokens/s | numesh tokens/s | torch tokens/s | "
          "numesh peak RSS MB | torch peak RSS MB | numesh / torch RSS | numesh page faults/step | other cpu |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rep["rows"]:
        print(f"| {r['T']} × {r['B']} | {span(r['numesh'], 'ms', '.0f')} | {span(r['torch'], 'ms', '.0f')} | "
              f"**{ratio_span(r, 'tokens_per_s')}** | {span(r['numesh'], 'tokens_per_s', ',.0f')} | "
              f"{span(r['torch'], 'tokens_per_s', ',.0f')} | {span(r['numesh'], 'rss_mb', '.0f')} | "
              f"{span(r['torch'], 'rss_mb', '.0f')} | {ratio_span(r, 'rss_mb')} | "
              f"{span(r['numesh'], 'minor_faults_per_iter', ',.0f')} | "
              f"{span(r['numesh'] + r['torch'], 'other_cpu_cores', '.2f')} |")
    print("ratios per round: tokens/s numesh over torch (> 1: numesh faster), RSS numesh over torch (< 1: numesh "
          "smaller); other cpu = cores other processes used while the steps were timed")
    if rep["base"]:
        print(f"\n--base {rep['base']} (numesh before), in the same rounds:")
        print("| T × B | base ms | numesh ms | numesh / base tokens/s | base CPU ms/step | numesh CPU ms/step | "
              "base peak RSS MB | numesh peak RSS MB | base page faults/step | numesh page faults/step |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rep["rows"]:
            print(f"| {r['T']} × {r['B']} | {span(r['base'], 'ms', '.0f')} | {span(r['numesh'], 'ms', '.0f')} | "
                  f"**{ratio_span(r, 'tokens_per_s', 'base')}** | {span(r['base'], 'cpu_ms', '.0f')} | "
                  f"{span(r['numesh'], 'cpu_ms', '.0f')} | {span(r['base'], 'rss_mb', '.0f')} | "
                  f"{span(r['numesh'], 'rss_mb', '.0f')} | {span(r['base'], 'minor_faults_per_iter', ',.0f')} | "
                  f"{span(r['numesh'], 'minor_faults_per_iter', ',.0f')} |")
        print("CPU ms/step: this process's CPU time per timed step (both threads; a numesh thread that waits spins "
              "up to 10 ms before it sleeps, numesh.host.spin, so idle waits count too since 3604a81)")
    if rep["same_init"]:
        for r in rep["rows"]:
            for a, b in zip(r["numesh"], r["torch"]):
                if "losses" in a and "losses" in b:
                    diff = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
                    print(f"same init, {r['T']} × {r['B']}: losses {a['losses'][0]:.4f} -> {a['losses'][-1]:.4f} "
                          f"(numesh), max |numesh - torch| over {len(a['losses'])} steps {diff:.2e}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=ROWS, help=f"block size x batch size, comma-separated (default {ROWS})")
    ap.add_argument("--layers", type=int, default=4, help="blocks of SmolLM2-135M's 30 (default 4)")
    ap.add_argument("--threads", type=int, default=2, help="threads per process, both sides (default 2)")
    ap.add_argument("--rounds", type=int, default=2, help="numesh/torch rounds per row (default 2)")
    ap.add_argument("--iters", type=int, default=5, help="timed steps per measurement (default 5)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--same-init", action="store_true",
                    help="load numesh's initial weights into the transformers model and print the loss difference")
    ap.add_argument("--base", default=None,
                    help="another numesh checkout (e.g. a `git worktree` of the code before a change) measured too")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one measurement may take")
    ap.add_argument("--data", default=None, help="dataset dir from `numesh data` (default: a temporary one)")
    ap.add_argument("--src", default=DEFAULT_SRC, help="text for the temporary dataset")
    ap.add_argument("--vocab", type=int, default=0,
                    help="the temporary dataset's vocabulary: 0 (default) the text's characters, else a byte-level "
                         "BPE of the text padded with reserved tokens to this many entries (49152: SmolLM2-135M's)")
    ap.add_argument("--json", action="store_true", help="also print the report as one JSON line")
    ap.add_argument("--worker", choices=("numesh", "torch"), help=argparse.SUPPRESS)
    ap.add_argument("--model", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        model = json.loads(args.model)
        if args.worker == "numesh":
            res = worker_numesh(model, args.data, args.threads, args.warmup, args.iters)
        else:
            res = worker_torch(model, args.data, args.threads, args.warmup, args.iters, args.same_init)
        print(json.dumps(res), flush=True)
        return 0
    if min(args.layers, args.threads, args.rounds, args.iters) < 1 or args.warmup < 0:
        ap.error("--layers, --threads, --rounds and --iters must be >= 1, --warmup >= 0")
    parse_rows(args.rows)
    if args.vocab and args.data:
        ap.error(f"--vocab makes a temporary dataset, --data {args.data} names one: leave out one of them")
    if args.vocab and not 257 <= args.vocab < 1 << 32:
        ap.error(f"--vocab takes 0 (characters) or a byte-level BPE's size, from 257 (its bytes and end-of-text "
                 f"token) to 2**32 - 1 (uint32 ids), got {args.vocab}")
    if args.base and not (Path(args.base) / "numesh" / "__init__.py").is_file():
        ap.error(f"--base {args.base} holds no numesh package (numesh/__init__.py)")
    rep: dict[str, Any] = {"machine": machine(), "isa": isa_flags(), "numpy_blas": blas_info(),
                           "date": time.strftime("%Y-%m-%d"), "layers": args.layers, "threads": args.threads,
                           "iters": args.iters, "warmup": args.warmup, "rounds": args.rounds,
                           "same_init": args.same_init, "base": args.base,
                           "load_before": [round(x, 2) for x in os.getloadavg()]}
    with dataset_dir(args.data, args.src, log=log, vocab=args.vocab) as data:
        meta = json.loads((Path(data) / "meta.json").read_text())
        rep["vocab_size"] = meta["vocab_size"]
        rep["data"] = f"{data if data == args.data else Path(args.src).name}, {describe_tokenizer(meta)}"
        rep["rows"] = measure(args, data)
    rep["load_after"] = [round(x, 2) for x in os.getloadavg()]
    torch_runs = [r for row in rep["rows"] for r in row["torch"] if "torch_cpu" in r]
    if torch_runs:
        rep["torch_cpu"], rep["transformers"] = torch_runs[0]["torch_cpu"], torch_runs[0]["transformers"]
    print_report(rep)
    if args.json:
        print(json.dumps(rep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
