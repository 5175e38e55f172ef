"""numba compiles numesh's kernels with 512-bit vectors on AVX-512 CPUs
(numesh/host/numba_target.py), and leaves a user's own choice, and a numba that has
already compiled, as they are."""

import json
import os
import subprocess
import sys

import pytest

from numesh.host import kernels as K
from numesh.host import numba_target

pytestmark = pytest.mark.skipif(not K.HAVE_NUMBA, reason="numba is not installed")

# What a fresh process ends with: numba's code generator's features after numesh's kernels
# compiled one function, and whether the host has AVX-512.
PROBE = """
import json, sys
if sys.argv[1] == "numba-first":
    import numba
    numba.njit(lambda x: x + 1)(1)
import numpy as np
import llvmlite.binding as llvm
from numba.core import registry
from numesh.host import kernels as K
K.exp32(np.float32(1.0))
print(json.dumps({"features": registry.cpu_target.target_context.codegen()._tm_features,
                  "avx512f": bool(llvm.get_host_cpu_features().get("avx512f"))}))
"""


def _probe(mode: str, **env: str) -> dict:
    """PROBE's reading in a fresh process (`mode`: numesh-first, or numba-first: numba
    compiles a function before numesh is imported), NUMBA_CPU_FEATURES only as `env` says."""
    base = {k: v for k, v in os.environ.items() if k != "NUMBA_CPU_FEATURES"}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env={**base, **env}, capture_output=True, text=True,
                         timeout=240, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_features_drop_the_256_bit_preference_on_avx512_only():
    assert numba_target.features({"avx512f": True, "avx2": True}, "+avx2,+avx512f") == \
        "+avx2,+avx512f,-prefer-256-bit"
    assert numba_target.features({"avx512f": False, "avx2": True}, "+avx2,-avx512f") is None
    assert numba_target.features({"avx2": True}, "+avx2") is None


def test_kernels_compile_full_width_where_the_cpu_has_avx512():
    """A fresh process that imports numesh's kernels compiles with "-prefer-256-bit" exactly
    when the host has AVX-512 (on an AVX2 machine: numba's own features, unchanged)."""
    got = _probe("numesh-first")
    assert got["features"].endswith(",-prefer-256-bit") == got["avx512f"], got


def test_a_users_features_and_an_earlier_compile_are_kept():
    """NUMBA_CPU_FEATURES set by the user wins; and where numba compiled before numesh was
    imported, its code generator (fixed features) is left alone."""
    mine = "+sse2,+sse4.2"
    assert _probe("numesh-first", NUMBA_CPU_FEATURES=mine)["features"] == mine
    assert "prefer-256-bit" not in _probe("numba-first")["features"]


def test_a_cpu_whose_features_llvm_cannot_read_is_left_alone(monkeypatch):
    """Where LLVM cannot read the host's features (it raises, as numba expects on some
    platforms), nothing is set."""
    import llvmlite.binding as llvm
    from numba.core import config, registry

    def fail():
        raise RuntimeError("no features")

    monkeypatch.setattr(llvm, "get_host_cpu_features", fail)
    monkeypatch.setattr(config, "CPU_FEATURES", None)
    monkeypatch.delenv("NUMBA_CPU_FEATURES", raising=False)
    monkeypatch.delitem(vars(registry.cpu_target), "_toplevel_target_context", raising=False)
    assert numba_target.prefer_full_width() is False
    assert config.CPU_FEATURES is None


def test_vector_bytes_follow_the_features_numba_compiles_with():
    """64 where numba's features include AVX-512 (the user's NUMBA_CPU_FEATURES, else the
    host's), 32 otherwise: tile_gemm's register blocks are sized by it."""
    import llvmlite.binding as llvm

    code = "from numesh.host import numba_target; print(numba_target.vector_bytes())"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CPU_FEATURES"}
    for feats, want in ((None, 64 if llvm.get_host_cpu_features().get("avx512f") else 32),
                        ("+sse2,+avx,+avx2,+fma", 32), ("+sse2,+avx,+avx2,+fma,+avx512f", 64)):
        run_env = env if feats is None else {**env, "NUMBA_CPU_FEATURES": feats}
        out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True, check=True)
        assert int(out.stdout) == want, feats
