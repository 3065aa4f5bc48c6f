"""Top-level names PyTorch scripts call as ``torch.<name>`` (``import axonmpi as torch``): dtypes,
``device``, tensor functions (``argmax``, ``flatten``, ``cat``, ``from_numpy``, ...), ``inference_mode``.

Each is a thin alias of an axonmpi op or NumPy dtype; ``tests/test_torch_surface.py`` checks them.
"""
from __future__ import annotations

import builtins

import numpy as np

from .autograd import Tensor, no_grad
from .autograd import ops as _ops
from .autograd import ops_nn as _nn
from .autograd import ops_select as _select
from . import backends
from .backends import get_float32_matmul_precision, set_float32_matmul_precision
from .backend import Device, is_floating

__all__ = [
    "device", "dtype", "float32", "float", "float64", "double", "float16", "half", "int64", "long", "int32",
    "int", "int8", "uint8", "bool", "argmax", "argmin", "flatten", "cat", "concat", "stack",
    "from_numpy", "as_tensor", "is_tensor", "is_floating_point", "numel", "sum", "mean", "max", "min", "exp",
    "sqrt", "abs", "tanh", "sigmoid", "relu", "softmax", "log_softmax", "matmul", "where", "clamp",
    "reshape", "squeeze", "unsqueeze", "transpose", "permute", "split", "chunk", "inference_mode",
    "get_default_dtype", "randint", "randperm", "eye", "linspace", "allclose", "equal",
    "topk", "multinomial", "tril", "triu", "pow", "sin", "cos", "maximum", "minimum",
    "set_float32_matmul_precision", "get_float32_matmul_precision",
    "backends",
]

device = Device                     # torch.device("cuda", 1), torch.device("cpu"), torch.device(0)
dtype = np.dtype
float32 = float = np.float32        # noqa: A001 - torch's names
float64 = double = np.float64
float16 = half = np.float16
int64 = long = np.int64
int32 = int = np.int32              # noqa: A001
int8 = np.int8
uint8 = np.uint8
bool = np.bool_                     # noqa: A001

argmax, argmin, flatten, cat, concat, stack = _ops.argmax, _ops.argmin, _ops.flatten, _ops.cat, _ops.concat, _ops.stack
sum, mean, max, min = _ops.sum, _ops.mean, _ops.max, _ops.min     # noqa: A001
exp, sqrt, abs, tanh = _ops.exp, _ops.sqrt, _ops.abs, _ops.tanh   # noqa: A001  (not log: axonmpi.log is a module)
matmul, where, clamp, reshape = _ops.matmul, _ops.where, _ops.clamp, _ops.reshape
squeeze, unsqueeze, transpose, permute, split, chunk = (_ops.squeeze, _ops.unsqueeze, _ops.transpose, _ops.permute,
                                                       _ops.split, _ops.chunk)
sigmoid, relu, softmax, log_softmax = _nn.sigmoid, _nn.relu, _nn.softmax, _nn.log_softmax
inference_mode = no_grad
topk, multinomial, tril, triu = _select.topk, _select.multinomial, _select.tril, _select.triu
# minGPT's NewGELU calls torch.pow
pow, sin, cos, maximum, minimum = _ops.pow, _ops.sin, _ops.cos, _ops.maximum, _ops.minimum   # noqa: A001


def from_numpy(a: np.ndarray) -> Tensor:
    """A Tensor sharing ``a``'s memory (as torch's; no dtype change)."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"from_numpy expects a numpy.ndarray, got {type(a).__name__}")
    return Tensor._wrap(a)


def as_tensor(data, dtype=None, device=None) -> Tensor:
    """``data`` as a Tensor, sharing memory where it can (a Tensor of the same dtype is returned as is)."""
    if isinstance(data, Tensor) and (dtype is None or np.dtype(dtype) == data.dtype) and device is None:
        return data
    if isinstance(data, np.ndarray) and dtype is None and device is None:
        return Tensor._wrap(data)
    return Tensor(data, dtype=dtype, device=device)


def is_tensor(obj) -> "bool":
    return isinstance(obj, Tensor)


def is_floating_point(t: Tensor) -> "bool":
    return is_floating(t.dtype)


def numel(t: Tensor) -> "int":
    return t.numel()


def get_default_dtype():
    """float32, axonmpi's default floating dtype (as torch's)."""
    return np.float32


def _gen(generator=None):
    from .random import host_generator
    return host_generator(generator)


def randint(low, high=None, size=None, *, dtype=None, device=None, generator=None) -> Tensor:
    """Integers in ``[low, high)`` (``randint(high, size)`` too), int64 by default, from ``generator`` (an
    :class:`axonmpi.Generator`) or axonmpi's default generator."""
    if size is None and isinstance(high, (tuple, list)):      # torch's randint(high, size)
        low, high, size = 0, low, high
    if size is None:
        raise TypeError("randint needs size=, e.g. randint(0, 10, (4,))")
    if high is None:
        low, high = 0, low
    return Tensor(_gen(generator).integers(low, high, size=tuple(size)), dtype=dtype or np.int64, device=device)


def randperm(n: "int", *, dtype=None, device=None, generator=None) -> Tensor:
    """A random permutation of ``0..n-1`` (int64) from ``generator`` or axonmpi's default generator."""
    return Tensor(_gen(generator).permutation(n), dtype=dtype or np.int64, device=device)


def eye(n: "int", m=None, *, dtype=None, device=None) -> Tensor:
    return Tensor(np.eye(n, m), dtype=dtype or np.float32, device=device)


def linspace(start, end, steps: "int", *, dtype=None, device=None) -> Tensor:
    return Tensor(np.linspace(start, end, steps), dtype=dtype or np.float32, device=device)


def allclose(a, b, rtol: "float" = 1e-05, atol: "float" = 1e-08, equal_nan: "bool" = False) -> "bool":
    raw = lambda x: x.data if isinstance(x, Tensor) else x   # noqa: E731
    return builtins.bool(np.allclose(raw(a), raw(b), rtol=rtol, atol=atol, equal_nan=equal_nan))


def equal(a, b) -> "bool":
    raw = lambda x: x.data if isinstance(x, Tensor) else x   # noqa: E731
    return builtins.bool(np.array_equal(raw(a), raw(b)))


def _bfloat16():
    """ml_dtypes' bfloat16 scalar type, or None without ml_dtypes. Looked up on first use (``axonmpi.bfloat16``):
    importing ml_dtypes costs seconds, which every rank of every job would otherwise pay at ``import axonmpi``."""
    try:
        import ml_dtypes
    except ImportError:             # pragma: no cover
        return None
    return np.dtype(ml_dtypes.bfloat16).type


def __getattr__(name: str):
    if name == "bfloat16":
        value = globals()["bfloat16"] = _bfloat16()
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
