"""Functional forms of every differentiable op (``import axonmpi.nn.functional as F``)."""
from __future__ import annotations

from ..autograd.ops import (abs, add, cat, chunk, concat, div, exp, expand, flatten, log, matmul,
                            max, mean, min, mul, neg, permute, pow, reshape, split, sqrt, squeeze,
                            stack, sub, sum, tanh, transpose, unsqueeze, var, where)
from ..autograd.ops_nn import (cross_entropy, dropout, embedding, gelu, layer_norm, linear,
                               log_softmax, masked_fill, mse_loss, relu, sigmoid, silu, softmax)

__all__ = [
    "abs", "add", "cat", "chunk", "concat", "cross_entropy", "div", "dropout", "embedding", "exp",
    "expand", "flatten", "gelu", "layer_norm", "linear", "log", "log_softmax", "masked_fill",
    "matmul", "max", "mean", "min", "mse_loss", "mul", "neg", "permute", "pow", "relu", "reshape",
    "sigmoid", "silu", "softmax", "split", "sqrt", "squeeze", "stack", "sub", "sum", "tanh",
    "transpose", "unsqueeze", "var", "where",
]
