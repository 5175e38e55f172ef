"""The machine code numba compiles numesh's kernels for: full-width vectors on AVX-512.

LLVM tunes Intel's AVX-512 server cores (Skylake-SP, Cascade Lake, Ice Lake) to prefer
256-bit vectors ("prefer-256-bit"), so numba's loops there run at AVX2's width although the
CPU has 512-bit registers and OpenBLAS's GEMMs already run at 512 bits between them. The
kernels' passes are memory-light element-wise loops (exp, sums, scales), which gain from
the wider vectors: on a Cascade Lake, the attention's softmax pass 1.41 -> 1.14 ns and its
probabilities pass 0.94 -> 0.63 ns an element, the default model's training step 3-6 %
faster (benchmarks/bench_long_context.py --sections model --base, with a checkout built
either way).

`prefer_full_width` turns the preference off by handing numba the host's features with
"-prefer-256-bit" (numba's `NUMBA_CPU_FEATURES` setting), before numba compiles anything
in the process, as numba reads it when it builds its code generator. It leaves things as
they are where the user set NUMBA_CPU_FEATURES, where the CPU has no AVX-512, and where
numba has already compiled code in this process (its code generator is built: then the
setting could not apply to numesh's kernels alone). A function's cached machine code is
keyed on these features (numba's cache index), so a cache written either way is not
reused the other way.
"""

from __future__ import annotations

NARROW = "prefer-256-bit"  # LLVM's x86 tuning flag that caps the vectoriser at 256 bits


def features(host: dict[str, bool], flattened: str) -> str | None:
    """The feature string numba should compile with on a CPU whose features are `host`
    (flattened: `flattened`), or None to keep numba's default: only AVX-512 CPUs change."""
    return f"{flattened},-{NARROW}" if host.get("avx512f") else None


def prefer_full_width() -> bool:
    """Have numba compile for the host with 512-bit vectors where it has AVX-512; whether it
    now does. Call after importing numba and before compiling anything."""
    from numba.core import config, registry

    if config.CPU_FEATURES is not None:
        return False  # the user's choice (numba read NUMBA_CPU_FEATURES into it at import)
    if "_toplevel_target_context" in vars(registry.cpu_target):
        return False  # numba's code generator already exists, with its features fixed
    import llvmlite.binding as llvm

    try:
        host = llvm.get_host_cpu_features()
    except RuntimeError:  # LLVM cannot read this CPU's features (numba itself then passes none)
        return False
    wanted = features(dict(host), host.flatten())
    if wanted is None:
        return False
    config.CPU_FEATURES = wanted
    return True


def vector_bytes() -> int:
    """Bytes in a vector register of the code numba compiles here: 64 where its features (the
    host's, or the user's NUMBA_CPU_FEATURES) include AVX-512, else 32; 32 without numba.
    numesh.host.tile_gemm sizes its register blocks by it."""
    try:
        import llvmlite.binding as llvm
        from numba.core import config
    except ImportError:
        return 32
    try:
        flat = config.CPU_FEATURES if config.CPU_FEATURES is not None else llvm.get_host_cpu_features().flatten()
    except RuntimeError:  # LLVM cannot read this CPU's features
        return 32
    return 64 if "+avx512f" in flat.split(",") else 32
