"""Old home of the GPT recipe: ``HybridGPT`` now lives in :mod:`axonmpi.recipes.gpt` (re-exported here)."""
from ..recipes.gpt import HybridGPT, Layout, TPStyle, batch_shards, check_layout, fsdp_refusal

__all__ = ["HybridGPT", "Layout", "TPStyle", "batch_shards", "check_layout", "fsdp_refusal"]
