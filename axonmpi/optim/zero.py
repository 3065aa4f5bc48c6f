"""ZeroRedundancyOptimizer (ZeRO-1): each rank keeps and steps the optimizer state of 1/N of the parameters.

[Note: ZeRO-1 layout]
Per parameter group and dtype, the parameters are packed back to back into one flat buffer
(a :class:`~axonmpi.distributed.sharding.FlatLayout`) of ``n`` elements, allocated padded to
``k * S`` (``S = ceil(n / k)``), and every parameter's ``.data`` becomes a view of its slice of
the first ``n`` elements. Rank ``i`` owns elements ``chunk_bounds(n, k, i)`` (the project's one
uneven rule) as a private parameter of its own, on which the wrapped optimizer is built, so
its state covers only that chunk (``k`` the ranks holding the same elements: the group, or for a
parameter its placement splits over a subgroup of it, an expert over its expert group,
the expert's replica group inside it, the expert-data group; see :func:`_state_group`). ``step()`` copies the (already averaged, e.g. by DDP)
gradients of the chunk into the chunk's gradient, steps the wrapped optimizer, then
all-gathers every rank's updated chunk straight into the padded buffer (chunk ``i`` in slot
``i``) and compacts it in place: one collective per buffer, no per-parameter broadcast.

[Note: ZeRO-1 and None gradients]
torch's optimizers skip a parameter whose ``.grad`` is None (no update, no weight decay, no state
change) and count steps per parameter (Adam's ``step``).  A chunk here may hold several
parameters that the wrapped optimizer steps as one tensor, so each bucket counts the steps of
every parameter (the same on every rank: it depends on the ``None`` pattern only).  When all
parameters of a chunk have gradients and equal counts (the usual case) the chunk takes one
wrapped step.  Otherwise it takes one pass per distinct count among the parameters that have
a gradient: the pass sets the state's ``step`` to that count, and the data and per-element state
of the other segments are copied before and put back after.  SGD with momentum *and* dampening
starts a parameter's buffer at its first gradient, which a shared buffer cannot reproduce for a
parameter that joins late: that case raises.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np

from ..autograd import Tensor, no_grad
from ..backend import get_array_module, to_host
from ..distributed import all_gather, chunk_bounds, role_group
from ..distributed.sharding import FlatLayout, ShardedArray, compact_slots
from ..nn.parameter import Parameter
from .optimizer import Optimizer

__all__ = ["ZeroRedundancyOptimizer"]


def _moment(key: str, v: Any) -> bool:
    """Whether a per-parameter state entry is an array shaped like its parameter (a moment; 0-d for a 0-d
    parameter), not a scalar such as ``step``."""
    return key != "step" and hasattr(v, "shape")


class _Bucket:
    """One flat buffer: the parameters of one group and dtype, and this rank's chunk of them."""

    def __init__(self, group_index: int, params: List[Any], indices: List[int], grp, names: List[str]):
        self.group = grp                  # the ranks sharing this chunk's elements (None: this rank alone)
        self.group_index = group_index
        self.params = params
        self.indices = indices            # the parameters' global indices (state dict numbering)
        self.names = names
        first = params[0].data
        xp = get_array_module(first)
        self.layout = FlatLayout([p.data.shape for p in params])
        n, k, r = self.layout.numel, (1 if grp is None else grp.size), (0 if grp is None else grp.rank)
        self.n, self.k = n, k
        self.size = max(1, -(-n // k))
        self.lo, self.hi = chunk_bounds(n, k, r)
        self.buffer = xp.zeros(k * self.size, first.dtype)
        self.layout.pack([p.data for p in params], self.buffer)
        for p, v in zip(params, self.layout.views(self.buffer)):
            p.data = v
        self.send = xp.zeros(self.size, first.dtype)
        self.send[:self.hi - self.lo] = self.buffer[self.lo:self.hi]
        self.shard = Parameter(self.send[:self.hi - self.lo])
        self.segments = self.layout.segments(self.lo, self.hi, [str(i) for i in range(len(params))])
        self.counts = [0] * len(params)  # steps each parameter has taken (torch's per-parameter count)
        self.passes: List[Tuple[int, List[Any]]] = []  # (count, segments) still to step this step()

    def plan_passes(self, options: Dict[str, Any], rank: int) -> None:
        """Group this chunk's segments with a gradient by their parameter's step count (see the Note)."""
        has = [p.grad is not None for p in self.params]
        if options.get("momentum", 0) and options.get("dampening", 0) and any(self.counts):
            late = [i for i, (h, c) in enumerate(zip(has, self.counts)) if h and c == 0]
            if late:
                raise RuntimeError(
                    f"rank {rank}: ZeroRedundancyOptimizer: parameter {self.indices[late[0]]} gets its first "
                    f"gradient after others of its group stepped; SGD with momentum and dampening="
                    f"{options['dampening']} would start its buffer differently from the wrapped optimizer; "
                    "put it in its own param group, or use dampening=0")
        by_count: Dict[int, List[Any]] = {}
        for s in self.segments:
            if has[s.index]:
                by_count.setdefault(self.counts[s.index], []).append(s)
        self.passes = sorted(by_count.items(), key=lambda kv: kv[0])
        for i, h in enumerate(has):
            self.counts[i] += h

    def gather_grad(self, optim) -> Optional[List[Any]]:
        """Load the next pass's gradient into the chunk; returns what to put back after the step."""
        if not self.passes:
            self.shard.grad = None
            return None
        count, active = self.passes.pop(0)
        xp = get_array_module(self.send)
        g = xp.zeros(self.hi - self.lo, self.send.dtype)
        for s in active:
            pg = self.params[s.index].grad
            g[s.offset:s.offset + s.param_stop - s.param_start] = pg.data.reshape(-1)[s.param_start:s.param_stop]
        self.shard.grad = Tensor(g)
        st = optim.state.get(self.shard)
        if st is not None and "step" in st:
            st["step"] = count
        if len(active) == len(self.segments):
            return None
        held = []
        on = {s.index for s in active}
        for s in self.segments:
            if s.index not in on:
                a, n = s.offset, s.param_stop - s.param_start
                arrays = {k: v[a:a + n].copy() for k, v in (st or {}).items() if getattr(v, "ndim", 0) > 0}
                held.append((a, n, self.shard.data[a:a + n].copy(), arrays))
        return held

    def put_back(self, optim, held) -> None:
        """Undo the wrapped step on the held segments: as torch, they were not stepped."""
        st = optim.state.get(self.shard, {})
        for a, n, data, arrays in held:
            self.shard.data[a:a + n] = data
            for k, v in st.items():
                if getattr(v, "ndim", 0) > 0:
                    v[a:a + n] = arrays[k] if k in arrays else 0  # state made by this step starts at 0
        if "step" in st:
            st["step"] = max(self.counts[s.index] for s in self.segments)

    def refresh(self) -> None:
        """The chunk from the parameters' current values (a load or a user may have written them since the
        last step: the shard is the optimizer's own copy)."""
        self.shard.data[...] = self.buffer[self.lo:self.hi]

    def all_gather_params(self) -> None:
        if self.shard.data is not self.send[:self.hi - self.lo] and self.shard.data.base is not self.send:
            self.send[:self.hi - self.lo] = self.shard.data
        self.gather(self.send, self.buffer)

    def gather(self, send, out) -> Any:
        """Every rank's ``send`` (``self.size`` elements) into ``out``, compacted to the ``n`` elements."""
        if self.group is None:
            out[:self.n] = send[:self.n]
            return out
        all_gather(send, group=self.group, out=out)
        compact_slots(out, self.n, self.k, self.size)
        return out


def _state_group(param: Any, group: Any) -> Any:
    """The ranks of ``group`` holding the same elements of ``param``, over which its state is split: ``group``;
    or, for a parameter its placement splits over a subgroup of the grid's data ranks inside ``group`` (an expert
    over its expert group, carved from data), its largest replica group inside ``group`` (the expert-data group),
    ``None`` when no other rank of ``group`` holds its elements (this rank steps them alone).  Any other parameter
    split inside ``group`` (a tensor-parallel shard) is refused later."""
    from ..distributed.placement import ShardKind, placement_of
    mine = set(group.ranks)
    data = _data_ranks(group)
    pl = placement_of(param)
    if not any(s.kind is ShardKind.DIM and s.group.size > 1 and set(s.group.ranks) <= mine
               and set(s.group.ranks) <= data for s in pl.shards):
        return group
    inside = [g for g in pl.replica_groups if set(g.ranks) <= mine]
    return max(inside, key=lambda g: g.size) if inside else None


def _data_ranks(group: Any) -> set:
    """The ranks of this rank's data (x context) group of the current grid (``group``'s when there is none)."""
    from ..distributed import get_world, is_initialized
    if is_initialized() and get_world().grid is not None:
        return set(get_world().grid.group_for("data_context").ranks)
    return set(group.ranks)


class ZeroRedundancyOptimizer(Optimizer):
    """Wrap an optimizer so each rank keeps the state of, and updates, only its 1/N of the parameters.

    Use it with replicated parameters whose gradients are already averaged (e.g. under
    :class:`~axonmpi.parallel.DistributedDataParallel`): after ``step()`` every rank holds the
    same updated parameters, as if the wrapped optimizer had stepped them all, while the
    optimizer state per rank is about 1/N.

    Args:
        params: parameters, or parameter-group dicts (per-group options as usual).
        optimizer_class: the optimizer to wrap (``axonmpi.optim.AdamW`` ...).
        group: the process group sharing the state (default: the grid's data group).
        **defaults: the wrapped optimizer's options (``lr=...``).

    Example:
        >>> model = DDP(net)
        >>> opt = ZeroRedundancyOptimizer(model.parameters(), axonmpi.optim.AdamW, lr=1e-3)
        >>> loss.backward(); opt.step()
    """

    def __init__(self, params: Iterable[Any], optimizer_class, *, group=None, **defaults):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(f"ZeroRedundancyOptimizer: optimizer_class must be an Optimizer subclass, "
                            f"got {optimizer_class!r}")
        self.process_group = role_group("data", group)
        groups = list(params)
        if not groups:
            raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
        from ..distributed.placement import check_group
        flat = [q for g in groups for q in ((g["params"] if not isinstance(g["params"], Tensor) else [g["params"]])
                                            if isinstance(g, dict) else [g])]
        held = [i for i, q in enumerate(flat) if "_local_owner" in getattr(q, "__dict__", {})]
        if held:        # an FSDP original: its storage is a piece of a flat chunk FSDP already shards
            raise ValueError(f"ZeroRedundancyOptimizer (rank {self.process_group.rank}): parameters {held[:6]} are "
                             "held in FSDP flat chunks, whose optimizer state FSDP already shards; build a plain "
                             "optimizer on pm.parameters() (each steps its piece of the chunk), or this one on "
                             "pm.flat_parameters()")
        owners = {id(q): _state_group(q, self.process_group) for q in flat}
        check_group([(f"#{i} (shape {tuple(q.shape)})", q) for i, q in enumerate(flat)
                     if owners[id(q)] is self.process_group], self.process_group, "ZeroRedundancyOptimizer")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.buckets: List[_Bucket] = []
        inner_groups = []
        index = 0
        for gi, g in enumerate(groups):
            ps = g["params"]
            ps = [ps] if isinstance(ps, Tensor) else list(ps)
            by_dtype: Dict[Any, List[Tuple[int, Any]]] = {}
            for p in ps:        # one bucket per dtype, device and partitioning group (the same order on every rank)
                grp = owners[id(p)]
                key = (str(p.data.dtype), str(p.device), None if grp is None else tuple(grp.ranks))
                by_dtype.setdefault(key, []).append((index, p))
                index += 1
            for items in by_dtype.values():
                b = _Bucket(gi, [p for _, p in items], [i for i, _ in items], owners[id(items[0][1])],
                            [str(i) for i, _ in items])
                self.buckets.append(b)
                inner_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": [b.shard]})
        self.optim = optimizer_class(inner_groups, **defaults)
        self.optimizer_class = optimizer_class
        super().__init__(groups, self.optim.defaults)
        self._consolidated: Optional[Dict[str, Any]] = None

    def _validate(self, options: Dict[str, Any]) -> None:
        if hasattr(self, "optim"):
            self.optim._validate(options)

    def _sync_options(self) -> None:
        for b, ig in zip(self.buckets, self.optim.param_groups):
            for k, v in self.param_groups[b.group_index].items():
                if k != "params":
                    ig[k] = v

    def _check_live(self, rank: int) -> None:
        """Raise naming the fix when a parameter was replaced or re-laid out since this optimizer was built (an
        optimizer built before ``parallelize``): its step would update arrays the model no longer reads."""
        for g in self.param_groups:       # a parameter a layout replaced (built before parallelize): say so
            for p in g["params"]:
                d = getattr(p, "__dict__", {})
                why = d.get("_replaced") or d.get("_other_stage")
                if why is not None:
                    raise RuntimeError(f"ZeroRedundancyOptimizer (rank {rank}): {why}")
        for b in self.buckets:
            for i, (p, shape) in enumerate(zip(b.params, b.layout.shapes)):
                if tuple(p.data.shape) != tuple(shape):
                    raise RuntimeError(
                        f"ZeroRedundancyOptimizer (rank {rank}): parameter {b.indices[i]} holds an array of shape "
                        f"{tuple(p.data.shape)}, {tuple(shape)} when this optimizer was built: a layout changed its "
                        "storage since (an optimizer built before the model was laid out): build the optimizer "
                        "from pm.parameters() after parallelize")

    def step(self, closure=None):
        """Step this rank's chunk with the wrapped optimizer, then all-gather the updated parameters."""
        loss = None
        if closure is not None:
            from ..autograd.grad_mode import enable_grad
            with enable_grad():
                loss = closure()
        rank = self.process_group.world.rank
        self._check_live(rank)
        self._sync_options()
        for b, options in zip(self.buckets, self.optim.param_groups):
            b.refresh()
            b.plan_passes(options, rank)
        while any(b.passes for b in self.buckets):  # one pass unless a chunk mixes None/counts
            held = [b.gather_grad(self.optim) for b in self.buckets]
            self.optim.step()
            for b, h in zip(self.buckets, held):
                if h is not None:
                    b.put_back(self.optim, h)
        for b in self.buckets:
            b.shard.grad = None
        with no_grad():
            for b in self.buckets:
                b.all_gather_params()
        return loss

    # -- state dicts ---------------------------------------------------------------------------
    def local_state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state dict of this rank's chunks (not consolidated)."""
        return self.optim.state_dict()

    def _full_state(self) -> Dict[int, Dict[str, Any]]:
        out: Dict[int, Dict[str, Any]] = {}
        for b in self.buckets:
            st = self.optim.state.get(b.shard, {})
            keys = sorted(st)
            for key in keys:
                v = st[key]
                if hasattr(v, "shape") and getattr(v, "ndim", 0) > 0:
                    xp = get_array_module(v)
                    send = xp.zeros(b.size, v.dtype)
                    send[:v.shape[0]] = v
                    full = b.gather(send, xp.zeros(b.k * b.size, v.dtype))
                    for i, piece in zip(b.indices, b.layout.views(full)):
                        out.setdefault(i, {})[key] = to_host(piece).copy()
                else:
                    for i in b.indices:
                        out.setdefault(i, {})[key] = v
        return out

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full optimizer state (PyTorch's per-parameter format) onto group rank ``to``.

        Collective over the group. Afterwards :meth:`state_dict` on rank ``to`` returns it.
        """
        full = self._full_state()
        groups = []
        for g in self.param_groups:
            ids = [i for b in self.buckets if self.param_groups[b.group_index] is g for i in b.indices]
            groups.append({**copy.deepcopy({k: v for k, v in g.items() if k != "params"}), "params": sorted(ids)})
        self._consolidated = {"state": full, "param_groups": groups} if self.process_group.rank == to else None

    def state_dict(self) -> Dict[str, Any]:
        """The consolidated state (after :meth:`consolidate_state_dict` on this rank)."""
        if self._consolidated is None:
            raise RuntimeError(f"rank {self.process_group.world.rank}: ZeroRedundancyOptimizer.state_dict() needs "
                               "consolidate_state_dict(to=this rank) first (or use sharded_state_dict())")
        return self._consolidated

    def sharded_state_dict(self) -> Dict[str, Any]:
        """Per parameter index, its state arrays as 1-D ShardedArray blocks of the flattened state.

        No gathering; for :func:`axonmpi.checkpoint.save`. ``{"state": {index: {key: ...}},
        "param_groups": [...]}`` as the full format, each array flattened.
        """
        state: Dict[int, Dict[str, Any]] = {}
        for b in self.buckets:
            st = self.optim.state.get(b.shard, {})
            for key, v in st.items():
                if hasattr(v, "shape") and getattr(v, "ndim", 0) > 0:
                    for i, blk in zip(b.indices, b.layout.shard_blocks(b.segments, v)):
                        state.setdefault(i, {})[key] = blk
                else:
                    for i in b.indices:
                        state.setdefault(i, {})[key] = v
        groups = []
        for gi, g in enumerate(self.param_groups):
            ids = sorted(i for b in self.buckets if b.group_index == gi for i in b.indices)
            groups.append({**copy.deepcopy({k: v for k, v in g.items() if k != "params"}), "params": ids})
        return {"state": state, "param_groups": groups}

    def param_states(self) -> Dict[int, Dict[str, Any]]:
        """``{id(parameter): {key: array shaped like the parameter, or scalar}}``: each parameter's state as the
        wrapped optimizer would hold it for that parameter alone (its moments gathered over the bucket's group;
        ``step``: its own count), for the parameters that have taken a step.  Collective over the groups; what
        ``ShardedState`` saves under serial names, as for a plain optimizer.

        Example:
            >>> st = opt.param_states()[id(model.fc.weight)]; st["exp_avg"].shape == model.fc.weight.shape
            True
        """
        out: Dict[int, Dict[str, Any]] = {}
        for b in self.buckets:
            st = self.optim.state.get(b.shard, {})
            stepped = [i for i, n in enumerate(b.counts) if n > 0]
            for key in sorted(st):
                v = st[key]
                if hasattr(v, "shape") and getattr(v, "ndim", 0) > 0:
                    xp = get_array_module(v)
                    send = xp.zeros(b.size, v.dtype)
                    send[:v.shape[0]] = v
                    views = b.layout.views(b.gather(send, xp.zeros(b.k * b.size, v.dtype)))
                    for i in stepped:
                        out.setdefault(id(b.params[i]), {})[key] = to_host(views[i]).copy()
                else:
                    for i in stepped:
                        out.setdefault(id(b.params[i]), {})[key] = b.counts[i] if key == "step" else v
        return out

    def load_param_states(self, states: Dict[int, Dict[str, Any]], param_groups=None) -> None:
        """Load :meth:`param_states`' form (``{id(parameter): {key: array shaped like it, or scalar}}``, e.g. read
        under another layout): each rank keeps its chunk; ``param_groups``: saved options to restore."""
        self._check_live(self.process_group.world.rank)
        if param_groups is not None:
            for g, sg in zip(self.param_groups, param_groups):
                g.update({k: copy.deepcopy(v) for k, v in sg.items() if k != "params"})
        for b in self.buckets:
            st: Dict[str, Any] = {}
            xp = get_array_module(b.send)
            for i, p in enumerate(b.params):
                ps = states.get(id(p))
                b.counts[i] = int(ps.get("step", 0)) if ps else 0
            arrays = sorted({k for p in b.params for k, v in (states.get(id(p)) or {}).items() if _moment(k, v)})
            for key in arrays if any(b.counts) else ():
                st[key] = xp.zeros(b.hi - b.lo, dtype=b.shard.data.dtype)
            for s in b.segments:
                ps = states.get(id(b.params[s.index]))
                for key, v in (ps or {}).items():
                    if _moment(key, v):          # a 0-d parameter's moment is one element of the chunk
                        if key not in st:
                            st[key] = xp.zeros(b.hi - b.lo, dtype=b.shard.data.dtype)
                        s.in_chunk(st[key])[...] = xp.asarray(np.asarray(v).reshape(-1)[s.param_start:s.param_stop])
                    elif key != "step":
                        st[key] = v
            if st or any(b.counts):
                if any(b.counts):
                    st["step"] = max(b.counts)
                self.optim.state[b.shard] = st
        self._sync_options()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a full (consolidated, any world size) or sharded state dict; every rank keeps its chunk."""
        xp_state = state_dict["state"]
        for g, sg in zip(self.param_groups, state_dict["param_groups"]):
            g.update({k: copy.deepcopy(v) for k, v in sg.items() if k != "params"})
        for b in self.buckets:
            st: Dict[str, Any] = {}
            for s in b.segments:
                ps = xp_state.get(b.indices[s.index], xp_state.get(str(b.indices[s.index])))
                if ps is None:
                    continue
                for key, v in ps.items():
                    if isinstance(v, ShardedArray):
                        a = v.offsets[0]
                        piece = np.asarray(v.local).reshape(-1)[s.param_start - a:s.param_stop - a]
                    elif hasattr(v, "shape") and getattr(v, "ndim", 0) > 0:
                        piece = np.asarray(to_host(v)).reshape(-1)[s.param_start:s.param_stop]
                    else:
                        st[key] = int(v) if key == "step" else v
                        continue
                    if key not in st:
                        xp = get_array_module(b.send)
                        st[key] = xp.zeros(b.hi - b.lo, dtype=self.optim.state.get(b.shard, {}).get(
                            key, b.shard.data).dtype if b.shard in self.optim.state else b.shard.data.dtype)
                    n = s.param_stop - s.param_start
                    st[key][s.offset:s.offset + n] = piece
            if st:
                self.optim.state[b.shard] = st
        self._sync_options()

    def __repr__(self) -> str:
        return (f"ZeroRedundancyOptimizer({self.optimizer_class.__name__}, group={self.process_group.name}"
                f"(size={self.process_group.size}), buckets={len(self.buckets)})")
