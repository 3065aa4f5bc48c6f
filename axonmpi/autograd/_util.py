"""Shape and argument helpers shared by the op modules (broadcast reduction, PyTorch/NumPy names)."""
from __future__ import annotations

from typing import Optional

import numpy as np

__all__ = ["_axes", "_dim", "_keep", "_keepdim", "_shape", "_unbroadcast"]


def _shape(a) -> tuple:
    return tuple(a.shape) if hasattr(a, "shape") else ()


def _local_shape(a) -> tuple:
    """The shape of ``a``'s array: a Tensor's ``.data`` (a cut parameter's local piece, not the serial shape it
    reports, ``nn.Parameter``'s [Note: a parameter keeps its identity]), or ``a``'s own."""
    d = a.data if hasattr(a, "grad_fn") else a
    return tuple(d.shape) if hasattr(d, "shape") else ()


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
    """Normalise an int / tuple of dims (negative allowed) to a sorted tuple, or ``None`` for all."""
    if axis is None:
        return None
    if isinstance(axis, (int, np.integer)):
        axis = (int(axis),)
    n = max(ndim, 1)
    out = []
    for a in axis:
        if not -n <= int(a) < n:
            raise IndexError(f"dimension {a} out of range for a tensor with {ndim} dimensions "
                             f"(expected {-n}..{n - 1})")
        out.append(int(a) % n)
    return tuple(sorted(out))


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


def _dim(dim, axis, default=None):
    """PyTorch's ``dim`` or NumPy's ``axis`` (not both)."""
    if axis is not None:
        if dim is not None and dim != default:
            raise TypeError(f"pass dim or axis, not both (got dim={dim!r}, axis={axis!r})")
        return axis
    return default if dim is None else dim


def _keepdim(keepdim, keepdims) -> bool:
    """PyTorch's ``keepdim`` or NumPy's ``keepdims`` (the latter wins when given)."""
    return bool(keepdim if keepdims is None else keepdims)


def _on_one_device(arrays, needs_grad, names):
    """Bring the operands of one op onto one device, or raise.

    The device is that of the first device (GPU) array among ``arrays``, else the host.  A host
    operand that is not differentiated (a mask, class targets, a constant) is copied there; an
    operand that needs a gradient, or one on another GPU, raises ``ValueError`` naming both devices
    (its gradient would land on the wrong device).  Scalars and ``None`` pass unchanged.
    """
    from ..backend import device_of, is_cupy_array, to_device

    ref = next((a for a in arrays if is_cupy_array(a)), None)
    if ref is None:
        return list(arrays)
    dev = device_of(ref)
    stay = [a is None or not hasattr(a, "shape") or device_of(a) == dev for a in arrays]
    for a, need, name, ok in zip(arrays, needs_grad, names, stay):
        if not ok and (need or is_cupy_array(a)):
            raise ValueError(
                f"{name} is on {device_of(a)} but the other operands are on {dev}; "
                f"move it first (tensor.to('{dev}'))")
    return [a if ok else to_device(a, dev) for a, ok in zip(arrays, stay)]
