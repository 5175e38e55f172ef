"""Optimisers (an interface, AdamW, Muon), learning-rate schedules and gradient clipping."""

from numesh.optim.adamw import AdamWConfig, AdamWState, adamw_init, adamw_step, decay_mask
from numesh.optim.clip import clip_scale, counted_once
from numesh.optim.interface import Elementwise, Leaf, MatrixRule, Optimizer
from numesh.optim.lr import cosine_lr
from numesh.optim.muon import MuonConfig, orthogonalise
from numesh.optim.registry import OPTIMIZERS, make_optimizer

__all__ = [
    "OPTIMIZERS", "AdamWConfig", "AdamWState", "Elementwise", "Leaf", "MatrixRule", "MuonConfig", "Optimizer",
    "adamw_init", "adamw_step", "clip_scale", "cosine_lr", "counted_once", "decay_mask", "make_optimizer",
    "orthogonalise",
]
