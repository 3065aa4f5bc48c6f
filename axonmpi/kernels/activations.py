"""Elementwise activations, forward and backward side by side: GELU (erf, tanh), SiLU, SwiGLU, ReLU, sigmoid, tanh, exp.

Each op has a NumPy form (ufuncs in place, every dtype), a numba form (one fused loop, float32/float64; see
``_activations_nb.py``) and a CuPy form (one ``ElementwiseKernel``, float math for 16-bit types). The entry
points take and return arrays of the module of their input; nothing above this layer knows which form ran.
"""
from __future__ import annotations

import math

import numpy as np

from ..backend import get_array_module
from . import _cupy
from ._select import use_numba

__all__ = ["gelu_forward", "gelu_backward", "silu_forward", "silu_backward", "swiglu_forward", "swiglu_backward",
           "relu_forward", "relu_backward", "sigmoid_forward", "sigmoid_backward", "tanh_forward", "tanh_backward",
           "exp_forward", "exp_backward", "erf_float32"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _nb():
    from . import _activations_nb
    return _activations_nb


def _flat(a):
    return np.ascontiguousarray(a).reshape(-1)


def _run_nb(fn, shape, dtype, *inputs, n_out: int = 1):
    outs = [np.empty(shape, dtype) for _ in range(n_out)]
    fn(*[_flat(a) for a in inputs], *[o.reshape(-1) for o in outs])
    return outs[0] if n_out == 1 else tuple(outs)


def _inplace_ok(x) -> bool:
    return getattr(x, "dtype", None) is not None and x.dtype.kind == "f" and x.dtype.itemsize >= 4


def _cupy_run(name, *args):
    return _cupy.kernel(name)(*args)


# -- GELU --------------------------------------------------------------------------------------
_cupy.define("axonmpi_gelu_erf_fwd", "elementwise", in_params="T x", out_params="T y", body="""
    typedef typename acc_t<T>::type A; A v = (A)x;
    y = (T)((A)0.5 * v * ((A)1 + erf(v * (A)0.70710678118654752)));""")
_cupy.define("axonmpi_gelu_erf_bwd", "elementwise", in_params="T x, T g", out_params="T gx", body="""
    typedef typename acc_t<T>::type A; A v = (A)x;
    A d = (A)0.5 * ((A)1 + erf(v * (A)0.70710678118654752)) + v * (A)0.39894228040143268 * exp((A)-0.5 * v * v);
    gx = (T)((A)g * d);""")
_cupy.define("axonmpi_gelu_tanh_fwd", "elementwise", in_params="T x", out_params="T y", body="""
    typedef typename acc_t<T>::type A; A v = (A)x;
    A u = (A)1.5957691216057308 * (v + (A)0.044715 * v * v * v);
    y = (T)(v / ((A)1 + exp(-u)));""")
_cupy.define("axonmpi_gelu_tanh_bwd", "elementwise", in_params="T x, T g", out_params="T gx", body="""
    typedef typename acc_t<T>::type A; A v = (A)x;
    A s = (A)1 / ((A)1 + exp((A)-1.5957691216057308 * (v + (A)0.044715 * v * v * v)));
    A d = s * ((A)1 + ((A)1 - s) * (A)1.5957691216057308 * v * ((A)1 + (A)0.134145 * v * v));
    gx = (T)((A)g * d);""")


def _gelu_exp_neg2u(x):
    """``exp(-2 sqrt(2/pi) (x + 0.044715 x^3))`` as one new array (``inf`` far left of 0)."""
    e = np.multiply(x, x)
    e *= -2.0 * 0.044715 * _SQRT_2_OVER_PI
    e -= 2.0 * _SQRT_2_OVER_PI
    e *= x
    with np.errstate(over="ignore"):
        np.exp(e, out=e)
    return e


def erf_float32(x):
    """``erf`` of a float32 NumPy array in float32 (N. Juffa's erff, max error 1.3 ulp), in ~20 in-place passes."""
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):   # the branch not taken may overflow
        return _erf_float32(x)


def _erf_float32(x):
    f = np.float32
    t = np.abs(x)
    s = np.multiply(x, x)
    r = np.multiply(t, f(-1.72853470e-5))
    r += f(3.83197126e-4)
    r *= s
    r += t * f(-3.88396438e-3)
    r += f(2.42546219e-2)
    for c in (-1.06777877e-1, -6.34846687e-1, -1.28717512e-1):
        r *= t
        r += f(c)
    r *= t
    r -= t
    np.exp(r, out=r)
    np.subtract(f(1.0), r, out=r)
    np.copysign(r, x, out=r)
    q = np.multiply(s, f(-5.96761703e-4))
    for c in (4.99119423e-3, -2.67681349e-2, 1.12819925e-1, -3.76125336e-1, 1.28379166e-1):
        q += f(c)
        if c != 1.28379166e-1:
            q *= s
    q *= x
    q += x
    np.copyto(r, q, where=t <= f(0.927734375))
    return r


def _erf_np(x):
    if x.dtype == np.float32:
        return erf_float32(x)
    from ..autograd.special import erf
    return erf(x)


def gelu_forward(x, approximate: str = "none"):
    """GELU of ``x``: exact (``"none"``: ``0.5 x (1 + erf(x / sqrt 2))``) or the ``"tanh"`` approximation."""
    xp = get_array_module(x)
    tanh = approximate == "tanh"
    if xp is not np:
        return _cupy_run("axonmpi_gelu_tanh_fwd" if tanh else "axonmpi_gelu_erf_fwd", x)
    if use_numba(x):
        return _run_nb(_nb().gelu_tanh_fwd if tanh else _nb().gelu_erf_fwd, x.shape, x.dtype, x)
    if tanh:
        if _inplace_ok(x):   # 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u))
            out = _gelu_exp_neg2u(x)
            out += 1.0
            np.divide(x, out, out=out)
            return out
        t = np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x))
        return 0.5 * x * (1 + t)
    if _inplace_ok(x):
        out = _erf_np(x * x.dtype.type(_INV_SQRT_2))
        out += 1.0
        out *= x
        out *= 0.5
        return out
    return 0.5 * x * (1 + _erf_np(x * _INV_SQRT_2))


def gelu_backward(x, g, approximate: str = "none", y=None):
    """Gradient of :func:`gelu_forward` at ``x`` times the output gradient ``g``.

    ``y``, the forward's output (optional): the exact GELU's numba form then takes ``Phi(x) = y / x`` from it
    and evaluates one ``exp`` per element instead of an ``erf`` and an ``exp`` (the next layer usually holds
    ``y`` anyway, so keeping it costs no memory there).
    """
    xp = get_array_module(x)
    tanh = approximate == "tanh"
    if xp is not np:
        return _cupy_run("axonmpi_gelu_tanh_bwd" if tanh else "axonmpi_gelu_erf_bwd", x, g.astype(x.dtype, copy=False))
    if not tanh and y is not None and use_numba(x, g, y):
        return _run_nb(_nb().gelu_erf_bwd_y, x.shape, x.dtype, x, y, g)
    if use_numba(x, g):
        return _run_nb(_nb().gelu_tanh_bwd if tanh else _nb().gelu_erf_bwd, x.shape, x.dtype, x, g)
    if tanh:
        if _inplace_ok(x) and g.dtype == x.dtype:
            # s = 1 / (1 + exp(-2u)), u = k (x + c x^3): d = s (1 + (1 - s) 2 k x (1 + 3 c x^2)), in place
            sg = _gelu_exp_neg2u(x)
            sg += 1.0
            np.divide(1.0, sg, out=sg)
            d = np.multiply(x, x)
            d *= 6.0 * 0.044715 * _SQRT_2_OVER_PI
            d += 2.0 * _SQRT_2_OVER_PI
            d *= x
            d *= np.subtract(1.0, sg)
            d += 1.0
            d *= sg
            d *= g
            return d
        x2 = x * x
        t = np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x2 * x))
        return g * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * (_SQRT_2_OVER_PI * (1 + 3 * 0.044715 * x2)))
    if _inplace_ok(x) and g.dtype == x.dtype:
        if y is not None and y.dtype == x.dtype and y.shape == x.shape:   # Phi(x) = y / x (0.5 where x ~ 0)
            d = np.full(x.shape, 0.5, x.dtype)
            np.divide(y, x, out=d, where=np.abs(x) > 1e-30)
        else:
            d = _erf_np(x * x.dtype.type(_INV_SQRT_2))
            d += 1.0
            d *= 0.5
        e = np.multiply(x, x)
        e *= -0.5
        np.exp(e, out=e)
        e *= x
        e *= _INV_SQRT_2PI
        d += e
        d *= g
        return d
    cdf = 0.5 * (1 + _erf_np(x * _INV_SQRT_2))
    return g * (cdf + x * (_INV_SQRT_2PI * np.exp(-0.5 * x * x)))


# -- sigmoid, SiLU, SwiGLU -------------------------------------------------------------------------
_cupy.define("axonmpi_sigmoid_fwd", "elementwise", in_params="T x", out_params="T y", body="""
    typedef typename acc_t<T>::type A; y = (T)((A)1 / ((A)1 + exp(-(A)x)));""")
_cupy.define("axonmpi_sigmoid_bwd", "elementwise", in_params="T s, T g", out_params="T gx", body="""
    typedef typename acc_t<T>::type A; gx = (T)((A)g * (A)s * ((A)1 - (A)s));""")
_cupy.define("axonmpi_silu_fwd", "elementwise", in_params="T x", out_params="T y", body="""
    typedef typename acc_t<T>::type A; A v = (A)x; y = (T)(v / ((A)1 + exp(-v)));""")
_cupy.define("axonmpi_silu_bwd", "elementwise", in_params="T x, T g", out_params="T gx", body="""
    typedef typename acc_t<T>::type A; A v = (A)x; A s = (A)1 / ((A)1 + exp(-v));
    gx = (T)((A)g * s * ((A)1 + v * ((A)1 - s)));""")
_cupy.define("axonmpi_swiglu_fwd", "elementwise", in_params="T gate, T up", out_params="T y", body="""
    typedef typename acc_t<T>::type A; A v = (A)gate; y = (T)(v / ((A)1 + exp(-v)) * (A)up);""")
_cupy.define("axonmpi_swiglu_bwd", "elementwise", in_params="T gate, T up, T g", out_params="T ggate, T gup",
             body="""
    typedef typename acc_t<T>::type A; A v = (A)gate; A s = (A)1 / ((A)1 + exp(-v));
    gup = (T)((A)g * v * s);
    ggate = (T)((A)g * (A)up * s * ((A)1 + v * ((A)1 - s)));""")


def _sigmoid_np(x):
    # 0.5 * (1 + tanh(x / 2)) is overflow-free and accurate for both signs
    out = np.tanh(x * 0.5)
    out += 1
    out *= 0.5
    return out


def sigmoid_forward(x):
    """``1 / (1 + exp(-x))`` (overflow-free)."""
    xp = get_array_module(x)
    if xp is not np:
        return _cupy_run("axonmpi_sigmoid_fwd", x)
    if use_numba(x):
        return _run_nb(_nb().sigmoid_fwd, x.shape, x.dtype, x)
    return _sigmoid_np(x)


def sigmoid_backward(s, g):
    """``g s (1 - s)`` from the forward's output ``s``."""
    xp = get_array_module(s)
    if xp is not np:
        return _cupy_run("axonmpi_sigmoid_bwd", s, g.astype(s.dtype, copy=False))
    if use_numba(s, g):
        return _run_nb(_nb().sigmoid_bwd, s.shape, s.dtype, s, g)
    return g * s * (1 - s)


def silu_forward(x):
    """``x sigmoid(x)``."""
    xp = get_array_module(x)
    if xp is not np:
        return _cupy_run("axonmpi_silu_fwd", x)
    if use_numba(x):
        return _run_nb(_nb().silu_fwd, x.shape, x.dtype, x)
    out = _sigmoid_np(x)
    out *= x
    return out


def silu_backward(x, g):
    """``g s (1 + x (1 - s))`` with ``s = sigmoid(x)``."""
    xp = get_array_module(x)
    if xp is not np:
        return _cupy_run("axonmpi_silu_bwd", x, g.astype(x.dtype, copy=False))
    if use_numba(x, g):
        return _run_nb(_nb().silu_bwd, x.shape, x.dtype, x, g)
    s = _sigmoid_np(x)
    d = 1 - s
    d *= x
    d += 1
    d *= s
    return g * d


def swiglu_forward(gate, up):
    """``silu(gate) * up`` (same shapes)."""
    xp = get_array_module(gate)
    if xp is not np:
        return _cupy_run("axonmpi_swiglu_fwd", gate, up)
    if use_numba(gate, up):
        return _run_nb(_nb().swiglu_fwd, gate.shape, gate.dtype, gate, up)
    act = gate * _sigmoid_np(gate)
    act *= up
    return act


def swiglu_backward(gate, up, g, need_gate: bool = True, need_up: bool = True):
    """``(d gate, d up)`` of :func:`swiglu_forward` for the output gradient ``g`` (None where not needed)."""
    xp = get_array_module(gate)
    if xp is not np:
        gg, gu = _cupy_run("axonmpi_swiglu_bwd", gate, up, g.astype(gate.dtype, copy=False))
    elif use_numba(gate, up, g):
        gg, gu = _run_nb(_nb().swiglu_bwd, gate.shape, gate.dtype, gate, up, g, n_out=2)
    else:
        s = _sigmoid_np(gate)
        gu = g * (gate * s) if need_up else None
        gg = None
        if need_gate:   # d silu / d gate = s (1 + gate (1 - s))
            gg = 1 - s
            gg *= gate
            gg += 1
            gg *= s
            gg *= up
            gg *= g
    return (gg if need_gate else None), (gu if need_up else None)


# -- ReLU, tanh, exp ---------------------------------------------------------------------------------
_cupy.define("axonmpi_relu_bwd", "elementwise", in_params="T out, T g", out_params="T gx",
             body="gx = out > (T)0 ? g : (T)0;")
_cupy.define("axonmpi_tanh_bwd", "elementwise", in_params="T t, T g", out_params="T gx", body="""
    typedef typename acc_t<T>::type A; gx = (T)((A)g * ((A)1 - (A)t * (A)t));""")


def relu_forward(x):
    """``max(x, 0)`` (NaN stays NaN)."""
    xp = get_array_module(x)
    if use_numba(x):
        return _run_nb(_nb().relu_fwd, x.shape, x.dtype, x)
    return xp.maximum(x, 0)


def relu_backward(out, g):
    """``g`` where the forward's output is positive, else 0 (gradient 0 at 0)."""
    xp = get_array_module(out)
    if xp is not np:
        return _cupy_run("axonmpi_relu_bwd", out, g.astype(out.dtype, copy=False))
    if use_numba(out, g):
        return _run_nb(_nb().relu_bwd, out.shape, out.dtype, out, g)
    return g * (out > 0)


def tanh_forward(x):
    """``tanh(x)``."""
    xp = get_array_module(x)
    if use_numba(x):
        return _run_nb(_nb().tanh_fwd, x.shape, x.dtype, x)
    return xp.tanh(x)


def tanh_backward(t, g):
    """``g (1 - t^2)`` from the forward's output ``t``."""
    xp = get_array_module(t)
    if xp is not np:
        return _cupy_run("axonmpi_tanh_bwd", t, g.astype(t.dtype, copy=False))
    if use_numba(t, g):
        return _run_nb(_nb().tanh_bwd, t.shape, t.dtype, t, g)
    return g * (1 - t * t)


def exp_forward(x):
    """``e**x``."""
    xp = get_array_module(x)
    if use_numba(x):
        return _run_nb(_nb().exp_fwd, x.shape, x.dtype, x)
    return xp.exp(x)


def exp_backward(out, g):
    """``g e**x`` from the forward's output."""
    if use_numba(out, g):
        return _run_nb(_nb().mul_bwd, out.shape, out.dtype, out, g)
    return g * out
