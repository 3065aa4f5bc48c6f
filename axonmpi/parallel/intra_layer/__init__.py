"""AxoNN-style 3-D intra-layer tensor parallelism: ``Linear`` over a row x column x depth grid,
gradient synchronisation and clipping for models that hold it."""
from .grad_sync import clip_grad_norm_, no_grad_sync, sync_gradients
from .embedding import Embedding
from .linear import Linear
from .overlap import optimize_communication

__all__ = ["Embedding", "Linear", "clip_grad_norm_", "no_grad_sync", "optimize_communication", "sync_gradients"]
