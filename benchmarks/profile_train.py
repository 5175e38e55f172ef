#!/usr/bin/env python
"""Where a numesh training step spends its time.

    python benchmarks/profile_train.py --preset default --steps 20
    python benchmarks/profile_train.py --preset smollm2-4 --steps 5              # Llama: SmolLM2's block, 4 layers
    python benchmarks/profile_train.py --preset smollm2-4 --block-size 2048 --batch-size 1 --steps 5 --clock cpu

Four views of the same single-process training run (see bench_train.py for presets/data;
benchmarks/common.py's LLAMA_PRESETS are Llama-family models, with the Llama parts' ops):
  1. cProfile over `--steps` Trainer.train_step() calls: the top functions by tottime.
     numpy operators (`a @ b`, `x * y`, ufuncs) are not separate entries: their time is
     the tottime of the Python function that executes them.
  2. Phases, timed directly: Trainer.train_step() runs unchanged while numesh.nn.transformer's
     embed_fwd/block_fwd/head_fwd (forward), head_bwd/block_bwd_input/block_bwd_weight/embed_bwd (backward),
     numesh.optim's adamw_step and the Trainer's optimiser step (optimizer), and the batch
     draw, gradient hand-off and global norm (other) are wrapped in timers, wherever a
     numesh module holds them (only in this process; no file is changed). Whatever is left
     of the step is reported as "rest of train_step". Wrapping by name keeps this working
     while the Trainer's internals change.
  3. Ops: in the same steps, the layer functions (linear, layernorm, gelu, attention,
     embedding, cross-entropy, flatten) are timed too, matmuls keyed by weight shape, and
     every wrapped function is reported by exclusive time, so the phase functions' own
     rows are their glue: the reshapes, transposes, residual adds and head matmuls written
     inline in block_fwd/block_bwd_input/block_bwd_weight/head_fwd/head_bwd.
  4. Hand-offs (with more than one thread): the main thread's stretches alone between the
     hand-offs to the threads (numesh.host.threads' `_run_all`), while the other threads
     wait, by the call that ends each stretch: the step's serial part, which no thread
     count shortens.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import numesh  # noqa: F401  # isort: skip  (before numpy: it sets up OpenBLAS, see numesh/__init__.py)
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import make_trainer, preset_config  # noqa: E402
from common import DEFAULT_SRC, LLAMA_PRESETS, PRESETS, CpuMonitor, dataset_dir, log, step_clock  # noqa: E402
from numesh.host.runtime import keep_freed_memory  # noqa: E402

# --------------------------------------------------------------------------------------
# timers around numesh's own functions, while Trainer.train_step() runs unchanged

# function name -> phase. Forward/backward are numesh.nn.transformer's pieces of the model; the
# optimizer is AdamW (and the optimiser object's step around it, if the Trainer has one).
PHASE_FUNCS = {
    "embed_fwd": "forward", "block_fwd": "forward", "head_fwd": "forward",
    "head_bwd": "backward", "block_bwd_input": "backward", "block_bwd_weight": "backward", "embed_bwd": "backward",
    "adamw_step": "optimizer",
    "local_batch": "other", "global_norm": "other", "clip_scale": "other",
}
# methods of Trainer.opt (the ZeRO optimiser) -> phase
PHASE_METHODS = {
    "step": "optimizer", "global_norm": "other", "grads_ready": "other", "begin_step": "other", "wait": "other",
}
# the layer functions inside the blocks (numesh.nn.layers / numesh.nn.parallel)
OP_FUNCS = (
    "layernorm_fwd", "layernorm_bwd", "linear_fwd", "linear_bwd_input", "linear_bwd_weight",
    "gelu_fwd", "gelu_bwd", "rmsnorm_fwd", "rmsnorm_bwd", "swiglu_fwd", "swiglu_bwd",
    "causal_attention_fwd", "causal_attention_bwd",
    "vocab_parallel_embedding_fwd", "vocab_parallel_embedding_bwd",
    "vocab_parallel_cross_entropy_fwd", "vocab_parallel_cross_entropy_bwd", "flatten",
    # the Llama kind's parts (numesh.nn.parts, layers, rotary)
    "rmsnorm_fwd", "rmsnorm_bwd", "swiglu_fwd", "swiglu_bwd", "rope_fwd", "rope_bwd", "qkv_fwd", "qkv_bwd_input",
    "qkv_bwd_weight", "attend_fwd", "attend_bwd",
)


class Instrument:
    """Wraps functions (wherever a loaded numesh module holds them) and methods in timers
    that record, per label, inclusive time, exclusive time (minus wrapped callees) and
    calls, plus per phase the time of its outermost calls."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.incl: dict[str, float] = defaultdict(float)
        self.excl: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.phase: dict[str, float] = defaultdict(float)
        self.label_phase: dict[str, str] = {}
        self._local = threading.local()  # per thread: a stack of [label, phase, child time]
        self._lock = threading.Lock()
        self.worker_time = 0.0  # outermost wrapped calls on other threads (numesh.host.threads.over_batch)
        self._undo: list[tuple[object, str, object]] = []

    def _wrap(self, fn, name: str, phase: str | None):
        inst = self

        def label_of(args):
            if name.startswith("linear") and args and hasattr(args[0], "w"):
                w = args[0].w
                return f"{name} w[{w.shape[0]}x{int(np.prod(w.shape[1:]))}]"
            return name

        @functools.wraps(fn)
        def timed(*args, **kw):
            label = label_of(args)
            inst.label_phase.setdefault(label, phase or "op")
            frame = [label, phase, 0.0]
            stack = inst._stack()
            stack.append(frame)
            t0 = inst.clock()
            try:
                return fn(*args, **kw)
            finally:
                dt = inst.clock() - t0
                stack.pop()
                with inst._lock:
                    inst.incl[label] += dt
                    inst.excl[label] += dt - frame[2]
                    inst.calls[label] += 1
                    if stack:
                        stack[-1][2] += dt
                    elif threading.current_thread() is not threading.main_thread():
                        inst.worker_time += dt
                    if phase is not None and not any(f[1] == phase for f in stack):
                        inst.phase[phase] += dt

        timed.__numesh_profiled__ = True
        return timed

    def _stack(self) -> list[list]:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def patch_functions(self, names: dict[str, str | None]) -> None:
        originals = {}
        for modname, mod in list(sys.modules.items()):
            if not (modname == "numesh" or modname.startswith("numesh.")) or mod is None:
                continue
            for name, phase in names.items():
                fn = getattr(mod, name, None)
                if fn is None or not callable(fn) or getattr(fn, "__numesh_profiled__", False):
                    continue
                key = id(fn)
                if key not in originals:
                    originals[key] = self._wrap(fn, name, phase)
                self._undo.append((mod, name, fn))
                setattr(mod, name, originals[key])

    def patch_methods(self, obj, names: dict[str, str]) -> None:
        for name, phase in names.items():
            fn = getattr(obj, name, None)
            if fn is not None and callable(fn):
                self._undo.append((obj, name, None))
                setattr(obj, name, self._wrap(fn, f"opt.{name}", phase))

    def restore(self) -> None:
        for obj, name, fn in reversed(self._undo):
            if fn is None:
                delattr(obj, name)  # drop the instance attribute: the class method shows again
            else:
                setattr(obj, name, fn)
        self._undo = []


def _load(mon, steps: int) -> str:
    if mon.other_cores is None:
        return "cpu use n/a"
    return (f"cpu: this process {mon.own_cores:.2f} cores ({100 * (mon.sys_share or 0):.0f}% in the kernel, "
            f"{mon.minor_faults / steps:,.0f} page faults/step), other processes {mon.other_cores:.2f}")


def _ms(seconds: float, n: int) -> str:
    return f"{seconds / n * 1e3:8.2f} ms"


def report_phases(inst: Instrument, step_total: float, n: int) -> None:
    known = sum(inst.phase[p] for p in ("forward", "backward", "optimizer", "other"))
    rest = step_total - known
    print(f"{'phase':<44} {'per step':>11} {'share':>6}")
    for phase in ("forward", "backward", "optimizer", "other"):
        total = inst.phase[phase] + (rest if phase == "other" else 0.0)
        print(f"{phase:<44} {_ms(total, n)} {100 * total / step_total:5.1f}%")
        rows = [(lab, inst.incl[lab]) for lab, ph in inst.label_phase.items() if ph == phase]
        for lab, t in sorted(rows, key=lambda r: -r[1]):
            calls = inst.calls[lab] // n
            print(f"    {lab + f' (x{calls})':<40} {_ms(t, n)} {100 * t / step_total:5.1f}%")
        if phase == "other":
            print(f"    {'rest of train_step (not in the above)':<40} {_ms(rest, n)} {100 * rest / step_total:5.1f}%")


def report_ops(inst: Instrument, step_total: float, n: int) -> None:
    """Exclusive time of every wrapped function: the ops, and the glue left in each phase function."""
    print("(exclusive = minus wrapped callees; a phase function's own code is its inline numpy: reshape\n"
          " copies, transposes, residual adds, and in head_fwd/head_bwd the tied LM-head matmuls)")
    total = step_total + inst.worker_time
    if inst.worker_time:
        print(f"(ops run on every thread: blocks split their sequences over threads, so times are summed\n"
              f" over threads, {_ms(total, n).strip()} of thread time per {_ms(step_total, n).strip()} step; "
              "shares are of that)")
    print(f"{'function':<44} {'per step':>11} {'share':>6} calls/step")
    rows = []
    for lab, t in inst.excl.items():
        name = lab
        if inst.label_phase[lab] in ("forward", "backward"):
            name = f"{lab} (own code)"
        rows.append((name, t, inst.calls[lab] // n))
    accounted = sum(inst.excl.values())
    rows.append(("(train_step outside every wrapped function)", total - accounted, 1))
    for name, t, calls in sorted(rows, key=lambda r: -r[1]):
        print(f"{name:<44} {_ms(t, n)} {100 * t / total:5.1f}% {calls:>5}")


class HandOffs:
    """Times the main thread's stretches between hand-offs to the threads (`_run_all`, the
    one place numesh.host.threads starts work on them), keyed by the calls (innermost
    first) that end each stretch, and the stretches before the first and after the last."""

    def __init__(self, depth: int = 5):
        from numesh.host import threads

        # wall time: a process's CPU time (--clock cpu) would count the workers spinning
        # awake after each hand-off as the main thread's
        self.threads, self.clock, self.depth = threads, time.perf_counter, depth
        self.start = self.clock()
        self.between: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)
        self.edges = [0.0, 0.0]  # before the first hand-off, after the last (the whole step: none)
        self.hand_offs = 0
        self.last: float | None = None
        self._orig = threads._run_all

        def run_all(calls):
            t0 = self.clock()
            if self.last is not None:
                f, names = sys._getframe(1), []
                while f is not None and len(names) < self.depth:
                    names.append(f.f_code.co_name)
                    f = f.f_back
                where = " < ".join(names)
                self.between[where] += t0 - self.last
                self.count[where] += 1
            else:
                self.edges[0] += t0 - self.start
            self.hand_offs += 1
            try:
                self._orig(calls)
            finally:
                self.last = self.clock()

        threads._run_all = run_all

    def step(self, fn) -> float:
        """Run one step under the timers; its time."""
        self.start, self.last = self.clock(), None
        fn()
        end = self.clock()
        self.edges[1] += end - (self.start if self.last is None else self.last)
        return end - self.start

    def restore(self) -> None:
        self.threads._run_all = self._orig

    def report(self, step_total: float, n: int) -> None:
        alone = sum(self.between.values()) + sum(self.edges)
        print(f"(hand-offs a step: {self.hand_offs / n:.0f}; the main thread alone "
              f"{_ms(alone, n).strip()} of {_ms(step_total, n).strip()}: {_ms(self.edges[0], n).strip()} before the "
              f"first, {_ms(self.edges[1], n).strip()} after the last, the rest between them, by the call that ends "
              "each stretch, innermost first)")
        for where, t in sorted(self.between.items(), key=lambda kv: -kv[1]):
            print(f"{_ms(t, n)} {self.count[where] / n:5.1f}x  {where}")


# --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS | LLAMA_PRESETS), default="default")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--steps", type=int, default=20, help="steps per view (default 20)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--sort", default="tottime", help="pstats sort key (default tottime)")
    ap.add_argument("--malloc", choices=("keep", "glibc"), default="keep",
                    help="keep freed memory for reuse as `numesh train` does (default), or glibc's defaults")
    ap.add_argument("--data", default=None)
    ap.add_argument("--src", default=DEFAULT_SRC)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall: elapsed time (default); cpu: this process's CPU time on all its threads "
                         "(time.process_time), which a busy machine's other processes do not inflate: each op's "
                         "own cost when one op runs at a time (blocks whole, e.g. batch 1, or --threads 1); blocks "
                         "run as pieces on several threads count each other's time")
    args = ap.parse_args(argv)
    clock = step_clock(args.clock)

    from numesh.host.runtime import set_blas_threads

    threads = set_blas_threads(args.threads)
    kept = keep_freed_memory() if args.malloc == "keep" else False
    model_cfg = preset_config(args.preset, args.batch_size, args.block_size)
    with dataset_dir(args.data, args.src, log=log) as data:
        tr = make_trainer(model_cfg, data, args.dtype)
        print(f"config: preset={args.preset} {model_cfg} dtype={args.dtype} threads={threads} clock={args.clock} "
              f"steps={args.steps} (+{args.warmup} warmup) malloc={'keep freed memory' if kept else 'glibc defaults'}")
        for _ in range(args.warmup):
            tr.train_step()

        # 0. plain steps, for reference
        t = []
        with CpuMonitor() as mon:
            for _ in range(args.steps):
                t0 = clock()
                tr.train_step()
                t.append(clock() - t0)
        step_ms = statistics.median(t) * 1e3
        print(f"Trainer.train_step: median {step_ms:.2f} ms, mean {statistics.fmean(t) * 1e3:.2f} ms, "
              f"min {min(t) * 1e3:.2f} ms ({_load(mon, args.steps)})")

        # 1. cProfile
        prof = cProfile.Profile(clock)
        with CpuMonitor() as mon:
            prof.enable()
            for _ in range(args.steps):
                tr.train_step()
            prof.disable()
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf)
        stats.sort_stats(args.sort).print_stats(args.top)
        text = buf.getvalue()
        text = text[text.find("   ncalls") if "   ncalls" in text else 0:]
        print(f"\n== cProfile over {args.steps} train_step calls (top {args.top} by {args.sort}; "
              f"{_load(mon, args.steps)}) ==")
        print(text.rstrip().replace(str(Path(__file__).resolve().parents[1]) + "/", ""))

        # 2 + 3. phases and ops, from timers around numesh's functions during train_step()
        inst = Instrument(clock)
        inst.patch_functions(PHASE_FUNCS)
        inst.patch_functions({name: None for name in OP_FUNCS})
        if getattr(tr, "opt", None) is not None:
            inst.patch_methods(tr.opt, PHASE_METHODS)
        t = []
        try:
            with CpuMonitor() as mon:
                for _ in range(args.steps):
                    t0 = clock()
                    tr.train_step()
                    t.append(clock() - t0)
        finally:
            inst.restore()
        n, total = args.steps, sum(t)
        print(f"\n== phases (ms per step, mean of {n} instrumented steps: {total / n * 1e3:.2f} ms; "
              f"median {statistics.median(t) * 1e3:.2f} ms vs {step_ms:.2f} ms uninstrumented; "
              f"{_load(mon, args.steps)}) ==")
        report_phases(inst, total, n)
        print("\n== ops and glue (exclusive time of each wrapped function, ms per step) ==")
        report_ops(inst, total, n)

        # 4. the main thread alone between hand-offs
        if threads > 1:
            hand = HandOffs()
            try:
                total = sum(hand.step(tr.train_step) for _ in range(args.steps))
            finally:
                hand.restore()
            print(f"\n== hand-offs: the main thread alone between them (the other threads waiting), ms per step "
                  f"(mean of {args.steps} steps: {total / args.steps * 1e3:.2f} ms) ==")
            hand.report(total, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
