"""numba loops of the row ops: softmax, log-softmax, cross-entropy, LayerNorm, RMSNorm (2-D C-contiguous arrays)."""
from __future__ import annotations

import math

from ._nb import fexp, jit, jit_reduce, rdot, rmax, rsum

__all__ = ["softmax_fwd", "softmax_bwd", "log_softmax_fwd", "log_softmax_bwd", "xent_fwd", "xent_bwd",
           "layer_norm_fwd", "layer_norm_bwd", "rms_norm_fwd", "rms_norm_bwd", "scatter_add_rows", "rotary_fwd",
           "rotary_bwd"]


@jit
def _exp_shift(x, shift, out):
    for j in range(x.size):
        out[j] = fexp(x[j] - shift)


@jit
def _exp_shift_scale(x, shift, scale, out):
    # [Note: numba inlining] a loop over an inlined fexp/ferf overload followed by more statements in the same
    # function body lost those statements (numba 0.68's IR inlining); such loops live in a function of their own
    for j in range(x.size):
        out[j] = fexp(x[j] - shift) * scale


@jit
def softmax_fwd(x, out):
    for i in range(x.shape[0]):
        _exp_shift(x[i], rmax(x[i]), out[i])
        inv = x.dtype.type(1) / rsum(out[i])
        o = out[i]
        for j in range(o.size):
            o[j] *= inv


@jit_reduce
def softmax_bwd(p, g, gx):
    for i in range(p.shape[0]):
        pi, gi, oi = p[i], g[i], gx[i]
        d = rdot(pi, gi)
        for j in range(pi.size):
            oi[j] = pi[j] * (gi[j] - d)


@jit
def log_softmax_fwd(x, out):
    for i in range(x.shape[0]):
        mx = rmax(x[i])
        _exp_shift(x[i], mx, out[i])
        lse = x.dtype.type(mx + math.log(rsum(out[i])))
        xi, oi = x[i], out[i]
        for j in range(xi.size):
            oi[j] = xi[j] - lse


@jit
def log_softmax_bwd(logp, g, gx):
    for i in range(logp.shape[0]):
        li, gi, oi = logp[i], g[i], gx[i]
        sg = rsum(gi)
        for j in range(li.size):
            oi[j] = gi[j] - fexp(li[j]) * sg


@jit
def xent_fwd(x, t, scratch, lse):
    """``lse[i] = log sum_j exp(x[i, j])`` (the caller takes ``lse - x[i, t_i]``); ``scratch`` one row."""
    for i in range(x.shape[0]):
        mx = rmax(x[i])
        _exp_shift(x[i], mx, scratch)
        lse[i] = mx + math.log(rsum(scratch))


@jit
def xent_bwd(x, t, lse, scale, gx):
    """``gx[i] = (softmax(x[i]) - onehot(t_i)) * scale[i]`` (``scale`` 0 for ignored rows)."""
    for i in range(x.shape[0]):
        oi, s = gx[i], scale[i]
        _exp_shift_scale(x[i], lse[i], s, oi)
        k = t[i]
        oi[k] = oi[k] - s


@jit_reduce
def layer_norm_fwd(x, w, b, eps, out, mean, rstd):
    m = x.shape[1]
    for i in range(x.shape[0]):
        xi, oi = x[i], out[i]
        mu = x.dtype.type(rsum(xi) / m)
        v = x.dtype.type(0)
        for j in range(m):
            d = xi[j] - mu
            v += d * d
        r = x.dtype.type(1 / math.sqrt(v / m + eps))
        mean[i], rstd[i] = mu, r
        for j in range(m):
            oi[j] = (xi[j] - mu) * r * w[j] + b[j]


@jit_reduce
def layer_norm_bwd(x, w, mean, rstd, g, gx, gw, gb, need_x):
    m = x.shape[1]
    for i in range(x.shape[0]):
        xi, gi, oi = x[i], g[i], gx[i]
        mu, r = mean[i], rstd[i]
        s1 = x.dtype.type(0)
        s2 = x.dtype.type(0)
        for j in range(m):
            xh = (xi[j] - mu) * r
            gw[j] += gi[j] * xh
            gb[j] += gi[j]
            wg = gi[j] * w[j]
            s1 += wg
            s2 += wg * xh
        if need_x:
            s1 = x.dtype.type(s1 / m)
            s2 = x.dtype.type(s2 / m)
            for j in range(m):
                oi[j] = r * (gi[j] * w[j] - s1 - (xi[j] - mu) * r * s2)


@jit_reduce
def rms_norm_fwd(x, w, eps, out, rstd):
    m = x.shape[1]
    for i in range(x.shape[0]):
        xi, oi = x[i], out[i]
        r = x.dtype.type(1 / math.sqrt(rdot(xi, xi) / m + eps))
        rstd[i] = r
        for j in range(m):
            oi[j] = xi[j] * r * w[j]


@jit_reduce
def rms_norm_bwd(x, w, rstd, g, gx, gw, need_x):
    m = x.shape[1]
    for i in range(x.shape[0]):
        xi, gi, oi = x[i], g[i], gx[i]
        r = rstd[i]
        s2 = x.dtype.type(0)
        for j in range(m):
            xh = xi[j] * r
            gw[j] += gi[j] * xh
            s2 += gi[j] * w[j] * xh
        if need_x:
            s2 = x.dtype.type(s2 / m)
            for j in range(m):
                oi[j] = r * (gi[j] * w[j] - xi[j] * r * s2)


@jit_reduce
def scatter_add_rows(out, idx, rows):
    """``out[idx[i]] += rows[i]`` for every ``i`` (repeated indices accumulate, in order)."""
    for i in range(idx.size):
        o, r = out[idx[i]], rows[i]
        for j in range(r.size):
            o[j] += r[j]


@jit
def rotary_fwd(x, c, s, row, out):
    """``out = x * cos + rotate_half(x) * sin`` per row of ``x`` (N, D), tables (R, D), table row ``row[i]``."""
    h = x.shape[1] // 2
    for i in range(x.shape[0]):
        xi, oi, ci, si = x[i], out[i], c[row[i]], s[row[i]]
        for j in range(h):
            oi[j] = xi[j] * ci[j] - xi[j + h] * si[j]
            oi[j + h] = xi[j + h] * ci[j + h] + xi[j] * si[j + h]


@jit
def rotary_bwd(g, c, s, row, gx):
    """The transpose of :func:`rotary_fwd`: ``rotate_half^T([g1, g2]) = [g2, -g1]``."""
    h = g.shape[1] // 2
    for i in range(g.shape[0]):
        gi, oi, ci, si = g[i], gx[i], c[row[i]], s[row[i]]
        for j in range(h):
            oi[j] = gi[j] * ci[j] + gi[j + h] * si[j + h]
            oi[j + h] = gi[j + h] * ci[j + h] - gi[j] * si[j]
