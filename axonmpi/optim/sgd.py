"""Stochastic gradient descent with momentum, dampening, Nesterov and weight decay (PyTorch's rule)."""
from __future__ import annotations

import numbers
from typing import Any, Dict, Iterable

from ..backend import get_array_module
from ..nn.parameter import local_arrays
from ..kernels.optim import _effective_grad
from .optimizer import Optimizer, state_dtype

__all__ = ["SGD"]


class SGD(Optimizer):
    """SGD exactly as ``torch.optim.SGD`` computes it.

    Per parameter, with ``g`` the gradient (negated when ``maximize``)::

        g = g + weight_decay * p
        if momentum:
            b = g                                   on the first step
            b = momentum * b + (1 - dampening) * g  afterwards
            g = g + momentum * b if nesterov else b
        p -= lr * g

    State per parameter (only with momentum): ``momentum_buffer``.

    Args:
        params: parameters or parameter groups (dicts).
        lr: learning rate (>= 0).
        momentum: momentum factor (>= 0).
        dampening: dampening of the momentum (>= 0).
        weight_decay: L2 penalty (>= 0).
        nesterov: Nesterov momentum (needs momentum > 0 and dampening == 0).
        maximize: ascend instead of descend.

    Example:
        >>> opt = SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, maximize: bool = False, foreach=None,
                 fused=None):
        # torch's foreach / fused pick a kernel, not a result: accepted, the update is the same
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize)
        super().__init__(params, defaults)

    def _validate(self, options: Dict[str, Any]) -> None:
        super()._validate(options)
        for key in ("momentum", "dampening"):
            val = options[key]
            if not isinstance(val, numbers.Real) or not val >= 0.0:
                raise ValueError(f"SGD: invalid {key}={val!r}; expected a number >= 0")
        if options["nesterov"] and (options["momentum"] <= 0 or options["dampening"] != 0):
            raise ValueError(
                f"SGD: nesterov=True needs momentum > 0 and dampening == 0, got "
                f"momentum={options['momentum']!r}, dampening={options['dampening']!r}"
            )

    def _update_group(self, group: Dict[str, Any]) -> None:
        lr, mu, damp = group["lr"], group["momentum"], group["dampening"]
        wd, nesterov, maximize = group["weight_decay"], group["nesterov"], group["maximize"]
        for p in group["params"]:
            pd, g = local_arrays(p)       # this rank's piece ([Note: a parameter keeps its identity])
            if g is None:
                continue
            xp = get_array_module(pd)
            buf, first = None, False
            if mu:
                state = self.state.setdefault(p, {})
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = state["momentum_buffer"] = xp.empty(pd.shape, dtype=state_dtype(pd.dtype))
                    first = True
            for pp, gg, b, s, gs in self._chunks([pd, g, buf], 2):
                gg = _effective_grad(xp, gg, pp, gs, s, maximize, wd)
                if b is not None:
                    if first:
                        b[...] = gg
                    else:
                        b *= mu
                        if damp:
                            xp.multiply(gg, 1.0 - damp, out=s)
                            b += s
                        else:
                            b += gg
                    if nesterov:
                        xp.multiply(b, mu, out=s)
                        s += gg
                        gg = s
                    else:
                        gg = b
                xp.multiply(gg, lr, out=s)
                pp -= s
