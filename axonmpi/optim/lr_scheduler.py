"""Learning-rate schedulers, PyTorch semantics: the constructor sets the initial lr, ``step()`` advances."""
from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Dict, List, Sequence, Union

from .optimizer import Optimizer

__all__ = ["CosineAnnealingLR", "LRScheduler", "LambdaLR", "LinearWarmupCosine", "StepLR"]


class LRScheduler:
    """Base class: sets every group's ``lr`` to :meth:`lr_at` of the step count.

    Schedules here are closed-form functions of ``last_epoch`` (the number of
    ``step()`` calls so far) and each group's ``initial_lr``, so resuming from a
    :meth:`state_dict` or constructing with ``last_epoch=k`` gives exactly the same
    values as stepping ``k`` times. Subclasses implement ``lr_at(base_lr, t)``.

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
        self.step()

    def lr_at(self, base_lr: float, t: int) -> float:
        """The learning rate after ``t`` steps for a group that started at ``base_lr``."""
        raise NotImplementedError(f"{type(self).__name__} must implement lr_at")

    def get_lr(self) -> List[float]:
        """Learning rates of all groups at the current step."""
        return [self.lr_at(base, self.last_epoch) for base in self.base_lrs]

    def step(self) -> None:
        """Advance one step and write the new learning rates into the optimizer."""
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
    """``lr = base_lr * gamma ** (t // step_size)``.

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


class CosineAnnealingLR(LRScheduler):
    """``lr = eta_min + (base_lr - eta_min) * (1 + cos(pi * t / T_max)) / 2`` (SGDR without restarts).

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
