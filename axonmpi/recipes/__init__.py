"""Recipes: models laid out over the grid by the library's generic pieces (``HybridGPT``, the GPT's)."""
from .gpt import HybridGPT, Layout, TPStyle, batch_shards, check_layout, gpt_plan

__all__ = ["HybridGPT", "Layout", "TPStyle", "batch_shards", "check_layout", "gpt_plan"]
