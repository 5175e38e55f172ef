"""Layers with hand-written backward, Megatron tensor-parallel operators, and the GPT model."""
