"""Hidden setup of docs/llm.md's "Prune your own LLM": ``path``, a pretrained Hugging Face
causal LM directory with its tokenizer (a 2-layer Llama and a 300-token BPE made offline)."""

from pathlib import Path

from tiny_hf import make_tiny_hf

path, _ = make_tiny_hf(Path("."))
