"""``torch.utils.checkpoint``'s path: ``checkpoint`` and ``checkpoint_sequential`` over the library's activation
checkpointing (:mod:`axonmpi.nn.checkpointing`: the function's intermediates are recomputed in backward, with
the random state replayed, so gradients equal an unchecked call's).

``use_reentrant=`` is accepted with either value: torch's two implementations give the same gradients, and
the library has one (it recomputes during backward, as both do). Keyword arguments reach the function as in
torch's non-reentrant form; a Tensor that needs a gradient must be passed positionally.

Example:
    >>> from axonmpi.utils.checkpoint import checkpoint
    >>> y = checkpoint(block, x, use_reentrant=False)
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from ..autograd.tensor import Tensor
from ..nn import checkpointing as _ckpt

__all__ = ["checkpoint", "checkpoint_sequential"]


def _refuse(context_fn, determinism_check, debug):
    if context_fn is not None and getattr(context_fn, "__name__", "") != "noop_context_fn":
        raise NotImplementedError("checkpoint(context_fn=...) is not built (selective activation checkpointing); "
                                  "leave it out")
    if determinism_check not in ("default", "none"):
        raise ValueError(f"checkpoint: determinism_check must be 'default' or 'none', got {determinism_check!r}")
    if debug:
        raise NotImplementedError("checkpoint(debug=True) is not built; leave it out")


def checkpoint(function: Callable, *args: Any, use_reentrant=None, context_fn=None, determinism_check: str = "default",
               debug: bool = False, preserve_rng_state: bool = True, **kwargs: Any):
    """torch's ``torch.utils.checkpoint.checkpoint``: ``function(*args, **kwargs)`` without keeping its
    intermediates (recomputed in backward). ``use_reentrant`` may be True, False or left out (same gradients).

    Args:
        function: a callable (a Module too) of Tensors, returning a Tensor or a tuple of Tensors.
        *args: its positional arguments (Tensors get gradients).
        use_reentrant: accepted, either value.
        preserve_rng_state: replay the same random numbers (dropout masks) on recomputation.
        **kwargs: passed to ``function`` (no Tensor that requires grad: pass it positionally).

    Returns:
        What ``function`` returns.
    """
    _refuse(context_fn, determinism_check, debug)
    grads_in_kwargs = sorted(k for k, v in kwargs.items() if isinstance(v, Tensor) and v.requires_grad)
    if grads_in_kwargs:
        raise ValueError(f"checkpoint: keyword argument(s) {grads_in_kwargs} are Tensors that require grad; pass them "
                         "positionally so their gradients are computed")
    fn = functools.partial(function, **kwargs) if kwargs else function
    return _ckpt.checkpoint(fn, *args, preserve_rng_state=preserve_rng_state)


def checkpoint_sequential(functions, segments: int, input, use_reentrant=None, **kwargs):  # noqa: A002
    """torch's ``checkpoint_sequential``: ``functions`` (a Sequential or a list of modules) in ``segments``
    checkpointed segments, the last run normally. ``use_reentrant`` as in :func:`checkpoint`."""
    unknown = sorted(set(kwargs) - {"preserve_rng_state"})
    if unknown:
        raise TypeError(f"checkpoint_sequential got unexpected keyword argument(s) {unknown}")
    return _ckpt.checkpoint_sequential(functions, segments, input,
                                       preserve_rng_state=kwargs.get("preserve_rng_state", True))
