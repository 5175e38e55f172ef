"""`keep_freed_memory`: a worker thread that frees what it allocated gets the same pages back
next time, without faulting them in again (glibc only: elsewhere the call is a no-op)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# A worker thread fills 40 MiB (its arena's first heap) and 40 MiB more (a second heap),
# frees both, four times; it prints the page faults of each round. Transparent huge pages
# are off for the process (prctl PR_SET_THP_DISABLE), so a fault is one 4 KiB page whatever
# the machine's THP setting.
_ROUNDS = """
import ctypes, json, resource, sys, threading
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)
import numpy as np
from numesh.host import runtime

if sys.argv[1] == "numesh":
    assert runtime.keep_freed_memory()
elif sys.argv[1] == "no-top-pad":  # what numesh asked glibc for before the top pad
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 30)
    libc.mallopt(-1, (1 << 31) - 1)
faults = []

def work():
    for _ in range(4):
        f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        a = np.empty(5 << 20)
        a.fill(1.0)
        b = np.empty(5 << 20)
        b.fill(1.0)
        del b, a
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)

t = threading.Thread(target=work)
t.start()
t.join()
print(json.dumps(faults))
"""


def _faults(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_a_worker_thread_reuses_its_freed_heaps() -> None:
    first, *again = _faults("numesh")
    assert first > 15_000  # the first round faults its 80 MiB in: 20,480 pages
    assert max(again) < 50, again
    # the control: without the top pad glibc unmaps the emptied second heap each round
    _, *again = _faults("no-top-pad")
    assert min(again) > 8_000, again  # its 40 MiB: 10,240 pages
