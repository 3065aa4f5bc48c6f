"""Which host implementation runs: ``numba`` (fused loops) where it imports, else ``numpy``; AXONMPI_KERNELS forces one."""
from __future__ import annotations

import functools
import os

import numpy as np

from .. import env as _env

__all__ = ["host_path", "numba_available", "use_numba"]

_PATHS = ("numpy", "numba")


@functools.lru_cache(maxsize=None)
def numba_available() -> bool:
    """True when ``numba`` imports (the ``axonmpi[fast]`` extra)."""
    try:
        import numba  # noqa: F401
    except Exception:   # ImportError, or an llvmlite that fails to load
        return False
    return True


@functools.lru_cache(maxsize=None)
def _path_from_env(value: str) -> str:
    v = value.strip().lower()
    if v == "":
        return "numba" if numba_available() else "numpy"
    if v not in _PATHS:
        raise _env.EnvError(f"AXONMPI_KERNELS={value!r}: expected one of {_PATHS} or unset (numba where it imports)")
    if v == "numba" and not numba_available():
        raise _env.EnvError("AXONMPI_KERNELS=numba but numba does not import here: pip install 'axonmpi[fast]' "
                            "(or numba>=0.60), or set AXONMPI_KERNELS=numpy")
    return v


def host_path() -> str:
    """``"numba"`` or ``"numpy"``: the implementation host (NumPy) arrays take, read from AXONMPI_KERNELS each call.

    Example:
        >>> host_path() in ("numba", "numpy")
        True
    """
    return _path_from_env(os.environ.get("AXONMPI_KERNELS", ""))     # env.get_str's value, without its layers


def use_numba(*arrays) -> bool:
    """True when the numba path is on and every array is a NumPy float32/float64 array (any layout)."""
    if host_path() != "numba":
        return False
    dt = None
    for a in arrays:
        if type(a) is not np.ndarray or a.dtype.char not in "fd":
            return False
        if dt is None:
            dt = a.dtype
        elif a.dtype != dt:
            return False
    return True
