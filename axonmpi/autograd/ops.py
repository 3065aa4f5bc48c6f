"""Core differentiable ops (arithmetic, reductions, shape, indexing) as small ``Function`` classes.

Each op's forward and backward sit side by side; every backward starts from the array module of
its inputs (``xp = get_array_module(...)``).  Public lowercase wrappers take Tensors or scalars.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import numpy as np

from ..backend import as_device, device_of, get_array_module, to_device
from .function import Function
from .tensor import Tensor

__all__ = [
    "abs", "add", "cast", "chunk", "clone", "concat", "div", "exp", "expand", "flatten", "getitem",
    "log", "matmul", "max", "mean", "min", "mul", "neg", "permute", "pow", "rdiv", "reshape",
    "rpow", "rsub", "split", "sqrt", "squeeze", "stack", "sub", "sum", "tanh", "to_device",
    "transpose", "unsqueeze", "var", "where",
]

_builtin_sum, _builtin_max, _builtin_min, _builtin_abs, _builtin_pow = sum, max, min, abs, pow


def _shape(a) -> tuple:
    return tuple(a.shape) if hasattr(a, "shape") else ()


def _unbroadcast(g, shape: tuple):
    """Sum ``g`` over the axes that broadcasting added or stretched to reach ``shape``."""
    if g.shape == shape:
        return g
    lead = g.ndim - len(shape)
    if lead:
        g = g.sum(axis=tuple(range(lead)))
    axes = tuple(i for i, s in enumerate(shape) if s == 1 and g.shape[i] != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return g


def _axes(axis, ndim: int) -> Optional[tuple]:
    if axis is None:
        return None
    if isinstance(axis, int):
        axis = (axis,)
    return tuple(a % ndim for a in axis)


def _keep(g, in_shape: tuple, axes: Optional[tuple], keepdims: bool):
    """Reshape a reduced gradient so it broadcasts against the input (re-insert reduced axes)."""
    if keepdims or g.ndim == len(in_shape):
        return g
    if axes is None:
        return g.reshape((1,) * len(in_shape))
    shape = list(in_shape)
    for a in axes:
        shape[a] = 1
    return g.reshape(shape)


# -- arithmetic ----------------------------------------------------------------------------
class Add(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.sa, ctx.sb = _shape(a), _shape(b)
        return a + b

    @staticmethod
    def backward(ctx, g):
        n = ctx.needs_input_grad
        return (_unbroadcast(g, ctx.sa) if n[0] else None, _unbroadcast(g, ctx.sb) if n[1] else None)


class Sub(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.sa, ctx.sb = _shape(a), _shape(b)
        return a - b

    @staticmethod
    def backward(ctx, g):
        n = ctx.needs_input_grad
        return (_unbroadcast(g, ctx.sa) if n[0] else None, -_unbroadcast(g, ctx.sb) if n[1] else None)


class Mul(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.sa, ctx.sb = _shape(a), _shape(b)
        n = ctx.needs_input_grad
        ctx.save_for_backward(a if n[1] else None, b if n[0] else None)
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        n = ctx.needs_input_grad
        return (_unbroadcast(g * b, ctx.sa) if n[0] else None, _unbroadcast(g * a, ctx.sb) if n[1] else None)


class Div(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.sa, ctx.sb = _shape(a), _shape(b)
        ctx.save_for_backward(a, b)
        return a / b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        n = ctx.needs_input_grad
        ga = g / b
        return (_unbroadcast(ga, ctx.sa) if n[0] else None,
                _unbroadcast(-ga * a / b, ctx.sb) if n[1] else None)


class Pow(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.sa, ctx.sb = _shape(a), _shape(b)
        out = a ** b
        ctx.save_for_backward(a, b, out)
        return out

    @staticmethod
    def backward(ctx, g):
        a, b, out = ctx.saved_tensors
        n = ctx.needs_input_grad
        ga = gb = None
        if n[0]:
            ga = _unbroadcast(g * b * a ** (b - 1), ctx.sa)
        if n[1]:
            xp = get_array_module(g)
            gb = _unbroadcast(g * out * xp.log(a), ctx.sb)
        return ga, gb


class Neg(Function):
    @staticmethod
    def forward(ctx, a):
        return -a

    @staticmethod
    def backward(ctx, g):
        return -g


def add(a, b) -> Tensor:
    """``a + b`` with broadcasting (Tensors or scalars)."""
    return Add.apply(a, b)


def sub(a, b) -> Tensor:
    """``a - b`` with broadcasting."""
    return Sub.apply(a, b)


def rsub(a, b) -> Tensor:
    """``b - a``."""
    return Sub.apply(b, a)


def mul(a, b) -> Tensor:
    """``a * b`` with broadcasting."""
    return Mul.apply(a, b)


def div(a, b) -> Tensor:
    """``a / b`` with broadcasting."""
    return Div.apply(a, b)


def rdiv(a, b) -> Tensor:
    """``b / a``."""
    return Div.apply(b, a)


def pow(a, b) -> Tensor:  # noqa: A001 - mirrors torch.pow
    """``a ** b`` (tensor or scalar exponent)."""
    return Pow.apply(a, b)


def rpow(a, b) -> Tensor:
    """``b ** a``."""
    return Pow.apply(b, a)


def neg(a) -> Tensor:
    """``-a``."""
    return Neg.apply(a)


# -- matmul --------------------------------------------------------------------------------
class MatMul(Function):
    @staticmethod
    def forward(ctx, a, b):
        n = ctx.needs_input_grad
        ctx.save_for_backward(a if n[1] else None, b if n[0] else None)
        ctx.sa, ctx.sb = a.shape, b.shape
        return a @ b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        sa, sb = ctx.sa, ctx.sb
        n = ctx.needs_input_grad
        if len(sa) == 1:
            g = g[..., None, :]
        if len(sb) == 1:
            g = g[..., None]
        ga = gb = None
        if n[0]:
            b2 = b[:, None] if len(sb) == 1 else b
            ga = g @ b2.swapaxes(-1, -2)
            ga = _unbroadcast(ga, (1,) + tuple(sa) if len(sa) == 1 else tuple(sa)).reshape(sa)
        if n[1]:
            a2 = a[None, :] if len(sa) == 1 else a
            gb = a2.swapaxes(-1, -2) @ g
            gb = _unbroadcast(gb, tuple(sb) + (1,) if len(sb) == 1 else tuple(sb)).reshape(sb)
        return ga, gb


def matmul(a, b) -> Tensor:
    """Matrix product with NumPy's batching/broadcasting rules (``a @ b``)."""
    return MatMul.apply(a, b)


# -- reductions ----------------------------------------------------------------------------
class Sum(Function):
    @staticmethod
    def forward(ctx, a, axis, keepdims):
        ctx.shape, ctx.axes, ctx.keepdims = a.shape, _axes(axis, a.ndim), keepdims
        return a.sum(axis=ctx.axes, keepdims=keepdims)

    @staticmethod
    def backward(ctx, g):
        xp = get_array_module(g)
        out = xp.empty(ctx.shape, g.dtype)
        out[...] = _keep(g, ctx.shape, ctx.axes, ctx.keepdims)
        return out, None, None


class Mean(Function):
    @staticmethod
    def forward(ctx, a, axis, keepdims):
        ctx.shape, ctx.axes, ctx.keepdims = a.shape, _axes(axis, a.ndim), keepdims
        out = a.mean(axis=ctx.axes, keepdims=keepdims)
        ctx.count = a.size // _builtin_max(out.size, 1) if a.size else 1
        return out

    @staticmethod
    def backward(ctx, g):
        xp = get_array_module(g)
        out = xp.empty(ctx.shape, g.dtype)
        out[...] = _keep(g, ctx.shape, ctx.axes, ctx.keepdims)
        out /= ctx.count
        return out, None, None


class _Extreme(Function):
    """max/min over axes; the gradient is split evenly between tied extremes."""

    op = "max"

    @staticmethod
    def forward(ctx, a, axis, keepdims, op):
        xp = get_array_module(a)
        axes = _axes(axis, a.ndim)
        out_k = getattr(xp, op)(a, axis=axes, keepdims=True)
        mask = (a == out_k)
        ctx.save_for_backward(mask)
        ctx.shape, ctx.axes = a.shape, axes
        return out_k if keepdims else out_k.reshape(
            tuple(s for i, s in enumerate(a.shape) if axes is not None and i not in axes))

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        gk = _keep(g, ctx.shape, ctx.axes, False)
        count = mask.sum(axis=ctx.axes, keepdims=True)
        return mask * (gk / count), None, None, None


def sum(a, axis=None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """Sum over ``axis`` (int, tuple or None for all)."""
    return Sum.apply(a, axis, keepdims)


def mean(a, axis=None, keepdims: bool = False) -> Tensor:
    """Mean over ``axis``."""
    return Mean.apply(a, axis, keepdims)


def max(a, axis=None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """Maximum over ``axis`` (values only; use ``Tensor.argmax`` for indices)."""
    return _Extreme.apply(a, axis, keepdims, "max")


def min(a, axis=None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """Minimum over ``axis``."""
    return _Extreme.apply(a, axis, keepdims, "min")


class Var(Function):
    @staticmethod
    def forward(ctx, a, axis, keepdims, correction):
        axes = _axes(axis, a.ndim)
        m = a.mean(axis=axes, keepdims=True)
        d = a - m
        n = a.size // m.size
        denom = n - correction
        out = (d * d).sum(axis=axes, keepdims=keepdims) / denom
        ctx.save_for_backward(d)
        ctx.shape, ctx.axes, ctx.keepdims, ctx.denom = a.shape, axes, keepdims, denom
        return out

    @staticmethod
    def backward(ctx, g):
        (d,) = ctx.saved_tensors
        return _keep(g, ctx.shape, ctx.axes, ctx.keepdims) * (2.0 / ctx.denom) * d, None, None, None


def var(a, axis=None, keepdims: bool = False, correction: int = 1) -> Tensor:
    """Variance over ``axis`` with ``correction`` (1 = unbiased, PyTorch's default; 0 = NumPy's)."""
    return Var.apply(a, axis, keepdims, correction)


# -- shape ---------------------------------------------------------------------------------
class Reshape(Function):
    @staticmethod
    def forward(ctx, a, shape):
        ctx.shape = a.shape
        return a.reshape(shape)

    @staticmethod
    def backward(ctx, g):
        return g.reshape(ctx.shape), None


class Permute(Function):
    @staticmethod
    def forward(ctx, a, dims):
        ctx.inv = tuple(np.argsort(dims))
        return a.transpose(dims)

    @staticmethod
    def backward(ctx, g):
        return g.transpose(ctx.inv), None


class Expand(Function):
    @staticmethod
    def forward(ctx, a, shape):
        xp = get_array_module(a)
        ctx.shape = a.shape
        return xp.broadcast_to(a, shape)

    @staticmethod
    def backward(ctx, g):
        return _unbroadcast(g, tuple(ctx.shape)), None


def _shape_arg(shape) -> tuple:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        return tuple(shape[0])
    return tuple(shape)


def reshape(a, *shape) -> Tensor:
    """Reshape (a view when possible); one dimension may be -1."""
    return Reshape.apply(a, _shape_arg(shape))


def flatten(a, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    """Flatten dimensions ``start_dim..end_dim`` into one."""
    s = a.shape
    nd = len(s)
    if nd == 0:
        return reshape(a, 1)
    start, end = start_dim % nd, end_dim % nd
    mid = int(np.prod(s[start:end + 1]))
    return reshape(a, tuple(s[:start]) + (mid,) + tuple(s[end + 1:]))


def unsqueeze(a, dim: int) -> Tensor:
    """Insert a size-1 axis at ``dim``."""
    s = list(a.shape)
    dim = dim % (len(s) + 1)
    s.insert(dim, 1)
    return reshape(a, tuple(s))


def squeeze(a, dim=None) -> Tensor:
    """Remove size-1 axes (all, or only ``dim``)."""
    s = a.shape
    if dim is None:
        new = tuple(x for x in s if x != 1)
    else:
        dim = dim % len(s)
        new = tuple(x for i, x in enumerate(s) if not (i == dim and x == 1))
    return reshape(a, new)


def expand(a, *shape) -> Tensor:
    """Broadcast to ``shape`` (a read-only view; -1 keeps a dimension)."""
    shape = _shape_arg(shape)
    lead = len(shape) - a.ndim
    shape = tuple(a.shape[i - lead] if s == -1 else s for i, s in enumerate(shape))
    return Expand.apply(a, shape)


def permute(a, *dims) -> Tensor:
    """Reorder axes (``dims`` is a permutation)."""
    dims = _shape_arg(dims)
    return Permute.apply(a, tuple(d % a.ndim for d in dims))


def transpose(a, dim0: int = -2, dim1: int = -1) -> Tensor:
    """Swap two axes."""
    dims = list(range(a.ndim))
    d0, d1 = dim0 % a.ndim, dim1 % a.ndim
    dims[d0], dims[d1] = dims[d1], dims[d0]
    return Permute.apply(a, tuple(dims))


# -- indexing ------------------------------------------------------------------------------
def _raw_index(idx):
    if isinstance(idx, tuple):
        return tuple(i.data if isinstance(i, Tensor) else i for i in idx)
    return idx.data if isinstance(idx, Tensor) else idx


def _is_advanced(idx) -> bool:
    items = idx if isinstance(idx, tuple) else (idx,)
    return any(not (i is None or i is Ellipsis or isinstance(i, (int, slice, np.integer))) for i in items)


class GetItem(Function):
    @staticmethod
    def forward(ctx, a, idx):
        ctx.shape, ctx.dtype, ctx.idx = a.shape, a.dtype, idx
        return a[idx]

    @staticmethod
    def backward(ctx, g):
        xp = get_array_module(g)
        out = xp.zeros(ctx.shape, g.dtype)
        if _is_advanced(ctx.idx):
            xp.add.at(out, ctx.idx, g)  # scatter-add: repeated indices accumulate
        else:
            out[ctx.idx] = g
        return out, None


def getitem(a, idx) -> Tensor:
    """``a[idx]`` with basic and integer/boolean-array indexing (scatter-add backward)."""
    return GetItem.apply(a, _raw_index(idx))


class Concat(Function):
    @staticmethod
    def forward(ctx, *arrays, axis=0):
        xp = get_array_module(*arrays)
        ctx.axis = axis
        ctx.sizes = [x.shape[axis] for x in arrays]
        return xp.concatenate(arrays, axis=axis)

    @staticmethod
    def backward(ctx, g):
        xp = get_array_module(g)
        cuts = np.cumsum(ctx.sizes)[:-1].tolist()
        return tuple(xp.split(g, cuts, axis=ctx.axis))


class Stack(Function):
    @staticmethod
    def forward(ctx, *arrays, axis=0):
        xp = get_array_module(*arrays)
        ctx.axis = axis
        return xp.stack(arrays, axis=axis)

    @staticmethod
    def backward(ctx, g):
        xp = get_array_module(g)
        n = g.shape[ctx.axis]
        return tuple(xp.take(g, i, axis=ctx.axis) for i in range(n))


class Split(Function):
    @staticmethod
    def forward(ctx, a, cuts, axis):
        xp = get_array_module(a)
        ctx.axis = axis
        return tuple(xp.split(a, cuts, axis=axis))

    @staticmethod
    def backward(ctx, *gs):
        xp = get_array_module(*gs)
        return xp.concatenate(gs, axis=ctx.axis), None, None


def concat(tensors: Sequence[Tensor], axis: int = 0) -> Tensor:
    """Join tensors along an existing axis."""
    return Concat.apply(*tensors, axis=axis)


cat = concat


def stack(tensors: Sequence[Tensor], axis: int = 0) -> Tensor:
    """Join tensors along a new axis."""
    return Stack.apply(*tensors, axis=axis)


def split(a, split_size_or_sections: Union[int, Sequence[int]], axis: int = 0) -> Tuple[Tensor, ...]:
    """Split into chunks of ``split_size`` (last may be smaller) or of the given section sizes."""
    n = a.shape[axis]
    if isinstance(split_size_or_sections, (int, np.integer)):
        size = int(split_size_or_sections)
        if size <= 0:
            raise ValueError(f"split size must be positive, got {size}")
        sizes = [size] * (n // size) + ([n % size] if n % size else [])
    else:
        sizes = [int(s) for s in split_size_or_sections]
        if _builtin_sum(sizes) != n:
            raise ValueError(f"split sections {sizes} do not sum to the axis length {n}")
    cuts = np.cumsum(sizes)[:-1].tolist()
    out = Split.apply(a, cuts, axis % a.ndim)
    return out if isinstance(out, tuple) else (out,)


def chunk(a, chunks: int, axis: int = 0) -> Tuple[Tensor, ...]:
    """Split into ``chunks`` pieces of size ``ceil(n / chunks)`` (PyTorch's rule)."""
    n = a.shape[axis]
    return split(a, -(-n // chunks), axis)


class Where(Function):
    @staticmethod
    def forward(ctx, cond, a, b):
        xp = get_array_module(cond, a, b)
        ctx.sa, ctx.sb = _shape(a), _shape(b)
        ctx.save_for_backward(cond)
        return xp.where(cond, a, b)

    @staticmethod
    def backward(ctx, g):
        (cond,) = ctx.saved_tensors
        xp = get_array_module(g)
        n = ctx.needs_input_grad
        zero = xp.zeros((), g.dtype)
        ga = _unbroadcast(xp.where(cond, g, zero), ctx.sa) if n[1] else None
        gb = _unbroadcast(xp.where(cond, zero, g), ctx.sb) if n[2] else None
        return None, ga, gb


def where(cond, a, b) -> Tensor:
    """Elementwise ``a if cond else b`` (cond is not differentiated)."""
    return Where.apply(cond, a, b)


# -- elementwise math ----------------------------------------------------------------------
class Exp(Function):
    @staticmethod
    def forward(ctx, a):
        out = get_array_module(a).exp(a)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        return g * ctx.saved_tensors[0]


class Log(Function):
    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return get_array_module(a).log(a)

    @staticmethod
    def backward(ctx, g):
        return g / ctx.saved_tensors[0]


class Sqrt(Function):
    @staticmethod
    def forward(ctx, a):
        out = get_array_module(a).sqrt(a)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        return g / (2 * ctx.saved_tensors[0])


class Tanh(Function):
    @staticmethod
    def forward(ctx, a):
        out = get_array_module(a).tanh(a)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        out = ctx.saved_tensors[0]
        return g * (1 - out * out)


class Abs(Function):
    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return get_array_module(a).abs(a)

    @staticmethod
    def backward(ctx, g):
        return g * get_array_module(g).sign(ctx.saved_tensors[0])


def exp(a) -> Tensor:
    """Elementwise ``e**a``."""
    return Exp.apply(a)


def log(a) -> Tensor:
    """Elementwise natural logarithm."""
    return Log.apply(a)


def sqrt(a) -> Tensor:
    """Elementwise square root."""
    return Sqrt.apply(a)


def tanh(a) -> Tensor:
    """Elementwise hyperbolic tangent."""
    return Tanh.apply(a)


def abs(a) -> Tensor:  # noqa: A001
    """Elementwise absolute value (gradient 0 at 0)."""
    return Abs.apply(a)


# -- dtype / device / copies ---------------------------------------------------------------
class Cast(Function):
    @staticmethod
    def forward(ctx, a, dtype):
        ctx.dtype = a.dtype
        return a.astype(dtype)

    @staticmethod
    def backward(ctx, g):
        return g.astype(ctx.dtype), None


class ToDevice(Function):
    @staticmethod
    def forward(ctx, a, device):
        ctx.device = device_of(a)
        return to_device(a, device)

    @staticmethod
    def backward(ctx, g):
        return to_device(g, ctx.device), None


class Clone(Function):
    @staticmethod
    def forward(ctx, a):
        return a.copy()

    @staticmethod
    def backward(ctx, g):
        return g


def cast(a, dtype) -> Tensor:
    """Differentiable dtype conversion."""
    return Cast.apply(a, np.dtype(dtype))


def to_device(a, device) -> Tensor:
    """Differentiable move to ``device``."""
    return ToDevice.apply(a, as_device(device))


def clone(a) -> Tensor:
    """A differentiable copy."""
    return Clone.apply(a)
