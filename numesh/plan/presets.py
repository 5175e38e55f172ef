"""Model presets: GPT-2 and GPT-3 sizes, and the GPT models of Megatron-LM's scaling study."""

from __future__ import annotations

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


GPT2 = "Radford et al. 2019 (GPT-2), as in nanoGPT's configs; batch 480 x 1024 tokens = nanoGPT's ~0.5M-token batch"
GPT3 = "Brown et al. 2020 (GPT-3), Table 2.1: layers, width, heads, 2048 context, batch in tokens / 2048"
MEGATRON = "Narayanan et al. 2021, Table 1 (vocabulary 51,200, sequence 2048, the batch of that row)"

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
}


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset '{name}': use one of {', '.join(PRESETS)}")
    return PRESETS[name]
