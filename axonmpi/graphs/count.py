"""Count the array operations a step launches on the host (NumPy), and its host syncs: the CPU stand-in for a GPU's
kernel launches and for its reads of device values.

:func:`counting` makes the model's, the optimizer's and the inputs' arrays :class:`CountedArray` views: every
ufunc call (operators, ``@``, reductions, in-place updates), every NumPy function that takes them
(``__array_function__``: ``concatenate``, ``einsum``, ``vdot``, ``zeros_like`` ...), every copy, cast,
fancy-indexed read and indexed write is one operation; views (``reshape``, ``transpose``, basic slicing)
are free, as on a GPU.  Such arrays take the kernel layer's NumPy path (its numba loops only take plain
``ndarray``), the path CuPy takes too, so the count is the number of kernels a GPU launches for the same step,
up to the kernels the CuPy path fuses further.  Arrays a step makes from nothing (``np.zeros(n)``) count when an
op uses them.  For measurement only: each counted operation costs a Python call.
"""
from __future__ import annotations

import collections
import contextlib
import threading
from typing import Any, Dict, Iterable, Iterator

import numpy as np

__all__ = ["CountedArray", "OpCounter", "counting"]

_LOCAL = threading.local()


class OpCounter:
    """Operations by name since the last :meth:`reset`; ``total`` is their sum; ``syncs`` counts the reads of
    array values into Python (``float()``, ``int()``, ``bool()``, ``.item()``, ``.tolist()``): on a GPU each is
    a host sync that stalls the launch queue (and makes a step impossible to capture)."""

    def __init__(self):
        self.by_name: Dict[str, int] = collections.Counter()
        self.syncs: Dict[str, int] = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.by_name.values())

    @property
    def host_syncs(self) -> int:
        return sum(self.syncs.values())

    def reset(self) -> None:
        self.by_name = collections.Counter()
        self.syncs = collections.Counter()


def _tick(name: str) -> None:
    c = getattr(_LOCAL, "counter", None)
    if c is not None:
        c.by_name[name] += 1


def _sync(name: str) -> None:
    c = getattr(_LOCAL, "counter", None)
    if c is not None:
        c.syncs[name] += 1


def _plain(x):
    if isinstance(x, CountedArray):
        return x.view(np.ndarray)
    if type(x) in (list, tuple):
        return type(x)(_plain(v) for v in x)
    return x


def _counted(x):
    if type(x) is np.ndarray:
        return x.view(CountedArray)
    if isinstance(x, np.generic):       # a reduction's scalar: a 0-d array, so reading it counts as a sync
        return np.asarray(x).view(CountedArray)
    if type(x) is tuple:
        return tuple(_counted(v) for v in x)
    return x


_FREE = frozenset({"reshape", "transpose", "swapaxes", "moveaxis", "expand_dims", "squeeze", "ravel", "shape",
                   "ndim", "size", "result_type", "can_cast", "broadcast_to", "broadcast_shapes", "atleast_1d",
                   "atleast_2d", "may_share_memory", "shares_memory", "iscomplexobj", "isrealobj", "ndarray_ravel",
                   "array_equal", "asarray", "asanyarray", "ascontiguousarray"})


class CountedArray(np.ndarray):
    """An ``ndarray`` view whose operations are counted while :func:`counting` is active."""

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        _tick(ufunc.__name__ if method == "__call__" else f"{ufunc.__name__}.{method}")
        out = kwargs.get("out")
        if out is not None:
            kwargs["out"] = tuple(_plain(o) for o in out)
        res = getattr(ufunc, method)(*(_plain(i) for i in inputs), **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _counted(res)

    def __array_function__(self, func, types, args, kwargs):
        name = func.__name__
        if name not in _FREE or (name == "ascontiguousarray" and not self.flags.c_contiguous):
            _tick(name)
        return _counted(func(*_plain(args), **{k: _plain(v) for k, v in kwargs.items()}))

    def copy(self, order="C"):
        _tick("copy")
        return np.ndarray.copy(self, order)

    def astype(self, dtype, order="K", casting="unsafe", subok=True, copy=True):
        if copy or np.dtype(dtype) != self.dtype:
            _tick("astype")
        return np.ndarray.astype(self, dtype, order, casting, subok, copy)

    def fill(self, value):
        _tick("fill")
        return np.ndarray.fill(self, value)

    def __float__(self):
        _sync("float")
        return float(self.view(np.ndarray))

    def __int__(self):
        _sync("int")
        return int(self.view(np.ndarray))

    def __index__(self):
        _sync("index")
        return self.view(np.ndarray).__index__()

    def __bool__(self):
        _sync("bool")
        return bool(self.view(np.ndarray))

    def item(self, *args):
        _sync("item")
        return self.view(np.ndarray).item(*args)

    def tolist(self):
        _sync("tolist")
        return self.view(np.ndarray).tolist()

    def __getitem__(self, key):
        if _advanced(key):
            _tick("gather")
        return np.ndarray.__getitem__(self, key)

    def __setitem__(self, key, value):
        _tick("setitem")
        np.ndarray.__setitem__(self, key, _plain(value))


def _advanced(key) -> bool:
    if isinstance(key, tuple):
        return any(_advanced(k) for k in key)
    return isinstance(key, (np.ndarray, list))


def _arrays_of(objs: Iterable[Any]) -> Iterator[Any]:
    """The Tensors (parameters, their gradients) and optimizer states among ``objs``, as ``(holder, key)``."""
    for o in objs:
        if hasattr(o, "parameters") and callable(o.parameters):
            for p in o.parameters():
                yield p, "data"
                if p.grad is not None:
                    yield p.grad, "data"
        if hasattr(o, "state") and isinstance(getattr(o, "state"), dict):
            for st in o.state.values():
                if isinstance(st, dict):
                    for k, v in st.items():
                        if isinstance(v, np.ndarray):
                            yield st, k


@contextlib.contextmanager
def counting(*holders: Any):
    """Count array operations on this thread while inside; ``holders`` (models, optimizers) get their arrays
    turned into :class:`CountedArray` views first (their values unchanged), and ``numpy.asarray`` keeps such a
    view a view while inside (it would drop the subclass).

    Example:
        >>> with counting(model, opt) as c:
        ...     c.reset(); step(CountedArray_view(x), y); print(c.total)
    """
    for holder, key in _arrays_of(holders):
        if isinstance(holder, dict):
            holder[key] = holder[key].view(CountedArray)
        else:
            setattr(holder, key, getattr(holder, key).view(CountedArray))
    prev = getattr(_LOCAL, "counter", None)
    _LOCAL.counter = c = OpCounter()
    asarray = np.asarray

    def keep(a, *args, **kwargs):        # np.asarray drops the subclass: keep counting what it passes on
        r = asarray(a, *args, **kwargs)
        if isinstance(a, CountedArray) and type(r) is np.ndarray:
            if r.dtype != a.dtype:
                _tick("astype")
            return r.view(CountedArray)
        return r
    np.asarray = keep
    try:
        yield c
    finally:
        np.asarray = asarray
        _LOCAL.counter = prev
