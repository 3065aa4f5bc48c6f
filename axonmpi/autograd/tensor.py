"""``Tensor``: an array (NumPy or CuPy) plus the autograd bookkeeping, and tensor constructors."""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import numpy as np

from .. import backend
from ..backend import Device, as_device, device_of, get_array_module, to_device, to_host
from ..backend import is_floating as _is_floating

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
    def wrap(cls, arr) -> "Tensor":
        """A Tensor over the array ``arr`` as it is: no copy, no checks, no gradient (the fast path
        for code that feeds raw arrays into a graph, e.g. a pipeline's received activations)."""
        return cls._wrap(arr)

    @classmethod
    def _wrap_out(cls, arr, fn, idx: int) -> "Tensor":
        t = object.__new__(Tensor)
        t.data = arr
        t.grad = None
        t._out_idx = idx
        t._hooks = None
        t._post_hooks = None
        if _is_floating(arr.dtype):
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
        if flag and not _is_floating(self.data.dtype):
            raise TypeError(f"only floating-point tensors can require grad, got dtype {self.data.dtype}")
        self._rg = bool(flag)

    def requires_grad_(self, requires_grad: bool = True) -> "Tensor":
        """Set ``requires_grad`` in place and return ``self``."""
        self.requires_grad = requires_grad
        return self

    @property
    def is_leaf(self) -> bool:
        """True for tensors not produced by a recorded operation."""
        return self.grad_fn is None

    @property
    def shape(self) -> Tuple[int, ...]:
        """The shape as a tuple of ints."""
        return tuple(self.data.shape)

    @property
    def dtype(self):
        """The NumPy dtype of ``.data``."""
        return self.data.dtype

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return self.data.ndim

    def size(self, dim: Optional[int] = None):
        """The shape (PyTorch's ``size()``), or the length of dimension ``dim``.

        Example:
            >>> Tensor([[1.0, 2.0, 3.0]]).size(), Tensor([[1.0, 2.0, 3.0]]).size(-1)
            ((1, 3), 3)
        """
        if dim is None:
            return tuple(self.data.shape)
        n = self.data.ndim
        if not -n <= int(dim) < max(n, 1):
            raise IndexError(f"size(dim={dim}): dimension out of range for a {n}-d tensor "
                             f"(expected {-n}..{n - 1})")
        return int(self.data.shape[dim])

    def numel(self) -> int:
        """Number of elements."""
        return int(self.data.size)

    nelement = numel

    def element_size(self) -> int:
        """Bytes per element."""
        return int(self.data.dtype.itemsize)

    def dim(self) -> int:
        """Number of dimensions."""
        return self.data.ndim

    @property
    def device(self) -> Device:
        """Where ``.data`` lives (:class:`~axonmpi.backend.Device`)."""
        return device_of(self.data)

    @property
    def is_cuda(self) -> bool:
        """True when ``.data`` is a CuPy array."""
        return backend.is_cupy_array(self.data)

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
        """The data as (nested) Python lists."""
        return to_host(self.data).tolist()

    def __float__(self) -> float:
        return float(self.item())

    def __index__(self) -> int:
        """An integer tensor of one element as a Python int (a slice bound, a list index), as torch's."""
        if self.data.size != 1 or self.dtype.kind not in "iub":
            raise TypeError(f"only integer tensors of a single element can be converted to an index, got "
                            f"dtype {self.dtype} shape {tuple(self.shape)}")
        return int(self.data.reshape(()))

    def __int__(self) -> int:
        return int(self.item())

    def __bool__(self) -> bool:
        if self.data.size != 1:
            raise RuntimeError(f"Boolean value of a Tensor of shape {self.shape} ({self.data.size} elements) "
                               "is ambiguous; use .any() or .all(), or compare identity with 'is'")
        return bool(self.item())

    def detach(self) -> "Tensor":
        """A new leaf sharing ``.data`` and not requiring grad."""
        return Tensor._wrap(self.data)

    def detach_(self) -> "Tensor":
        """Detach in place: make this a leaf that does not require grad."""
        self.grad_fn = None
        self._rg = False
        return self

    def to(self, *args, device=None, dtype=None, non_blocking: bool = False, copy: bool = False) -> "Tensor":
        """Move to ``device`` and/or cast to ``dtype`` (differentiable); returns self if nothing changes.

        Takes PyTorch's forms: ``to("cuda")``, ``to(np.float64)``, ``to("cpu", np.float32)``,
        ``to(other)`` (other's device and dtype), ``to(rank)`` (GPU ``rank`` where there are GPUs, the
        CPU where there are none: :func:`axonmpi.backend.index_device`), and the keywords.
        """
        for a in args:
            is_dev = isinstance(a, str) and a.split(":")[0].lower() in ("cpu", "cuda", "gpu")
            if isinstance(a, Tensor):
                device, dtype = a.device, a.dtype
            elif isinstance(a, (int, np.integer)) and not isinstance(a, bool):
                device = a                        # torch's .to(rank): see backend.index_device
            elif isinstance(a, Device) or is_dev:
                device = a
            else:
                dtype = a
        out = self
        if dtype is not None and np.dtype(dtype) != self.data.dtype:
            out = _ops().cast(out, np.dtype(dtype))
        if device is not None and backend.to_target(device) != out.device:
            out = _ops().to_device(out, backend.to_target(device))
        return out.clone() if copy and out is self else out

    def pin_memory(self) -> "Tensor":
        """torch's ``pin_memory()``: the tensor itself (a host array is copied to the GPU from where it is)."""
        return self

    def cpu(self) -> "Tensor":
        """This tensor on the host (differentiable; ``self`` if already there)."""
        return self.to("cpu")

    def cuda(self, device=None) -> "Tensor":
        """This tensor on GPU ``device`` (an index or ``"cuda:i"``; default 0); needs CuPy (unlike ``.to("cuda")``,
        it never falls back to the CPU)."""
        if device is None or isinstance(device, (int, np.integer)):
            device = f"cuda:{0 if device is None else int(device)}"
        dev = as_device(device)
        return self if dev == self.device else _ops().to_device(self, dev)

    def float(self) -> "Tensor":
        """Cast to float32 (differentiable)."""
        return self.to(dtype=np.float32)

    def double(self) -> "Tensor":
        """Cast to float64 (differentiable)."""
        return self.to(dtype=np.float64)

    def half(self) -> "Tensor":
        """Cast to float16 (differentiable)."""
        return self.to(dtype=np.float16)

    def long(self) -> "Tensor":
        """Cast to int64 (not differentiable)."""
        return self.to(dtype=np.int64)

    def astype(self, dtype) -> "Tensor":
        """Cast to ``dtype`` (NumPy's name for :meth:`to` with a dtype)."""
        return self.to(dtype=dtype)

    def type_as(self, other: "Tensor") -> "Tensor":
        """Cast to ``other``'s dtype."""
        return self.to(dtype=other.dtype)

    def clone(self) -> "Tensor":
        """A differentiable copy."""
        return _ops().clone(self)

    def contiguous(self) -> "Tensor":
        """A C-contiguous tensor: ``self`` when already contiguous, else a differentiable copy."""
        return self if self.data.flags.c_contiguous else _ops().clone(self)

    def new_zeros(self, *size, dtype=None) -> "Tensor":
        """Zeros of ``size`` with this tensor's dtype and device (unless ``dtype``)."""
        return Tensor._wrap(self.xp.zeros(_size_arg(size), self.dtype if dtype is None else dtype))

    def new_ones(self, *size, dtype=None) -> "Tensor":
        """Ones of ``size`` with this tensor's dtype and device (unless ``dtype``)."""
        return Tensor._wrap(self.xp.ones(_size_arg(size), self.dtype if dtype is None else dtype))

    def new_full(self, size, fill_value, dtype=None) -> "Tensor":
        """``fill_value`` everywhere, with this tensor's dtype and device (unless ``dtype``)."""
        return Tensor._wrap(self.xp.full(_size_arg((size,)), fill_value,
                                         self.dtype if dtype is None else dtype))

    def new_tensor(self, data, dtype=None) -> "Tensor":
        """A copy of ``data`` with this tensor's dtype and device (unless ``dtype``)."""
        data = data.data if isinstance(data, Tensor) else data
        return Tensor._wrap(self.xp.array(to_host(data) if self.xp is np else data,
                                          dtype=self.dtype if dtype is None else dtype))

    def zero_(self) -> "Tensor":
        """Fill ``.data`` with zeros in place (not recorded)."""
        self.data[...] = 0
        return self

    def fill_(self, value) -> "Tensor":
        """Fill ``.data`` with ``value`` in place (not recorded)."""
        self.data[...] = value
        return self

    # -- in-place updates (PyTorch's names; not recorded, so refused where autograd would need them) ---
    def _check_inplace(self, what: str) -> None:
        from .grad_mode import is_grad_enabled
        if (self._rg or self.grad_fn is not None) and is_grad_enabled():
            kind = "a leaf Tensor that requires grad" if self.grad_fn is None else "a Tensor produced by a recorded op"
            raise RuntimeError(f"{what} on {kind} (shape {self.shape}, dtype {self.dtype}) is not recorded by "
                               "autograd; do it under `with axonmpi.no_grad():`, or on .detach() / .data")

    def __setitem__(self, idx, value) -> None:
        """``t[idx] = value`` in place (as torch; refused on tensors autograd tracks, outside no_grad)."""
        self._check_inplace("item assignment")
        self.data[_raw_index_value(idx)] = _raw(value)

    def copy_(self, src, non_blocking: bool = False) -> "Tensor":
        """Copy ``src`` (a Tensor, array or number; broadcast, cast to this dtype) into this tensor in place."""
        self._check_inplace("copy_")
        v = src.data if isinstance(src, Tensor) else src
        xp = self.xp
        self.data[...] = to_device(v, self.device) if xp is not np else to_host(v) if not np.isscalar(v) else v
        return self

    def _inplace(self, what, fn, other=None):
        self._check_inplace(what)
        o = _raw(other) if other is not None else None
        res = fn(self.data, o)
        if res.dtype != self.data.dtype and not np.can_cast(res.dtype, self.data.dtype, "same_kind"):
            raise TypeError(f"{what}: the result's dtype {res.dtype} can't be cast to this tensor's {self.data.dtype}")
        if not _is_array(self.data):          # a NumPy scalar (t[0] of a 1-d tensor): nothing to write into
            self.data = np.asarray(res, dtype=self.data.dtype)
            return self
        self.data[...] = res
        return self

    def add_(self, other, *, alpha=1):
        """``self += alpha * other`` in place."""
        return self._inplace("add_", lambda a, o: a + (o if alpha == 1 else alpha * o), other)

    def sub_(self, other, *, alpha=1):
        """``self -= alpha * other`` in place."""
        return self._inplace("sub_", lambda a, o: a - (o if alpha == 1 else alpha * o), other)

    def mul_(self, other):
        """``self *= other`` in place."""
        return self._inplace("mul_", lambda a, o: a * o, other)

    def div_(self, other):
        """``self /= other`` in place."""
        return self._inplace("div_", lambda a, o: a / o, other)

    def clamp_(self, min=None, max=None):  # noqa: A002
        """Clamp in place."""
        return self._inplace("clamp_", lambda a, o: self.xp.clip(a, min, max))

    def normal_(self, mean: float = 0.0, std: float = 1.0, *, generator=None):
        """Fill with normal samples from ``generator`` (an :class:`axonmpi.Generator`) or axonmpi's
        default generator (``axonmpi.manual_seed``)."""
        from .. import random as _r
        self._check_inplace("normal_")
        self.data[...] = to_device(_r.host_generator(generator).normal(mean, std, self.data.shape), self.device)
        return self

    def uniform_(self, a: float = 0.0, b: float = 1.0, *, generator=None):
        """Fill with uniform samples in ``[a, b)`` from ``generator`` or axonmpi's default generator."""
        from .. import random as _r
        self._check_inplace("uniform_")
        self.data[...] = to_device(_r.host_generator(generator).uniform(a, b, self.data.shape), self.device)
        return self

    def __iadd__(self, o):
        return self.add_(o) if not (self._rg or self.grad_fn is not None) else _ops().add(self, o)

    def __isub__(self, o):
        return self.sub_(o) if not (self._rg or self.grad_fn is not None) else _ops().sub(self, o)

    def __imul__(self, o):
        return self.mul_(o) if not (self._rg or self.grad_fn is not None) else _ops().mul(self, o)

    def __itruediv__(self, o):
        return self.div_(o) if not (self._rg or self.grad_fn is not None) else _ops().div(self, o)

    def int(self) -> "Tensor":
        """Cast to int32."""
        return self.to(dtype=np.int32)

    def bool(self) -> "Tensor":
        """Cast to bool."""
        return self.to(dtype=np.bool_)

    def view_as(self, other: "Tensor") -> "Tensor":
        """Reshape to ``other``'s shape."""
        return _ops().reshape(self, *other.shape)

    def type(self, dtype=None):
        """With no argument, torch's type name (``"axonmpi.FloatTensor"``); else a cast to ``dtype``."""
        if dtype is None:
            names = {"float32": "FloatTensor", "float64": "DoubleTensor", "int64": "LongTensor",
                     "int32": "IntTensor", "bool": "BoolTensor", "float16": "HalfTensor"}
            return "axonmpi." + names.get(self.data.dtype.name, self.data.dtype.name)
        return self.to(dtype=dtype)

    # -- autograd --------------------------------------------------------------------------
    def backward(self, gradient: Any = None, retain_graph: Optional[bool] = None,
                 create_graph: bool = False, inputs: Any = None) -> None:
        """Accumulate d(self)/d(leaf) (times ``gradient``) into every leaf's ``.grad``.

        Args:
            gradient: the gradient of some scalar w.r.t. ``self``; may be left out for a
                one-element tensor.
            retain_graph: keep the saved arrays for another backward (default False).
            create_graph: higher-order gradients are not supported: True raises
                NotImplementedError.
            inputs: accumulating into a subset of the leaves is not supported: anything but
                None raises NotImplementedError.
        """
        from .function import backward as _backward

        if create_graph:
            raise NotImplementedError("backward(create_graph=True): higher-order gradients are not supported")
        if inputs is not None:
            raise NotImplementedError("backward(inputs=...): gradients always go to every leaf of the graph")
        _backward([self], [gradient], retain_graph=bool(retain_graph))

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
    def __format__(self, spec: str) -> str:
        """``f"{loss:.4f}"``: a one-element tensor formats as its number (as torch's 0-d tensors do);
        an empty spec gives ``str(self)``."""
        if not spec:
            return str(self)
        if self.data.size != 1:
            raise TypeError(f"unsupported format string {spec!r} passed to Tensor.__format__ for a tensor of "
                            f"shape {self.shape}: only one-element tensors format as numbers (use .item() "
                            "or .tolist())")
        return format(self.item(), spec)

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

    # [Note: == is elementwise, hash is identity]
    # As in PyTorch, ``a == b`` is a bool Tensor (``(pred == y).float().mean()``), and hashing is
    # by identity, so tensors still work as dict keys and in sets (lookups compare identity
    # first). Library code must never compare tensors with ``==`` or search a list of tensors
    # with ``in``/``index``/``remove`` (a non-identical element would be compared elementwise);
    # it compares ``id(t)``. ``t == None`` is False, as in PyTorch.
    def __eq__(self, o):
        if o is None or isinstance(o, str):
            return NotImplemented
        return Tensor._wrap(self.data == _raw(o))

    def __ne__(self, o):
        if o is None or isinstance(o, str):
            return NotImplemented
        return Tensor._wrap(self.data != _raw(o))

    __hash__ = object.__hash__

    def eq(self, other) -> "Tensor":
        """Elementwise equality (the same as ``==``)."""
        return Tensor._wrap(self.data == _raw(other))

    def ne(self, other) -> "Tensor":
        """Elementwise inequality."""
        return Tensor._wrap(self.data != _raw(other))

    def lt(self, other) -> "Tensor":
        """Elementwise ``<``."""
        return self < other

    def le(self, other) -> "Tensor":
        """Elementwise ``<=``."""
        return self <= other

    def gt(self, other) -> "Tensor":
        """Elementwise ``>``."""
        return self > other

    def ge(self, other) -> "Tensor":
        """Elementwise ``>=``."""
        return self >= other

    def all(self, dim=None, keepdim: bool = False) -> "Tensor":
        """True where every element (along ``dim``) is nonzero (not differentiable)."""
        return Tensor._wrap(self.xp.asarray(self.data.all(axis=dim, keepdims=keepdim)))

    def any(self, dim=None, keepdim: bool = False) -> "Tensor":
        """True where some element (along ``dim``) is nonzero (not differentiable)."""
        return Tensor._wrap(self.xp.asarray(self.data.any(axis=dim, keepdims=keepdim)))

    # -- math (PyTorch's names and signatures; NumPy's axis/keepdims are accepted too) -----
    def add(self, other): return _ops().add(self, other)
    def sub(self, other): return _ops().sub(self, other)
    def mul(self, other): return _ops().mul(self, other)
    def div(self, other): return _ops().div(self, other)
    def pow(self, exponent): return _ops().pow(self, exponent)
    def neg(self): return _ops().neg(self)
    def matmul(self, other): return _ops().matmul(self, other)
    def exp(self): return _ops().exp(self)
    def log(self): return _ops().log(self)
    def sqrt(self): return _ops().sqrt(self)
    def rsqrt(self): return _ops().pow(self, -0.5)
    def square(self): return _ops().mul(self, self)
    def reciprocal(self): return _ops().rdiv(self, 1.0)
    def tanh(self): return _ops().tanh(self)
    def sin(self): return _ops().sin(self)
    def cos(self): return _ops().cos(self)
    def abs(self): return _ops().abs(self)
    def clamp(self, min=None, max=None): return _ops().clamp(self, min, max)  # noqa: A002
    clip = clamp
    def maximum(self, other): return _ops().maximum(self, other)
    def minimum(self, other): return _ops().minimum(self, other)
    def relu(self): return _nn().relu(self)
    def sigmoid(self): return _nn().sigmoid(self)
    def softmax(self, dim=-1, dtype=None, *, axis=None): return _nn().softmax(self, dim, dtype, axis=axis)

    def log_softmax(self, dim=-1, dtype=None, *, axis=None):
        return _nn().log_softmax(self, dim, dtype, axis=axis)

    def masked_fill(self, mask, value): return _nn().masked_fill(self, mask, value)
    def where(self, condition, other): return _ops().where(condition, self, other)

    def sum(self, dim=None, keepdim=False, *, dtype=None, axis=None, keepdims=None):
        return _ops().sum(self, dim, keepdim, dtype=dtype, axis=axis, keepdims=keepdims)

    def mean(self, dim=None, keepdim=False, *, dtype=None, axis=None, keepdims=None):
        return _ops().mean(self, dim, keepdim, dtype=dtype, axis=axis, keepdims=keepdims)

    def max(self, dim=None, keepdim=False, *, axis=None, keepdims=None):
        return _ops().max(self, dim, keepdim, axis=axis, keepdims=keepdims)

    def min(self, dim=None, keepdim=False, *, axis=None, keepdims=None):
        return _ops().min(self, dim, keepdim, axis=axis, keepdims=keepdims)

    def amax(self, dim=None, keepdim=False, *, axis=None, keepdims=None):
        return _ops().amax(self, dim, keepdim, axis=axis, keepdims=keepdims)

    def amin(self, dim=None, keepdim=False, *, axis=None, keepdims=None):
        return _ops().amin(self, dim, keepdim, axis=axis, keepdims=keepdims)

    def argmax(self, dim=None, keepdim=False, *, axis=None, keepdims=None):
        return _ops().argmax(self, dim, keepdim, axis=axis, keepdims=keepdims)

    def argmin(self, dim=None, keepdim=False, *, axis=None, keepdims=None):
        return _ops().argmin(self, dim, keepdim, axis=axis, keepdims=keepdims)

    def var(self, dim=None, unbiased=None, keepdim=False, *, correction=None, axis=None, keepdims=None):
        return _ops().var(self, dim, unbiased, keepdim, correction=correction, axis=axis, keepdims=keepdims)

    def std(self, dim=None, unbiased=None, keepdim=False, *, correction=None, axis=None, keepdims=None):
        return _ops().std(self, dim, unbiased, keepdim, correction=correction, axis=axis, keepdims=keepdims)

    # -- shape ---------------------------------------------------------------------------------
    def reshape(self, *shape): return _ops().reshape(self, *shape)
    def view(self, *shape): return _ops().reshape(self, *shape)
    def view_as(self, other): return _ops().reshape(self, other.shape)
    def reshape_as(self, other): return _ops().reshape(self, other.shape)
    def flatten(self, start_dim=0, end_dim=-1): return _ops().flatten(self, start_dim, end_dim)
    def unsqueeze(self, dim): return _ops().unsqueeze(self, dim)
    def squeeze(self, dim=None): return _ops().squeeze(self, dim)
    def expand(self, *sizes): return _ops().expand(self, *sizes)
    def expand_as(self, other): return _ops().expand(self, other.shape)
    def transpose(self, dim0=-2, dim1=-1): return _ops().transpose(self, dim0, dim1)
    def permute(self, *dims): return _ops().permute(self, *dims)

    def t(self):
        """Transpose a tensor of at most 2 dims (PyTorch's ``t()``)."""
        nd = self.data.ndim
        if nd > 2:
            raise ValueError(f"t() expects a tensor with <= 2 dims, got shape {self.shape}; use transpose")
        return self if nd < 2 else _ops().transpose(self, 0, 1)

    @property
    def T(self):
        """All dims reversed."""
        return _ops().permute(self, *reversed(range(self.data.ndim)))

    def split(self, split_size_or_sections, dim=0, *, axis=None):
        return _ops().split(self, split_size_or_sections, dim, axis=axis)

    def chunk(self, chunks, dim=0, *, axis=None):
        return _ops().chunk(self, chunks, dim, axis=axis)

    def __abs__(self): return _ops().abs(self)

    def topk(self, k, dim=-1, largest=True, sorted=True):  # noqa: A002
        return _select().topk(self, k, dim, largest, sorted)

    def tril(self, diagonal=0): return _select().tril(self, diagonal)
    def triu(self, diagonal=0): return _select().triu(self, diagonal)

    def multinomial(self, num_samples, replacement=False, *, generator=None):
        return _select().multinomial(self, num_samples, replacement, generator=generator)


_METHOD_DOCS = {
    "add": "``self + other``.", "sub": "``self - other``.", "mul": "``self * other``.",
    "div": "``self / other``.", "pow": "``self ** exponent``.", "neg": "``-self``.",
    "matmul": "``self @ other``.", "exp": "Elementwise exponential.", "log": "Natural logarithm.",
    "sqrt": "Square root.", "rsqrt": "``1 / sqrt(self)``.", "square": "``self * self``.",
    "reciprocal": "``1 / self``.", "tanh": "Hyperbolic tangent.", "sin": "Sine.", "cos": "Cosine.",
    "abs": "Absolute value.", "clamp": "Clip to ``[min, max]`` (gradient where inside).",
    "maximum": "Elementwise maximum.", "minimum": "Elementwise minimum.", "relu": "``max(self, 0)``.",
    "sigmoid": "Logistic function.", "softmax": "Softmax along ``dim``.",
    "log_softmax": "Log-softmax along ``dim``.", "masked_fill": "``value`` where ``mask`` is True.",
    "where": "``self`` where ``condition`` else ``other``.",
    "sum": "Sum over ``dim`` (int, tuple or None).", "mean": "Mean over ``dim``.",
    "max": "Max over all (a Tensor) or along ``dim`` (``(values, indices)``).",
    "min": "Min over all (a Tensor) or along ``dim`` (``(values, indices)``).",
    "amax": "Max values over ``dim`` (ties share the gradient).",
    "amin": "Min values over ``dim`` (ties share the gradient).",
    "argmax": "Index of the max along ``dim`` (flattened if None).",
    "argmin": "Index of the min along ``dim`` (flattened if None).",
    "var": "Variance over ``dim`` (``correction=1`` by default).",
    "std": "Standard deviation over ``dim`` (``correction=1`` by default).",
    "reshape": "Reshape; one dim may be -1.", "view": "Reshape (PyTorch's ``view``).",
    "view_as": "Reshape to ``other.shape``.", "reshape_as": "Reshape to ``other.shape``.",
    "flatten": "Flatten dims ``start_dim..end_dim``.", "unsqueeze": "Insert a size-1 dim.",
    "squeeze": "Remove size-1 dims (all or ``dim``).", "expand": "Broadcast to ``sizes``.",
    "expand_as": "Broadcast to ``other.shape``.", "transpose": "Swap two dims.",
    "permute": "Reorder dims.", "split": "Split along ``dim`` (sizes or one size).",
    "chunk": "Split into ``chunks`` pieces along ``dim``.", "__abs__": "``abs(self)``.",
    "topk": "``(values, indices)`` of the ``k`` largest along ``dim`` (see ``axonmpi.topk``).",
    "tril": "Lower triangle of the last two dims.", "triu": "Upper triangle of the last two dims.",
    "multinomial": "Sampled category indices per row of weights (see ``axonmpi.multinomial``).",
}
for _name, _doc in _METHOD_DOCS.items():
    getattr(Tensor, _name).__doc__ = _doc
Tensor.clip.__doc__ = Tensor.clamp.__doc__


def _size_arg(size) -> tuple:
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        return tuple(size[0])
    if len(size) == 1 and isinstance(size[0], (int, np.integer)):
        return (int(size[0]),)
    return tuple(size)


def _raw(x):
    return x.data if isinstance(x, Tensor) else x


def _raw_index_value(idx):
    if isinstance(idx, tuple):
        return tuple(i.data if isinstance(i, Tensor) else i for i in idx)
    return idx.data if isinstance(idx, Tensor) else idx


_OPS = None


def _ops():
    global _OPS
    if _OPS is None:
        from . import ops

        _OPS = ops
    return _OPS


def _nn():
    from . import ops_nn

    return ops_nn


def _select():
    from . import ops_select

    return ops_select


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


def _scalar_dtype(*values):
    """PyTorch's dtype for Python scalars: bool, int64, float32 (the default float) or complex64."""
    kinds = {np.asarray(_raw(v)).dtype.kind for v in values}
    if "c" in kinds:
        return np.dtype(np.complex64)
    if "f" in kinds:
        return np.dtype(np.float32)
    if kinds <= {"b"}:
        return np.dtype(np.bool_)
    return np.dtype(np.int64)


def full(size, fill_value, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """A tensor of ``size`` filled with ``fill_value``.

    The dtype follows PyTorch when not given: int64 for an int, bool for a bool, float32 for a
    float.

    Example:
        >>> full((2,), 3).dtype, full((2,), 3.0).dtype
        (dtype('int64'), dtype('float32'))
    """
    dt = _scalar_dtype(fill_value) if dtype is None else np.dtype(dtype)
    size = (size,) if isinstance(size, (int, np.integer)) else tuple(size)
    return Tensor(_xp_for(device).full(size, _raw(fill_value), dt), requires_grad=requires_grad)


def zeros_like(input: Tensor, dtype=None, requires_grad: bool = False) -> Tensor:  # noqa: A002
    """Zeros with ``input``'s shape, dtype (unless ``dtype``) and device."""
    a = _raw(input)
    return Tensor(get_array_module(a).zeros_like(a, dtype=dtype), requires_grad=requires_grad)


def ones_like(input: Tensor, dtype=None, requires_grad: bool = False) -> Tensor:  # noqa: A002
    """Ones with ``input``'s shape, dtype (unless ``dtype``) and device."""
    a = _raw(input)
    return Tensor(get_array_module(a).ones_like(a, dtype=dtype), requires_grad=requires_grad)


def arange(start, end=None, step=1, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """Values from ``start`` to ``end`` (exclusive) by ``step``, PyTorch's dtype rule.

    int64 when every argument is an int, float32 when one is a float (unless ``dtype``).

    Example:
        >>> arange(3).tolist(), arange(0.0, 3.0).dtype
        ([0, 1, 2], dtype('float32'))
    """
    if end is None:
        start, end = 0, start
    dt = _scalar_dtype(start, end, step) if dtype is None else np.dtype(dtype)
    if dt.kind == "b":
        dt = np.dtype(np.int64)
    return Tensor(_xp_for(device).arange(start, end, step, dtype=dt), requires_grad=requires_grad)


def randn(*shape, generator=None, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """Standard-normal samples drawn on the host from ``generator`` (an :class:`axonmpi.Generator`,
    torch's ``generator=``) or, without one, from :mod:`axonmpi.random`'s default generator."""
    from ..random import host_generator

    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    arr = host_generator(generator).standard_normal(shape).astype(_dt(dtype))
    return Tensor(arr, requires_grad=requires_grad, device=device)


def rand(*shape, generator=None, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """Uniform [0, 1) samples drawn on the host from ``generator`` (or axonmpi's default generator)."""
    from ..random import host_generator

    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    arr = host_generator(generator).random(shape).astype(_dt(dtype))
    return Tensor(arr, requires_grad=requires_grad, device=device)
