"""A backward split in two: input gradients now (B), weight gradients later (W), the same bits as one backward."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

from .function import Function, _accumulate, _classify, _finalize_leaf, _graph_order, _incoming, _leaf_schedule, _to_array
from .grad_mode import no_grad
from .tensor import Tensor

__all__ = ["WeightGradients", "backward_input"]

# [Note: B/W split]
# A zero-bubble pipeline runs a stage's backward in two actions: B computes the gradient of the
# stage's input (which the previous stage waits for) and W the gradients of the weights (which no
# one waits for, so W can fill a bubble). Each node of the graph is either *on the input path*
# (some input leaf is reachable from it) or not. B runs the on-path nodes, in the order an ordinary
# backward would, asking each only for the gradients of its on-path edges (``needs_input_grad`` is
# masked, so Linear computes dX = dY W and not dW = dY^T X). A node that also feeds a weight keeps
# its saved arrays and its incoming gradient. W then walks the same order again: each such node is
# asked for its remaining edges with the incoming gradient it kept, and the nodes off the input path
# (a weight's transpose, ...) run as usual. Every gradient is computed by the same op from the same
# arrays, and each pending sum is accumulated in the same order, so ``.grad`` ends up bitwise equal to
# that of :func:`~axonmpi.autograd.backward`. Leaf hooks (DDP's post-accumulate hooks) fire in W for
# the weights and in B for the inputs.
#
# A Function whose backward accumulates weight gradients itself instead of returning them (activation
# checkpointing runs an inner backward over the recomputed chunk) cannot be asked twice: it sets the
# class attribute ``_whole_backward = True`` and runs entirely in B, weights included.


def _with_needs(fn: Function, needs, incoming):
    """``fn.backward`` on ``incoming`` with ``needs_input_grad`` replaced for the call."""
    saved = fn.needs_input_grad
    fn.needs_input_grad = needs
    try:
        results = type(fn).backward(fn, *incoming)
    finally:
        fn.needs_input_grad = saved
    if type(results) is not tuple:
        results = (results,)
    if len(results) != len(fn._edges):
        raise RuntimeError(f"{type(fn).__name__}.backward returned {len(results)} gradients; "
                           f"expected {len(fn._edges)} (one per forward argument, None where not needed)")
    return tuple(None if (r is None or not n) else _to_array(r, None) for r, n in zip(results, needs))


def _propagate(fn: Function, needs, incoming, pending: Dict[Any, list]) -> None:
    results = _with_needs(fn, needs, [e[0] for e in incoming])
    owned = _classify(results, incoming, type(fn)._fresh_grads)
    for e, g, own in zip(fn._edges, results, owned):
        if g is not None:
            target, idx = e
            _accumulate(pending, (id(target), idx) if idx >= 0 else id(target), g, own)


class WeightGradients:
    """The deferred half of a :func:`backward_input`: call :meth:`run` once to accumulate the weights' ``.grad``."""

    def __init__(self, order: List[Function], deferred: Dict[int, tuple], pending: Dict[Any, list],
                 roots: List[tuple]):
        self._order, self._deferred, self._pending, self._roots = order, deferred, pending, roots
        self._done = False

    @property
    def done(self) -> bool:
        """Whether :meth:`run` has run."""
        return self._done

    def run(self) -> None:
        """Compute and accumulate every weight gradient the input-gradient pass left out (the W action)."""
        if self._done:
            raise RuntimeError("WeightGradients.run: the weight gradients of this backward were already "
                               "accumulated; each backward_input has exactly one W")
        self._done = True
        pending, order, deferred = self._pending, self._order, self._deferred
        last, finalize_at = _leaf_schedule(order, lambda fn, k: id(fn) not in deferred or deferred[id(fn)][0][k])
        for t, g, owned in self._roots:
            if id(t) in last:
                _accumulate(pending, id(t), g, owned)
            else:
                _finalize_leaf(t, g, owned)
        with no_grad():
            for pos, fn in enumerate(order):
                if id(fn) in deferred:
                    needs, incoming = deferred.pop(id(fn))
                    if incoming is not None:
                        _propagate(fn, needs, incoming, pending)
                else:
                    incoming = _incoming(fn, pending)
                    if incoming is not None:
                        _propagate(fn, fn.needs_input_grad, incoming, pending)
                fn._release()
                for leaf in finalize_at.get(pos, ()):
                    entry = pending.pop(id(leaf), None)
                    if entry is not None:
                        _finalize_leaf(leaf, *entry)
        self._order = self._deferred = self._pending = self._roots = None


def backward_input(tensors, grad_tensors=None, inputs: Sequence[Tensor] = ()) -> WeightGradients:
    """Backward for the gradients of ``inputs`` only; the other leaves' gradients wait for ``.run()``.

    ``inputs`` are leaf tensors that require grad (a pipeline stage's received activation). Their
    ``.grad`` is accumulated now, exactly as :func:`~axonmpi.autograd.backward` would; every
    other leaf reachable from ``tensors`` (the weights: dW = X^T dY of a Linear and its relatives)
    gets its ``.grad`` when the returned :class:`WeightGradients` runs, bitwise equal to an
    ordinary backward's. Until then the graph keeps what the weight gradients need (see
    [Note: B/W split]).

    Args:
        tensors: a Tensor or a sequence of Tensors to differentiate.
        grad_tensors: their output gradients, arrays or Tensors (one, or a sequence for a
            sequence of ``tensors``; ``None`` for a scalar: ones).
        inputs: the leaves whose gradients are computed now (may be empty: all work is deferred).

    Returns:
        A :class:`WeightGradients`; call ``.run()`` exactly once.

    Example:
        >>> x = Tensor(np.ones((2, 3)), requires_grad=True); lin = nn.Linear(3, 4)
        >>> w = backward_input(lin(x).sum(), inputs=[x])   # x.grad is set, lin.weight.grad is None
        >>> w.run()                                         # now lin.weight.grad is set
    """
    if isinstance(tensors, Tensor):
        tensors, grad_tensors = [tensors], [grad_tensors]
    elif grad_tensors is None:
        grad_tensors = [None] * len(tensors)
    if isinstance(inputs, Tensor):
        inputs = [inputs]
    for k, x in enumerate(inputs):
        if not isinstance(x, Tensor) or x.grad_fn is not None or not x.requires_grad:
            raise ValueError(f"backward_input: inputs[{k}] must be a leaf Tensor that requires grad, got "
                             f"{type(x).__name__}" + ("" if not isinstance(x, Tensor) else
                                                      f" (requires_grad={x.requires_grad}, "
                                                      f"leaf={x.grad_fn is None})"))
    input_ids = {id(x) for x in inputs}
    pending: Dict[Any, list] = {}
    roots, w_roots = [], []
    for t, g in zip(tensors, grad_tensors):
        if not t.requires_grad:
            raise RuntimeError("backward_input: a tensor does not require grad and does not have a grad_fn")
        xp = t.xp
        if g is None:
            if t.data.size != 1:
                raise RuntimeError(f"grad can be implicitly created only for scalar outputs; got shape {tuple(t.shape)}")
            g, owned = xp.ones_like(t.data), True
        else:
            g, owned = _to_array(g, xp), False
            if tuple(g.shape) != tuple(t.data.shape):
                raise ValueError(f"grad shape {tuple(g.shape)} does not match tensor shape {tuple(t.shape)}")
        if t.grad_fn is None:
            (roots if id(t) in input_ids else w_roots).append((t, g, owned))
        else:
            _accumulate(pending, (id(t.grad_fn), t._out_idx), g, owned)

    order = _graph_order(tensors)

    # a node's inputs were made before it (lower _seq): walk upwards to mark the input path
    on_path: Dict[int, bool] = {}
    for fn in reversed(order):
        on_path[id(fn)] = any(e is not None and (id(e[0]) in input_ids if e[1] < 0 else on_path[id(e[0])])
                              for e in fn._edges)

    def in_b(e) -> bool:
        return e is not None and (id(e[0]) in input_ids if e[1] < 0 else on_path[id(e[0])])

    b_order = [fn for fn in order if on_path[id(fn)]]
    last: Dict[int, int] = {}
    for pos, fn in enumerate(b_order):
        for e in fn._edges:
            if e is not None and e[1] < 0 and id(e[0]) in input_ids:
                last[id(e[0])] = pos
    finalize_at: Dict[int, List[Tensor]] = {}
    for x in inputs:
        if id(x) in last:
            finalize_at.setdefault(last[id(x)], []).append(x)
    for t, g, owned in roots:
        if id(t) in last:
            _accumulate(pending, id(t), g, owned)
        else:
            _finalize_leaf(t, g, owned)

    deferred: Dict[int, tuple] = {}
    whole_leaves: Dict[int, Tensor] = {}     # weights a _whole_backward node reached in B
    with no_grad():
        for pos, fn in enumerate(b_order):
            incoming = _incoming(fn, pending)
            if getattr(type(fn), "_whole_backward", False):
                b_needs, w_needs = fn.needs_input_grad, (False,) * len(fn._edges)
                whole_leaves.update((id(e[0]), e[0]) for e in fn._edges
                                    if e is not None and e[1] < 0 and id(e[0]) not in input_ids)
            else:
                b_needs = tuple(n and in_b(e) for n, e in zip(fn.needs_input_grad, fn._edges))
                w_needs = tuple(n and e is not None and not in_b(e) for n, e in zip(fn.needs_input_grad, fn._edges))
            if incoming is not None:
                # W reuses ``incoming``: B must not hand it on as an array it may add into
                shared = [[e[0], False] for e in incoming] if any(w_needs) else incoming
                _propagate(fn, b_needs, shared, pending)
            if any(w_needs):
                deferred[id(fn)] = (w_needs, incoming)
            else:
                fn._release()
            for leaf in finalize_at.get(pos, ()):
                entry = pending.pop(id(leaf), None)
                if entry is not None:
                    _finalize_leaf(leaf, *entry)
    w_order = [fn for fn in order if not on_path[id(fn)] or id(fn) in deferred]
    w_leaves = {id(e[0]) for fn in w_order for k, e in enumerate(fn._edges) if e is not None and e[1] < 0
                and (id(fn) not in deferred or deferred[id(fn)][0][k])}
    for lid, leaf in whole_leaves.items():
        entry = pending.pop(lid, None) if lid not in w_leaves else None
        if entry is not None:
            _finalize_leaf(leaf, *entry)
    return WeightGradients(w_order, deferred, pending, w_roots)
