"""``auto_parallelize()``: inside the block, ``axonmpi.nn.Linear(...)`` builds AxoNN's 3-D ``intra_layer.Linear``
where the grid divides its sizes, so an unchanged model becomes tensor parallel."""
from __future__ import annotations

import contextlib
import math
from typing import Optional

from ..backend import as_device
from ..nn import init
from ..nn import layers as _layers
from .intra_layer.linear import Linear as _IntraLinear
from .tensor.groups import TensorParallelGroups, default_groups

__all__ = ["auto_parallelize", "is_parallelizable_linear"]


def is_parallelizable_linear(in_features: int, out_features: int, sizes) -> bool:
    """AxoNN's rule: ``out % G_r == 0``, ``in % G_c == 0`` and ``(in*out/(G_r*G_c)) % G_d == 0``.

    Args:
        in_features, out_features: the Linear's full sizes.
        sizes: ``(G_intra_r, G_intra_c, G_intra_d)``, e.g. ``TensorParallelGroups.sizes``.

    Returns:
        True when the layer can be split over the grid.

    Example:
        >>> is_parallelizable_linear(6, 12, (2, 1, 2))
        True
    """
    G_r, G_c, G_d = sizes
    if out_features % G_r or in_features % G_c:
        return False
    return (in_features * out_features // (G_r * G_c)) % G_d == 0


@contextlib.contextmanager
def auto_parallelize(*, groups: Optional[TensorParallelGroups] = None):
    """Build every ``axonmpi.nn.Linear`` made inside the block as an easy-mode ``intra_layer.Linear``.

    Layers whose sizes the grid does not divide stay plain (data parallel) ``nn.Linear``.  A
    swapped layer is initialised exactly as the ``nn.Linear`` it replaces (PyTorch's kaiming
    weight and uniform bias, drawn on the full arrays), so with the same seed the model starts
    from the serial model's values.  The hook is scoped: it is removed on exit, also when the
    block raises, and nested blocks restore the outer one.  Train the model as usual and call
    ``intra_layer.sync_gradients(model, groups=...)`` after ``backward``.

    Args:
        groups: the :class:`TensorParallelGroups` to split over (default: ``default_groups()``,
            the grid of ``axonmpi.init(G_intra_r=..., G_intra_c=..., G_intra_d=...)``).

    Example:
        >>> with auto_parallelize():
        ...     model = GPT(config)                  # its Linear layers are 3-D parallel
    """
    g = default_groups() if groups is None else groups

    def factory(in_features, out_features, bias=True, dtype=None, device=None):
        if not is_parallelizable_linear(int(in_features), int(out_features), g.sizes):
            return None
        layer = _IntraLinear(in_features, out_features, bias=bias, dtype=dtype, groups=g)
        if bias:             # nn.Linear's bias init, so the random stream and values match the serial model
            bound = 1.0 / math.sqrt(layer.in_features) if layer.in_features > 0 else 0.0
            layer.init_full_("bias", lambda b: init.uniform_(b, -bound, bound))
        if device is not None and as_device(device).type != "cpu":
            layer.to(device)
        return layer

    with _layers.linear_factory(factory):
        yield
