"""Attention's row ops, forward and backward side by side: the masked softmax (mask + scale + softmax in one pass) and
the online-softmax block of ring attention.

Masks are prefixes: row ``i`` of a score block sees its first ``ncols[i]`` keys (top-left causal attention:
``ncols[i] = min(i + 1, S)``; ring attention: the keys at global positions up to the query's,
:func:`prefix_lengths`), so the numba loops stop at each row's last key and never read the masked part.
Arbitrary boolean or additive masks take the NumPy form. Scores are arrays the caller owns: every function
here overwrites them in place (no scaled, masked or shifted copies). CuPy: one ``ElementwiseKernel`` for mask
and scale, CuPy's row reductions, one fused pass for the backward.
"""
from __future__ import annotations

import numpy as np

from ..backend import get_array_module
from . import _cupy
from ._select import use_numba

__all__ = ["causal_lengths", "prefix_lengths", "masked_softmax_forward", "masked_softmax_backward",
           "online_softmax_block", "exp_minus_lse", "lse_softmax_backward"]


def _nb():
    from . import _attn_nb
    return _attn_nb


def causal_lengths(xp, r0: int, r1: int, s: int):
    """``ncols`` of query rows ``r0..r1`` in top-left causal attention over ``s`` keys: ``min(i + 1, s)``."""
    return xp.minimum(xp.arange(r0 + 1, r1 + 1, dtype=np.int64), s)


def prefix_lengths(qpos, kpos):
    """``ncols[i]``: how many keys (ascending global positions ``kpos``) are at or before query position ``qpos[i]``."""
    xp = get_array_module(qpos)
    return xp.searchsorted(kpos, qpos, side="right").astype(np.int64, copy=False)


_cupy.define("axonmpi_mask_scale", "elementwise", in_params="raw int64 ncols, int64 L, int64 S, float64 scale",
             out_params="T s", body="""
    typedef typename acc_t<T>::type A;
    long long col = i % S, row = (i / S) % L;
    s = col < ncols[row] ? (T)((A)s * (A)scale) : (T)(-(A)INFINITY);""")
_cupy.define("axonmpi_softmax_bwd_scaled", "elementwise", in_params="T p, T g, T d, float64 scale",
             out_params="T gx", body="""
    typedef typename acc_t<T>::type A; gx = (T)((A)scale * (A)p * ((A)g - (A)d));""")


def _nb_ok(s, *more) -> bool:
    return (s.ndim >= 2 and s.size and s.flags.c_contiguous and use_numba(s, *more)
            and all(a.flags.c_contiguous for a in more))


def _as3(a):
    return a.reshape((-1,) + a.shape[-2:])


def _mask_scale(xp, s, scale, ncols):
    """``s *= scale`` and ``-inf`` past each row's ``ncols`` (in place, any module)."""
    L, S = s.shape[-2:]
    if xp is not np:
        _cupy.kernel("axonmpi_mask_scale")(xp.ascontiguousarray(ncols, dtype=np.int64), L, S, float(scale), s)
        return
    s *= scale
    if ncols is not None:
        np.copyto(s, -np.inf, where=np.arange(S)[None, :] >= np.asarray(ncols)[:, None])


def masked_softmax_forward(s, scale: float, ncols=None, mask=None):
    """``softmax(s * scale + mask)`` over the last axis of the scores ``s`` (..., L, S), in place; returns ``s``.

    ``ncols`` (L,) ints: row ``i`` sees keys ``[0, ncols[i])`` only (0 elsewhere in the result; a row that sees
    none is NaN, as torch's). ``mask``: a boolean (True: the pair takes part) or additive float mask,
    broadcastable to ``s``.
    """
    xp = get_array_module(s)
    L, S = s.shape[-2:]
    if xp is np and mask is None and _nb_ok(s):
        n = np.full(L, S, np.int64) if ncols is None else np.ascontiguousarray(ncols, dtype=np.int64)
        _nb().masked_softmax_fwd(_as3(s), scale, n)
        return s
    if ncols is not None or xp is np:
        _mask_scale(xp, s, scale, ncols)
    else:
        s *= scale
    if mask is not None:
        if mask.dtype == np.bool_:
            if xp is np:
                np.copyto(s, -np.inf, where=~mask)
            else:
                s[...] = xp.where(mask, s, xp.asarray(-np.inf, s.dtype))
        else:
            s += mask
    from .softmax import sum_keep
    s -= s.max(axis=-1, keepdims=True)
    xp.exp(s, out=s)
    s /= sum_keep(xp, s, -1)
    return s


def masked_softmax_backward(p, g, scale: float):
    """``scale * p * (g - sum(g p))``: the gradient of the scores for the output gradient ``g`` (overwritten)."""
    xp = get_array_module(p)
    g = g.astype(p.dtype, copy=False)
    if xp is np and _nb_ok(p, g) and p.shape == g.shape:
        _nb().softmax_bwd_scaled(_as3(p), _as3(g), scale)
        return g
    from .softmax import sum_keep
    t = g * p
    d = sum_keep(xp, t, -1) if xp is np else t.sum(axis=-1, keepdims=True)
    if xp is not np:
        return _cupy.kernel("axonmpi_softmax_bwd_scaled")(p, g, d, float(scale), g)
    g -= d
    g *= p
    g *= scale
    return g


def online_softmax_block(s, scale: float, ncols, m, lsum, q0: int):
    """One key block of FlashAttention's online softmax, in place (ring attention's forward).

    ``s`` (R, Lq, Sk): the raw scores of queries ``q0..q0+Lq`` against the block's keys, replaced by
    ``exp(scale s - m_new)`` (0 past each row's ``ncols``); ``m`` and ``lsum`` (R, T): the running row max and
    normaliser of all ``T`` queries, updated for rows ``q0:``. Returns ``alpha`` (R, Lq) = ``exp(m_old - m_new)``,
    the factor the running output of those rows takes before ``+= s @ v``.
    """
    xp = get_array_module(s)
    if xp is np and _nb_ok(s, m, lsum):
        alpha = np.empty(s.shape[:2], s.dtype)
        _nb().online_block(s, scale, np.ascontiguousarray(ncols, dtype=np.int64), m, lsum, int(q0), alpha)
        return alpha
    _mask_scale(xp, s, scale, ncols)
    mb = m[:, q0:]
    m_new = xp.maximum(mb, s.max(axis=-1))
    alpha = xp.exp(mb - m_new)
    s -= m_new[..., None]
    xp.exp(s, out=s)
    lsum[:, q0:] = lsum[:, q0:] * alpha + s.sum(axis=-1)
    m[:, q0:] = m_new
    return alpha


def exp_minus_lse(s, scale: float, ncols, lse, q0: int):
    """In place: ``s = exp(scale s - lse[:, q0 + i])`` with 0 past each row's ``ncols`` (the probabilities again, from
    the saved log-sum-exp ``lse`` (R, T)); returns ``s``."""
    xp = get_array_module(s)
    if xp is np and _nb_ok(s, lse):
        _nb().exp_minus_lse(s, scale, np.ascontiguousarray(ncols, dtype=np.int64), lse, int(q0))
        return s
    _mask_scale(xp, s, scale, ncols)
    s -= lse[:, q0:, None]
    xp.exp(s, out=s)
    return s


def lse_softmax_backward(p, dp, delta, q0: int, scale: float):
    """In place: ``dp = scale * p * (dp - delta[:, q0 + i])``, the scores' gradient from ``delta = sum(dout * out)``
    (R, T) (FlashAttention's backward); returns ``dp``."""
    xp = get_array_module(p)
    if xp is np and _nb_ok(p, dp, delta):
        _nb().lse_grad(p, dp, delta, int(q0), scale)
        return dp
    dp -= delta[:, q0:, None]
    dp *= p
    dp *= scale
    return dp
