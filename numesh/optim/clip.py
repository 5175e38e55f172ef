"""Global-norm gradient clipping that counts every parameter exactly once across the mesh.

The norm itself is `ZeroOptimizer.global_norm`, on the flat gradient buffers. Ranks along
pp, ep and tp hold different parameters (or different slices of them: ep the experts), so
their partial sums are added; a leaf replicated over tp or ep is counted on rank 0 of that
axis only (`counted_once`). Over
dp the synchronised gradients are identical copies, so dp enters only when the gradient
is sharded (ZeRO >= 1). The one pp duplicate (the tied embedding on the first and last
stage) is left out by the caller.
"""

from __future__ import annotations

from numesh.base.errors import ConfigError, check_scalar
from numesh.mesh import Mesh, P, replicated_axes


def counted_once(spec: P, mesh: Mesh) -> bool:
    """Whether this rank's copy of a leaf enters the norm: one copy over tp, and over ep,
    when the leaf is replicated there (its spec does not split it over that axis)."""
    replicated = replicated_axes(spec, mesh)
    return all(mesh.index(a) == 0 for a in ("ep", "tp") if a in replicated)


def clip_scale(norm: float, max_norm: float) -> float:
    """Factor to multiply gradients by so their global norm is at most `max_norm` (1 if it
    is; `max_norm` 0 = off). A one-line ConfigError for a negative `max_norm` (was "off"),
    a non-number, or a non-finite `norm` (was a NaN factor): no factor rescues a NaN or
    infinite norm, so train checks it first and skips or stops the step (--on-nan)."""
    check_scalar("clip_scale's max_norm", max_norm, float)
    if max_norm < 0.0:
        raise ConfigError(f"clip_scale's max_norm must be >= 0 (0 = no clipping), got {max_norm}")
    check_scalar("clip_scale's norm", norm, float)
    if max_norm == 0.0 or norm <= max_norm:
        return 1.0
    return max_norm / (norm + 1e-6)
