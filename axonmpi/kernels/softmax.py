"""Softmax, log-softmax and cross-entropy over the last axis, forward and backward side by side.

NumPy: max-shifted ufuncs in place, row sums as BLAS matrix-vector products; numba: one loop per row (max,
exp-sum, scale) with the float32 exp of ``_nb``; CuPy: CuPy's row reductions and one fused
``ElementwiseKernel`` per pass. Cross-entropy never builds a one-hot matrix and, on a GPU, checks no target on
the host: a target outside ``[0, C)`` (other than ``ignore_index``) gives a NaN loss there instead of an error.
"""
from __future__ import annotations

import numpy as np

from ..backend import get_array_module
from . import _cupy
from ._select import use_numba

__all__ = ["softmax_forward", "softmax_backward", "log_softmax_forward", "log_softmax_backward",
           "cross_entropy_forward", "cross_entropy_backward", "sum_keep"]


def _nb():
    from . import _rows_nb
    return _rows_nb


def _inplace_ok(x) -> bool:
    return getattr(x, "dtype", None) is not None and x.dtype.kind == "f" and x.dtype.itemsize >= 4


def _last(axis, ndim) -> bool:
    return axis in (-1, ndim - 1)


def _rows(a):
    a = np.ascontiguousarray(a)
    return a.reshape(-1, a.shape[-1]) if a.ndim != 2 else a


def sum_keep(xp, a, axis):
    """``a.sum(axis=axis, keepdims=True)``; over the last axis of a float32/float64 C-contiguous NumPy array,
    one BLAS matrix-vector product (a row sum of short rows is 2-3x faster there than NumPy's reduce)."""
    n = a.shape[axis] if a.ndim else 1
    if (a.ndim and _last(axis, a.ndim) and _inplace_ok(a) and a.flags.c_contiguous and a.size and n > 1):
        return (a.reshape(-1, n) @ xp.ones(n, a.dtype)).reshape(a.shape[:-1] + (1,))
    return a.sum(axis=axis, keepdims=True)


_cupy.define("axonmpi_softmax_bwd", "elementwise", in_params="T p, T g, T d", out_params="T gx",
             body="gx = p * (g - d);")
_cupy.define("axonmpi_log_softmax_bwd", "elementwise", in_params="T logp, T g, T sg", out_params="T gx", body="""
    typedef typename acc_t<T>::type A; gx = (T)((A)g - exp((A)logp) * (A)sg);""")


def softmax_forward(x, axis: int = -1):
    """``exp(x - max) / sum(exp(x - max))`` along ``axis``."""
    xp = get_array_module(x)
    if xp is np and x.ndim and _last(axis, x.ndim) and x.size and use_numba(x):
        out = np.empty(x.shape, x.dtype)
        _nb().softmax_fwd(_rows(x), out.reshape(-1, x.shape[-1]))
        return out
    z = x - x.max(axis=axis, keepdims=True)
    xp.exp(z, out=z)
    z /= sum_keep(xp, z, axis)
    return z


def softmax_backward(p, g, axis: int = -1):
    """``p (g - sum(g p))`` from the forward's output ``p``."""
    xp = get_array_module(p)
    if xp is np and p.ndim and _last(axis, p.ndim) and p.size and use_numba(p, g):
        gx = np.empty(p.shape, p.dtype)
        _nb().softmax_bwd(_rows(p), _rows(g), gx.reshape(-1, p.shape[-1]))
        return gx
    gp = g * p
    s = sum_keep(xp, gp, axis)
    if xp is not np:
        return _cupy.kernel("axonmpi_softmax_bwd")(p, g.astype(p.dtype, copy=False), s.astype(p.dtype, copy=False))
    if _inplace_ok(gp) and g.dtype == gp.dtype:   # (g - sum(g p)) p, in place
        np.subtract(g, s, out=gp)
        gp *= p
        return gp
    gp -= p * s
    return gp


def log_softmax_forward(x, axis: int = -1):
    """``x - max - log(sum(exp(x - max)))`` along ``axis``."""
    xp = get_array_module(x)
    if xp is np and x.ndim and _last(axis, x.ndim) and x.size and use_numba(x):
        out = np.empty(x.shape, x.dtype)
        _nb().log_softmax_fwd(_rows(x), out.reshape(-1, x.shape[-1]))
        return out
    z = x - x.max(axis=axis, keepdims=True)
    e = xp.exp(z)
    z -= xp.log(sum_keep(xp, e, axis) if xp is np else e.sum(axis=axis, keepdims=True))
    return z


def log_softmax_backward(logp, g, axis: int = -1):
    """``g - exp(logp) sum(g)`` from the forward's output ``logp``."""
    xp = get_array_module(logp)
    if xp is np and logp.ndim and _last(axis, logp.ndim) and logp.size and use_numba(logp, g):
        gx = np.empty(logp.shape, logp.dtype)
        _nb().log_softmax_bwd(_rows(logp), _rows(g), gx.reshape(-1, logp.shape[-1]))
        return gx
    sg = g.sum(axis=axis, keepdims=True)
    if xp is not np:
        return _cupy.kernel("axonmpi_log_softmax_bwd")(logp, g.astype(logp.dtype, copy=False),
                                                         sg.astype(logp.dtype, copy=False))
    out = np.exp(logp)
    out *= sg
    np.subtract(g, out, out=out)
    return out


# -- cross-entropy ---------------------------------------------------------------------------------------
def cross_entropy_forward(x, t, ignore_index: int, weight=None, label_smoothing: float = 0.0):
    """Per-row losses of logits ``x`` (N, C) against integer targets ``t`` (N,), and the state for backward.

    Returns ``(loss, wt, state)``: ``loss`` (N,) is ``(1-e) w[t] (lse - x_t) + e/C (W lse - sum_c w_c x_c)``,
    0 for ignored rows; ``wt`` (N,) each row's weight ``w[t] * valid`` (the ``"mean"`` divisor is its sum).
    """
    xp = get_array_module(x)
    n, c = x.shape
    valid = t != ignore_index
    ts = xp.where(valid, t, 0)
    eps = float(label_smoothing)
    w = None if weight is None else xp.asarray(weight, dtype=x.dtype)
    wt = valid.astype(x.dtype) if w is None else w[ts] * valid
    if xp is not np:        # a target out of range: NaN loss (no host check on the device)
        bad = (ts < 0) | (ts >= c)
        ts = xp.where(bad, 0, ts)
        wt = xp.where(bad, xp.asarray(xp.nan, x.dtype), wt)
    rows = xp.arange(n)
    if xp is np and not eps and n and c and use_numba(x):
        xr = np.ascontiguousarray(x)
        lse = np.empty(n, x.dtype)
        _nb().xent_fwd(xr, ts, np.empty(c, x.dtype), lse)
        loss = (lse - xr[rows, ts]) * wt
        return loss, wt, ("nb", xr, ts, lse, wt, w, eps)
    mx = x.max(axis=1, keepdims=True)
    z = x - mx
    zt = z[rows, ts]
    if eps:
        zsum = z.sum(axis=1) if w is None else z @ w
        wsum = float(c) if w is None else w.sum()
    xp.exp(z, out=z)
    s = sum_keep(xp, z, 1)[:, 0] if xp is np else z.sum(axis=1)
    lse = xp.log(s)
    loss = (lse - zt) * wt
    if eps:
        loss = (1.0 - eps) * loss + (eps / c) * (wsum * lse - zsum) * valid
    z /= s[:, None]  # softmax probabilities, kept for backward
    return loss, wt, ("np", z, ts, valid, wt, w, eps)


def cross_entropy_backward(state, scale):
    """Gradient of ``sum_i loss_i * scale_i`` w.r.t. the logits (``scale`` a scalar or (N,) array)."""
    kind, a, ts, b, wt, w, eps = state
    xp = get_array_module(a)
    if kind == "nb":
        x, lse = a, b
        s = np.ascontiguousarray(np.broadcast_to(wt * scale, wt.shape), dtype=x.dtype)
        gx = np.empty(x.shape, x.dtype)
        _nb().xent_bwd(x, ts, lse, s, gx)
        return gx
    p, valid = a, b
    rows = xp.arange(p.shape[0])
    c = p.shape[1]
    if eps:
        wsum = float(c) if w is None else w.sum()
        coef = (1.0 - eps) * wt + (eps / c) * wsum * valid
        gx = p * coef[:, None]
        gx[rows, ts] -= (1.0 - eps) * wt
        vf = valid.astype(p.dtype)
        gx -= (eps / c) * (vf[:, None] if w is None else vf[:, None] * w[None, :])
    else:
        gx = p * wt[:, None]
        gx[rows, ts] -= wt
    if getattr(scale, "ndim", 0):
        gx *= scale.reshape(-1, 1).astype(gx.dtype, copy=False)
    else:
        gx *= scale
    return gx
