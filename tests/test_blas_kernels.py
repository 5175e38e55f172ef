"""The bit-for-bit thread-count checks (tests marked `bits`) rerun under each OpenBLAS kernel
family, each in a fresh process with OPENBLAS_CORETYPE set.

OpenBLAS picks its kernels for the CPU it runs on (OPENBLAS_CORETYPE overrides the pick), and
on some kernels a row of a product rounds differently in calls of different shapes. A split
that is exact with this machine's own kernels need not be with another machine's, so every
machine that runs the suite checks all four families its CPU can execute, not just its own.
The suite's own process keeps the environment's OPENBLAS_CORETYPE, whatever it is.

numesh's own GEMMs run on numpy's BLAS in those runs (NUMESH_BLAS=numpy), and once more on
MKL where pip's `mkl` is installed (numesh.host.mkl).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from numesh.host.blas import loaded_libraries

TESTS = Path(__file__).parent

# family: (the CPU features its kernels use, as numpy names them; the names OpenBLAS reports
# when it runs that family: Zen runs Haswell's kernels and may say so)
KERNELS = {
    "Haswell": (("AVX2", "FMA3"), {"Haswell"}),
    "SkylakeX": (("AVX512_SKX",), {"SkylakeX"}),
    "Zen": (("AVX2", "FMA3"), {"Zen", "Haswell"}),
    "Sandybridge": (("AVX",), {"Sandybridge"}),
}


def why_not(family: str) -> str | None:
    """Why this machine cannot run OpenBLAS's `family` kernels, or None if it can."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"OpenBLAS's x86 kernel families need an x86-64 CPU, this is {platform.machine()}"
    blas = loaded_libraries()
    if not blas or blas[0]["internal_api"] != "openblas":
        return f"numpy's BLAS is {blas[0]['internal_api'] if blas else 'unknown'}, not OpenBLAS"
    features = np._core._multiarray_umath.__cpu_features__
    missing = [f for f in KERNELS[family][0] if not features.get(f)]
    if missing:
        return f"this CPU lacks {', '.join(missing)}, which OpenBLAS's {family} kernels need"
    return None


def run(family: str, *args: str, timeout: float = 300, gemm: str = "numpy") -> subprocess.CompletedProcess:
    env = {**os.environ, "OPENBLAS_CORETYPE": family, "NUMESH_BLAS": gemm}
    return subprocess.run([sys.executable, *args], env=env, cwd=TESTS.parent, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("family", list(KERNELS))
def test_thread_counts_give_the_same_bits_on_every_blas_kernel(family: str) -> None:
    reason = why_not(family)
    if reason:
        pytest.skip(f"OPENBLAS_CORETYPE={family} not checked: {reason}")
    probe = run(family, "-c", "import numpy, threadpoolctl; print([i.get('architecture') for i in "
                              "threadpoolctl.threadpool_info() if i['user_api'] == 'blas'][0])", timeout=60)
    assert probe.returncode == 0, probe.stderr
    arch = probe.stdout.strip()
    if arch not in KERNELS[family][1]:
        pytest.skip(f"OPENBLAS_CORETYPE={family} not checked: this OpenBLAS ran {arch} instead (built without "
                    "DYNAMIC_ARCH?)")
    res = run(family, "-m", "pytest", "-q", "-m", "bits", "-p", "no:cacheprovider", str(TESTS / "test_threads.py"))
    lines = res.stdout.strip().splitlines()
    assert res.returncode == 0, "\n".join([f"under OPENBLAS_CORETYPE={family} ({arch} kernels):"]
                                          + [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
                                          + lines[-15:] + res.stderr.splitlines()[-5:])
    assert " passed" in lines[-1] and "failed" not in lines[-1], lines[-1]


def test_thread_counts_give_the_same_bits_on_mkl() -> None:
    """The same checks with numesh's GEMMs on MKL (sequential, strict CNR: numesh.host.mkl)."""
    from numesh.host import kernels, mkl

    if mkl.gemms() is None:
        pytest.skip("NUMESH_BLAS=mkl not checked: pip's mkl is not installed (pip install 'numesh[mkl]')")
    if not kernels.HAVE_NUMBA:
        pytest.skip("NUMESH_BLAS=mkl not checked: without numba numesh's GEMMs stay on numpy's BLAS")
    family = next((f for f in KERNELS if why_not(f) is None), None)
    env_family = os.environ.get("OPENBLAS_CORETYPE") or family or ""
    res = run(env_family, "-m", "pytest", "-q", "-m", "bits", "-p", "no:cacheprovider", str(TESTS / "test_threads.py"),
              gemm="mkl")
    lines = res.stdout.strip().splitlines()
    failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    tail = [*lines[-15:], *res.stderr.splitlines()[-5:]]
    assert res.returncode == 0, "\n".join(["with NUMESH_BLAS=mkl:", *failed, *tail])
    assert " passed" in lines[-1] and "failed" not in lines[-1], lines[-1]
