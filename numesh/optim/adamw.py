"""AdamW over one flat parameter vector.

Parameters, gradients and both moments live in flat buffers (the parameter tree is a set
of views into its buffer), so an optimiser step is a handful of vectorised operations
whatever the number of leaves, and ZeRO can shard the same buffers by plain slicing.
The step updates its buffers in place: they are donated, as with JAX's `donate_argnums`.

With numba installed the update is one fused pass (numesh.host.kernels.adamw) instead of the
reference's fourteen NumPy passes; `adamw_step_reference` is the readable definition it is
tested against (bit-identical: the same operations in the same order, in the buffers' dtype).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import attrs
import numpy as np

from numesh.base.errors import ConfigError, check_scalar
from numesh.base.tree import Tree, flatten, tree_map_with_path
from numesh.host import kernels as K
from numesh.host.threads import over_rows
from numesh.optim.interface import Elementwise, Leaf, Optimizer
from numesh.optim.lr import DEFAULT_LEARNING_RATE, check_decay


@attrs.frozen
class AdamWConfig:
    """AdamW's constants, fixed for a run (the learning rate changes every step, so each
    step is given it).

    Attributes:
        beta1: decay of the first moment (the gradient's running mean).
        beta2: decay of the second moment (the squared gradient's running mean).
        eps: added to the second moment's bias-corrected root, keeping the division finite.
        weight_decay: decoupled decay, applied only where `decay_mask` is 1.
    """

    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.1

    def __attrs_post_init__(self) -> None:
        check_adamw(self)  # a config built by hand is checked as the options' is


# the options `define` reads (`TrainConfig` fields) and their types; learning_rate is the
# schedule's, taken so that every optimiser accepts the run's rate
OPTIONS: dict[str, type] = {"learning_rate": float, "beta1": float, "beta2": float, "weight_decay": float}


@attrs.define
class AdamWState:
    """First and second moments (flat, like the parameters they follow) and the step count.
    Mutable, unlike the trees: a step updates the moments in place and counts itself.

    Attributes:
        m: the first moment, the shape of the flat parameters it follows.
        v: the second moment, likewise.
        step: steps taken, the t of the bias corrections 1 - β^t.
    """

    m: np.ndarray
    v: np.ndarray
    step: int = 0


def adamw_init(flat_params: np.ndarray) -> AdamWState:
    return AdamWState(np.zeros_like(flat_params), np.zeros_like(flat_params))


def decays(path: str, x: np.ndarray) -> bool:
    """Whether weight decay applies to a leaf: matrices and embeddings, not biases or norms
    (nanoGPT's groups; a qkv bias is stored [3, C] but is still a bias)."""
    return np.ndim(x) >= 2 and not path.endswith(".b")


def decay_mask(params: Tree, dtype=np.float64) -> np.ndarray:
    """1 where weight decay applies, else 0, in `flatten` order."""
    return flatten(tree_map_with_path(lambda p, x: np.full(np.shape(x), float(decays(p, x))), params), dtype=dtype)


def _next_step(state: AdamWState, lr: float, cfg: AdamWConfig) -> tuple[float, float, float]:
    """Count the step and return its scalars: the decay factor lr·wd, lr/(1 - β1^t) and
    1/sqrt(1 - β2^t) (the bias corrections), the same for the fused and reference updates.
    Python floats: NumPy rounds them to the buffers' dtype (a NumPy float64 would make the
    reference's float32 product with it a float64 one)."""
    state.step += 1
    t = state.step
    lr = float(lr)  # a NumPy float64 here would make the reference's float32 products float64
    return lr * cfg.weight_decay, lr / (1.0 - cfg.beta1**t), 1.0 / math.sqrt(1.0 - cfg.beta2**t)


def adamw_step(
    params: np.ndarray,
    grads: np.ndarray,
    state: AdamWState,
    lr: float,
    cfg: AdamWConfig,
    decay: np.ndarray,
    scratch: np.ndarray | None = None,
) -> None:
    """One decoupled-weight-decay Adam step on flat buffers (PyTorch's AdamW formula). A
    ValueError line unless params are a flat float32 or float64 array and grads, the
    moments, decay (and scratch) have its shape (the fused pass read past a shorter one), and
    those it writes (params, the moments, scratch) are writeable."""
    _check_buffers(params, grads, state, decay, scratch)
    if not K.enabled():
        return adamw_step_reference(params, grads, state, lr, cfg, decay, scratch)
    f = params.dtype.type  # every scalar in the buffers' dtype, as the reference's NumPy rounds it
    wd, c1, c2 = _next_step(state, lr, cfg)
    consts = tuple(f(c) for c in (wd, cfg.beta1, 1.0 - cfg.beta1, cfg.beta2, 1.0 - cfg.beta2, cfg.eps, c1, c2))

    def rows(r: slice) -> None:
        K.adamw(params[r], grads[r], state.m[r], state.v[r], decay[r], *consts)

    over_rows(rows, params.shape[0], 1 << 16)


def _check_buffers(params: np.ndarray, grads: np.ndarray, state: AdamWState, decay: np.ndarray | None,
                   scratch: np.ndarray | None) -> None:
    """`adamw_step`'s entry checks: a dtype and a few tuple comparisons, nothing per element."""
    K.check_float("adamw_step's params", params)
    if params.ndim != 1:
        raise ValueError(f"adamw_step's params must be a flat (1-D) buffer, got shape {params.shape}: "
                         f"pass params.reshape(-1) and its grads, moments and decay likewise")
    if decay is None:
        raise ValueError("adamw_step's decay must be an array of params' shape (decay_mask's; ones to decay "
                         "every value, zeros for none), got None")
    why = f"params {params.shape}"
    for what, a in (("grads", grads), ("state.m", state.m), ("state.v", state.v), ("decay", decay),
                    ("scratch", scratch)):
        if a is not None:
            K.check_shape(f"adamw_step's {what}", a, params.shape, why)
    for what, a in (("params", params), ("state.m", state.m), ("state.v", state.v), ("scratch", scratch)):
        if a is not None and not a.flags.writeable:  # the step writes them: numba's was a page of typing errors
            raise ValueError(f"adamw_step's {what} is read-only: pass a writeable copy (np.array(...))")


def adamw_step_reference(
    params: np.ndarray,
    grads: np.ndarray,
    state: AdamWState,
    lr: float,
    cfg: AdamWConfig,
    decay: np.ndarray,
    scratch: np.ndarray | None = None,
) -> None:
    """`adamw_step` as plain NumPy passes over a scratch buffer."""
    wd, c1, c2 = _next_step(state, lr, cfg)
    tmp = np.empty_like(params) if scratch is None else scratch

    def rows(r: slice) -> None:
        p, g, m, v, s = params[r], grads[r], state.m[r], state.v[r], tmp[r]
        # p -= lr * wd * p  (decoupled decay, only where decay == 1)
        np.multiply(p, decay[r], out=s)
        s *= wd
        p -= s
        # moments
        m *= cfg.beta1
        np.multiply(g, 1.0 - cfg.beta1, out=s)
        m += s
        v *= cfg.beta2
        np.multiply(g, g, out=s)
        s *= 1.0 - cfg.beta2
        v += s
        # p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
        np.sqrt(v, out=s)
        s *= c2
        s += cfg.eps
        np.divide(m, s, out=s)
        s *= c1
        p -= s

    over_rows(rows, params.shape[0], 1 << 16)


# ---------------------------------------------------------------------------------------
# AdamW as an optimiser of the interface (numesh/optim/interface.py)


def check_adamw(cfg: AdamWConfig) -> None:
    """One-line ConfigError unless AdamW's constants are usable (finite numbers, NumPy's
    too, in range)."""
    for name in ("beta1", "beta2", "eps", "weight_decay"):
        check_scalar(name, getattr(cfg, name), float)  # beta1='0.9' was a TypeError in the comparison below
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(cfg, name) < 1.0:
            raise ConfigError(f"{name} must be in [0, 1), got {getattr(cfg, name)}")
    if not 0 < cfg.eps < math.inf:
        raise ConfigError(f"AdamW's eps must be a finite number > 0, got {cfg.eps}")
    if not 0 <= cfg.weight_decay < math.inf:
        raise ConfigError(f"weight_decay must be a finite number >= 0, got {cfg.weight_decay}")


def adamw_config(options: Mapping[str, Any]) -> AdamWConfig:
    """AdamW's constants from a run's options (`TrainConfig` fields: beta1, beta2,
    weight_decay; defaults where absent), checked, the decay against learning_rate too."""
    d = AdamWConfig()
    cfg = AdamWConfig(float(options.get("beta1", d.beta1)), float(options.get("beta2", d.beta2)), d.eps,
                      float(options.get("weight_decay", d.weight_decay)))
    check_decay(float(options.get("learning_rate", DEFAULT_LEARNING_RATE)), cfg.weight_decay)
    return cfg


def adamw_rule(cfg: AdamWConfig, lr_ratio: float = 1.0) -> Elementwise:
    """AdamW as an elementwise rule: state "m" and "v"."""

    def step(p: np.ndarray, g: np.ndarray, states: Sequence[np.ndarray], lr: float, t: int, decay: np.ndarray,
             scratch: np.ndarray) -> None:
        m, v = states
        adamw_step(p, g, AdamWState(m, v, t - 1), lr, cfg, decay, scratch)

    return Elementwise("adamw", ("m", "v"), step, lr_ratio)


def define(options: Mapping[str, Any]) -> Optimizer:
    """`--optimizer adamw`: AdamW on every leaf."""
    cfg = adamw_config(options)
    return Optimizer("adamw", cfg, (adamw_rule(cfg),), _every_leaf)


def _every_leaf(_leaf: Leaf) -> int:
    return 0
