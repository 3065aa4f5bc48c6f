"""Gradient clipping by total norm (over sharded and replicated parameters) or by value, in place."""
from __future__ import annotations

import math
import numbers
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import numpy as np

from ..backend import get_array_module

__all__ = ["clip_grad_norm_", "clip_grad_norm_array_", "clip_grad_value_", "grad_norm", "grad_norm_array",
           "shard_group_of"]

Params = Union[Any, Iterable[Any]]


class _Held(list):
    """What :func:`_held` returned (a second call gives it back as it is)."""


def _held(parameters: Params) -> List[Any]:
    """The parameters as a list, each one held in another buffer (an original parameter inside an FSDP flat
    chunk, [Note: a parameter keeps its identity]) replaced by that buffer, listed once: its gradient lives
    there, with the buffer's placement."""
    if type(parameters) is _Held:
        return parameters
    if hasattr(parameters, "data") and hasattr(parameters, "grad"):
        parameters = [parameters]
    out, seen = _Held(), set()
    for p in parameters:
        d = getattr(p, "__dict__", None)
        owner = d.get("_local_owner") if d else None
        q = p if owner is None else owner[0]
        if id(q) not in seen:
            seen.add(id(q))
            out.append(q)
    return out


def _grads(parameters: Params) -> List[Any]:
    """Gradient arrays of the parameters that have one (a single Tensor is accepted)."""
    return [p.grad.data for p in _held(parameters) if p.grad is not None]




def shard_group_of(param: Any, default: Optional[Any] = None) -> Optional[Any]:
    """The process group over which ``param`` is sharded, read through :func:`~axonmpi.distributed.placement_of`
    (the one reader of placements and tags).

    * its placement (``set_placement``): its first shard group that is not a pipeline stage;
    * else ``param.shard_group = group`` (or ``None`` for replicated: every rank holds the same values);
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
    from ..distributed.placement import Placement, ShardKind, placement_of
    none = Placement()
    pl = placement_of(param, none)      # the one reader: a placement, else ``shard_group``, else AxoNN's tags
    if pl is none:
        return default
    groups = [s.group for s in pl.shards if s.kind is not ShardKind.STAGE]
    return groups[0] if groups else None


def _domain(group: Optional[Any]):
    """The group whose ranks hold different parameters (pipeline stages): ``group`` if given, else
    the grid's pipeline group when it has more than one rank, else ``None``.  Every rank of it
    takes part in the last sum, whether it holds parameters or not."""
    if group is not None:
        from ..distributed import resolve_group
        return resolve_group(group)
    from ..distributed import get_world, is_initialized
    if not is_initialized():
        return None
    grid = get_world().grid
    return grid.inter_group if grid.G_inter > 1 else None


def _plan(parameters: Params, group: Optional[Any], domain: Optional[Any]):
    """Split the gradients by the groups that shard their parameters (their placements).

    Returns ``(replicated grads, grads split over the domain only, [(groups, grads), ...])``: the
    last list is keyed by the groups other than the domain that split them, in order of first
    appearance; those split over the domain as well are marked with a trailing ``True``.  Every
    parameter counts when the groups are collected (with or without a gradient), so each rank
    of a group takes part in the group's reduction even when it holds no gradient for it.
    """
    from ..distributed.placement import Placement, Shard, ShardKind, placement_of

    parameters = _held(parameters)
    default = Placement(shards=(Shard(group, ShardKind.STAGE),)) if group is not None else None
    dranks = domain.ranks if domain is not None and domain.size > 1 else None
    local: List[Any] = []
    staged: List[Any] = []
    outer: Dict[Tuple[Any, ...], Tuple[Tuple[Any, ...], bool, List[Any]]] = {}
    def add(groups, grads):
        on_domain = dranks is not None and any(g.ranks == dranks for g in groups)
        groups = tuple(g for g in groups if dranks is None or g.ranks != dranks)
        if not groups:
            (staged if on_domain else local).extend(grads)
            return
        entry = outer.setdefault(tuple(id(g) for g in groups) + (on_domain,), (groups, on_domain, []))
        entry[2].extend(grads)

    for p in parameters:
        pl = placement_of(p, default)
        if group is not None and getattr(p, "placement", None) is pl \
                and not any(g.ranks == group.ranks for g in pl.shard_groups + pl.replica_groups):
            pl = pl.with_shard(Shard(group, ShardKind.STAGE))   # a strategy's shard on one stage of ``group``
        if not pl.counted:                   # a later stage's copy of a tied weight: counted on the first
            add(pl.shard_groups, [])
            continue
        inner = getattr(p, "params", None) if callable(getattr(p, "segments", None)) else None
        if inner and any(placement_of(q).shard_groups for q in inner):
            # an FSDP chunk of tensor-parallel shards: each original parameter's elements also over its
            # own groups; every original parameter makes its bucket, so ranks agree on the buckets
            slices: Dict[int, List[Any]] = {}
            if p.grad is not None:
                for seg in p.segments():
                    slices.setdefault(seg.index, []).append(seg.in_chunk(p.grad.data))
            for i, q in enumerate(inner):
                extra = tuple(g for g in placement_of(q).shard_groups
                              if not any(g.ranks == h.ranks for h in pl.shard_groups))
                add(pl.shard_groups + extra, slices.get(i, []))
            continue
        add(pl.shard_groups, [] if p.grad is None else [p.grad.data])
    return local, staged, list(outer.values())


def _power_sum(parameters: Params, p: float, group: Optional[Any]):
    """``sum |g|^p`` over every gradient element of the global model (``max |g|`` for inf) as a 0-d float64 array
    on the parameters' device: partial sums per placement, reduced over the groups that split them, nothing read
    back to the host (a MAX reduction sends "is NaN" beside the value: MPI's MAX drops a NaN)."""
    from .. import kernels as K

    inf = p == math.inf
    domain = _domain(group)
    local, staged, outer = _plan(parameters, group, domain)
    held = _held(parameters)
    xp = get_array_module(held[0].data) if held else np

    def add(a, b):
        return xp.maximum(a, b) if inf else a + b      # maximum propagates NaN from either side

    total = K.grad_norm_partial(local, p, xp)
    across = K.grad_norm_partial(staged, p, xp)        # summed over the domain below
    if outer or domain is not None:
        from ..distributed import ReduceOp, all_reduce

        def reduce(value, g):
            if inf:
                nan = xp.isnan(value)
                r = all_reduce(xp.stack([xp.where(nan, 0.0, value), nan.astype(np.float64)]), ReduceOp.MAX, g)
                return xp.where(r[1] > 0, xp.nan, r[0])
            return all_reduce(value.reshape(1), ReduceOp.SUM, g)[0]

        for groups, on_domain, grads in outer:
            value = K.grad_norm_partial(grads, p, xp)
            for g in groups:
                value = reduce(value, g)
            if on_domain:
                across = add(across, value)
            else:
                total = add(total, value)
        if domain is not None and domain.size > 1:   # every rank of the domain, with parameters or not
            across = reduce(across, domain)
    return add(total, across)


def _norm_type(norm_type: float) -> float:
    p = float(norm_type)
    if not (p > 0):
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type!r}")
    return p


def grad_norm(parameters: Params, norm_type: float = 2.0, group: Optional[Any] = None) -> float:
    """Total ``norm_type``-norm of all gradients of a model whose parameters may be partly sharded.

    Each gradient element of the global model counts exactly once, read from the parameters'
    placements (:func:`~axonmpi.distributed.placement_of`): sharded parts summed (max for inf)
    over the groups that shard them, replicated ones counted once -- never over replicas.
    See :func:`clip_grad_norm_` for ``group``; :func:`grad_norm_array` gives it without a host read.

    Example:
        >>> grad_norm(model.parameters())          # the 2-norm of all gradients as one vector
    """
    p = _norm_type(norm_type)
    total = float(_power_sum(_held(parameters), p, group))
    return total if p == math.inf else total ** (1.0 / p)


def grad_norm_array(parameters: Params, norm_type: float = 2.0, group: Optional[Any] = None):
    """:func:`grad_norm` as a 0-d float64 array on the gradients' device, with no host sync (a step that logs it
    reads it when it logs; a captured step keeps it on the device).

    Example:
        >>> norm = grad_norm_array(model.parameters())     # float(norm) only when logged
    """
    p = _norm_type(norm_type)
    total = _power_sum(_held(parameters), p, group)
    xp = get_array_module(total)
    if p != math.inf:
        total = xp.sqrt(total) if p == 2.0 else total ** (1.0 / p)
    return xp.asarray(total, dtype=np.float64)       # a 0-d array (NumPy's ufuncs give scalars)


def clip_grad_norm_array_(parameters: Params, max_norm: float, norm_type: float = 2.0, *,
                          group: Optional[Any] = None):
    """:func:`clip_grad_norm_` without a host sync: the norm computed and reduced on the gradients' device, the
    gradients scaled by ``min(max_norm / (norm + 1e-6), 1)`` as an array operation (a NaN norm makes them NaN,
    as torch's), the norm returned as a 0-d float64 array. ``error_if_nonfinite`` is not offered (it needs the
    host to look at the norm): check ``float(norm)`` where the step is logged.

    Example:
        >>> norm = clip_grad_norm_array_(model.parameters(), 1.0)
        >>> opt.step()                                         # no host round trip in between
    """
    from .. import kernels as K

    if not isinstance(max_norm, numbers.Real) or not max_norm >= 0:
        raise ValueError(f"max_norm must be a number >= 0, got {max_norm!r}")
    if not isinstance(parameters, (list, tuple)) and not hasattr(parameters, "grad"):
        parameters = list(parameters)  # a generator is read twice
    parameters = _held(parameters)
    total = grad_norm_array(parameters, norm_type, group)
    K.clip_by_total_norm_(_grads(parameters), total, float(max_norm))
    return total


def clip_grad_norm_(parameters: Params, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: Optional[bool] = None, *,
                    group: Optional[Any] = None) -> float:
    """Scale all gradients in place so that their total norm is at most ``max_norm`` (PyTorch's rule).

    The norm is that of all gradient elements of the *global* model concatenated into one vector.
    When it exceeds ``max_norm`` every gradient is multiplied by ``max_norm / (total_norm + 1e-6)``.

    Sharded and replicated parameters mix freely; each parameter's :class:`~axonmpi.distributed.Placement`
    (set by every strategy, :func:`~axonmpi.distributed.placement_of`) says which groups split
    it.  Its ``|g|^p`` is summed over those groups (max for inf); a parameter no group splits
    counts once, from the local copy -- never summed over its replicas.  The pipeline records
    its group on every stage parameter (a ``STAGE`` shard), so with ``group`` left out the
    pipeline group of the grid (``axonmpi.init(G_inter=p)``) is summed over last, on every rank
    of it -- also a stage that holds no parameters -- and pipeline x tensor parallel gives the
    serial norm on every rank.  Parameters that carry no placement are split over ``group``
    when it is given.  Every rank of a sharding group must pass the parameters of that group in
    the same order; parameters without ``.grad`` contribute nothing but still take part.

    Args:
        parameters: a Tensor or an iterable of Tensors; those without ``.grad`` are skipped.
        max_norm: the largest allowed norm (>= 0).
        norm_type: p of the p-norm (> 0), or ``math.inf`` for the max-abs norm.
        error_if_nonfinite: raise RuntimeError when the total norm is nan or inf
            (otherwise the gradients are scaled by a nan/0 coefficient, as in PyTorch).
        foreach: accepted for PyTorch compatibility; the computation is the same either way.
        group: a :class:`~axonmpi.distributed.ProcessGroup` whose ranks hold different
            parameters (pipeline stages): every parameter is taken to be split over it (those
            with a placement a strategy set as well as those with none; AxoNN's tags and a
            ``shard_group`` attribute keep their own meaning), and every rank of it takes part in
            one last sum. ``None`` (default): the grid's
            pipeline group when it has more than one rank.

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
    parameters = _held(parameters)
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
