"""``Parameter``: a leaf Tensor that a Module registers as trainable."""
from __future__ import annotations

from ..autograd.tensor import Tensor

__all__ = ["Parameter"]


class Parameter(Tensor):
    """A Tensor that requires grad by default and is registered when assigned to a Module attribute.

    Unlike plain Tensors, Parameters accept extra attributes (e.g. ``p.tensor_parallel = True``)
    so strategies can tag them.

    Example:
        >>> w = Parameter(np.zeros((4, 3), np.float32))
        >>> w.requires_grad
        True
    """

    def __init__(self, data, requires_grad: bool = True, dtype=None, device=None):
        super().__init__(data, requires_grad=requires_grad, dtype=dtype, device=device)

    def __repr__(self) -> str:
        return "Parameter containing:\n" + super().__repr__()
