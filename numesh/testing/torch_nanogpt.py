"""nanoGPT in PyTorch: the reference model for numesh's tests and benchmarks.

The architecture of Karpathy's nanoGPT `model.py`, which numesh implements by hand: token
and position embeddings, pre-LN blocks (causal self-attention, MLP with GPT-2's tanh
GELU), a final LayerNorm (eps 1e-5) and an LM head tied to the token embedding; biases in
the Linear and LayerNorm layers optional. Parameter names are nanoGPT's
(`transformer.wte.weight`, `transformer.h.0.attn.c_attn.weight`, `lm_head.weight`, ...),
so the state dict that `numesh export` writes loads with `strict=True`. Initialisation is
nanoGPT's: N(0, 0.02) for Linear and Embedding weights, N(0, 0.02/sqrt(2 n_layer)) for the
residual projections (`c_proj`), zero biases, LayerNorm weights 1.

    from numesh.testing.torch_nanogpt import nanogpt
    net = nanogpt(vocab_size=65, n_layer=4, n_head=4, n_embd=128, block_size=64)
    logits = net(idx)            # [B, T, vocab]
    loss = net(idx, targets)     # mean cross-entropy over every position

torch is a dependency of this module only (numesh never imports it): import this module
where torch is known to be installed, e.g. after `pytest.importorskip("torch")`.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

ATTENTION = ("sdpa", "manual")


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, bias: bool, attention: str):
        super().__init__()
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, not {attention!r}")
        self.n_embd, self.n_head, self.attention = n_embd, n_head, attention
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        if attention == "manual":  # not persistent: the state dict stays nanoGPT's
            self.register_buffer("mask", torch.ones(block_size, block_size, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.attention == "sdpa":  # nanoGPT's default (flash attention where available)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # nanoGPT's fallback: explicit masked softmax
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(~self.mask[:T, :T], float("-inf")).softmax(dim=-1)
            y = att @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd: int, bias: bool):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, bias: bool, attention: str):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, eps=1e-5, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, bias, attention)
        self.ln_2 = nn.LayerNorm(n_embd, eps=1e-5, bias=bias)
        self.mlp = MLP(n_embd, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab_size: int, n_layer: int, n_head: int, n_embd: int, block_size: int,
                 bias: bool = False, attention: str = "sdpa"):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList(Block(n_embd, n_head, block_size, bias, attention) for _ in range(n_layer)),
            ln_f=nn.LayerNorm(n_embd, eps=1e-5, bias=bias),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as nanoGPT (and numesh) do
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The logits [B, T, vocab] of every position, or with `targets` the mean cross-entropy."""
        tr = self.transformer
        x = tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in tr.h:
            x = block(x)
        logits = self.lm_head(tr.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def nanogpt(vocab_size: int, n_layer: int, n_head: int, n_embd: int, block_size: int, bias: bool = False,
            attention: str = "sdpa") -> NanoGPT:
    """A freshly initialised nanoGPT (torch's default dtype; seed with torch.manual_seed)."""
    return NanoGPT(vocab_size, n_layer, n_head, n_embd, block_size, bias, attention)


def from_config(model, attention: str = "sdpa") -> NanoGPT:
    """The nanoGPT of a numesh `GPTConfig` (or anything with its fields)."""
    return nanogpt(model.vocab_size, model.n_layer, model.n_head, model.n_embd, model.block_size,
                   bias=model.bias, attention=attention)
