"""FSDP's state dicts: the full (gathered) model state, the sharded state, the optimizer state, and loading each.

A mixin of :class:`~axonmpi.parallel.fsdp.FullyShardedDataParallel` (kept apart from the wrapper's step protocol in
``runtime.py``); every method is collective over the FSDP instance's groups.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Tuple

import numpy as np

from ...autograd import Tensor, no_grad
from ...backend import get_array_module, to_host
from ...distributed import get_world
from ...distributed.sharding import ShardedArray
from ...nn import IncompatibleKeys, Module, Parameter
from .._flat import FlatParameter
from .wrap import unwrapped_state_items

__all__: list = []   # private to the fsdp package


def _load_into(module: Module, state_dict, strict: bool):
    """``module.load_state_dict`` under the unwrapped names (nested FSDP instances add no key parts)."""
    own = OrderedDict(unwrapped_state_items(module))
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    bad = [f"{k}: checkpoint shape {tuple(np.shape(state_dict[k]))}, model shape {tuple(t.shape)}"
           for k, t in own.items() if k in state_dict and tuple(np.shape(state_dict[k])) != tuple(t.shape)]
    errors = ([f"missing keys: {missing}"] if strict and missing else []) + \
        ([f"unexpected keys: {unexpected}"] if strict and unexpected else []) + \
        ([f"shape mismatches: {'; '.join(bad)}"] if bad else [])
    if errors:
        raise RuntimeError(f"Error(s) in loading state_dict for FSDP({type(module).__name__}):\n  "
                           + "\n  ".join(errors))
    with no_grad():
        for k, t in own.items():
            if k in state_dict:
                v = state_dict[k]
                v = to_host(v.data if isinstance(v, Tensor) else v)
                t.data[...] = get_array_module(t.data).asarray(v).astype(t.data.dtype, copy=False)
    return IncompatibleKeys(missing, unexpected)


class StateForms:
    """The state-dict methods of :class:`~axonmpi.parallel.fsdp.FullyShardedDataParallel`."""

    def _gather_full(self) -> None:
        for u in self._all_units:
            if u.flat is not None:
                u.flat.reshard()
                u.flat.unshard()

    def state_dict(self):
        """The full model state, gathered (keys identical to the unwrapped module's); collective.

        Nested FSDP instances add nothing to the keys: ``FSDP(Sequential(FSDP(a), b))`` gives the
        keys of ``Sequential(a, b)``. Frozen parameters are included.
        """
        self._check_root("state_dict")
        self._gather_full()
        try:
            return OrderedDict((k, np.array(to_host(self._frozen_master.get(id(t), t.data)), copy=True))
                               for k, t in unwrapped_state_items(self.module))
        finally:
            for u in self._all_units:
                u.free()

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load a full state dict (as :meth:`state_dict` gives) or a :meth:`sharded_state_dict`."""
        self._check_root("load_state_dict")
        if any(isinstance(v, ShardedArray) for v in state_dict.values()):
            return self._load_sharded(state_dict, strict)
        self._gather_full()
        try:
            res = _load_into(self.module, state_dict, strict)
            for k, p in self._frozen:
                if k in state_dict and id(p) in self._frozen_master:   # exact values into the master too
                    v = state_dict[k]
                    self._set_replicated(p, to_host(v.data if isinstance(v, Tensor) else v))
            for u in self._all_units:
                f = u.flat
                if f is not None:
                    lo, hi = f.shard_range
                    f.data[...] = f.full[lo:hi]
        finally:
            for u in self._all_units:
                u.free()
        return res

    def sharded_state_dict(self) -> Dict[str, Any]:
        """Each original parameter's part held here as a ShardedArray of its flattened values.

        Keys are the unwrapped module's names; each value is a 1-D ``ShardedArray`` of global
        shape ``(numel,)`` whose block is the elements this rank's chunk holds (possibly
        empty). Nothing is gathered. Frozen parameters and buffers appear as plain (replicated)
        arrays of their own shape. Keys follow the :meth:`state_dict` order.
        """
        self._check_root("sharded_state_dict")
        out: Dict[str, Any] = {}
        for u in self._all_units:
            if u.flat is not None:
                for fn, (_, blk) in zip(self.param_names(u.flat), self._blocks(u.flat, u.flat.data)):
                    out[fn] = blk
        for k, p in self._frozen:
            out[k] = to_host(self._frozen_master.get(id(p), p.data)).copy()
        for k, b in self.named_buffers():
            out[k] = to_host(b.data).copy()
        order = [k for k, _ in unwrapped_state_items(self.module)]
        return {**{k: out[k] for k in order if k in out}, **out}

    def _set_replicated(self, t: Tensor, value) -> None:
        """Copy ``value`` into a frozen parameter (its full-precision master and compute copy) or buffer."""
        master = self._frozen_master.get(id(t))
        xp = get_array_module(t.data)
        if master is not None:
            master[...] = xp.asarray(value).astype(master.dtype, copy=False)
            value = master
        t.data[...] = xp.asarray(value).astype(t.data.dtype, copy=False)

    def _blocks(self, f: FlatParameter, arr) -> List[Tuple[str, ShardedArray]]:
        """Split a chunk-shaped array of ``f`` into one 1-D ShardedArray per original parameter."""
        return list(zip(f.names, f.layout.shard_blocks(f.segments(), arr)))

    def param_names(self, f: FlatParameter) -> List[str]:
        """The model's names of the parameters packed in ``f`` (its FSDP unit's prefix, then their names)."""
        prefix = f"{f.fsdp_unit}." if f.fsdp_unit else ""
        return [prefix + n for n in f.names]

    def optim_state_dict(self, optimizer) -> Dict[str, Any]:
        """The optimizer's state keyed by original parameter names, as 1-D ShardedArray blocks.

        ``{"state": {name: {"step": int, "exp_avg": ShardedArray, ...}}, "param_groups":
        [{options..., "params": [names]}]}``: PyTorch's full optimizer state dict with names for
        keys and each array flattened; nothing is gathered. Save it with
        :func:`axonmpi.checkpoint.save`; :meth:`load_optim_state_dict` reads it back at any
        world size. Frozen parameters have no optimizer state and do not appear.
        """
        self._check_root("optim_state_dict")
        state: Dict[str, Dict[str, Any]] = {}
        groups = []
        for g in optimizer.param_groups:
            names = []
            for f in g["params"]:
                if not isinstance(f, FlatParameter) or not hasattr(f, "fsdp_unit"):
                    raise ValueError("FSDP.optim_state_dict: the optimizer must be built on fsdp.parameters()")
                names += self.param_names(f)
                st = optimizer.state.get(f)
                if not st:
                    continue
                full_names = self.param_names(f)
                for key, v in st.items():
                    if hasattr(v, "shape") and getattr(v, "ndim", 0) > 0:
                        for (n, blk), fn in zip(self._blocks(f, v), full_names):
                            state.setdefault(fn, {})[key] = blk
                    else:
                        for fn in full_names:
                            state.setdefault(fn, {})[key] = v
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": names})
        return {"state": state, "param_groups": groups}

    def load_optim_state_dict(self, optimizer, state_dict: Dict[str, Any]) -> None:
        """Load an :meth:`optim_state_dict` (any world size) into ``optimizer`` (built on ``parameters()``)."""
        self._check_root("load_optim_state_dict")
        for g, sg in zip(optimizer.param_groups, state_dict["param_groups"]):
            g.update({k: v for k, v in sg.items() if k != "params"})
        saved = state_dict["state"]
        for g in optimizer.param_groups:
            for f in g["params"]:
                names = self.param_names(f)
                st: Dict[str, Any] = {}
                c = f.shard_range[1] - f.shard_range[0]
                for s in f.segments():
                    ps = saved.get(names[s.index])
                    if ps is None:
                        continue
                    for key, v in ps.items():
                        if isinstance(v, ShardedArray) or (hasattr(v, "shape") and getattr(v, "ndim", 0) > 0):
                            if isinstance(v, ShardedArray):
                                a, local = v.offsets[0], np.asarray(v.local).reshape(-1)
                            else:
                                a, local = 0, np.asarray(to_host(v)).reshape(-1)
                            if key not in st:
                                st[key] = get_array_module(f.data).zeros(c, dtype=f.data.dtype)
                            s.in_chunk(st[key])[...] = s.in_param(local, a)
                        else:
                            st[key] = int(v) if key == "step" else v
                if st:
                    optimizer.state[f] = st

    def _load_sharded(self, state_dict, strict: bool):
        missing, used = [], set()
        for u in self._all_units:
            f = u.flat
            if f is None:
                continue
            prefix = f"{u.name}." if u.name else ""
            for s in f.segments():
                key = prefix + f.names[s.index]
                v = state_dict.get(key)
                if v is None:
                    missing.append(key)
                    continue
                used.add(key)
                if not isinstance(v, ShardedArray) or v.shape != (f.layout.numels[s.index],):
                    raise ValueError(f"FSDP.load_state_dict: {key!r} must be a ShardedArray of shape "
                                     f"({f.layout.numels[s.index]},), got {v!r}")
                a, b = v.offsets[0], v.offsets[0] + v.local_shape[0]
                if s.param_start < a or s.param_stop > b:
                    raise ValueError(f"rank {get_world().rank}: {key!r} block [{a}, {b}) does not cover this "
                                     f"rank's elements [{s.param_start}, {s.param_stop})")
                s.in_chunk(f.data)[...] = s.in_param(np.asarray(v.local), a)
        for k, t in self._frozen + list(self.named_buffers()):
            if k not in state_dict:
                if isinstance(t, Parameter):
                    missing.append(k)
                continue
            v = state_dict[k]
            if isinstance(v, ShardedArray):
                if v.local_shape != v.shape:
                    raise ValueError(f"rank {get_world().rank}: FSDP.load_state_dict: {k!r} is replicated "
                                     f"here (frozen or a buffer); its ShardedArray block {v.local_shape} must "
                                     f"be the whole {v.shape} (load the checkpoint with this model's "
                                     "sharded_state_dict() as the template)")
                v = v.local
            v = np.asarray(to_host(v))
            if v.size != t.data.size:
                raise ValueError(f"FSDP.load_state_dict: {k!r} has {v.size} elements, the model "
                                 f"{t.data.size}")
            self._set_replicated(t, v.reshape(t.data.shape))
            used.add(k)
        if strict and missing:
            raise RuntimeError(f"FSDP.load_state_dict: missing keys {missing}")
        return None
