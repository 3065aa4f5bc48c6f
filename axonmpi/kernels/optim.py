"""Optimizer and gradient kernels: the Adam / AdamW update in one pass, the gradient norm and the clip without a
host sync.

:func:`adam_update` is ``torch.optim.Adam``'s / ``AdamW``'s update rule over one parameter's (or one flat
buffer's) elements: the decay, the moments, the bias corrections and the step in one loop (numba, exact IEEE
arithmetic: bit for bit the NumPy form's result), in cache-sized pieces of in-place ufuncs (NumPy), or in one
``ElementwiseKernel`` (CuPy). Its scalars come in one float64 array (:func:`adam_coefficients`): on a GPU the
kernel reads them from device memory, so a captured step replays with new values written there. A lower-precision
working copy of the parameter (``low``) is written in the same pass. :func:`adam_update_multi` runs it over a whole
parameter group in one numba call (a multi-tensor pass over a table of the arrays' addresses).

:func:`grad_norm_partial` sums ``|g|^p`` (max for inf) over gradients as a 0-d float64 array on their device;
:func:`clip_by_total_norm_` scales them by ``min(max_norm / (total + 1e-6), 1)`` as an array operation: nothing
is read back to the host.
"""
from __future__ import annotations

import math
import weakref

import numpy as np

from ..backend import get_array_module
from . import _cupy
from ._select import host_path, use_numba

__all__ = ["adam_coefficients", "adam_update", "adam_update_multi", "grad_norm_partial", "clip_by_total_norm_"]

# NumPy form: pieces of 64 Ki elements (256 KiB float32), so a piece's dozen passes stay in a 1 MiB L2
_CHUNK = 1 << 16
# coefficient slots
DECAY, L2, B1, OMB1, B2, OMB2, STEP_SIZE, BC2, EPS = range(9)


def adam_coefficients(lr: float, betas, eps: float, weight_decay: float, step: int, decoupled: bool, xp=np):
    """The update's scalars for step ``step`` (1-based) as a float64 array of 9 (``xp``'s module).

    ``[decay, l2, beta1, 1 - beta1, beta2, 1 - beta2, lr / (1 - beta1^t), sqrt(1 - beta2^t), eps]``: AdamW
    decays the parameter by ``decay = 1 - lr * weight_decay``; Adam adds ``l2 = weight_decay`` times it to the
    gradient.
    """
    b1, b2 = betas
    decay = 1.0 - lr * weight_decay if decoupled and weight_decay else 1.0
    l2 = 0.0 if decoupled else float(weight_decay)
    c = [decay, l2, b1, 1.0 - b1, b2, 1.0 - b2, lr / (1.0 - b1 ** step), math.sqrt(1.0 - b2 ** step), eps]
    return xp.asarray(np.array(c, dtype=np.float64))


# both Adam kernels: decoupled decay, (-g) + l2 p, the moments (c: adam_coefficients' order)
_ADAM_MOMENTS = """
    S pi = (S)p * (S)c[0];
    S ge = (flags & 1) ? -(S)g : (S)g;
    if (c[1] != 0) ge = ge + pi * (S)c[1];
    S mi = m * (S)c[2] + ge * (S)c[3];
    S vi = v * (S)c[4] + ge * ge * (S)c[5];
    m = mi; v = vi;
"""
_cupy.define("axonmpi_adam_step", "elementwise", in_params="G g, raw float64 c, int32 flags",
             out_params="P p, S m, S v", body=_ADAM_MOMENTS + """    p = (P)(pi - mi / (sqrt(vi) / (S)c[7] + (S)c[8]) * (S)c[6]);""")
_cupy.define("axonmpi_adam_step_amsgrad", "elementwise", in_params="G g, raw float64 c, int32 flags",
             out_params="P p, S m, S v, S vm", body=_ADAM_MOMENTS + """    S a = vm; a = (a != a || vi != vi) ? a + vi : (vi > a ? vi : a); vm = a;
    p = (P)(pi - mi / (sqrt(a) / (S)c[7] + (S)c[8]) * (S)c[6]);""")


def _low_kind(p, low) -> int:
    """0: no copy; 1: float16; 2: bfloat16 (written by the numba loop from float32 parameters); -1: another form."""
    if low is None:
        return 0
    if p.dtype != np.float32 or not isinstance(low, np.ndarray) or not low.flags.c_contiguous:
        return -1
    return 1 if low.dtype == np.float16 else 2 if low.dtype.name == "bfloat16" else -1


def _numba_ok(p, g, m, v, vm, low) -> bool:
    arrays = (p, g, m, v) + (() if vm is None else (vm,))
    return use_numba(*arrays) and all(a.flags.c_contiguous for a in arrays) and _low_kind(p, low) >= 0


def adam_update(p, g, m, v, coef, *, maximize: bool = False, vmax=None, low=None, scratch=None) -> None:
    """One Adam / AdamW step over the elements of ``p`` in place (``m``, ``v``, ``vmax`` too); ``coef`` from
    :func:`adam_coefficients`. ``low``: an array of ``p``'s shape in a lower precision, set to the updated ``p``
    in the same pass (a mixed-precision working copy). ``scratch``: two reusable 1-D buffers of at least
    ``min(p.size, 65536)`` elements in the state dtype for the NumPy form (allocated when left out).

    Example:
        >>> c = adam_coefficients(1e-3, (0.9, 0.999), 1e-8, 0.01, step=1, decoupled=True)
        >>> adam_update(w, dw, m, v, c)
    """
    xp = get_array_module(p)
    if xp is not np:
        flags = xp.int32(1 if maximize else 0)
        c = xp.asarray(coef, dtype=np.float64)
        if vmax is None:
            _cupy.kernel("axonmpi_adam_step")(g, c, flags, p, m, v)
        else:
            _cupy.kernel("axonmpi_adam_step_amsgrad")(g, c, flags, p, m, v, vmax)
        if low is not None:
            low[...] = p.astype(low.dtype)
        return
    c = [float(x) for x in np.asarray(coef)]
    if p.size and _numba_ok(p, g, m, v, vmax, low):
        t = p.dtype.type
        dummy = np.empty(1, p.dtype)
        from ._optim_nb import adam_step, adamw_plain
        if vmax is None and low is None and c[L2] == 0.0:
            adamw_plain(p.reshape(-1), g.reshape(-1), m.reshape(-1), v.reshape(-1),
                        *(t(c[k]) for k in (DECAY, B1, OMB1, B2, OMB2, STEP_SIZE, BC2, EPS)), t(-1 if maximize else 1))
            return
        adam_step(p.reshape(-1), g.reshape(-1), m.reshape(-1), v.reshape(-1),
                  dummy if vmax is None else vmax.reshape(-1),
                  np.empty(1, np.uint16) if low is None else low.reshape(-1).view(np.uint16),
                  *(t(x) for x in c), bool(maximize), vmax is not None, _low_kind(p, low))
        return
    _adam_numpy(p, g, m, v, vmax, c, maximize, scratch)
    if low is not None:
        low[...] = p.astype(low.dtype)


def _fits(dt, arrays) -> bool:
    """Every array a plain C-contiguous NumPy array of dtype ``dt`` (what the multi-tensor loop takes)."""
    for a in arrays:
        if type(a) is not np.ndarray or a.dtype != dt or not a.flags.c_contiguous:
            return False
    return True


def _addresses(arrays, cache) -> list:
    """The arrays' data addresses; ``cache`` (a dict, or None) keeps those of arrays that live across steps (by a
    weak reference: a replaced array is not kept alive, and a new one at a reused ``id`` is told apart)."""
    if cache is None:
        return [a.ctypes.data for a in arrays]
    out = []
    for a in arrays:
        e = cache.get(id(a))
        if e is None or e[0]() is not a:
            e = cache[id(a)] = (weakref.ref(a), a.ctypes.data)
        out.append(e[1])
    return out


def adam_update_multi(ps, gs, ms, vs, coef, *, maximize: bool = False, vmaxs=None, lows=None, scratch=None,
                      cache=None) -> None:
    """:func:`adam_update` over several parameters with the same scalars (one parameter group's, one step count):
    on the numba path one call for all of them (a multi-tensor pass: the arrays' addresses in one table, each
    parameter's loop the single-parameter loop, so every value is bit for bit :func:`adam_update`'s); elsewhere,
    and for arrays the numba loop does not take, one :func:`adam_update` each. ``vmaxs`` / ``lows``: lists beside
    ``ps`` (entries None where absent) or None. ``scratch(p)``: the NumPy form's buffers for ``p`` (or None).
    ``cache``: a dict the caller keeps between steps (the addresses of the parameters and their moments).

    Example:
        >>> c = adam_coefficients(1e-3, (0.9, 0.999), 1e-8, 0.01, step=1, decoupled=True)
        >>> adam_update_multi([w1, w2], [dw1, dw2], [m1, m2], [v1, v2], c)
    """
    n = len(ps)
    vmaxs = vmaxs or [None] * n
    lows = lows or [None] * n
    batch, rest = [], []
    dt = ps[0].dtype if n else None
    if n > 1 and type(ps[0]) is np.ndarray and dt.char in "fd" and host_path() == "numba":
        ams = vmaxs[0] is not None
        kind = _low_kind(ps[0], lows[0])
        for i in range(n):
            p, vm, low = ps[i], vmaxs[i], lows[i]
            ok = (p.size and (vm is not None) == ams and _low_kind(p, low) == kind and kind >= 0
                  and _fits(dt, (p, gs[i], ms[i], vs[i]) if vm is None else (p, gs[i], ms[i], vs[i], vm)))
            (batch if ok else rest).append(i)
    else:
        rest = list(range(n))
    if len(batch) == 1:
        rest, batch = batch + rest, []
    if batch:
        c = [float(x) for x in np.asarray(coef)]
        t = dt.type
        if cache is not None and len(cache) > 16 * n:      # many arrays replaced since (state loads): start again
            cache.clear()
        sizes = np.array([ps[i].size for i in batch], np.int64)
        table = [_addresses([a[i] for i in batch], cache) for a in (ps, ms, vs)]
        table.insert(1, _addresses([gs[i] for i in batch], None))
        from ._optim_nb import adam_step_multi, adamw_plain_multi
        if not ams and kind == 0 and c[L2] == 0.0:
            adamw_plain_multi(np.array(table, np.int64), sizes, ps[batch[0]],
                              *(t(c[k]) for k in (DECAY, B1, OMB1, B2, OMB2, STEP_SIZE, BC2, EPS)),
                              t(-1 if maximize else 1))
        else:
            zero = [0] * len(batch)
            table.append(_addresses([vmaxs[i] for i in batch], cache) if ams else zero)
            table.append(_addresses([lows[i] for i in batch], cache) if kind else zero)
            adam_step_multi(np.array(table, np.int64), sizes, ps[batch[0]], *(t(x) for x in c), bool(maximize),
                            ams, kind)
    for i in rest:
        adam_update(ps[i], gs[i], ms[i], vs[i], coef, maximize=maximize, vmax=vmaxs[i], low=lows[i],
                    scratch=None if scratch is None else scratch(ps[i]))


def _pieces(arrays, scratch, dtype):
    """``[pieces of arrays..., scratch pieces...]`` over ``arrays[0]``'s elements (strided arrays: one piece)."""
    first = arrays[0]
    n = first.size
    if n == 0:                  # a rank's empty piece of a sharded parameter (FSDP): nothing to update
        return
    flat = all(a is None or a.flags.c_contiguous for a in arrays)
    size = min(_CHUNK, n) if flat else n
    if scratch is None or scratch[0].size < size:
        scratch = [np.empty(size, dtype) for _ in range(2)]
    if not flat:
        yield list(arrays) + [b[:n].reshape(first.shape) for b in scratch]
        return
    flats = [None if a is None else a.reshape(-1) for a in arrays]
    for i in range(0, n, size):
        j = min(i + size, n)
        yield [None if f is None else f[i:j] for f in flats] + [b[:j - i] for b in scratch]


def _effective_grad(xp, g, p, gs, s, maximize: bool, weight_decay: float):
    """``(-g if maximize else g) + weight_decay * p`` in the state dtype (PyTorch's order).

    Returns ``g`` itself when nothing changes; otherwise writes into ``gs`` (``s`` is
    clobbered as scratch).
    """
    if not maximize and not weight_decay and g.dtype == gs.dtype:
        return g
    if maximize:
        xp.negative(g, out=gs)
    else:
        gs[...] = g
    if weight_decay:
        xp.multiply(p, weight_decay, out=s)
        gs += s
    return gs


def _adam_numpy(p, g, m, v, vmax, c, maximize, scratch) -> None:
    decay, l2, b1, omb1, b2, omb2, step_size, bc2, eps = c
    for pp, gg, mm, vv, vm, s, gs in _pieces([p, g, m, v, vmax], scratch, m.dtype):
        if decay != 1.0:
            pp *= decay
        gg = _effective_grad(np, gg, pp, gs, s, maximize, l2)
        np.multiply(gg, omb1, out=s)
        mm *= b1
        mm += s
        np.multiply(gg, gg, out=s)
        s *= omb2
        vv *= b2
        vv += s
        if vm is not None:
            np.maximum(vm, vv, out=vm)
        np.sqrt(vv if vm is None else vm, out=s)
        s /= bc2
        s += eps
        np.divide(mm, s, out=s)
        s *= step_size
        pp -= s


# -- gradient norm and clip ------------------------------------------------------------------------------------------
_cupy.define("axonmpi_clip_scale", "elementwise", in_params="raw float64 coef", out_params="T g", body="""
    typedef typename acc_t<T>::type A;
    double c = coef[0]; c = (c != c || c < 1.0) ? c : 1.0;
    g = (T)((A)g * (A)c);""")


def grad_norm_partial(grads, p: float, xp=None):
    """``sum(|g|^p)`` over every element of ``grads`` (``max |g|`` for ``p = inf``) as a 0-d float64 array on the
    gradients' device (``xp``'s when ``grads`` is empty): 16-bit gradients summed in float32, each gradient one pass
    (``vdot`` for p = 2)."""
    if not grads:
        return (xp or np).zeros((), np.float64)
    xp = get_array_module(grads[0])
    if p == 2.0 and all(type(g) is np.ndarray and g.dtype.char in "fd" for g in grads):
        # the host's common case: each gradient's vdot as a Python float (exact in float64), summed as below
        parts = [float(np.vdot(f, f)) for f in (g.reshape(-1) for g in grads)]
        return np.array(parts, np.float64).sum().reshape(())
    parts = []
    for g in grads:
        if g.dtype.itemsize < 4 and g.dtype.kind == "f":
            g = g.astype(np.float32)  # 16-bit sums overflow and lose precision
        if p == math.inf:
            part = xp.abs(g).max() if g.size else xp.zeros((), g.dtype)
        elif p == 2.0:
            flat = g.reshape(-1)
            part = xp.vdot(flat, flat)  # one pass, no temporaries
        elif p == 1.0:
            part = xp.abs(g).sum()
        else:
            part = (xp.abs(g) ** p).sum()
        parts.append(xp.asarray(part, dtype=np.float64))
    stacked = xp.stack(parts)
    return stacked.max() if p == math.inf else stacked.sum()


def clip_by_total_norm_(grads, total, max_norm: float):
    """Scale every gradient in place by ``min(max_norm / (total + 1e-6), 1)`` (``total`` a 0-d array: no host
    read; a NaN total makes the gradients NaN, as torch's). Returns the factor as a 0-d float64 array.

    The factor is rounded to each gradient's dtype before the product (as a Python float factor would be), so
    the results equal :func:`axonmpi.optim.clip_grad_norm_`'s bit for bit."""
    xp = get_array_module(total)
    coef = max_norm / (total + 1e-6)
    if xp is np:
        coef = np.where(coef >= 1.0, 1.0, coef)     # NaN stays NaN
        for g in grads:
            g *= coef.astype(g.dtype)
        return coef
    coef = xp.asarray(coef, dtype=np.float64).reshape(1)
    for g in grads:
        _cupy.kernel("axonmpi_clip_scale")(coef, g)
    return xp.where(coef[0] >= 1.0, 1.0, coef[0])
