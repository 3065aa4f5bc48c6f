"""Neural-network modules, parameters, initializers and functional ops."""
from __future__ import annotations

from . import functional, init, utils
from .checkpointing import Checkpointed, checkpoint, checkpoint_sequential
from .conv import Conv2d, MaxPool2d
from .layers import (GELU, Dropout, Embedding, Flatten, Identity, LayerNorm, Linear, ReLU, Sigmoid,
                     SiLU, Softmax, Tanh)
from .loss import (BCELoss, BCEWithLogitsLoss, CrossEntropyLoss, L1Loss, MSELoss, NLLLoss,
                   SmoothL1Loss)
from .moe import MoE, moe_losses, moe_stats
from .module import IncompatibleKeys, Module, ModuleDict, ModuleList, Sequential
from .parameter import Parameter
from .transformer import MLP, CausalSelfAttention, SwiGLU, TransformerBlock
from .attention import GroupedQueryAttention
from .normalization import RMSNorm
from .rotary import RotaryEmbedding

__all__ = [
    "CausalSelfAttention", "Conv2d", "MaxPool2d", "Dropout", "Embedding", "Flatten", "GELU", "Identity", "IncompatibleKeys",
    "LayerNorm", "Linear", "MLP", "MoE", "moe_losses", "moe_stats", "Module", "ModuleDict", "ModuleList", "Parameter", "ReLU",
    "Sequential", "SiLU", "Sigmoid", "Softmax", "Tanh", "TransformerBlock", "functional", "init",
    "Checkpointed", "checkpoint", "checkpoint_sequential", "utils", "BCELoss", "BCEWithLogitsLoss", "CrossEntropyLoss",
    "L1Loss", "MSELoss", "NLLLoss", "SmoothL1Loss", "GroupedQueryAttention", "RMSNorm", "RotaryEmbedding", "SwiGLU",
]


def __getattr__(name: str):
    # torch.nn.parallel's path (docs/porting.md): loaded on first use, since it names axonmpi.parallel's classes
    if name == "parallel":
        import importlib
        return importlib.import_module(f"{__name__}.parallel")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
