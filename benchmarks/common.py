"""What the benchmark scripts share: where the corpus is, a temporary dataset made from it,
the model presets of the default and baby nanoGPT runs, `numesh` commands and workers in
fresh processes, timing steps, and what a report says of the machine (CPU, ISA, BLAS).

Importing this module has no side effect (the scripts import numesh first themselves, for
its OpenBLAS set-up); numesh, numpy and threadpoolctl are imported inside the functions.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

# ../shared beside the repository, whatever the working directory
DEFAULT_SRC = str(Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt")

# Model and batch of each preset (the optimiser hyper-parameters are TrainConfig's defaults,
# which are nanoGPT's Shakespeare-char ones: lr 1e-3, betas (0.9, 0.99), wd 0.1, clip 1.0).
PRESETS: dict[str, dict[str, Any]] = {
    # nanoGPT's "I only have a macbook" Shakespeare-char quick start
    "default": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12),
    # nanoGPT's train_shakespeare_char.py ("baby GPT")
    "baby": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=12),
}

# SmolLM2-135M's block (HuggingFaceTB/SmolLM2-135M's config.json) as `numesh train` options:
# 576 wide, 9 query heads sharing 3 key/value heads, SwiGLU of 1,536, RMSNorm eps 1e-5,
# rotary theta 1e5, the LM head tied to the embedding, no biases. Its 30 layers are cut to
# what a benchmark can step (bench_llama.py's --layers).
SMOLLM2 = dict(arch="llama", n_embd=576, n_head=9, n_kv_head=3, ffn_hidden=1536, norm="rmsnorm", norm_eps=1e-5,
               positions="rotary", rope_theta=1e5, mlp="swiglu", tie_embeddings=True, bias=False, dropout=0.0)
# Llama-family presets of the numesh-only scripts (profile_train.py); the nanoGPT ones above
# are also the PyTorch reference model's (bench_train.py), which has no Llama block.
LLAMA_PRESETS: dict[str, dict[str, Any]] = {
    "smollm2-4": dict(SMOLLM2, n_layer=4, block_size=512, batch_size=4),  # bench_llama.py's first row
}


RESERVED = "<|reserved_"  # how `padded_bpe_dataset`'s padding tokens start: <|reserved_0|>, <|reserved_1|>, ...


def padded_bpe_dataset(src: str, vocab_size: int, out: str) -> dict[str, Any]:
    """A dataset of the text file `src` whose vocabulary has exactly `vocab_size` entries:
    the byte-level BPE `numesh data bpe` trains on it (as many entries as the text holds
    merges for, at most `vocab_size`), then reserved special tokens the text never uses up
    to `vocab_size`, as real models pad theirs. The embedding, LM head and cross-entropy then
    have that model's width: tiny Shakespeare holds merges for 21,528 entries, SmolLM2-135M's
    vocabulary has 49,152. Returns `numesh data tokenize`'s summary."""
    from tokenizers import AddedToken, Tokenizer

    from numesh.data.char import read_source
    from numesh.data.sharded import prepare_tokenized
    from numesh.data.tokenizer import EOT, HFTokenizer, train_bpe

    raw = Tokenizer.from_str(train_bpe([read_source(src)], vocab_size).json_text)
    have = raw.get_vocab_size(with_added_tokens=True)
    raw.add_tokens([AddedToken(f"{RESERVED}{i}|>", special=True) for i in range(vocab_size - have)])
    return prepare_tokenized([src], HFTokenizer(raw.to_str(), EOT), out)


@contextlib.contextmanager
def dataset_dir(data: str | None, src: str, comm: Any = None,
                log: Callable[[str], None] | None = None, vocab: int = 0) -> Iterator[str]:
    """Yield a dataset directory: `data` if it holds a prepared dataset (`numesh data`), else
    a temporary one prepared from the text file `src` and removed afterwards: character-level,
    or with `vocab` a BPE padded to that many entries (`padded_bpe_dataset`; `vocab` is
    not looked at where `data` holds a dataset).

    With an MPI communicator `comm`, rank 0 prepares it and every rank gets its path; it is
    removed after a barrier when the block ends normally, and left behind when it raises
    (another rank may be inside a collective then, and a barrier would hang: the script's
    `numesh.host.runtime.guarded` aborts the job instead). `log` gets one line about what was done
    (on rank 0)."""
    if data is not None and (Path(data) / "meta.json").is_file():
        yield str(data)
        return
    root = comm is None or comm.Get_rank() == 0
    tmp = None
    if root:
        from numesh.data.char import prepare_char_dataset, read_source

        if data is not None and log is not None:
            log(f"note: no dataset at {data}; preparing a temporary one from {src}")
        tmp = tempfile.mkdtemp(prefix="numesh-bench-")
        try:
            info = padded_bpe_dataset(src, vocab, tmp) if vocab else prepare_char_dataset(read_source(src), tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if log is not None:
            log(f"prepared {info['train_tokens']:,} train tokens (vocab {info['vocab_size']}) in {tmp}")
    if comm is not None:
        tmp = comm.bcast(tmp, root=0)
    if comm is None or comm.Get_size() == 1:
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    yield tmp
    comm.Barrier()
    if root:
        shutil.rmtree(tmp, ignore_errors=True)


def log(msg: str) -> None:
    """A progress line on stderr (stdout is the report's)."""
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------
# fresh processes: `numesh` commands and the scripts' own workers

# the thread counts a worker sets itself: a parent's must not leak into it
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

# `numesh ARGS` in this Python, printing the process's peak RSS (KiB) last on stderr
_MEASURED = ("import resource, runpy, sys\n"
             "sys.argv = ['numesh', *sys.argv[1:]]\n"
             "try:\n    runpy.run_module('numesh.cli.app', run_name='__main__')\n"
             "finally:\n    print(f'PEAK_RSS_KB={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}', "
             "file=sys.stderr)\n")


def peak_rss_mb() -> float:
    """This process's peak resident memory in MB (ru_maxrss is KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def numesh_cli(*args: str) -> tuple[float, float]:
    """Run `numesh ARGS` in a fresh process: (wall seconds, its peak RSS in MB), or exit
    with the command and the end of its stderr when it fails."""
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", _MEASURED, *args], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    lines = res.stderr.splitlines()
    peaks = [line for line in lines if line.startswith("PEAK_RSS_KB=")]
    if res.returncode or not peaks:
        said = "\n".join(line for line in lines if not line.startswith("PEAK_RSS_KB="))
        raise SystemExit(f"numesh {' '.join(args)} failed: {said.strip()[-600:]}")
    return wall, int(peaks[-1].split("=")[1]) / 1024.0


def metrics(run: str | Path) -> list[dict[str, Any]]:
    """The records of a run directory's metrics.jsonl, in order."""
    lines = (Path(run) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@contextlib.contextmanager
def work_dir(keep: str | None, prefix: str) -> Iterator[Path]:
    """The directory a script writes its datasets and runs to: `keep` (made if missing, left
    behind), else a temporary one removed afterwards."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        root = Path(keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        yield root


def venv_tool(name: str) -> str:
    """The command `name` (mpirun, mpiexec, numesh) beside this Python, a virtual
    environment's (the mpich wheel's launchers live there), else the one on PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if here.is_file() else (shutil.which(name) or name)


def worker_env(first_on_path: str | None = None) -> dict[str, str]:
    """This environment for a worker process: without THREAD_VARS, and with
    `first_on_path` (another numesh checkout) first on PYTHONPATH when given."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    if first_on_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(first_on_path), *filter(None, [env.get("PYTHONPATH")])])
    return env


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # a terminal control sequence


def run_json(cmd: Sequence[str], env: dict[str, str] | None = None, timeout: float | None = 3600) -> dict[str, Any]:
    """Run a worker command: the last JSON line it printed, or {"error": ...} with its exit
    status and the end of its output (or the timeout)."""
    try:
        p = subprocess.run(list(cmd), capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    # Open MPI's ranks interleave terminal resets ("\x1b[0m") with a worker's JSON line: on a
    # 16-core node rows of 4 and 16 ranks read as errors (benchmarks/bench_node.py, weak and baby)
    lines = [x for x in _ANSI.sub("", p.stdout).splitlines() if x.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {p.returncode}: " + " | ".join(tail)}
    return json.loads(lines[-1])


# --------------------------------------------------------------------------------------
# the PyTorch side: a torch model trained as numesh trains


def torch_training(torch, model, tc, train_data, loss_of: Callable[[Any, Any], Any],
                   optim_impl: str = "default") -> tuple[list, Callable[[int], None], list[float]]:
    """(parameters, step, losses) for a torch `model`: AdamW with TrainConfig `tc`'s
    hyper-parameters (weight decay on >= 2-D parameters only, as nanoGPT; `optim_impl`
    default, foreach or fused) and a step(i) that trains it on numesh's batch i at numesh's
    cosine learning rate, clipping the global norm, appending its loss to `losses`.
    `loss_of(x, y)` is the model's mean token loss on torch tensors of the batch."""
    from numesh.data.batches import local_batch, train_key
    from numesh.optim import cosine_lr

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": tc.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    extra = {"fused": True} if optim_impl == "fused" else {"foreach": True} if optim_impl == "foreach" else {}
    opt = torch.optim.AdamW(groups, lr=tc.learning_rate, betas=(tc.beta1, tc.beta2), eps=1e-8, **extra)
    losses: list[float] = []

    def step(i: int) -> None:
        (x, y), = local_batch(train_data, train_key(tc.seed, i), tc.batch_size, tc.block_size, 0, 1, 1)
        lr = cosine_lr(i, tc.learning_rate, tc.min_lr, tc.warmup_iters, tc.lr_decay_iters)
        for g in opt.param_groups:
            g["lr"] = lr
        loss = loss_of(torch.from_numpy(x), torch.from_numpy(y))
        loss.backward()
        if tc.grad_clip > 0.0:
            torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    return params, step, losses


# --------------------------------------------------------------------------------------
# timing steps


def step_clock(kind: str) -> Callable[[], float]:
    """wall: time.perf_counter. cpu: the process's CPU time (time.process_time), which with
    one thread is a step's time less its waits for a core on a machine other jobs share."""
    return time.process_time if kind == "cpu" else time.perf_counter


def _minor_faults() -> int:
    try:
        import resource
    except ImportError:  # not on Windows
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class CpuMonitor:
    """CPU used by *other* processes (and hypervisor steal) while we measure, in cores: busy
    time in /proc/stat minus this process's CPU time. On a small shared machine this says
    whether a number is trustworthy (Linux only; n/a elsewhere)."""

    def __init__(self):
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def _busy(self) -> float | None:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
        except OSError:
            return None
        return (sum(v[:8]) - v[3] - v[4]) / self.hz  # user nice system irq softirq steal (guest is in user)

    def __enter__(self):
        t = os.times()
        self._own, self._sys, self._busy0, self._wall = t.user + t.system, t.system, self._busy(), time.perf_counter()
        self._faults = _minor_faults()
        return self

    def __exit__(self, *exc):
        t = os.times()
        busy = self._busy()
        wall = time.perf_counter() - self._wall
        own = t.user + t.system - self._own
        self.other_cores = None if busy is None or wall <= 0 else max(0.0, (busy - self._busy0 - own) / wall)
        self.own_cores = own / wall if wall > 0 else None
        # kernel time of this process: mostly page faults on freshly allocated arrays
        self.sys_share = (t.system - self._sys) / own if own > 0 else None
        self.minor_faults = _minor_faults() - self._faults


def monitor_fields(mon: CpuMonitor, iters: int) -> dict[str, Any]:
    """A CpuMonitor's readings for a report, the page faults per timed step."""
    return {"own_cpu_cores": mon.own_cores, "other_cpu_cores": mon.other_cores, "sys_share": mon.sys_share,
            "minor_faults_per_iter": mon.minor_faults / iters}


def timed_steps(step: Callable[[int], Any], warmup: int, iters: int, tick: Callable[[], float] = time.perf_counter,
                first: int = 0) -> tuple[list[float], CpuMonitor]:
    """Run step(first), ..., step(first + warmup + iters - 1): the seconds of the last `iters`
    by `tick` (see `step_clock`), and what the machine's other processes did meanwhile."""
    for i in range(first, first + warmup):
        step(i)
    times = []
    with CpuMonitor() as mon:
        for i in range(first + warmup, first + warmup + iters):
            t0 = tick()
            step(i)
            times.append(tick() - t0)
    return times, mon


def alternate(sides: Sequence[str], rounds: int, measure: Callable[[str], dict[str, Any]], label: str,
              say: Callable[[dict[str, Any]], Any]) -> dict[str, list[dict[str, Any]]]:
    """Each side's results over `rounds` rounds, every side measured once per round back to
    back (a drift of the machine hits them alike); each logged as "LABEL round N SIDE: say(r)"."""
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for rnd in range(rounds):
        for side in sides:
            r = measure(side)
            log(f"  {label} round {rnd + 1} {side}: {say(r)}")
            runs[side].append(r)
    return runs


def ns_per_element(sides: dict[str, Callable[[], object]], elements: int, rounds: int,
                   reps: int) -> dict[str, list[float]]:
    """Each side's ns an element (`elements` per call), one timing of `reps` calls per round,
    the sides back to back in every round (a drift of the machine hits them alike), after a
    call of each that compiles and warms it."""
    for fn in sides.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            times[name].append((time.perf_counter() - t0) / reps / elements * 1e9)
    return times


def print_ns_table(what: str, times: dict[str, list[float]]) -> None:
    """`ns_per_element`'s times as a markdown table: the median and the minimum of each side."""
    print(f"| {what} | median ns/element | min |")
    print("|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {statistics.median(t):.3f} | {min(t):.3f} |")


def span(rs: list[dict[str, Any]], key: str, spec: str) -> str:
    """`key` over the rounds' results `rs` as "lo–hi" (one number when they print alike),
    or the rounds' errors."""
    vals = [r[key] for r in rs if key in r]
    if not vals:
        return "error: " + "; ".join(r.get("error", "?") for r in rs)
    lo, hi = format(min(vals), spec), format(max(vals), spec)
    return lo if lo == hi else f"{lo}–{hi}"


def ratio_span(row: dict[str, list[dict[str, Any]]], key: str, over: str = "torch") -> str:
    """numesh's `key` over side `over`'s (torch, or base), per round (each round's runs back
    to back), as "lo–hi×", with the rounds' median from three rounds on: on a machine whose
    neighbours take cycles now and then, one slow round moves the range but not the median."""
    rs = [a[key] / b[key] for a, b in zip(row["numesh"], row[over]) if key in a and key in b]
    if not rs:
        return "n/a"
    if len(rs) == 1:
        return f"{rs[0]:.2f}×"
    median = f" (median {statistics.median(rs):.2f})" if len(rs) >= 3 else ""
    return f"{min(rs):.2f}–{max(rs):.2f}×{median}"


# --------------------------------------------------------------------------------------
# the machine, as a report's head names it

ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile")


def cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    try:
        block = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in block.splitlines())}


def isa_flags() -> list[str]:
    """The vector extensions of ISA_FLAGS this CPU has (/proc/cpuinfo; empty elsewhere)."""
    flags = cpuinfo().get("flags", "").split()
    return [f for f in ISA_FLAGS if f in flags]


def cpu_isa() -> str:
    """The widest vector ISA numpy sees on this CPU: AVX-512, AVX2, AVX or SSE."""
    import numpy as np

    f = np._core._multiarray_umath.__cpu_features__
    return next((name for name, key in (("AVX-512", "AVX512F"), ("AVX2", "AVX2"), ("AVX", "AVX")) if f.get(key)),
                "SSE")


def blas_info() -> list[dict[str, Any]]:
    """The loaded BLAS libraries as threadpoolctl reports them, numpy's own first."""
    from numesh.host.blas import loaded_libraries

    keep = ("internal_api", "version", "num_threads", "threading_layer", "architecture", "filepath")
    return [{k: d.get(k) for k in keep} for d in loaded_libraries()]


def blas_kernel() -> str:
    """numpy's BLAS, its version and the kernel family it runs here (OpenBLAS: Haswell,
    Zen, SkylakeX, ...)."""
    blas = blas_info()
    if not blas:
        return "unknown"
    b = blas[0]
    return f"{b['internal_api']} {b.get('version') or '?'} {b.get('architecture') or ''}".strip()


def svml() -> bool | None:
    """Whether numba runs with Intel's SVML (vector math functions), None without numba."""
    try:
        from numba import config
    except ImportError:
        return None
    return bool(config.USING_SVML)


def machine() -> dict[str, Any]:
    """What a measurement ran on: the CPU (model, family/model numbers, ISA), numpy's BLAS
    and its kernel, library versions and the load average (the tables cite all of it)."""
    info = cpuinfo()
    cpu = info.get("model name", platform.processor() or "unknown")
    if "cpu family" in info:
        cpu += f" (family {info['cpu family']} model {info.get('model', '?')})"
    versions = {}
    for mod in ("numpy", "numba", "torch", "mpi4py"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            versions[mod] = None
    from numesh.host import blas

    return {"cpu": cpu, "isa": cpu_isa(), "blas": blas_kernel(), "gemm": blas.describe(), "svml": svml(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "loadavg": [round(x, 2) for x in os.getloadavg()], **versions}


def describe(m: dict[str, Any]) -> str:
    """One line for a report's head: CPU, ISA, BLAS kernel, versions and load."""
    return (f"{m['cpu']}, {m['isa']}, {m['cpu_count']} cpus; BLAS {m['blas']}, numesh's GEMMs on "
            f"{m.get('gemm', '?')}; numba {m['numba']} "
            f"(SVML {'on' if m['svml'] else 'off'}), numpy {m['numpy']}, torch {m['torch'] or '(not installed)'}, "
            f"python {m['python']}; load avg {m['loadavg']}")
