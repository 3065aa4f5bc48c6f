"""Learning-rate schedulers, PyTorch semantics: the constructor sets the initial lr, ``step()`` advances."""
from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Dict, List, Sequence, Union

from .optimizer import Optimizer

__all__ = ["CosineAnnealingLR", "LRScheduler", "LambdaLR", "LinearWarmupCosine", "StepLR"]


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
        self._step_count = 0
        self.step()

    def lr_at(self, base_lr: float, t: int) -> float:
        """The learning rate after ``t`` steps for a group that started at ``base_lr``."""
        raise NotImplementedError(f"{type(self).__name__} must implement lr_at")

    def get_lr(self) -> List[float]:
        """Learning rates of all groups at the current step."""
        return [self.lr_at(base, self.last_epoch) for base in self.base_lrs]

    def step(self) -> None:
        """Advance one step and write the new learning rates into the optimizer."""
        self._step_count += 1
        self.last_epoch += 1
        self._last_lr = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr

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
