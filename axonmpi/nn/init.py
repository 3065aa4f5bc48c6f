"""Weight initializers (PyTorch names and formulas) drawing from :mod:`axonmpi.random`.

Samples are drawn on the host in float64 with the default generator and then cast and copied
into the tensor in place, so the same seed gives the same weights for any dtype or device.
"""
from __future__ import annotations

import math
from typing import Tuple

import numpy as np

from ..autograd.grad_mode import no_grad
from ..autograd.tensor import Tensor
from ..backend import get_array_module
from ..random import default_generator

__all__ = [
    "calculate_gain", "constant_", "kaiming_normal_", "kaiming_uniform_", "normal_", "ones_",
    "trunc_normal_", "uniform_", "xavier_normal_", "xavier_uniform_", "zeros_",
]


def _fill(t: Tensor, host: np.ndarray) -> Tensor:
    xp = get_array_module(t.data)
    t.data[...] = xp.asarray(host.astype(t.data.dtype, copy=False))
    return t


def _fans(t: Tensor) -> Tuple[int, int]:
    shape = t.shape
    if len(shape) < 2:
        raise ValueError(f"fan in/out need a tensor with at least 2 dims, got shape {shape}")
    receptive = int(np.prod(shape[2:])) if len(shape) > 2 else 1
    return shape[1] * receptive, shape[0] * receptive


def calculate_gain(nonlinearity: str, param=None) -> float:
    """Recommended gain for ``nonlinearity`` (PyTorch's table)."""
    if nonlinearity in ("linear", "conv1d", "conv2d", "conv3d", "sigmoid", "identity"):
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        slope = 0.01 if param is None else float(param)
        return math.sqrt(2.0 / (1 + slope ** 2))
    if nonlinearity == "selu":
        return 3.0 / 4
    raise ValueError(f"unsupported nonlinearity {nonlinearity!r}")


@no_grad()
def uniform_(t: Tensor, a: float = 0.0, b: float = 1.0) -> Tensor:
    """Fill with U(a, b)."""
    return _fill(t, default_generator().uniform(a, b, t.data.shape))


@no_grad()
def normal_(t: Tensor, mean: float = 0.0, std: float = 1.0) -> Tensor:
    """Fill with N(mean, std**2)."""
    return _fill(t, default_generator().normal(mean, std, t.data.shape))


@no_grad()
def trunc_normal_(t: Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0) -> Tensor:
    """Fill with N(mean, std**2) truncated to [a, b] (rejection sampling)."""
    gen = default_generator()
    out = gen.normal(mean, std, t.data.shape)
    bad = (out < a) | (out > b)
    while bad.any():
        out[bad] = gen.normal(mean, std, int(bad.sum()))
        bad = (out < a) | (out > b)
    return _fill(t, out)


def constant_(t: Tensor, value: float) -> Tensor:
    """Fill with ``value``."""
    t.data[...] = value
    return t


def zeros_(t: Tensor) -> Tensor:
    """Fill with zeros."""
    return constant_(t, 0.0)


def ones_(t: Tensor) -> Tensor:
    """Fill with ones."""
    return constant_(t, 1.0)


def kaiming_uniform_(t: Tensor, a: float = 0.0, mode: str = "fan_in",
                     nonlinearity: str = "leaky_relu") -> Tensor:
    """He uniform: U(-bound, bound), bound = gain * sqrt(3 / fan)."""
    fan_in, fan_out = _fans(t)
    fan = fan_in if mode == "fan_in" else fan_out
    bound = calculate_gain(nonlinearity, a) * math.sqrt(3.0 / fan)
    return uniform_(t, -bound, bound)


def kaiming_normal_(t: Tensor, a: float = 0.0, mode: str = "fan_in",
                    nonlinearity: str = "leaky_relu") -> Tensor:
    """He normal: N(0, (gain / sqrt(fan))**2)."""
    fan_in, fan_out = _fans(t)
    fan = fan_in if mode == "fan_in" else fan_out
    return normal_(t, 0.0, calculate_gain(nonlinearity, a) / math.sqrt(fan))


def xavier_uniform_(t: Tensor, gain: float = 1.0) -> Tensor:
    """Glorot uniform: bound = gain * sqrt(6 / (fan_in + fan_out))."""
    fan_in, fan_out = _fans(t)
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return uniform_(t, -bound, bound)


def xavier_normal_(t: Tensor, gain: float = 1.0) -> Tensor:
    """Glorot normal: std = gain * sqrt(2 / (fan_in + fan_out))."""
    fan_in, fan_out = _fans(t)
    return normal_(t, 0.0, gain * math.sqrt(2.0 / (fan_in + fan_out)))
