"""The float32 matmul precision (torch's ``set_float32_matmul_precision``), kept in CuPy where CuPy is loaded."""
from __future__ import annotations

import os

import numpy as np

__all__ = ["get_float32_matmul_precision", "set_float32_matmul_precision"]

_CHOICES = ("highest", "high", "medium")
_COMPUTE_TYPE_DEFAULT, _COMPUTE_TYPE_TF32 = 1, 7          # cupy/_core/_routines_linalg.pxd's enum


class _Precision:
    """torch's process-wide setting (torch keeps it in one global too); set by the functions below."""
    value = "highest"


def _apply_to_cupy(tf32: bool) -> None:
    """Set CuPy's float32 GEMM compute type now (when CuPy is already imported) and for later imports."""
    os.environ["CUPY_TF32"] = "1" if tf32 else "0"          # read by CuPy on its first float32 GEMM
    import sys
    cp = sys.modules.get("cupy")
    linalg = getattr(getattr(cp, "_core", None), "_routines_linalg", None) if cp is not None else None
    setter = getattr(linalg, "set_compute_type", None)
    if setter is not None:
        setter(np.float32, _COMPUTE_TYPE_TF32 if tf32 else _COMPUTE_TYPE_DEFAULT)


def set_float32_matmul_precision(precision: str) -> None:
    """torch's ``set_float32_matmul_precision``: ``"highest"`` (full float32), ``"high"`` or ``"medium"`` (TF32
    tensor cores on a GPU, through CuPy's compute type). No effect on the CPU, where NumPy's float32 GEMMs are
    always full float32.

    Example:
        >>> set_float32_matmul_precision("high")
    """
    if precision not in _CHOICES:
        raise ValueError(f"set_float32_matmul_precision: precision must be one of {_CHOICES}, got {precision!r}")
    _Precision.value = precision
    _apply_to_cupy(precision != "highest")


def get_float32_matmul_precision() -> str:
    """torch's ``get_float32_matmul_precision``: the last value set (``"highest"`` at start)."""
    return _Precision.value
