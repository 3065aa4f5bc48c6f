"""``torch.nn.utils`` names: gradient clipping and parameters <-> one flat vector."""
from __future__ import annotations

from typing import Iterable

from ..autograd.tensor import Tensor
from ..backend import get_array_module
from ..optim.clip import clip_grad_norm_, clip_grad_value_

__all__ = ["clip_grad_norm_", "clip_grad_value_", "parameters_to_vector", "vector_to_parameters"]


def parameters_to_vector(parameters: Iterable[Tensor]) -> Tensor:
    """The parameters' values flattened and concatenated into one 1-D Tensor (a copy, no graph).

    Example:
        >>> vec = parameters_to_vector(model.parameters())
    """
    arrays = [p.data.reshape(-1) for p in _as_list(parameters, "parameters_to_vector")]
    if not arrays:
        raise ValueError("parameters_to_vector: no parameters given")
    xp = get_array_module(arrays[0])
    return Tensor(xp.concatenate(arrays))


def vector_to_parameters(vec, parameters: Iterable[Tensor]) -> None:
    """Copy consecutive slices of the 1-D ``vec`` into the parameters, in place.

    Raises ValueError naming both lengths when ``vec`` does not have exactly as many elements.
    """
    params = _as_list(parameters, "vector_to_parameters")
    v = vec.data if isinstance(vec, Tensor) else vec
    if getattr(v, "ndim", None) != 1:
        raise TypeError(f"vector_to_parameters: expected a 1-D vector, got {type(vec).__name__} of shape "
                        f"{getattr(v, 'shape', None)}")
    need = sum(int(p.data.size) for p in params)
    if v.shape[0] != need:
        raise ValueError(f"vector_to_parameters: vector has {v.shape[0]} elements, the parameters {need}")
    at = 0
    for p in params:
        n = int(p.data.size)
        xp = get_array_module(p.data)
        p.data[...] = xp.asarray(v[at:at + n]).reshape(p.data.shape).astype(p.data.dtype, copy=False)
        at += n


def _as_list(parameters, who: str):
    if isinstance(parameters, Tensor):
        return [parameters]
    params = list(parameters)
    bad = [type(p).__name__ for p in params if not isinstance(p, Tensor)]
    if bad:
        raise TypeError(f"{who}: expected Tensors/Parameters, got {bad[0]}")
    return params
