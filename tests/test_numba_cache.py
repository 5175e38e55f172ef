"""numba's on-disk cache of numesh's kernels is renewed when any kernel file changes
(numesh/host/numba_cache.py): numba alone keys a function on its own file, though it
compiles the kernels it calls into it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import numesh
from numesh.host import kernels as K

pytestmark = pytest.mark.skipif(not K.HAVE_NUMBA, reason="numba is not installed: no kernels to cache")

# swiglu_fwd (llama_kernels.py) calls kernels.py's vexp: run it once in a fresh process of
# the copied package and print whether it came from the cache
_RUN = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, sys.argv[1])
import numpy as np
import numesh
assert numesh.__file__.startswith(sys.argv[1]), numesh.__file__
from numesh.host import llama_kernels as LK
x = np.ones(8, np.float32)
LK.swiglu_fwd(x, x, np.empty_like(x))
print(sum(LK.swiglu_fwd.stats.cache_hits.values()), sum(LK.swiglu_fwd.stats.cache_misses.values()))
"""


def _hits_and_misses(src: Path, cache: Path) -> tuple[int, int]:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "NUMESH_KERNELS": "numba"}
    out = subprocess.run([sys.executable, "-c", _RUN, str(src)], env=env, capture_output=True, text=True,
                         check=True, timeout=300).stdout.split()
    return int(out[0]), int(out[1])


def test_a_change_to_kernels_py_recompiles_the_kernels_that_call_into_it(tmp_path):
    """A copy of numesh: compiled once (a miss), then loaded from the cache (a hit: the
    cache works); then kernels.py changes, llama_kernels.py does not, and swiglu_fwd, which
    holds kernels.py's exp, must compile again (numba's own key would load the stale copy)."""
    src = tmp_path / "src"
    shutil.copytree(Path(numesh.__file__).parent, src / "numesh", ignore=shutil.ignore_patterns("__pycache__"))
    cache = tmp_path / "cache"
    assert _hits_and_misses(src, cache) == (0, 1), "the first run compiles"
    assert _hits_and_misses(src, cache) == (1, 0), "an unchanged package loads the kernel from the cache"
    kernels_py = src / "numesh" / "host" / "kernels.py"
    kernels_py.write_text(kernels_py.read_text() + "\n# an update that changes kernels.py alone\n")
    assert _hits_and_misses(src, cache) == (0, 1), "a kernel that calls into a changed kernels.py must recompile"
