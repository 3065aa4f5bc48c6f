"""Fused ops of the Llama block: RMS normalization, rotary position embedding and the SwiGLU gate."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np

from ..backend import get_array_module
from .function import Function
from .. import kernels as K
from .tensor import Tensor

__all__ = ["apply_rotary_emb", "rms_norm", "swiglu"]


# -- RMS norm ------------------------------------------------------------------------------
class RMSNorm(Function):
    """``x / sqrt(mean(x**2) + eps) * weight`` over the trailing ``ndims`` axes (no centring, no bias)."""

    _fresh_grads = True

    @staticmethod
    def forward(ctx, x, weight, ndims, eps):
        xp = get_array_module(x)
        axes = tuple(range(x.ndim - ndims, x.ndim))
        ctx.axes = axes
        m = int(np.prod(x.shape[x.ndim - ndims:]))
        if x.dtype.kind == "f" and x.dtype.itemsize >= 4 and m and x.size and (weight is None or
                                                                                weight.dtype == x.dtype):
            out, ctx.state = K.rms_norm_forward(x.reshape(-1, m), weight, eps)
            return out.reshape(x.shape)
        ctx.state = None
        rstd = (x * x).mean(axis=axes, keepdims=True)
        rstd += eps
        rstd = 1.0 / xp.sqrt(rstd, out=rstd)
        xhat = x * rstd
        n = ctx.needs_input_grad
        ctx.save_for_backward(xhat, rstd, weight if n[0] else None)
        return xhat * weight if weight is not None else xhat.copy()

    @staticmethod
    def backward(ctx, g):
        n = ctx.needs_input_grad
        if ctx.state is not None:
            wshape = g.shape[g.ndim - len(ctx.axes):]
            m = int(np.prod(wshape))
            gx, gw = K.rms_norm_backward(g.reshape(-1, m), ctx.state, n[0], n[1])
            return (None if gx is None else gx.reshape(g.shape), None if gw is None else gw.reshape(wshape),
                    None, None)
        xhat, rstd, weight = ctx.saved_tensors
        lead = tuple(range(g.ndim - len(ctx.axes)))
        gw = (g * xhat).sum(axis=lead) if n[1] else None
        gx = None
        if n[0]:
            # d/dx of x * rstd(x): rstd * (gh - xhat * mean(gh * xhat))
            gh = g * weight if weight is not None else g.copy()
            m = (gh * xhat).mean(axis=ctx.axes, keepdims=True)
            gh -= xhat * m
            gh *= rstd
            gx = gh
        return gx, gw, None, None


def rms_norm(input, normalized_shape: Union[int, Sequence[int]], weight=None,  # noqa: A002
             eps: Optional[float] = None) -> Tensor:
    """PyTorch's ``F.rms_norm``: ``input / sqrt(mean(input**2) + eps) * weight`` over the trailing
    ``normalized_shape`` axes; ``eps=None`` is the machine epsilon of ``input``'s dtype (torch's default).

    Example:
        >>> rms_norm(Tensor([[3.0, 4.0]]), 2, eps=0.0).tolist()      # [3, 4] / sqrt(12.5)
        [[0.8485..., 1.1313...]]
    """
    shape = (int(normalized_shape),) if isinstance(normalized_shape, (int, np.integer)) else tuple(normalized_shape)
    x_shape = tuple(input.shape)
    if len(shape) > len(x_shape) or x_shape[len(x_shape) - len(shape):] != shape:
        raise ValueError(f"rms_norm: normalized_shape={shape} must be the trailing dimensions of the input's shape "
                         f"{x_shape}")
    if weight is not None and tuple(weight.shape) != shape:
        raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}, expected normalized_shape={shape}")
    if eps is None:
        eps = float(np.finfo(np.dtype(input.dtype)).eps)
    return RMSNorm.apply(input, weight, len(shape), float(eps))


# -- rotary position embedding ---------------------------------------------------------------
class Rotary(Function):
    """``x * cos + rotate_half(x) * sin`` with ``rotate_half([x1, x2]) = [-x2, x1]`` over the last axis
    (the half-split layout of transformers' Llama); ``cos`` and ``sin`` are constants."""

    _fresh_grads = True

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return K.rotary_forward(x, cos, sin)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return K.rotary_backward(g, cos, sin), None, None


def apply_rotary_emb(x, cos, sin) -> Tensor:
    """Rotary position embedding of ``x`` (..., head_dim) by the tables ``cos``, ``sin`` (arrays or
    Tensors, not differentiated) that broadcast to ``x``'s shape: ``x * cos + rotate_half(x) * sin``,
    ``rotate_half`` swapping the two halves of the last axis with a sign (transformers' Llama layout:
    dimension ``i`` pairs with ``i + head_dim / 2``). :class:`~axonmpi.nn.RotaryEmbedding` makes the
    tables from each token's position.

    Example:
        >>> cos, sin = nn.RotaryEmbedding(8)(np.arange(4))        # (4, 8) each
        >>> q = apply_rotary_emb(q, cos[:, None, :], sin[:, None, :])   # q: (B, T=4, heads, 8)
    """
    c = cos.data if isinstance(cos, Tensor) else cos
    s = sin.data if isinstance(sin, Tensor) else sin
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"apply_rotary_emb: the last dimension (head_dim) must be even, got {d} (shape {tuple(x.shape)})")
    if tuple(c.shape) != tuple(s.shape):
        raise ValueError(f"apply_rotary_emb: cos has shape {tuple(c.shape)} and sin {tuple(s.shape)}; they must match")
    try:
        out_shape = np.broadcast_shapes(tuple(x.shape), tuple(c.shape))
    except ValueError:
        out_shape = None
    if out_shape != tuple(x.shape):
        raise ValueError(f"apply_rotary_emb: the tables' shape {tuple(c.shape)} must broadcast to x's shape "
                         f"{tuple(x.shape)} (e.g. cos[:, None, :] for x of (batch, time, heads, head_dim))")
    xp = get_array_module(x.data if isinstance(x, Tensor) else x)
    if get_array_module(c) is not xp:           # host tables for a device input: moved once, here
        c, s = xp.asarray(c), xp.asarray(s)
    if c.dtype != x.dtype:
        c, s = c.astype(x.dtype), s.astype(x.dtype)
    return Rotary.apply(x, c, s)


# -- SwiGLU gate -----------------------------------------------------------------------------
class SwiGLU(Function):
    """``silu(gate) * up`` (the gated unit of a SwiGLU MLP), one pass each way."""

    _fresh_grads = True

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return K.swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx, g):
        gate, up = ctx.saved_tensors
        n = ctx.needs_input_grad
        return K.swiglu_backward(gate, up, g, n[0], n[1])


def swiglu(gate, up) -> Tensor:
    """``silu(gate) * up``: the gate of a SwiGLU MLP (``down(silu(gate(x)) * up(x))``, transformers'
    ``LlamaMLP``), fused: one output array, ``gate``/``up`` kept for backward.

    Example:
        >>> swiglu(Tensor([0.0, 1.0]), Tensor([2.0, 2.0])).tolist()      # silu(1) * 2 = 2 / (1 + e^-1)
        [0.0, 1.4621...]
    """
    if tuple(gate.shape) != tuple(up.shape):
        raise ValueError(f"swiglu: gate has shape {tuple(gate.shape)} and up {tuple(up.shape)}; they must match")
    return SwiGLU.apply(gate, up)
