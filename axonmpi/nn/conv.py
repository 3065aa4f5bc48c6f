"""2-D convolution and max pooling (PyTorch's ``nn.Conv2d``, ``nn.MaxPool2d``, ``F.conv2d``, ``F.max_pool2d``),
the layers of PyTorch's FSDP tutorial's MNIST net, on NumPy or CuPy.

A convolution is one GEMM over strided windows of the padded input (no copy of the windows in the
forward; ``tensordot`` gathers them); its backward adds each kernel tap's contribution back to the
input. ``dilation`` and ``groups`` other than 1 raise ``NotImplementedError``.
"""
from __future__ import annotations

import math
from typing import Tuple, Union

import numpy as np

from ..autograd.function import Function
from ..autograd.ops_nn import DtypeMismatchError, dtype_mismatch, dtype_refused
from ..autograd.tensor import Tensor
from ..backend import get_array_module
from . import init
from .layers import _param, _to_device
from .module import Module

__all__ = ["Conv2d", "MaxPool2d", "conv2d", "max_pool2d"]

_Pair = Union[int, Tuple[int, int]]


def _pair(v, what: str) -> Tuple[int, int]:
    a, b = (v, v) if isinstance(v, (int, np.integer)) else tuple(v)
    if int(a) != a or int(b) != b or a < 0 or b < 0:
        raise ValueError(f"{what} must be a non-negative int or a pair of them, got {v!r}")
    return int(a), int(b)


def _windows(xp, xpad, kh, kw, sh, sw):
    """(N, C, Ho, Wo, kh, kw) strided view of the padded input (no copy)."""
    n, c, h, w = xpad.shape
    ho, wo = (h - kh) // sh + 1, (w - kw) // sw + 1
    s = xpad.strides
    return xp.lib.stride_tricks.as_strided(xpad, (n, c, ho, wo, kh, kw),
                                           (s[0], s[1], s[2] * sh, s[3] * sw, s[2], s[3]))


def _pad(xp, x, ph, pw, value=0.0):
    if not ph and not pw:
        return xp.ascontiguousarray(x)
    return xp.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=value)


class Conv2dFn(Function):
    """``y[n, o] = b[o] + sum_c,i,j w[o, c, i, j] * xpad[n, c, s*h + i, s*w + j]``."""

    _fresh_grads = True

    @staticmethod
    def forward(ctx, x, w, b, stride, padding):
        xp = get_array_module(x)
        (sh, sw), (ph, pw) = stride, padding
        kh, kw = w.shape[2:]
        xpad = _pad(xp, x, ph, pw)
        win = _windows(xp, xpad, kh, kw, sh, sw)
        y = xp.tensordot(win, w, axes=([1, 4, 5], [1, 2, 3]))          # (N, Ho, Wo, O)
        if b is not None:
            y += b
        ctx.save_for_backward(xpad, w)
        ctx.geom = (x.shape, stride, padding)
        return xp.ascontiguousarray(y.transpose(0, 3, 1, 2))

    @staticmethod
    def backward(ctx, g):
        xpad, w = ctx.saved_tensors
        xshape, (sh, sw), (ph, pw) = ctx.geom
        xp = get_array_module(g)
        kh, kw = w.shape[2:]
        n_in = ctx.needs_input_grad
        ho, wo = g.shape[2], g.shape[3]
        gx = gw = gb = None
        if n_in[1]:
            win = _windows(xp, xpad, kh, kw, sh, sw)
            gw = xp.tensordot(g, win, axes=([0, 2, 3], [0, 2, 3]))       # (O, C, kh, kw)
        if n_in[2]:
            gb = g.sum(axis=(0, 2, 3))
        if n_in[0]:
            gpad = xp.zeros(xpad.shape, dtype=g.dtype)
            for i in range(kh):
                for j in range(kw):
                    part = xp.tensordot(g, w[:, :, i, j], axes=([1], [0]))   # (N, Ho, Wo, C)
                    gpad[:, :, i:i + sh * (ho - 1) + 1:sh, j:j + sw * (wo - 1) + 1:sw] += part.transpose(0, 3, 1, 2)
            gx = gpad[:, :, ph:ph + xshape[2], pw:pw + xshape[3]]
        return gx, gw, gb, None, None


class MaxPool2dFn(Function):
    """The largest element of each window (the first one on ties, as torch); the gradient goes to it."""

    _fresh_grads = True

    @staticmethod
    def forward(ctx, x, kernel, stride, padding):
        xp = get_array_module(x)
        (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
        xpad = _pad(xp, x, ph, pw, value=-np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min)
        win = _windows(xp, xpad, kh, kw, sh, sw)
        n, c, ho, wo = win.shape[:4]
        flat = win.reshape(n, c, ho, wo, kh * kw)
        idx = flat.argmax(axis=-1)
        ctx.save_for_backward(idx)
        ctx.geom = (x.shape, xpad.shape, kernel, stride, padding)
        return xp.take_along_axis(flat, idx[..., None], axis=-1)[..., 0]

    @staticmethod
    def backward(ctx, g):
        (idx,) = ctx.saved_tensors
        xshape, pshape, (kh, kw), (sh, sw), (ph, pw) = ctx.geom
        xp = get_array_module(g)
        ho, wo = g.shape[2], g.shape[3]
        gpad = xp.zeros(pshape, dtype=g.dtype)
        for i in range(kh):
            for j in range(kw):
                gpad[:, :, i:i + sh * (ho - 1) + 1:sh, j:j + sw * (wo - 1) + 1:sw] += g * (idx == i * kw + j)
        return gpad[:, :, ph:ph + xshape[2], pw:pw + xshape[3]], None, None, None


def _check_input(x: Tensor, what: str) -> None:
    if x.ndim != 4:
        raise ValueError(f"{what} takes (N, C, H, W) input, got shape {tuple(x.shape)}; add a batch dim with "
                         "x.unsqueeze(0)")


def conv2d(input: Tensor, weight: Tensor, bias=None, stride: _Pair = 1, padding: _Pair = 0,  # noqa: A002
           dilation: _Pair = 1, groups: int = 1) -> Tensor:
    """PyTorch's ``F.conv2d`` (``dilation=1``, ``groups=1``); ``input`` (N, C, H, W), ``weight`` (O, C, kh, kw).

    Example:
        >>> conv2d(axonmpi.ones(1, 1, 3, 3), axonmpi.ones(1, 1, 2, 2)).tolist()
        [[[[4.0, 4.0], [4.0, 4.0]]]]
    """
    if _pair(dilation, "dilation") != (1, 1) or groups != 1:
        raise NotImplementedError(f"conv2d: dilation={dilation!r}, groups={groups!r}: only 1 and 1 are implemented")
    _check_input(input, "conv2d")
    if dtype_refused(input.dtype, weight.dtype):
        raise DtypeMismatchError(dtype_mismatch("conv2d", input, weight))
    if input.shape[1] != weight.shape[1]:
        raise ValueError(f"conv2d: input has {input.shape[1]} channels, the weight expects {weight.shape[1]}")
    return Conv2dFn.apply(input, weight, bias, _pair(stride, "stride"), _pair(padding, "padding"))


def max_pool2d(input: Tensor, kernel_size: _Pair, stride=None, padding: _Pair = 0, dilation: _Pair = 1,  # noqa: A002
               ceil_mode: bool = False, return_indices: bool = False) -> Tensor:
    """PyTorch's ``F.max_pool2d`` (``stride`` defaults to ``kernel_size``; ``dilation=1``, no ``ceil_mode``)."""
    if _pair(dilation, "dilation") != (1, 1) or ceil_mode or return_indices:
        raise NotImplementedError("max_pool2d: dilation, ceil_mode and return_indices are not implemented")
    _check_input(input, "max_pool2d")
    k = _pair(kernel_size, "kernel_size")
    s = k if stride is None else _pair(stride, "stride")
    p = _pair(padding, "padding")
    if p[0] > k[0] // 2 or p[1] > k[1] // 2:
        raise ValueError(f"max_pool2d: padding {p} must be at most half the kernel {k}, as torch requires")
    return MaxPool2dFn.apply(input, k, s, p)


class Conv2d(Module):
    """``nn.Conv2d(in_channels, out_channels, kernel_size, stride=1, padding=0, bias=True)`` (PyTorch's init:
    weight kaiming_uniform(a=sqrt(5)), bias U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = in * kh * kw).

    Example:
        >>> conv = Conv2d(1, 32, 3, 1)
        >>> conv(axonmpi.randn(8, 1, 28, 28)).shape
        (8, 32, 26, 26)
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: _Pair, stride: _Pair = 1,
                 padding: _Pair = 0, dilation: _Pair = 1, groups: int = 1, bias: bool = True,
                 padding_mode: str = "zeros", dtype=None, device=None):
        super().__init__()
        if padding_mode != "zeros" or _pair(dilation, "dilation") != (1, 1) or groups != 1:
            raise NotImplementedError("Conv2d: only padding_mode='zeros', dilation=1 and groups=1 are implemented")
        self.in_channels, self.out_channels = int(in_channels), int(out_channels)
        self.kernel_size = _pair(kernel_size, "kernel_size")
        self.stride, self.padding = _pair(stride, "stride"), _pair(padding, "padding")
        self.weight = _param((self.out_channels, self.in_channels) + self.kernel_size, dtype, device)
        self.bias = _param((self.out_channels,), dtype, device) if bias else None
        if not bias:
            self.register_parameter("bias", None)
        self.reset_parameters()
        _to_device(self, device)

    def reset_parameters(self) -> None:
        """Re-draw the parameters with PyTorch's default initialization."""
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = self.in_channels * self.kernel_size[0] * self.kernel_size[1]
            bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
            init.uniform_(self.bias, -bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        if dtype_refused(x.dtype, self.weight.dtype):
            raise DtypeMismatchError(dtype_mismatch(self, x, self.weight))
        return conv2d(x, self.weight, self.bias, self.stride, self.padding)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}"
                + (f", padding={self.padding}" if self.padding != (0, 0) else "")
                + ("" if self.bias is not None else ", bias=False"))


class MaxPool2d(Module):
    """``nn.MaxPool2d(kernel_size, stride=None, padding=0)``: :func:`max_pool2d` as a module."""

    def __init__(self, kernel_size: _Pair, stride=None, padding: _Pair = 0, dilation: _Pair = 1,
                 return_indices: bool = False, ceil_mode: bool = False):
        super().__init__()
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding
        self.dilation, self.return_indices, self.ceil_mode = dilation, return_indices, ceil_mode

    def forward(self, x: Tensor) -> Tensor:
        return max_pool2d(x, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode,
                          self.return_indices)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride or self.kernel_size}, padding={self.padding}"
