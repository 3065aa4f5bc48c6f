"""Functional forms of every differentiable op (``import axonmpi.nn.functional as F``)."""
from __future__ import annotations

from ..autograd.ops import (MinMax, abs, add, amax, amin, argmax, argmin, cat, chunk, clamp, clip,
                            concat, cos, div, exp, expand, flatten, log, matmul, max, maximum, mean,
                            min, minimum, mul, neg, permute, pow, reshape, sin, split, sqrt, squeeze,
                            stack, std, sub, sum, tanh, transpose, unsqueeze, var, where)
from .loss import (binary_cross_entropy, binary_cross_entropy_with_logits, l1_loss, nll_loss,
                   smooth_l1_loss)
from ..autograd.ops_nn import (cross_entropy, dropout, embedding, gelu, layer_norm, linear,
                               log_softmax, masked_fill, mse_loss, relu, sigmoid, silu, softmax)

__all__ = [
    "MinMax", "abs", "add", "amax", "amin", "argmax", "argmin", "cat", "chunk", "clamp", "clip",
    "concat", "cos", "cross_entropy", "div", "dropout", "embedding", "exp", "expand", "flatten",
    "gelu", "layer_norm", "linear", "log", "log_softmax", "masked_fill", "matmul", "max", "maximum",
    "mean", "min", "minimum", "mse_loss", "mul", "neg", "permute", "pow", "relu", "reshape", "sigmoid",
    "silu", "sin", "softmax", "split", "sqrt", "squeeze", "stack", "std", "sub", "sum", "tanh",
    "transpose", "unsqueeze", "var", "where", "binary_cross_entropy", "binary_cross_entropy_with_logits",
    "l1_loss", "nll_loss", "smooth_l1_loss",
]
