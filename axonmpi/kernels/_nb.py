"""numba building blocks (imported only on the numba path): the jit flags, float32 exp/erf/tanh that vectorize.

[Note: vectorized float32 math] numba calls the C library for ``math.exp``/``math.erf`` one element at a time
(no SVML in the registry's llvmlite), 4-30x slower than a SIMD loop. The float32 forms here are branch-free
polynomials (Cephes ``expf`` with the exponent written through a bit cast; N. Juffa's ``erff``, 1.3 ulp;
Cephes ``tanhf``) that LLVM turns into AVX2 loops; float64 keeps ``math.exp``/``math.erf``/``math.tanh`` (the
C library's, correctly rounded to ~1 ulp: the float64 parity tests compare against torch at 1e-10 and tighter).

numba's on-disk cache (``cache=True``, in ``__pycache__``) is keyed on the file of each kernel, not on the
helpers here: after editing this file, delete ``axonmpi/kernels/__pycache__`` (stale kernels keep the old helpers).
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

__all__ = ["FASTMATH", "jit", "jit_exact", "jit_reduce", "fexp", "ferf", "ftanh", "fsigmoid", "rmax", "rsum", "rdot"]

# no "reassoc" (it would fold the round-to-nearest trick (v + 1.5*2**23) - 1.5*2**23 away), no "nnan"/"ninf":
# NaN and inf propagate as in torch (GradScaler finds overflowed gradients by them)
FASTMATH = frozenset({"nsz", "arcp", "contract", "afn"})


def jit(fn):
    """``numba.njit`` with the flags every kernel uses: cached on disk, compiled on first call, fast math, NumPy's
    error model (a float division by zero gives inf, no Python check: the check would stop the loop vectorizing)."""
    return njit(cache=True, fastmath=set(FASTMATH), nogil=True, error_model="numpy")(fn)


def jit_exact(fn):
    """:func:`jit` without fast math: IEEE rounding of every operation in source order (no FMA contraction, no
    reciprocal for a division), so that a loop gives bit for bit what the NumPy ufuncs it replaces give (dropout,
    the optimizers' updates)."""
    return njit(cache=True, nogil=True, error_model="numpy")(fn)


def jit_reduce(fn):
    """:func:`jit` plus ``reassoc``, so that sums vectorize: for kernels without the float32 exp's rounding trick."""
    return njit(cache=True, fastmath=set(FASTMATH | {"reassoc"}), nogil=True, error_model="numpy")(fn)


@njit(cache=True, fastmath=set(FASTMATH | {"reassoc", "nnan"}), nogil=True, error_model="numpy")
def rmax(a):
    """Maximum of a 1-D array, vectorized (a NaN may be skipped: callers' exp(x - max) turns it to NaN anyway)."""
    m = a[0]
    for i in range(1, a.size):
        m = a[i] if a[i] > m else m
    return m


@njit(cache=True, fastmath=set(FASTMATH | {"reassoc"}), nogil=True, error_model="numpy")
def rsum(a):
    """Sum of a 1-D array, vectorized (partial sums in the array's dtype, as torch's CPU kernels)."""
    s = a.dtype.type(0)
    for i in range(a.size):
        s += a[i]
    return s


@njit(cache=True, fastmath=set(FASTMATH | {"reassoc"}), nogil=True, error_model="numpy")
def rdot(a, b):
    """``sum(a * b)`` of two 1-D arrays, vectorized."""
    s = a.dtype.type(0)
    for i in range(a.size):
        s += a[i] * b[i]
    return s


@intrinsic
def _bits_to_f32(typingctx, x):
    """Reinterpret an int32's bits as a float32 (LLVM ``bitcast``; vectorizes)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


def fexp(v):
    """``exp(v)`` for a float32 or float64 scalar inside a numba kernel."""
    return math.exp(v)


def ferf(v):
    """``erf(v)`` for a float32 or float64 scalar inside a numba kernel."""
    return math.erf(v)


def ftanh(v):
    """``tanh(v)`` for a float32 or float64 scalar inside a numba kernel."""
    return math.tanh(v)


def fsigmoid(v):
    """``1 / (1 + exp(-v))`` for a float32 or float64 scalar inside a numba kernel (overflow-free)."""
    return 1.0 / (1.0 + math.exp(-v))


_F = np.float32


@njit(fastmath=set(FASTMATH), inline="always", error_model="numpy")
def _exp32(v):
    v = _F(-103.97) if v < _F(-103.97) else v    # below: 0 (gradual underflow through the denormals above)
    v = _F(88.7228) if v > _F(88.7228) else v     # exp(88.7228) ~ 3.4e38, the largest finite float32
    k = (v * _F(1.4426950408889634) + _F(12582912.0)) - _F(12582912.0)   # round(v / ln 2)
    r = v - k * _F(0.693359375)
    r = r - k * _F(-2.12194440e-4)
    p = _F(1.9875691500e-4)
    p = p * r + _F(1.3981999507e-3)
    p = p * r + _F(8.3334519073e-3)
    p = p * r + _F(4.1665795894e-2)
    p = p * r + _F(1.6666665459e-1)
    p = p * r + _F(5.0000001201e-1)
    p = p * r * r + r + _F(1.0)
    ki = np.int32(k)
    k1 = ki >> np.int32(1)                      # 2**k as two normal factors: k in [-150, 128]
    k2 = ki - k1
    p = p * _bits_to_f32((k1 + np.int32(127)) << np.int32(23))
    return p * _bits_to_f32((k2 + np.int32(127)) << np.int32(23))


@njit(fastmath=set(FASTMATH), inline="always", error_model="numpy")
def _exp32_full(v):
    e = _exp32(v)
    e = _F(np.inf) if v > _F(88.7228) else e
    return _F(0.0) if v < _F(-103.97) else e


@njit(fastmath=set(FASTMATH), inline="always", error_model="numpy")
def _erf32(a):
    t = abs(a)
    s = a * a
    r = _F(-1.72853470e-5) * t + _F(3.83197126e-4)
    u = _F(-3.88396438e-3) * t + _F(2.42546219e-2)
    r = r * s + u
    r = r * t + _F(-1.06777877e-1)
    r = r * t + _F(-6.34846687e-1)
    r = r * t + _F(-1.28717512e-1)
    r = r * t - t
    big = _F(1.0) - _exp32(r)
    big = -big if a < _F(0.0) else big
    q = _F(-5.96761703e-4)
    q = q * s + _F(4.99119423e-3)
    q = q * s + _F(-2.67681349e-2)
    q = q * s + _F(1.12819925e-1)
    q = q * s + _F(-3.76125336e-1)
    q = q * s + _F(1.28379166e-1)
    q = q * a + a
    return big if t > _F(0.927734375) else q


@njit(fastmath=set(FASTMATH), inline="always", error_model="numpy")
def _tanh32(x):
    a = abs(x)
    z = x * x
    small = ((((_F(-5.70498872745e-3) * z + _F(2.06390887954e-2)) * z - _F(5.37397155531e-2)) * z
              + _F(1.33314422036e-1)) * z - _F(3.33332819422e-1)) * z * x + x
    big = _F(1.0) - _F(2.0) / (_exp32(a + a) + _F(1.0))
    big = -big if x < _F(0.0) else big
    return small if a < _F(0.625) else big


@njit(fastmath=set(FASTMATH), inline="always", error_model="numpy")
def _sigmoid32(x):
    return _F(1.0) / (_F(1.0) + _exp32_full(-x))     # exactly 0 far left (x sigmoid(x) is -0 there, as torch's)


@njit(fastmath=set(FASTMATH), inline="always", error_model="numpy")
def _sigmoid64(x):
    if x >= 0.0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def _by_dtype(generic, f32, f64):
    @overload(generic, jit_options={"fastmath": set(FASTMATH), "error_model": "numpy"}, inline="always")
    def _ol(v):
        if v == types.float32:
            return lambda v: f32(v)
        if v == types.float64:
            return lambda v: f64(v)
        return None


_by_dtype(fexp, _exp32_full, njit(inline="always")(lambda v: math.exp(v)))
_by_dtype(ferf, _erf32, njit(inline="always")(lambda v: math.erf(v)))
_by_dtype(ftanh, _tanh32, njit(inline="always")(lambda v: math.tanh(v)))
_by_dtype(fsigmoid, _sigmoid32, _sigmoid64)
