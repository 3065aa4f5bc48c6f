"""Optimizers (SGD, Adam, AdamW), learning-rate schedulers and gradient clipping."""
from .adam import Adam, AdamW
from .lr_scheduler import CosineAnnealingLR, LambdaLR, LinearWarmupCosine, LRScheduler, StepLR
from .optimizer import Optimizer
from .sgd import SGD

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
]
