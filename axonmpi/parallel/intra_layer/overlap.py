"""``optimize_communication``: overlap the 3-D Linear's backward collectives with its compute and
prefetch the next layer's weight (AxoNN's context of the same name).

Inside the context each ``intra_layer.Linear`` runs as one fused op (:class:`_OverlappedLinear`):

* ``overlap_all_reduce``: the dX all-reduce over the row group is started non-blocking before
  dW is computed and completed just before dX is returned (the latest point the engine allows).
* ``overlap_reduce_scatter``: the dW reduce-scatter over depth is started non-blocking and
  completed when the context exits, which adds the results to ``weight.grad``; call
  ``backward`` inside the context and read gradients after it.
* ``overlap_all_gather``: while a layer runs forward, the depth all-gather of the next layer's
  weight (``model``'s module order) is already in flight.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Dict, List, Optional, Tuple

import numpy as np

from ...autograd.function import Function
from ...autograd.tensor import Tensor
from ...backend import get_array_module
from ...distributed import Work, all_gather, all_reduce, reduce_scatter

__all__ = ["optimize_communication"]

_STATE: contextvars.ContextVar = contextvars.ContextVar("axonmpi_intra_layer_overlap", default=None)


class _OverlapState:
    """What one ``optimize_communication`` block has in flight."""

    def __init__(self, overlap_all_reduce: bool, overlap_reduce_scatter: bool, overlap_all_gather: bool, layers):
        self.all_reduce, self.reduce_scatter, self.all_gather = overlap_all_reduce, overlap_reduce_scatter, overlap_all_gather
        self.pending: List[Tuple[Tensor, Work]] = []          # (weight, reduce-scatter of its dW)
        self.prefetch: Dict[int, Work] = {}                    # id(layer) -> all-gather of its weight
        self.next_layer = {id(a): b for a, b in zip(layers, layers[1:])}

    def gathered_weight(self, layer):
        work = self.prefetch.pop(id(layer), None)
        if work is not None:
            return work.wait()
        w = layer.weight.data
        return w if layer.depth.size == 1 else all_gather(w, axis=0, group=layer.depth)

    def start_prefetch(self, layer) -> None:
        nxt = self.next_layer.get(id(layer))
        if self.all_gather and nxt is not None and nxt.depth.size > 1 and id(nxt) not in self.prefetch:
            self.prefetch[id(nxt)] = all_gather(nxt.weight.data, axis=0, group=nxt.depth, async_op=True)

    def finish(self) -> None:
        for w, work in self.pending:
            g = work.wait()
            if w.grad is None:
                w.grad = Tensor(g)
            else:
                w.grad.data += g
        self.pending.clear()
        for work in self.prefetch.values():
            work.wait()
        self.prefetch.clear()


class _OverlappedLinear(Function):
    """``y = allreduce_inner(x @ gather_depth(w).T)`` with the backward collectives overlapped."""

    @staticmethod
    def forward(ctx, x, anchor, layer, state):
        W = state.gathered_weight(layer).reshape(layer.local_out_features, layer.local_in_features)
        state.start_prefetch(layer)
        y = x @ W.T
        if layer.inner.size > 1:
            y = all_reduce(y, group=layer.inner, out=y)
        ctx.save_for_backward(x, W)
        ctx.layer, ctx.state, ctx.weight = layer, state, layer.weight
        ctx.deferred = anchor.ndim == 0
        return y

    @staticmethod
    def backward(ctx, g):
        x, W = ctx.saved_tensors
        layer, state = ctx.layer, ctx.state
        n = ctx.needs_input_grad
        gx = work = None
        if n[0]:
            gx = g @ W
            if layer.outer.size > 1:
                work = all_reduce(gx, group=layer.outer, out=gx, async_op=state.all_reduce)
        gw = None
        if ctx.deferred:      # the weight is not an input of this node: its gradient lands at the block's end
            full = (g.T @ x).reshape(-1)
            state.pending.append((ctx.weight, reduce_scatter(full, group=layer.depth, async_op=True)))
            gw = get_array_module(g).zeros(())          # for the scalar anchor that keeps the node recorded
        elif n[1]:
            gw = (g.T @ x).reshape(-1)
            if layer.depth.size > 1:
                gw = reduce_scatter(gw, group=layer.depth)
        if work is not None and state.all_reduce:
            gx = work.wait()
        return gx, gw, None, None


def overlapped_matmul(x: Tensor, layer) -> Optional[Tensor]:
    """The fused op for ``layer`` when an ``optimize_communication`` block is active, else ``None``."""
    state = _STATE.get()
    if state is None:
        return None
    deferred = state.reduce_scatter and layer.depth.size > 1 and layer.weight.requires_grad
    # a deferred weight is not an input (its gradient arrives later); a scalar anchor keeps the node
    # recorded even when ``x`` needs no gradient (the first layer)
    anchor = Tensor(np.zeros((), layer.weight.data.dtype), requires_grad=True) if deferred else layer.weight
    return _OverlappedLinear.apply(x, anchor, layer, state)


@contextlib.contextmanager
def optimize_communication(overlap_all_reduce: bool = True, overlap_reduce_scatter: bool = False,
                           overlap_all_gather: bool = False, *, model=None):
    """Overlap the 3-D layers' collectives with compute inside the block (see the module notes).

    Args:
        overlap_all_reduce: start the backward dX all-reduce before computing dW.
        overlap_reduce_scatter: defer the dW reduce-scatters to the end of the block.
        overlap_all_gather: prefetch the next layer's weight during the current forward; needs
            ``model`` (its ``intra_layer.Linear`` modules, in module order, are the sequence).
        model: the model whose layers are prefetched.

    Example:
        >>> with optimize_communication(overlap_reduce_scatter=True, overlap_all_gather=True, model=model):
        ...     loss = loss_fn(model(x)); loss.backward()
        >>> sync_gradients(model); opt.step()
    """
    if overlap_all_gather and model is None:
        raise ValueError("optimize_communication(overlap_all_gather=True) needs model= to know the layer order")
    # the layers that call overlapped_matmul mark themselves (no import of linear.py: no cycle)
    layers = [m for m in model.modules() if getattr(m, "overlaps_communication", False)] if model is not None else []
    state = _OverlapState(bool(overlap_all_reduce), bool(overlap_reduce_scatter), bool(overlap_all_gather), layers)
    token = _STATE.set(state)
    try:
        yield
    finally:
        _STATE.reset(token)
        state.finish()
