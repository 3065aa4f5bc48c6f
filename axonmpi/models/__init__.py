"""Reference models built from :mod:`axonmpi.nn`."""
from __future__ import annotations

from .gpt import GPT, GPTConfig
from .llama import Llama, LlamaConfig

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig"]
