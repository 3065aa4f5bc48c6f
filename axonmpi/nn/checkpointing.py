"""Activation checkpointing: run a function without keeping its intermediates, recompute them in backward."""
from __future__ import annotations

from typing import Any, Callable, List, Sequence, Union

import numpy as np

from ..autograd.function import Function, backward as _backward
from ..autograd.grad_mode import enable_grad, is_grad_enabled, no_grad
from ..autograd.tensor import Tensor
from ..backend import get_array_module, is_floating
from ..random import get_rng_state, set_rng_state
from .module import Module, Sequential

__all__ = ["Checkpointed", "checkpoint", "checkpoint_sequential"]


def _run(fn: Callable, raw: Sequence[Any], is_tensor: Sequence[bool], grads_for: Sequence[bool]):
    args = []
    for a, t, g in zip(raw, is_tensor, grads_for):
        if not t:
            args.append(a)
            continue
        x = Tensor.wrap(a)
        if g:
            x.requires_grad = True
        args.append(x)
    return fn(*args), args


class _Checkpoint(Function):
    """Forward of ``fn`` without a graph; backward recomputes it (with the saved RNG state) and back-propagates.

    The last positional argument is an anchor tensor that requires grad, so the node is recorded
    even when no real input does (the chunk's parameters still need their gradients).
    Its backward accumulates the chunk's weight gradients itself, so a split backward
    (:func:`~axonmpi.autograd.split_backward.backward_input`) runs it whole, in B.
    """

    _whole_backward = True

    @staticmethod
    def forward(ctx, *raw, fn, is_tensor, preserve_rng_state):
        raw = raw[:-1]
        ctx.fn, ctx.is_tensor = fn, is_tensor
        ctx.rng = get_rng_state() if preserve_rng_state else None
        with no_grad():
            out, _ = _run(fn, raw, is_tensor, [False] * len(raw))
        ctx.save_for_backward(*raw)
        ctx.multi = isinstance(out, tuple)
        outs = out if ctx.multi else (out,)
        for o in outs:
            if not isinstance(o, Tensor):
                raise TypeError(f"checkpoint: the function must return a Tensor or a tuple of Tensors, "
                                f"got {type(o).__name__}")
        return tuple(o.data for o in outs) if ctx.multi else outs[0].data

    @staticmethod
    def backward(ctx, *grads):
        raw = ctx.saved_tensors
        want = [t and bool(n) and is_floating(getattr(a, "dtype", np.dtype(int)))
                for a, t, n in zip(raw, ctx.is_tensor, ctx.needs_input_grad)]
        now = get_rng_state() if ctx.rng is not None else None
        try:
            if ctx.rng is not None:
                set_rng_state(ctx.rng)
            with enable_grad():
                out, args = _run(ctx.fn, raw, ctx.is_tensor, want)
        finally:
            if now is not None:
                set_rng_state(now)
        outs = out if ctx.multi else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if isinstance(o, Tensor) and o.requires_grad]
        if pairs:
            _backward([o for o, _ in pairs], [g for _, g in pairs])
        result: List[Any] = []
        for a, w in zip(args, want):
            if not w:
                result.append(None)
            else:
                result.append(a.grad.data if a.grad is not None else get_array_module(a.data).zeros_like(a.data))
        anchor = grads[0]
        return tuple(result) + (get_array_module(anchor).zeros((), anchor.dtype),)


def checkpoint(fn: Callable, *args: Any, preserve_rng_state: bool = True):
    """Call ``fn(*args)`` keeping only its inputs; recompute its intermediates during backward.

    Gradients equal those of ``fn(*args)`` exactly (same operations, same order); memory drops to
    the inputs and outputs of ``fn`` at the cost of a second forward. Gradients of parameters used
    inside ``fn`` are accumulated during that recomputation. With ``preserve_rng_state`` the
    random state of :mod:`axonmpi.random` (NumPy generator: dropout on the CPU) is saved before the
    forward and restored for the recomputation, so dropout masks are identical. Without grad mode
    it is a plain call.

    Args:
        fn: a function (or Module) of Tensors (non-Tensor arguments pass through) returning a
            Tensor or a tuple of Tensors.
        *args: its arguments.
        preserve_rng_state: replay the same random numbers on recomputation.

    Returns:
        What ``fn`` returns.

    Example:
        >>> block = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
        >>> y = axonmpi.nn.checkpoint(block, x)       # no intermediate of block is kept
        >>> y.sum().backward()
    """
    if not callable(fn):
        raise TypeError(f"checkpoint: fn must be callable, got {type(fn).__name__}")
    if not is_grad_enabled():
        return fn(*args)
    is_tensor = tuple(isinstance(a, Tensor) for a in args)
    first = next((a.data for a in args if isinstance(a, Tensor)), None)
    xp = get_array_module(first) if first is not None else np
    anchor = Tensor.wrap(xp.zeros((), np.float64))
    anchor.requires_grad = True
    return _Checkpoint.apply(*args, anchor, fn=fn, is_tensor=is_tensor, preserve_rng_state=bool(preserve_rng_state))


def checkpoint_sequential(modules: Union[Sequential, Sequence[Module]], segments: int, x, *,
                          preserve_rng_state: bool = True):
    """Run ``modules`` in order on ``x``, checkpointing each of ``segments`` contiguous segments but the last.

    As in PyTorch, the last segment runs normally (its output is needed for backward anyway).
    Segments are as even as possible (the first ones take one more module).

    Args:
        modules: a ``Sequential`` or a list of modules, each fed the previous one's output.
        segments: number of segments (1 <= segments <= number of modules).
        x: the input.
        preserve_rng_state: see :func:`checkpoint`.

    Returns:
        The output of the last module.

    Example:
        >>> y = checkpoint_sequential(model, 2, x)     # model: nn.Sequential of 6 layers
    """
    mods = list(modules)
    n = len(mods)
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= max(n, 1):
        raise ValueError(f"checkpoint_sequential: segments must be an int in [1, {n}] for {n} modules, "
                         f"got {segments!r}")
    q, extra = divmod(n, segments)
    at = 0
    for k in range(segments):
        part = mods[at:at + q + (1 if k < extra else 0)]
        at += len(part)
        seg = Sequential(*part)
        x = seg(x) if k == segments - 1 else checkpoint(seg, x, preserve_rng_state=preserve_rng_state)
    return x


class Checkpointed(Module):
    """``inner`` with its forward recomputed in backward (activation checkpointing of a whole module,
    e.g. a pipeline chunk).

    Example:
        >>> chunk = Checkpointed(nn.Sequential(block0, block1))
    """

    def __init__(self, inner: Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return checkpoint(self.inner, x)
