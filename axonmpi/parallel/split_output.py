"""Refuse a model whose output leaves the tensor-parallel region split: a Megatron ``"column"`` layer with no row layer after it.

[Note: the output keeps the serial shape]  A column-parallel layer (``gather_output=False``) gives each
tensor rank its ``1/p`` of the output features.  Inside a block that is what the next row-parallel
layer (or attention, reading its heads) wants; as the model's output it is silently wrong: ``pm(x)``
has another shape than the serial model's and a loss on it runs on a slice of the logits.  A plan maps
such a layer to ``"column_gather"`` (its output all-gathered: PyTorch's
``ColwiseParallel(output_layouts=Replicate())``).  :func:`refuse_split_outputs` checks the model's first
forward: walking the autograd graph back from the outputs it stops at every row-parallel layer's output
and every all-gather / all-reduce over the tensor group; reaching a column layer's output means that
output leaves the parallel region unpaired, and it raises naming the layer and the fix.  Without a
graph (``no_grad``) it checks that no output is (a view of) a column layer's output.  After one forward
with a graph the hooks remove themselves.
"""
from __future__ import annotations

from typing import Any, Dict, List

import numpy as np

from ..autograd.tensor import Tensor
from ..nn.module import Module

__all__ = ["refuse_split_outputs"]


def _tensors(out: Any) -> List[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    return []


def _boundary_types() -> tuple:
    """The autograd nodes whose output is whole again over the tensor group: the feature all-gather, the
    all-reduce, and the vocabulary-parallel cross-entropy (a loss over split logits)."""
    from .tensor import layers, mappings
    names = ((mappings, "_GatherFromTensorParallelRegion"), (mappings, "_ReduceFromTensorParallelRegion"),
             (layers, "_VocabParallelCrossEntropy"))
    return tuple(getattr(m, n) for m, n in names if hasattr(m, n))


def refuse_split_outputs(model: Module, columns: Dict[str, Module], rows: List[Module], group: Any) -> None:
    """Hook ``model`` so that its forward raises ``ValueError`` when the output of one of ``columns``
    (``{qualified name: column-parallel layer}``) reaches the model's output with none of ``rows`` (the
    row-parallel and vocab-parallel layers) nor a gather / all-reduce over the tensor group in between.

    Raises (at the forward):
        ValueError: naming the rank, the layer, the local and serial widths, and the fix.
    """
    if not columns or group.size == 1:
        return
    seen: Dict[int, str] = {}           # id(grad_fn or array) of a column output -> its name, one forward
    stops: Dict[int, None] = {}         # id(grad_fn) of a row output
    arrays: List[Any] = []              # (name, array) of the column outputs of this forward
    handles = []
    boundary = _boundary_types()

    def on_column(name):
        def hook(m, args, out):
            if isinstance(out, Tensor):
                arrays.append((name, out.data))
                if out.grad_fn is not None:
                    seen[id(out.grad_fn)] = name
        return hook

    def on_row(m, args, out):
        if isinstance(out, Tensor) and out.grad_fn is not None:
            stops[id(out.grad_fn)] = None

    def fail(name, out):
        layer = columns[name]
        raise ValueError(
            f"rank {group.world.rank}: the tensor-parallel plan makes {name!r} a 'column' layer and its output "
            f"leaves the model split over the tensor group ({layer.out_features // group.size} of its "
            f"{layer.out_features} output features on this rank; the serial model gives {layer.out_features}) "
            f"with no 'row' layer after it: map {name!r} to 'column_gather' (its output all-gathered, as "
            f"PyTorch's ColwiseParallel(output_layouts=Replicate())), or pair it with a 'row' layer")

    def on_model(m, args, out):
        try:
            outs = _tensors(out)
            graph = [t.grad_fn for t in outs if t.grad_fn is not None]
            for t in outs:                     # no graph needed: an output that is a column output's array
                for name, a in arrays:
                    if t.data is a or (isinstance(a, np.ndarray) and isinstance(t.data, np.ndarray)
                                       and np.shares_memory(t.data, a)):
                        fail(name, t)
            if not graph:
                return
            done, stack = set(), list(graph)
            while stack:
                fn = stack.pop()
                if id(fn) in done:
                    continue
                done.add(id(fn))
                if id(fn) in stops or isinstance(fn, boundary):
                    continue
                if id(fn) in seen:
                    fail(seen[id(fn)], None)
                for e in getattr(fn, "_edges", ()) or ():
                    if e is not None and e[1] >= 0:
                        stack.append(e[0])
            for h in handles:                  # checked once with a graph: the plan holds
                h.remove()
        finally:
            seen.clear()
            stops.clear()
            arrays.clear()

    for name, layer in columns.items():
        handles.append(layer.register_forward_hook(on_column(name)))
    for layer in rows:
        handles.append(layer.register_forward_hook(on_row))
    handles.append(model.register_forward_hook(on_model))
