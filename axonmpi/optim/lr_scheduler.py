"""Learning-rate schedulers, PyTorch semantics: the constructor sets the initial lr, ``step()`` advances."""
from __future__ import annotations

import math
import numbers
from bisect import bisect_right
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from .optimizer import Optimizer

__all__ = [
    "ChainedScheduler",
    "ConstantLR",
    "CosineAnnealingLR",
    "CosineAnnealingWarmRestarts",
    "ExponentialLR",
    "LRScheduler",
    "LambdaLR",
    "LinearLR",
    "LinearWarmupCosine",
    "MultiStepLR",
    "OneCycleLR",
    "PolynomialLR",
    "ReduceLROnPlateau",
    "SequentialLR",
    "StepLR",
]


class LRScheduler:
    """Base class: each :meth:`step` writes :meth:`get_lr` into every group's ``lr``.

    As in PyTorch, :class:`StepLR` and :class:`CosineAnnealingLR` are *chainable*: each
    step updates the lr the group holds now (``lr *= gamma`` every ``step_size`` steps; the
    cosine ratio), so two schedulers on one optimizer compose and a manual change of
    ``group["lr"]`` persists.  :class:`LambdaLR` and :class:`LinearWarmupCosine` are closed
    forms of ``last_epoch`` and ``initial_lr`` (as torch's LambdaLR), which overwrite other
    changes.  Subclasses implement ``lr_at(base_lr, t)`` (the closed form) and may override
    :meth:`get_lr` with the recursive form.

    Args:
        optimizer: the optimizer whose groups' ``lr`` is driven.
        last_epoch: index of the last step taken; -1 (default) starts fresh and
            records each group's current ``lr`` as ``initial_lr``.
    """

    _is_initial = False  # True during the constructor's step (torch's ``_initial_mode``)

    def __init__(self, optimizer: Optimizer, last_epoch: int = -1):
        if not isinstance(getattr(optimizer, "param_groups", None), list):
            raise TypeError(f"{type(self).__name__} needs an optimizer with param_groups, "
                            f"got {type(optimizer).__name__}")
        if not isinstance(last_epoch, int) or last_epoch < -1:
            raise ValueError(f"last_epoch must be an int >= -1, got {last_epoch!r}")
        self.optimizer = optimizer
        for i, group in enumerate(optimizer.param_groups):
            if last_epoch == -1:
                group.setdefault("initial_lr", group["lr"])
            elif "initial_lr" not in group:
                raise KeyError(f"param group {i} has no 'initial_lr'; "
                               f"it is needed to resume at last_epoch={last_epoch}")
        self.base_lrs: List[float] = [g["initial_lr"] for g in optimizer.param_groups]
        self.last_epoch = last_epoch
        self._last_lr: List[float] = []
        self._initial_step()

    def _initial_step(self) -> None:
        """The constructor's step (also used by :class:`SequentialLR` to restart a scheduler)."""
        self._step_count = 0
        self._is_initial = True
        try:
            self.step()
        finally:
            self._is_initial = False

    def lr_at(self, base_lr: float, t: int) -> float:
        """The learning rate after ``t`` steps for a group that started at ``base_lr``."""
        raise NotImplementedError(f"{type(self).__name__} must implement lr_at")

    def get_lr(self) -> List[float]:
        """Learning rates of all groups at the current step."""
        return [self.lr_at(base, self.last_epoch) for base in self.base_lrs]

    def step(self, epoch: Optional[int] = None) -> None:
        """Advance one step and write the new learning rates into the optimizer.

        ``epoch`` (deprecated in PyTorch, kept for its meaning) jumps to that step and uses the
        closed form :meth:`lr_at` where the scheduler has one.
        """
        self._step_count += 1
        self._update_lr(epoch)

    def _update_lr(self, epoch: Optional[int] = None) -> None:
        if epoch is None:
            self.last_epoch += 1
            lrs = self.get_lr()
        else:
            self.last_epoch = epoch
            if type(self).lr_at is not LRScheduler.lr_at:
                lrs = [self.lr_at(base, epoch) for base in self.base_lrs]
            else:
                lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def get_last_lr(self) -> List[float]:
        """The learning rates set by the last :meth:`step` (or the constructor)."""
        return list(self._last_lr)

    def state_dict(self) -> Dict[str, Any]:
        """Everything but the optimizer (and, for LambdaLR, the functions)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "lr_lambdas")}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` and set the groups' lr to the restored last lrs.

        (PyTorch leaves the lr the constructor set until the next ``step()``; writing it
        back makes the result independent of whether the optimizer was loaded first.)
        """
        self.__dict__.update({k: v for k, v in state_dict.items() if k not in ("optimizer", "lr_lambdas")})
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr


def _check(name: str, value: Any, ok: bool, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


class StepLR(LRScheduler):
    """``lr = base_lr * gamma ** (t // step_size)``, applied as torch does: ``lr *= gamma`` on
    every ``step_size``-th step, to the lr the group holds then (so it chains).

    Example:
        >>> sched = StepLR(opt, step_size=30, gamma=0.1)   # /10 every 30 steps
    """

    def __init__(self, optimizer: Optimizer, step_size: int, gamma: float = 0.1, last_epoch: int = -1):
        _check("step_size", step_size, _is_int(step_size) and step_size >= 1, "an int >= 1")
        _check("gamma", gamma, isinstance(gamma, numbers.Real) and gamma >= 0, "a number >= 0")
        self.step_size, self.gamma = int(step_size), float(gamma)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr: float, t: int) -> float:
        return base_lr * self.gamma ** (t // self.step_size)

    def get_lr(self) -> List[float]:
        t = self.last_epoch
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        if t == 0 or t % self.step_size != 0:
            return lrs
        return [lr * self.gamma for lr in lrs]


class CosineAnnealingLR(LRScheduler):
    """``lr = eta_min + (base_lr - eta_min) * (1 + cos(pi * t / T_max)) / 2`` (SGDR without restarts).

    Stepped with torch's recursive form ``lr_t = eta_min + (lr_{t-1} - eta_min) * (1 + cos(pi t/T))
    / (1 + cos(pi (t-1)/T))``, which equals the closed form alone and chains with other schedulers.

    Example:
        >>> sched = CosineAnnealingLR(opt, T_max=1000, eta_min=1e-5)
    """

    def __init__(self, optimizer: Optimizer, T_max: int, eta_min: float = 0.0, last_epoch: int = -1):
        _check("T_max", T_max, _is_int(T_max) and T_max >= 1, "an int >= 1")
        _check("eta_min", eta_min, isinstance(eta_min, numbers.Real) and eta_min >= 0, "a number >= 0")
        self.T_max, self.eta_min = int(T_max), float(eta_min)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr: float, t: int) -> float:
        return self.eta_min + (base_lr - self.eta_min) * (1 + math.cos(math.pi * t / self.T_max)) / 2

    def get_lr(self) -> List[float]:
        t, n, lo = self.last_epoch, self.T_max, self.eta_min
        groups = self.optimizer.param_groups
        if t == 0:
            return [g["lr"] for g in groups]
        if self._step_count == 1 and t > 0:  # resumed with last_epoch=k: torch's closed form
            return [self.lr_at(base, t) for base in self.base_lrs]
        if (t - 1 - n) % (2 * n) == 0:  # the ratio below is 0/0 at the trough
            return [g["lr"] + (base - lo) * (1 - math.cos(math.pi / n)) / 2
                    for g, base in zip(groups, self.base_lrs)]
        ratio = (1 + math.cos(math.pi * t / n)) / (1 + math.cos(math.pi * (t - 1) / n))
        return [ratio * (g["lr"] - lo) + lo for g in groups]


class LinearWarmupCosine(LRScheduler):
    """Linear warmup to ``base_lr``, then cosine decay to ``min_lr`` at ``total_steps``, then ``min_lr``.

    With ``W = warmup_steps`` and ``T = total_steps``::

        t <  W:      lr = base_lr * (t + 1) / W          (never 0, reaches base_lr at t = W - 1)
        W <= t <= T: lr = min_lr + (base_lr - min_lr) * (1 + cos(pi * (t - W) / (T - W))) / 2
        t >  T:      lr = min_lr

    Example:
        >>> sched = LinearWarmupCosine(opt, warmup_steps=100, total_steps=5000, min_lr=3e-5)
    """

    def __init__(self, optimizer: Optimizer, warmup_steps: int, total_steps: int, min_lr: float = 0.0,
                 last_epoch: int = -1):
        _check("warmup_steps", warmup_steps, _is_int(warmup_steps) and warmup_steps >= 0, "an int >= 0")
        _check("total_steps", total_steps, _is_int(total_steps) and total_steps > warmup_steps,
               f"an int > warmup_steps={warmup_steps}")
        _check("min_lr", min_lr, isinstance(min_lr, numbers.Real) and min_lr >= 0, "a number >= 0")
        self.warmup_steps, self.total_steps, self.min_lr = int(warmup_steps), int(total_steps), float(min_lr)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr: float, t: int) -> float:
        w, total = self.warmup_steps, self.total_steps
        if t < w:
            return base_lr * (t + 1) / w
        if t > total:
            return self.min_lr
        return self.min_lr + (base_lr - self.min_lr) * (1 + math.cos(math.pi * (t - w) / (total - w))) / 2


class LambdaLR(LRScheduler):
    """``lr = base_lr * lr_lambda(t)``; one function for all groups or one per group.

    The functions are not part of :meth:`state_dict`; pass them again when resuming.

    Example:
        >>> sched = LambdaLR(opt, lambda t: 0.95 ** t)
    """

    def __init__(self, optimizer: Optimizer, lr_lambda: Union[Callable[[int], float], Sequence[Callable]],
                 last_epoch: int = -1):
        n = len(optimizer.param_groups)
        if callable(lr_lambda):
            self.lr_lambdas = [lr_lambda] * n
        else:
            self.lr_lambdas = list(lr_lambda)
            if len(self.lr_lambdas) != n or not all(callable(f) for f in self.lr_lambdas):
                raise ValueError(f"lr_lambda must be a callable or a list of {n} callables "
                                 "(one per param group), "
                                 f"got {lr_lambda!r}")
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[float]:
        return [base * f(self.last_epoch) for base, f in zip(self.base_lrs, self.lr_lambdas)]


def _per_group(name: str, optimizer: Optimizer, value: Any) -> List[Any]:
    """``value`` for every param group: a scalar is repeated, a list must have one per group."""
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} must be a number or a list of {n} (one per param group), got {value!r}")
        return list(value)
    return [value] * n


def _current(optimizer: Optimizer) -> List[float]:
    return [g["lr"] for g in optimizer.param_groups]


class LinearLR(LRScheduler):
    """Scale lr linearly from ``start_factor * base_lr`` to ``end_factor * base_lr`` over ``total_iters`` steps.

    Closed form: ``base_lr * (start + (end - start) * min(t, total_iters) / total_iters)``;
    stepped recursively as torch does, so it chains.

    Example:
        >>> sched = LinearLR(opt, start_factor=0.1, total_iters=100)   # warmup
    """

    def __init__(self, optimizer: Optimizer, start_factor: float = 1.0 / 3, end_factor: float = 1.0,
                 total_iters: int = 5, last_epoch: int = -1):
        _check("start_factor", start_factor, isinstance(start_factor, numbers.Real) and 0 < start_factor <= 1,
               "a number in (0, 1]")
        _check("end_factor", end_factor, isinstance(end_factor, numbers.Real) and 0 <= end_factor <= 1,
               "a number in [0, 1]")
        _check("total_iters", total_iters, _is_int(total_iters) and total_iters >= 1, "an int >= 1")
        self.start_factor, self.end_factor, self.total_iters = float(start_factor), float(end_factor), int(total_iters)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr: float, t: int) -> float:
        s, e, n = self.start_factor, self.end_factor, self.total_iters
        return base_lr * (s + (e - s) * min(n, t) / n)

    def get_lr(self) -> List[float]:
        t, s, e, n = self.last_epoch, self.start_factor, self.end_factor, self.total_iters
        if t == 0:
            return [lr * s for lr in _current(self.optimizer)]
        if self._is_initial or t > n:
            return _current(self.optimizer)
        return [lr * (1.0 + (e - s) / (n * s + (t - 1) * (e - s))) for lr in _current(self.optimizer)]


class ExponentialLR(LRScheduler):
    """``lr = base_lr * gamma ** t`` (each step multiplies the current lr by ``gamma``).

    Example:
        >>> sched = ExponentialLR(opt, gamma=0.99)
    """

    def __init__(self, optimizer: Optimizer, gamma: float, last_epoch: int = -1):
        _check("gamma", gamma, isinstance(gamma, numbers.Real) and gamma >= 0, "a number >= 0")
        self.gamma = float(gamma)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr: float, t: int) -> float:
        return base_lr * self.gamma ** t

    def get_lr(self) -> List[float]:
        if self._is_initial:
            return _current(self.optimizer)
        return [lr * self.gamma for lr in _current(self.optimizer)]


class MultiStepLR(LRScheduler):
    """Multiply lr by ``gamma`` at each milestone (a milestone listed twice multiplies twice).

    Example:
        >>> sched = MultiStepLR(opt, milestones=[30, 80], gamma=0.1)
    """

    def __init__(self, optimizer: Optimizer, milestones: Sequence[int], gamma: float = 0.1, last_epoch: int = -1):
        milestones = list(milestones)
        _check("milestones", milestones, all(_is_int(m) for m in milestones), "a list of ints")
        _check("gamma", gamma, isinstance(gamma, numbers.Real) and gamma >= 0, "a number >= 0")
        self.milestones, self.gamma = Counter(milestones), float(gamma)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr: float, t: int) -> float:
        return base_lr * self.gamma ** bisect_right(sorted(self.milestones.elements()), t)

    def get_lr(self) -> List[float]:
        k = self.milestones.get(self.last_epoch, 0)
        return [lr * self.gamma ** k if k else lr for lr in _current(self.optimizer)]


class ConstantLR(LRScheduler):
    """``lr = base_lr * factor`` for the first ``total_iters`` steps, then ``base_lr``.

    Example:
        >>> sched = ConstantLR(opt, factor=0.5, total_iters=4)
    """

    def __init__(self, optimizer: Optimizer, factor: float = 1.0 / 3, total_iters: int = 5, last_epoch: int = -1):
        _check("factor", factor, isinstance(factor, numbers.Real) and 0 < factor <= 1, "a number in (0, 1]")
        _check("total_iters", total_iters, _is_int(total_iters) and total_iters >= 0, "an int >= 0")
        self.factor, self.total_iters = float(factor), int(total_iters)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr: float, t: int) -> float:
        return base_lr * (self.factor + (t >= self.total_iters) * (1 - self.factor))

    def get_lr(self) -> List[float]:
        t = self.last_epoch
        if t == 0:
            return [lr * self.factor for lr in _current(self.optimizer)]
        if t != self.total_iters:
            return _current(self.optimizer)
        return [lr * (1.0 / self.factor) for lr in _current(self.optimizer)]


class PolynomialLR(LRScheduler):
    """``lr = base_lr * (1 - min(t, total_iters) / total_iters) ** power``.

    Example:
        >>> sched = PolynomialLR(opt, total_iters=1000, power=2.0)
    """

    def __init__(self, optimizer: Optimizer, total_iters: int = 5, power: float = 1.0, last_epoch: int = -1):
        _check("total_iters", total_iters, _is_int(total_iters) and total_iters >= 1, "an int >= 1")
        _check("power", power, isinstance(power, numbers.Real), "a number")
        self.total_iters, self.power = int(total_iters), float(power)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr: float, t: int) -> float:
        return base_lr * (1.0 - min(self.total_iters, t) / self.total_iters) ** self.power

    def get_lr(self) -> List[float]:
        t, n = self.last_epoch, self.total_iters
        if self._is_initial or t > n:
            return _current(self.optimizer)
        decay = ((1.0 - t / n) / (1.0 - (t - 1) / n)) ** self.power
        return [lr * decay for lr in _current(self.optimizer)]


class CosineAnnealingWarmRestarts(LRScheduler):
    """SGDR: cosine from ``base_lr`` to ``eta_min`` over ``T_i`` steps, then restart with ``T_i *= T_mult``.

    ``step(epoch)`` accepts a fractional epoch (``step(epoch + i / iters)``) as torch's does.

    Example:
        >>> sched = CosineAnnealingWarmRestarts(opt, T_0=10, T_mult=2, eta_min=1e-5)
    """

    def __init__(self, optimizer: Optimizer, T_0: int, T_mult: int = 1, eta_min: float = 0.0, last_epoch: int = -1):
        _check("T_0", T_0, _is_int(T_0) and T_0 >= 1, "an int >= 1")
        _check("T_mult", T_mult, _is_int(T_mult) and T_mult >= 1, "an int >= 1")
        _check("eta_min", eta_min, isinstance(eta_min, numbers.Real), "a number")
        self.T_0 = self.T_i = int(T_0)
        self.T_mult, self.eta_min = int(T_mult), float(eta_min)
        self.T_cur = last_epoch
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[float]:
        cos = (1 + math.cos(math.pi * self.T_cur / self.T_i)) / 2
        return [self.eta_min + (base - self.eta_min) * cos for base in self.base_lrs]

    def step(self, epoch: Optional[float] = None) -> None:
        """Advance one step, or go to ``epoch`` (may be fractional)."""
        self._step_count += 1
        if epoch is None and self.last_epoch < 0:
            epoch = 0
        if epoch is None:
            epoch = self.last_epoch + 1
            self.T_cur += 1
            if self.T_cur >= self.T_i:
                self.T_cur %= self.T_i
                self.T_i *= self.T_mult
        else:
            _check("epoch", epoch, epoch >= 0, "a number >= 0")
            if epoch >= self.T_0:
                if self.T_mult == 1:
                    self.T_cur = epoch % self.T_0
                else:
                    n = int(math.log(epoch / self.T_0 * (self.T_mult - 1) + 1, self.T_mult))
                    self.T_cur = epoch - self.T_0 * (self.T_mult ** n - 1) / (self.T_mult - 1)
                    self.T_i = self.T_0 * self.T_mult ** n
            else:
                self.T_i, self.T_cur = self.T_0, epoch
        self.last_epoch = math.floor(epoch)
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            group["lr"] = lr
        self._last_lr = _current(self.optimizer)

    _update_lr = step


class OneCycleLR(LRScheduler):
    """The 1cycle policy: lr rises from ``max_lr / div_factor`` to ``max_lr`` over ``pct_start`` of
    ``total_steps``, then anneals to ``initial_lr / final_div_factor``; momentum (SGD's ``momentum``
    or Adam's ``beta1``) moves the other way between ``max_momentum`` and ``base_momentum``.

    Step it once per batch; stepping more than ``total_steps`` times raises ``ValueError``.
    Keeps ``initial_lr``, ``max_lr``, ``min_lr`` (and ``max_momentum``, ``base_momentum``) in each
    param group, as torch does.

    Example:
        >>> sched = OneCycleLR(opt, max_lr=0.1, epochs=10, steps_per_epoch=len(loader))
    """

    def __init__(self, optimizer: Optimizer, max_lr: Union[float, Sequence[float]], total_steps: Optional[int] = None,
                 epochs: Optional[int] = None, steps_per_epoch: Optional[int] = None, pct_start: float = 0.3,
                 anneal_strategy: str = "cos", cycle_momentum: bool = True,
                 base_momentum: Union[float, Sequence[float]] = 0.85,
                 max_momentum: Union[float, Sequence[float]] = 0.95, div_factor: float = 25.0,
                 final_div_factor: float = 1e4, three_phase: bool = False, last_epoch: int = -1):
        if total_steps is not None:
            _check("total_steps", total_steps, _is_int(total_steps) and total_steps >= 1, "an int >= 1")
            self.total_steps = int(total_steps)
        elif epochs is not None and steps_per_epoch is not None:
            _check("epochs", epochs, _is_int(epochs) and epochs >= 1, "an int >= 1")
            _check("steps_per_epoch", steps_per_epoch, _is_int(steps_per_epoch) and steps_per_epoch >= 1,
                   "an int >= 1")
            self.total_steps = int(epochs) * int(steps_per_epoch)
        else:
            raise ValueError("OneCycleLR needs total_steps, or both epochs and steps_per_epoch; "
                             f"got total_steps={total_steps!r}, epochs={epochs!r}, "
                             f"steps_per_epoch={steps_per_epoch!r}")
        _check("pct_start", pct_start, isinstance(pct_start, float) and 0 <= pct_start <= 1, "a float in [0, 1]")
        _check("anneal_strategy", anneal_strategy, anneal_strategy in ("cos", "linear"), "'cos' or 'linear'")
        n = self.total_steps
        if three_phase:
            self._schedule_phases = [
                dict(end_step=float(pct_start * n) - 1, start_lr="initial_lr", end_lr="max_lr",
                     start_momentum="max_momentum", end_momentum="base_momentum"),
                dict(end_step=float(2 * pct_start * n) - 2, start_lr="max_lr", end_lr="initial_lr",
                     start_momentum="base_momentum", end_momentum="max_momentum"),
                dict(end_step=n - 1, start_lr="initial_lr", end_lr="min_lr",
                     start_momentum="max_momentum", end_momentum="max_momentum"),
            ]
        else:
            self._schedule_phases = [
                dict(end_step=float(pct_start * n) - 1, start_lr="initial_lr", end_lr="max_lr",
                     start_momentum="max_momentum", end_momentum="base_momentum"),
                dict(end_step=n - 1, start_lr="max_lr", end_lr="min_lr",
                     start_momentum="base_momentum", end_momentum="max_momentum"),
            ]
        self._anneal_func_type = anneal_strategy
        max_lrs = _per_group("max_lr", optimizer, max_lr)
        if last_epoch == -1:
            for group, top in zip(optimizer.param_groups, max_lrs):
                group["initial_lr"] = top / div_factor
                group["max_lr"] = top
                group["min_lr"] = group["initial_lr"] / final_div_factor
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum:
            defaults = getattr(optimizer, "defaults", {})
            if "momentum" not in defaults and "betas" not in defaults:
                raise ValueError(f"cycle_momentum=True needs an optimizer with momentum or betas; "
                                 f"{type(optimizer).__name__} has neither (pass cycle_momentum=False)")
            self.use_beta1 = "betas" in defaults
            tops = _per_group("max_momentum", optimizer, max_momentum)
            bases = _per_group("base_momentum", optimizer, base_momentum)
            if last_epoch == -1:
                for top, base, group in zip(tops, bases, optimizer.param_groups):
                    self._set_momentum(group, top)
                    group["max_momentum"], group["base_momentum"] = top, base
        super().__init__(optimizer, last_epoch)

    def _set_momentum(self, group: Dict[str, Any], m: float) -> None:
        if self.use_beta1:
            group["betas"] = (m, *group["betas"][1:])
        else:
            group["momentum"] = m

    def _anneal(self, start: float, end: float, pct: float) -> float:
        if self._anneal_func_type == "cos":
            return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def get_lr(self) -> List[float]:
        t = self.last_epoch
        if t > self.total_steps:
            raise ValueError(f"OneCycleLR stepped {t} times; total_steps is {self.total_steps}")
        lrs = []
        for group in self.optimizer.param_groups:
            start = 0.0
            for i, phase in enumerate(self._schedule_phases):
                end = phase["end_step"]
                if t <= end or i == len(self._schedule_phases) - 1:
                    pct = (t - start) / (end - start)
                    lrs.append(self._anneal(group[phase["start_lr"]], group[phase["end_lr"]], pct))
                    if self.cycle_momentum:
                        self._set_momentum(group, self._anneal(group[phase["start_momentum"]],
                                                               group[phase["end_momentum"]], pct))
                    break
                start = end
        return lrs


class _Composite(LRScheduler):
    """Shared state handling of schedulers made of schedulers."""

    def _check_children(self, optimizer: Optimizer, schedulers: Sequence[LRScheduler]) -> List[LRScheduler]:
        schedulers = list(schedulers)
        if not schedulers:
            raise ValueError(f"{type(self).__name__} needs at least one scheduler, got none")
        for i, s in enumerate(schedulers):
            if isinstance(s, ReduceLROnPlateau):
                raise ValueError(f"{type(self).__name__} cannot hold ReduceLROnPlateau (index {i}): "
                                 "its step() needs the metric")
            if getattr(s, "optimizer", None) is not optimizer:
                raise ValueError(f"{type(self).__name__}: scheduler {i} ({type(s).__name__}) drives another "
                                 "optimizer; all must share one")
        return schedulers

    def state_dict(self) -> Dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "_schedulers")}
        state["_schedulers"] = [s.state_dict() for s in self._schedulers]
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.__dict__.update({k: v for k, v in state_dict.items() if k not in ("optimizer", "_schedulers")})
        for s, sd in zip(self._schedulers, state_dict["_schedulers"]):
            s.load_state_dict(sd)


class SequentialLR(_Composite):
    """Run ``schedulers[i]`` between ``milestones[i-1]`` and ``milestones[i]``; each restarts at step 0
    (its closed form) when its turn comes, as in torch.

    Example:
        >>> warm = LinearLR(opt, start_factor=0.1, total_iters=5)
        >>> decay = CosineAnnealingLR(opt, T_max=95)
        >>> sched = SequentialLR(opt, [warm, decay], milestones=[5])
    """

    def __init__(self, optimizer: Optimizer, schedulers: Sequence[LRScheduler], milestones: Sequence[int],
                 last_epoch: int = -1):
        self._schedulers = self._check_children(optimizer, schedulers)
        milestones = list(milestones)
        if len(milestones) != len(self._schedulers) - 1:
            raise ValueError(f"SequentialLR needs one milestone fewer than schedulers: "
                             f"{len(self._schedulers)} schedulers, milestones={milestones!r}")
        self._milestones = milestones
        self.optimizer = optimizer
        self.last_epoch = last_epoch + 1
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"]
        self._undo(self)
        idx = bisect_right(milestones, 0)
        self._schedulers[idx]._initial_step()
        self._last_lr = self._schedulers[idx].get_last_lr()
        self._step_count = 1

    @classmethod
    def _undo(cls, sched: Any) -> None:
        """Take back the constructor step of every scheduler inside (recursively)."""
        if hasattr(sched, "_schedulers"):
            for s in sched._schedulers:
                cls._undo(s)
        elif hasattr(sched, "last_epoch"):
            sched.last_epoch -= 1

    def step(self) -> None:  # type: ignore[override]
        """Advance one step: the scheduler whose turn it is steps (restarted at 0 at its milestone)."""
        self._step_count += 1
        self.last_epoch += 1
        idx = bisect_right(self._milestones, self.last_epoch)
        sched = self._schedulers[idx]
        if idx > 0 and self._milestones[idx - 1] == self.last_epoch:
            sched._update_lr(0)
        else:
            sched.step()
        self._last_lr = sched.get_last_lr()


class ChainedScheduler(_Composite):
    """Step several schedulers together each step; their (chainable) effects compose.

    Example:
        >>> sched = ChainedScheduler([ConstantLR(opt, factor=0.1, total_iters=2), ExponentialLR(opt, 0.9)])
    """

    def __init__(self, schedulers: Sequence[LRScheduler], optimizer: Optional[Optimizer] = None):
        schedulers = list(schedulers)
        if optimizer is None and schedulers:
            optimizer = schedulers[0].optimizer
        self._schedulers = self._check_children(optimizer, schedulers)
        self.optimizer = optimizer
        self._last_lr = _current(optimizer)
        self.last_epoch, self._step_count = 0, 1

    def step(self) -> None:  # type: ignore[override]
        """Step every scheduler in order."""
        self._step_count += 1
        self.last_epoch += 1
        for s in self._schedulers:
            s.step()
        self._last_lr = _current(self.optimizer)


class ReduceLROnPlateau(LRScheduler):
    """Multiply lr by ``factor`` when the metric passed to ``step(metric)`` stops improving for
    more than ``patience`` steps (then wait ``cooldown`` steps); never below ``min_lr``, and
    changes smaller than ``eps`` are skipped.

    ``threshold_mode="rel"`` counts an improvement when ``metric < best * (1 - threshold)``
    (``mode="min"``) or ``metric > best * (1 + threshold)`` (``"max"``); ``"abs"`` uses
    ``best -/+ threshold``.

    Example:
        >>> sched = ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=3)
        >>> sched.step(val_loss)
    """

    def __init__(self, optimizer: Optimizer, mode: str = "min", factor: float = 0.1, patience: int = 10,
                 threshold: float = 1e-4, threshold_mode: str = "rel", cooldown: int = 0,
                 min_lr: Union[float, Sequence[float]] = 0, eps: float = 1e-8):
        if not isinstance(getattr(optimizer, "param_groups", None), list):
            raise TypeError(f"ReduceLROnPlateau needs an optimizer with param_groups, got {type(optimizer).__name__}")
        _check("factor", factor, isinstance(factor, numbers.Real) and 0 <= factor < 1, "a number in [0, 1)")
        _check("mode", mode, mode in ("min", "max"), "'min' or 'max'")
        _check("threshold_mode", threshold_mode, threshold_mode in ("rel", "abs"), "'rel' or 'abs'")
        _check("patience", patience, _is_int(patience) and patience >= 0, "an int >= 0")
        _check("cooldown", cooldown, _is_int(cooldown) and cooldown >= 0, "an int >= 0")
        self.optimizer = optimizer
        self.factor, self.patience, self.cooldown, self.eps = float(factor), int(patience), int(cooldown), eps
        self.mode, self.threshold, self.threshold_mode = mode, threshold, threshold_mode
        self.default_min_lr = None if isinstance(min_lr, (list, tuple)) else min_lr
        self.min_lrs = _per_group("min_lr", optimizer, min_lr)
        self.mode_worse = math.inf if mode == "min" else -math.inf
        self.best, self.cooldown_counter, self.num_bad_epochs = self.mode_worse, 0, 0
        self.last_epoch, self._step_count = 0, 0
        self._last_lr = _current(optimizer)

    @property
    def in_cooldown(self) -> bool:
        return self.cooldown_counter > 0

    def _is_better(self, a: float, best: float) -> bool:
        if self.mode == "min":
            return a < (best * (1.0 - self.threshold) if self.threshold_mode == "rel" else best - self.threshold)
        return a > (best * (1.0 + self.threshold) if self.threshold_mode == "rel" else best + self.threshold)

    def step(self, metrics: Any, epoch: Optional[int] = None) -> None:  # type: ignore[override]
        """Record ``metrics`` (a number or 0-d tensor) for this step and reduce lr if it plateaued."""
        current = float(metrics.item() if hasattr(metrics, "item") else metrics)
        self._step_count += 1
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        if self._is_better(current, self.best):
            self.best, self.num_bad_epochs = current, 0
        else:
            self.num_bad_epochs += 1
        if self.in_cooldown:
            self.cooldown_counter -= 1
            self.num_bad_epochs = 0
        if self.num_bad_epochs > self.patience:
            self._reduce_lr()
            self.cooldown_counter, self.num_bad_epochs = self.cooldown, 0
        self._last_lr = _current(self.optimizer)

    def _reduce_lr(self) -> None:
        groups = self.optimizer.param_groups
        if len(groups) != len(self.min_lrs):
            if self.default_min_lr is None:
                raise RuntimeError(f"the optimizer has {len(groups)} param groups but min_lr lists "
                                   f"{len(self.min_lrs)}; set min_lrs to match")
            self.min_lrs = [self.default_min_lr] * len(groups)
        for group, floor in zip(groups, self.min_lrs):
            old = float(group["lr"])
            new = max(old * self.factor, floor)
            if old - new > self.eps:
                group["lr"] = new

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (the optimizer's lr is the optimizer's own state here)."""
        self.__dict__.update({k: v for k, v in state_dict.items() if k != "optimizer"})
