"""Rotary position embedding, forward and backward side by side: ``x cos + rotate_half(x) sin`` (half-split layout)."""
from __future__ import annotations

import numpy as np

from ..backend import get_array_module
from ._select import use_numba

__all__ = ["rotary_forward", "rotary_backward"]


def _table_rows(xshape, cshape):
    """For each row of ``x`` (its leading axes flattened), the row of the tables (theirs flattened) it takes,
    or None where the tables do not broadcast that way (their last axis must be the full head dim)."""
    lead = tuple(xshape[:-1])
    tl = tuple(cshape[:-1])
    if cshape[-1] != xshape[-1] or len(tl) > len(lead):
        return None
    n = int(np.prod(tl)) if tl else 1
    rows = np.broadcast_to(np.arange(n, dtype=np.int64).reshape(tl), lead)
    return np.ascontiguousarray(rows).reshape(-1)


def _numba_form(x, c, s):
    if not (x.ndim and x.size and x.shape[-1] % 2 == 0 and use_numba(x, c, s)):
        return None
    rows = _table_rows(x.shape, c.shape)
    if rows is None:
        return None
    d = x.shape[-1]
    return rows, np.ascontiguousarray(c).reshape(-1, d), np.ascontiguousarray(s).reshape(-1, d)


def rotary_forward(x, cos, sin):
    """``x * cos + rotate_half(x) * sin``, ``rotate_half([x1, x2]) = [-x2, x1]`` over the last axis; the tables
    broadcast to ``x``."""
    xp = get_array_module(x)
    if xp is np:
        form = _numba_form(x, cos, sin)
        if form is not None:
            from ._rows_nb import rotary_fwd
            rows, c, s = form
            d = x.shape[-1]
            out = np.empty(x.shape, x.dtype)
            rotary_fwd(np.ascontiguousarray(x).reshape(-1, d), c, s, rows, out.reshape(-1, d))
            return out
    h = x.shape[-1] // 2
    out = x * cos
    out[..., :h] -= x[..., h:] * sin[..., :h]
    out[..., h:] += x[..., :h] * sin[..., h:]
    return out


def rotary_backward(g, cos, sin):
    """The gradient of :func:`rotary_forward` for the output gradient ``g`` (the transposed rotation)."""
    xp = get_array_module(g)
    if xp is np:
        form = _numba_form(g, cos, sin)
        if form is not None:
            from ._rows_nb import rotary_bwd
            rows, c, s = form
            d = g.shape[-1]
            gx = np.empty(g.shape, g.dtype)
            rotary_bwd(np.ascontiguousarray(g).reshape(-1, d), c, s, rows, gx.reshape(-1, d))
            return gx
    h = g.shape[-1] // 2
    gx = g * cos              # rotate_half^T([g1, g2]) = [g2, -g1]
    gx[..., :h] += g[..., h:] * sin[..., h:]
    gx[..., h:] -= g[..., :h] * sin[..., :h]
    return gx
