"""Capture and replay of a step's autograd bookkeeping: the graph recorded once, later backwards from static plans.

[Note: what a replay skips, and why it stays exact]
A recorded step (:meth:`Tape.begin` with ``RECORD``) runs eagerly; every op ``Function.apply`` records is noted
in creation order with its structure (its class, its outputs' shapes, where each input comes from: the output
``k`` of op ``j`` of this step, or a leaf), and every backward pass of the step is turned into a plan: the
nodes in the order the eager engine runs them, the integer slot each output gradient and each leaf's gradient
sits in, which results the engine may keep and write into (the eager engine's ``_classify``, decided once),
and after which node each leaf is finished.  A replayed step (``REPLAY``) runs the user's Python again (its
modules, hooks and collectives are the step's own), but each op is checked against the record as it is
made (one tuple compared), and its backward passes run their plans: no graph walk, no topological sort, no
leaf schedule, no dictionaries keyed by node, no ownership test.  The backward functions run in the same
order on the same arrays, gradients are summed in the same order, in place exactly where the eager engine
sums in place: the result is bitwise the eager one.

Where the step made differs from the record (another op, another shape: data-dependent shapes or control
flow; a backward that was not recorded), the tape *diverges*: the rest of the step runs on the eager engine
(the graph is built as always, so nothing is lost) and the tape says why (:attr:`Tape.reason`).  A graph
that reaches ops made before the step (a tensor carried over from the last step) cannot be recorded.
Nested passes (activation checkpointing's recomputation inside the backward) run eagerly inside the plan.
"""
from __future__ import annotations

import threading
from typing import Any, List, Optional

__all__ = ["Tape", "RECORD", "REPLAY", "active_tape", "use_tape"]

RECORD = "record"
REPLAY = "replay"

_STATE = threading.local()          # .tape: the Tape recording or replaying on this thread, or None


def active_tape() -> Optional["Tape"]:
    """The :class:`Tape` recording or replaying on this thread, or None."""
    return getattr(_STATE, "tape", None)


class use_tape:
    """``with use_tape(tape, mode):`` the ops and backward passes of this thread go through ``tape``."""

    def __init__(self, tape: "Tape", mode: str):
        self.tape, self.mode = tape, mode

    def __enter__(self):
        self.prev = active_tape()
        self.tape.begin(self.mode)
        _STATE.tape = self.tape
        return self.tape

    def __exit__(self, *exc):
        _STATE.tape = self.prev
        self.tape.end(failed=exc[0] is not None)
        return False


def _out_shapes(ctx, out) -> Any:
    return out.shape if ctx._n_out == 1 else tuple(m[0] for m in ctx._out_meta)


class _Plan:
    """One backward pass as data: roots, the node steps in order, the slot count, the leaves."""

    __slots__ = ("roots", "steps", "nslots")

    def __init__(self, roots, steps, nslots):
        self.roots, self.steps, self.nslots = roots, steps, nslots


class Tape:
    """One training step's ops and backward plans, recorded once and checked against every replayed step.

    ``reason`` is None while the record holds; else the sentence that says why the step ran (or must run)
    eagerly.  ``replayed_passes`` counts the backward passes that ran from a plan.

    Example:
        >>> tape = Tape()
        >>> with use_tape(tape, RECORD):
        ...     step()
        >>> with use_tape(tape, REPLAY):
        ...     step()                    # bitwise the eager step, without the engine's bookkeeping
    """

    def __init__(self):
        self.sig: List[Any] = []          # per recorded op: (class, output shapes, input sources)
        self.plans: List[_Plan] = []
        self.nodes: List[Any] = []        # this step's ops
        self.mode: Optional[str] = None
        self.nplan = 0
        self.busy = 0                     # > 0 while a backward pass runs: ops made then are not recorded
        self.reason: Optional[str] = None
        self.diverged = False             # this step left the record (it finished eagerly)
        self.replayed_passes = 0
        self.leaves: List[Any] = []       # this step's leaves in the order its ops first use them
        self._leaf_ord = {}               # id(leaf) -> its place in ``leaves``

    # -- per step ------------------------------------------------------------------------------
    def begin(self, mode: str) -> None:
        """Start a step: ``RECORD`` (a new record) or ``REPLAY`` (checked against the record)."""
        if mode not in (RECORD, REPLAY):
            raise ValueError(f"Tape mode must be {RECORD!r} or {REPLAY!r}, got {mode!r}")
        if mode == REPLAY and (self.reason is not None or not self.sig):
            raise RuntimeError(f"Tape: nothing to replay ({self.reason or 'no step was recorded'})")
        if mode == RECORD:
            self.sig, self.plans, self.reason = [], [], None
        self.mode, self.nodes, self.nplan, self.busy, self.diverged = mode, [], 0, 0, False
        self.leaves, self._leaf_ord = [], {}

    def end(self, failed: bool = False) -> None:
        """Close the step: a replay that made fewer ops or passes than the record diverged."""
        if failed and self.mode == RECORD and self.reason is None:
            self.reason = "the recorded step raised an exception"
        elif self.mode == REPLAY and not self.diverged and not failed:
            if len(self.nodes) != len(self.sig) or self.nplan != len(self.plans):
                self._diverge(f"the step made {len(self.nodes)} ops and {self.nplan} backward passes; the record "
                              f"has {len(self.sig)} and {len(self.plans)}")
        self.nodes, self.mode, self.leaves, self._leaf_ord = [], None, [], {}

    def _leaf(self, leaf) -> int:
        """The place of ``leaf`` among this step's leaves (a parameter, or a leaf the step made: the same each step)."""
        o = self._leaf_ord.get(id(leaf))
        if o is None:
            o = self._leaf_ord[id(leaf)] = len(self.leaves)
            self.leaves.append(leaf)
        return o

    def _diverge(self, why: str) -> None:
        self.diverged = True
        if self.reason is None:
            self.reason = why

    def _refuse(self, why: str) -> None:
        """Recording: the step cannot be replayed (it still runs eagerly, correct)."""
        if self.reason is None:
            self.reason = why

    # -- ops -----------------------------------------------------------------------------------
    def add(self, ctx, out) -> None:
        """Note op ``ctx`` (called by ``Function.apply`` for every recorded op)."""
        if self.busy or self.diverged:
            return
        i = len(self.nodes)
        ctx._tix = i
        self.nodes.append(ctx)
        src = []
        nodes = self.nodes
        for e in ctx._edges:
            if e is None:
                src.append(None)
            elif e[1] < 0:
                src.append((self._leaf(e[0]), -1))
            else:
                j = getattr(e[0], "_tix", -1)
                if not (0 <= j < i and nodes[j] is e[0]):
                    j = -2                # an op made outside this step
                src.append((j, e[1]))
        sig = (type(ctx), _out_shapes(ctx, out), tuple(src))
        if self.mode == RECORD:
            self.sig.append(sig)
        elif i >= len(self.sig) or self.sig[i] != sig:
            was = self.sig[i] if i < len(self.sig) else None
            what = "no op" if was is None else f"{was[0].__name__} with outputs {was[1]}"
            self._diverge(f"op {i} of the step is {type(ctx).__name__} with outputs {sig[1]}; the record has "
                          f"{what} (or its inputs came from elsewhere): data-dependent shapes or control flow")

    # -- backward ------------------------------------------------------------------------------
    def backward(self, run_eager, tensors, grad_tensors, retain_graph: bool) -> None:
        """One backward pass of the step: recorded (then run from its new plan), replayed, or eager."""
        from .function import _backward_roots
        self.busy += 1
        try:
            if self.busy > 1 or self.diverged or (self.mode == RECORD and self.reason is not None):
                return run_eager(tensors, grad_tensors, retain_graph)
            roots = _backward_roots(tensors, grad_tensors)
            if self.mode == RECORD:
                plan = self._make_plan(tensors, roots)
                if plan is None:
                    return run_eager(tensors, grad_tensors, retain_graph)
                _run_plan(plan, self.nodes, self.leaves, roots, retain_graph, record=True)
                self.plans.append(plan)
            else:
                plan = self.plans[self.nplan] if self.nplan < len(self.plans) else None
                if plan is None or not self._roots_match(plan, roots):
                    self._diverge(f"backward pass {self.nplan} of the step starts from other tensors than the "
                                  "recorded one")
                    return run_eager(tensors, grad_tensors, retain_graph)
                _run_plan(plan, self.nodes, self.leaves, roots, retain_graph, record=False)
                self.replayed_passes += 1
            self.nplan += 1
        finally:
            self.busy -= 1

    def _root_key(self, t):
        fn = t.grad_fn
        if fn is None:
            return (self._leaf(t), -1)
        j = getattr(fn, "_tix", -1)
        return (j, t._out_idx) if 0 <= j < len(self.nodes) and self.nodes[j] is fn else None

    def _roots_match(self, plan: _Plan, roots) -> bool:
        return len(roots) == len(plan.roots) and all(
            self._root_key(t) == r[0] for (t, _g, _o), r in zip(roots, plan.roots))

    def _make_plan(self, tensors, roots) -> Optional[_Plan]:
        from .function import _graph_order, _leaf_schedule
        order = _graph_order(tensors)
        n = len(self.nodes)
        for fn in order:
            j = getattr(fn, "_tix", -1)
            if not (0 <= j < n and self.nodes[j] is fn):
                self._refuse(f"the backward reaches a {type(fn).__name__} op made before the step (or while "
                             "another backward ran): a tensor carried over from an earlier step; detach it")
                return None
        last, finalize_at = _leaf_schedule(order)
        slots = {}

        def slot(key):
            s = slots.get(key)
            if s is None:
                s = slots[key] = len(slots)
            return s
        plan_roots = []
        for t, _g, _owned in roots:
            key = self._root_key(t)
            if key is None:
                self._refuse("backward starts from a tensor made before the step")
                return None
            if key[1] < 0:
                plan_roots.append((key, slot(key) if id(t) in last else -1))
            else:
                plan_roots.append((key, slot(key)))
        steps = []
        for pos, fn in enumerate(order):
            j = fn._tix
            outs = tuple(slot((j, k)) for k in range(fn._n_out))
            targets = []
            for e in fn._edges:
                if e is None:
                    targets.append(-1)
                elif e[1] < 0:
                    targets.append(slot((self._leaf(e[0]), -1)))
                else:
                    targets.append(slot((e[0]._tix, e[1])))
            fin = tuple((slots[(self._leaf(leaf), -1)], self._leaf(leaf)) for leaf in finalize_at.get(pos, ()))
            steps.append([j, outs, tuple(targets), None, fin])     # [3]: owned flags, filled by the record run
        return _Plan(tuple(plan_roots), steps, len(slots))


def _run_plan(plan: _Plan, nodes, leaves, roots, retain_graph: bool, record: bool) -> None:
    """Run one backward pass from ``plan`` over this step's ``nodes`` and ``leaves`` (the eager engine's rules, in
    its order)."""
    from .function import _classify, _finalize_leaf, _out_grads, _to_array
    from .grad_mode import no_grad
    pending: List[Any] = [None] * plan.nslots
    for (t, g, owned), (key, s) in zip(roots, plan.roots):
        if s < 0:
            _finalize_leaf(t, g, owned)
        else:
            _add(pending, s, g, owned)
    with no_grad():
        for step in plan.steps:
            j, outs, targets, flags, fin = step
            fn = nodes[j]
            incoming = _out_grads(fn, [pending[s] for s in outs])
            for s in outs:
                pending[s] = None
            if incoming is not None:
                results = type(fn).backward(fn, *(e[0] for e in incoming))
                if type(results) is not tuple:
                    results = (results,)
                if len(results) != len(targets):
                    raise RuntimeError(
                        f"{type(fn).__name__}.backward returned {len(results)} gradients; "
                        f"expected {len(targets)} (one per forward argument, None where not needed)")
                results = tuple(None if (r is None or s < 0) else _to_array(r, None)
                                for r, s in zip(results, targets))
                if record or flags is None:
                    flags = step[3] = _classify(results, incoming, type(fn)._fresh_grads)
                elif any(g is not None and g.base is not None for g, f in zip(results, flags) if f):
                    flags = _classify(results, incoming, True)   # a view kept as owned: decide again, as eager
                del incoming
                for s, g, own in zip(targets, results, flags):
                    if g is not None:
                        _add(pending, s, g, own)
                del results
            if not retain_graph:
                fn._release()
            for s, o in fin:
                entry = pending[s]
                if entry is not None:
                    pending[s] = None
                    _finalize_leaf(leaves[o], *entry)


def _add(pending: List[Any], s: int, g, owned: bool) -> None:
    """The eager engine's ``_accumulate`` over a slot."""
    from .function import _merged      # function imports this module
    pending[s] = _merged(pending[s], g, owned)
