"""LayerNorm and RMSNorm over the last axis of a (rows, m) array: one pass forward, one pass backward.

The forward returns the output and an opaque state; the backward takes the state back. NumPy keeps ``xhat``
and does every row sum as a BLAS matrix-vector product, every elementwise step in place; numba keeps the
input, the mean and 1/std and does each row in one loop each way (``gamma``/``beta`` gradients accumulated in
the same loop); CuPy takes the NumPy form (CuPy's reductions, ``@`` on cuBLAS).
"""
from __future__ import annotations

import numpy as np

from ..backend import get_array_module, matmul as _bmm
from ._select import use_numba

__all__ = ["layer_norm_forward", "layer_norm_backward", "rms_norm_forward", "rms_norm_backward"]


def _nb():
    from . import _rows_nb
    return _rows_nb


def _numba_rows(x2, weight, *more):
    arrays = [x2] + [a for a in (weight,) + more if a is not None]
    return x2.shape[0] > 0 and x2.shape[1] > 0 and use_numba(*arrays)


def layer_norm_forward(x2, weight, bias, eps: float):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` per row of ``x2`` (rows, m); ``weight``/``bias`` (m,) or None."""
    xp = get_array_module(x2)
    rows, m = x2.shape
    if xp is np and _numba_rows(x2, weight, bias):
        x2 = np.ascontiguousarray(x2)
        w = np.ones(m, x2.dtype) if weight is None else np.ascontiguousarray(weight.reshape(-1))
        b = np.zeros(m, x2.dtype) if bias is None else np.ascontiguousarray(bias.reshape(-1))
        out = np.empty_like(x2)
        mean, rstd = np.empty(rows, x2.dtype), np.empty(rows, x2.dtype)
        _nb().layer_norm_fwd(x2, w, b, eps, out, mean, rstd)
        return out, ("nb", x2, w, mean, rstd, weight is not None)
    ones = xp.ones(m, x2.dtype)
    xc = x2 - (x2 @ ones)[:, None] * (1.0 / m)
    var = _bmm(xc[:, None, :], xc[:, :, None]).reshape(-1)
    var *= 1.0 / m
    var += eps
    rstd = xp.sqrt(var, out=var)
    xp.divide(1.0, rstd, out=rstd)
    xc *= rstd[:, None]                     # xhat
    out = xc * weight.reshape(-1) if weight is not None else xc.copy()
    if bias is not None:
        out += bias.reshape(-1)
    return out, ("np", xc, None if weight is None else weight.reshape(-1), None, rstd, weight is not None)


def layer_norm_backward(g2, state, need_x: bool, need_w: bool, need_b: bool):
    """``(gx, gw, gb)`` of :func:`layer_norm_forward` for the output gradient ``g2`` (rows, m); None where not needed."""
    kind, a, w, mean, rstd, has_w = state
    xp = get_array_module(a)
    rows, m = a.shape
    g2 = g2.astype(a.dtype, copy=False)
    if kind == "nb":
        gx = np.empty_like(a) if need_x else np.empty((1, 1), a.dtype)
        gw, gb = np.zeros(m, a.dtype), np.zeros(m, a.dtype)
        _nb().layer_norm_bwd(a, w, mean, rstd, np.ascontiguousarray(g2), gx, gw, gb, need_x)
        return (gx if need_x else None), (gw if need_w else None), (gb if need_b else None)
    xhat = a
    ones = xp.ones(rows, g2.dtype)
    gb = ones @ g2 if need_b else None
    gxh = g2 * xhat
    gw = ones @ gxh if need_w else None
    if not need_x:
        return None, gw, gb
    gh = g2 * w if w is not None else g2.copy()
    m1 = gh @ xp.ones(m, g2.dtype)                                   # sum(g w)
    m2 = gxh @ w if w is not None else gxh @ xp.ones(m, g2.dtype)    # sum(g w xhat)
    m1 *= 1.0 / m
    m2 *= 1.0 / m
    gh -= m1[:, None]
    xp.multiply(xhat, m2[:, None], out=gxh)
    gh -= gxh
    gh *= rstd[:, None]
    return gh, gw, gb


def rms_norm_forward(x2, weight, eps: float):
    """``x / sqrt(mean(x^2) + eps) * weight`` per row of ``x2`` (rows, m); ``weight`` (m,) or None."""
    xp = get_array_module(x2)
    rows, m = x2.shape
    if xp is np and _numba_rows(x2, weight):
        x2 = np.ascontiguousarray(x2)
        w = np.ones(m, x2.dtype) if weight is None else np.ascontiguousarray(weight.reshape(-1))
        out = np.empty_like(x2)
        rstd = np.empty(rows, x2.dtype)
        _nb().rms_norm_fwd(x2, w, eps, out, rstd)
        return out, ("nb", x2, w, rstd)
    rstd = (x2 * x2).mean(axis=1, keepdims=True)
    rstd += eps
    rstd = 1.0 / xp.sqrt(rstd, out=rstd)
    xhat = x2 * rstd
    out = xhat * weight.reshape(-1) if weight is not None else xhat.copy()
    return out, ("np", xhat, None if weight is None else weight.reshape(-1), rstd)


def rms_norm_backward(g2, state, need_x: bool, need_w: bool):
    """``(gx, gw)`` of :func:`rms_norm_forward` for the output gradient ``g2``; None where not needed."""
    kind, a, w, rstd = state
    rows, m = a.shape
    g2 = g2.astype(a.dtype, copy=False)
    if kind == "nb":
        gx = np.empty_like(a) if need_x else np.empty((1, 1), a.dtype)
        gw = np.zeros(m, a.dtype)
        _nb().rms_norm_bwd(a, w, rstd, np.ascontiguousarray(g2), gx, gw, need_x)
        return (gx if need_x else None), (gw if need_w else None)
    xhat = a
    gw = (g2 * xhat).sum(axis=0) if need_w else None
    gx = None
    if need_x:   # d/dx of x * rstd(x): rstd * (gh - xhat * mean(gh * xhat))
        gh = g2 * w if w is not None else g2.copy()
        mm = (gh * xhat).mean(axis=1, keepdims=True)
        gh -= xhat * mm
        gh *= rstd
        gx = gh
    return gx, gw
