"""``Tensor``: an array (NumPy or CuPy) plus the autograd bookkeeping, and tensor constructors."""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import numpy as np

from .. import backend
from ..backend import Device, as_device, device_of, get_array_module, to_device, to_host

__all__ = [
    "Tensor",
    "arange",
    "empty",
    "full",
    "ones",
    "ones_like",
    "rand",
    "randn",
    "tensor",
    "zeros",
    "zeros_like",
]

def _is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or backend.is_cupy_array(x)


def _as_dtype(dtype):
    return None if dtype is None else np.dtype(dtype)


class Tensor:
    """An n-dimensional array with automatic differentiation.

    Args:
        data: array-like (NumPy/CuPy array, nested lists, scalar or Tensor).  Arrays are wrapped
            without a copy; Python floats default to float32.
        requires_grad: record operations on this tensor for :meth:`backward`.
        dtype: NumPy dtype to cast to.
        device: ``"cpu"``, ``"cuda:0"`` or :class:`~axonmpi.backend.Device`.

    ``.data`` is the raw array (assignable); ``.grad`` is a Tensor or ``None`` (assignable).

    Example:
        >>> x = Tensor([[1.0, 2.0]], requires_grad=True)
        >>> (x * x).sum().backward()
        >>> x.grad.numpy()
        array([[2., 4.]], dtype=float32)
    """

    __slots__ = ("data", "grad", "_rg", "grad_fn", "_out_idx", "_hooks", "_post_hooks", "__weakref__")
    __array_ufunc__ = None  # make ``ndarray op Tensor`` defer to Tensor's reflected operators

    def __init__(self, data: Any, requires_grad: bool = False, dtype=None, device=None):
        if isinstance(data, Tensor):
            data = data.data
        dtype = _as_dtype(dtype)
        if device is not None:
            dev = as_device(device)
            xp = dev.xp
            arr = to_device(data if _is_array(data) else np.asarray(data), dev)
        else:
            xp = get_array_module(data)
            arr = data if _is_array(data) else np.asarray(data)
        if dtype is not None:
            if arr.dtype != dtype:
                arr = arr.astype(dtype)
        elif not _is_array(data) and arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        if not _is_array(arr):
            arr = xp.asarray(arr)
        self.data = arr
        self.grad = None
        self.grad_fn = None
        self._out_idx = 0
        self._hooks = None
        self._post_hooks = None
        self._rg = False
        if requires_grad:
            self.requires_grad = True

    # -- fast internal constructors --------------------------------------------------------
    @classmethod
    def _wrap(cls, arr) -> "Tensor":
        t = object.__new__(Tensor)
        t.data = arr
        t.grad = None
        t.grad_fn = None
        t._out_idx = 0
        t._hooks = None
        t._post_hooks = None
        t._rg = False
        return t

    @classmethod
    def _wrap_out(cls, arr, fn, idx: int) -> "Tensor":
        t = object.__new__(Tensor)
        t.data = arr
        t.grad = None
        t._out_idx = idx
        t._hooks = None
        t._post_hooks = None
        if arr.dtype.kind in "fc":
            t.grad_fn = fn
            t._rg = True
        else:
            t.grad_fn = None
            t._rg = False
        return t

    # -- properties ------------------------------------------------------------------------
    @property
    def requires_grad(self) -> bool:
        """Whether operations on this tensor are recorded for backward."""
        return self._rg

    @requires_grad.setter
    def requires_grad(self, flag: bool) -> None:
        if self.grad_fn is not None and not flag:
            raise RuntimeError("requires_grad can only be changed on leaf tensors; use .detach()")
        if flag and self.data.dtype.kind not in "fc":
            raise TypeError(f"only floating-point tensors can require grad, got dtype {self.data.dtype}")
        self._rg = bool(flag)

    def requires_grad_(self, flag: bool = True) -> "Tensor":
        """Set ``requires_grad`` in place and return ``self``."""
        self.requires_grad = flag
        return self

    @property
    def is_leaf(self) -> bool:
        """True for tensors not produced by a recorded operation."""
        return self.grad_fn is None

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def size(self) -> int:
        """Number of elements (NumPy's ``size``)."""
        return int(self.data.size)

    def numel(self) -> int:
        """Number of elements."""
        return int(self.data.size)

    def dim(self) -> int:
        return self.data.ndim

    @property
    def device(self) -> Device:
        return device_of(self.data)

    @property
    def xp(self):
        """The array module (``numpy`` or ``cupy``) of ``.data``."""
        return get_array_module(self.data)

    def __len__(self) -> int:
        if self.data.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return self.data.shape[0]

    # -- conversion ------------------------------------------------------------------------
    def numpy(self) -> np.ndarray:
        """A host NumPy copy of the data."""
        return np.array(to_host(self.data), copy=True)

    def item(self):
        """The single element as a Python number."""
        if self.data.size != 1:
            raise ValueError(f"item() needs a tensor with one element, got shape {self.shape}")
        return self.data.item()

    def tolist(self):
        return to_host(self.data).tolist()

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __bool__(self) -> bool:
        return bool(self.item())

    def detach(self) -> "Tensor":
        """A new leaf sharing ``.data`` and not requiring grad."""
        return Tensor._wrap(self.data)

    def detach_(self) -> "Tensor":
        """Detach in place: make this a leaf that does not require grad."""
        self.grad_fn = None
        self._rg = False
        return self

    def to(self, *args, device=None, dtype=None) -> "Tensor":
        """Move to ``device`` and/or cast to ``dtype`` (differentiable); returns self if nothing changes."""
        for a in args:
            is_dev = isinstance(a, str) and a.split(":")[0].lower() in ("cpu", "cuda", "gpu")
            if isinstance(a, Device) or is_dev:
                device = a
            else:
                dtype = a
        out = self
        if dtype is not None and np.dtype(dtype) != self.data.dtype:
            out = _ops().cast(out, np.dtype(dtype))
        if device is not None and as_device(device) != out.device:
            out = _ops().to_device(out, as_device(device))
        return out

    def cpu(self) -> "Tensor":
        return self.to("cpu")

    def float(self) -> "Tensor":
        return self.to(dtype=np.float32)

    def double(self) -> "Tensor":
        return self.to(dtype=np.float64)

    def astype(self, dtype) -> "Tensor":
        return self.to(dtype=dtype)

    def clone(self) -> "Tensor":
        return _ops().clone(self)

    def zero_(self) -> "Tensor":
        """Fill ``.data`` with zeros in place (not recorded)."""
        self.data[...] = 0
        return self

    def fill_(self, value) -> "Tensor":
        self.data[...] = value
        return self

    # -- autograd --------------------------------------------------------------------------
    def backward(self, grad: Any = None, retain_graph: bool = False) -> None:
        """Accumulate d(self)/d(leaf) (times ``grad``) into every leaf's ``.grad``."""
        from .function import backward as _backward

        _backward([self], [grad], retain_graph=retain_graph)

    def register_hook(self, fn: Callable[["Tensor"], Optional["Tensor"]]):
        """Call ``fn(grad)`` with this tensor's gradient during backward; a returned Tensor replaces it."""
        from .function import RemovableHandle

        if not self._rg:
            raise RuntimeError("cannot register a hook on a tensor that does not require grad")
        if self.grad_fn is None:
            if self._hooks is None:
                self._hooks = {}
            hooks = self._hooks
        else:
            fn_node = self.grad_fn
            if fn_node._out_hooks is None:
                fn_node._out_hooks = {}
            hooks = fn_node._out_hooks.setdefault(self._out_idx, {})
        handle = RemovableHandle(hooks)
        hooks[handle._key] = fn
        return handle

    def register_post_accumulate_grad_hook(self, fn: Callable[["Tensor"], None]):
        """On a leaf: call ``fn(self)`` right after this backward's last contribution to ``.grad``."""
        from .function import RemovableHandle

        if self.grad_fn is not None:
            raise RuntimeError("post-accumulate-grad hooks can only be registered on leaf tensors")
        if self._post_hooks is None:
            self._post_hooks = {}
        handle = RemovableHandle(self._post_hooks)
        self._post_hooks[handle._key] = fn
        return handle

    # -- repr ------------------------------------------------------------------------------
    def __repr__(self) -> str:
        body = np.array2string(to_host(self.data), separator=", ", prefix="Tensor(", precision=4)
        extra = []
        if self.data.dtype != np.float32:
            extra.append(f"dtype={self.data.dtype}")
        if self.device.type != "cpu":
            extra.append(f"device='{self.device}'")
        if self.grad_fn is not None:
            extra.append(f"grad_fn=<{type(self.grad_fn).__name__}>")
        elif self._rg:
            extra.append("requires_grad=True")
        return f"Tensor({body}{''.join(', ' + e for e in extra)})"

    # -- operators (one-line wrappers over autograd.ops) -----------------------------------
    def __add__(self, o): return _ops().add(self, o)
    def __radd__(self, o): return _ops().add(self, o)
    def __sub__(self, o): return _ops().sub(self, o)
    def __rsub__(self, o): return _ops().rsub(self, o)
    def __mul__(self, o): return _ops().mul(self, o)
    def __rmul__(self, o): return _ops().mul(self, o)
    def __truediv__(self, o): return _ops().div(self, o)
    def __rtruediv__(self, o): return _ops().rdiv(self, o)
    def __pow__(self, o): return _ops().pow(self, o)
    def __rpow__(self, o): return _ops().rpow(self, o)
    def __neg__(self): return _ops().neg(self)
    def __matmul__(self, o): return _ops().matmul(self, o)
    def __rmatmul__(self, o): return _ops().matmul(o, self)
    def __getitem__(self, idx): return _ops().getitem(self, idx)
    def __lt__(self, o): return Tensor._wrap(self.data < _raw(o))
    def __le__(self, o): return Tensor._wrap(self.data <= _raw(o))
    def __gt__(self, o): return Tensor._wrap(self.data > _raw(o))
    def __ge__(self, o): return Tensor._wrap(self.data >= _raw(o))
    __hash__ = object.__hash__

    def eq(self, o) -> "Tensor":
        """Elementwise equality (``==`` keeps Python identity semantics so tensors work in sets)."""
        return Tensor._wrap(self.data == _raw(o))

    def ne(self, o) -> "Tensor":
        return Tensor._wrap(self.data != _raw(o))

    def matmul(self, o): return _ops().matmul(self, o)
    def sum(self, axis=None, keepdims=False): return _ops().sum(self, axis, keepdims)
    def mean(self, axis=None, keepdims=False): return _ops().mean(self, axis, keepdims)
    def max(self, axis=None, keepdims=False): return _ops().max(self, axis, keepdims)
    def min(self, axis=None, keepdims=False): return _ops().min(self, axis, keepdims)
    def var(self, axis=None, keepdims=False, correction=1):
        return _ops().var(self, axis, keepdims, correction)

    def argmax(self, axis=None, keepdims=False):
        return Tensor._wrap(self.xp.argmax(self.data, axis=axis, keepdims=keepdims))

    def argmin(self, axis=None, keepdims=False):
        return Tensor._wrap(self.xp.argmin(self.data, axis=axis, keepdims=keepdims))

    def reshape(self, *shape): return _ops().reshape(self, *shape)
    def view(self, *shape): return _ops().reshape(self, *shape)
    def flatten(self, start_dim=0, end_dim=-1): return _ops().flatten(self, start_dim, end_dim)
    def unsqueeze(self, dim): return _ops().unsqueeze(self, dim)
    def squeeze(self, dim=None): return _ops().squeeze(self, dim)
    def expand(self, *shape): return _ops().expand(self, *shape)
    def transpose(self, dim0=-2, dim1=-1): return _ops().transpose(self, dim0, dim1)
    def permute(self, *dims): return _ops().permute(self, *dims)

    @property
    def T(self): return _ops().permute(self, *reversed(range(self.ndim)))

    def split(self, split_size_or_sections, axis=0): return _ops().split(self, split_size_or_sections, axis)
    def chunk(self, chunks, axis=0): return _ops().chunk(self, chunks, axis)
    def exp(self): return _ops().exp(self)
    def log(self): return _ops().log(self)
    def sqrt(self): return _ops().sqrt(self)
    def tanh(self): return _ops().tanh(self)
    def abs(self): return _ops().abs(self)
    def relu(self): return _ops().relu(self)
    def sigmoid(self): return _ops().sigmoid(self)
    def softmax(self, axis=-1): return _ops().softmax(self, axis)
    def log_softmax(self, axis=-1): return _ops().log_softmax(self, axis)
    def masked_fill(self, mask, value): return _ops().masked_fill(self, mask, value)


def _raw(x):
    return x.data if isinstance(x, Tensor) else x


_OPS = None


def _ops():
    global _OPS
    if _OPS is None:
        from . import ops

        _OPS = ops
    return _OPS


# -- constructors --------------------------------------------------------------------------
def _xp_for(device):
    return as_device(device).xp


def _dt(dtype):
    return np.float32 if dtype is None else np.dtype(dtype)


def tensor(data: Any, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """Create a tensor from array-like data (copies, like ``torch.tensor``)."""
    if isinstance(data, Tensor):
        data = data.data
    if _is_array(data):
        data = data.copy()
    return Tensor(data, requires_grad=requires_grad, dtype=dtype, device=device)


def zeros(*shape, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """A tensor of zeros (float32 unless ``dtype``)."""
    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    return Tensor(_xp_for(device).zeros(shape, _dt(dtype)), requires_grad=requires_grad)


def ones(*shape, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """A tensor of ones (float32 unless ``dtype``)."""
    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    return Tensor(_xp_for(device).ones(shape, _dt(dtype)), requires_grad=requires_grad)


def empty(*shape, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """An uninitialized tensor (float32 unless ``dtype``)."""
    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    return Tensor(_xp_for(device).empty(shape, _dt(dtype)), requires_grad=requires_grad)


def full(shape, fill_value, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """A tensor filled with ``fill_value`` (float32 unless ``dtype``)."""
    return Tensor(_xp_for(device).full(shape, fill_value, _dt(dtype)), requires_grad=requires_grad)


def zeros_like(t: Tensor, dtype=None, requires_grad: bool = False) -> Tensor:
    a = _raw(t)
    return Tensor(get_array_module(a).zeros_like(a, dtype=dtype), requires_grad=requires_grad)


def ones_like(t: Tensor, dtype=None, requires_grad: bool = False) -> Tensor:
    a = _raw(t)
    return Tensor(get_array_module(a).ones_like(a, dtype=dtype), requires_grad=requires_grad)


def arange(start, stop=None, step=1, dtype=None, device=None) -> Tensor:
    """``arange`` like NumPy (int64 for integer arguments)."""
    if stop is None:
        start, stop = 0, start
    return Tensor(_xp_for(device).arange(start, stop, step, dtype=dtype))


def randn(*shape, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """Standard-normal samples from :mod:`axonmpi.random`'s generator (drawn on the host)."""
    from ..random import default_generator

    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    arr = default_generator().standard_normal(shape).astype(_dt(dtype))
    return Tensor(arr, requires_grad=requires_grad, device=device)


def rand(*shape, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """Uniform [0, 1) samples from :mod:`axonmpi.random`'s generator (drawn on the host)."""
    from ..random import default_generator

    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    arr = default_generator().random(shape).astype(_dt(dtype))
    return Tensor(arr, requires_grad=requires_grad, device=device)
