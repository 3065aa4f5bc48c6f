"""Optimizers (SGD, Adam, AdamW), learning-rate schedulers and gradient clipping."""
from .adam import Adam, AdamW
from .clip import clip_grad_norm_, clip_grad_value_, grad_norm
from .lr_scheduler import CosineAnnealingLR, LambdaLR, LinearWarmupCosine, LRScheduler, StepLR
from .optimizer import Optimizer
from .sgd import SGD
from .zero import ZeroRedundancyOptimizer

__all__ = [
    "Adam",
    "AdamW",
    "CosineAnnealingLR",
    "LRScheduler",
    "LambdaLR",
    "LinearWarmupCosine",
    "Optimizer",
    "SGD",
    "StepLR",
    "ZeroRedundancyOptimizer",
    "clip_grad_norm_",
    "clip_grad_value_",
    "grad_norm",
]
