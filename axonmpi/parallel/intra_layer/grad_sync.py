"""Gradient reduction and clipping for models holding AxoNN 3-D layers (driven by parameter tags).

Tags (set by the layers): ``is_tensor_parallel``; ``needs_depth_parallel_gradient_sync`` (biases,
replicated over depth); ``process_group_for_norm_reduction`` (the group over which a shard's
squared norm is summed so each element counts once).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterable, Optional, Union

from ...autograd import no_grad
from ...autograd.tensor import Tensor
from ...optim.clip import clip_grad_norm_ as _clip_grad_norm
from ..grad_sync import GradReducer, reduction_groups
from ..tensor.groups import TensorParallelGroups, default_groups

__all__ = ["clip_grad_norm_", "no_grad_sync", "sync_gradients"]

_NO_SYNC = contextvars.ContextVar("axonmpi_intra_layer_no_grad_sync", default=False)


@contextlib.contextmanager
def no_grad_sync():
    """Inside this context :func:`sync_gradients` does nothing (gradient accumulation steps).

    Example:
        >>> with no_grad_sync():
        ...     loss.backward(); sync_gradients(model)     # skipped
    """
    token = _NO_SYNC.set(True)
    try:
        yield
    finally:
        _NO_SYNC.reset(token)


def sync_gradients(model, mean: bool = False, *, groups: Optional[TensorParallelGroups] = None) -> None:
    """Sum gradients over the replicas (AxoNN's rule), so every rank holds the full batch's gradient.

    * 3-D weights (already reduce-scattered over depth in the layer): all-reduce over data.
    * 3-D biases (replicated over depth): all-reduce over data and depth.
    * every other parameter (data parallel over all ranks in easy mode): all-reduce over data
      and the tensor block (the table of :mod:`axonmpi.parallel.grad_sync`).

    Args:
        model: the module (or an iterable of its parameters, e.g. one pipeline stage's).
        mean: divide by the number of replica ranks (the mean over every rank's rows).
        groups: the :class:`TensorParallelGroups` the model's layers were built with (default:
            ``default_groups()``, the current grid's).

    Example:
        >>> loss.backward(); sync_gradients(model); opt.step()
    """
    if _NO_SYNC.get():
        return
    g = default_groups() if groups is None else groups
    params = model.parameters() if hasattr(model, "parameters") else model
    red = GradReducer("axonn.sync_gradients")       # the one reducer, bucketed over each parameter's groups
    red.after_backward(params, lambda p: reduction_groups(p, g.data, (g.intra,), g.depth),
                       1.0 / g.replica_size if mean else 1.0)
    with no_grad():
        red.run()


def clip_grad_norm_(parameters: Union[Tensor, Iterable[Tensor]], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> float:
    """Clip the gradients so that the norm of the whole (unsharded) gradient is at most ``max_norm``.

    AxoNN's name for :func:`axonmpi.optim.clip_grad_norm_`, which reads the layers' AxoNN tags:
    each shard's ``norm_type``-th power is summed over its ``process_group_for_norm_reduction``
    (each element once, max for ``math.inf``); replicated parameters count once. Returns the total
    norm before clipping.

    Example:
        >>> total = clip_grad_norm_(model.parameters(), 1.0)
    """
    return _clip_grad_norm(parameters, max_norm, norm_type, error_if_nonfinite)
