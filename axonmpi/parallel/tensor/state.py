"""Unsharded (serial, PyTorch-named) state dicts for models holding tensor-parallel layers.

A tensor-parallel module keeps only its shard of some parameters; each parameter's placement (its
cuts and full shape, :mod:`axonmpi.parallel.placed`) says how to go between the full array and the
shard, so the functions here walk any model: a model built from TP layers loads a serial checkpoint
and saves one, and gives ``ShardedArray`` blocks for sharded checkpoints (through
:class:`~axonmpi.parallel.state.ShardedState`).

A TP module (``_TensorParallelModule``) only records placements; every conversion between a full array, a
shard and a checkpoint block is :mod:`axonmpi.parallel.placed`'s (the same one ``ShardedState`` uses).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Dict, Mapping, Optional

import numpy as np

from ...backend import get_array_module, to_host
from ...distributed import broadcast, get_world
from ...distributed.placement import placement_of
from ...nn import Module
from .. import placed
from ..state import ShardedState

__all__ = ["full_state_dict", "load_full_state_dict", "load_sharded_state_dict", "sharded_state_dict", "tp_entries"]


def tp_entries(model: Module):
    """(key, module, local name, parameter) for every parameter of a TP module inside ``model``.

    Example:
        >>> {key: placement_of(p).full_shape for key, m, name, p in tp_entries(model)}
    """
    for prefix, m in model.named_modules():
        if isinstance(m, _TensorParallelModule):
            for name, p in m.named_parameters(recurse=False):
                if p is not None and m._tp_full_shape(name) is not None:
                    yield (f"{prefix}.{name}" if prefix else name), m, name, p


def full_state_dict(model: Module, *, grads: bool = False) -> "OrderedDict[str, np.ndarray]":
    """The model's state dict with every sharded parameter gathered to its full serial shape (by placement).

    Collective over the tensor-parallel groups of the model's layers: call it on every rank.

    Args:
        model: any module holding tensor-parallel layers.
        grads: gather the parameters' gradients instead (keys of the parameters that have one).

    Example:
        >>> sd = full_state_dict(model)       # same keys and shapes as the serial model
        >>> g = full_state_dict(model, grads=True)["blocks.0.mlp.fc.weight"]
    """
    if not grads:
        return ShardedState(model, rank=_world_rank()).full_state_dict()
    return OrderedDict((k, np.array(placed.gather(p.grad.data, placement_of(p)) if placement_of(p).layout
                                    else to_host(p.grad.data), copy=True))
                       for k, p in model.named_parameters() if p.grad is not None)


def load_full_state_dict(model: Module, state_dict: Mapping[str, Any], strict: bool = True):
    """Load a full (serial) state dict, or a :func:`sharded_state_dict` filled by ``checkpoint.load``; each
    TP layer keeps its shard.  Entries already in the shard's shape are taken as shards.  Returns
    ``IncompatibleKeys`` like ``Module.load_state_dict``.

    Example:
        >>> load_full_state_dict(tp_model, serial_model.state_dict())
    """
    sd: Dict[str, Any] = {k: (v.local if hasattr(v, "global_shape") and tuple(v.local_shape) == tuple(v.global_shape)
                              else v) for k, v in state_dict.items()}      # a whole array's block: the array
    for key, m, name, p in tp_entries(model):
        if key not in sd:
            continue
        v, pl = sd[key], placement_of(p)
        if hasattr(v, "global_shape"):
            sd[key] = placed.unblock(v.local, pl)          # this layout's block, read by checkpoint.load
            continue
        v = to_host(getattr(v, "data", v))
        if tuple(np.shape(v)) == tuple(pl.full_shape):
            sd[key] = placed.cut(v, pl)
        elif tuple(np.shape(v)) != tuple(p.data.shape):
            raise RuntimeError(
                f"rank {_world_rank()}: {key!r} has shape {tuple(np.shape(v))}; expected the full shape "
                f"{tuple(pl.full_shape)} or this rank's shard shape {tuple(p.data.shape)}")
    return Module.load_state_dict(model, sd, strict=strict)


def sharded_state_dict(model: Module) -> "OrderedDict[str, Any]":
    """State dict whose parameters are ``ShardedArray`` blocks of the full arrays (by placement; no gather
    where a piece is a rectangle); buffers are host arrays (replicated).  ``ShardedArray`` comes from
    ``axonmpi.distributed.sharding`` (also ``axonmpi.checkpoint.ShardedArray``).

    Example:
        >>> axonmpi.checkpoint.save("ckpt.h5", sharded_state_dict(model))
    """
    return ShardedState(model, rank=_world_rank()).sharded_state_dict()


def load_sharded_state_dict(model: Module, state_dict: Mapping[str, Any], strict: bool = True):
    """Load a state dict made by :func:`sharded_state_dict` and filled by ``checkpoint.load`` (the blocks
    cut back to this rank's shard; :func:`load_full_state_dict` takes both forms).  Returns ``IncompatibleKeys``.

    Example:
        >>> template = sharded_state_dict(model)
        >>> axonmpi.checkpoint.load("ckpt", {"model": template})
        >>> load_sharded_state_dict(model, template)
    """
    return load_full_state_dict(model, state_dict, strict)


def _world_rank() -> int:
    return get_world().rank


def init_full(shape, dtype, init_fn, groups) -> np.ndarray:
    """A full host array filled by ``init_fn`` and made identical over ``groups`` (rank 0 of each wins)."""
    from ...nn.parameter import Parameter
    p = Parameter(np.empty(shape, np.float32 if dtype is None else np.dtype(dtype)))
    init_fn(p)
    full = np.ascontiguousarray(p.data)
    for g in groups:
        if g.size > 1:
            broadcast(full, src=0, group=g)
    return full


class _TensorParallelModule(Module):
    """Base of TP layers: ``state_dict(full=...)``, ``load_state_dict`` of full or sharded entries,
    ``sharded_state_dict()``, read from each parameter's placement (its cuts and full shape,
    :mod:`axonmpi.parallel.placed`): a layer only records placements."""

    def _tp_placement(self, name: str):
        """The placement of parameter ``name`` when it is cut (has cuts and a full shape), else ``None``."""
        p = self._parameters.get(name)
        pl = None if p is None else placement_of(p)
        return pl if pl is not None and pl.full_shape is not None and pl.layout else None

    def _tp_full_shape(self, name: str) -> Optional[tuple]:
        pl = self._tp_placement(name)
        return None if pl is None else tuple(pl.full_shape)

    def state_dict(self, full: bool = False) -> "OrderedDict[str, np.ndarray]":
        """This layer's state: shards (default) or, with ``full=True``, full serial arrays (collective)."""
        return full_state_dict(self) if full else Module.state_dict(self)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True):
        """Load full (serial) or sharded entries; full ones are cut to this rank's shard."""
        return load_full_state_dict(self, state_dict, strict=strict)

    def sharded_state_dict(self) -> "OrderedDict[str, Any]":
        """``ShardedArray`` blocks of the full arrays for the sharded parameters."""
        return sharded_state_dict(self)

    def _tp_init_groups(self) -> list:
        """The groups over which a full array drawn at init is made identical (rank 0 of each wins)."""
        return []

    def init_full_(self, name: str, init_fn: Callable) -> None:
        """Re-initialise parameter ``name`` as the serial layer would: ``init_fn`` fills the full array
        (the same random draws as on the serial parameter), and this rank keeps its shard.

        Collective over the layer's groups.  With the same seed on every rank the values equal the
        serial model's; replicated parameters are filled by ``init_fn`` directly.

        Args:
            name: a parameter of this module (e.g. ``"weight"``).
            init_fn: an in-place initializer of a full parameter, e.g. ``lambda w: init.normal_(w, 0, 0.02)``.

        Example:
            >>> layer.init_full_("weight", lambda w: init.normal_(w, 0.0, 0.02))
        """
        p = self._parameters.get(name)
        if p is None:
            have = [k for k, v in self._parameters.items() if v is not None]
            raise ValueError(f"rank {_world_rank()}: {type(self).__name__} has no parameter {name!r} to "
                             f"initialise; it has {have}")
        shape = self._tp_full_shape(name)
        if shape is None:
            init_fn(p)
            return
        full = init_full(shape, np.dtype(p.dtype), init_fn, self._tp_init_groups())
        xp = get_array_module(p.data)
        p.data[...] = xp.asarray(placed.cut(full, self._tp_placement(name))).reshape(p.data.shape)
