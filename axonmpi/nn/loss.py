"""Loss functions and modules with PyTorch's names, arguments and reductions (``reduction=``).

Built from differentiable ops (every backward is that of its parts), except the fused
:func:`~axonmpi.autograd.ops_nn.cross_entropy` (``F.cross_entropy``), which ``CrossEntropyLoss``
calls for every class-index target.
``CrossEntropyLoss``/``NLLLoss`` take the class axis at dim 1 as PyTorch does ((N, C) or
(N, C, d1, ...)); :func:`axonmpi.nn.functional.cross_entropy` keeps its class-last layout.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..autograd import ops, ops_math, ops_nn, ops_reduce
from ..autograd.tensor import Tensor
from ..backend import get_array_module
from .module import Module

__all__ = [
    "nll_loss", "l1_loss", "smooth_l1_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
    "class_cross_entropy", "CrossEntropyLoss", "NLLLoss", "MSELoss", "L1Loss", "SmoothL1Loss",
    "BCEWithLogitsLoss", "BCELoss",
]

_REDUCTIONS = ("mean", "sum", "none")


def _check_reduction(reduction: str, who: str) -> str:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{who}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    return reduction


def _t(x, like: Optional[Tensor] = None) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if like is not None:
        xp = get_array_module(like.data)
        return Tensor(xp.asarray(x, dtype=like.data.dtype))
    return Tensor(x)


def _reduce(loss: Tensor, reduction: str) -> Tensor:
    if reduction == "none":
        return loss
    return ops_reduce.sum(loss) if reduction == "sum" else ops_reduce.mean(loss)


def _classes_last(x: Tensor) -> Tensor:
    """(N, C, d1, ...) -> (N, d1, ..., C); (C,) and (N, C) unchanged."""
    if x.ndim <= 2:
        return x
    return ops.permute(x, 0, *range(2, x.ndim), 1)


def _raw_target(target):
    t = target.data if isinstance(target, Tensor) else target
    return t if hasattr(t, "dtype") else np.asarray(t)


def nll_loss(input, target, weight=None, ignore_index: int = -100, reduction: str = "mean") -> Tensor:  # noqa: A002
    """Negative log-likelihood of log-probabilities ``input`` (N, C) or (N, C, d1, ...) at ``target``.

    ``weight`` (C,) rescales each class; ``"mean"`` divides by the summed weights of the
    non-ignored targets (PyTorch's rule).

    Example:
        >>> nll_loss(Tensor([[-0.1, -2.3]]), [1]).item()
        2.3
    """
    _check_reduction(reduction, "nll_loss")
    return _weighted_nll(_classes_last(_t(input)), _raw_target(target), weight, ignore_index, reduction)


def _weighted_nll(logp: Tensor, t, weight, ignore_index: int, reduction: str, smoothing: float = 0.0) -> Tensor:
    """Class-last log-probabilities ``logp`` (..., C) and integer targets ``t`` (...)."""
    if t.dtype.kind not in "iu":
        raise TypeError(f"nll_loss/cross_entropy: class-index targets must be integers, got dtype {t.dtype}")
    xp = get_array_module(logp.data)
    c = logp.shape[-1]
    flat = ops.reshape(logp, -1, c)
    t = xp.asarray(t).reshape(-1)
    if flat.shape[0] != t.shape[0]:
        raise ValueError(f"target has {t.shape[0]} elements, input {flat.shape[0]} rows of {c} classes")
    valid = t != ignore_index
    ts = xp.where(valid, t, 0)
    bad = ts[(ts < 0) | (ts >= c)]
    if bad.size:
        raise IndexError(f"target {int(bad[0])} is out of bounds for {c} classes")
    w = xp.ones(c, dtype=logp.data.dtype) if weight is None else xp.asarray(_raw_target(weight), logp.data.dtype)
    wt = w[ts] * valid                                         # per-row weight, 0 where ignored
    picked = flat[xp.arange(flat.shape[0]), ts]
    loss = -(picked * Tensor(wt))
    if smoothing:
        smooth = -ops_reduce.sum(flat * Tensor(w), dim=-1) * Tensor(valid.astype(wt.dtype))
        loss = loss * (1.0 - smoothing) + smooth * (smoothing / c)
    if reduction == "none":
        return ops.reshape(loss, *logp.shape[:-1])
    total = ops_reduce.sum(loss)
    if reduction == "sum":
        return total
    count = wt.sum()
    if not bool(count):
        # every target ignored: torch's loss is NaN (0/0) but its gradient is zero; divide by 1
        # so the backward multiplies the (zero) per-row weights by a finite number, then add NaN
        return total + Tensor(xp.asarray(xp.nan, dtype=logp.data.dtype))
    return total / Tensor(xp.asarray(count, dtype=logp.data.dtype))


def class_cross_entropy(input, target, weight=None, ignore_index: int = -100, reduction: str = "mean",  # noqa: A002
                        label_smoothing: float = 0.0) -> Tensor:
    """PyTorch's ``F.cross_entropy``: classes at dim 1, class-index or probability targets.

    Class-index targets, with or without ``weight`` and ``label_smoothing``, go to the one fused
    kernel :func:`axonmpi.nn.functional.cross_entropy` (after moving the classes last), so the
    module and the function cannot disagree; a batch whose targets are all ``ignore_index``
    gives a NaN ``"mean"`` loss and zero gradients, as torch does.  Probability targets are
    ``log_softmax`` times the target, summed over classes.
    """
    _check_reduction(reduction, "cross_entropy")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    x = _classes_last(_t(input))
    t = _raw_target(target)
    if t.dtype.kind == "f":                                    # class probabilities, shaped like input
        tl = _classes_last(_t(t, x))
        c = x.shape[-1]
        if tuple(tl.shape) != tuple(x.shape):
            raise ValueError(f"cross_entropy: probability target shape {tuple(_t(t).shape)} must equal input shape "
                             f"{tuple(_t(input).shape)}")
        if label_smoothing:
            tl = tl * (1.0 - label_smoothing) + label_smoothing / c
        logp = ops_nn.log_softmax(x, -1)
        if weight is not None:
            logp = logp * _t(weight, x)
        loss = -ops_reduce.sum(logp * tl, dim=-1)
        if reduction == "mean":
            return ops_reduce.sum(loss) / float(int(np.prod(loss.shape)) or 1)
        return _reduce(loss, reduction)
    # class indices: the one fused implementation, F.cross_entropy (classes last), for every
    # weight / label_smoothing / reduction / rank; an all-ignored batch gives zero gradients
    return ops_nn.cross_entropy(x, t, weight=weight, reduction=reduction, ignore_index=ignore_index,
                                label_smoothing=label_smoothing)


def l1_loss(input, target, reduction: str = "mean") -> Tensor:  # noqa: A002
    """Mean (or sum, or elementwise) absolute difference."""
    _check_reduction(reduction, "l1_loss")
    x = _t(input)
    return _reduce(ops_math.abs(x - _t(target, x)), reduction)


def smooth_l1_loss(input, target, reduction: str = "mean", beta: float = 1.0) -> Tensor:  # noqa: A002
    """Huber-like loss: ``0.5 d^2 / beta`` where ``|d| < beta``, else ``|d| - 0.5 beta`` (``beta=0``: L1)."""
    _check_reduction(reduction, "smooth_l1_loss")
    if beta < 0:
        raise ValueError(f"smooth_l1_loss: beta must be >= 0, got {beta}")
    x = _t(input)
    d = ops_math.abs(x - _t(target, x))
    if beta == 0:
        return _reduce(d, reduction)
    small = d.data < beta
    return _reduce(ops.where(small, d * d * (0.5 / beta), d - 0.5 * beta), reduction)


def binary_cross_entropy(input, target, weight=None, reduction: str = "mean") -> Tensor:  # noqa: A002
    """BCE of probabilities ``input`` in [0, 1]; each log is clamped at -100 as PyTorch does."""
    _check_reduction(reduction, "binary_cross_entropy")
    x = _t(input)
    xp = get_array_module(x.data)
    if x.data.size and (xp.any(x.data < 0) or xp.any(x.data > 1)):
        raise ValueError("binary_cross_entropy: input must be probabilities in [0, 1] "
                         "(use binary_cross_entropy_with_logits for logits)")
    y = _t(target, x)
    lo = ops_math.clamp(ops_math.log(x), min=-100.0)
    l1 = ops_math.clamp(ops_math.log(1.0 - x), min=-100.0)
    loss = -(y * lo + (1.0 - y) * l1)
    if weight is not None:
        loss = loss * _t(weight, x)
    return _reduce(loss, reduction)


def binary_cross_entropy_with_logits(input, target, weight=None, reduction: str = "mean",  # noqa: A002
                                     pos_weight=None) -> Tensor:
    """BCE of ``sigmoid(input)``, computed stably: ``(1-y) x + (1 + (pw-1) y) (log1p(e^-|x|) + max(-x, 0))``."""
    _check_reduction(reduction, "binary_cross_entropy_with_logits")
    x = _t(input)
    y = _t(target, x)
    if tuple(y.shape) != tuple(x.shape):
        raise ValueError(f"binary_cross_entropy_with_logits: target shape {tuple(y.shape)} must equal input "
                         f"shape {tuple(x.shape)}")
    soft = ops_math.log(ops_math.exp(-ops_math.abs(x)) + 1.0) + ops_nn.relu(-x)
    coef = 1.0 if pos_weight is None else (_t(pos_weight, x) - 1.0) * y + 1.0
    loss = (1.0 - y) * x + coef * soft
    if weight is not None:
        loss = loss * _t(weight, x)
    return _reduce(loss, reduction)


class _Loss(Module):
    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = _check_reduction(reduction, type(self).__name__)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}"


class CrossEntropyLoss(_Loss):
    """``CrossEntropyLoss(weight=None, ignore_index=-100, reduction='mean', label_smoothing=0.0)``.

    Example:
        >>> crit = CrossEntropyLoss()
        >>> loss = crit(model(x), y)            # x: (N, ...), logits (N, C), y: (N,) class ids
    """

    def __init__(self, weight=None, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0):
        super().__init__(reduction)
        self.weight, self.ignore_index, self.label_smoothing = weight, ignore_index, float(label_smoothing)

    def forward(self, input, target) -> Tensor:  # noqa: A002
        return class_cross_entropy(input, target, self.weight, self.ignore_index, self.reduction,
                                   self.label_smoothing)


class NLLLoss(_Loss):
    """``NLLLoss(weight=None, ignore_index=-100, reduction='mean')`` over log-probabilities."""

    def __init__(self, weight=None, ignore_index: int = -100, reduction: str = "mean"):
        super().__init__(reduction)
        self.weight, self.ignore_index = weight, ignore_index

    def forward(self, input, target) -> Tensor:  # noqa: A002
        return nll_loss(input, target, self.weight, self.ignore_index, self.reduction)


class MSELoss(_Loss):
    """``MSELoss(reduction='mean')``."""

    def forward(self, input, target) -> Tensor:  # noqa: A002
        x = _t(input)
        return ops_nn.mse_loss(x, _t(target, x), reduction=self.reduction)


class L1Loss(_Loss):
    """``L1Loss(reduction='mean')``."""

    def forward(self, input, target) -> Tensor:  # noqa: A002
        return l1_loss(input, target, self.reduction)


class SmoothL1Loss(_Loss):
    """``SmoothL1Loss(reduction='mean', beta=1.0)``."""

    def __init__(self, reduction: str = "mean", beta: float = 1.0):
        super().__init__(reduction)
        self.beta = float(beta)

    def forward(self, input, target) -> Tensor:  # noqa: A002
        return smooth_l1_loss(input, target, self.reduction, self.beta)


class BCEWithLogitsLoss(_Loss):
    """``BCEWithLogitsLoss(weight=None, reduction='mean', pos_weight=None)``."""

    def __init__(self, weight=None, reduction: str = "mean", pos_weight=None):
        super().__init__(reduction)
        self.weight, self.pos_weight = weight, pos_weight

    def forward(self, input, target) -> Tensor:  # noqa: A002
        return binary_cross_entropy_with_logits(input, target, self.weight, self.reduction, self.pos_weight)


class BCELoss(_Loss):
    """``BCELoss(weight=None, reduction='mean')`` over probabilities."""

    def __init__(self, weight=None, reduction: str = "mean"):
        super().__init__(reduction)
        self.weight = weight

    def forward(self, input, target) -> Tensor:  # noqa: A002
        return binary_cross_entropy(input, target, self.weight, self.reduction)
