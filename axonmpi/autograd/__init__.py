"""Autograd: ``Tensor``, ``Function``, gradient modes, ops and ``gradcheck``."""
from __future__ import annotations

from . import ops, ops_nn
from .function import Function, RemovableHandle, backward, backward_depth, queue_callback
from .grad_mode import enable_grad, is_grad_enabled, no_grad, set_grad_enabled
from .gradcheck import gradcheck
from .tensor import (Tensor, arange, empty, full, ones, ones_like, rand, randn, tensor, zeros,
                     zeros_like)

__all__ = [
    "Function", "RemovableHandle", "Tensor", "arange", "backward", "backward_depth", "empty", "enable_grad", "full",
    "gradcheck", "is_grad_enabled", "no_grad", "ones", "ones_like", "ops", "ops_nn", "rand", "randn",
    "queue_callback", "set_grad_enabled", "tensor", "zeros", "zeros_like",
]
