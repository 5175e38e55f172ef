"""Context parallelism: activation memory per rank, throughput, and what overlapping the
ring's transfers buys.

    python benchmarks/bench_context_parallel.py memory                  # cp=1
    mpirun -n 4 python benchmarks/bench_context_parallel.py memory      # cp=4 (the world size)
    python benchmarks/bench_context_parallel.py speed --block-size 1024
    mpirun -n 2 python benchmarks/bench_context_parallel.py speed --block-size 1024
    mpirun -n 2 python benchmarks/bench_context_parallel.py overlap --block-size 1024

`memory`: one forward of the whole model on a cp=world mesh (default: 2048 tokens, 2
layers, width 128, 4 heads, batch 1, float32, no dropout), then the bytes of the unique
arrays its saved contexts hold (arrays that are views are counted once, by the array that
owns the memory), per rank and by kind, beside `numesh.perf.formulas.activation_bytes`, as one
JSON line.
`speed`: median ms and tokens/s of training steps on cp=world (one BLAS thread per rank).
`overlap`: one layer's ring attention forward+backward on cp=world, with the next K/V
transfer posted before the current block's compute or only after it, runs alternating,
medians of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numesh  # noqa: F401  # isort: skip  (before numpy: it sets up OpenBLAS, see numesh/__init__.py)
import attrs
import numpy as np
from mpi4py import MPI

from numesh.host.runtime import configure_process
from numesh.mesh import Mesh
from numesh.nn.context_parallel import MeshRing, take_local
from numesh.nn.gpt import GPTConfig, init_gpt
from numesh.nn.ring_attention import ring_attention_bwd, ring_attention_fwd
from numesh.nn.walk import ResidentParams, stage_forward, whole_model
from numesh.perf import formulas
from numesh.run.config import config_from
from numesh.run.train import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_SRC, dataset_dir  # noqa: E402

WORLD = MPI.COMM_WORLD


def _owner(x: np.ndarray) -> np.ndarray:
    while isinstance(x.base, np.ndarray):
        x = x.base
    return x


def unique_arrays(obj: Any, out: dict[int, tuple[str, np.ndarray]], where: str = "") -> None:
    """Every array a context holds, keyed by the array owning its memory (views once)."""
    if isinstance(obj, np.ndarray):
        own = _owner(obj)
        out.setdefault(id(own), (where, own))
    elif isinstance(obj, (tuple, list)):
        for i, o in enumerate(obj):
            unique_arrays(o, out, where)
    elif attrs.has(type(obj)):
        for f in attrs.fields(type(obj)):
            unique_arrays(getattr(obj, f.name), out, f"{type(obj).__name__}.{f.name}")


def memory(args: argparse.Namespace) -> None:
    mesh = Mesh.parse(f"cp={WORLD.Get_size()}", WORLD)
    cfg = GPTConfig(vocab_size=65, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd)
    dtype = np.float64 if args.dtype == "float64" else np.float32
    params = init_gpt(cfg, mesh, seed=0, dtype=dtype)
    rng = np.random.default_rng(0)
    idx, tgt = (rng.integers(0, 65, (args.batch, args.block_size)) for _ in range(2))
    cp, r = mesh.size("cp"), mesh.index("cp")
    _, ctx = stage_forward(ResidentParams(params), whole_model(cfg.n_layer), take_local(idx, cp, r),
                           take_local(tgt, cp, r), cfg, mesh)
    found: dict[int, tuple[str, np.ndarray]] = {}
    unique_arrays(ctx, found)
    param_ids = {id(_owner(x)) for x in _leaves(params)}
    kinds: dict[str, int] = {}
    for key, (where, x) in found.items():
        if key not in param_ids:  # a context may hold a parameter (LayerNorm's weight): not an activation
            kinds[where] = kinds.get(where, 0) + x.nbytes
    total = sum(kinds.values())
    per_rank = WORLD.gather(total, root=0)
    formula = formulas.activation_bytes(
        formulas.ActivationShape(args.batch, args.block_size, args.n_embd, args.n_head, cp=cp,
                                 itemsize=np.dtype(dtype).itemsize),
        formulas.Chunk(args.n_layer, first=True, last=True), vocab=65)
    if WORLD.Get_rank() == 0:
        print(json.dumps({"cp": cp, "block_size": args.block_size, "n_layer": args.n_layer, "n_embd": args.n_embd,
                          "n_head": args.n_head, "batch": args.batch, "dtype": args.dtype,
                          "bytes_per_rank_max": max(per_rank), "bytes_per_rank": per_rank,
                          "formula_bytes": formula,
                          "by_kind_rank0": dict(sorted(kinds.items(), key=lambda kv: -kv[1]))}))


def _leaves(tree: Any) -> list[np.ndarray]:
    from numesh.base.tree import tree_leaves

    return [x for x in tree_leaves(tree) if isinstance(x, np.ndarray)]


def speed(args: argparse.Namespace) -> None:
    n = WORLD.Get_size()
    with dataset_dir(args.data, args.src, WORLD) as data:
        cfg = config_from(dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size,
                               batch_size=args.batch, data=data, out="/tmp/numesh-bench-cp", mesh=f"cp={n}",
                               dtype=args.dtype, max_iters=10**6, warmup_iters=0))
        trainer = Trainer(cfg, WORLD)
        for _ in range(args.warmup):
            trainer.train_step()
        times = []
        for _ in range(args.iters):
            WORLD.Barrier()
            t0 = time.perf_counter()
            trainer.train_step()
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1e3
        if WORLD.Get_rank() == 0:
            print(json.dumps({"mesh": f"cp={n}", "block_size": args.block_size, "batch": args.batch,
                              "median_ms": round(ms, 1), "tokens_per_s": round(trainer.tokens_per_step / ms * 1e3),
                              "steps_ms": [round(t * 1e3, 1) for t in times]}))


def overlap(args: argparse.Namespace) -> None:
    mesh = Mesh.parse(f"cp={WORLD.Get_size()}", WORLD)
    ring = MeshRing(mesh)
    dtype = np.float64 if args.dtype == "float64" else np.float32
    hs = args.n_embd // args.n_head
    rng = np.random.default_rng(mesh.index("cp"))
    shape = (args.batch, args.n_head, args.block_size // mesh.size("cp"), hs)
    q, k, v, dy = (rng.standard_normal(shape).astype(dtype) for _ in range(4))
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(2 * (args.iters + args.warmup)):
        ov = i % 2 == 0  # alternate, so drifts in machine load hit both alike
        WORLD.Barrier()
        t0 = time.perf_counter()
        ctx = ring_attention_fwd(q, k, v, np.empty_like(q), ring, None, ov)
        ring_attention_bwd(ctx, dy, *(np.zeros_like(q) for _ in range(3)), ring, ov)
        dt = WORLD.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if i >= 2 * args.warmup:
            times[ov].append(dt)
    if WORLD.Get_rank() == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(json.dumps({"cp": mesh.size("cp"), "block_size": args.block_size, "batch": args.batch,
                          "heads": args.n_head, "head_size": hs, "runs_each": args.iters,
                          "median_ms_overlap": round(med[True], 2), "median_ms_no_overlap": round(med[False], 2),
                          "saving": round(1 - med[True] / med[False], 3)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("memory", "speed", "overlap"))
    ap.add_argument("--block-size", type=int, default=2048)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1, help="BLAS threads per rank")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--data", default=None, help="a prepared dataset (else one is made from --src)")
    ap.add_argument("--src", default=DEFAULT_SRC)
    args = ap.parse_args()
    configure_process(args.threads, WORLD)
    {"memory": memory, "speed": speed, "overlap": overlap}[args.what](args)


if __name__ == "__main__":
    main()
