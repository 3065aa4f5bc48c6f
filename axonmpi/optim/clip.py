"""Gradient clipping by total norm (over sharded and replicated parameters) or by value, in place."""
from __future__ import annotations

import math
import numbers
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import numpy as np

from ..backend import get_array_module

__all__ = ["clip_grad_norm_", "clip_grad_value_", "grad_norm", "shard_group_of"]

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


_UNSET = object()


def shard_group_of(param: Any, default: Optional[Any] = None) -> Optional[Any]:
    """The process group over which ``param`` is sharded, read from its attributes.

    * ``param.shard_group = group`` (or ``None`` for replicated: every rank holds the same values);
    * else AxoNN's tags, as the tensor-parallel layers set them: ``is_tensor_parallel`` True means
      sharded over ``process_group_for_norm_reduction``, False means replicated;
    * else ``default``.

    Strategies tag the parameters they shard (AxoNN's parameter attributes), so generic code such
    as :func:`clip_grad_norm_` works on any model.

    Example:
        >>> p = Parameter(np.zeros(4))
        >>> p.shard_group = world.default_group    # each rank holds a different slice
        >>> shard_group_of(p) is world.default_group
        True
    """
    g = getattr(param, "shard_group", _UNSET)
    if g is not _UNSET:
        return g
    tp = getattr(param, "is_tensor_parallel", _UNSET)
    if tp is not _UNSET:
        return getattr(param, "process_group_for_norm_reduction", None) if tp else None
    return default


def _plan(parameters: Params, group: Optional[Any]):
    """Split the parameters by the group that shards them, in order of first appearance.

    Returns ``(replicated grads, [(group, grads), ...])``.  Every parameter counts when the
    groups are collected (with or without a gradient), so each rank of a group takes part in the
    group's reduction even when it holds no gradient for it.
    """
    if hasattr(parameters, "data") and hasattr(parameters, "grad"):
        parameters = [parameters]
    local: List[Any] = []
    sharded: Dict[int, Tuple[Any, List[Any]]] = {}
    for p in parameters:
        g = shard_group_of(p, group)
        if g is not None and getattr(g, "size", 2) == 1:
            g = None  # a group of one rank: the shard is the whole tensor
        if g is None:
            if p.grad is not None:
                local.append(p.grad.data)
            continue
        entry = sharded.setdefault(id(g), (g, []))
        if p.grad is not None:
            entry[1].append(p.grad.data)
    return local, list(sharded.values())


def grad_norm(parameters: Params, norm_type: float = 2.0, group: Optional[Any] = None) -> float:
    """Total ``norm_type``-norm of all gradients of a model whose parameters may be partly sharded.

    Each gradient element of the global model counts exactly once: replicated parameters locally,
    sharded ones summed (max for inf) over the group that shards them -- never over replicas.
    See :func:`clip_grad_norm_` for ``group`` and the ``shard_group`` parameter attribute.

    Example:
        >>> grad_norm(model.parameters())          # the 2-norm of all gradients as one vector
    """
    p = float(norm_type)
    if not (p > 0):
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type!r}")
    inf = p == math.inf
    local, sharded = _plan(parameters, group)
    total = float(_partial_norm(local, p)) if local else 0.0
    if sharded:
        from ..distributed import ReduceOp, all_reduce

        op = ReduceOp.MAX if inf else ReduceOp.SUM
        for g, grads in sharded:
            value = float(_partial_norm(grads, p)) if grads else 0.0
            if inf:  # MPI's MAX drops a NaN (as Python's max does): send "is NaN" beside the value
                nan = math.isnan(value)
                part = all_reduce(np.array([0.0 if nan else value, float(nan)]), op, g)
                reduced = math.nan if part[1] > 0 else float(part[0])
                total = _nan_max(total, reduced)
            else:
                total += float(all_reduce(np.array([value]), op, g)[0])
    return total if inf else total ** (1.0 / p)


def _nan_max(a: float, b: float) -> float:
    """``max`` that propagates NaN from either side (Python's drops it from the second)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def clip_grad_norm_(parameters: Params, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: Optional[bool] = None, *,
                    group: Optional[Any] = None) -> float:
    """Scale all gradients in place so that their total norm is at most ``max_norm`` (PyTorch's rule).

    The norm is that of all gradient elements of the *global* model concatenated into one vector.
    When it exceeds ``max_norm`` every gradient is multiplied by ``max_norm / (total_norm + 1e-6)``.

    Sharded and replicated parameters mix freely: a parameter whose elements are split over a
    process group (tensor parallel, FSDP/ZeRO shards) says so with the attribute
    ``param.shard_group = group`` or AxoNN's ``is_tensor_parallel`` / ``process_group_for_norm_reduction``
    tags (see :func:`shard_group_of`), or inherits ``group`` below; its
    ``|g|^p`` is summed over that group (max for inf).  A replicated parameter (plain data
    parallel, LayerNorm inside a tensor-parallel block) counts once, from the local copy -- it
    is never summed over its replicas.  Every rank of a sharding group must pass the parameters
    of that group in the same order (one all-reduce per distinct group, in order of first
    appearance); parameters without ``.grad`` contribute nothing but still take part.

    Args:
        parameters: a Tensor or an iterable of Tensors; those without ``.grad`` are skipped.
        max_norm: the largest allowed norm (>= 0).
        norm_type: p of the p-norm (> 0), or ``math.inf`` for the max-abs norm.
        error_if_nonfinite: raise RuntimeError when the total norm is nan or inf
            (otherwise the gradients are scaled by a nan/0 coefficient, as in PyTorch).
        foreach: accepted for PyTorch compatibility; the computation is the same either way.
        group: the :class:`~axonmpi.distributed.ProcessGroup` that shards every parameter
            without a ``shard_group`` attribute; ``None`` (default): such parameters are
            replicated (local gradients only).

    Returns:
        The total norm before clipping, as a Python float.

    Example:
        >>> loss.backward()
        >>> norm = clip_grad_norm_(model.parameters(), max_norm=1.0)
        >>> opt.step()
        >>> # Megatron-style: column-parallel weights sharded over the tensor group, LayerNorm replicated
        >>> for p in column_parallel.parameters():
        ...     p.shard_group = tp_group
        >>> norm = clip_grad_norm_(model.parameters(), 1.0)   # the norm of the unsharded model
    """
    if not isinstance(max_norm, numbers.Real) or not max_norm >= 0:
        raise ValueError(f"max_norm must be a number >= 0, got {max_norm!r}")
    if foreach not in (None, True, False):
        raise ValueError(f"foreach must be None, True or False, got {foreach!r}")
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
