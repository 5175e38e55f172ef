"""Optimisers, learning-rate schedules and gradient clipping."""

from numesh.optim.adamw import AdamWConfig, AdamWState, adamw_init, adamw_step, decay_mask
from numesh.optim.clip import clip_scale, counted_once
from numesh.optim.lr import cosine_lr

__all__ = [
    "AdamWConfig", "AdamWState", "adamw_init", "adamw_step", "clip_scale", "cosine_lr", "counted_once", "decay_mask",
]
