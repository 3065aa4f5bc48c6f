"""Walking the autograd graph: the tensors in a nested output, the leaves an output reaches."""
from __future__ import annotations

from typing import Any, Iterator, Set

from .tensor import Tensor

__all__ = ["tensors_in", "reachable_leaves"]


def tensors_in(obj: Any) -> Iterator[Tensor]:
    """Yield every :class:`Tensor` inside ``obj`` (a Tensor, or nested lists/tuples/dict values).

    Example:
        >>> [t.shape for t in tensors_in({"logits": a, "aux": (b, 3)})]
        [(2, 3), (4,)]
    """
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from tensors_in(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors_in(o)


def reachable_leaves(outputs: Any) -> Set[int]:
    """``id()`` of every leaf tensor that a backward from ``outputs`` can send a gradient to.

    A leaf that requires grad and is itself one of ``outputs`` counts as reached.

    Args:
        outputs: a Tensor or a nested structure of Tensors (see :func:`tensors_in`).

    Returns:
        The set of ``id(leaf)``.

    Example:
        >>> w = Parameter(np.ones(2)); v = Parameter(np.ones(2))
        >>> id(v) in reachable_leaves((w * 2).sum())
        False
    """
    stack, seen, leaves = [], set(), set()
    for t in tensors_in(outputs):
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad:
            leaves.add(id(t))
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        for e in getattr(fn, "_edges", ()) or ():
            if e is None:
                continue
            if e[1] < 0:
                leaves.add(id(e[0]))
            elif id(e[0]) not in seen:
                stack.append(e[0])
    return leaves
