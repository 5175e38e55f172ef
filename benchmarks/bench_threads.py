"""Hand-offs between numesh's threads: what waking a sleeping thread costs, and what spinning
awake first (numesh.host.spin) saves on a training step.

    python benchmarks/bench_threads.py                               # default model, 2048 x 1 and 64 x 12
    python benchmarks/bench_threads.py --rows default:2048x1 --steps 40
    python benchmarks/bench_threads.py --rows smollm2-4:2048x1 --steps 12

Two sections, in one process, on --threads threads (default: the cores):
  hand-off  an empty job's round trip through `threads._run_all` (post it, run it on a
            worker, see it done), with the waiters sleeping at once or spinning first,
            right after the previous one and after 1 and 5 ms idle: the wake-up cost;
  steps     `Trainer.train_step()` of each row, spin off and on alternating every --per
            steps after a warm-up, the median of each: the same process, the same
            memory, so the ratio is not the ±10-20 % between fresh processes on a VM.

It prints the machine, and whether the guest polls before halting an idle vCPU (Linux's
haltpoll `guest_halt_poll_ns`: 0 means no, and each wake-up goes through the hypervisor).
A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numesh  # noqa: F401  # isort: skip  (before numpy: it sets up OpenBLAS)
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import make_trainer, preset_config  # noqa: E402
from common import DEFAULT_SRC, dataset_dir, describe, machine  # noqa: E402
from numesh.host import spin  # noqa: E402
from numesh.host import threads as TH  # noqa: E402
from numesh.host.runtime import configure_process  # noqa: E402

_HALTPOLL = Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns")


def hand_offs(rounds: int) -> None:
    print("\nhand-off: an empty job's round trip, µs (median, p90)")
    print("| waiters | back to back | after 1 ms idle | after 5 ms idle |")
    print("|---|---|---|---|")
    for spinning in (False, True):
        TH._spin = spinning
        cells = []
        for gap in (0.0, 1e-3, 5e-3):
            ts = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < gap:  # the other thread goes idle meanwhile
                    pass
                t0 = time.perf_counter()
                TH._run_all([lambda: None] * TH.threads())
                ts.append(time.perf_counter() - t0)
            cells.append(f"{np.median(ts) * 1e6:.0f}, {np.percentile(ts, 90) * 1e6:.0f}")
        print(f"| {'spin first' if spinning else 'sleep at once'} | " + " | ".join(cells) + " |")


def steps(row: str, data: str, n: int, per: int) -> None:
    preset, shape = row.split(":")
    T, B = map(int, shape.split("x"))
    trainer = make_trainer(preset_config(preset, B, T), data)
    for _ in range(3):
        trainer.train_step()
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(n):
        spinning = (i // per) % 2 == 1
        TH._spin = spinning
        t0 = time.perf_counter()
        trainer.train_step()
        times[spinning].append(time.perf_counter() - t0)
    off, on = (statistics.median(times[s]) * 1e3 for s in (False, True))
    print(f"| {preset} | {T} × {B} | {off:.1f} | {on:.1f} | {off / on:.3f}× | {len(times[True])} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="default:2048x1,default:64x12", help="preset:TxB,... (default %(default)s)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per row, half each way")
    ap.add_argument("--per", type=int, default=2, help="steps in a row before switching")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=300, help="round trips per hand-off cell")
    ap.add_argument("--data", default=None, help="dataset dir from `numesh data` (default: a temporary one)")
    ap.add_argument("--src", default=DEFAULT_SRC)
    ap.add_argument("--spin-seconds", type=float, default=spin.SPIN_SECONDS,
                    help="how long a waiter spins before it sleeps (default %(default)s)")
    args = ap.parse_args()
    spin.SPIN_SECONDS = args.spin_seconds
    threads = configure_process(args.threads, None)
    print(describe(machine()))
    poll = _HALTPOLL.read_text().strip() if _HALTPOLL.exists() else "no haltpoll driver"
    print(f"{threads} threads, spinning allowed: {TH._spin} (up to {spin.SPIN_SECONDS * 1e3:g} ms); "
          f"guest_halt_poll_ns: {poll}")
    if threads < 2:
        raise SystemExit("bench_threads: needs 2 threads or more (--threads)")
    hand_offs(args.rounds)
    print("\nsteps: Trainer.train_step(), ms (median), spin off and on alternating in one process")
    print("| model | T × B | sleep at once | spin first | speed-up | steps each |")
    print("|---|---|---|---|---|---|")
    with dataset_dir(args.data, args.src) as data:
        for row in args.rows.split(","):
            steps(row, data, args.steps, args.per)
    TH._spin = True


if __name__ == "__main__":
    main()
