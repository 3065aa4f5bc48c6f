"""numba loops of the attention row ops: the masked softmax, its backward, the ring's online-softmax block (see attention.py).

Scores are ``(R, L, S)`` C-contiguous (R: batch x heads); row ``i`` of every ``L`` sees its first ``ncols[i]``
keys (a prefix: causal masks and the ring's global positions are both prefixes), the rest are 0 in the output.
"""
from __future__ import annotations

import math

from ._nb import jit, jit_reduce, rdot, rmax, rsum
from ._rows_nb import _exp_shift

__all__ = ["masked_softmax_fwd", "softmax_bwd_scaled", "online_block", "exp_minus_lse", "lse_grad"]


@jit
def _scale_into(x, scale, out):
    for j in range(x.size):
        out[j] = x[j] * scale


@jit
def _zero(out):
    z = out.dtype.type(0)
    for j in range(out.size):
        out[j] = z


@jit
def _times(out, c):
    for j in range(out.size):
        out[j] *= c


@jit
def masked_softmax_fwd(s, scale, ncols, out):
    """``out[b, i, :n] = softmax(s[b, i, :n] * scale)``, ``out[b, i, n:] = 0`` with ``n = ncols[i]`` (``out`` may be ``s``)."""
    sc = s.dtype.type(scale)
    one = s.dtype.type(1)
    for b in range(s.shape[0]):
        for i in range(s.shape[1]):
            n = ncols[i]
            o = out[b, i]
            if n <= 0:                               # no key: NaN, as torch's softmax of an all -inf row
                for j in range(o.size):
                    o[j] = s.dtype.type(math.nan)
                continue
            h = o[:n]
            _scale_into(s[b, i, :n], sc, h)
            _exp_shift(h, rmax(h), h)
            _times(h, one / rsum(h))
            _zero(o[n:])


@jit_reduce
def softmax_bwd_scaled(p, g, scale, gx):
    """``gx = scale * p * (g - sum(g p))`` per row (``gx`` may be ``g``)."""
    sc = p.dtype.type(scale)
    for b in range(p.shape[0]):
        for i in range(p.shape[1]):
            pi, gi, oi = p[b, i], g[b, i], gx[b, i]
            d = rdot(pi, gi)
            for j in range(pi.size):
                oi[j] = sc * pi[j] * (gi[j] - d)


@jit
def online_block(s, scale, ncols, m, lsum, q0, alpha):
    """One key block of the online softmax, in place: ``s`` (R, Lq, Sk) raw scores -> ``exp(scale s - m_new)``
    (0 past each row's ``ncols``), ``m[:, q0 + i]`` / ``lsum[:, q0 + i]`` (R, T) updated, ``alpha`` (R, Lq) =
    ``exp(m_old - m_new)`` (the factor the caller applies to its running output)."""
    sc = s.dtype.type(scale)
    for b in range(s.shape[0]):
        for i in range(s.shape[1]):
            n = ncols[i]
            row = s[b, i]
            if n <= 0:
                alpha[b, i] = s.dtype.type(1)
                _zero(row)
                continue
            h = row[:n]
            _times(h, sc)
            mo = m[b, q0 + i]
            mx = rmax(h)
            mn = mx if mx > mo else mo
            _exp_shift(h, mn, h)
            _zero(row[n:])
            a = s.dtype.type(math.exp(mo - mn))
            alpha[b, i] = a
            lsum[b, q0 + i] = lsum[b, q0 + i] * a + rsum(h)
            m[b, q0 + i] = mn


@jit
def exp_minus_lse(s, scale, ncols, lse, q0):
    """In place: ``s[b, i, :n] = exp(scale s - lse[b, q0 + i])``, 0 past ``n = ncols[i]`` (the ring's backward)."""
    sc = s.dtype.type(scale)
    for b in range(s.shape[0]):
        for i in range(s.shape[1]):
            n = ncols[i]
            row = s[b, i]
            h = row[:n]
            _times(h, sc)
            _exp_shift(h, lse[b, q0 + i], h)
            _zero(row[n:])


@jit_reduce
def lse_grad(p, dp, delta, q0, scale):
    """In place: ``dp = scale * p * (dp - delta[b, q0 + i])`` (the ring's backward; ``delta = sum(dout * out)``)."""
    sc = p.dtype.type(scale)
    for b in range(p.shape[0]):
        for i in range(p.shape[1]):
            pi, di = p[b, i], dp[b, i]
            d = delta[b, q0 + i]
            for j in range(pi.size):
                di[j] = sc * pi[j] * (di[j] - d)
