"""Recipes: models laid out over the grid by the library's generic pieces (``HybridGPT``: the GPT's or the Llama's plan)."""
from .gpt import HybridGPT, Layout, ModelRecipe, TPStyle, batch_shards, check_layout, gpt_plan, recipe_for
from .llama import llama_layers, llama_model_plan, llama_plan

__all__ = ["HybridGPT", "Layout", "ModelRecipe", "TPStyle", "batch_shards", "check_layout", "gpt_plan", "llama_layers",
           "llama_model_plan", "llama_plan", "recipe_for"]
