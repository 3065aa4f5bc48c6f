"""Serial-named, sharded model and optimizer state of a model laid out over a grid (any placed model).

A :class:`LayoutState` describes one rank's model: its (tensor-parallel) layers, the parameters
this rank owns (its pipeline stage's; the rest are shape-only stand-ins), and an FSDP wrapper
over data when there is one.  From that it gives serial-named state dicts and ``checkpoint.load``
templates, so a checkpoint saved under one layout loads under any other and into the plain model:

* TP shards are ``ShardedArray`` blocks of the full arrays (the layers' ``_tp_*`` protocol);
* each pipeline stage contributes only its own parameters (an empty block for the others');
* FSDP alone: each parameter flattened under its serial name (1-D blocks); templates reshape
  between the two forms (the other layouts read a flattened entry whole, FSDP reads the whole
  rows of a full-shape entry covering its elements);
* FSDP x TP: the TP form (each TP-local array gathered over data, written as its TP block), and
  loading keeps the elements of this rank's FSDP chunk of its TP shard.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Optional

import numpy as np

from ..distributed import all_gather_object

__all__ = ["LayoutState", "ModelState", "OptimizerState"]


def _with_aliases(model, entries: "OrderedDict[str, Any]") -> "OrderedDict[str, Any]":
    """``entries`` (by ``named_parameters``, a shared Parameter once) with every other name of a shared one (a
    tied head's ``lm_head.weight`` beside ``wte.weight``) holding the same value, as ``state_dict`` has them."""
    first: Dict[int, str] = {}
    for prefix, m in model.named_modules():
        for name, p in m._parameters.items():
            if p is None:
                continue
            key = f"{prefix}.{name}" if prefix else name
            if id(p) not in first:
                first[id(p)] = key
            elif first[id(p)] in entries and key not in entries:
                entries[key] = entries[first[id(p)]]
    return entries


class LayoutState:
    """The state of one rank's part of a model laid out over ``grid``.

    Args:
        model: the rank's model (tensor-parallel layers in place; other stages' parameters may be
            zero-stride stand-ins with the serial names and local shapes).
        param_names: the parameters this rank owns (its stage's; every one under FSDP).
        shapes: every parameter's TP-local shape (taken before FSDP flattened them).
        fsdp: the :class:`~axonmpi.parallel.FSDP` wrapping ``model`` over data, or ``None``.
        tensor_parallel: whether ``model`` holds tensor-parallel layers.
        grid: the process grid (its ``inter_group`` joins the pipeline stages' parts).
        dtype: the parameter dtype (of load templates).

    Example:
        >>> state = LayoutState(model, param_names=names, shapes=shapes, fsdp=None, tensor_parallel=True,
        ...                     grid=grid, dtype=np.float64)
        >>> mgr.save(step, training_state(*state.checkpoint_state(opt)))
    """

    def __init__(self, model, *, param_names: List[str], shapes: Dict[str, tuple], fsdp=None,
                 tensor_parallel: bool = False, grid, dtype):
        self.model, self.fsdp, self.grid, self.dtype = model, fsdp, grid, np.dtype(dtype)
        self.param_names = list(param_names)
        self._owned = set(self.param_names)
        self._shapes = dict(shapes)
        self.tensor_parallel = bool(tensor_parallel)
        self._fsdp_tp = fsdp is not None and self.tensor_parallel

    def _tp_map(self) -> Dict[str, Any]:
        if not self.tensor_parallel:
            return {}
        from .tensor.state import tp_entries
        return {key: (m, name) for key, m, name, _ in tp_entries(self.model)}

    def _gather(self, local: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
        """``{name: {key: local shard}}`` of this rank's parameters -> full arrays of every stage's
        (collective: TP gathers in ``param_names`` order, then one all-gather over ``inter_group``)."""
        from ..backend import to_host
        tp = self._tp_map()
        own: Dict[str, Dict[str, Any]] = {}
        for n in self.param_names:
            ent = {}
            for k, v in local.get(n, {}).items():
                if hasattr(v, "shape") and getattr(v, "ndim", 0) > 0:
                    if n in tp:
                        m, name = tp[n]
                        v = m.tp_gather(name, v)
                    v = np.array(to_host(v), copy=True)
                ent[k] = v
            own[n] = ent
        inter = self.grid.inter_group
        merged: Dict[str, Dict[str, Any]] = {}
        for part in (all_gather_object(own, group=inter) if inter.size > 1 else [own]):
            merged.update(part)
        return merged

    def _shard(self, name: str, full) -> np.ndarray:
        """This rank's shard of parameter ``name`` from its full array, or from a loaded block of
        :meth:`_block` (a ``ShardedArray``: its TP block, or the whole array)."""
        tp = self._tp_map()
        shape = self._full_shape(name)
        if hasattr(full, "global_shape") and tuple(full.global_shape) != shape:   # FSDP's flattened save
            full = np.asarray(full.local).reshape(shape)
        elif not hasattr(full, "global_shape") and tuple(np.shape(full)) != shape \
                and int(np.prod(np.shape(full))) == int(np.prod(shape)):
            full = np.asarray(full).reshape(shape)
        if hasattr(full, "global_shape"):
            if name in tp:
                m, local = tp[name]
                return np.asarray(m.tp_unblock(local, full.local))
            return np.asarray(full.local)
        if name in tp:
            m, local = tp[name]
            return m.tp_shard(local, np.asarray(full))
        return np.asarray(full)

    def _full_shape(self, name: str) -> tuple:
        """The serial GPT's shape of parameter ``name``."""
        tp = self._tp_map()
        if name in tp:
            return tuple(tp[name][0].tp_full_shape(tp[name][1]))
        return self._shapes[name]

    def _fsdp_ranges(self) -> Dict[str, tuple]:
        """``{name: (start, stop)}``: the elements of each flattened parameter this rank's FSDP shard holds."""
        return {n: (v.offsets[0], v.offsets[0] + v.local_shape[0])
                for n, v in self.fsdp.sharded_state_dict().items() if hasattr(v, "global_shape")}

    def _template_block(self, name: str, saved_shape, dtype, ranges=None):
        """A ``checkpoint.load`` template block of parameter ``name`` (or a moment shaped like it) for an
        entry saved with ``saved_shape``: the full shape (replicated / TP layouts) or ``(numel,)`` (FSDP's
        flattened save).  FSDP reads the whole rows covering its elements of a full-shape entry; the
        other layouts read the whole of a flattened entry they own."""
        from ..distributed.sharding import ShardedArray
        shape = self._full_shape(name)
        numel = int(np.prod(shape))
        saved_shape = tuple(saved_shape)
        if self.fsdp is not None and not self._fsdp_tp:
            a, b = ranges[name]
            if saved_shape == (numel,):
                return ShardedArray(np.zeros(b - a, dtype), (numel,), (a,))
            row = int(np.prod(shape[1:]))
            r0, r1 = (a // row, -(-b // row)) if b > a else (0, 0)
            return ShardedArray(np.zeros((r1 - r0,) + shape[1:], dtype), shape, (r0,) + (0,) * (len(shape) - 1))
        if saved_shape == shape or saved_shape != (numel,):
            return self._block(name, np.zeros(self._local_shape(name), dtype))
        n = numel if name in self._owned else 0
        return ShardedArray(np.zeros(n, dtype), (numel,), (0,))

    def _local_shape(self, name: str) -> tuple:
        return self._shapes[name]      # this rank's (TP-local) shape, kept from before FSDP flattened them

    def _tp_flat(self, name: str, v):
        """FSDP x TP: this rank's TP shard of a loaded value of ``name`` (any layout's save), flattened, as
        the 1-D ``ShardedArray`` FSDP's loaders take (they keep the elements of this rank's chunk)."""
        from ..distributed.sharding import ShardedArray
        local = np.ascontiguousarray(self._shard(name, v)).reshape(-1)
        if local.size != int(np.prod(self._shapes[name])):
            raise ValueError(f"rank {self.grid.world.rank}: {name!r} shard has {local.size} elements, the "
                             f"parameter {self._shapes[name]}")
        return ShardedArray(local, (local.size,), (0,))

    def _fsdp_local(self, optimizer=None) -> Dict[str, Any]:
        """FSDP x TP: this rank's whole TP-local arrays, gathered over FSDP's shard group (collective):
        ``{name: array}`` of the parameters, or with ``optimizer`` ``{name: {key: array or scalar}}`` of
        its state (moments gathered like the parameters, scalars such as ``step`` as they are)."""
        out: Dict[str, Any] = {}
        for f in self.fsdp.parameters():
            names = self.fsdp.param_names(f)
            if optimizer is None:
                for nm, v in zip(names, f.gather_host(f.data)):
                    out[nm] = v
                continue
            st = optimizer.state.get(f) or {}
            for nm in names:
                out[nm] = {}
            for key in sorted(st):
                v = st[key]
                if _is_array(v):
                    for nm, a in zip(names, f.gather_host(v)):
                        out[nm][key] = a
                else:
                    for nm in names:
                        out[nm][key] = v
        return out

    def _fsdp_flat(self, name: str, v):
        """A loaded value of ``name`` as the 1-D ``ShardedArray`` FSDP's loaders take (they keep the elements
        of this rank's chunk): FSDP x TP, this rank's TP shard flattened; FSDP alone, the serial array's."""
        return self._tp_flat(name, v) if self._fsdp_tp else self._flat_block(name, v)

    def _flat_block(self, name: str, v):
        """A loaded value of parameter ``name`` (full array, a block of whole rows, or FSDP's flattened
        block) as the 1-D ``ShardedArray`` FSDP's loaders take."""
        from ..backend import to_host
        from ..distributed.sharding import ShardedArray
        shape = self._full_shape(name)
        numel = int(np.prod(shape))
        if hasattr(v, "global_shape"):
            if tuple(v.global_shape) == (numel,):
                return v
            row = int(np.prod(shape[1:]))
            return ShardedArray(np.asarray(v.local).reshape(-1), (numel,), (v.offsets[0] * row,))
        return ShardedArray(np.asarray(to_host(v)).reshape(-1), (numel,), (0,))

    def _block(self, name: str, local):
        """A ``ShardedArray`` of parameter ``name``'s full array holding ``local`` (this rank's shard of it,
        or of an array shaped like it); an empty block where another pipeline stage owns ``name``."""
        from ..backend import to_host
        from ..distributed.sharding import ShardedArray
        tp = self._tp_map()
        full = self._full_shape(name)
        if name not in self._owned:
            dt = dict(self.model.named_parameters())[name].dtype
            return ShardedArray(np.empty((0,) + full[1:], dtype=dt), full, (0,) * len(full))
        if name in tp:
            m, local_name = tp[name]
            return m.tp_block(local_name, local)
        return ShardedArray(np.asarray(to_host(local)), full, (0,) * len(full))

    def full_state_dict(self) -> "OrderedDict[str, np.ndarray]":
        """The whole serial model's parameters (gathered over tensor and pipeline groups), on every rank.

        Collective over the grid.  Keys and shapes are the serial GPT's (PyTorch names).
        """
        named = dict(self.model.named_parameters())
        if self._fsdp_tp:
            local = self._fsdp_local()
            full = self._gather({n: {"v": local[n]} for n in self.param_names})
            return _with_aliases(self.model, OrderedDict((n, full[n]["v"]) for n in named))
        if self.fsdp is not None:
            from ..backend import to_host
            sd = self.fsdp.state_dict()
            return _with_aliases(self.model, OrderedDict((n, np.array(to_host(sd[n]), copy=True)) for n in named))
        full = self._gather({n: {"v": named[n].data} for n in self.param_names})
        return _with_aliases(self.model, OrderedDict((n, full[n]["v"]) for n in named))

    def load_full_state_dict(self, state_dict, strict: bool = True) -> None:
        """Load a full (serial-named) state dict, or one read into :meth:`checkpoint_template`'s blocks:
        each rank copies in its shard of its stage's parameters."""
        named = dict(self.model.named_parameters())
        if strict:
            missing = sorted(set(named) - set(state_dict))
            if missing:
                raise KeyError(f"rank {self.grid.world.rank}: the state dict lacks {missing}")
        if self.fsdp is not None:
            self.fsdp.load_state_dict({n: self._fsdp_flat(n, v) for n, v in state_dict.items() if n in named},
                                      strict=strict)
            return
        for n in self.param_names:
            if n in state_dict:
                p = named[n]
                shard = self._shard(n, state_dict[n])
                if tuple(shard.shape) != tuple(p.shape):
                    raise ValueError(f"rank {self.grid.world.rank}: {n!r} shard has shape {tuple(shard.shape)}, "
                                     f"the parameter {tuple(p.shape)}")
                from ..backend import get_array_module
                p.data[...] = get_array_module(p.data).asarray(shard, dtype=p.data.dtype)

    def checkpoint_template(self, path: Optional[str] = None) -> Dict[str, Any]:
        """A ``checkpoint.load`` template for a :func:`~axonmpi.checkpoint.training_state` saved by any
        layout: the model entries as this layout's blocks (each rank reads only its shard); with
        ``path`` (the checkpoint, to learn the optimizer's per-parameter keys) the optimizer's
        moments too; the rest (scheduler, sampler, RNG, meta, extra) as saved.  Collective.

        Example:
            >>> loaded = axonmpi.checkpoint.load(path, state.checkpoint_template())
            >>> restore_training_state(loaded, *state.checkpoint_state(opt), sched, sampler)
        """
        optimizer: Dict[str, Any] = {}
        model = ModelState(self).state_dict()
        if path is not None:
            from ..distributed import broadcast_object
            keys = shapes = None
            if self.grid.world.rank == 0:
                from ..checkpoint import CheckpointReader
                keys, shapes = {}, {}
                reader = CheckpointReader(path, verify=False)
                for name in reader.names():
                    parts = name.split("/")
                    if len(parts) == 4 and parts[:2] == ["optimizer", "state"]:
                        keys.setdefault(parts[2], []).append(parts[3])
                    if parts[0] in ("model", "optimizer"):
                        e = reader.entry(name)
                        shapes[name] = tuple(e.shape) if e.kind == "array" else None
            keys, shapes = broadcast_object((keys, shapes), group=self.grid.world.default_group)
            named = dict(self.model.named_parameters())
            ranges = self._fsdp_ranges() if self.fsdp is not None and not self._fsdp_tp else None
            model = OrderedDict((n, self._template_block(n, shapes.get(f"model/{n}") or self._full_shape(n),
                                                         self.dtype, ranges)) for n in named)
            if keys and set(keys) == set(named):
                state = OrderedDict()
                for n in named:
                    state[n] = {k: (self._template_block(n, shapes.get(f"optimizer/state/{n}/{k}")
                                                         or self._full_shape(n), self.dtype, ranges)
                                    if k in _MOMENTS else None) for k in keys[n]}
                optimizer = {"state": state, "param_groups": None}
        return {"model": model, "optimizer": optimizer, "scheduler": {}, "sampler": {},
                "rng": None, "meta": {}, "extra": {}}

    def sharded_state_dict(self) -> "OrderedDict[str, Any]":
        """This rank's entries under serial names: TP shards as ``ShardedArray`` blocks, only its stage's."""
        from .tensor import sharded_state_dict
        if self._fsdp_tp:             # FSDP x TP: the TP blocks (gathered over data; replicas write once)
            return ModelState(self).state_dict()
        if self.fsdp is not None:     # FSDP: 1-D blocks of the flattened parameters
            sd = self.fsdp.sharded_state_dict()
            return OrderedDict((n, sd[n]) for n in self.param_names)
        sd = sharded_state_dict(self.model) if self.tensor_parallel else self.model.state_dict()
        return OrderedDict((n, sd[n]) for n in self.param_names)

    def checkpoint_state(self, optimizer) -> "tuple":
        """``(model_state, optimizer_state)``: objects with ``state_dict``/``load_state_dict`` for
        :func:`axonmpi.checkpoint.training_state`.  They save serial-named ``ShardedArray`` blocks
        (no gather: TP shards as blocks, each pipeline stage its own parameters) and load full
        arrays, so a checkpoint saved under one layout loads under any other and into the serial GPT."""
        return ModelState(self), OptimizerState(self, optimizer)


# optimizer state entries shaped like their parameter (read block-wise on resume); others are read whole
_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta", "sum")


def _is_array(v) -> bool:
    return hasattr(v, "global_shape") or (hasattr(v, "shape") and getattr(v, "ndim", 0) > 0)


def _dtype(v):
    return v.local.dtype if hasattr(v, "global_shape") else np.asarray(v).dtype


class ModelState:
    """A laid-out model's parameters under serial names as ``ShardedArray`` blocks of the full arrays.

    Every rank lists every parameter (the checkpoint's rule: the same keys everywhere): its own
    stage's as its TP block (or the whole array, written once over replicas), other stages' as
    an empty block.  Loading takes full arrays (any layout's checkpoint) and keeps the shard.
    """

    def __init__(self, owner: LayoutState):
        self.owner = owner   # the LayoutState (e.g. a HybridGPT) whose state this is

    def state_dict(self):
        if self.owner._fsdp_tp:
            local = self.owner._fsdp_local()
            return OrderedDict((n, self.owner._block(n, local[n])) for n, _ in self.owner.model.named_parameters())
        if self.owner.fsdp is not None:
            return self.owner.sharded_state_dict()
        return _with_aliases(self.owner.model, OrderedDict((n, self.owner._block(n, p.data))
                                                           for n, p in self.owner.model.named_parameters()))

    def load_state_dict(self, state_dict, strict: bool = True):
        self.owner.load_full_state_dict(state_dict, strict=strict)


class OptimizerState:
    """An optimizer's per-parameter state keyed by serial parameter names, as blocks like the parameters'."""

    def __init__(self, owner: LayoutState, optimizer):
        self.owner, self.opt = owner, optimizer

    def state_dict(self):
        lay = self.owner
        named = dict(lay.model.named_parameters())
        if lay._fsdp_tp:             # FSDP x TP: the moments gathered over data, saved as TP blocks
            local = lay._fsdp_local(self.opt)
            state = OrderedDict((n, {k: (lay._block(n, v) if _is_array(v) else v) for k, v in local[n].items()})
                                for n in named if local.get(n))
            return {"state": state,
                    "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]}
        if lay.fsdp is not None:     # FSDP: keyed by serial names, moments as 1-D blocks of the flattened arrays
            osd = lay.fsdp.optim_state_dict(self.opt)
            return {"state": OrderedDict((n, osd["state"][n]) for n in named if n in osd["state"]),
                    "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]]}
        own = [n for n in lay.param_names if self.opt.state.get(named[n])]
        # the per-parameter keys (and scalar values such as AdamW's step) are the same for every parameter
        sample = {k: (None if _is_array(v) else v) for k, v in self.opt.state[named[own[0]]].items()} if own else None
        inter = lay.grid.inter_group
        samples = [x for x in (all_gather_object(sample, group=inter) if inter.size > 1 else [sample]) if x]
        state = OrderedDict()
        if samples:
            keys = samples[0]
            for n, p in named.items():
                st = self.opt.state.get(p, {}) if n in lay.param_names else {}
                state[n] = {k: (lay._block(n, st.get(k)) if v is None else v) for k, v in keys.items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict, strict: bool = True):
        from ..backend import get_array_module
        named = dict(self.owner.model.named_parameters())
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.opt.param_groups):
            raise ValueError(f"rank {self.owner.grid.world.rank}: the checkpoint has {len(saved_groups)} parameter "
                             f"groups, the optimizer {len(self.opt.param_groups)}")
        for g, saved in zip(self.opt.param_groups, saved_groups):
            g.update({k: v for k, v in saved.items() if k != "params"})
        if self.owner.fsdp is not None:
            state = {n: {k: (self.owner._fsdp_flat(n, v) if _is_array(v) else v) for k, v in st.items()}
                     for n, st in state_dict["state"].items() if st}
            self.owner.fsdp.load_optim_state_dict(self.opt, {"state": state, "param_groups": saved_groups})
            return
        for n in self.owner.param_names:
            saved = state_dict["state"].get(n)
            if not saved:
                continue
            p = named[n]
            xp = get_array_module(p.data)
            self.opt.state[p] = {k: (xp.asarray(self.owner._shard(n, v), dtype=_dtype(v)) if _is_array(v) else v)
                                 for k, v in saved.items()}
