"""Serial-named, sharded model and optimizer state of a model laid out over a grid (any placed model).

:class:`ShardedState` reads every parameter's placement (its cuts and full shape; see
:mod:`axonmpi.parallel.placed`) and gives the full and the sharded form of the model and optimizer
state, and loads either; ``ParallelModule`` / ``PipelinedModule`` (``pm.sharded_state()``) and
:class:`LayoutState` (a recipe's view, e.g. ``HybridGPT``) use it, so a checkpoint saved under one
layout loads under any other and into the plain model:

* cut parameters are ``ShardedArray`` blocks of the full arrays (``placed.block``);
* each pipeline stage contributes only its own parameters (an empty block for the others');
* FSDP x tensor parallel, FSDP in a pipeline: each piece gathered over FSDP's group from its flat
  chunk and written as its block; loading packs the pieces back into this rank's chunk;
* FSDP alone (:class:`LayoutState`, ``FSDP`` itself): FSDP's own form, each parameter flattened under its
  serial name (1-D blocks, nothing gathered); templates reshape between the forms.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Optional

import numpy as np

from ..distributed import all_gather_object
from . import placed

__all__ = ["ShardedState", "LayoutState", "ModelState", "OptimizerState"]


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


def _is_array(v) -> bool:
    return hasattr(v, "global_shape") or (hasattr(v, "shape") and getattr(v, "ndim", 0) > 0)


def _host(v) -> np.ndarray:
    from ..backend import to_host
    return np.array(to_host(v), copy=True)


class ShardedState:
    """Serial-named model and optimizer state of one rank's part of a laid-out model, from placements alone.

    Every parameter's :class:`~axonmpi.distributed.Placement` (its full shape and cuts) says how its
    local array sits in the serial one (:mod:`axonmpi.parallel.placed`); this class adds the two things
    placements do not hold: which parameters this rank owns (a pipeline stage's; the others are
    stand-ins with the serial names) and where FSDP keeps them (a flat parameter's chunk).

    Two forms, for the model and for the optimizer:

    * full: serial names, full serial shapes, on every rank (collective: the cuts' groups, then
      one all-gather over ``stage_group`` joining the stages);
    * sharded: every serial name on every rank (the checkpoint's rule), this rank's piece as a
      ``ShardedArray`` block of the full array (another stage's as an empty block); what
      ``axonmpi.checkpoint`` writes and reshards on load.

    Loading takes either form, a full array flattened (FSDP's save), or a block read into this
    layout's sharded form; each rank keeps its piece.

    Args:
        model: the rank's model under serial names (tensor-parallel layers in place).
        params: the parameters this rank owns (``None``: all of them).
        flats: FSDP's flat parameters holding some of ``model``'s (their chunks are this rank's).
        stage_group: the group joining the pipeline stages (``None``: one stage).
        rank: this rank in the world, for errors (default: the current World's, else 0).

    Example:
        >>> st = ShardedState(model, params=pipe.parameters(), stage_group=grid.inter_group)
        >>> axonmpi.checkpoint.save(path, {"model": st.sharded_state_dict(), "optimizer": st.optim_state_dict(opt)})
    """

    def __init__(self, model, *, params=None, flats=(), stage_group=None, rank: Optional[int] = None):
        if rank is None:
            from ..distributed.world import get_world, is_initialized
            rank = get_world().rank if is_initialized() else 0     # a plain model in one process: rank 0
        self.model, self.stage_group, self.rank = model, stage_group, int(rank)
        self.named: "OrderedDict[str, Any]" = OrderedDict(model.named_parameters())
        self._name = {id(q): n for n, q in self.named.items()}
        self.flats = [f for f in flats if f is not None]
        in_flat = {id(q) for f in self.flats for q in f.params}
        own = None if params is None else {id(q) for q in params}
        self.owned = [n for n, q in self.named.items() if own is None or id(q) in own or id(q) in in_flat]
        self._plain = [n for n in self.owned if id(self.named[n]) not in in_flat]

    # -- one parameter -------------------------------------------------------------------------
    def placement(self, name: str):
        """The placement of ``name`` with its full shape (a replicated one: the local shape)."""
        from dataclasses import replace
        from ..distributed.placement import placement_of
        pl = placement_of(self.named[name])
        return pl if pl.full_shape is not None else replace(pl, full_shape=tuple(self.named[name].shape))

    def full_shape(self, name: str) -> tuple:
        return tuple(self.placement(name).full_shape)

    def piece(self, name: str, value) -> np.ndarray:
        """This rank's local array of ``name`` from a loaded ``value``: a full array (any shape with the serial
        number of elements: FSDP's flattened save), a ``ShardedArray`` holding the whole array, or the block
        :meth:`sharded_state_dict` gave (filled by ``checkpoint.load``)."""
        pl, shape = self.placement(name), self.full_shape(name)
        if hasattr(value, "global_shape") and tuple(value.local_shape) != tuple(value.global_shape):
            if tuple(value.global_shape) != shape:
                raise ValueError(f"rank {self.rank}: {name!r} was read as a block of shape {tuple(value.global_shape)}, "
                                 f"the serial parameter is {shape}: load it with this layout's template "
                                 f"(its sharded_state_dict()) or with no template (full arrays)")
            return placed.unblock(value.local, pl)
        full = _host(value.local if hasattr(value, "global_shape") else value)
        if full.shape != shape:
            if full.size != int(np.prod(shape)):
                raise ValueError(f"rank {self.rank}: {name!r} has shape {full.shape}; expected the serial shape "
                                 f"{shape} (or its {int(np.prod(shape))} elements flattened)")
            full = full.reshape(shape)
        return placed.cut(full, pl)

    def _empty(self, name: str, dtype):
        from ..distributed.sharding import ShardedArray
        shape = self.full_shape(name)
        return ShardedArray(np.empty((0,) + shape[1:], dtype), shape, (0,) * len(shape))

    # -- this rank's local arrays ----------------------------------------------------------------
    def _flat_names(self, f) -> List[str]:
        return [self._name[id(q)] for q in f.params]

    def _is_flat(self, q) -> bool:
        return any(q is f for f in self.flats)

    def _names_of(self, q) -> List[str]:
        """The serial names an optimizer parameter holds (a flat one's, or its own)."""
        if self._is_flat(q):
            return self._flat_names(q)
        if id(q) not in self._name:
            raise ValueError(f"rank {self.rank}: the optimizer holds a parameter of shape {tuple(q.shape)} that is "
                             "not one of this model's; build it on pm.parameters()")
        return [self._name[id(q)]]

    def _local(self, optimizer=None) -> Dict[str, Any]:
        """``{name: local array}`` of the owned parameters (FSDP's gathered over its group: collective), or
        with ``optimizer`` ``{name: {key: local array or scalar}}`` of its state."""
        out: Dict[str, Any] = {}
        for n in self._plain:
            p = self.named[n]
            if optimizer is None:
                out[n] = _host(p.data)
            elif optimizer.state.get(p):
                out[n] = {k: (_host(v) if _is_array(v) else v) for k, v in optimizer.state[p].items()}
        for f in self.flats:
            names = self._flat_names(f)
            if optimizer is None:
                out.update(zip(names, f.gather_host(f.data)))
                continue
            st = optimizer.state.get(f) or {}
            if not st:
                continue
            per = {n: {} for n in names}
            for k in sorted(st):
                vals = f.gather_host(st[k]) if _is_array(st[k]) else [st[k]] * len(names)
                for n, v in zip(names, vals):
                    per[n][k] = v
            out.update(per)
        return out

    def _join(self, own: Dict[str, Any]) -> Dict[str, Any]:
        g = self.stage_group
        if g is None or g.size == 1:
            return dict(own)
        merged: Dict[str, Any] = {}
        for part in all_gather_object(own, group=g):
            merged.update(part)
        return merged

    # -- model -----------------------------------------------------------------------------------
    def _entries(self, values: Dict[str, Any]) -> "OrderedDict[str, Any]":
        """``values`` (by parameter name) in the model's state-dict order, a tied parameter under each of its
        names, the persistent buffers as host copies (replicated)."""
        out = OrderedDict()
        for k, t in self.model._state_items():
            n = self._name.get(id(t))
            if n is None:
                out[k] = _host(t.data)
            elif n in values:
                out[k] = values[n]
        return out

    def full_state_dict(self) -> "OrderedDict[str, np.ndarray]":
        """The serial model's state dict (full shapes, serial names, a tied parameter under each name), every rank.

        Collective over the cuts' groups, FSDP's groups and ``stage_group``."""
        local = self._local()
        return self._entries(self._join({n: np.asarray(placed.gather(local[n], self.placement(n)))
                                         for n in self.owned}))

    def sharded_state_dict(self) -> "OrderedDict[str, Any]":
        """Every serial name: this rank's piece as a ``ShardedArray`` block (another stage's: an empty one).

        Collective where a piece is not a rectangle of the full array (see ``placed.block``) and over FSDP's
        groups (its chunks are gathered to the tensor-parallel piece)."""
        local = self._local()
        return self._entries({n: (placed.block(local[n], self.placement(n)) if n in local else self._empty(n, p.dtype))
                              for n, p in self.named.items()})

    def load_state_dict(self, state_dict, strict: bool = True) -> None:
        """Load either form (or any layout's save, as full arrays or this layout's blocks); each rank keeps
        its pieces of its own parameters; buffers are copied as they are."""
        from ..backend import get_array_module
        missing = [n for n in self.owned if n not in state_dict]
        unexpected = sorted(set(state_dict) - {k for k, _ in self.model._state_items()})
        if strict and (missing or unexpected):
            raise RuntimeError(f"rank {self.rank}: the state dict lacks {missing} and has {unexpected} the model has "
                               "not (serial names expected); pass strict=False to load a part")

        def put(t, v):
            t.data[...] = get_array_module(t.data).asarray(np.asarray(v).reshape(t.data.shape), dtype=t.data.dtype)
        for n in self._plain:
            if n in state_dict:
                put(self.named[n], self.piece(n, state_dict[n]))
        for f in self.flats:
            names = self._flat_names(f)
            if all(n in state_dict for n in names):
                pieces = [self.piece(n, state_dict[n]) for n in names]
                self._into_flat(f, pieces, f.data)
                if getattr(f, "_full", None) is not None:      # gathered now: its bound full buffer too
                    f.layout.pack(pieces, f._full)
        for k, t in self.model._state_items():
            if id(t) not in self._name and k in state_dict:
                v = state_dict[k]
                put(t, _host(v.local if hasattr(v, "global_shape") else v))

    @staticmethod
    def _into_flat(f, pieces, out) -> None:
        """Write this rank's chunk of the flat buffer packed from the parameters' ``pieces`` into ``out``."""
        from ..backend import get_array_module
        full = f.layout.pack(pieces, np.empty(f.total_numel, np.asarray(pieces[0]).dtype))
        a, b = f.shard_range
        out[...] = get_array_module(out).asarray(full[a:b], dtype=out.dtype).reshape(out.shape)

    # -- optimizer -------------------------------------------------------------------------------
    def _check_optimizer(self, optimizer) -> None:
        if callable(getattr(optimizer, "sharded_state_dict", None)):
            raise NotImplementedError(
                f"rank {self.rank}: {type(optimizer).__name__} keeps its state in buckets of flattened chunks, not "
                "per parameter, so it has no serial-named form here: checkpoint it with its own "
                "optimizer.sharded_state_dict() / load_state_dict (same layout, any data size) beside "
                "pm.sharded_state_dict(), or use AdamW on pm.parameters()")

    def _optim(self, optimizer, convert) -> Dict[str, Any]:
        self._check_optimizer(optimizer)
        local = self._local(optimizer)
        # the per-parameter keys and scalars (AdamW's step) are the same for every parameter: every rank
        # lists every name with them (the checkpoint's rule), another stage's arrays as empty blocks
        sample = next(iter(local.values()), None)
        sample = None if sample is None else {k: (None if _is_array(v) else v) for k, v in sample.items()}
        keys = sample
        staged = self.stage_group is not None and self.stage_group.size > 1
        if staged:
            keys = next((x for x in all_gather_object(sample, group=self.stage_group) if x), None)
        state = OrderedDict()
        if keys is not None:
            for n, p in self.named.items():
                if n in local:
                    state[n] = {k: (convert(n, local[n][k]) if v is None else local[n].get(k, v))
                                for k, v in keys.items()}
                elif n not in self.owned:
                    state[n] = {k: (self._empty(n, p.dtype) if v is None else v) for k, v in keys.items()}
        groups = []
        for g in optimizer.param_groups:
            opts = {k: v for k, v in g.items() if k != "params"}
            # one stage's names differ from another's: a pipeline's groups keep only the options
            groups.append(opts if staged else {**opts, "params": [n for q in g["params"] for n in self._names_of(q)]})
        return {"state": state, "param_groups": groups}

    def optim_state_dict(self, optimizer) -> Dict[str, Any]:
        """The optimizer's state under serial names, each moment as its parameter's block (sharded form):
        ``{"state": {name: {"step": 3, "exp_avg": ShardedArray, ...}}, "param_groups": [{..., "params": [names]}]}``."""
        return self._optim(optimizer, lambda n, v: placed.block(v, self.placement(n)))

    def full_optim_state_dict(self, optimizer) -> Dict[str, Any]:
        """The optimizer's state under serial names with full serial arrays, on every rank (collective)."""
        st = self._optim(optimizer, lambda n, v: np.asarray(placed.gather(v, self.placement(n))))
        joined = self._join({n: d for n, d in st["state"].items() if n in self.owned})
        st["state"] = OrderedDict((n, joined[n]) for n in self.named if n in joined)
        return st

    def load_optim_state_dict(self, optimizer, state_dict: Dict[str, Any]) -> None:
        """Load either optimizer form saved under any layout into ``optimizer`` (built on this rank's
        parameters or FSDP's flat ones): each moment cut to its parameter's piece (packed into FSDP's chunk)."""
        self._check_optimizer(optimizer)
        saved, index, groups, i = state_dict["state"], {}, [], 0
        if len(state_dict["param_groups"]) != len(optimizer.param_groups):
            raise ValueError(f"rank {self.rank}: the saved optimizer has {len(state_dict['param_groups'])} parameter "
                             f"groups, this one {len(optimizer.param_groups)}: build it with the same groups")
        for g, sg in zip(optimizer.param_groups, state_dict["param_groups"]):
            ids = []
            for q in g["params"]:
                names = self._names_of(q)
                sts = [saved.get(n) or {} for n in names]
                if all(sts):
                    st = {}
                    for k, v in sts[0].items():
                        if not _is_array(v):
                            st[k] = v
                        elif self._is_flat(q):
                            out = np.empty(q.data.shape, np.asarray(_host(getattr(v, "local", v))).dtype)
                            self._into_flat(q, [self.piece(n, s[k]) for n, s in zip(names, sts)], out)
                            st[k] = out
                        else:
                            st[k] = self.piece(names[0], v).reshape(q.data.shape)
                    index[i] = st
                ids.append(i)
                i += 1
            groups.append({**{k: v for k, v in sg.items() if k != "params"}, "params": ids})
        optimizer.load_state_dict({"state": index, "param_groups": groups})


class LayoutState:
    """The state of one rank's part of a model laid out over ``grid`` (a recipe's view of :class:`ShardedState`).

    Every layout's pieces come from the placements (:class:`ShardedState`); what this adds is the recipe's
    record of the layout and FSDP's own form: FSDP alone (nothing cut) keeps FSDP's 1-D blocks of the
    flattened serial arrays (nothing gathered), and :meth:`checkpoint_template` reads either form into
    either.

    Args:
        model: the rank's model (tensor-parallel layers in place; other stages' parameters may be
            zero-stride stand-ins with the serial names, local shapes and placements).
        param_names: the parameters this rank owns (its stage's; every one under FSDP).
        fsdp: the :class:`~axonmpi.parallel.FSDP` wrapping ``model`` over data, or ``None``.
        tensor_parallel: whether ``model`` holds cut parameters (tensor or expert parallel).
        grid: the process grid (its ``inter_group`` joins the pipeline stages' parts).
        dtype: the parameter dtype (of load templates).
        flats: FSDP flat parameters of pipeline stages holding some of the owned parameters.

    Example:
        >>> state = LayoutState(model, param_names=names, fsdp=None, tensor_parallel=True,
        ...                     grid=grid, dtype=np.float64)
        >>> mgr.save(step, training_state(*state.checkpoint_state(opt)))
    """

    def __init__(self, model, *, param_names: List[str], fsdp=None, tensor_parallel: bool = False, grid, dtype,
                 flats=()):
        from ._flat import FlatParameter
        self.model, self.fsdp, self.grid, self.dtype = model, fsdp, grid, np.dtype(dtype)
        self.param_names = list(param_names)
        self.tensor_parallel = bool(tensor_parallel)
        self._fsdp_alone = fsdp is not None and not self.tensor_parallel
        named = dict(model.named_parameters())
        flats = list(flats) + ([f for f in fsdp.parameters() if isinstance(f, FlatParameter)] if fsdp is not None
                               else [])
        self.sharded = ShardedState(model, params=[named[n] for n in self.param_names if n in named], flats=flats,
                                    stage_group=grid.inter_group, rank=grid.world.rank)
        self._owned = set(self.sharded.owned)      # with the parameters inside a stage's FSDP flat shard

    def _full_shape(self, name: str) -> tuple:
        """The serial model's shape of parameter ``name`` (its placement's)."""
        return self.sharded.full_shape(name)

    def _fsdp_ranges(self) -> Dict[str, tuple]:
        """``{name: (start, stop)}``: the elements of each flattened parameter this rank's FSDP shard holds."""
        return {n: (v.offsets[0], v.offsets[0] + v.local_shape[0])
                for n, v in self.fsdp.sharded_state_dict().items() if hasattr(v, "global_shape")}

    def _template_block(self, name: str, saved_shape, dtype, ranges=None):
        """A ``checkpoint.load`` template block of parameter ``name`` (or a moment shaped like it) for an
        entry saved with ``saved_shape``: the full shape (the placements' form) or ``(numel,)`` (FSDP's
        flattened save).  FSDP alone reads the whole rows covering its elements of a full-shape entry; the
        other layouts read the whole of a flattened entry they own."""
        from ..distributed.sharding import ShardedArray
        shape = self._full_shape(name)
        numel = int(np.prod(shape))
        saved_shape = tuple(saved_shape)
        if self._fsdp_alone:
            a, b = ranges[name]
            if saved_shape == (numel,):
                return ShardedArray(np.zeros(b - a, dtype), (numel,), (a,))
            row = int(np.prod(shape[1:]))
            r0, r1 = (a // row, -(-b // row)) if b > a else (0, 0)
            return ShardedArray(np.zeros((r1 - r0,) + shape[1:], dtype), shape, (r0,) + (0,) * (len(shape) - 1))
        if saved_shape == shape or saved_shape != (numel,):
            if name not in self._owned:
                return self.sharded._empty(name, dtype)
            pl = self.sharded.placement(name)
            return placed.block(np.zeros(placed.local_shape(pl), dtype), pl)
        n = numel if name in self._owned else 0
        return ShardedArray(np.zeros(n, dtype), (numel,), (0,))

    def _flat_block(self, name: str, v):
        """FSDP alone: a loaded value of parameter ``name`` (full array, a block of whole rows, or FSDP's
        flattened block) as the 1-D ``ShardedArray`` FSDP's loaders take."""
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

    def full_state_dict(self) -> "OrderedDict[str, np.ndarray]":
        """The whole serial model's state on every rank (collective over the grid); keys and shapes the
        serial model's (PyTorch names)."""
        if self._fsdp_alone:
            from ..backend import to_host
            named = dict(self.model.named_parameters())
            sd = self.fsdp.state_dict()
            return _with_aliases(self.model, OrderedDict((n, np.array(to_host(sd[n]), copy=True)) for n in named))
        return self.sharded.full_state_dict()

    def load_full_state_dict(self, state_dict, strict: bool = True) -> None:
        """Load a full (serial-named) state dict, or one read into :meth:`checkpoint_template`'s blocks:
        each rank copies in its pieces of its stage's parameters."""
        if self._fsdp_alone:
            named = dict(self.model.named_parameters())
            missing = sorted(set(named) - set(state_dict))
            if strict and missing:
                raise KeyError(f"rank {self.grid.world.rank}: the state dict lacks {missing}")
            self.fsdp.load_state_dict({n: self._flat_block(n, v) for n, v in state_dict.items() if n in named},
                                      strict=strict)
            return
        self.sharded.load_state_dict(state_dict, strict=strict)

    def checkpoint_template(self, path: Optional[str] = None) -> Dict[str, Any]:
        """A ``checkpoint.load`` template for a :func:`~axonmpi.checkpoint.training_state` saved by any
        layout: the model entries as this layout's blocks (each rank reads only its pieces); with
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
            ranges = self._fsdp_ranges() if self._fsdp_alone else None
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
        """Every serial name as this rank's block (FSDP alone: FSDP's 1-D blocks of the flattened arrays)."""
        return self.fsdp.sharded_state_dict() if self._fsdp_alone else self.sharded.sharded_state_dict()

    def checkpoint_state(self, optimizer) -> "tuple":
        """``(model_state, optimizer_state)``: objects with ``state_dict``/``load_state_dict`` for
        :func:`axonmpi.checkpoint.training_state`.  They save serial-named ``ShardedArray`` blocks
        (each rank its pieces of its stage's parameters) and load either form, so a checkpoint saved under
        one layout loads under any other and into the serial model."""
        return ModelState(self), OptimizerState(self, optimizer)


# optimizer state entries shaped like their parameter (read block-wise on resume); others are read whole
_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta", "sum")


class ModelState:
    """A laid-out model's parameters under serial names as ``ShardedArray`` blocks of the full arrays.

    Every rank lists every parameter (the checkpoint's rule: the same keys everywhere): its own
    stage's as its block, other stages' as an empty block.  Loading takes either form and keeps the pieces.
    """

    def __init__(self, owner: LayoutState):
        self.owner = owner   # the LayoutState (e.g. a HybridGPT) whose state this is

    def state_dict(self):
        return self.owner.sharded_state_dict()

    def load_state_dict(self, state_dict, strict: bool = True):
        self.owner.load_full_state_dict(state_dict, strict=strict)


class OptimizerState:
    """An optimizer's per-parameter state keyed by serial parameter names, as blocks like the parameters'."""

    def __init__(self, owner: LayoutState, optimizer):
        self.owner, self.opt = owner, optimizer

    def state_dict(self):
        lay = self.owner
        if lay._fsdp_alone:     # FSDP: keyed by serial names, moments as 1-D blocks of the flattened arrays
            named = dict(lay.model.named_parameters())
            osd = lay.fsdp.optim_state_dict(self.opt)
            return {"state": OrderedDict((n, osd["state"][n]) for n in named if n in osd["state"]),
                    "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]]}
        st = lay.sharded.optim_state_dict(self.opt)
        return {"state": st["state"], "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                                       for g in st["param_groups"]]}

    def load_state_dict(self, state_dict, strict: bool = True):
        lay = self.owner
        if lay._fsdp_alone:
            state = {n: {k: (lay._flat_block(n, v) if _is_array(v) else v) for k, v in st.items()}
                     for n, st in state_dict["state"].items() if st}
            lay.fsdp.load_optim_state_dict(self.opt, {"state": state, "param_groups": state_dict["param_groups"]})
            return
        lay.sharded.load_optim_state_dict(self.opt, state_dict)
