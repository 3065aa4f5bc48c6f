"""Any array in the collectives: DLPack, CUDA array interface and buffer-protocol objects as NumPy/CuPy views, and back.

The public collectives and point-to-point calls take NumPy and CuPy arrays. Wrapped with
:func:`any_array`, they also take any object that exposes

* ``__dlpack__`` / ``__dlpack_device__`` (PyTorch tensors, JAX arrays, CuPy, ...): a CPU
  producer is viewed with ``numpy.from_dlpack``, a CUDA one with ``cupy.from_dlpack``;
* ``__cuda_array_interface__`` (Numba, older CuPy/PyTorch): viewed with ``cupy.asarray``;
* the buffer protocol (``bytearray``, ``array.array``, ``memoryview``, ``bytes``): viewed
  with ``numpy.asarray(memoryview(x))``.

Each is a view, not a copy, wherever the producer allows it (PyTorch, CuPy, the buffer
protocol: always), so an in-place call (``out=x``, ``broadcast``, ``recv``) writes the
caller's memory and returns the caller's own object. A new result is made of the first
array argument's type (:func:`like`): ``torch.from_dlpack`` for PyTorch, ``jax.numpy.from_dlpack``
for JAX, ``T.from_dlpack`` for a type ``T`` with that classmethod, ``memoryview``/``bytearray``/
``bytes``/``array.array`` for those; a type none of these can build gets the NumPy/CuPy array.

Example:
    >>> t = torch.ones(3)
    >>> axonmpi.all_reduce(t, out=t) is t          # summed in place, same storage
    True
    >>> type(axonmpi.all_gather(t))                 # a new result: a torch.Tensor again
    <class 'torch.Tensor'>
"""
from __future__ import annotations

import array as _array
import functools
import sys
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from .. import backend as _be

__all__ = ["any_array", "any_array_p2p", "call_with_arrays", "foreign", "is_foreign", "like", "to_array"]

_ND = np.ndarray
_CPU_DEVICES = (1, 3)            # DLPack kDLCPU, kDLCUDAHost (pinned host memory)
_CUDA_DEVICES = (2, 13)          # kDLCUDA, kDLCUDAManaged
_BUFFERS = (bytes, bytearray, memoryview, _array.array)


def is_foreign(x: Any) -> bool:
    """True for an object this module converts: not a NumPy/CuPy array, a scalar or a list, but
    one exposing ``__dlpack__``, ``__cuda_array_interface__`` or the buffer protocol."""
    if isinstance(x, (_ND, np.generic, int, float, complex, str, list, tuple)) or x is None or _be.is_cupy_array(x):
        return False
    if isinstance(x, _BUFFERS) or hasattr(x, "__dlpack__") or hasattr(x, "__cuda_array_interface__"):
        return True
    try:
        memoryview(x)
    except TypeError:
        return False
    return True


def to_array(x: Any, name: str = "x"):
    """The NumPy (host) or CuPy (CUDA) view of a foreign array ``x`` (see :func:`is_foreign`).

    Raises:
        TypeError: a DLPack producer on a device that is neither the host nor CUDA, or a
            CUDA producer without CuPy.
    """
    if hasattr(x, "__dlpack__"):
        dev = int(x.__dlpack_device__()[0]) if hasattr(x, "__dlpack_device__") else 1
        if dev in _CPU_DEVICES:
            return np.from_dlpack(x)
        if dev in _CUDA_DEVICES:
            return _cupy(x, name).from_dlpack(x)
        raise TypeError(f"{name} is a {type(x).__name__} on DLPack device type {dev}; collectives move "
                        f"host (1, 3) and CUDA (2, 13) memory")
    if hasattr(x, "__cuda_array_interface__"):
        return _cupy(x, name).asarray(x)
    return np.asarray(memoryview(x))


def _cupy(x, name):
    if not _be.cupy_available():
        raise TypeError(f"{name} is a CUDA {type(x).__name__}; moving it needs CuPy (pip install axonmpi[cuda12])")
    return _be.get_cupy()


def _maker(original: Any) -> Optional[Callable[[Any], Any]]:
    """How to build an object of ``original``'s type from a NumPy/CuPy array (None: no way known)."""
    t = type(original)
    if isinstance(original, memoryview):
        return memoryview
    if isinstance(original, (bytes, bytearray)):
        return t
    if isinstance(original, _array.array):
        return lambda a: _array.array(original.typecode, np.ascontiguousarray(a).tobytes())
    f = getattr(t, "from_dlpack", None)
    if callable(f):
        return f
    root = t.__module__.split(".")[0]
    if root in ("jax", "jaxlib"):
        import jax.numpy as jnp  # noqa: WPS433 - only when a JAX array came in
        return jnp.from_dlpack
    f = getattr(sys.modules.get(root), "from_dlpack", None)     # torch.from_dlpack, ...
    return f if callable(f) else None


def like(result: Any, originals: Dict[int, Tuple[Any, Any]], exemplar: Any) -> Any:
    """``result`` in the caller's types: a converted argument becomes the caller's object (in
    place: the same storage), a new array an object of ``exemplar``'s type (see :func:`_maker`),
    lists element by element, a :class:`~axonmpi.distributed.work.Work` on completion."""
    if result is None:
        return None
    hit = originals.get(id(result))
    if hit is not None and hit[1] is result:
        return hit[0]
    if isinstance(result, (list, tuple)):
        return type(result)(like(r, originals, exemplar) for r in result)
    if isinstance(result, _ND) or _be.is_cupy_array(result):
        make = _maker(exemplar) if exemplar is not None else None
        return result if make is None else make(result)
    if hasattr(result, "then") and hasattr(result, "wait"):       # a Work
        return result.then(lambda r: like(r, originals, exemplar))
    return result


def _convert(v: Any, name: str, originals: Dict[int, Tuple[Any, Any]], seen: Dict[int, Any]):
    """``v`` with its foreign arrays (also inside a list or tuple) replaced by views; records them."""
    if isinstance(v, (list, tuple)):
        return type(v)(_convert(c, f"{name}[{i}]", originals, seen) for i, c in enumerate(v))
    if not is_foreign(v):
        return v
    a = seen.get(id(v))
    if a is None:
        a = seen[id(v)] = to_array(v, name)
        originals[id(a)] = (v, a)
    return a


def _first_foreign(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return next((c for c in v if is_foreign(c)), None)
    return v if is_foreign(v) else None


def foreign(*xs: Any) -> bool:
    """True when one of ``xs`` (or an element of a list among them) is a foreign array."""
    return any(is_foreign(_first_foreign(v)) for v in xs)


def call_with_arrays(fn: Callable, x: Any, *args, **kw) -> Any:
    """``fn(x, *args, **kw)`` with the foreign arrays in ``x`` and ``kw["out"]`` as views, and its
    result in the caller's types (module docstring). A collective whose NumPy fast path must stay
    free of this calls it at its entry: ``if foreign(x, out): return call_with_arrays(fn, x, ...)``."""
    originals: Dict[int, Tuple[Any, Any]] = {}
    seen: Dict[int, Any] = {}
    exemplar = _first_foreign(x)
    x = _convert(x, getattr(fn, "__name__", "collective") + " x", originals, seen)
    out = kw.get("out")
    if out is not None:
        kw["out"] = _convert(out, "out", originals, seen)
        exemplar = exemplar if exemplar is not None else _first_foreign(out)
    return like(fn(x, *args, **kw), originals, exemplar)


def any_array(fn: Callable) -> Callable:
    """Let ``fn(x, ..., out=None)`` take foreign arrays as ``x`` (or a list of them) and ``out``,
    and return its result in their types (module docstring). NumPy/CuPy calls pass straight through."""

    @functools.wraps(fn)
    def wrapper(x, *args, **kw):
        if type(x) is not _ND and foreign(x, kw.get("out")):
            return call_with_arrays(fn, x, *args, **kw)
        out = kw.get("out")
        if out is not None and type(out) is not _ND and is_foreign(out):
            return call_with_arrays(fn, x, *args, **kw)
        return fn(x, *args, **kw)

    return wrapper


def any_array_p2p(fn: Callable) -> Callable:
    """Let ``batch_isend_irecv(ops)`` take foreign arrays in its ``P2POp``s; a receive's Work
    returns the caller's object."""

    @functools.wraps(fn)
    def wrapper(p2p_op_list, *args, **kw):
        if not isinstance(p2p_op_list, (list, tuple)) or not any(is_foreign(getattr(o, "tensor", None))
                                                                  for o in p2p_op_list):
            return fn(p2p_op_list, *args, **kw)
        originals: Dict[int, Tuple[Any, Any]] = {}
        seen: Dict[int, Any] = {}
        ops = []
        for i, o in enumerate(p2p_op_list):
            if is_foreign(getattr(o, "tensor", None)):
                o = type(o)(o.op, _convert(o.tensor, f"op {i} tensor", originals, seen), o.peer, o.group, o.tag)
            ops.append(o)
        return [like(w, originals, None) for w in fn(ops, *args, **kw)]

    return wrapper
