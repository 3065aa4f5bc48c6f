"""The one sharded-state form: serial-named model and optimizer state of any laid-out model, from placements.

:class:`ShardedState` reads every parameter's placement (its cuts and full shape; see
:mod:`axonmpi.parallel.placed`) and gives the full and the sharded form of the model and optimizer state, and
loads either, so a checkpoint saved under one layout loads under any other and into the plain model:

* cut parameters are ``ShardedArray`` blocks of the full arrays (``placed.block``);
* each pipeline stage contributes only its own parameters (an empty block for the others');
* a parameter inside an FSDP flat chunk that no other group cuts is the 1-D block of its flattened serial
  array that the chunk holds (nothing gathered: FSDP's own form); one a tensor-parallel group cuts is gathered
  over FSDP's group to its piece, then written as its block;
* frozen parameters (``requires_grad=False``) and persistent buffers are in both forms with their values;
* the optimizer's state per parameter (AdamW's, or a ZeRO-1 wrapper's chunks gathered over its group to each
  parameter), under the serial names of the parameters that have state in the serial model.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Optional

import numpy as np

from ..distributed import all_gather_object
from . import placed

__all__ = ["ShardedState"]


def _is_array(v) -> bool:
    return hasattr(v, "global_shape") or (hasattr(v, "shape") and getattr(v, "ndim", 0) > 0)


def _host(v) -> np.ndarray:
    from ..backend import to_host
    return np.array(to_host(v), copy=True)


def _flat_block(v, numel: int) -> bool:
    """Whether ``v`` is a 1-D block of a parameter's flattened serial array (FSDP's form)."""
    return hasattr(v, "global_shape") and tuple(v.global_shape) == (numel,) and len(v.local_shape) == 1


class ShardedState:
    """Serial-named model and optimizer state of one rank's part of a laid-out model, from placements alone.

    Two forms, for the model and for the optimizer:

    * full: serial names, full serial shapes, on every rank (collective: the cuts' groups, FSDP's groups,
      then one all-gather over ``stage_group`` joining the stages);
    * sharded: every serial name on every rank (the checkpoint's rule), this rank's piece as a
      ``ShardedArray`` block of the full array (another stage's as an empty block); what
      ``axonmpi.checkpoint`` writes and reshards on load.

    Loading takes either form, a full array flattened, or blocks read into this layout's sharded form; each
    rank keeps its piece.

    Args:
        model: the rank's model under serial names (tensor-parallel layers in place).
        modules: the modules this rank holds (a pipeline's stages; ``None``: the whole model).
        flats: FSDP's flat parameters holding some of ``model``'s (their chunks are this rank's).
        stage_group: the group joining the pipeline stages (``None``: one stage).
        rank: this rank in the world, for errors (default: the current World's, else 0).

    Example:
        >>> st = ShardedState(model, modules=stages, stage_group=grid.inter_group)
        >>> axonmpi.checkpoint.save(path, {"model": st.sharded_state_dict(), "optimizer": st.optim_state_dict(opt)})
    """

    def __init__(self, model, *, modules=None, flats=(), stage_group=None, rank: Optional[int] = None):
        if rank is None:
            from ..distributed.world import get_world, is_initialized
            rank = get_world().rank if is_initialized() else 0     # a plain model in one process: rank 0
        self.model, self.stage_group, self.rank = model, stage_group, int(rank)
        self.named: "OrderedDict[str, Any]" = OrderedDict(model.named_parameters())
        self._name = {id(q): n for n, q in self.named.items()}
        self.flats = [f for f in flats if f is not None]
        in_flat = {id(q) for f in self.flats for q in f.params}
        own = None if modules is None else {id(q) for m in modules for q in m.parameters()}
        self.owned = [n for n, q in self.named.items() if own is None or id(q) in own or id(q) in in_flat]
        self._plain = [n for n in self.owned if id(self.named[n]) not in in_flat]
        # FSDP's 1-D blocks where every rank writes its entries in one form: one stage (another stage's rank
        # writes an empty block of the serial shape)
        self._flat1d = stage_group is None or stage_group.size == 1

    # -- one parameter -------------------------------------------------------------------------
    def placement(self, name: str):
        """The placement of ``name`` with its full shape (a replicated one: the local shape)."""
        from dataclasses import replace
        from ..distributed.placement import placement_of
        pl = placement_of(self.named[name])
        return pl if pl.full_shape is not None else replace(pl, full_shape=tuple(self.named[name].shape))

    def full_shape(self, name: str) -> tuple:
        return tuple(self.placement(name).full_shape)

    def _cut(self, name: str) -> bool:
        return bool(self.placement(name).layout)

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
        return ShardedArray.empty(self.full_shape(name), dtype)       # 0-d too (issue 48 item 4)

    # -- this rank's arrays ----------------------------------------------------------------------
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

    def _flat_values(self, f, chunk, sharded: bool) -> Dict[str, Any]:
        """``{name: value}`` of ``chunk`` (the flat shard, or a moment of it): with ``sharded`` the 1-D blocks of
        the parameters no other group cuts (nothing gathered) and the gathered pieces of the others; else every
        piece gathered (collective over the flat's group)."""
        names = self._flat_names(f)
        cut = [self._cut(n) for n in names]
        out: Dict[str, Any] = {}
        if not self._flat1d:
            cut = [True] * len(names)
        if sharded:
            for n, blk, c in zip(names, f.layout.shard_blocks(f.segments(), chunk), cut):
                if not c:
                    out[n] = blk
        if not sharded or any(cut):
            for n, v, c in zip(names, f.gather_host(chunk), cut):
                if not sharded or c:
                    out[n] = v
        return out

    def _local(self, sharded: bool) -> Dict[str, Any]:
        """``{name: local array (or FSDP 1-D block)}`` of the owned parameters (collective over FSDP's groups)."""
        out: Dict[str, Any] = {n: _host(self.named[n].data) for n in self._plain}
        for f in self.flats:
            out.update(self._flat_values(f, f.data, sharded))
        return out

    def _join(self, own: Dict[str, Any]) -> Dict[str, Any]:
        g = self.stage_group
        if g is None or g.size == 1:
            return dict(own)
        merged: Dict[str, Any] = {}
        for part in all_gather_object(own, group=g):
            merged.update(part)
        return merged

    def _as_block(self, name: str, v):
        return v if hasattr(v, "global_shape") else placed.block(v, self.placement(name))

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
        """The serial model's state dict (full shapes, serial names, a tied parameter under each name, frozen
        parameters and buffers), every rank.  Collective over the cuts' groups, FSDP's groups and ``stage_group``."""
        local = self._local(sharded=False)
        return self._entries(self._join({n: np.asarray(placed.gather(local[n], self.placement(n)))
                                         for n in self.owned}))

    def sharded_state_dict(self) -> "OrderedDict[str, Any]":
        """Every serial name: this rank's piece as a ``ShardedArray`` block (another stage's: an empty one).
        Collective where a piece is not a rectangle of the full array (see ``placed.block``) and over FSDP's
        groups for the pieces a tensor-parallel group cuts."""
        local = self._local(sharded=True)
        return self._entries({n: (self._as_block(n, local[n]) if n in local else self._empty(n, p.dtype))
                              for n, p in self.named.items()})

    def load_state_dict(self, state_dict, strict: bool = True) -> None:
        """Load either form (or any layout's save, as full arrays or this layout's blocks); each rank keeps its
        pieces of its own parameters; frozen parameters and buffers are copied as they are.

        Raises:
            RuntimeError: with ``strict``, naming every missing and every unexpected key.
        """
        from ..backend import get_array_module
        items = dict(self.model._state_items())      # every serial name, on every rank (any stage)
        missing = [k for k in items if k not in state_dict]
        unexpected = sorted(set(state_dict) - set(items))
        if strict and (missing or unexpected):
            raise RuntimeError(f"rank {self.rank}: load_state_dict(strict=True): missing keys {missing}, unexpected "
                               f"keys {unexpected} (serial names expected); pass strict=False to load a part")

        def put(t, v):
            t.data[...] = get_array_module(t.data).asarray(np.asarray(v).reshape(t.data.shape), dtype=t.data.dtype)
        for n in self._plain:
            if n in state_dict:
                put(self.named[n], self.piece(n, state_dict[n]))
        for f in self.flats:
            names = self._flat_names(f)
            if all(n in state_dict for n in names):
                self._into_flat(f, [state_dict[n] for n in names], f.data)
        for k, t in self.model._state_items():
            if id(t) not in self._name and k in state_dict:
                v = state_dict[k]
                put(t, _host(v.local if hasattr(v, "global_shape") else v))

    def _into_flat(self, f, values, out) -> None:
        """Write this rank's chunk of ``f`` (shaped like its shard: the data, or a moment) from each parameter's
        loaded value: a 1-D block of its flattened serial array (FSDP's form), or any form :meth:`piece` reads."""
        from ..backend import get_array_module
        xp = get_array_module(out)
        names = self._flat_names(f)
        flat = {}
        for i, (n, v) in enumerate(zip(names, values)):
            numel = int(f.layout.numels[i])
            if not self._cut(n) and _flat_block(v, numel):
                flat[i] = (np.asarray(v.local).reshape(-1), int(v.offsets[0]))
            else:
                flat[i] = (np.asarray(self.piece(n, v)).reshape(-1), 0)
        for s in f.segments():
            local, start = flat[s.index]
            s.in_chunk(out)[...] = xp.asarray(s.in_param(local, start), dtype=out.dtype)
        if out is f.data and getattr(f, "_full", None) is not None and not f.aliased:
            f.layout.pack(f.gather_host(f.data), f._full)      # gathered now: its bound full buffer too

    # -- optimizer -------------------------------------------------------------------------------
    def _local_optim(self, optimizer, sharded: bool) -> Dict[str, Dict[str, Any]]:
        """``{name: {key: local array (or FSDP 1-D block) or scalar}}`` of the optimizer's state (a ZeRO-1
        wrapper's gathered over its group: collective)."""
        out: Dict[str, Dict[str, Any]] = {}
        states = optimizer.param_states() if callable(getattr(optimizer, "param_states", None)) else None
        for n in self._plain:
            p = self.named[n]
            st = states.get(id(p)) if states is not None else optimizer.state.get(p)
            if st:
                out[n] = {k: (_host(v) if _is_array(v) else v) for k, v in st.items()}
        for f in self.flats:
            st = optimizer.state.get(f) or _chunk_state(optimizer, f)
            names = self._flat_names(f)
            for k in sorted(st):
                vals = self._flat_values(f, st[k], sharded) if _is_array(st[k]) else dict.fromkeys(names, st[k])
                for n, v in vals.items():
                    out.setdefault(n, {})[k] = v
        return out

    def _optim(self, optimizer, convert) -> Dict[str, Any]:
        local = self._local_optim(optimizer, sharded=convert is not None)
        # the names with state, and their keys and scalars, agreed over the stages: every rank lists every one
        # (the checkpoint's rule), another stage's arrays as empty blocks
        keys = {n: {k: (None if _is_array(v) else v) for k, v in st.items()} for n, st in local.items()}
        staged = self.stage_group is not None and self.stage_group.size > 1
        if staged:
            for part in all_gather_object(keys, group=self.stage_group):
                for n, ks in part.items():
                    keys.setdefault(n, ks)
        state = OrderedDict()
        for n, p in self.named.items():
            if n not in keys:
                continue
            if n in local:
                state[n] = {k: (v if not _is_array(v) or convert is None else convert(n, v))
                            for k, v in local[n].items()}
            else:
                state[n] = {k: (self._empty(n, p.dtype) if v is None else v) for k, v in keys[n].items()}
        groups = []
        for g in optimizer.param_groups:
            opts = {k: v for k, v in g.items() if k != "params"}
            # one stage's names differ from another's: a pipeline's groups keep only the options
            groups.append(opts if staged else {**opts, "params": [n for q in g["params"] for n in self._names_of(q)]})
        return {"state": state, "param_groups": groups}

    def optim_state_dict(self, optimizer) -> Dict[str, Any]:
        """The optimizer's state under serial names, each moment as its parameter's block (sharded form):
        ``{"state": {name: {"step": 3, "exp_avg": ShardedArray, ...}}, "param_groups": [{..., "params": [names]}]}``."""
        return self._optim(optimizer, self._as_block)

    def full_optim_state_dict(self, optimizer) -> Dict[str, Any]:
        """The optimizer's state under serial names with full serial arrays, on every rank (collective)."""
        st = self._optim(optimizer, None)
        full = {n: {k: (np.asarray(placed.gather(v, self.placement(n))) if _is_array(v) else v) for k, v in d.items()}
                for n, d in st["state"].items() if n in self.owned}
        joined = self._join(full)
        st["state"] = OrderedDict((n, joined[n]) for n in self.named if n in joined)
        return st

    def load_optim_state_dict(self, optimizer, state_dict: Dict[str, Any]) -> None:
        """Load either optimizer form saved under any layout into ``optimizer`` (built on this rank's parameters
        or FSDP's flat ones; or a ZeRO-1 wrapper of them): each moment cut to its parameter's piece.  A plain
        optimizer's own ``state_dict()`` (torch's form, keyed by index) of one parameter group is read by the
        serial model's parameter order; of several groups it is refused (its indices name no parameter)."""
        state_dict = self._by_name(state_dict)
        saved = state_dict["state"]
        if len(state_dict["param_groups"]) != len(optimizer.param_groups):
            raise ValueError(f"rank {self.rank}: the saved optimizer has {len(state_dict['param_groups'])} parameter "
                             f"groups, this one {len(optimizer.param_groups)}: build it with the same groups")
        per: Dict[int, Dict[str, Any]] = {}
        for g in optimizer.param_groups:
            for q in g["params"]:
                names = self._names_of(q)
                sts = [saved.get(n) or {} for n in names]
                if not any(sts):
                    continue
                st = {}
                owner = getattr(q, "__dict__", {}).get("_local_owner")
                f = owner[0] if owner is not None and self._is_flat(owner[0]) else None
                if f is None and not self._is_flat(q) and names[0] not in self.owned:
                    continue            # another pipeline stage's (an optimizer built on the whole model)
                for k, v in next(s for s in sts if s).items():
                    if not (_is_array(v) or (k != "step" and hasattr(v, "shape"))):    # a 0-d moment is one
                        st[k] = v
                    elif f is not None:     # an original parameter inside an FSDP chunk: its piece of the chunk
                        fnames = self._flat_names(f)
                        out = np.zeros(f.data.shape, np.asarray(_host(getattr(v, "local", v))).dtype)
                        self._into_flat(f, [(saved.get(n) or {}).get(k, np.zeros(self.full_shape(n)))
                                            for n in fnames], out)
                        a, b = f._piece_bounds(owner[1])
                        st[k] = out[a:b]
                    elif self._is_flat(q):
                        out = np.zeros(q.data.shape, np.asarray(_host(getattr(v, "local", v))).dtype)
                        self._into_flat(q, [s.get(k, np.zeros(self.full_shape(n))) for n, s in zip(names, sts)], out)
                        st[k] = out
                    else:
                        st[k] = self.piece(names[0], v).reshape(q.data.shape)
                per[id(q)] = st
        if callable(getattr(optimizer, "load_param_states", None)):
            optimizer.load_param_states(per, state_dict["param_groups"])
        else:
            self._into_optimizer(optimizer, per, state_dict["param_groups"])

    def _by_name(self, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        """``state_dict`` under serial names: as it is when it is already, else a plain optimizer's index-keyed
        form (``optimizer.state_dict()``, saved by ``training_state`` of a plain model) mapped by the serial
        model's parameter order, which is its index order when it has one parameter group."""
        groups = state_dict.get("param_groups") or []
        indexed = [q for g in groups for q in (g.get("params") or []) if not isinstance(q, str)]
        if not indexed:
            return state_dict
        names = list(self.named)
        order = [int(q) for g in groups for q in g["params"]]
        if len(groups) != 1 or sorted(order) != list(range(len(names))):
            raise ValueError(
                f"rank {self.rank}: the optimizer state is a plain optimizer's state_dict() (keyed by index) with "
                f"{len(groups)} parameter group(s) of {len(order)} parameters; this model has {len(names)}, and "
                "indices of several groups name no parameter. Save it under serial names instead: "
                "ShardedState(model).optim_state_dict(optimizer) (or train under parallelize and save "
                "training_state(pm, opt)), or load it into the plain model")
        by_index = {str(k): v for k, v in state_dict["state"].items()}
        state = OrderedDict((names[i], by_index[str(i)]) for i in order if str(i) in by_index)
        return {"state": state, "param_groups": [{**groups[0], "params": [names[i] for i in order]}]}

    # -- checkpoint templates ---------------------------------------------------------------------
    def _zero_block(self, name: str, dtype):
        """A zero block of ``name`` in this layout's sharded form (a template entry for one moment)."""
        if name not in self.owned:
            return self._empty(name, dtype)
        q, pl = self.named[name], self.placement(name)
        for f in self.flats:
            if self._flat1d and any(q is x for x in f.params) and not self._cut(name):
                i = next(i for i, x in enumerate(f.params) if x is q)
                return f.layout.shard_blocks(f.segments(), np.zeros(f.data.shape, dtype))[i]
        return placed.block(np.zeros(placed.local_shape(pl), dtype), pl)

    def checkpoint_template(self, path: Optional[str] = None, group=None) -> Dict[str, Any]:
        """A ``checkpoint.load`` template for a :func:`~axonmpi.checkpoint.training_state` saved under any layout:
        the model entries as this layout's blocks (each rank reads only its pieces); with ``path`` (the
        checkpoint, to learn which parameters have optimizer state and its keys) the optimizer's moments as this
        layout's blocks too; the rest as saved.  Collective over ``group`` (default: the world).

        Example:
            >>> loaded = axonmpi.checkpoint.load(path, pm.sharded_state().checkpoint_template(path))
            >>> axonmpi.checkpoint.restore_training_state(loaded, pm, opt)
        """
        from ..distributed import broadcast_object, resolve_group
        optimizer: Dict[str, Any] = {}
        model = self.sharded_state_dict()
        if path is not None:
            g = resolve_group(group)
            if g.rank == 0:     # a checkpoint's path, or an in-memory copy (checkpoint.memory_load.MemoryCopy)
                keys = path.optimizer_keys() if hasattr(path, "optimizer_keys") else _optimizer_keys(path)
            keys = broadcast_object(keys if g.rank == 0 else None, group=g)
            if keys:
                state = OrderedDict()
                for n, p in self.named.items():
                    if n in keys:
                        state[n] = {k: (self._zero_block(n, p.dtype) if is_array else None)
                                    for k, is_array in keys[n].items()}
                optimizer = {"state": state, "param_groups": None}
        return {"model": model, "optimizer": optimizer, "scheduler": {}, "sampler": {}, "rng": None, "meta": {},
                "extra": {}}

    @staticmethod
    def _into_optimizer(optimizer, per: Dict[int, Dict[str, Any]], saved_groups) -> None:
        index, groups, i = {}, [], 0
        for g, sg in zip(optimizer.param_groups, saved_groups):
            ids = []
            for q in g["params"]:
                if id(q) in per:
                    index[i] = per[id(q)]
                ids.append(i)
                i += 1
            groups.append({**{k: v for k, v in sg.items() if k != "params"}, "params": ids})
        optimizer.load_state_dict({"state": index, "param_groups": groups})


def _chunk_state(optimizer, f) -> Dict[str, Any]:
    """The state of an optimizer built on the original parameters of the FSDP flat ``f`` ([Note: a parameter
    keeps its identity]) as one state of ``f``'s chunk: each original's moment in its piece of the chunk (zeros
    where it has none), the scalars (``step``) of the first original that has state."""
    out: Dict[str, Any] = {}
    for i, q in enumerate(f.params):
        st = optimizer.state.get(q)
        if not st:
            continue
        a, b = f._piece_bounds(i)
        for k, v in st.items():
            if _is_array(v):
                if k not in out:
                    out[k] = np.zeros(f.data.shape, _host(v).dtype)
                out[k][a:b] = _host(v)
            else:
                out.setdefault(k, v)
    return out


def _optimizer_keys(path: str) -> Dict[str, Dict[str, bool]]:
    """``{parameter name: {key: is an array}}`` of the optimizer state saved at ``path``."""
    from ..checkpoint import CheckpointReader
    keys: Dict[str, Dict[str, bool]] = {}
    reader = CheckpointReader(path, verify=False)
    for name in reader.names():
        parts = name.split("/")
        if len(parts) == 4 and parts[:2] == ["optimizer", "state"]:
            e = reader.entry(name)
            keys.setdefault(parts[2], {})[parts[3]] = e.kind == "array" and len(tuple(e.shape)) > 0
    return keys
