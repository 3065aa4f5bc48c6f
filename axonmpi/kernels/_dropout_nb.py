"""numba loops of dropout and residual add + dropout (flat contiguous arrays; see dropout.py), without fast math:
bit for bit the values of the NumPy form."""
from __future__ import annotations

from ._nb import jit_exact as jit

__all__ = ["dropout_fwd", "dropout_add_fwd", "dropout_bwd"]


@jit
def dropout_fwd(x, r, p, scale, y, keep):
    z = x.dtype.type(0)
    for i in range(x.size):
        k = r[i] >= p
        keep[i] = k
        y[i] = x[i] * (scale if k else z)


@jit
def dropout_add_fwd(x, res, r, p, scale, y, keep):
    z = x.dtype.type(0)
    for i in range(x.size):
        k = r[i] >= p
        keep[i] = k
        y[i] = res[i] + x[i] * (scale if k else z)


@jit
def dropout_bwd(g, keep, scale, gx):
    z = g.dtype.type(0)
    for i in range(g.size):
        gx[i] = g[i] * (scale if keep[i] else z)
