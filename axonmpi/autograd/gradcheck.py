"""Central finite-difference gradient checking (run it in float64)."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from ..backend import get_array_module, to_host
from .grad_mode import no_grad
from .tensor import Tensor

__all__ = ["gradcheck", "numerical_grad"]


def _scalar_of(out, weights):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    total = 0.0
    for o, w in zip(outs, weights):
        if o is None or w is None:
            continue
        total += float(to_host((o.data * w).sum()))
    return total


def numerical_grad(fn: Callable, inputs: Sequence[Tensor], weights, eps: float = 1e-6,
                   index: int = 0, entries: Optional[Sequence[tuple]] = None) -> np.ndarray:
    """d/d inputs[index] of ``sum(fn(*inputs) * weights)`` by central differences (host array)."""
    x = inputs[index]
    grad = np.zeros(x.shape, dtype=np.float64)
    flat = x.data.reshape(-1)
    positions = range(x.numel()) if entries is None else [np.ravel_multi_index(e, x.shape) for e in entries]
    with no_grad():
        for i in positions:
            old = flat[i].item()
            flat[i] = old + eps
            fp = _scalar_of(fn(*inputs), weights)
            flat[i] = old - eps
            fm = _scalar_of(fn(*inputs), weights)
            flat[i] = old
            grad.reshape(-1)[i] = (fp - fm) / (2 * eps)
    return grad


def gradcheck(fn: Callable, inputs: Sequence[Tensor], eps: float = 1e-6, atol: float = 1e-5,
              rtol: float = 1e-4, seed: int = 0, max_entries: Optional[int] = None,
              raise_exception: bool = True) -> bool:
    """Compare autograd gradients of ``fn(*inputs)`` with central finite differences.

    The (possibly tuple) output is contracted with fixed random weights, so every output
    element and every output of a multi-output op is checked.  Inputs that require grad must
    be float64 leaves (their ``.data`` is perturbed in place and restored).

    Args:
        fn: function of Tensors returning a Tensor or a tuple of Tensors.
        inputs: the arguments; those with ``requires_grad`` are checked.
        eps: finite-difference step.
        atol, rtol: tolerances for ``|analytic - numeric| <= atol + rtol * |numeric|``.
        max_entries: check at most this many (randomly chosen) entries per input.

    Returns:
        True, or raises ``AssertionError`` naming the input and the worst entry.

    Example:
        >>> x = Tensor(np.random.rand(3, 4), requires_grad=True)
        >>> gradcheck(lambda t: (t * t).sum(axis=1), [x])
        True
    """
    rng = np.random.default_rng(seed)
    for i, t in enumerate(inputs):
        if isinstance(t, Tensor) and t.requires_grad and t.dtype != np.float64:
            raise TypeError(f"gradcheck input {i} has dtype {t.dtype}; use float64")
        if isinstance(t, Tensor) and t.requires_grad and not t.is_leaf:
            raise TypeError(f"gradcheck input {i} is not a leaf (it has grad_fn {t.grad_fn!r})")
    out = fn(*inputs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    weights = []
    for o in outs:
        if o is None or not isinstance(o, Tensor) or o.dtype.kind != "f":
            weights.append(None)
            continue
        xp = get_array_module(o.data)
        weights.append(xp.asarray(rng.standard_normal(o.shape)).astype(o.dtype))
    for t in inputs:
        if isinstance(t, Tensor):
            t.grad = None
    roots = [o for o, w in zip(outs, weights) if w is not None and o.requires_grad]
    if roots:
        from .function import backward

        backward(roots, [Tensor._wrap(w) for o, w in zip(outs, weights) if w is not None and o.requires_grad])
    ok = True
    for i, t in enumerate(inputs):
        if not (isinstance(t, Tensor) and t.requires_grad):
            continue
        entries = None
        if max_entries is not None and t.numel() > max_entries:
            picks = rng.choice(t.numel(), size=max_entries, replace=False)
            entries = [np.unravel_index(p, t.shape) for p in picks]
        num = numerical_grad(fn, inputs, weights, eps, i, entries)
        ana = np.zeros(t.shape) if t.grad is None else to_host(t.grad.data).astype(np.float64)
        if entries is not None:
            sel = tuple(np.array(e) for e in zip(*entries))
            num, ana = num[sel], ana[sel]
        err = np.abs(ana - num) - (atol + rtol * np.abs(num))
        if (err > 0).any():
            ok = False
            if raise_exception:
                k = int(np.argmax(err))
                raise AssertionError(
                    f"gradcheck failed for input {i} (shape {t.shape}): worst entry {k}: "
                    f"analytic {ana.reshape(-1)[k]!r} vs numeric {num.reshape(-1)[k]!r}; "
                    f"max abs diff {np.abs(ana - num).max():.3e}")
    return ok
