"""The kernel layer: every fused op once, forward and backward side by side, one implementation per array module.

Host (NumPy) arrays take the ``numba`` path (fused loops, ``pip install 'axonmpi[fast]'``) where numba imports,
else the ``numpy`` path (ufuncs in place); ``AXONMPI_KERNELS=numpy|numba`` forces one (:func:`host_path`).
CuPy arrays take CuPy kernels (:mod:`axonmpi.kernels._cupy`: sources as data, compiled on first use). The
autograd ops call these functions; nothing above this layer branches on the device or the path.
"""
from __future__ import annotations

from ._select import host_path, numba_available, use_numba
from .attention import (causal_lengths, exp_minus_lse, lse_softmax_backward, masked_softmax_backward,
                        masked_softmax_forward, online_softmax_block, prefix_lengths)
from .activations import (erf_float32, exp_backward, exp_forward, gelu_backward, gelu_forward, relu_backward,
                          relu_forward, sigmoid_backward, sigmoid_forward, silu_backward, silu_forward,
                          swiglu_backward, swiglu_forward, tanh_backward, tanh_forward)
from .dropout import dropout_backward, dropout_forward
from .embedding import embedding_backward, permute_rows_backward, permute_rows_forward, scatter_add_rows
from .norms import layer_norm_backward, layer_norm_forward, rms_norm_backward, rms_norm_forward
from .optim import adam_coefficients, adam_update, adam_update_multi, clip_by_total_norm_, grad_norm_partial
from .rotary import rotary_backward, rotary_forward
from .softmax import (cross_entropy_backward, cross_entropy_forward, log_softmax_backward, log_softmax_forward,
                      softmax_backward, softmax_forward, sum_keep)

__all__ = ["host_path", "numba_available", "use_numba", "describe",
           "erf_float32", "exp_backward", "exp_forward", "gelu_backward", "gelu_forward", "relu_backward",
           "relu_forward", "sigmoid_backward", "sigmoid_forward", "silu_backward", "silu_forward",
           "swiglu_backward", "swiglu_forward", "tanh_backward", "tanh_forward",
           "dropout_backward", "dropout_forward", "embedding_backward", "permute_rows_backward",
           "permute_rows_forward", "scatter_add_rows",
           "layer_norm_backward", "layer_norm_forward", "rms_norm_backward", "rms_norm_forward",
           "adam_coefficients", "adam_update", "adam_update_multi", "clip_by_total_norm_", "grad_norm_partial",
           "rotary_backward", "rotary_forward",
           "cross_entropy_backward", "cross_entropy_forward", "log_softmax_backward", "log_softmax_forward",
           "softmax_backward", "softmax_forward", "sum_keep",
           "causal_lengths", "exp_minus_lse", "lse_softmax_backward", "masked_softmax_backward",
           "masked_softmax_forward", "online_softmax_block", "prefix_lengths"]


def describe() -> str:
    """One line for ``axonmpi info``: the host path, numba's version where it imports, and the GPU's kernels."""
    if host_path() == "numba":
        import numba
        host = f"numba {numba.__version__} fused loops (float32/float64; other dtypes: NumPy ufuncs)"
    else:
        why = "AXONMPI_KERNELS=numpy" if numba_available() else "numba not installed: pip install 'axonmpi[fast]'"
        host = f"NumPy ufuncs in place ({why})"
    return f"{host}; CuPy arrays: CuPy Elementwise kernels"
