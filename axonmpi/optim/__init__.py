"""Optimizers (SGD, Adam, AdamW, Adadelta), learning-rate schedulers and gradient clipping."""
from .adadelta import Adadelta
from .adam import Adam, AdamW
from .clip import clip_grad_norm_, clip_grad_norm_array_, clip_grad_value_, grad_norm, grad_norm_array
from . import lr_scheduler
from .lr_scheduler import (ChainedScheduler, ConstantLR, CosineAnnealingLR, CosineAnnealingWarmRestarts,
                           ExponentialLR, LambdaLR, LinearLR, LinearWarmupCosine, LRScheduler, MultiStepLR,
                           OneCycleLR, PolynomialLR, ReduceLROnPlateau, SequentialLR, StepLR)
from .optimizer import Optimizer
from .sgd import SGD
from .zero import ZeroRedundancyOptimizer

__all__ = [
    "Adadelta",
    "Adam",
    "AdamW",
    "ChainedScheduler",
    "ConstantLR",
    "CosineAnnealingLR",
    "CosineAnnealingWarmRestarts",
    "ExponentialLR",
    "LRScheduler",
    "LambdaLR",
    "LinearLR",
    "LinearWarmupCosine",
    "MultiStepLR",
    "OneCycleLR",
    "Optimizer",
    "PolynomialLR",
    "ReduceLROnPlateau",
    "SGD",
    "SequentialLR",
    "StepLR",
    "ZeroRedundancyOptimizer",
    "clip_grad_norm_",
    "clip_grad_norm_array_",
    "clip_grad_value_",
    "grad_norm",
    "grad_norm_array",
    "lr_scheduler",
]
