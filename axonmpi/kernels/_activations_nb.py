"""numba loops of the elementwise activations (float32/float64, flat contiguous arrays; see activations.py)."""
from __future__ import annotations

from ._nb import ferf, fexp, fsigmoid, ftanh, jit

__all__ = ["gelu_erf_fwd", "gelu_erf_bwd", "gelu_erf_bwd_y", "gelu_tanh_fwd", "gelu_tanh_bwd", "silu_fwd", "silu_bwd", "swiglu_fwd",
           "swiglu_bwd", "relu_fwd", "relu_bwd", "sigmoid_fwd", "sigmoid_bwd", "tanh_fwd", "tanh_bwd", "exp_fwd",
           "mul_bwd"]

_INV_SQRT_2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327
_K2 = 2.0 * 0.7978845608028654            # 2 sqrt(2/pi)
_C = 0.044715


@jit
def gelu_erf_fwd(x, out):
    o = x.dtype.type(1)
    a, h = x.dtype.type(_INV_SQRT_2), x.dtype.type(0.5)
    for i in range(x.size):
        v = x[i]
        out[i] = h * v * (o + ferf(v * a))


@jit
def gelu_erf_bwd(x, g, out):
    o = x.dtype.type(1)
    a, h, c = x.dtype.type(_INV_SQRT_2), x.dtype.type(0.5), x.dtype.type(_INV_SQRT_2PI)
    for i in range(x.size):
        v = x[i]
        out[i] = g[i] * (h * (o + ferf(v * a)) + v * c * fexp(-h * v * v))


@jit
def gelu_erf_bwd_y(x, y, g, out):
    """The exact GELU's gradient from its input and output: Phi(x) = y / x, one exp (no erf) per element."""
    h, c, tiny = x.dtype.type(0.5), x.dtype.type(_INV_SQRT_2PI), x.dtype.type(1e-30)
    for i in range(x.size):
        v = x[i]
        cdf = y[i] / v if abs(v) > tiny else h + v * c
        out[i] = g[i] * (cdf + v * c * fexp(-h * v * v))


@jit
def gelu_tanh_fwd(x, out):
    k2, c = x.dtype.type(_K2), x.dtype.type(_C)
    for i in range(x.size):
        v = x[i]
        out[i] = v * fsigmoid(k2 * (v + c * v * v * v))      # 0.5 x (1 + tanh u) = x sigmoid(2u)


@jit
def gelu_tanh_bwd(x, g, out):
    o = x.dtype.type(1)
    k2, c, c3 = x.dtype.type(_K2), x.dtype.type(_C), x.dtype.type(3 * _C)
    for i in range(x.size):
        v = x[i]
        s = fsigmoid(k2 * (v + c * v * v * v))
        out[i] = g[i] * (s * (o + (o - s) * k2 * v * (o + c3 * v * v)))


@jit
def silu_fwd(x, out):
    for i in range(x.size):
        out[i] = x[i] * fsigmoid(x[i])


@jit
def silu_bwd(x, g, out):
    o = x.dtype.type(1)
    for i in range(x.size):
        v = x[i]
        s = fsigmoid(v)
        out[i] = g[i] * (s * (o + v * (o - s)))


@jit
def swiglu_fwd(gate, up, out):
    for i in range(gate.size):
        out[i] = gate[i] * fsigmoid(gate[i]) * up[i]


@jit
def swiglu_bwd(gate, up, g, ggate, gup):
    o = gate.dtype.type(1)
    for i in range(gate.size):
        v = gate[i]
        s = fsigmoid(v)
        gup[i] = g[i] * v * s
        ggate[i] = g[i] * up[i] * (s * (o + v * (o - s)))


@jit
def relu_fwd(x, out):
    z = x.dtype.type(0)
    for i in range(x.size):
        v = x[i]
        out[i] = z if v < z else v          # NaN stays NaN, as np.maximum and torch.relu


@jit
def relu_bwd(out, g, gx):
    z = g.dtype.type(0)
    for i in range(out.size):
        gx[i] = g[i] if out[i] > z else z


@jit
def sigmoid_fwd(x, out):
    for i in range(x.size):
        out[i] = fsigmoid(x[i])


@jit
def sigmoid_bwd(s, g, gx):
    o = s.dtype.type(1)
    for i in range(s.size):
        gx[i] = g[i] * s[i] * (o - s[i])


@jit
def tanh_fwd(x, out):
    for i in range(x.size):
        out[i] = ftanh(x[i])


@jit
def tanh_bwd(t, g, gx):
    o = t.dtype.type(1)
    for i in range(t.size):
        gx[i] = g[i] * (o - t[i] * t[i])


@jit
def exp_fwd(x, out):
    for i in range(x.size):
        out[i] = fexp(x[i])


@jit
def mul_bwd(a, g, gx):
    for i in range(a.size):
        gx[i] = g[i] * a[i]
