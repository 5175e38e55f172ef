"""Model presets: GPT-2 and GPT-3 sizes, the GPT models of Megatron-LM's scaling study, and
Llama-family shapes (SmolLM2, Llama 3)."""

from __future__ import annotations

from typing import Any

import attrs

from numesh.base.errors import ConfigError


@attrs.frozen
class Preset:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int
    batch_size: int
    source: str
    parts: dict[str, Any] = attrs.field(factory=lambda: {"bias": True})  # GPT-2's and GPT-3's: biases

    def model_options(self) -> dict[str, Any]:
        """The `numesh train` options of its model (the vocabulary and batch are the run's):
        its kind and every part of its shape, GPT-2's kind, full heads and a 4C MLP where the
        preset names none, so that no --config file's Llama keys (n_kv_head, ffn_hidden) mix in."""
        return {**dict(arch="gpt2", n_kv_head=0, ffn_hidden=0, n_layer=self.n_layer, n_head=self.n_head,
                       n_embd=self.n_embd, block_size=self.block_size), **self.parts}


GPT2 = "Radford et al. 2019 (GPT-2), as in nanoGPT's configs; batch 480 x 1024 tokens = nanoGPT's ~0.5M-token batch"
GPT3 = "Brown et al. 2020 (GPT-3), Table 2.1: layers, width, heads, 2048 context, batch in tokens / 2048"
MEGATRON = "Narayanan et al. 2021, Table 1 (vocabulary 51,200, sequence 2048, the batch of that row)"
SMOLLM2 = ("HuggingFaceTB/SmolLM2-135M's config.json (Allal et al. 2025): 30 layers x 576, 9 heads, 3 kv heads, "
           "SwiGLU 1,536, tied, theta 100,000, 2048 context; batch 512 x 2048 tokens (about 1M) chosen here")
LLAMA3 = ("Llama 3 (Grattafiori et al. 2024), Table 3: layers, width, FFN, heads, 8 kv heads, vocabulary 128,256, "
          "RoPE theta 500,000; 8192 context; batch 4M tokens / 8192 = 512")


def _llama(kv: int, ffn: int, theta: float, tied: bool = False) -> dict[str, Any]:
    return dict(arch="llama", bias=False, n_kv_head=kv, ffn_hidden=ffn, rope_theta=theta, norm_eps=1e-5,
                tie_embeddings=tied)


PRESETS: dict[str, Preset] = {
    "gpt2": Preset(12, 12, 768, 1024, 50257, 480, GPT2),
    "gpt2-medium": Preset(24, 16, 1024, 1024, 50257, 480, GPT2),
    "gpt2-large": Preset(36, 20, 1280, 1024, 50257, 480, GPT2),
    "gpt2-xl": Preset(48, 25, 1600, 1024, 50257, 480, GPT2),
    "gpt3-125m": Preset(12, 12, 768, 2048, 50257, 256, GPT3),
    "gpt3-1.3b": Preset(24, 16, 2048, 2048, 50257, 512, GPT3),
    "gpt3-13b": Preset(40, 40, 5120, 2048, 50257, 1024, GPT3),
    "gpt3-175b": Preset(96, 96, 12288, 2048, 50257, 1536, GPT3),
    "megatron-18b": Preset(40, 48, 6144, 2048, 51200, 1024, MEGATRON),
    "megatron-146b": Preset(80, 96, 12288, 2048, 51200, 2304, MEGATRON),
    "megatron-1t": Preset(128, 160, 25600, 2048, 51200, 3072, MEGATRON),
    "smollm2-135m": Preset(30, 9, 576, 2048, 49152, 512, SMOLLM2, _llama(3, 1536, 100000.0, tied=True)),
    "llama3-8b": Preset(32, 32, 4096, 8192, 128256, 512, LLAMA3, _llama(8, 14336, 500000.0)),
    "llama3-70b": Preset(80, 64, 8192, 8192, 128256, 512, LLAMA3, _llama(8, 28672, 500000.0)),
    "llama3-405b": Preset(126, 128, 16384, 8192, 128256, 512, LLAMA3, _llama(8, 53248, 500000.0)),
}


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset '{name}': use one of {', '.join(PRESETS)}")
    return PRESETS[name]
