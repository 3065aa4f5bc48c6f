"""Functional forms of every differentiable op (``import axonmpi.nn.functional as F``)."""
from __future__ import annotations

import numpy as np

from ..autograd.ops import (MinMax, abs, add, amax, amin, argmax, argmin, cat, chunk, clamp, clip,
                            concat, cos, div, exp, expand, flatten, log, matmul, max, maximum, mean,
                            min, minimum, mul, neg, permute, pow, reshape, sin, split, sqrt, squeeze,
                            stack, std, sub, sum, tanh, transpose, unsqueeze, var, where)
from .conv import conv2d, max_pool2d
from .loss import (binary_cross_entropy, binary_cross_entropy_with_logits, l1_loss, nll_loss,
                   smooth_l1_loss)
from ..autograd.ops_nn import (cross_entropy, dropout, dropout_add, embedding, gelu, layer_norm, linear,
                               log_softmax, masked_fill, mse_loss, relu, scaled_dot_product_attention, sigmoid,
                               silu, softmax)



def one_hot(tensor, num_classes: int = -1):
    """PyTorch's ``F.one_hot``: int64 Tensor of shape ``tensor.shape + (num_classes,)`` (not differentiable).

    ``num_classes=-1`` uses ``max + 1``. Integer input only; a value outside ``[0, num_classes)``
    raises ``ValueError`` naming it.

    Example:
        >>> F.one_hot(axonmpi.tensor([0, 2]), 3).tolist()
        [[1, 0, 0], [0, 0, 1]]
    """
    from ..autograd import Tensor
    from ..backend import get_array_module
    x = tensor.data if isinstance(tensor, Tensor) else tensor
    xp = get_array_module(x)
    x = xp.asarray(x)
    if x.dtype.kind not in "iu":
        raise TypeError(f"one_hot needs an integer (class index) tensor, got dtype {x.dtype}; cast with .long()")
    if num_classes == -1:
        num_classes = int(x.max()) + 1 if x.size else 0
    if x.size and (int(x.min()) < 0 or int(x.max()) >= num_classes):
        raise ValueError(f"one_hot: class values must be in [0, {num_classes}), got min {int(x.min())} "
                         f"and max {int(x.max())}")
    out = (x[..., None] == xp.arange(num_classes)).astype(np.int64)
    return Tensor._wrap(out)


__all__ = [
    "conv2d", "max_pool2d", "one_hot", "MinMax", "abs", "add", "amax", "amin", "argmax", "argmin", "cat", "chunk", "clamp", "clip",
    "concat", "cos", "cross_entropy", "div", "dropout", "dropout_add", "embedding", "exp", "expand", "flatten",
    "gelu", "layer_norm", "linear", "log", "log_softmax", "masked_fill", "matmul", "max", "maximum",
    "mean", "min", "minimum", "mse_loss", "mul", "neg", "permute", "pow", "relu", "reshape",
    "scaled_dot_product_attention", "sigmoid",
    "silu", "sin", "softmax", "split", "sqrt", "squeeze", "stack", "std", "sub", "sum", "tanh",
    "transpose", "unsqueeze", "var", "where", "binary_cross_entropy", "binary_cross_entropy_with_logits",
    "l1_loss", "nll_loss", "smooth_l1_loss",
]


# -- the Llama block's fused ops (RMSNorm, rotary position embedding, SwiGLU gate) -------------------
from ..autograd.ops_llama import apply_rotary_emb, rms_norm, swiglu  # noqa: E402

__all__ += ["apply_rotary_emb", "rms_norm", "swiglu"]
