"""Decoder-only language models (Qwen2 / Llama family) in Flax NNX, their tokenizers and HF I/O."""
