"""Reference models built from :mod:`axonmpi.nn`."""
from __future__ import annotations

from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
