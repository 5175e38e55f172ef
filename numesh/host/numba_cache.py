"""numba's on-disk cache of numesh's kernels, keyed on all their sources, not one file.

numba keys a cached function on its own source file, but it compiles the njit functions
that function calls into its machine code: numesh/host/attention_kernels.py's `group_fwd`
holds numesh/host/kernels.py's `stripe_softmax`. After an update (a `git pull` into an
editable install) that changed kernels.py alone, the cached `group_fwd` would go on running
the old stripe passes, silently. Here every function of numesh's kernel files is keyed on
one hash of all of them, so a change to any recompiles them all.

It hooks numba's cache locators, which are numba's internals: where numba's cache no longer
looks like this module expects, `install` leaves numba's own keys (one file each) and says
so by returning False.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# the files with cached njit code, and lanes.py, whose vector reductions compile into kernels.py's
SOURCES = ("kernels.py", "attention_kernels.py", "llama_kernels.py", "blas.py", "lanes.py", "tile_gemm.py")


@functools.cache
def stamp() -> bytes:
    """The SHA-256 of every kernel file's bytes, in `SOURCES` order: each cached kernel's key."""
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((_HERE / name).read_bytes())
    return h.digest()


def _ours(py_file: str) -> bool:
    p = Path(py_file).resolve()
    return p.parent == _HERE and p.name in SOURCES


def _keyed(base: type) -> type:
    """numba's locator `base`, for numesh's kernel files only, with `stamp` as their key."""

    class Keyed(base):  # type: ignore[misc, valid-type]
        numesh = True

        def get_source_stamp(self):
            return stamp()

        @classmethod
        def from_function(cls, py_func, py_file):
            return super().from_function(py_func, py_file) if _ours(py_file) else None

    Keyed.__name__ = f"NumeshKeyed{base.__name__}"
    return Keyed


def install() -> bool:
    """Put the keyed locators first in numba's list (before any kernel is decorated: numba
    picks a function's locator when `njit(cache=True)` wraps it), in numba's own order: the
    user's NUMBA_CACHE_DIR, beside the source, the user-wide cache. Idempotent."""
    try:
        from numba.core import caching

        impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl  # its name before numba 0.60
        classes = impl._locator_classes
        bases = (caching.UserProvidedCacheLocator, caching.InTreeCacheLocator, caching.UserWideCacheLocator)
    except (ImportError, AttributeError):
        return False
    if not any(getattr(c, "numesh", False) for c in classes):
        classes[:0] = [_keyed(b) for b in bases]
    return True
