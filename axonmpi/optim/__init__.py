"""Optimizers (SGD, Adam, AdamW), learning-rate schedulers and gradient clipping."""
from .adam import Adam, AdamW
from .optimizer import Optimizer
from .sgd import SGD

__all__ = ["Adam", "AdamW", "Optimizer", "SGD"]
