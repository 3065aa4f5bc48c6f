"""Loss normalisation, the one rule: the serial mean over the global batch's counted targets (tokens).

[Note: one loss rule]  A rank computes the loss SUM over its counted targets (``F.cross_entropy(...,
reduction="sum")``) and its count of counted targets.  :func:`token_mean` sums both over the groups
whose ranks read different targets (data, data x context, the tensor block in AxoNN's easy mode) and
returns ``global sum / global count``, the same value on every rank.  Its backward gives this rank's
loss sum the gradient ``n / global count``, where ``n`` is the number of batch shards the gradient
reducer averages over (DDP's / FSDP's mean over the data group, the grad-sync table's ``1 / shards``):
the reducer's mean of these per-rank gradients is then exactly the serial gradient of the global token
mean, whatever the number of ignored targets on each rank.  The pipeline counts the same way, over its
micro-batches too (:func:`global_count`), and so does the GPT recipe.

A plain ``F.cross_entropy(...)`` mean (per-rank mean, reducer averages the means) keeps PyTorch DDP's
semantics instead: the mean of per-rank means, equal to the token mean only when every rank counts the
same number of targets.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ..autograd.function import Function
from ..autograd.tensor import Tensor
from ..backend import get_array_module, to_host
from ..distributed import ReduceOp, all_reduce

__all__ = ["FROM_LOSS", "check_counted_targets", "global_count", "loss_ignore_index", "resolve_ignore_index",
           "token_groups_size", "token_mean"]


def _groups(groups: Iterable) -> List:
    """The groups of more than one rank, each once, in order."""
    out, seen = [], set()
    for g in groups:
        if g is not None and g.size > 1 and id(g) not in seen:
            seen.add(id(g))
            out.append(g)
    return out


def _rank(gs) -> int:
    if gs:
        return gs[0].world.rank
    from ..distributed.world import get_world, is_initialized
    return get_world().rank if is_initialized() else 0


def token_groups_size(groups: Iterable) -> int:
    """The number of batch shards ``groups`` make together (the product of their sizes)."""
    return int(np.prod([g.size for g in _groups(groups)], dtype=np.int64))


def _check_count(num_tokens, rank) -> int:
    if isinstance(num_tokens, (bool, np.bool_)) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
        raise ValueError(f"rank {rank}: num_tokens must be a non-negative int (this rank's counted targets, "
                         f"e.g. int((yb != -100).sum())), got {num_tokens!r}")
    return int(num_tokens)


def global_count(num_tokens: int, groups: Iterable) -> int:
    """``num_tokens`` summed over each of ``groups`` in turn (collective over them): the global batch's
    number of counted targets when ``groups`` are the groups whose ranks read different targets.

    Example:
        >>> n = global_count(int((yb != -100).sum()), [grid.data_group])
    """
    gs = _groups(groups)
    c = np.array([_check_count(num_tokens, _rank(gs))], np.int64)
    for g in gs:
        c = all_reduce(c, ReduceOp.SUM, g)
    return int(c[0])


class _TokenMean(Function):
    """forward: ``sum over groups of loss_sum / count`` (the same on every rank); backward: ``g * scale``
    with ``scale = shards / count`` (the reducer's mean over the shards makes it the serial gradient)."""

    @staticmethod
    def forward(ctx, loss_sum, groups, num_tokens, shards):
        xp = get_array_module(loss_sum)
        both = np.array([float(to_host(loss_sum).reshape(())), float(num_tokens)], np.float64)
        for g in groups:
            both = all_reduce(both, ReduceOp.SUM, g)
        total, count = float(both[0]), float(both[1])
        ctx.scale = shards / count if count else 0.0        # all ignored: NaN loss, zero gradient (torch)
        ctx.count = count
        value = total / count if count else float("nan")
        return xp.asarray(value, dtype=loss_sum.dtype)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None, None, None


def token_mean(loss_sum: Tensor, num_tokens: int, groups: Sequence = (), *, shards: Optional[int] = None) -> Tensor:
    """The serial mean over the global batch's counted targets, from this rank's loss sum and count.

    Args:
        loss_sum: a scalar Tensor, the loss summed over this rank's counted targets
            (``F.cross_entropy(logits, y, ignore_index=-100, reduction="sum")``).
        num_tokens: this rank's counted targets (``int((y != -100).sum())``).
        groups: the groups whose ranks read different targets of the global batch (collective over
            them; ranks of a Megatron tensor group read the same ones and are not among them).
        shards: the number of batch shards the gradient reducer averages over (default: the product
            of the sizes of ``groups``).

    Returns:
        A scalar Tensor: the global token mean, the same on every rank (NaN when no target counts,
        as torch's mean; its gradient is then zero).  Its backward gives ``loss_sum`` the gradient
        ``shards / global count`` (see [Note: one loss rule]).

    Example:
        >>> lsum = F.cross_entropy(model(xb), yb, reduction="sum")
        >>> loss = token_mean(lsum, int((yb != -100).sum()), [grid.data_group])
    """
    if not isinstance(loss_sum, Tensor):
        raise TypeError(f"token_mean needs the loss sum as a scalar Tensor, got {type(loss_sum).__name__}")
    gs = _groups(groups)
    rank = _rank(gs)
    if loss_sum.data.size != 1:
        raise ValueError(f"rank {rank}: token_mean needs a scalar loss sum (reduction='sum'), got shape "
                         f"{tuple(loss_sum.shape)}")
    n = _check_count(num_tokens, rank)
    shards = token_groups_size(gs) if shards is None else int(shards)
    return _TokenMean.apply(loss_sum.reshape(()), tuple(gs), n, shards)


# -- which targets a pipeline counts: one source ---------------------------------------------------
class _FromLoss:
    """``ignore_index`` left to the loss function (the default of ``Pipeline`` and ``PipelinePlan``)."""

    def __repr__(self) -> str:
        return "FROM_LOSS"


#: the default ``ignore_index`` of ``Pipeline`` / ``PipelinePlan``: read it from ``loss_fn`` (see
#: :func:`resolve_ignore_index`)
FROM_LOSS = _FromLoss()
_UNREAD = object()


def loss_ignore_index(loss_fn: Optional[Callable]) -> Tuple[Any, str]:
    """The ``ignore_index`` ``loss_fn`` applies, as ``(value, where it was read)``, or ``(_UNREAD, reason)`` when
    it cannot be read.  Read: a loss module's ``ignore_index`` attribute (``nn.CrossEntropyLoss(ignore_index=-1)``,
    ``nn.NLLLoss``), a ``functools.partial``'s keyword (``partial(F.cross_entropy, ignore_index=-1)``), or a
    function's ``ignore_index`` parameter default (``F.cross_entropy``: -100).  ``None``: the pipeline's default
    loss, ``F.cross_entropy`` (-100).  A lambda or another function has no readable value."""
    if loss_fn is None:
        return -100, "F.cross_entropy (the default loss)"
    name = getattr(loss_fn, "__qualname__", None) or type(loss_fn).__qualname__
    if isinstance(loss_fn, functools.partial):
        if "ignore_index" in loss_fn.keywords:
            return loss_fn.keywords["ignore_index"], f"functools.partial({_name(loss_fn.func)}, ignore_index=...)"
        return loss_ignore_index(loss_fn.func)
    value = getattr(loss_fn, "ignore_index", _UNREAD)
    if value is not _UNREAD and not callable(value):
        return value, f"{type(loss_fn).__qualname__}.ignore_index"
    if inspect.isfunction(loss_fn) or inspect.ismethod(loss_fn):
        try:
            param = inspect.signature(loss_fn).parameters.get("ignore_index")
        except (TypeError, ValueError):
            param = None
        if param is not None and param.default is not inspect.Parameter.empty:
            return param.default, f"{_name(loss_fn)}'s ignore_index default"
    return _UNREAD, f"{name} (a function with no ignore_index the pipeline can read)"


def _name(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def resolve_ignore_index(loss_fn: Optional[Callable], ignore_index: Any, rank: int) -> Tuple[Optional[int], bool]:
    """The target value a pipeline does not count, from its one source, and whether it was checked.

    ``ignore_index=FROM_LOSS`` (the default) takes the loss function's (:func:`loss_ignore_index`); a loss whose
    value cannot be read (a lambda) is counted with -100, ``F.cross_entropy``'s, and :func:`check_counted_targets`
    refuses at the first step a negative target other than it (which only a loss ignoring it accepts).  An
    explicit ``ignore_index`` (``None``: every target counts) must equal the loss's where that is readable.

    Raises:
        ValueError: naming both values and the fix, when ``ignore_index`` and the loss function's disagree.
    """
    read, where = loss_ignore_index(loss_fn)
    if ignore_index is FROM_LOSS:
        return (-100, False) if read is _UNREAD else (read, True)
    if read is not _UNREAD and read != ignore_index:
        raise ValueError(
            f"rank {rank}: the pipeline was told ignore_index={ignore_index!r} but its loss function ignores "
            f"{read!r} ({where}): the token count would disagree with the loss. Leave ignore_index out (it is read "
            f"from the loss function) or give the loss the same ignore_index")
    return ignore_index, read is not _UNREAD


def check_counted_targets(targets, ignore_index: Optional[int], rank: int) -> None:
    """Refuse integer targets holding a negative value other than ``ignore_index``: no class has it, so a loss
    that accepted them ignores them, and the pipeline (told another value) would count them."""
    t = to_host(targets)
    if getattr(t, "dtype", np.dtype(float)).kind != "i" or not t.size:
        return
    mask = t < 0
    if ignore_index is not None:
        mask &= t != ignore_index
    bad = t[mask]
    if bad.size:
        raise ValueError(
            f"rank {rank}: the pipeline's targets hold {int(bad.flat[0])}, which it counts as a token "
            f"(ignore_index={ignore_index!r}); no class has a negative index, so the loss function must be ignoring "
            f"it and the token mean would be wrong. Give the loss function in a form the pipeline reads "
            f"(nn.CrossEntropyLoss(ignore_index={int(bad.flat[0])}) or functools.partial(F.cross_entropy, "
            f"ignore_index={int(bad.flat[0])})) or pass ignore_index={int(bad.flat[0])} to PipelinePlan / Pipeline")
