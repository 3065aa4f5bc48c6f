"""Which rank went non-finite: the local loss and gradients checked before the optimizer step, agreed in one all-reduce.

A NaN made by one rank's forward reaches every rank through the loss mean and the gradient reduction;
checked after ``opt.step()`` it is reported by rank 0 as "loss became nan" once the NaN gradients are
applied everywhere. :func:`nonfinite_ranks` looks at what is still this rank's own — its loss before the
mean over ranks, and its gradients — and agrees over the group with one all-reduce of ``2 * size``
int32 flags (computed on the device; one host read), so every rank learns which ranks were non-finite,
and :func:`check_finite` raises :class:`NonFiniteError` naming the ranks whose local loss went
non-finite first. Under a :class:`~axonmpi.amp.GradScaler` an overflow is the scaler's to handle: it
skips the step and lowers the scale (:attr:`GradScaler.skipped`), and nothing should raise.
"""
from __future__ import annotations

import math
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np

from . import backend as _be
from .backend import get_array_module
from .distributed import ReduceOp, all_reduce, resolve_group

__all__ = ["NonFiniteError", "nonfinite_ranks", "check_finite"]


class NonFiniteError(FloatingPointError):
    """A loss or gradient was inf/nan before the optimizer step; ``loss_ranks`` and ``grad_ranks`` name the ranks."""

    def __init__(self, message: str, loss_ranks: List[int], grad_ranks: List[int]):
        super().__init__(message)
        self.loss_ranks, self.grad_ranks = loss_ranks, grad_ranks


def _data(x):
    return getattr(x, "data", x)


def _grads(parameters=None, optimizer=None) -> list:
    if optimizer is not None:
        parameters = [p for g in optimizer.param_groups for p in g["params"]]
    return [_data(p.grad) for p in (parameters or []) if getattr(p, "grad", None) is not None]


def nonfinite_ranks(*, loss=None, parameters: Optional[Iterable] = None, optimizer=None,
                    group=None) -> Tuple[List[int], List[int]]:
    """The group ranks whose local ``loss`` was inf/nan, and those whose local gradients were (collective).

    Args:
        loss: this rank's own loss (before any mean over ranks): a Tensor, an array or a float; None: unknown.
        parameters: the parameters whose ``.grad`` to check (or ``optimizer``: its parameter groups').
        optimizer: instead of ``parameters``.
        group: the ranks that agree (default: all ranks).

    Returns:
        ``(loss_ranks, grad_ranks)``, sorted group ranks; both empty when everything is finite.

    Example:
        >>> bad_loss, bad_grads = nonfinite_ranks(loss=local_loss_sum, optimizer=opt)
    """
    g = resolve_group(group)
    grads = _grads(parameters, optimizer)
    loss = None if loss is None else _data(loss)
    first = next((a for a in grads if a is not None), loss if loss is not None else np.zeros(1))
    xp = get_array_module(first) if hasattr(first, "dtype") else np
    flags = xp.zeros(2 * g.size, xp.int32)
    if loss is not None:
        flags[g.rank] = ~xp.isfinite(xp.asarray(loss)).all()
    bad = xp.zeros((), xp.int64)
    for a in grads:                                   # no host read per array: summed on the device
        if a.size:
            bad = bad + (~xp.isfinite(a)).any()
    flags[g.size + g.rank] = bad > 0
    flags = np.asarray(_be.to_host(all_reduce(flags, ReduceOp.SUM, g)))
    return ([int(r) for r in np.flatnonzero(flags[:g.size])],
            [int(r) for r in np.flatnonzero(flags[g.size:])])


def check_finite(step: int, *, loss=None, parameters: Optional[Iterable] = None, optimizer=None, group=None,
                 reduced: Sequence[float] = (), hint: str = "lower the learning rate") -> None:
    """Raise :class:`NonFiniteError` on every rank, naming the ranks, when a local loss or gradient is inf/nan
    (collective; call it before ``optimizer.step()``, so nothing non-finite is applied).

    Args:
        step: the step number the message names.
        loss, parameters, optimizer, group: as :func:`nonfinite_ranks`.
        reduced: values already reduced over the ranks (the global loss, the gradient norm): non-finite while
            every rank's own values are finite, they raise too (an overflow in the reduction).
        hint: what to do about it, appended to the message.

    Example:
        >>> check_finite(step, loss=local_loss_sum, optimizer=opt, hint="lower --lr")
        >>> opt.step()
    """
    loss_ranks, grad_ranks = nonfinite_ranks(loss=loss, parameters=parameters, optimizer=optimizer, group=group)
    rank = resolve_group(group).rank
    if not loss_ranks and not grad_ranks:
        bad = [v for v in reduced if not math.isfinite(float(v))]
        if bad:
            raise NonFiniteError(f"rank {rank}: non-finite values at step {step} before the optimizer step: the "
                                 f"reduced values {bad} are inf/nan although every rank's own loss and gradients are finite "
                                 f"(an overflow in the reduction). The step was not applied; {hint}", [], [])
        return
    parts = []
    if loss_ranks:
        parts.append(f"the local loss of rank(s) {loss_ranks} became inf/nan first (their forward made it)")
    if grad_ranks:
        parts.append(f"gradients were inf/nan on rank(s) {grad_ranks}" +
                     (" (reduced from it)" if loss_ranks and grad_ranks != loss_ranks else ""))
    raise NonFiniteError(f"rank {rank}: non-finite values at step {step} before the optimizer step: "
                         + "; ".join(parts) + f". The step was not applied; {hint}", loss_ranks, grad_ranks)
