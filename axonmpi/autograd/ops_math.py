"""Elementwise math (exp, log, sqrt, tanh, abs, sin, cos, clamp, maximum/minimum) as ``Function``s."""
from __future__ import annotations

from .. import kernels as K
from ..backend import get_array_module
from ._util import _shape, _unbroadcast
from .function import Function
from .tensor import Tensor

__all__ = ["abs", "clamp", "clip", "cos", "exp", "log", "maximum", "minimum", "sin", "sqrt", "tanh"]


# -- elementwise math ----------------------------------------------------------------------
class Exp(Function):
    _fresh_grads = True

    @staticmethod
    def forward(ctx, a):
        out = K.exp_forward(a)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        return K.exp_backward(ctx.saved_tensors[0], g)


class Log(Function):
    _fresh_grads = True

    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return get_array_module(a).log(a)

    @staticmethod
    def backward(ctx, g):
        return g / ctx.saved_tensors[0]


class Sqrt(Function):
    _fresh_grads = True

    @staticmethod
    def forward(ctx, a):
        out = get_array_module(a).sqrt(a)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        return g / (2 * ctx.saved_tensors[0])


class Tanh(Function):
    _fresh_grads = True

    @staticmethod
    def forward(ctx, a):
        out = K.tanh_forward(a)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        return K.tanh_backward(ctx.saved_tensors[0], g)


class Abs(Function):
    _fresh_grads = True

    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return get_array_module(a).abs(a)

    @staticmethod
    def backward(ctx, g):
        return g * get_array_module(g).sign(ctx.saved_tensors[0])


def exp(a) -> Tensor:
    """Elementwise ``e**a``."""
    return Exp.apply(a)


def log(a) -> Tensor:
    """Elementwise natural logarithm."""
    return Log.apply(a)


def sqrt(a) -> Tensor:
    """Elementwise square root."""
    return Sqrt.apply(a)


def tanh(a) -> Tensor:
    """Elementwise hyperbolic tangent."""
    return Tanh.apply(a)


def abs(a) -> Tensor:  # noqa: A001
    """Elementwise absolute value (gradient 0 at 0)."""
    return Abs.apply(a)


class Sin(Function):
    _fresh_grads = True

    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return get_array_module(a).sin(a)

    @staticmethod
    def backward(ctx, g):
        return g * get_array_module(g).cos(ctx.saved_tensors[0])


class Cos(Function):
    _fresh_grads = True

    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return get_array_module(a).cos(a)

    @staticmethod
    def backward(ctx, g):
        return -g * get_array_module(g).sin(ctx.saved_tensors[0])


class Clamp(Function):
    """Clip to ``[lo, hi]``; the gradient passes where ``lo <= x <= hi`` (PyTorch's rule)."""

    _fresh_grads = True

    @staticmethod
    def forward(ctx, a, lo, hi):
        xp = get_array_module(a)
        keep = xp.ones(a.shape, bool)
        if lo is not None:
            keep &= a >= lo
        if hi is not None:
            keep &= a <= hi
        ctx.save_for_backward(keep)
        return xp.clip(a, lo, hi)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.saved_tensors[0], None, None


class _Pairwise(Function):
    """Elementwise maximum/minimum of two tensors; ties share the gradient evenly (PyTorch's rule)."""

    _fresh_grads = True

    op = "maximum"

    @staticmethod
    def forward(ctx, a, b, op):
        xp = get_array_module(a, b)
        ctx.sa, ctx.sb = _shape(a), _shape(b)
        out = getattr(xp, op)(a, b)
        ctx.save_for_backward(a, b)
        ctx.op = op
        return out

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        win = (a > b) if ctx.op == "maximum" else (a < b)
        share = win + 0.5 * (a == b)
        n = ctx.needs_input_grad
        ga = _unbroadcast(g * share, ctx.sa) if n[0] else None
        gb = _unbroadcast(g * (1.0 - share), ctx.sb) if n[1] else None
        return ga, gb, None


def sin(a) -> Tensor:
    """Elementwise sine."""
    return Sin.apply(a)


def cos(a) -> Tensor:
    """Elementwise cosine."""
    return Cos.apply(a)


def clamp(a, min=None, max=None) -> Tensor:  # noqa: A002 - PyTorch's argument names
    """Clip every element to ``[min, max]`` (either bound may be None).

    Example:
        >>> clamp(Tensor([-2.0, 0.5, 3.0]), min=0.0, max=1.0).tolist()
        [0.0, 0.5, 1.0]
    """
    if min is None and max is None:
        raise ValueError("clamp needs at least one of min and max, got neither")
    return Clamp.apply(a, min, max)


clip = clamp


def maximum(a, b) -> Tensor:
    """Elementwise maximum with broadcasting (ties share the gradient)."""
    return _Pairwise.apply(a, b, "maximum")


def minimum(a, b) -> Tensor:
    """Elementwise minimum with broadcasting (ties share the gradient)."""
    return _Pairwise.apply(a, b, "minimum")
