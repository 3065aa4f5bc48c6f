"""Dropout and residual add + dropout, forward and backward side by side, from uniform draws the caller makes.

The draws ``r`` (uniform in [0, 1), float32 for 16- and 32-bit inputs, float64 for float64) come from the caller
(the autograd op draws them from :mod:`axonmpi.random`'s generator), so the kernels hold no random state and a
recorded step replays them. An element is kept where ``r >= p`` and scaled by ``1 / (1 - p)`` (rounded to the
input's dtype): the values are those of ``x * mask`` with ``mask = (r >= p).astype(dtype) * (1 / (1 - p))``.
numba: one loop each way, the mask kept as one byte per element; NumPy: ufuncs in place; CuPy: one
``ElementwiseKernel`` each way.
"""
from __future__ import annotations

import numpy as np

from ..backend import get_array_module
from . import _cupy
from ._select import use_numba

__all__ = ["dropout_forward", "dropout_backward"]


def _nb():
    from . import _dropout_nb
    return _dropout_nb


_cupy.define("axonmpi_dropout_fwd", "elementwise", in_params="T x, R r, float64 p, float64 scale",
             out_params="T y, bool keep", body="""
    typedef typename acc_t<T>::type A;
    keep = r >= (R)p;
    y = (T)((A)x * (keep ? (A)(T)scale : (A)0));""")
_cupy.define("axonmpi_dropout_add_fwd", "elementwise", in_params="T x, T res, R r, float64 p, float64 scale",
             out_params="T y, bool keep", body="""
    typedef typename acc_t<T>::type A;
    keep = r >= (R)p;
    y = (T)((A)res + (A)x * (keep ? (A)(T)scale : (A)0));""")
_cupy.define("axonmpi_dropout_bwd", "elementwise", in_params="T g, bool keep, float64 scale", out_params="T gx",
             body="""
    typedef typename acc_t<T>::type A; gx = (T)((A)g * (keep ? (A)(T)scale : (A)0));""")


def _flat(a):
    return np.ascontiguousarray(a).reshape(-1)


def dropout_forward(x, r, p: float, residual=None):
    """``(y, keep)``: ``y = x * mask`` (``residual + x * mask`` when ``residual`` is given), ``keep`` the boolean mask
    :func:`dropout_backward` takes back. ``r``: uniform draws of ``x``'s shape (see the module's docstring)."""
    xp = get_array_module(x)
    scale = 1.0 / (1.0 - p)
    if xp is not np:
        if residual is None:
            return _cupy.kernel("axonmpi_dropout_fwd")(x, r, float(p), scale)
        return _cupy.kernel("axonmpi_dropout_add_fwd")(x, residual.astype(x.dtype, copy=False), r, float(p), scale)
    if use_numba(x, *(() if residual is None else (residual,))) and x.size and r.dtype.char in "fd":
        y = np.empty(x.shape, x.dtype)
        keep = np.empty(x.shape, np.bool_)
        pr, sc = r.dtype.type(p), x.dtype.type(scale)
        if residual is None:
            _nb().dropout_fwd(_flat(x), _flat(r), pr, sc, y.reshape(-1), keep.reshape(-1))
        else:
            _nb().dropout_add_fwd(_flat(x), _flat(residual), _flat(r), pr, sc, y.reshape(-1), keep.reshape(-1))
        return y, keep
    keep = r >= p
    dt = x.dtype if x.dtype.kind == "f" or x.dtype.name == "bfloat16" else np.dtype(np.float32)
    mask = keep.astype(dt)
    mask *= scale
    y = x * mask
    if residual is not None:
        y = residual + y if y.dtype != residual.dtype else np.add(residual, y, out=y)
    return y, keep


def dropout_backward(g, keep, p: float):
    """``g * mask``: the input's gradient (the residual's is ``g`` itself)."""
    xp = get_array_module(g)
    scale = 1.0 / (1.0 - p)
    if xp is not np:
        return _cupy.kernel("axonmpi_dropout_bwd")(g, keep, scale)
    if use_numba(g) and g.size and keep.flags.c_contiguous:
        gx = np.empty(g.shape, g.dtype)
        _nb().dropout_bwd(_flat(g), keep.reshape(-1), g.dtype.type(scale), gx.reshape(-1))
        return gx
    mask = keep.astype(g.dtype)
    mask *= scale
    mask *= g
    return mask
