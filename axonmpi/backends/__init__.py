"""``torch.backends``'s path: the float32 matmul precision switches PyTorch scripts set.

``torch.backends.cuda.matmul.allow_tf32 = True``, ``torch.backends.cudnn.allow_tf32 = True`` and
``torch.set_float32_matmul_precision("high")`` are accepted. On the CPU (NumPy) they change nothing: NumPy's
float32 GEMMs are always full float32. On a GPU (CuPy) ``matmul.allow_tf32`` and the precision map onto CuPy's
compute type for float32 GEMMs (TF32 tensor cores for ``"high"`` / ``"medium"``, plain float32 for
``"highest"``), the switch ``CUPY_TF32=1`` sets at start-up. ``cudnn.allow_tf32`` is accepted and has no effect
(axonmpi calls no cuDNN convolution).

Example:
    >>> import axonmpi as torch
    >>> torch.backends.cuda.matmul.allow_tf32 = True      # no-op on the CPU
    >>> torch.get_float32_matmul_precision()
    'high'
"""
from __future__ import annotations

from . import cuda, cudnn
from ._precision import get_float32_matmul_precision, set_float32_matmul_precision

__all__ = ["cuda", "cudnn", "get_float32_matmul_precision", "set_float32_matmul_precision"]
