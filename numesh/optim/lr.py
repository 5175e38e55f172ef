"""The learning-rate schedule (a function of the step; the pipeline's schedules of actions are
numesh/pipeline/schedules.py, another thing)."""

from __future__ import annotations

import math

from numesh.base.errors import ConfigError

DEFAULT_LEARNING_RATE = 1e-3  # --learning-rate's default: an optimiser given no learning_rate assumes it


def check_decay(lr: float, weight_decay: float, lr_flag: str = "--learning-rate") -> None:
    """One-line ConfigError where decoupled weight decay at the peak rate, W·(1 − lr·wd),
    would zero or flip the sign of every weight at each step (the run "trained" on)."""
    if lr * weight_decay >= 1.0:
        raise ConfigError(f"--weight-decay {weight_decay:g} times {lr_flag} {lr:g} is {lr * weight_decay:g}, not "
                          f"below 1: the decay W·(1 - lr·wd) would zero or flip every weight each step; lower either")


def cosine_lr(step: int, lr: float, min_lr: float, warmup_iters: int, decay_iters: int) -> float:
    """Linear warmup to `lr`, cosine decay to `min_lr` at `decay_iters`, then constant (nanoGPT's)."""
    if step < 0:  # the warmup's line goes below zero there: a negative rate would train uphill
        raise ConfigError(f"the learning-rate schedule starts at step 0, got step {step}")
    if step < warmup_iters:
        return lr * (step + 1) / (warmup_iters + 1)
    if step > decay_iters:
        return min_lr
    ratio = (step - warmup_iters) / max(decay_iters - warmup_iters, 1)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)
