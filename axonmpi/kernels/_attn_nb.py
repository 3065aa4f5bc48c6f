"""numba loops of the attention row ops: the masked softmax, its backward, the ring's online-softmax block (see attention.py).

Scores are ``(R, L, S)`` C-contiguous (R: batch x heads); row ``i`` of every ``L`` sees its first ``ncols[i]``
keys (a prefix: causal masks and the ring's global positions are both prefixes), the rest are 0 in the output.
The row helpers take the whole (contiguous) row and the prefix length: a slice ``row[:n]`` is typed as a strided
array by numba, and its loops do not vectorize (10x slower).
"""
from __future__ import annotations

import math

from ._nb import FASTMATH, fexp, jit, jit_reduce, rdot
from numba import njit

__all__ = ["masked_softmax_fwd", "softmax_bwd_scaled", "online_block", "exp_minus_lse", "lse_grad"]

_REDUCE = dict(cache=True, fastmath=set(FASTMATH | {"reassoc", "nnan"}), nogil=True, error_model="numpy")


@njit(**_REDUCE)
def _max_n(a, n):
    m = a[0]
    for j in range(1, n):
        m = a[j] if a[j] > m else m
    return m


@njit(cache=True, fastmath=set(FASTMATH | {"reassoc"}), nogil=True, error_model="numpy")
def _sum_n(a, n):
    s = a.dtype.type(0)
    for j in range(n):
        s += a[j]
    return s


@jit
def _exp_shift_n(a, shift, n):
    # [Note: numba inlining] (``_rows_nb``): the loop over the inlined exp stays alone in its function. In place
    # through one argument: with an input and an output that may alias LLVM checks the overlap at run time and,
    # for the same row, takes its scalar loop
    for j in range(n):
        a[j] = fexp(a[j] - shift)


@jit
def _times_n(out, c, n):
    for j in range(n):
        out[j] *= c


@jit
def _zero_from(out, n):
    z = out.dtype.type(0)
    for j in range(n, out.size):
        out[j] = z


@jit
def masked_softmax_fwd(s, scale, ncols):
    """In place: ``s[b, i, :n] = softmax(s[b, i, :n] * scale)``, ``s[b, i, n:] = 0`` with ``n = ncols[i]``."""
    sc = s.dtype.type(scale)
    one = s.dtype.type(1)
    for b in range(s.shape[0]):
        for i in range(s.shape[1]):
            n = ncols[i]
            o = s[b, i]
            if n <= 0:                               # no key: NaN, as torch's softmax of an all -inf row
                for j in range(o.size):
                    o[j] = s.dtype.type(math.nan)
                continue
            _times_n(o, sc, n)
            _exp_shift_n(o, _max_n(o, n), n)
            _times_n(o, one / _sum_n(o, n), n)
            _zero_from(o, n)


@jit_reduce
def softmax_bwd_scaled(p, g, scale):
    """In place: ``g = scale * p * (g - sum(g p))`` per row."""
    sc = p.dtype.type(scale)
    for b in range(p.shape[0]):
        for i in range(p.shape[1]):
            pi, gi = p[b, i], g[b, i]
            d = rdot(pi, gi)
            for j in range(pi.size):
                gi[j] = sc * pi[j] * (gi[j] - d)


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
                _zero_from(row, 0)
                continue
            _times_n(row, sc, n)
            mo = m[b, q0 + i]
            mx = _max_n(row, n)
            mn = mx if mx > mo else mo
            _exp_shift_n(row, mn, n)
            _zero_from(row, n)
            a = s.dtype.type(math.exp(mo - mn))
            alpha[b, i] = a
            lsum[b, q0 + i] = lsum[b, q0 + i] * a + _sum_n(row, n)
            m[b, q0 + i] = mn


@jit
def exp_minus_lse(s, scale, ncols, lse, q0):
    """In place: ``s[b, i, :n] = exp(scale s - lse[b, q0 + i])``, 0 past ``n = ncols[i]`` (the ring's backward)."""
    sc = s.dtype.type(scale)
    for b in range(s.shape[0]):
        for i in range(s.shape[1]):
            n = ncols[i]
            row = s[b, i]
            _times_n(row, sc, n)
            _exp_shift_n(row, lse[b, q0 + i], n)
            _zero_from(row, n)


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
