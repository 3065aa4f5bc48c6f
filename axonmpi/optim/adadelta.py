"""Adadelta (PyTorch's rule), the optimizer of PyTorch's FSDP tutorial."""
from __future__ import annotations

import numbers
from typing import Any, Dict, Iterable

from ..backend import get_array_module
from ..nn.parameter import local_arrays
from .optimizer import Optimizer, state_dtype

__all__ = ["Adadelta"]


class Adadelta(Optimizer):
    """Adadelta exactly as ``torch.optim.Adadelta`` computes it.

    Per parameter, with ``g`` the gradient (negated when ``maximize``)::

        g = g + weight_decay * p
        v = rho * v + (1 - rho) * g^2                      (square_avg)
        d = sqrt(u + eps) / sqrt(v + eps) * g
        u = rho * u + (1 - rho) * d^2                      (acc_delta)
        p -= lr * d

    State per parameter: ``step``, ``square_avg``, ``acc_delta`` (in the state dtype: float32 for
    16-bit parameters).

    Args:
        params: parameters or parameter groups (dicts).
        lr: the learning rate (default 1.0, as torch).
        rho: decay of the running averages, in [0, 1].
        eps: added inside the square roots.
        weight_decay: L2 penalty (>= 0).
        maximize: ascend instead of descend.

    Example:
        >>> opt = Adadelta(model.parameters(), lr=1.0)
    """

    def __init__(self, params: Iterable[Any], lr: float = 1.0, rho: float = 0.9, eps: float = 1e-6,
                 weight_decay: float = 0.0, maximize: bool = False):
        defaults = dict(lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults)

    def _validate(self, options: Dict[str, Any]) -> None:
        super()._validate(options)
        rho, eps = options["rho"], options["eps"]
        if not isinstance(rho, numbers.Real) or not 0.0 <= rho <= 1.0:
            raise ValueError(f"Adadelta: invalid rho={rho!r}; expected a number in [0, 1]")
        if not isinstance(eps, numbers.Real) or not eps >= 0.0:
            raise ValueError(f"Adadelta: invalid eps={eps!r}; expected a number >= 0")

    def _update_group(self, group: Dict[str, Any]) -> None:
        lr, rho, eps = group["lr"], group["rho"], group["eps"]
        wd, maximize = group["weight_decay"], group["maximize"]
        for p in group["params"]:
            pd, gd = local_arrays(p)      # this rank's piece ([Note: a parameter keeps its identity])
            if gd is None:
                continue
            xp = get_array_module(pd)
            sd = state_dtype(pd.dtype)
            state = self.state.setdefault(p, {})
            if "square_avg" not in state:
                state["step"] = 0
                state["square_avg"] = xp.zeros(pd.shape, dtype=sd)
                state["acc_delta"] = xp.zeros(pd.shape, dtype=sd)
            state["step"] += 1
            v, u = state["square_avg"], state["acc_delta"]
            g = gd.astype(sd, copy=True)
            if maximize:
                g = -g
            if wd:
                g += wd * pd.astype(sd)
            v *= rho
            v += (1.0 - rho) * g * g
            d = xp.sqrt(u + eps) / xp.sqrt(v + eps) * g
            u *= rho
            u += (1.0 - rho) * d * d
            if pd.dtype == sd:
                pd -= lr * d
            else:
                pd[...] = (pd.astype(sd) - lr * d).astype(pd.dtype)
