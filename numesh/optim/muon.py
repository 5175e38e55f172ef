"""Muon: momentum orthogonalised by a Newton–Schulz iteration for the blocks' matrices,
AdamW (its own learning rate and betas) for everything else.

The definition is torch.optim.Muon's (PyTorch >= 2.9). For a matrix W with gradient G and
momentum buffer B (zero at first):

    B ← B + (1 − μ)·(G − B)                    buf.lerp_(grad, 1 − μ)
    U ← G + μ·(B − G)  (Nesterov; else U = B)  grad.lerp(buf, μ)
    O ← NS(U)                                  5 steps of the quintic below
    W ← W·(1 − lr·wd) − lr·r·O

NS normalises X = U / max(‖U‖_F, eps), eps 1e-7, then 5 times A = X·Xᵀ, X ← a·X + (b·A +
c·A·A)·X with (a, b, c) = (3.4445, −4.7750, 2.0315), on the orientation with fewer rows. r
is `adjust_lr`: "original" √max(1, A/B), "match_rms_adamw" 0.2·√max(A, B) (Moonlight's:
the update's RMS then matches AdamW's, so Muon can share AdamW's learning rate), for the
A × B matrix torch is given, an nn.Linear weight [out, in]. numesh stores a Linear's
weight [in, out]: A is its out, B its in, and the iteration runs on the orientation torch
would use, so a square matrix is iterated as torch iterates its transpose.

Unlike PyTorch, which runs the iteration in bfloat16, numesh runs it in the run's dtype
(float32, or float64 for the parity tests): the same definition with less rounding, and
every mesh gives one rank's numbers.

Which leaves: `is_hidden_matrix`, every weight ("…w", two dims or more past the expert dims)
inside the blocks: attention's q, k, v (stored fused [C, 3, C]: three matrices) and output,
the MLP's matrices, each expert's matrices ([E, in, out]: E matrices) and the MoE router.
The embeddings, an LM head, norms and biases are AdamW's (the modded-nanoGPT and Moonlight
split). New block matrices (Llama's separate q/k/v, gate and up) are Muon's by what they are.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import attrs
import numpy as np

from numesh.base.errors import ConfigError, check_scalar
from numesh.host.threads import matmul
from numesh.optim.adamw import OPTIONS as ADAMW_OPTIONS
from numesh.optim.adamw import AdamWConfig, adamw_config, adamw_rule
from numesh.optim.interface import Leaf, MatrixRule, Optimizer
from numesh.optim.lr import DEFAULT_LEARNING_RATE, check_decay

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
ADJUST_LR = ("original", "match_rms_adamw")


@attrs.frozen
class MuonConfig:
    """Muon's hyper-parameters (torch.optim.Muon's, defaults as there but `adjust_lr`).

    Attributes:
        momentum: μ, the momentum's decay.
        nesterov: use the Nesterov point G + μ·(B − G) instead of B.
        ns_steps: Newton–Schulz iterations.
        ns_coefficients: the quintic's (a, b, c).
        eps: the smallest Frobenius norm divided by.
        adjust_lr: "original" or "match_rms_adamw" (numesh's default: AdamW's learning rate fits).
        weight_decay: decoupled, W·(1 − lr·wd) (every matrix).
        lr_ratio: Muon's peak learning rate over the run's (AdamW's).
        adamw: the AdamW of the other leaves.
    """

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS
    eps: float = 1e-7
    adjust_lr: str = "match_rms_adamw"
    weight_decay: float = 0.1
    lr_ratio: float = 1.0
    adamw: AdamWConfig = AdamWConfig()

    def __attrs_post_init__(self) -> None:
        check_muon(self)  # a config built by hand is checked as the options' is


# the options `define` reads (`TrainConfig` fields) and their types: AdamW's (its rule's) and Muon's
OPTIONS: dict[str, type] = {**ADAMW_OPTIONS, "muon_lr": float, "muon_momentum": float, "muon_nesterov": bool,
                            "muon_ns_steps": int, "muon_adjust_lr": str}


def check_muon(cfg: MuonConfig) -> None:
    """One-line ConfigError unless Muon's hyper-parameters are usable: of their types first
    (NumPy integers and floats are numbers; nesterov='no' is no bool, though truthy)."""
    for name, want in (("momentum", float), ("nesterov", bool), ("ns_steps", int), ("eps", float),
                       ("adjust_lr", str), ("weight_decay", float), ("lr_ratio", float)):
        check_scalar(f"muon_{name}" if name in ("momentum", "nesterov", "ns_steps", "adjust_lr") else name,
                     getattr(cfg, name), want)
    coefficients = cfg.ns_coefficients
    if not isinstance(coefficients, (tuple, list)) or len(coefficients) != 3:
        raise ConfigError(f"Muon's ns_coefficients must be three numbers (a, b, c), got {coefficients!r}")
    for c in coefficients:
        check_scalar("each of Muon's ns_coefficients", c, float)
    if not 0.0 <= cfg.momentum < 1.0:
        raise ConfigError(f"muon_momentum must be in [0, 1), got {cfg.momentum}")
    if not 1 <= cfg.ns_steps < 100:
        raise ConfigError(f"muon_ns_steps must be between 1 and 99, got {cfg.ns_steps}")
    if cfg.adjust_lr not in ADJUST_LR:
        raise ConfigError(f"muon_adjust_lr must be one of {', '.join(ADJUST_LR)}, got '{cfg.adjust_lr}'")
    if not 0 < cfg.eps < math.inf:
        raise ConfigError(f"Muon's eps must be a finite number > 0, got {cfg.eps}")
    if not 0 <= cfg.weight_decay < math.inf:
        raise ConfigError(f"weight_decay must be a finite number >= 0, got {cfg.weight_decay}")
    if not (cfg.lr_ratio > 0 and math.isfinite(cfg.lr_ratio)):
        raise ConfigError(f"Muon's learning rate must be > 0, got {cfg.lr_ratio} times the run's")
    if not isinstance(cfg.adamw, AdamWConfig):  # None or a dict was accepted, to fail at the first step
        raise ConfigError(f"MuonConfig's adamw must be an AdamWConfig (AdamWConfig(beta1=...)), got {cfg.adamw!r}")


def muon_config(options: Mapping[str, Any]) -> MuonConfig:
    """Muon's hyper-parameters from a run's options (`TrainConfig` fields muon_lr,
    muon_momentum, muon_nesterov, muon_ns_steps, muon_adjust_lr, weight_decay,
    learning_rate, and AdamW's; defaults where absent), checked (`make_optimizer` has
    checked their types)."""
    d = MuonConfig()
    # learning_rate absent is its default, as the run's: muon_lr is relative to it (it divided by 1.0)
    lr, muon_lr = float(options.get("learning_rate", DEFAULT_LEARNING_RATE)), float(options.get("muon_lr", 0.0))
    if muon_lr < 0:
        raise ConfigError(f"muon_lr must be >= 0 (0 = --learning-rate), got {muon_lr}")
    if muon_lr > 0 and not lr > 0:
        raise ConfigError(f"learning_rate must be > 0, got {lr}")
    ratio = muon_lr / lr if muon_lr > 0 else 1.0
    if not 0 < ratio < math.inf:  # else "lr_ratio must be a finite number", an option nobody passed
        raise ConfigError(f"--muon-lr {muon_lr:g} over --learning-rate {lr:g} is {ratio:g}: give two rates whose "
                          "ratio is a finite number above 0")
    weight_decay = float(options.get("weight_decay", d.weight_decay))
    check_decay(lr * ratio, weight_decay, "--muon-lr" if muon_lr > 0 else "--learning-rate")
    return MuonConfig(
        momentum=float(options.get("muon_momentum", d.momentum)),
        nesterov=bool(options.get("muon_nesterov", d.nesterov)),
        ns_steps=options.get("muon_ns_steps", d.ns_steps),
        adjust_lr=str(options.get("muon_adjust_lr", d.adjust_lr)),
        weight_decay=weight_decay,
        lr_ratio=ratio,
        adamw=adamw_config(options),
    )


def is_hidden_matrix(leaf: Leaf) -> bool:
    """Whether Muon updates a leaf: a weight inside the blocks with two dims or more past
    the dims split over ep (the experts' batch)."""
    if not leaf.path.startswith("blocks.") or leaf.name != "w":
        return False
    spec = list(leaf.spec) + [None] * (len(leaf.shape) - len(leaf.spec))
    experts = 0
    while experts < len(spec) and spec[experts] is not None and "ep" in (
            (spec[experts],) if isinstance(spec[experts], str) else spec[experts]):
        experts += 1
    return len(leaf.shape) - experts >= 2


# ---------------------------------------------------------------------------------------
# the update


def lerp(start: np.ndarray, end: np.ndarray, weight: float, out: np.ndarray) -> np.ndarray:
    """torch.lerp's formula: start + w·(end − start) for w < 0.5, else end − (1 − w)·(end − start)."""
    diff = end - start
    if weight < 0.5:
        diff *= weight
        return np.add(start, diff, out=out)
    diff *= 1.0 - weight
    return np.subtract(end, diff, out=out)


def momentum_direction(g: np.ndarray, buf: np.ndarray, cfg: MuonConfig) -> None:
    """The momentum step on a run of values: B ← lerp(B, G, 1 − μ), then G ← the Nesterov
    point lerp(G, B, μ) (or B), in place."""
    lerp(buf, g, 1.0 - cfg.momentum, out=buf)
    if cfg.nesterov:
        lerp(g, buf, cfg.momentum, out=g)
    else:
        g[...] = buf


def orthogonalise(x: np.ndarray, cfg: MuonConfig = MuonConfig()) -> np.ndarray:
    """NS(x) for one matrix x [in, out], in x's dtype: the quintic Newton–Schulz iteration
    on the orientation torch.optim.Muon uses for the [out, in] weight, x·(xᵀx)^(-1/2)
    approximately (its singular values pushed towards 1). A ValueError line unless x is a
    float matrix (an int one came back all zeros)."""
    if not isinstance(x, np.ndarray) or x.ndim != 2 or x.dtype.kind != "f":
        raise ValueError(f"orthogonalise takes a float matrix (a 2-D float array), got {_described(x)}")
    if not isinstance(cfg, MuonConfig):  # None was an AttributeError
        raise ValueError(f"orthogonalise's cfg must be a MuonConfig (or left out), got {cfg!r}")
    a, b, c = cfg.ns_coefficients
    work = x if x.shape[1] > x.shape[0] else x.T  # torch's W = xᵀ, transposed when it has more rows
    norm = float(np.sqrt(np.sum(work * work, dtype=work.dtype)))
    X = work / max(norm, cfg.eps)
    for _ in range(cfg.ns_steps):  # numesh's threads over fixed row tiles: the same bits for any thread count
        A = matmul(X, X.T)
        B = b * A + c * matmul(A, A)
        X = a * X + matmul(B, X)
    out = X if work is x else X.T
    return np.ascontiguousarray(out, dtype=x.dtype)


def _described(x: object) -> str:
    if not isinstance(x, np.ndarray):
        return type(x).__name__
    return f"a {x.ndim}-D array of shape {x.shape}" if x.ndim != 2 else f"a matrix of {x.dtype.name}"


def lr_factor(fan_in: int, fan_out: int, adjust_lr: str) -> float:
    """r of the update: torch's `_adjust_lr` for its A × B = out × in weight. A ValueError
    line for an empty matrix (was a ZeroDivisionError) or an unknown `adjust_lr` (was taken
    as "match_rms_adamw")."""
    if adjust_lr not in ADJUST_LR:
        raise ValueError(f"lr_factor's adjust_lr must be one of {', '.join(ADJUST_LR)}, got {adjust_lr!r}")
    if not (fan_in >= 1 and fan_out >= 1):
        raise ValueError(f"lr_factor's fan_in and fan_out must be >= 1, got {fan_in} and {fan_out}")
    A, B = fan_out, fan_in
    if adjust_lr == "original":
        return math.sqrt(max(1.0, A / B))
    return 0.2 * math.sqrt(max(A, B))


def apply_update(p: np.ndarray, update: np.ndarray, lr: float, fan: tuple[int, int], cfg: MuonConfig) -> None:
    """W ← W·(1 − lr·wd) − lr·r·O on a run of a matrix's values, in place."""
    p *= 1.0 - lr * cfg.weight_decay
    p -= (lr * lr_factor(*fan, cfg.adjust_lr)) * update


def ns_flops(fan_in: int, fan_out: int, steps: int = 5) -> float:
    """FLOPs of `orthogonalise` on an in × out matrix: per step, with s the smaller and l
    the larger dim, X·Xᵀ 2s²l, A·A 2s³ and B·X 2s²l."""
    s, big = min(fan_in, fan_out), max(fan_in, fan_out)
    return steps * (4.0 * s * s * big + 2.0 * s**3)


def muon_rule(cfg: MuonConfig) -> MatrixRule:
    """Muon as a matrix rule: state "momentum"."""

    def direction(g: np.ndarray, states: Sequence[np.ndarray]) -> None:
        momentum_direction(g, states[0], cfg)

    return MatrixRule(
        "muon", ("momentum",), direction, lambda x: orthogonalise(x, cfg),
        lambda p, o, lr, fan: apply_update(p, o, lr, fan, cfg),
        lambda fan_in, fan_out: ns_flops(fan_in, fan_out, cfg.ns_steps), cfg.lr_ratio,
    )


def define(options: Mapping[str, Any]) -> Optimizer:
    """`--optimizer muon`: Muon on the blocks' matrices, AdamW (rule 0) on the rest."""
    cfg = muon_config(options)
    return Optimizer("muon", cfg, (adamw_rule(cfg.adamw), muon_rule(cfg)),
                     lambda leaf: int(is_hidden_matrix(leaf)))
