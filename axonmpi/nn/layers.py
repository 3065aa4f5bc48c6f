"""Standard layers: Linear, Embedding, LayerNorm, Dropout, activations, Identity, Flatten."""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Callable, Iterator, Sequence, Union

import numpy as np

from ..autograd import ops, ops_nn
from ..autograd.tensor import Tensor
from ..backend import as_device
from . import init
from .module import Module
from .parameter import Parameter

__all__ = [
    "Dropout", "Embedding", "Flatten", "GELU", "Identity", "LayerNorm", "Linear", "ReLU", "SiLU",
    "Sigmoid", "Softmax", "Tanh",
]


def _param(shape, dtype, device) -> Parameter:
    """An uninitialised host parameter; ``_finish`` moves it to ``device`` after init."""
    return Parameter(np.empty(shape, np.float32 if dtype is None else np.dtype(dtype)))


# Set only by ``axonmpi.parallel.auto_parallelize`` for the duration of its ``with`` block:
# a callable (in_features, out_features, bias=, dtype=, device=) -> Module or None (None: build a plain Linear).
_linear_factory: contextvars.ContextVar = contextvars.ContextVar("axonmpi_linear_factory", default=None)


@contextlib.contextmanager
def linear_factory(factory: Callable) -> Iterator[None]:
    """While the block runs, ``nn.Linear(...)`` calls ``factory(in_features, out_features, bias=, dtype=,
    device=)`` and returns what it gives (``None``: a plain Linear).  ``auto_parallelize`` uses it.

    Example:
        >>> with linear_factory(lambda i, o, **kw: None):
        ...     lin = Linear(4, 2)          # a plain Linear
    """
    token = _linear_factory.set(factory)
    try:
        yield
    finally:
        _linear_factory.reset(token)


def _to_device(module: Module, device) -> None:
    if device is not None and as_device(device).type != "cpu":
        module.to(device)


class Linear(Module):
    """``y = x @ weight.T + bias`` with ``weight`` of shape (out_features, in_features).

    Init (PyTorch's): weight ~ kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)),
    bias ~ U(-1/sqrt(in), 1/sqrt(in)).

    Example:
        >>> fc = Linear(784, 10, dtype="float64")
        >>> fc.weight.shape
        (10, 784)
    """

    def __new__(cls, *args, **kwargs):
        factory = _linear_factory.get()
        if factory is not None and cls is Linear and (args or kwargs):
            made = factory(*args, **kwargs)
            if made is not None:
                return made
        return super().__new__(cls)

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 dtype=None, device=None):
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.weight = _param((out_features, in_features), dtype, device)
        self.bias = _param((out_features,), dtype, device) if bias else None
        if not bias:
            self.register_parameter("bias", None)
        self.reset_parameters()
        _to_device(self, device)

    def reset_parameters(self) -> None:
        """Re-draw the parameters with the layer's default initialization."""
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
            init.uniform_(self.bias, -bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if x.dtype != w.dtype and ops_nn.dtype_refused(x.dtype, w.dtype):
            raise ops_nn.DtypeMismatchError(ops_nn.dtype_mismatch(self, x, w))
        return ops_nn.Linear.apply(x, w, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


class Embedding(Module):
    """A lookup table of ``num_embeddings`` rows of size ``embedding_dim`` (init N(0, 1)).

    Args:
        num_embeddings, embedding_dim: the table's shape.
        padding_idx: a row initialised to zeros that receives no gradient (PyTorch's rule).
        dtype, device: of the weight.

    Example:
        >>> emb = Embedding(10, 4, padding_idx=0)
        >>> emb([[1, 2], [0, 9]]).shape
        (2, 2, 4)
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx=None, dtype=None, device=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        if padding_idx is not None:
            if not -self.num_embeddings <= int(padding_idx) < self.num_embeddings:
                raise ValueError(f"Embedding padding_idx={padding_idx} must be within "
                                 f"[-{self.num_embeddings}, {self.num_embeddings - 1}]")
            padding_idx = int(padding_idx) % self.num_embeddings
        self.padding_idx = padding_idx
        self.weight = _param((num_embeddings, embedding_dim), dtype, device)
        self.reset_parameters()
        _to_device(self, device)

    def reset_parameters(self) -> None:
        """Re-draw the parameters with the layer's default initialization (padding row zero)."""
        init.normal_(self.weight)
        if self.padding_idx is not None:
            self.weight.data[self.padding_idx] = 0

    def forward(self, idx) -> Tensor:
        return ops_nn.embedding(idx, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}"


class LayerNorm(Module):
    """Layer normalization over the trailing ``normalized_shape`` (weight ones, bias zeros)."""

    def __init__(self, normalized_shape: Union[int, Sequence[int]], eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, dtype=None, device=None):
        super().__init__()
        if isinstance(normalized_shape, (int, np.integer)):
            normalized_shape = (int(normalized_shape),)
        self.normalized_shape, self.eps = tuple(normalized_shape), float(eps)
        self.elementwise_affine = elementwise_affine
        self.weight = _param(self.normalized_shape, dtype, device) if elementwise_affine else None
        self.bias = _param(self.normalized_shape, dtype, device) if elementwise_affine and bias else None
        if self.weight is None:
            self.register_parameter("weight", None)
        if self.bias is None:
            self.register_parameter("bias", None)
        self.reset_parameters()
        _to_device(self, device)

    def reset_parameters(self) -> None:
        """Re-draw the parameters with the layer's default initialization."""
        if self.weight is not None:
            init.ones_(self.weight)
        if self.bias is not None:
            init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if w is not None and x.dtype != w.dtype and ops_nn.dtype_refused(x.dtype, w.dtype):
            raise ops_nn.DtypeMismatchError(ops_nn.dtype_mismatch(self, x, w))
        return ops_nn.LayerNorm.apply(x, w, self.bias, len(self.normalized_shape), self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class Dropout(Module):
    """Zero elements with probability ``p`` in training mode; identity in eval mode."""

    def __init__(self, p: float = 0.5, inplace: bool = False):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1], got {p}")
        self.p = float(p)
        self.inplace = _inplace_flag("Dropout", inplace)

    def forward(self, x: Tensor) -> Tensor:
        return ops_nn.dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def _inplace_flag(name: str, inplace) -> bool:
    if inplace not in (False, True):
        raise TypeError(f"{name}: inplace must be a bool, got {inplace!r}")
    return bool(inplace)


class ReLU(Module):
    """``max(x, 0)``; ``inplace`` is accepted for PyTorch compatibility (results are new tensors)."""

    def __init__(self, inplace: bool = False):
        super().__init__()
        self.inplace = _inplace_flag("ReLU", inplace)

    def forward(self, x):
        return ops_nn.ReLU.apply(x)


class GELU(Module):
    """GELU, exact (``approximate="none"``) or tanh-approximated."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x):
        return ops_nn.GELU.apply(x, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class SiLU(Module):
    """``x * sigmoid(x)``; ``inplace`` as in :class:`ReLU`."""

    def __init__(self, inplace: bool = False):
        super().__init__()
        self.inplace = _inplace_flag("SiLU", inplace)

    def forward(self, x):
        return ops_nn.SiLU.apply(x)


class Tanh(Module):
    """Elementwise hyperbolic tangent."""

    def forward(self, x):
        return ops.tanh(x)


class Sigmoid(Module):
    """Elementwise logistic function."""

    def forward(self, x):
        return ops_nn.Sigmoid.apply(x)


class Softmax(Module):
    """Softmax along ``dim`` (default: the last)."""

    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return ops_nn.Softmax.apply(x, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class Identity(Module):
    """Returns its input unchanged."""

    def forward(self, x):
        return x


class Flatten(Module):
    """Flatten dims ``start_dim..end_dim`` (default: all but the batch dim)."""

    def __init__(self, start_dim: int = 1, end_dim: int = -1):
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, x):
        return ops.flatten(x, self.start_dim, self.end_dim)
