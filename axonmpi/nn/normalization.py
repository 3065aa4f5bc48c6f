"""Root-mean-square layer normalization (``nn.RMSNorm``, PyTorch's name and arguments)."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np

from ..autograd import ops_llama, ops_nn
from ..autograd.tensor import Tensor
from . import init
from .layers import _param, _to_device
from .module import Module

__all__ = ["RMSNorm"]


class RMSNorm(Module):
    """``x / sqrt(mean(x**2) + eps) * weight`` over the trailing ``normalized_shape`` (PyTorch's
    ``nn.RMSNorm``; transformers' ``LlamaRMSNorm`` with ``eps=rms_norm_eps``).

    Args:
        normalized_shape: the trailing shape normalized over (an int: the last dimension).
        eps: added to the mean square; ``None`` (torch's default) is the machine epsilon of the
            input's dtype (``np.finfo(dtype).eps``).
        elementwise_affine: a learnable ``weight`` of ``normalized_shape`` (init ones); no bias.
        dtype, device: of the weight.

    Example:
        >>> norm = RMSNorm(64, eps=1e-6)
        >>> norm(x).shape == x.shape
        True
    """

    def __init__(self, normalized_shape: Union[int, Sequence[int]], eps: Optional[float] = None,
                 elementwise_affine: bool = True, device=None, dtype=None):
        super().__init__()
        if isinstance(normalized_shape, (int, np.integer)):
            normalized_shape = (int(normalized_shape),)
        self.normalized_shape = tuple(int(s) for s in normalized_shape)
        if eps is not None and not float(eps) >= 0:
            raise ValueError(f"RMSNorm: eps must be >= 0 or None, got {eps!r}")
        self.eps = None if eps is None else float(eps)
        self.elementwise_affine = bool(elementwise_affine)
        self.weight = _param(self.normalized_shape, dtype, device) if elementwise_affine else None
        if self.weight is None:
            self.register_parameter("weight", None)
        self.reset_parameters()
        _to_device(self, device)

    def reset_parameters(self) -> None:
        """Set the weight to ones."""
        if self.weight is not None:
            init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if w is not None and x.dtype != w.dtype and ops_nn.dtype_refused(x.dtype, w.dtype):
            raise ops_nn.DtypeMismatchError(ops_nn.dtype_mismatch(self, x, w))
        return ops_llama.rms_norm(x, self.normalized_shape, w, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
