#!/usr/bin/env python
"""Long contexts: numesh beside PyTorch eager (SDPA) as the context grows, and the fused
attention kernel beside the time of its FLOPs.

    python benchmarks/bench_long_context.py                        # both sections, 2 threads
    python benchmarks/bench_long_context.py --sections attention --threads 1
    python benchmarks/bench_long_context.py --sections attention --attn-head-size 64 --attn-heads 9/3  # SmolLM2's
    python benchmarks/bench_long_context.py --rows default:2048x1,baby:1024x2 --rounds 3
    python benchmarks/bench_long_context.py --sections tiles --threads 1 --clock cpu  # a shared machine
    python benchmarks/bench_long_context.py --sections copies --threads 1
    python benchmarks/bench_long_context.py --sections products --threads 1 --clock cpu --rounds 5
    python benchmarks/bench_long_context.py --sections stripes --threads 1 --clock cpu --rounds 3
    python benchmarks/bench_long_context.py --sections model --base ../before   # before/after a change

Sections:
  model      training steps of the default model (4 layers × 128, 4 heads) at T × B = 64×32,
             256×8, 1024×2, 2048×1 and 4096×1 (~2048 tokens per step; 4096 tokens at the
             last row, where B cannot shrink further) and of the baby model (6 × 384, 6
             heads) at 256×8 and 1024×2: each measurement a fresh process
             (benchmarks/bench_node.py's workers), numesh and torch alternating, --rounds
             rounds; median step ms over --iters steps after --warmup, the ratio of tokens/s
             (numesh / torch) and each process's peak RSS.
  attention  one layer's attention core alone, forward + backward, float32, T = 2048,
             heads × head size = 128 (--attn-head-size, default 32: 4 heads; --attn-heads
             H/Hkv another count, with grouped-query attention, e.g. 9/3): numesh's
             `attend_fwd`/`attend_bwd` and torch's
             `scaled_dot_product_attention(is_causal=True)` with its backward, each a fresh
             process (median of --attn-runs), alternating for --rounds; the causal half's FLOPs (7 GEMMs over each
             query's visible keys: numesh.perf.formulas.attention_flops) and the time they take
             at the machine's GEMM rate (numesh.host.runtime.gemm_flops of a 1024³ float32 GEMM on
             the same threads): the kernel's time over that is its distance from the GEMM
             bound; and the kernel's GEMMs alone (its passes made no-ops, in the Python stripe
             loop: on several threads that one also waits for the GIL between calls), which
             shows how much of that distance is BLAS at these skinny (head-size) shapes.

  loops      (on request) the kernel at T = 2048 in this process on --threads threads with
             its stripe loops compiled (numesh.host.attention_kernels) and in Python,
             alternating: what the compiled loops save by taking the GIL once per group.
  tiles      (on request) the kernel at T = 2048 for query tiles of 64, 128, 256, 512 and
             key tiles of 512, 1024, 2048, at each head size of --head-sizes (32, 64, 128;
             heads × head size = 128), interleaved, medians and minima: what
             numesh.nn.attention's QUERY_TILE and KEY_TILE were chosen from.
  copies     (on request) the kernel as a training step calls it (in a block's pieces, q, k,
             v strided through the QKV buffer) at T = 256 to 2048, head sizes 32 and 64,
             with each group reading contiguous copies of its rows from 2 stripes, from 9
             (numesh.nn.attention.COPY_STRIPES) or never, interleaved: what COPY_STRIPES
             was chosen from.
  products   (on request) the kernel at the default model's, SmolLM2's and Llama 3's head
             sizes (32, 64, 128) with its tile products on numesh.host.tile_gemm and on
             BLAS, interleaved: what numesh.nn.attention.TILE_HEAD_SIZE was chosen from.
  stripes    (on request) the kernel at the default model's, SmolLM2's and Llama 3's head
             sizes from T = 256 to 2048 (q, k, v in the QKV buffer, as a block reads them)
             in stripes of 32, 64 and 128 query rows, interleaved: what
             numesh.nn.attention.TILE_QUERIES (tile products) and QUERY_TILE (BLAS) were
             chosen from.

Without torch installed, the torch sides are left out (said at the start, "—" in the
tables) and the rest is measured. Ratios above 1 mean numesh is faster. This is a
benchmark: it asserts nothing. The README's "Long context" table and docs/benchmarks.md
hold its output.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import numesh  # noqa: E402,F401  # isort: skip  (before numpy: it sets up OpenBLAS)
from bench_node import run_worker  # noqa: E402
from common import (  # noqa: E402
    DEFAULT_SRC,
    PRESETS,
    alternate,
    dataset_dir,
    describe,
    log,
    machine,
    ratio_span,
    run_json,
    span,
    step_clock,
    timed_steps,
)

ROWS = "default:64x32,default:256x8,default:1024x2,default:2048x1,default:4096x1,baby:256x8,baby:1024x2"


def parse_rows(spec: str) -> list[tuple[str, int, int]]:
    rows = []
    for item in spec.split(","):
        name, _, shape = item.partition(":")
        t, _, b = shape.partition("x")
        rows.append((name, int(t), int(b)))
    return rows


def have_torch() -> bool:
    """Whether torch can be imported here (its workers run in this interpreter)."""
    return importlib.util.find_spec("torch") is not None


def model_section(args: argparse.Namespace, data: str) -> list[dict[str, Any]]:
    out = []
    sides = ("base",) * bool(args.base) + ("numesh",) + ("torch",) * have_torch()
    for name, T, B in parse_rows(args.rows):
        model = dict(PRESETS[name], block_size=T, batch_size=B)
        runs = alternate(sides, args.rounds,
                         lambda kind: run_worker("numesh" if kind == "base" else kind, model, data, args.threads,
                                                 args.iters, args.warmup, timeout=args.timeout, clock=args.clock,
                                                 numesh_from=args.base if kind == "base" else None),
                         f"{name} {T}x{B}", lambda r: r.get("ms", r.get("error")))
        out.append({"model": name, "T": T, "B": B, "torch": [], **runs})
    return out


def _span(rs: list[dict[str, Any]], key: str, spec: str) -> str:
    """`span`, or "—" for a side that did not run (torch not installed)."""
    return span(rs, key, spec) if rs else "—"


def print_model(rows: list[dict], threads: int, clock: str = "wall") -> None:
    print(f"\nmodel: training step, {threads} threads, float32, fresh process per measurement"
          + (", ms = process CPU time" if clock == "cpu" else ""))
    print("| model | T × B | numesh ms | torch ms | numesh / torch tokens/s | numesh peak RSS MB | torch peak RSS MB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['T']} × {r['B']} | {span(r['numesh'], 'ms', '.1f')} | "
              f"{_span(r['torch'], 'ms', '.1f')} | **{ratio_span(r, 'tokens_per_s')}** | "
              f"{span(r['numesh'], 'rss_mb', '.0f')} | {_span(r['torch'], 'rss_mb', '.0f')} |")
    if any("base" in r for r in rows):
        print("\n--base (numesh before), in the same rounds:")
        print("| model | T × B | base ms | numesh ms | numesh / base tokens/s | base peak RSS MB |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['model']} | {r['T']} × {r['B']} | {span(r['base'], 'ms', '.1f')} | "
                  f"{span(r['numesh'], 'ms', '.1f')} | **{ratio_span(r, 'tokens_per_s', 'base')}** | "
                  f"{span(r['base'], 'rss_mb', '.0f')} |")


ATTN = dict(T=2048, B=1, H=4, hs=32)


def attn_shape(head_size: int) -> tuple[int, int, int, int]:
    """(T, B, H, head size) of the attention section: T = 2048, heads × head size = 128."""
    return ATTN["T"], ATTN["B"], max(1, 128 // head_size), head_size


def attn_heads(spec: str | None, head_size: int) -> tuple[int, int]:
    """(query heads, kv heads) of the attention section: --attn-heads "H/Hkv" (or "H"), else
    heads × head size = 128 without GQA."""
    if not spec:
        H = attn_shape(head_size)[2]
        return H, H
    h, _, kv = spec.partition("/")
    H, Hkv = int(h), int(kv or h)
    if H % Hkv:
        raise SystemExit(f"--attn-heads {spec}: the kv heads must divide the query heads")
    return H, Hkv


def attention_worker(kind: str, threads: int, runs: int, head_size: int = 32, clock: str = "wall",
                     heads: str | None = None) -> None:
    """One side of the attention section in this (fresh) process: prints {"ms": median}
    (clock cpu: of the process's CPU time)."""
    import numpy as np

    from numesh.host import aligned
    from numesh.host.runtime import configure_process

    n = configure_process(threads, None)
    T, B, _, hs = attn_shape(head_size)
    H, Hkv = attn_heads(heads, head_size)
    rng = np.random.default_rng(0)
    qkv = aligned.copy(rng.standard_normal((B, T, H + 2 * Hkv, hs)).astype(np.float32))  # as the model's QKV output
    q, k, v = (qkv[:, :, a:b].transpose(0, 2, 1, 3) for a, b in ((0, H), (H, H + Hkv), (H + Hkv, H + 2 * Hkv)))
    dy = rng.standard_normal((B, H, T, hs)).astype(np.float32)
    if kind in ("numesh", "gemms"):
        from numesh.nn import attention as A

        if kind == "gemms":  # the Python stripe loop's calls with the passes between the GEMMs made no-ops
            import types

            from numesh.host import blas

            blas.gemm_addresses = lambda: None  # the compiled loops' passes cannot be made no-ops

            for name in ("_softmax", "_probs", "_grad"):
                setattr(A, name, lambda *a, **kw: None)
            A.np = types.SimpleNamespace(**{**vars(np), "exp": lambda x, out=None: out})
            np.seterr(all="ignore")  # y and lse come out as garbage; the GEMMs' inputs stay finite

        y = np.empty((B, T, H, hs), np.float32).transpose(0, 2, 1, 3)

        def step() -> None:
            lse = A.attend_fwd(q, k, v, y, scale=1 / math.sqrt(hs))
            grads = [aligned.zeros((B, h, T, hs), np.float32) for h in (H, Hkv, Hkv)]
            A.attend_bwd(q, k, v, dy, lse, A.row_dots(dy, y), *grads, scale=1 / math.sqrt(hs))
    else:
        import torch

        torch.set_num_threads(n)
        tq, tk, tv = (torch.tensor(np.ascontiguousarray(a), requires_grad=True) for a in (q, k, v))
        tdy = torch.tensor(dy)

        gqa = {"enable_gqa": True} if Hkv < H else {}  # torch >= 2.5

        def step() -> None:
            out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, **gqa)
            out.backward(tdy)
            for t in (tq, tk, tv):
                t.grad = None

    times, _ = timed_steps(lambda _i: step(), 3, runs, step_clock(clock))
    print(json.dumps({"ms": statistics.median(times) * 1e3}), flush=True)


def gemm_rate(clock: str) -> float:
    """FLOP/s of a 1024³ float32 GEMM on numesh's threads (clock cpu: one thread, best of 10
    by the process's CPU time)."""
    from numesh.host import threads
    from numesh.host.runtime import gemm_flops

    if clock != "cpu":
        return gemm_flops(1024, 1024, 1024, split=threads.threads() > 1)
    import numpy as np

    a = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
    best = float("inf")
    for _ in range(10):
        t0 = time.process_time()
        a @ a
        best = min(best, time.process_time() - t0)
    return 2.0 * 1024**3 / best


def attention_section(args: argparse.Namespace) -> dict[str, Any]:
    """numesh and torch in fresh processes, alternating (torch's OpenMP threads spin after
    each op and would slow whatever ran next in the same process); the GEMM rate here."""
    from numesh.host.runtime import configure_process
    from numesh.nn.attention import QUERY_TILE, query_tile
    from numesh.perf import formulas

    n = configure_process(args.threads, None)
    times: dict[str, list[float]] = {"numesh": [], "torch": [], "gemms": []}
    for _ in range(args.rounds):
        for kind in ("numesh",) + ("torch",) * have_torch() + ("gemms",):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--attn-worker", kind, "--threads",
                   str(args.threads), "--attn-runs", str(args.attn_runs), "--attn-head-size",
                   str(args.attn_head_size), "--clock", args.clock] + (["--attn-heads", args.attn_heads]
                                                                           if args.attn_heads else [])
            out = run_json(cmd, timeout=args.timeout)
            if "error" in out:
                raise SystemExit(f"attention worker {kind} failed: {out['error']}")
            times[kind].append(out["ms"])
            log(f"  attention {kind}: {times[kind][-1]:.1f} ms")
    T, B, _, hs = attn_shape(args.attn_head_size)
    H, Hkv = attn_heads(args.attn_heads, args.attn_head_size)
    rate = gemm_rate(args.clock)
    causal = B * 7 * 2.0 * H * hs * T * (T + 1) / 2
    qt = query_tile("float32", hs)  # the stripes the kernel runs: 64 rows on the tile products, else QUERY_TILE
    executed = B * formulas.attention_flops(T, H * hs, qt)
    med = {k: statistics.median(v) for k, v in times.items() if v}
    return {"T": T, "B": B, "H": H, "kv_heads": Hkv, "head_size": hs, "threads": n, "numesh_ms": times["numesh"],
            "torch_ms": times["torch"], "gemms_ms": times["gemms"], "gemm_gflops": rate / 1e9,
            "causal_gflop": causal / 1e9,
            "executed_gflop": executed / 1e9, "bound_ms": causal / rate * 1e3,
            "numesh_over_bound": med["numesh"] * 1e-3 / (causal / rate), "query_tile": qt,
            "gemms_query_tile": QUERY_TILE}


TILES = [(qt, kt) for qt in (64, 128, 256, 512) for kt in (512, 1024, 2048)]


def loops_section(args: argparse.Namespace) -> dict[str, Any]:
    """The kernel's forward + backward (T = 2048, heads x head size = 128 at each head size
    of --head-sizes, batch 1) with its stripe loops compiled (numesh.host.attention_kernels:
    one GIL-free call per group) and in Python (the GIL handed over at every call), in this
    process on --threads threads, alternating; medians and minima over --rounds x 3."""
    import numpy as np

    from numesh.host import blas
    from numesh.host.runtime import configure_process
    from numesh.nn import attention as A

    configure_process(args.threads, None)
    addresses = blas.gemm_addresses()
    if addresses is None:
        raise SystemExit("loops: numpy's BLAS offers no gemm the compiled loops can call (numesh.host.blas), or "
                         "numba is off: nothing to compare")
    out: dict[str, Any] = {}
    saved = blas.gemm_addresses
    try:
        for hs in (int(x) for x in args.head_sizes.split(",")):
            T, B, H, _ = attn_shape(hs)
            rng = np.random.default_rng(0)
            q, k, v, dy = (rng.standard_normal((B, H, T, hs)).astype(np.float32) for _ in range(4))
            y = np.empty_like(q)

            def step() -> None:
                lse = A.attend_fwd(q, k, v, y, scale=1 / math.sqrt(hs))
                grads = [np.zeros_like(q) for _ in range(3)]
                A.attend_bwd(q, k, v, dy, lse, A.row_dots(dy, y), *grads, scale=1 / math.sqrt(hs))

            def use(fns: Any) -> None:
                blas.gemm_addresses = lambda: fns

            times = _interleaved(step, {"compiled": lambda: use(addresses), "python": lambda: use(None)},
                                 3 * args.rounds, time.perf_counter)
            out[f"hs{hs}"] = {kind: (statistics.median(ts) * 1e3, min(ts) * 1e3) for kind, ts in times.items()}
    finally:
        blas.gemm_addresses = saved
    return out


def print_loops(t: dict[str, Any], threads: int) -> None:
    print(f"\nloops: the kernel's forward + backward, T = {ATTN['T']}, heads x head size = 128, {threads} threads, "
          "wall ms, median (min)")
    print("| head size | stripe loops compiled | in Python | Python / compiled |")
    print("|---|---|---|---|")
    for h, r in t.items():
        print(f"| {h[2:]} | {r['compiled'][0]:.1f} ({r['compiled'][1]:.1f}) | {r['python'][0]:.1f} "
              f"({r['python'][1]:.1f}) | {r['python'][0] / r['compiled'][0]:.2f}× |")


def _interleaved(step: Callable[[], None], settings: dict[Any, Callable[[], None]], rounds: int,
                 clock: Callable[[], float]) -> dict[Any, list[float]]:
    """Each setting's times of `step` over `rounds` rounds, every setting applied and timed
    once per round (after one untimed step), so a drift of the machine hits them alike."""
    times: dict[Any, list[float]] = {key: [] for key in settings}
    for _ in range(rounds):
        for key, apply in settings.items():
            apply()
            step()
            t0 = clock()
            step()
            times[key].append(clock() - t0)
    return times


def _kernel_step(A: Any, q: Any, k: Any, v: Any, dy: Any, y: Any) -> Callable[[], None]:
    """One forward + backward of numesh.nn.attention's kernel (`A`) on q [B, H, T, hs], k, v
    [B, Hkv, T, hs], dy, into y, with fresh zeroed gradients each call (64-byte aligned, as
    the model's: numesh.host.aligned)."""
    from numesh.host import aligned

    scale = 1 / math.sqrt(q.shape[-1])

    def step() -> None:
        lse = A.attend_fwd(q, k, v, y, scale=scale)
        grads = [aligned.zeros(x.shape, x.dtype) for x in (q, k, v)]
        A.attend_bwd(q, k, v, dy, lse, A.row_dots(dy, y), *grads, scale=scale)

    return step


def _set_tiles(A: Any, tiles: tuple[int, int]) -> None:
    """numesh.nn.attention's stripe height (QUERY_TILE and TILE_QUERIES: whichever path
    runs) and KEY_TILE."""
    A.QUERY_TILE = A.TILE_QUERIES = tiles[0]
    A.KEY_TILE = tiles[1]


def tiles_section(args: argparse.Namespace) -> dict[str, Any]:
    """The kernel's forward + backward for each (query tile, key tile) at T = 2048 and each
    head size of --head-sizes (heads = 128 / head size, so every row does the same FLOPs),
    in this process, the configurations interleaved round by round so a drift in the
    machine hits them alike; medians and minima over --rounds × 3 rounds (--clock cpu: this
    thread's CPU time, with --threads 1)."""
    import numpy as np

    from numesh.host.runtime import configure_process
    from numesh.nn import attention as A

    configure_process(args.threads, None)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    out: dict[str, Any] = {}
    saved = A.QUERY_TILE, A.TILE_QUERIES, A.KEY_TILE
    try:
        for hs in (int(x) for x in args.head_sizes.split(",")):
            T, B, H, _ = attn_shape(hs)
            rng = np.random.default_rng(0)
            q, k, v = rng.standard_normal((B, T, 3, H, hs)).astype(np.float32).transpose(2, 0, 3, 1, 4)
            dy = rng.standard_normal((B, H, T, hs)).astype(np.float32)
            y = np.empty((B, T, H, hs), np.float32).transpose(0, 2, 1, 3)

            step = _kernel_step(A, q, k, v, dy, y)
            times = _interleaved(step, {c: lambda c=c: _set_tiles(A, c) for c in TILES}, 3 * args.rounds, clock)
            out[f"hs{hs}"] = {f"{qt}x{kt}": (statistics.median(ts) * 1e3, min(ts) * 1e3)
                              for (qt, kt), ts in times.items()}
    finally:
        A.QUERY_TILE, A.TILE_QUERIES, A.KEY_TILE = saved
    return out


STRIPE_ROWS = ((256, 4, 4, 4, 32), (1024, 1, 4, 4, 32), (2048, 1, 4, 4, 32), (512, 2, 9, 3, 64),
               (2048, 1, 9, 3, 64), (512, 2, 4, 2, 128), (2048, 1, 4, 2, 128))  # T, B, heads, kv heads, head size
STRIPES = (32, 64, 128)


def stripes_section(args: argparse.Namespace) -> dict[str, Any]:
    """The kernel's forward + backward for each T × B × heads × head size of STRIPE_ROWS (a
    thread's share of the default model's, SmolLM2's and Llama 3's attention in a 2,048-token
    step) with stripes of each height of STRIPES, q, k, v read in place in a QKV buffer as a
    block reads them, the heights interleaved round by round in this process; medians and
    minima over --rounds × 3 rounds (--clock cpu: this thread's CPU time). `path` says whether
    numesh multiplies the tiles with tile_gemm (TILE_QUERIES) or BLAS (QUERY_TILE) there."""
    import numpy as np

    from numesh.host import aligned
    from numesh.host.runtime import configure_process
    from numesh.nn import attention as A

    configure_process(args.threads, None)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    out: dict[str, Any] = {}
    saved = A.QUERY_TILE, A.TILE_QUERIES
    try:
        for T, B, H, Hk, hs in STRIPE_ROWS:
            rng = np.random.default_rng(0)
            qkv = aligned.copy(rng.standard_normal((B, T, H + 2 * Hk, hs)).astype(np.float32))  # [B, T, heads, hs]
            q, k, v = (qkv[:, :, a:b].transpose(0, 2, 1, 3) for a, b in ((0, H), (H, H + Hk), (H + Hk, H + 2 * Hk)))
            dy = aligned.copy(rng.standard_normal((B, H, T, hs)).astype(np.float32))
            y = aligned.empty((B, T, H, hs), np.float32).transpose(0, 2, 1, 3)
            step = _kernel_step(A, q, k, v, dy, y)
            path = "tile" if A._gemm(np.float32, hs) == 0 else "blas"
            times = _interleaved(step, {r: lambda r=r: _set_tiles(A, (r, A.KEY_TILE)) for r in STRIPES},
                                 3 * args.rounds, clock)
            out[f"{T}x{B} {H}/{Hk}x{hs}"] = {**{r: (statistics.median(ts) * 1e3, min(ts) * 1e3)
                                                for r, ts in times.items()}, "path": path}
    finally:
        A.QUERY_TILE, A.TILE_QUERIES = saved
    return out


def print_stripes(t: dict[str, Any], threads: int, clock: str) -> None:
    print(f"\nstripes: the kernel's forward + backward, float32, {threads} threads, "
          f"{'CPU' if clock == 'cpu' else 'wall'} ms, median (min), by query rows per stripe; the ratios of minima")
    print("| T × B, heads, head size | products | " + " | ".join(f"{r} rows" for r in STRIPES) + " | "
          + " | ".join(f"{r} / 128" for r in STRIPES[:-1]) + " |")
    print("|---|---|" + "---|" * (2 * len(STRIPES) - 1))
    for row, r in t.items():
        print(f"| {row} | {r['path']} | " + " | ".join(f"{r[n][0]:.2f} ({r[n][1]:.2f})" for n in STRIPES) + " | "
              + " | ".join(f"{r[n][1] / r[128][1]:.3f}×" for n in STRIPES[:-1]) + " |")


COPY_ROWS = ((256, 4, 32), (512, 2, 32), (1024, 1, 32), (2048, 1, 32), (512, 2, 64), (2048, 1, 64))  # T, B, hs
COPY_RULES = {"copy from 2 stripes": 1, "from 9 (COPY_STRIPES = 8)": 8, "never": 1 << 30}


def copies_section(args: argparse.Namespace) -> dict[str, Any]:
    """The kernel's forward + backward inside a block's pieces (one run, as a training step
    calls it), q, k, v strided through a QKV buffer, for each T × B × head size of
    COPY_ROWS (128 wide: 4 heads of 32 or 2 of 64) and each rule of when a group reads
    contiguous copies of its rows (numesh.nn.attention.COPY_STRIPES), the rules interleaved
    round by round; medians over --rounds × 3 rounds (--clock cpu: this thread's CPU time)."""
    import numpy as np

    from numesh.host import threads
    from numesh.host.runtime import configure_process
    from numesh.nn import attention as A

    configure_process(args.threads, None)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    out: dict[str, Any] = {}
    saved = A.COPY_STRIPES
    try:
        for T, B, hs in COPY_ROWS:
            H = 128 // hs
            rng = np.random.default_rng(0)
            q, k, v = rng.standard_normal((B, T, 3, H, hs)).astype(np.float32).transpose(2, 0, 3, 1, 4)
            dy = rng.standard_normal((B, H, T, hs)).astype(np.float32)
            y = np.empty((B, T, H, hs), np.float32).transpose(0, 2, 1, 3)

            def step() -> None:
                with threads.token_pieces((slice(0, B),)):
                    lse = A.attend_fwd(q, k, v, y, scale=1 / math.sqrt(hs))
                    grads = np.zeros((B, T, 3, H, hs), np.float32).transpose(2, 0, 3, 1, 4)
                    A.attend_bwd(q, k, v, dy, lse, A.row_dots(dy, y), *grads, scale=1 / math.sqrt(hs))

            times = _interleaved(step, {name: lambda r=rule: setattr(A, "COPY_STRIPES", r)
                                        for name, rule in COPY_RULES.items()}, 3 * args.rounds, clock)
            out[f"{T}x{B} hs{hs}"] = {**{name: statistics.median(ts) * 1e3 for name, ts in times.items()},
                                      "stripes": -(-T // A.query_tile(np.float32, hs))}
    finally:
        A.COPY_STRIPES = saved
    return out


def print_copies(t: dict[str, Any], threads: int, clock: str) -> None:
    print(f"\ncopies: the kernel's forward + backward in a block's pieces, {threads} threads, "
          f"{'CPU' if clock == 'cpu' else 'wall'} ms (median) by when a group copies its rows")
    print("| T × B, head size | stripes | " + " | ".join(COPY_RULES) + " |")
    print("|---|---|" + "---|" * len(COPY_RULES))
    for row, r in t.items():
        times = " | ".join(f"{r[n]:.2f}" for n in COPY_RULES)
        print(f"| {row.replace(' hs', ', ')} | {r['stripes']} | {times} |")


PRODUCT_ROWS = ((64, 12, 4, 4, 32), (1024, 2, 4, 4, 32), (4096, 1, 4, 4, 32), (512, 4, 9, 3, 64),
                (2048, 1, 9, 3, 64), (1024, 2, 4, 1, 128))  # T, B, heads, kv heads, head size


def products_section(args: argparse.Namespace) -> dict[str, Any]:
    """The kernel's forward + backward for each T × B × heads × head size of PRODUCT_ROWS
    (the default model's 4 heads of 32, SmolLM2's 9/3 of 64, Llama 3's head size 128) with
    its tile products on numesh.host.tile_gemm and on BLAS (MKL where numesh uses it, else
    numpy's), the two interleaved round by round in this process; medians over --rounds × 3
    rounds (--clock cpu: this thread's CPU time). What attention.TILE_HEAD_SIZE was chosen
    from; `now` says which one numesh picks on this CPU."""
    import numpy as np

    from numesh.host import aligned
    from numesh.host.runtime import configure_process
    from numesh.nn import attention as A

    configure_process(args.threads, None)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    real = A._gemm
    paths = {"blas": lambda dtype, hs: real(dtype, 1 << 30), "tile": lambda dtype, hs: 0}
    out: dict[str, Any] = {}
    try:
        for T, B, H, Hk, hs in PRODUCT_ROWS:
            rng = np.random.default_rng(0)
            q, dy = (aligned.copy(rng.standard_normal((B, H, T, hs)).astype(np.float32)) for _ in range(2))
            k, v = (aligned.copy(rng.standard_normal((B, Hk, T, hs)).astype(np.float32)) for _ in range(2))
            step = _kernel_step(A, q, k, v, dy, aligned.empty(q.shape, q.dtype))
            now = "tile" if real(np.float32, hs) == 0 else "blas"
            times = _interleaved(step, {p: lambda f=f: setattr(A, "_gemm", f) for p, f in paths.items()},
                                 3 * args.rounds, clock)
            out[f"{T}x{B} {H}/{Hk}x{hs}"] = {**{p: statistics.median(ts) * 1e3 for p, ts in times.items()}, "now": now}
    finally:
        A._gemm = real
    return out


def print_products(t: dict[str, Any], threads: int, clock: str) -> None:
    print(f"\nproducts: the kernel's forward + backward, float32, {threads} threads, "
          f"{'CPU' if clock == 'cpu' else 'wall'} ms (median) with its tile products on BLAS and on tile_gemm")
    print("| T × B, heads, head size | BLAS | tile_gemm | tile_gemm / BLAS | numesh uses |")
    print("|---|---|---|---|---|")
    for row, r in t.items():
        print(f"| {row} | {r['blas']:.2f} | {r['tile']:.2f} | {r['tile'] / r['blas']:.3f}× | {r['now']} |")


def print_tiles(t: dict[str, Any], threads: int, clock: str) -> None:
    sizes = list(t)
    print(f"\ntiles: the kernel's forward + backward, T = {ATTN['T']}, heads x head size = 128, {threads} threads, "
          f"{'CPU' if clock == 'cpu' else 'wall'} ms per query tile x key tile, median (min)")
    print("| tiles | " + " | ".join(f"head size {h[2:]}" for h in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for name in t[sizes[0]]:
        print(f"| {name} | " + " | ".join(f"{t[h][name][0]:.1f} ({t[h][name][1]:.1f})" for h in sizes) + " |")


def print_attention(a: dict) -> None:
    def ms_span(xs: list[float]) -> str:
        return f"{min(xs):.1f}–{max(xs):.1f}" if len(xs) > 1 else f"{xs[0]:.1f}"

    ratios = [t / m for m, t in zip(a["numesh_ms"], a["torch_ms"])]
    versus = (f"torch SDPA {ms_span(a['torch_ms'])} ms (numesh / torch speed {min(ratios):.2f}–{max(ratios):.2f}×)"
              if ratios else "torch SDPA — (not installed)")
    kv = f" (kv heads {a['kv_heads']})" if a.get("kv_heads", a["H"]) != a["H"] else ""
    print(f"\nattention: forward + backward, T = {a['T']}, B·H = {a['B'] * a['H']}{kv}, head size {a['head_size']}, "
          f"float32, {a['threads']} threads, fresh processes alternating")
    print(f"  numesh {ms_span(a['numesh_ms'])} ms, {versus}")
    print(f"  causal half {a['causal_gflop']:.2f} GFLOP (executed with {a['query_tile']}-query stripes: "
          f"{a['executed_gflop']:.2f}) at the GEMM rate {a['gemm_gflops']:.1f} GFLOP/s = {a['bound_ms']:.1f} ms: "
          f"numesh's median takes {a['numesh_over_bound']:.2f}× that")
    print(f"  the Python stripe loop's BLAS GEMMs alone ({a.get('gemms_query_tile', 128)}-query stripes, the passes "
          f"and exp between them no-ops; the compiled loops' products cannot be timed apart): "
          f"{ms_span(a['gemms_ms'])} ms, "
          f"{statistics.median(a['gemms_ms']) / a['bound_ms']:.2f}× the bound")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="model,attention",
                    help="comma-separated: model, attention, loops, tiles, copies, products, stripes "
                         "(default model,attention)")
    ap.add_argument("--threads", type=int, default=2, help="threads per process (default 2)")
    ap.add_argument("--rows", default=ROWS, help=f"model:TxB,... (default {ROWS})")
    ap.add_argument("--rounds", type=int, default=2, help="numesh/torch rounds per row (default 2)")
    ap.add_argument("--iters", type=int, default=8, help="timed steps per measurement (default 8)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--attn-head-size", type=int, default=32,
                    help="the attention section's head size (heads = 128 / it; default 32)")
    ap.add_argument("--attn-heads", default=None,
                    help="the attention section's query heads, or H/Hkv with fewer kv heads (grouped-query "
                         "attention, e.g. 9/3: SmolLM2's; default 128 / head size, no GQA)")
    ap.add_argument("--head-sizes", default="32,64,128", help="the tiles section's head sizes (default 32,64,128)")
    ap.add_argument("--attn-runs", type=int, default=10, help="timed runs each in the attention section")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one measurement may take")
    ap.add_argument("--data", default=None, help="dataset dir from `numesh data` (default: a temporary one)")
    ap.add_argument("--src", default=DEFAULT_SRC, help="text for the temporary dataset")
    ap.add_argument("--json", action="store_true", help="also print the report as one JSON line")
    ap.add_argument("--base", default=None,
                    help="model section: also a numesh checkout at DIR (`git worktree add DIR COMMIT`) in the same "
                         "rounds, before beside after")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: time the model and tiles sections by CPU time (the process's, the thread's), which "
                         "on a machine other jobs share leaves out the waits for a core (with --threads 1 only)")
    ap.add_argument("--attn-worker", choices=("numesh", "torch", "gemms"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.attn_worker:
        attention_worker(args.attn_worker, args.threads, args.attn_runs, args.attn_head_size, args.clock,
                         args.attn_heads)
        return 0
    sections = set(args.sections.split(","))
    report: dict[str, Any] = {"machine": machine(), "date": time.strftime("%Y-%m-%d")}
    print(f"machine: {describe(report['machine'])}; {report['date']}")
    if not have_torch() and sections & {"model", "attention"}:
        log(f"torch is not installed, so only numesh is measured; to compare: {sys.executable} -m pip install torch")
    if "model" in sections:
        with dataset_dir(args.data, args.src, log=log) as data:
            report["model"] = model_section(args, data)
        print_model(report["model"], args.threads, args.clock)
    if "attention" in sections:
        report["attention"] = attention_section(args)
        print_attention(report["attention"])
    if "loops" in sections:
        report["loops"] = loops_section(args)
        print_loops(report["loops"], args.threads)
    if "tiles" in sections:
        report["tiles"] = tiles_section(args)
        print_tiles(report["tiles"], args.threads, args.clock)
    if "copies" in sections:
        report["copies"] = copies_section(args)
        print_copies(report["copies"], args.threads, args.clock)
    if "products" in sections:
        report["products"] = products_section(args)
        print_products(report["products"], args.threads, args.clock)
    if "stripes" in sections:
        report["stripes"] = stripes_section(args)
        print_stripes(report["stripes"], args.threads, args.clock)
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
