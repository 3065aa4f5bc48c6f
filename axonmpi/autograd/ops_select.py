"""Selection ops torch model files call: ``topk`` (values differentiable), ``tril`` / ``triu`` and
``multinomial`` (sampling, no gradient), with PyTorch's signatures."""
from __future__ import annotations

from collections import namedtuple

import numpy as np

from ..backend import device_of, get_array_module, to_device, to_host
from ._util import _axes
from .function import Function
from .tensor import Tensor

__all__ = ["TopK", "multinomial", "topk", "tril", "triu"]

TopK = namedtuple("TopK", ["values", "indices"])
TopK.__doc__ = """``(values, indices)`` returned by :func:`topk` (PyTorch's ``return_types.topk``)."""


def _along(idx, dim: int):
    """Fancy-index tuple addressing ``idx``'s positions along ``dim`` (``put_along_axis`` by hand: CuPy too)."""
    xp = get_array_module(idx)
    grid = []
    for i, n in enumerate(idx.shape):
        if i == dim:
            grid.append(idx)
        else:
            grid.append(xp.arange(n).reshape([-1 if j == i else 1 for j in range(idx.ndim)]))
    return tuple(grid)


class _TopK(Function):
    """The ``k`` largest (or smallest) entries along ``dim``; the gradient goes to the selected positions."""

    _fresh_grads = True

    @staticmethod
    def forward(ctx, a, k, dim, largest, sorted_):
        xp = get_array_module(a)
        key = a.astype(np.int64) if a.dtype.kind in "ub" else a
        key = -key if largest else key
        order = xp.argsort(key, axis=dim, kind="stable")           # ties: the lower index first, as torch's CPU
        idx = xp.take(order, xp.arange(k), axis=dim)
        if not sorted_:
            idx = xp.sort(idx, axis=dim)                           # torch leaves the order free; keep index order
        ctx.save_for_backward(idx)
        ctx.shape, ctx.dim = a.shape, dim
        return xp.take_along_axis(a, idx, axis=dim), idx.astype(np.int64, copy=False)

    @staticmethod
    def backward(ctx, g, g_idx):
        (idx,) = ctx.saved_tensors
        xp = get_array_module(g)
        out = xp.zeros(ctx.shape, g.dtype)
        out[_along(idx, ctx.dim)] = g
        return out, None, None, None, None


def topk(input, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> TopK:  # noqa: A002
    """PyTorch's ``topk``: the ``k`` largest (``largest=False``: smallest) entries of ``input`` along ``dim``
    and their int64 indices, as ``(values, indices)``; values are differentiable (the gradient goes to
    the selected positions). Ties keep the lower index first.

    Example:
        >>> v, i = topk(Tensor([[1.0, 5.0, 3.0]]), 2)
        >>> v.tolist(), i.tolist()
        ([[5.0, 3.0]], [[1, 2]])
    """
    if not isinstance(input, Tensor):
        raise TypeError(f"topk expects a Tensor, got {type(input).__name__}")
    ndim = max(input.ndim, 1)
    (d,) = _axes(int(dim), ndim)
    n = input.shape[d] if input.ndim else 1
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= n:
        raise ValueError(f"topk: k must be an int in [0, {n}] (the size of dim {dim} of shape "
                         f"{tuple(input.shape)}), got {k!r}")
    x = input if input.ndim else input.reshape(1)
    values, indices = _TopK.apply(x, int(k), d, bool(largest), bool(sorted))
    if not input.ndim:
        values, indices = values.reshape(()), indices.reshape(())
    return TopK(values, indices)


class _Tri(Function):
    """Keep the lower (``upper=False``) or upper triangle of the last two dims; the gradient is masked alike."""

    _fresh_grads = True

    @staticmethod
    def forward(ctx, a, diagonal, upper):
        xp = get_array_module(a)
        ctx.diagonal, ctx.upper = diagonal, upper
        return (xp.triu if upper else xp.tril)(a, k=diagonal)

    @staticmethod
    def backward(ctx, g):
        xp = get_array_module(g)
        return (xp.triu if ctx.upper else xp.tril)(g, k=ctx.diagonal), None, None


def _tri(name, input, diagonal, upper):
    if not isinstance(input, Tensor):
        input = Tensor(input)
    if input.ndim < 2:
        raise ValueError(f"{name} expects a tensor of at least 2 dims (the triangle is of the last two), got "
                         f"shape {tuple(input.shape)}")
    if isinstance(diagonal, bool) or not isinstance(diagonal, (int, np.integer)):
        raise TypeError(f"{name}: diagonal must be an int, got {diagonal!r}")
    return _Tri.apply(input, int(diagonal), upper)


def tril(input, diagonal: int = 0) -> Tensor:  # noqa: A002
    """PyTorch's ``tril``: the lower triangle of the last two dims (entries above ``diagonal`` zeroed).

    Example:
        >>> tril(ones(3, 3)).tolist()[0]
        [1.0, 0.0, 0.0]
    """
    return _tri("tril", input, diagonal, False)


def triu(input, diagonal: int = 0) -> Tensor:  # noqa: A002
    """PyTorch's ``triu``: the upper triangle of the last two dims (entries below ``diagonal`` zeroed)."""
    return _tri("triu", input, diagonal, True)


def _check_weights(w: np.ndarray, num_samples, replacement):
    if w.ndim not in (1, 2):
        raise ValueError(f"multinomial expects a 1-d or 2-d tensor of weights, got shape {w.shape}")
    if w.dtype.kind not in "fiu":
        raise TypeError(f"multinomial expects numeric weights, got dtype {w.dtype}")
    n = w.shape[-1]
    if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or num_samples < 1:
        raise ValueError(f"multinomial: num_samples must be a positive int, got {num_samples!r}")
    if not replacement and num_samples > n:
        raise ValueError(f"multinomial: cannot draw {num_samples} samples without replacement from {n} "
                         f"categories; pass replacement=True or num_samples <= {n}")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError("multinomial: the weights must be finite and non-negative (probabilities or "
                         "unnormalised weights), got a negative, inf or nan entry")
    sums = w.sum(axis=-1)
    if np.any(sums <= 0):
        raise ValueError("multinomial: a row of weights sums to 0 (invalid distribution; torch raises too)")
    if not replacement and np.any(np.count_nonzero(w, axis=-1) < num_samples):
        raise ValueError(f"multinomial: a row has fewer than {num_samples} non-zero weights, so "
                         f"{num_samples} distinct categories cannot be drawn without replacement")


def multinomial(input, num_samples: int, replacement: bool = False, *, generator=None, out=None) -> Tensor:  # noqa: A002
    """PyTorch's ``multinomial``: ``num_samples`` category indices (int64) per row of non-negative weights
    ``input`` (1-d or 2-d; rows need not sum to 1), with or without replacement, drawn on the host from
    ``generator`` (an :class:`axonmpi.Generator`) or axonmpi's default generator. Not differentiable.
    The numbers are NumPy's stream, not torch's: the same seed gives the same draws here on every rank.

    Example:
        >>> multinomial(Tensor([0.0, 1.0, 0.0]), 1).tolist()
        [1]
    """
    from ..random import host_generator

    if out is not None:
        raise NotImplementedError("multinomial(out=...) is not built; use the returned tensor")
    raw = input.data if isinstance(input, Tensor) else input
    w = to_host(raw)
    _check_weights(w, num_samples, replacement)
    rng = host_generator(generator)
    rows = w.reshape(-1, w.shape[-1]).astype(np.float64)
    drawn = np.empty((rows.shape[0], int(num_samples)), np.int64)
    for r, row in enumerate(rows):
        drawn[r] = rng.choice(row.shape[0], size=int(num_samples), replace=bool(replacement), p=row / row.sum())
    drawn = drawn.reshape(w.shape[:-1] + (int(num_samples),))
    return Tensor._wrap(to_device(drawn, device_of(raw)))
