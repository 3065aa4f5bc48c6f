"""``Function`` (PyTorch-style ctx-based custom ops) and the backward engine."""
from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import trace as _trace
from ..backend import get_array_module
from . import replay as _replay
from .grad_mode import is_grad_enabled, no_grad
from .tensor import Tensor

__all__ = ["Function", "RemovableHandle", "backward", "backward_depth", "queue_callback"]

_SEQ = itertools.count()


class RemovableHandle:
    """Handle returned by hook registration; ``remove()`` unregisters the hook."""

    __slots__ = ("_hooks", "_key")
    _ids = itertools.count()

    def __init__(self, hooks: Dict[int, Callable]):
        self._hooks = hooks
        self._key = next(RemovableHandle._ids)

    def remove(self) -> None:
        """Unregister the hook (idempotent)."""
        self._hooks.pop(self._key, None)


class Function:
    """Base class of differentiable operations; an instance is both the ``ctx`` and the graph node.

    Subclass with ``@staticmethod forward(ctx, *args, **kwargs)`` computing on raw arrays
    (``Tensor`` arguments arrive as their ``.data``; other arguments pass through unchanged)
    and ``@staticmethod backward(ctx, *grad_outputs)`` returning one raw array (or ``None``)
    per positional argument of ``forward``.  ``forward`` may return one array or a tuple of
    arrays (several outputs) and may return an input array unchanged (identity forward).
    Backward functions must not modify their ``grad_outputs`` in place.  A ``None`` gradient for
    an input that requires grad contributes nothing (a leaf that receives only ``None`` keeps
    ``.grad`` as it was, like PyTorch).

    The engine never writes into an array a custom ``backward`` returns (it may be a constant or
    a buffer the Function keeps): it copies before accumulating in place.  Built-in ops whose
    backward returns only fresh arrays or views of its ``grad_outputs`` set the class attribute
    ``_fresh_grads = True`` so their results are reused without a copy.

    Example:
        >>> class Double(Function):
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         return x * 2
        ...     @staticmethod
        ...     def backward(ctx, g):
        ...         return g * 2
        >>> y = Double.apply(Tensor([1.0, 2.0], requires_grad=True))
    """

    __slots__ = ("_edges", "_saved", "needs_input_grad", "_seq", "_n_out", "_out_meta",
                 "_out_hooks", "_freed", "_tix", "__dict__", "__weakref__")

    _fresh_grads = False  # True: backward returns only new arrays or views of its grad_outputs

    # -- ctx API -----------------------------------------------------------------------------
    def save_for_backward(self, *arrays: Any) -> None:
        """Keep arrays (or Tensors, stored as their arrays) for ``backward``."""
        self._saved = tuple(a.data if isinstance(a, Tensor) else a for a in arrays)

    @property
    def saved_tensors(self) -> Tuple[Any, ...]:
        """The arrays given to :meth:`save_for_backward`."""
        if self._saved is None:
            raise RuntimeError(
                f"{type(self).__name__}: saved tensors were freed after backward; "
                "call backward(retain_graph=True) to backward through the graph twice")
        return self._saved

    # -- subclass API ------------------------------------------------------------------------
    @staticmethod
    def forward(ctx, *args, **kwargs):  # pragma: no cover - abstract
        raise NotImplementedError("Function subclasses must implement forward(ctx, ...)")

    @staticmethod
    def backward(ctx, *grad_outputs):  # pragma: no cover - abstract
        raise NotImplementedError("Function subclasses must implement backward(ctx, ...)")

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any):
        """Run ``forward`` on the raw arrays and record the op when gradients are needed."""
        ctx = object.__new__(cls)
        ctx._saved = ()
        raw = []
        needs = []
        record = False
        for a in args:
            if isinstance(a, Tensor):
                raw.append(a.data)
                r = a._rg
                needs.append(r)
                record = record or r
            else:
                raw.append(a)
                needs.append(False)
        record = record and is_grad_enabled()
        ctx.needs_input_grad = tuple(needs) if record else (False,) * len(needs)
        out = cls.forward(ctx, *raw, **kwargs)
        if not record:
            ctx._saved = None
            if type(out) is tuple:
                return tuple(Tensor._wrap(o) for o in out)
            return Tensor._wrap(out)
        ctx._edges = tuple(_edge(a) if n else None for a, n in zip(args, needs))
        ctx._seq = next(_SEQ)
        ctx._out_hooks = None
        ctx._freed = False
        if type(out) is tuple:
            ctx._n_out = len(out)
            xp = get_array_module(*out)
            ctx._out_meta = tuple((o.shape, o.dtype, xp) for o in out)
            wrapped = tuple(Tensor._wrap_out(o, ctx, i) for i, o in enumerate(out))
        else:
            ctx._n_out = 1
            ctx._out_meta = None
            wrapped = Tensor._wrap_out(out, ctx, 0)
        tape = _replay.active_tape()
        if tape is not None:             # a step being recorded or replayed ([Note: what a replay skips])
            tape.add(ctx, out)
        return wrapped

    def _release(self) -> None:
        self._saved = None
        self._freed = True
        self.__dict__.clear()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} node>"


def _edge(t: Tensor):
    """Where the gradient of input ``t`` goes: ``(node, output_index)`` or ``(leaf, -1)``."""
    fn = t.grad_fn
    return (t, -1) if fn is None else (fn, t._out_idx)


def _derived_from(g, a) -> bool:
    if g is a:
        return True
    base = getattr(g, "base", None)
    return base is not None and (base is a or base is getattr(a, "base", None))


def _classify(results: Sequence[Any], incoming: Sequence[Tuple[Any, bool]], fresh: bool) -> List[bool]:
    """For each returned gradient, whether the engine owns it exclusively (may keep/modify it).

    Without ``fresh`` (a custom Function), nothing returned is owned: the array may be a constant
    or state of the Function, so the engine copies before it writes.
    """
    if not fresh:
        return [False] * len(results)
    owned = []
    for i, g in enumerate(results):
        if g is None:
            owned.append(False)
            continue
        src = None
        for k, (a, _) in enumerate(incoming):
            if a is not None and _derived_from(g, a):
                src = k
                break
        if src is None:
            ok = getattr(g, "base", None) is None
            if ok:
                ok = not any(h is g for j, h in enumerate(results) if j != i)
        else:
            a = incoming[src][0]
            ok = incoming[src][1] and g.size <= a.size and not any(
                h is not None and _derived_from(h, a) for j, h in enumerate(results) if j != i)
        owned.append(ok)
    return owned


def _to_array(g, xp):
    if isinstance(g, Tensor):
        return g.data
    if isinstance(g, np.generic):
        return np.asarray(g)
    return g


def _accumulate(pending: Dict[Any, list], key, g, owned: bool) -> None:
    pending[key] = _merged(pending.get(key), g, owned)


def _merged(entry: Optional[list], g, owned: bool) -> list:
    """A pending gradient ``[array, owned]`` plus ``g`` (in place when the array is this engine's own)."""
    if entry is None:
        return [g, owned]
    if entry[1] and entry[0].shape == g.shape and entry[0].dtype == g.dtype:
        entry[0] += g
    else:
        entry[0] = entry[0] + g
        entry[1] = True
    return entry


def _finalize_leaf(leaf: Tensor, g, owned: bool) -> None:
    if leaf._hooks:
        for hook in list(leaf._hooks.values()):
            r = hook(Tensor._wrap(g))
            if r is not None:
                r = r.data if isinstance(r, Tensor) else r
                if r is not g:
                    owned = False
                g = r
    if g.shape != leaf.data.shape:
        raise RuntimeError(
            f"gradient of shape {tuple(g.shape)} for a leaf of shape {tuple(leaf.data.shape)}; "
            "a Function.backward returned a wrongly shaped gradient")
    if g.dtype != leaf.data.dtype:
        g = g.astype(leaf.data.dtype)
        owned = True
    if leaf.grad is None:
        leaf.grad = Tensor._wrap(g if owned else g.copy())
    else:
        leaf.grad.data += g
    if leaf._post_hooks:
        for hook in list(leaf._post_hooks.values()):
            hook(leaf)


@_trace.traced("backward", "backward")

def _graph_order(tensors) -> List["Function"]:
    """The nodes reachable from ``tensors``' grad_fns, in the order a backward runs them (newest first)."""
    nodes: Dict[int, Function] = {}
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if id(fn) in nodes:
            continue
        if fn._freed:
            raise RuntimeError(
                "Trying to backward through the graph a second time (saved tensors were freed); "
                "pass retain_graph=True to the first backward")
        nodes[id(fn)] = fn
        for e in fn._edges:
            if e is not None and e[1] >= 0 and id(e[0]) not in nodes:
                stack.append(e[0])
    return sorted(nodes.values(), key=lambda f: f._seq, reverse=True)


def _leaf_schedule(order, counts=None):
    """Where each leaf receives its last contribution: ``(last, finalize_at)`` with ``last[id(leaf)]``
    the position in ``order`` of its last node and ``finalize_at[pos]`` the leaves finished there.
    ``counts(fn, k)``, when given, says whether edge ``k`` of ``fn`` contributes in this pass."""
    last: Dict[int, int] = {}
    leaves: Dict[int, Tensor] = {}
    for pos, fn in enumerate(order):
        for k, e in enumerate(fn._edges):
            if e is not None and e[1] < 0 and (counts is None or counts(fn, k)):
                last[id(e[0])] = pos
                leaves[id(e[0])] = e[0]
    finalize_at: Dict[int, List[Tensor]] = {}
    for lid, pos in last.items():
        finalize_at.setdefault(pos, []).append(leaves[lid])
    return last, finalize_at


def _incoming(fn: "Function", pending: Dict[Any, list]):
    """The gradient entries ``[array, owned]`` of ``fn``'s outputs, taken from ``pending`` (zeros where
    none arrived) after ``fn``'s output hooks; ``None`` when no gradient reached ``fn`` at all."""
    fid = id(fn)
    return _out_grads(fn, [pending.pop((fid, k), None) for k in range(fn._n_out)])


def _out_grads(fn: "Function", entries: List[Any]):
    """``entries`` (one ``[array, owned]`` or None per output of ``fn``) with zeros where none arrived, after
    ``fn``'s output hooks; ``None`` when no gradient reached ``fn`` at all."""
    for e in entries:
        if e is not None:
            break
    else:
        return None
    incoming = []
    for k, entry in enumerate(entries):
        if entry is None:
            shape, dtype, xp = fn._out_meta[k]
            entry = [xp.zeros(shape, dtype), True]
        if fn._out_hooks and k in fn._out_hooks:
            for hook in list(fn._out_hooks[k].values()):
                r = hook(Tensor._wrap(entry[0]))
                if r is not None:
                    r = r.data if isinstance(r, Tensor) else r
                    if r is not entry[0]:
                        entry = [r, False]
        incoming.append(entry)
    return incoming


_ENGINE = threading.local()     # the callbacks queued by the backward passes running on this thread


def queue_callback(fn: Callable[[], None]) -> None:
    """Run ``fn()`` once the backward pass running now has finished (PyTorch's
    ``Variable._execution_engine.queue_callback``): from a gradient hook, a step that needs every gradient of
    the pass (a reducer's finalize) is queued for its end -- the end of the outermost pass, when a pass runs
    inside another (activation checkpointing's recomputation).  Callbacks run in order; one may queue more.

    Raises:
        RuntimeError: outside a backward pass.
    """
    stack = getattr(_ENGINE, "callbacks", None)
    if not stack:
        raise RuntimeError("queue_callback: no backward pass is running (call it from a gradient hook)")
    stack[0].append(fn)      # the outermost pass (a checkpoint's recomputation runs a pass inside it)


def backward_depth() -> int:
    """How many backward passes are running on this thread (0 outside backward; 2 inside the pass an activation
    checkpoint's recomputation runs within another): a gradient hook at depth > 1 may see more contributions to
    its leaf later in the outer pass."""
    return len(getattr(_ENGINE, "callbacks", None) or ())


def backward(tensors: Sequence[Tensor], grad_tensors: Sequence[Any] = None,
             retain_graph: bool = False) -> None:
    """Accumulate gradients of ``tensors`` (weighted by ``grad_tensors``) into the graph's leaves, then run the
    callbacks gradient hooks queued during the pass (:func:`queue_callback`)."""
    stack = getattr(_ENGINE, "callbacks", None)
    if stack is None:
        stack = _ENGINE.callbacks = []
    stack.append([])
    try:
        tape = _replay.active_tape()
        if tape is None:
            _backward(tensors, grad_tensors, retain_graph)
        else:                            # a recorded or replayed step: its plan ([Note: what a replay skips])
            tape.backward(_backward, tensors, grad_tensors, retain_graph)
        queued = stack[-1]
        while queued:
            queued.pop(0)()
    finally:
        stack.pop()


def _backward_roots(tensors, grad_tensors) -> List[Tuple[Tensor, Any, bool]]:
    """``(tensor, gradient array, owned)`` per root of a backward pass (ones for a one-element tensor)."""
    if isinstance(tensors, Tensor):
        tensors = [tensors]
    if grad_tensors is None or isinstance(grad_tensors, Tensor):
        grad_tensors = [grad_tensors] * len(tensors) if grad_tensors is None else [grad_tensors]
    out = []
    for t, g in zip(tensors, grad_tensors):
        if not t.requires_grad:
            raise RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn")
        xp = t.xp
        if g is None:
            if t.data.size != 1:
                raise RuntimeError(
                    f"grad can be implicitly created only for scalar outputs; got shape {tuple(t.shape)}")
            g, owned = xp.ones_like(t.data), True
        else:
            g, owned = _to_array(g, xp), False
            if tuple(g.shape) != tuple(t.data.shape):
                raise ValueError(f"grad shape {tuple(g.shape)} does not match tensor shape {tuple(t.shape)}")
        out.append((t, g, owned))
    return out


def _backward(tensors: Sequence[Tensor], grad_tensors: Sequence[Any] = None,
              retain_graph: bool = False) -> None:
    """Accumulate gradients of ``tensors`` (weighted by ``grad_tensors``) into the graph's leaves.

    Nodes run once each in decreasing creation order (a topological order), with the sum of
    their upstream gradients.  A leaf's gradient is accumulated, and its post-accumulate hooks
    fire, right after the last node that contributes to it has run.  Saved arrays are released
    unless ``retain_graph``.
    """
    pending: Dict[Any, list] = {}
    roots = []
    for t, g, owned in _backward_roots(tensors, grad_tensors):
        if t.grad_fn is None:
            roots.append((t, g, owned))
        else:
            _accumulate(pending, (id(t.grad_fn), t._out_idx), g, owned)
    if isinstance(tensors, Tensor):
        tensors = [tensors]

    order = _graph_order(tensors)
    last, finalize_at = _leaf_schedule(order)

    for t, g, owned in roots:  # a leaf passed directly to backward
        if id(t) in last:
            _accumulate(pending, id(t), g, owned)
        else:
            _finalize_leaf(t, g, owned)

    with no_grad():
        for pos, fn in enumerate(order):
            incoming = _incoming(fn, pending)
            if incoming is None:
                # no gradient reached this node (a custom backward returned None on the way):
                # like PyTorch, do not run it; the leaves below keep .grad as it was
                if not retain_graph:
                    fn._release()
                for leaf in finalize_at.get(pos, ()):
                    entry = pending.pop(id(leaf), None)
                    if entry is not None:
                        _finalize_leaf(leaf, *entry)
                continue
            results = type(fn).backward(fn, *(e[0] for e in incoming))
            if type(results) is not tuple:
                results = (results,)
            if len(results) != len(fn._edges):
                raise RuntimeError(
                    f"{type(fn).__name__}.backward returned {len(results)} gradients; "
                    f"expected {len(fn._edges)} (one per forward argument, None where not needed)")
            results = tuple(None if (r is None or e is None) else _to_array(r, None)
                            for r, e in zip(results, fn._edges))
            owned = _classify(results, incoming, type(fn)._fresh_grads)
            del incoming
            for e, g, own in zip(fn._edges, results, owned):
                if g is None:
                    continue
                target, idx = e
                _accumulate(pending, (id(target), idx) if idx >= 0 else id(target), g, own)
            del results
            if not retain_graph:
                fn._release()
            for leaf in finalize_at.get(pos, ()):
                entry = pending.pop(id(leaf), None)
                if entry is not None:  # every contribution was None: .grad stays as it was
                    _finalize_leaf(leaf, *entry)

