"""Reductions: ``sum``, ``mean``, ``max``/``min`` (values and indices), ``amax``/``amin``, ``var``,
``std``, ``argmax``/``argmin``, with PyTorch's ``dim``/``keepdim`` (NumPy's ``axis``/``keepdims`` too)."""
from __future__ import annotations

from collections import namedtuple

import numpy as np

from ..backend import get_array_module
from ._util import _axes, _dim, _keep, _keepdim
from .function import Function
from .tensor import Tensor

__all__ = [
    "MinMax", "amax", "amin", "argmax", "argmin", "max", "mean", "min", "std", "sum", "var",
]

_builtin_max = max

MinMax = namedtuple("MinMax", ["values", "indices"])
MinMax.__doc__ = """``(values, indices)`` returned by ``max(dim)`` / ``min(dim)`` (PyTorch's ``return_types.max``)."""


class Sum(Function):
    _fresh_grads = True

    @staticmethod
    def forward(ctx, a, axis, keepdims):
        ctx.shape, ctx.axes, ctx.keepdims = a.shape, _axes(axis, a.ndim), keepdims
        return a.sum(axis=ctx.axes, keepdims=keepdims)

    @staticmethod
    def backward(ctx, g):
        xp = get_array_module(g)
        out = xp.empty(ctx.shape, g.dtype)
        out[...] = _keep(g, ctx.shape, ctx.axes, ctx.keepdims)
        return out, None, None


class Mean(Function):
    _fresh_grads = True

    @staticmethod
    def forward(ctx, a, axis, keepdims):
        ctx.shape, ctx.axes, ctx.keepdims = a.shape, _axes(axis, a.ndim), keepdims
        out = a.mean(axis=ctx.axes, keepdims=keepdims)
        ctx.count = a.size // _builtin_max(out.size, 1) if a.size else 1
        return out

    @staticmethod
    def backward(ctx, g):
        xp = get_array_module(g)
        out = xp.empty(ctx.shape, g.dtype)
        out[...] = _keep(g, ctx.shape, ctx.axes, ctx.keepdims)
        out /= ctx.count
        return out, None, None


class Extreme(Function):
    """max/min over all or several dims (``amax``/``amin``); the gradient is split evenly between ties."""

    _fresh_grads = True

    @staticmethod
    def forward(ctx, a, axis, keepdims, op):
        xp = get_array_module(a)
        axes = _axes(axis, a.ndim)
        out_k = getattr(xp, op)(a, axis=axes, keepdims=True)
        ctx.save_for_backward(a == out_k)
        ctx.shape, ctx.axes = a.shape, axes
        if keepdims:
            return out_k
        return out_k.reshape(tuple(s for i, s in enumerate(a.shape) if axes is not None and i not in axes))

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        gk = _keep(g, ctx.shape, ctx.axes, False)
        count = mask.sum(axis=ctx.axes, keepdims=True)
        return mask * (gk / count), None, None, None


class ExtremeDim(Function):
    """max/min along one dim with the indices; the gradient goes to the returned index only."""

    _fresh_grads = True

    @staticmethod
    def forward(ctx, a, dim, keepdim, op):
        xp = get_array_module(a)
        idx = getattr(xp, "arg" + op)(a, axis=dim, keepdims=True)
        vals = xp.take_along_axis(a, idx, axis=dim)
        ctx.save_for_backward(idx)
        ctx.shape, ctx.dim = a.shape, dim
        if not keepdim:
            vals, idx = vals.squeeze(dim), idx.squeeze(dim)
        return vals, idx.astype(np.int64, copy=False)

    @staticmethod
    def backward(ctx, g, g_idx):
        (idx,) = ctx.saved_tensors
        xp = get_array_module(g)
        shape, dim = ctx.shape, ctx.dim
        gk = g if g.ndim == len(shape) else xp.expand_dims(g, dim)
        pos = xp.arange(shape[dim]).reshape([-1 if i == dim else 1 for i in range(len(shape))])
        return (pos == idx) * gk, None, None, None


def sum(input, dim=None, keepdim: bool = False, *, dtype=None, axis=None,  # noqa: A001,A002
        keepdims=None) -> Tensor:
    """Sum over ``dim`` (int, tuple, or None for all); ``dtype`` casts first.

    Example:
        >>> sum(Tensor([[1.0, 2.0], [3.0, 4.0]]), dim=1).tolist()
        [3.0, 7.0]
    """
    if dtype is not None:
        input = input.to(dtype=dtype)
    return Sum.apply(input, _dim(dim, axis), _keepdim(keepdim, keepdims))


def mean(input, dim=None, keepdim: bool = False, *, dtype=None, axis=None,  # noqa: A002
         keepdims=None) -> Tensor:
    """Mean over ``dim`` (int, tuple, or None for all); ``dtype`` casts first."""
    if dtype is not None:
        input = input.to(dtype=dtype)
    return Mean.apply(input, _dim(dim, axis), _keepdim(keepdim, keepdims))


def _extreme(op, input, dim, keepdim, axis, keepdims):
    if isinstance(dim, Tensor):  # torch.max(input, other): elementwise
        from .ops import maximum, minimum

        return (maximum if op == "max" else minimum)(input, dim)
    d = _dim(dim, axis)
    if d is None:
        return Extreme.apply(input, None, _keepdim(keepdim, keepdims), op)
    if not isinstance(d, (int, np.integer)):
        raise TypeError(f"{op}(dim=...) takes one int dim, got {d!r}; use a{op}(dim=tuple) to reduce several")
    (d,) = _axes(d, input.ndim)
    return MinMax(*ExtremeDim.apply(input, d, _keepdim(keepdim, keepdims), op))


def max(input, dim=None, keepdim: bool = False, *, axis=None, keepdims=None):  # noqa: A001,A002
    """PyTorch's ``max``: over all elements a Tensor (ties share the gradient evenly); along ``dim``
    a :class:`MinMax` ``(values, indices)`` (the gradient goes to the returned index); with a
    Tensor as second argument the elementwise maximum.

    Example:
        >>> values, indices = max(Tensor([[1.0, 5.0], [7.0, 2.0]]), dim=1)
        >>> values.tolist(), indices.tolist()
        ([5.0, 7.0], [1, 0])
    """
    return _extreme("max", input, dim, keepdim, axis, keepdims)


def min(input, dim=None, keepdim: bool = False, *, axis=None, keepdims=None):  # noqa: A001,A002
    """PyTorch's ``min`` (see :func:`max`)."""
    return _extreme("min", input, dim, keepdim, axis, keepdims)


def amax(input, dim=None, keepdim: bool = False, *, axis=None, keepdims=None) -> Tensor:  # noqa: A002
    """Maximum values over ``dim`` (int, tuple or None); ties share the gradient evenly."""
    return Extreme.apply(input, _dim(dim, axis), _keepdim(keepdim, keepdims), "max")


def amin(input, dim=None, keepdim: bool = False, *, axis=None, keepdims=None) -> Tensor:  # noqa: A002
    """Minimum values over ``dim`` (int, tuple or None); ties share the gradient evenly."""
    return Extreme.apply(input, _dim(dim, axis), _keepdim(keepdim, keepdims), "min")


def _arg(op, input, dim, keepdim, axis, keepdims) -> Tensor:
    a = input.data if isinstance(input, Tensor) else input
    xp = get_array_module(a)
    d = _dim(dim, axis)
    if d is None:
        return Tensor._wrap(xp.asarray(getattr(xp, op)(a), dtype=np.int64))
    return Tensor._wrap(getattr(xp, op)(a, axis=int(d), keepdims=_keepdim(keepdim, keepdims)).astype(np.int64))


def argmax(input, dim=None, keepdim: bool = False, *, axis=None, keepdims=None) -> Tensor:  # noqa: A002
    """Index of the maximum along ``dim`` (of the flattened tensor when ``dim`` is None); int64."""
    return _arg("argmax", input, dim, keepdim, axis, keepdims)


def argmin(input, dim=None, keepdim: bool = False, *, axis=None, keepdims=None) -> Tensor:  # noqa: A002
    """Index of the minimum along ``dim`` (of the flattened tensor when ``dim`` is None); int64."""
    return _arg("argmin", input, dim, keepdim, axis, keepdims)


class Var(Function):
    _fresh_grads = True

    @staticmethod
    def forward(ctx, a, axis, keepdims, correction):
        axes = _axes(axis, a.ndim)
        m = a.mean(axis=axes, keepdims=True)
        d = a - m
        n = a.size // m.size
        denom = n - correction
        out = (d * d).sum(axis=axes, keepdims=keepdims) / denom
        ctx.save_for_backward(d)
        ctx.shape, ctx.axes, ctx.keepdims, ctx.denom = a.shape, axes, keepdims, denom
        return out

    @staticmethod
    def backward(ctx, g):
        (d,) = ctx.saved_tensors
        return _keep(g, ctx.shape, ctx.axes, ctx.keepdims) * (2.0 / ctx.denom) * d, None, None, None


def _correction(unbiased, correction) -> int:
    if unbiased is not None and correction is not None:
        raise TypeError(f"pass unbiased or correction, not both (got {unbiased!r}, {correction!r})")
    if correction is not None:
        return correction
    return 0 if unbiased is False else 1


def var(input, dim=None, unbiased=None, keepdim: bool = False, *, correction=None,  # noqa: A002
        axis=None, keepdims=None) -> Tensor:
    """Variance over ``dim`` with ``correction`` (1 = unbiased, PyTorch's default; 0 = NumPy's).

    ``unbiased=False`` is ``correction=0`` (PyTorch's older argument).
    """
    return Var.apply(input, _dim(dim, axis), _keepdim(keepdim, keepdims), _correction(unbiased, correction))


def std(input, dim=None, unbiased=None, keepdim: bool = False, *, correction=None,  # noqa: A002
        axis=None, keepdims=None) -> Tensor:
    """Standard deviation: ``sqrt(var(...))`` with the same arguments as :func:`var`."""
    from .ops import sqrt

    return sqrt(var(input, dim, unbiased, keepdim, correction=correction, axis=axis, keepdims=keepdims))
