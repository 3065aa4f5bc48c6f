"""numba loop of the Adam / AdamW update (flat contiguous arrays; see optim.py), without fast math: bit for bit the
values of the NumPy form (the same IEEE operations in the same order, scalars rounded to the array's dtype)."""
from __future__ import annotations

import numpy as np

from llvmlite import ir
from numba import carray, types
from numba.extending import intrinsic

from ._nb import jit_exact

__all__ = ["adam_step", "adam_step_multi", "adamw_plain", "adamw_plain_multi", "f32_to_bf16_bits", "f32_to_f16_bits"]


@intrinsic
def _f32_bits(typingctx, x):
    """A float32's bits as an int32 (LLVM ``bitcast``)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.int32(types.float32), codegen


@jit_exact
def f32_to_bf16_bits(x):
    """The bits of a float32 rounded to bfloat16 (nearest, ties to even; NaN kept quiet), as ml_dtypes rounds."""
    u = np.uint32(_f32_bits(x))
    if (u & np.uint32(0x7F800000)) == np.uint32(0x7F800000) and (u & np.uint32(0x007FFFFF)) != 0:
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
    u = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return np.uint16(u >> np.uint32(16))


@jit_exact
def f32_to_f16_bits(x):
    """The bits of a float32 rounded to float16 (nearest, ties to even; NumPy's ``npy_floatbits_to_halfbits``)."""
    f = np.uint32(_f32_bits(x))
    h_sgn = np.uint32((f & np.uint32(0x80000000)) >> np.uint32(16))
    f_exp = f & np.uint32(0x7F800000)
    if f_exp >= np.uint32(0x47800000):                     # overflow, inf, NaN
        if f_exp == np.uint32(0x7F800000) and (f & np.uint32(0x007FFFFF)) != 0:
            r = np.uint32(0x7C00) + ((f & np.uint32(0x007FFFFF)) >> np.uint32(13))
            if r == np.uint32(0x7C00):
                r += np.uint32(1)
            return np.uint16(h_sgn + r)
        return np.uint16(h_sgn + np.uint32(0x7C00))
    if f_exp <= np.uint32(0x38000000):                     # half subnormals and zero
        if f_exp < np.uint32(0x33000000):
            return np.uint16(h_sgn)
        e = f_exp >> np.uint32(23)
        sig = np.uint32(0x00800000) + (f & np.uint32(0x007FFFFF))
        sig = sig >> (np.uint32(113) - e)
        if (sig & np.uint32(0x3FFF)) != np.uint32(0x1000) or (f & np.uint32(0x7FF)) != 0:
            sig += np.uint32(0x1000)
        return np.uint16(h_sgn + (sig >> np.uint32(13)))
    h_exp = (f_exp - np.uint32(0x38000000)) >> np.uint32(13)
    sig = f & np.uint32(0x007FFFFF)
    if (sig & np.uint32(0x3FFF)) != np.uint32(0x1000):
        sig += np.uint32(0x1000)
    return np.uint16(h_sgn + h_exp + (sig >> np.uint32(13)))


@jit_exact
def adamw_plain(p, g, m, v, decay, b1, omb1, b2, omb2, step_size, bc2, eps, sgn):
    """The common case without a branch in the loop (so that it vectorizes): no L2 term, no AMSGrad, no low copy;
    ``sgn`` is -1 (maximize: ``-g`` exactly) or 1."""
    for i in range(p.size):
        pi = p[i] * decay
        ge = g[i] * sgn
        mi = m[i] * b1 + ge * omb1
        vi = v[i] * b2 + (ge * ge) * omb2
        m[i] = mi
        v[i] = vi
        p[i] = pi - (mi / (np.sqrt(vi) / bc2 + eps)) * step_size


@jit_exact
def adam_step(p, g, m, v, vm, low, decay, l2, b1, omb1, b2, omb2, step_size, bc2, eps, neg, ams, low_kind):
    """``p, m, v`` (and ``vm`` with AMSGrad) updated in place; ``low`` (uint16 bits) set to the new float32 ``p``
    rounded to float16 (``low_kind`` 1) or bfloat16 (2); ``low_kind`` 0: no copy."""
    for i in range(p.size):
        pi = p[i] * decay
        ge = -g[i] if neg else g[i]
        if l2 != 0:
            ge = ge + pi * l2
        mi = m[i] * b1 + ge * omb1
        vi = v[i] * b2 + (ge * ge) * omb2
        m[i] = mi
        v[i] = vi
        if ams:
            a = vm[i]
            if a != a or vi != vi:
                a = a + vi
            elif vi > a:
                a = vi
            vm[i] = a
            vi = a
        den = np.sqrt(vi) / bc2 + eps
        pi = pi - (mi / den) * step_size
        p[i] = pi
        if low_kind == 1:
            low[i] = f32_to_f16_bits(pi)
        elif low_kind == 2:
            low[i] = f32_to_bf16_bits(pi)


@intrinsic
def _ptr_like(typingctx, addr, like):
    """The address ``addr`` (an int64) as a pointer to ``like``'s element type (LLVM ``inttoptr``)."""
    sig = types.CPointer(like.dtype)(addr, like)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))
    return sig, codegen


@intrinsic
def _u16_ptr(typingctx, addr):
    """The address ``addr`` (an int64) as a ``uint16*``."""
    sig = types.CPointer(types.uint16)(addr)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))
    return sig, codegen


@jit_exact
def adamw_plain_multi(addr, sizes, like, decay, b1, omb1, b2, omb2, step_size, bc2, eps, sgn):
    """:func:`adamw_plain` over many parameters in one call: ``addr`` (4, n) int64 holds the addresses of each
    parameter's ``p, g, m, v`` (contiguous, ``like``'s dtype), ``sizes`` (n,) their element counts."""
    for j in range(sizes.size):
        n = sizes[j]
        adamw_plain(carray(_ptr_like(addr[0, j], like), n), carray(_ptr_like(addr[1, j], like), n),
                    carray(_ptr_like(addr[2, j], like), n), carray(_ptr_like(addr[3, j], like), n),
                    decay, b1, omb1, b2, omb2, step_size, bc2, eps, sgn)


@jit_exact
def adam_step_multi(addr, sizes, like, decay, l2, b1, omb1, b2, omb2, step_size, bc2, eps, neg, ams, low_kind):
    """:func:`adam_step` over many parameters in one call: ``addr`` (6, n) int64 holds the addresses of each
    parameter's ``p, g, m, v, vm, low`` (``vm`` read only with ``ams``, ``low`` (uint16 bits) only with
    ``low_kind`` > 0), ``sizes`` (n,) their element counts."""
    for j in range(sizes.size):
        n = sizes[j]
        nv = n if ams else 1
        nl = n if low_kind > 0 else 1
        adam_step(carray(_ptr_like(addr[0, j], like), n), carray(_ptr_like(addr[1, j], like), n),
                  carray(_ptr_like(addr[2, j], like), n), carray(_ptr_like(addr[3, j], like), n),
                  carray(_ptr_like(addr[4, j], like), nv), carray(_u16_ptr(addr[5, j]), nl),
                  decay, l2, b1, omb1, b2, omb2, step_size, bc2, eps, neg, ams, low_kind)
