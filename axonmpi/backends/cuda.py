"""``torch.backends.cuda``: ``matmul.allow_tf32`` (the float32 matmul precision: see :mod:`axonmpi.backends`)."""
from __future__ import annotations

from ._precision import get_float32_matmul_precision, set_float32_matmul_precision

__all__ = ["matmul", "is_built"]


class _Matmul:
    """``torch.backends.cuda.matmul``: ``allow_tf32`` reads and sets the float32 matmul precision."""

    @property
    def allow_tf32(self) -> bool:
        return get_float32_matmul_precision() != "highest"

    @allow_tf32.setter
    def allow_tf32(self, value: bool) -> None:
        set_float32_matmul_precision("high" if value else "highest")

    def __setattr__(self, name, value):
        if name != "allow_tf32":
            raise AttributeError(f"torch.backends.cuda.matmul.{name} is not served by axonmpi (only allow_tf32)")
        object.__setattr__(self, name, value)


matmul = _Matmul()


def is_built() -> bool:
    """True when CuPy imports and sees a GPU (torch: built with CUDA)."""
    from .. import backend
    return backend.cupy_available()
