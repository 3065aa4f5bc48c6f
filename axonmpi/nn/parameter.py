"""``Parameter``: a leaf Tensor that a Module registers as trainable; under a layout it keeps its serial shape.

[Note: a parameter keeps its identity]
A layout changes where a parameter's elements live, never what the user's code sees: the same Python object
stays in the model under its serial name, and ``shape``, ``size()``, ``dim()``, ``ndim`` and ``numel()`` report
the serial (global) shape, as FSDP2's DTensor parameters do.  ``.data`` is this rank's local array (what the
forward computes with); :meth:`Parameter.to_local` gives this rank's piece as a Tensor (FSDP: the parameter's
elements in this rank's flat chunk, 1-D; tensor parallel: its shard), and the optimizers update that piece.  So
param groups chosen by shape or name, ``p.numel()`` counts, and an optimizer built before the model was laid
out behave as serially.  The global shape is recorded by ``distributed.placement.set_placement`` (a placement
that cuts the parameter, with its ``full_shape``) and by FSDP's ``FlatParameter`` (the shape while the storage
is released); where the piece the optimizer steps lives in another buffer (an FSDP flat chunk) the parameter
names that owner, which gives ``piece(index)`` and ``zero_piece_grad(index)``.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

from ..autograd.tensor import Tensor

__all__ = ["Parameter", "local_arrays"]


class Parameter(Tensor):
    """A Tensor that requires grad by default and is registered when assigned to a Module attribute.

    Unlike plain Tensors, Parameters accept extra attributes (e.g. ``p.tensor_parallel = True``)
    so strategies can tag them.  Under a layout (``parallelize``, FSDP, tensor parallel, AxoNN) a
    Parameter reports its serial ``shape`` / ``size()`` / ``dim()`` / ``ndim`` / ``numel()``;
    ``.data`` and :meth:`to_local` are this rank's piece ([Note: a parameter keeps its identity]).

    Example:
        >>> w = Parameter(np.zeros((4, 3), np.float32))
        >>> w.requires_grad, w.shape, w.to_local().shape
        (True, (4, 3), (4, 3))
    """

    def __init__(self, data, requires_grad: bool = True, dtype=None, device=None):
        super().__init__(data, requires_grad=requires_grad, dtype=dtype, device=device)

    # -- the serial shape ([Note: a parameter keeps its identity]) ------------------------------
    @property
    def shape(self) -> Tuple[int, ...]:
        """The serial shape: the global one under a layout, else that of ``.data``."""
        g = self.__dict__.get("_global_shape")
        return tuple(self.data.shape) if g is None else g

    @property
    def ndim(self) -> int:
        """Number of dimensions of the serial shape."""
        return len(self.shape)

    def dim(self) -> int:
        """Number of dimensions of the serial shape."""
        return len(self.shape)

    def numel(self) -> int:
        """Elements of the serial parameter (all ranks' pieces together)."""
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    nelement = numel

    def size(self, dim: Optional[int] = None):
        """The serial shape, or the length of its dimension ``dim``."""
        shape = self.shape
        if dim is None:
            return shape
        n = len(shape)
        if not -n <= int(dim) < max(n, 1):
            raise IndexError(f"size(dim={dim}): dimension out of range for a {n}-d tensor "
                             f"(expected {-n}..{n - 1})")
        return int(shape[dim])

    @property
    def is_local(self) -> bool:
        """True when ``.data`` is the whole serial parameter (no layout splits it or holds it elsewhere)."""
        return "_global_shape" not in self.__dict__ and "_local_owner" not in self.__dict__

    def to_local(self) -> Tensor:
        """This rank's piece of the parameter as a Tensor sharing its storage (PyTorch's
        ``DTensor.to_local()``): the tensor-parallel shard, FSDP's elements in this rank's flat chunk
        (1-D, possibly empty), or the whole parameter when no layout splits it.  Its ``.grad`` is the
        piece's gradient (``None`` when there is none)."""
        d, g = local_arrays(self)
        t = Tensor._wrap(d)
        if g is not None:
            t.grad = Tensor._wrap(g)
        return t

    def __repr__(self) -> str:
        return "Parameter containing:\n" + super().__repr__()


def local_arrays(p: Any):
    """``(param array, grad array or None)``: the piece of ``p`` an optimizer updates in place on this rank.

    A parameter held in another buffer (an FSDP flat chunk: ``p._local_owner = (owner, index)``) is that
    buffer's piece (``owner.piece(index)``); any other Tensor is its ``.data`` and ``.grad``.  A parameter a
    transform replaced by another object (``p._replaced``) raises, naming the fix.
    """
    d = getattr(p, "__dict__", None)
    if d:
        owner = d.get("_local_owner")
        if owner is not None:
            return owner[0].piece(owner[1])
        why = d.get("_replaced")
        if why is not None:
            raise RuntimeError(why)
    g = p.grad
    return p.data, (None if g is None else g.data)
