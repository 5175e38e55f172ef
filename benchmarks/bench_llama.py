#!/usr/bin/env python
"""A Llama-family model: numesh beside Hugging Face transformers' `LlamaForCausalLM` trained
in PyTorch eager, side by side in one run (issue 40's benchmark).

    python benchmarks/bench_llama.py                              # 512 x 4 and 2048 x 1, 2 threads, 2 rounds
    python benchmarks/bench_llama.py --rows 512x4 --rounds 3 --iters 8 --json
    python benchmarks/bench_llama.py --same-init --iters 3        # also: both sides' losses from one init
    python benchmarks/bench_llama.py --base /tmp/numesh-before    # also another numesh checkout: before/after

The model is SmolLM2-135M's block (HuggingFaceTB/SmolLM2-135M: 576 wide, 9 query heads
sharing 3 key/value heads, head size 64, SwiGLU of 1,536, RMSNorm eps 1e-5, rotary theta
1e5, LM head tied to the embedding, no biases) cut to --layers of its 30 blocks (default 4),
with the vocabulary of the data: tiny Shakespeare, character-level (65 tokens;
../shared/data/tinyshakespeare.txt, or --data a prepared dataset). Rows are T x B, ~2048
tokens per step by default.

Both sides train on the same batches (numesh's step-keyed random windows of the same
uint16 train.bin: `numesh.data.batches.local_batch`) with the same hyper-parameters
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
after --warmup, and the cores other processes used meanwhile ("other cpu": on a shared
machine a row well above 0 is not a clean measurement). The header names the CPU, its
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
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import numesh  # noqa: E402,F401  # isort: skip  (before numpy: it sets up OpenBLAS, see numesh/__init__.py)
from bench_node import machine  # noqa: E402
from bench_train import CpuMonitor, blas_info, monitor_fields  # noqa: E402
from common import DEFAULT_SRC, SMOLLM2, dataset_dir  # noqa: E402

ROWS = "512x4,2048x1"
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def train_config(model: dict[str, Any], data: str, seed: int = 1337):
    """The TrainConfig both sides train with: the model, float32, one rank."""
    from numesh.run.config import config_from

    return config_from({**model, "data": data, "dtype": "float32", "seed": seed, "mesh": ""})


def _timed(step, first: int, warmup: int, iters: int) -> tuple[list[float], CpuMonitor]:
    """Run step(first), ..., step(first + warmup + iters - 1); the last `iters` timed."""
    for i in range(first, first + warmup):
        step(i)
    times = []
    with CpuMonitor() as mon:
        for i in range(first + warmup, first + warmup + iters):
            t0 = time.perf_counter()
            step(i)
            times.append(time.perf_counter() - t0)
    return times, mon


def _result(times: list[float], mon: CpuMonitor, tokens: int, losses: list[float], **extra) -> dict[str, Any]:
    med = statistics.median(times)
    cpu = None if mon.own_cores is None else mon.own_cores * statistics.fmean(times) * 1e3
    return {"ms": med * 1e3, "ms_all": [round(t * 1e3, 1) for t in times], "tokens_per_s": tokens / med,
            "cpu_ms": cpu,
            "rss_mb": _peak_rss_mb(), "losses": losses, **monitor_fields(mon, len(times)), **extra}


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
    times, mon = _timed(lambda _i: losses.append(trainer.train_step()[0]), 0, warmup, iters)
    return _result(times, mon, trainer.tokens_per_step, losses, threads=n, n_params=trainer.n_params,
                   blas=blas_info(), numesh_path=str(Path(numesh.__file__).resolve().parents[1]))


def _load_numesh_init(torch, model, tc) -> None:
    """Copy numesh's initial parameters (its seed, tp=1) into the transformers model, so the
    two loss curves can be compared step by step (`--same-init`)."""
    import numpy as np
    from mpi4py import MPI

    from numesh.mesh import Mesh
    from numesh.nn.gpt import init_gpt
    from numesh.run.config import validate

    _, gcfg = validate(tc, 1)
    p = init_gpt(gcfg, Mesh.create(comm=MPI.COMM_SELF), tc.seed, np.float32)
    V = gcfg.vocab_size

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a))

    sd = {"model.embed_tokens.weight": t(p.wte[:V]), "model.norm.weight": t(p.ln_f.w)}
    if p.lm_head is not None:
        sd["lm_head.weight"] = t(p.lm_head[:V])
    for i, b in enumerate(p.blocks):
        h = f"model.layers.{i}."
        sd.update({h + "input_layernorm.weight": t(b.ln1.w), h + "post_attention_layernorm.weight": t(b.ln2.w),
                   h + "self_attn.q_proj.weight": t(b.attn.q.w.T), h + "self_attn.k_proj.weight": t(b.attn.k.w.T),
                   h + "self_attn.v_proj.weight": t(b.attn.v.w.T), h + "self_attn.o_proj.weight": t(b.attn.proj.w.T),
                   h + "mlp.gate_proj.weight": t(b.mlp.gate.w.T), h + "mlp.up_proj.weight": t(b.mlp.fc.w.T),
                   h + "mlp.down_proj.weight": t(b.mlp.proj.w.T)})
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(sd[name])


def hf_llama(torch, transformers, tc, vocab_size: int):
    """transformers' LlamaForCausalLM of TrainConfig `tc`'s shape, SDPA attention, float32."""
    hf_cfg = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=tc.n_embd, intermediate_size=tc.ffn_hidden, num_hidden_layers=tc.n_layer,
        num_attention_heads=tc.n_head, num_key_value_heads=tc.n_kv_head or tc.n_head,
        max_position_embeddings=tc.block_size, rms_norm_eps=tc.norm_eps, rope_theta=tc.rope_theta,
        tie_word_embeddings=tc.tie_embeddings, attention_bias=tc.bias, mlp_bias=tc.bias, use_cache=False,
        attn_implementation="sdpa")
    torch.manual_seed(tc.seed)
    model = transformers.LlamaForCausalLM(hf_cfg).float()
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    return model


def worker_torch(model_spec: dict[str, Any], data: str, threads: int, warmup: int, iters: int,
                 same_init: bool = False) -> dict[str, Any]:
    import torch
    import transformers

    from numesh.data.batches import local_batch, train_key
    from numesh.data.dataset import load_split
    from numesh.optim import cosine_lr

    torch.set_num_threads(threads)
    tc = train_config(model_spec, data)
    train_data = load_split(data, "train")
    vocab = json.loads((Path(data) / "meta.json").read_text())["vocab_size"]
    model = hf_llama(torch, transformers, tc, vocab)
    if same_init:
        _load_numesh_init(torch, model, tc)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": tc.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=tc.learning_rate, betas=(tc.beta1, tc.beta2), eps=1e-8)
    losses: list[float] = []

    def step(i: int) -> None:
        (x, y), = local_batch(train_data, train_key(tc.seed, i), tc.batch_size, tc.block_size, 0, 1, 1)
        xb, yb = torch.from_numpy(x.astype("int64")), torch.from_numpy(y.astype("int64"))
        for g in opt.param_groups:
            g["lr"] = cosine_lr(i, tc.learning_rate, tc.min_lr, tc.warmup_iters, tc.lr_decay_iters)
        logits = model(input_ids=xb).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), yb.reshape(-1))
        loss.backward()
        if tc.grad_clip > 0.0:
            torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    times, mon = _timed(step, 0, warmup, iters)
    return _result(times, mon, tc.batch_size * tc.block_size, losses, threads=torch.get_num_threads(),
                   n_params=sum(p.numel() for p in params), torch=torch.__version__,
                   transformers=transformers.__version__, torch_cpu=torch_cpu(torch))


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
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    if kind == "base":
        env["PYTHONPATH"] = os.pathsep.join([str(base), *filter(None, [env.get("PYTHONPATH")])])
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {p.returncode}: " + " | ".join(tail)}
    res = json.loads(lines[-1])
    if kind == "base" and Path(res["numesh_path"]) != Path(base).resolve():
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


def isa() -> list[str]:
    """The vector extensions of ISA_FLAGS this CPU has (/proc/cpuinfo; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return [f for f in ISA_FLAGS if f in flags]


def measure(args: argparse.Namespace, data: str) -> list[dict[str, Any]]:
    out = []
    for T, B in parse_rows(args.rows):
        model = dict(SMOLLM2, n_layer=args.layers, block_size=T, batch_size=B)
        kinds = ("base", "numesh", "torch") if args.base else ("numesh", "torch")
        runs: dict[str, list[dict]] = {k: [] for k in kinds}
        for rnd in range(args.rounds):
            for kind in kinds:
                r = run_worker(kind, model, data, args.threads, args.warmup, args.iters, args.same_init,
                               timeout=args.timeout, base=args.base)
                said = (f"{r['ms']:.0f} ms, {r['rss_mb']:.0f} MB, other cpu {r['other_cpu_cores']:.2f}"
                        if "ms" in r else r["error"])
                log(f"  {T}x{B} round {rnd + 1} {kind}: {said}")
                runs[kind].append(r)
        out.append({"T": T, "B": B, **runs})
    return out


def _span(rs: list[dict], key: str, spec: str) -> str:
    vals = [r[key] for r in rs if key in r]
    if not vals:
        return "error: " + "; ".join(r.get("error", "?") for r in rs)
    lo, hi = format(min(vals), spec), format(max(vals), spec)
    return lo if lo == hi else f"{lo}–{hi}"


def _ratio_span(row: dict, key: str, over: str = "torch") -> str:
    """numesh over `over` (torch, or base) of `key`, per round (each round's runs back to back)."""
    rs = [a[key] / b[key] for a, b in zip(row["numesh"], row[over]) if key in a and key in b]
    if not rs:
        return "n/a"
    return f"{min(rs):.2f}×" if len(rs) == 1 else f"{min(rs):.2f}–{max(rs):.2f}×"


def print_report(rep: dict[str, Any]) -> None:
    m = rep["machine"]
    print(f"machine: {m['cpu']}, {m['cpu_count']} cpus, ISA {' '.join(rep['isa']) or 'unknown'}; "
          f"python {m['python']}, numpy {m['numpy']}, numba {m['numba']}, torch {m['torch']}; {rep['date']}")
    for b in rep["numpy_blas"]:
        print(f"numpy BLAS: {b['internal_api']} {b['version']}, kernel {b['architecture']}")
    print(f"torch: {rep.get('torch_cpu', '(no torch measurement)')}, transformers {rep.get('transformers', '?')}")
    print(f"load avg before / after: {rep['load_before']} / {rep['load_after']}")
    print(f"\nSmolLM2-135M's block x {rep['layers']} layers (576 wide, 9 heads, 3 kv heads, SwiGLU 1536, tied, "
          f"theta 1e5), tiny Shakespeare char-level (vocab {rep['vocab_size']}); float32, {rep['threads']} threads, "
          f"{rep['iters']} timed steps after {rep['warmup']}, fresh process per measurement, {rep['rounds']} "
          f"round(s) alternating")
    print("| T × B | numesh ms | torch ms | numesh / torch tokens/s | numesh tokens/s | torch tokens/s | "
          "numesh peak RSS MB | torch peak RSS MB | numesh / torch RSS | other cpu |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rep["rows"]:
        print(f"| {r['T']} × {r['B']} | {_span(r['numesh'], 'ms', '.0f')} | {_span(r['torch'], 'ms', '.0f')} | "
              f"**{_ratio_span(r, 'tokens_per_s')}** | {_span(r['numesh'], 'tokens_per_s', ',.0f')} | "
              f"{_span(r['torch'], 'tokens_per_s', ',.0f')} | {_span(r['numesh'], 'rss_mb', '.0f')} | "
              f"{_span(r['torch'], 'rss_mb', '.0f')} | {_ratio_span(r, 'rss_mb')} | "
              f"{_span(r['numesh'] + r['torch'], 'other_cpu_cores', '.2f')} |")
    print("ratios per round: tokens/s numesh over torch (> 1: numesh faster), RSS numesh over torch (< 1: numesh "
          "smaller); other cpu = cores other processes used while the steps were timed")
    if rep["base"]:
        print(f"\n--base {rep['base']} (numesh before), in the same rounds:")
        print("| T × B | base ms | numesh ms | numesh / base tokens/s | base CPU ms/step | numesh CPU ms/step | "
              "base peak RSS MB | numesh peak RSS MB |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rep["rows"]:
            print(f"| {r['T']} × {r['B']} | {_span(r['base'], 'ms', '.0f')} | {_span(r['numesh'], 'ms', '.0f')} | "
                  f"**{_ratio_span(r, 'tokens_per_s', 'base')}** | {_span(r['base'], 'cpu_ms', '.0f')} | "
                  f"{_span(r['numesh'], 'cpu_ms', '.0f')} | {_span(r['base'], 'rss_mb', '.0f')} | "
                  f"{_span(r['numesh'], 'rss_mb', '.0f')} |")
        print("CPU ms/step: this process's CPU time per timed step (both threads; numesh's threads block, never "
              "spin): steadier than wall time on a busy machine")
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
    ap.add_argument("--src", default=DEFAULT_SRC, help="text for the temporary character dataset")
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
    if args.base and not (Path(args.base) / "numesh" / "__init__.py").is_file():
        ap.error(f"--base {args.base} holds no numesh package (numesh/__init__.py)")
    rep: dict[str, Any] = {"machine": machine(), "isa": isa(), "numpy_blas": blas_info(),
                           "date": time.strftime("%Y-%m-%d"), "layers": args.layers, "threads": args.threads,
                           "iters": args.iters, "warmup": args.warmup, "rounds": args.rounds,
                           "same_init": args.same_init, "base": args.base,
                           "load_before": [round(x, 2) for x in os.getloadavg()]}
    with dataset_dir(args.data, args.src, log=log) as data:
        rep["vocab_size"] = json.loads((Path(data) / "meta.json").read_text())["vocab_size"]
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
