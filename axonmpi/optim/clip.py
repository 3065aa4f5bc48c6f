"""Gradient clipping by total norm or by value, in place, optionally over a process group."""
from __future__ import annotations

import math
import numbers
from typing import Any, Iterable, List, Optional, Union

import numpy as np

from ..backend import get_array_module

__all__ = ["clip_grad_norm_", "clip_grad_value_", "grad_norm"]

Params = Union[Any, Iterable[Any]]


def _grads(parameters: Params) -> List[Any]:
    """Gradient arrays of the parameters that have one (a single Tensor is accepted)."""
    if hasattr(parameters, "data") and hasattr(parameters, "grad"):
        parameters = [parameters]
    return [p.grad.data for p in parameters if p.grad is not None]


def _partial_norm(grads: List[Any], p: float) -> Any:
    """sum(|g|^p) over all grads (max(|g|) for p = inf) as a float64 0-d array on the grads' device."""
    xp = get_array_module(grads[0])
    parts = []
    for g in grads:
        if g.dtype.itemsize < 4 and g.dtype.kind == "f":
            g = g.astype(np.float32)  # 16-bit sums overflow and lose precision
        if p == math.inf:
            part = xp.abs(g).max() if g.size else xp.zeros((), g.dtype)
        elif p == 2.0:
            flat = g.reshape(-1)
            part = xp.vdot(flat, flat)  # one pass, no temporaries
        elif p == 1.0:
            part = xp.abs(g).sum()
        else:
            part = (xp.abs(g) ** p).sum()
        parts.append(xp.asarray(part, dtype=np.float64))
    stacked = xp.stack(parts)
    return stacked.max() if p == math.inf else stacked.sum()


def grad_norm(parameters: Params, norm_type: float = 2.0, group: Optional[Any] = None) -> float:
    """Total ``norm_type``-norm of all gradients, as if they were one vector (see :func:`clip_grad_norm_`)."""
    p = float(norm_type)
    if not (p > 0):
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type!r}")
    grads = _grads(parameters)
    partial = _partial_norm(grads, p) if grads else None
    if group is not None:
        from ..distributed import ReduceOp, all_reduce

        local = np.zeros(1) if partial is None else np.asarray(float(partial)).reshape(1)
        total = float(all_reduce(local, ReduceOp.MAX if p == math.inf else ReduceOp.SUM, group)[0])
    else:
        total = 0.0 if partial is None else float(partial)
    return total if p == math.inf else total ** (1.0 / p)


def clip_grad_norm_(parameters: Params, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, group: Optional[Any] = None) -> float:
    """Scale all gradients in place so that their total norm is at most ``max_norm`` (PyTorch's rule).

    The norm is taken over all gradients concatenated into one vector. When it exceeds
    ``max_norm`` every gradient is multiplied by ``max_norm / (total_norm + 1e-6)``.

    Args:
        parameters: a Tensor or an iterable of Tensors; those without ``.grad`` are skipped.
        max_norm: the largest allowed norm (>= 0).
        norm_type: p of the p-norm (> 0), or ``math.inf`` for the max-abs norm.
        error_if_nonfinite: raise RuntimeError when the total norm is nan or inf
            (otherwise the gradients are scaled by a nan/0 coefficient, as in PyTorch).
        group: a :class:`~axonmpi.distributed.ProcessGroup` over which the parameters are
            *sharded* (tensor parallel, ZeRO/FSDP shards): the sum of ``|g|^p`` (max for
            inf) is all-reduced over it, so every rank clips with the same global norm.
            ``None`` (default) uses the local gradients only; do not pass a group whose
            ranks hold replicated gradients (e.g. plain data parallel), or they count
            several times.

    Returns:
        The total norm before clipping, as a Python float.

    Example:
        >>> loss.backward()
        >>> norm = clip_grad_norm_(model.parameters(), max_norm=1.0)
        >>> opt.step()
    """
    if not isinstance(max_norm, numbers.Real) or not max_norm >= 0:
        raise ValueError(f"max_norm must be a number >= 0, got {max_norm!r}")
    if not isinstance(parameters, (list, tuple)) and not hasattr(parameters, "grad"):
        parameters = list(parameters)  # a generator is read twice
    total = grad_norm(parameters, norm_type, group)
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is {total}, so they cannot be clipped; "
            "pass error_if_nonfinite=False to clip anyway"
        )
    coef = max_norm / (total + 1e-6)
    if not coef >= 1.0:  # also true for nan, which then propagates into the grads like PyTorch
        for g in _grads(parameters):
            g *= coef
    return total


def clip_grad_value_(parameters: Params, clip_value: float) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]`` in place.

    Example:
        >>> clip_grad_value_(model.parameters(), 0.5)
    """
    if not isinstance(clip_value, numbers.Real) or not clip_value >= 0:
        raise ValueError(f"clip_value must be a number >= 0, got {clip_value!r}")
    for g in _grads(parameters):
        get_array_module(g).clip(g, -clip_value, clip_value, out=g)
