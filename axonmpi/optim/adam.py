"""Adam and AdamW with PyTorch's update rules: one fused pass per parameter group (``kernels.adam_update_multi``)."""
from __future__ import annotations

import math
import numbers
from typing import Any, Dict, Iterable, Tuple

import numpy as np

from .. import kernels as K
from ..backend import get_array_module
from ..nn.parameter import local_arrays
from .optimizer import _HOST_CHUNK, Optimizer, state_dtype

__all__ = ["Adam", "AdamW"]


class Adam(Optimizer):
    """Adam (Kingma & Ba) exactly as ``torch.optim.Adam`` computes it.

    Per parameter, with ``g`` the gradient (negated when ``maximize``) and step ``t``::

        g  = g + weight_decay * p                    (L2 penalty; AdamW decays p instead)
        m  = beta1 * m + (1 - beta1) * g
        v  = beta2 * v + (1 - beta2) * g * g
        v_ = max(v_, v) if amsgrad else v
        p -= lr / (1 - beta1**t) * m / (sqrt(v_) / sqrt(1 - beta2**t) + eps)

    State per parameter: ``step`` (int), ``exp_avg``, ``exp_avg_sq`` and with amsgrad
    ``max_exp_avg_sq`` (float32 for 16-bit parameters).

    Args:
        params: parameters or parameter groups (dicts).
        lr: learning rate (>= 0).
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to the denominator (>= 0).
        weight_decay: L2 penalty coefficient (>= 0).
        amsgrad: use the running maximum of ``v`` (AMSGrad).
        maximize: ascend instead of descend.

    Example:
        >>> opt = Adam(model.parameters(), lr=3e-4)
        >>> loss.backward(); opt.step(); opt.zero_grad()
    """

    _decoupled = False

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, maximize: bool = False,
                 foreach=None, fused=None):
        # torch's foreach / fused pick a kernel, not a result: accepted, the update is the same
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize)
        super().__init__(params, defaults)

    def _validate(self, options: Dict[str, Any]) -> None:
        super()._validate(options)
        name = type(self).__name__
        betas = options["betas"]
        if (not isinstance(betas, (tuple, list)) or len(betas) != 2
                or not all(isinstance(b, numbers.Real) and 0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"{name}: invalid betas={betas!r}; expected two numbers in [0, 1)")
        eps = options["eps"]
        if not isinstance(eps, numbers.Real) or not eps >= 0.0:
            raise ValueError(f"{name}: invalid eps={eps!r}; expected a number >= 0")

    def _update_group(self, group: Dict[str, Any]) -> None:
        lr, (b1, b2), eps = group["lr"], group["betas"], group["eps"]
        wd, amsgrad, maximize = group["weight_decay"], group["amsgrad"], group["maximize"]
        ps, gs, ms, vs, vmaxs, lows, steps = [], [], [], [], [], [], []
        for p in group["params"]:
            pd, g = local_arrays(p)       # this rank's piece ([Note: a parameter keeps its identity])
            if g is None:
                continue
            state = self.state.get(p)
            if state is None:
                state = self.state[p] = self._init_state(pd, amsgrad)
            t = state["step"] = state["step"] + 1
            vmax = state.get("max_exp_avg_sq") if amsgrad else None
            if amsgrad and vmax is None:  # amsgrad switched on after the state was made
                vmax = state["max_exp_avg_sq"] = get_array_module(pd).zeros(pd.shape, dtype=state_dtype(pd.dtype))
            ps.append(pd)
            gs.append(g)
            ms.append(state["exp_avg"])
            vs.append(state["exp_avg_sq"])
            vmaxs.append(vmax)
            lows.append(_low_copy(p, pd))
            steps.append((t, type(pd)))
        if not ps:
            return
        first = steps[0]
        keys = [first] if steps.count(first) == len(steps) else list(dict.fromkeys(steps))
        for key in keys:                  # one pass per step count and array kind (one in a plain run)
            idx = range(len(ps)) if len(keys) == 1 else [i for i, k in enumerate(steps) if k == key]
            pick = (lambda a: a) if len(keys) == 1 else (lambda a: [a[i] for i in idx])
            xp = get_array_module(ps[idx[0]])
            coef = K.adam_coefficients(lr, (b1, b2), eps, wd, key[0], self._decoupled, xp)
            K.adam_update_multi(pick(ps), pick(gs), pick(ms), pick(vs), coef, maximize=maximize,
                                vmaxs=pick(vmaxs) if amsgrad else None,
                                lows=pick(lows) if any(x is not None for x in lows) else None,
                                scratch=self._host_scratch if xp is np else None,
                                cache=self.__dict__.setdefault("_address_cache", {}) if xp is np else None)

    def _host_scratch(self, pd: Any):
        n = min(pd.size, _HOST_CHUNK)
        return self._scratch(pd, n, 2) if n else None

    @staticmethod
    def _init_state(pd: Any, amsgrad: bool) -> Dict[str, Any]:
        xp = get_array_module(pd)
        dt = state_dtype(pd.dtype)
        names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")
        state = {"step": 0}
        state.update((k, xp.zeros(pd.shape, dtype=dt)) for k in names)
        return state


def _low_copy(p, pd):
    """The parameter's lower-precision working copy the update writes in the same pass, or None.

    A strategy that computes in 16 bits from float32 master weights sets ``p.low_precision_copy`` to an array
    of the local piece's shape in the compute dtype; the optimizer then refreshes it with every step (no
    separate cast pass before the next forward)."""
    d = getattr(p, "__dict__", None)
    low = d.get("low_precision_copy") if d else None
    if low is None:
        return None
    if tuple(low.shape) != tuple(pd.shape) or get_array_module(low) is not get_array_module(pd):
        raise ValueError(f"low_precision_copy of shape {tuple(low.shape)} on {type(low).__module__} does not match "
                         f"the parameter's local piece {tuple(pd.shape)}: give an array of that shape on its device")
    return low


class AdamW(Adam):
    """Adam with decoupled weight decay, exactly as ``torch.optim.AdamW``.

    Identical to :class:`Adam` except that ``weight_decay`` shrinks the parameter,
    ``p *= 1 - lr * weight_decay``, before the Adam update instead of adding an L2
    term to the gradient. Default ``weight_decay=1e-2``.

    Example:
        >>> opt = AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    """

    _decoupled = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False,
                 maximize: bool = False, foreach=None, fused=None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, maximize=maximize)
