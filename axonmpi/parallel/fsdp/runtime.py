"""FullyShardedDataParallel: the wrapper and the per-step protocol (its groups: ``groups.py``; its state dicts:
``state.py``).

[Note: FSDP step]
Forward: the root unit (the parameters outside every child unit) is gathered, then the wrapped
model runs; each child unit's forward first gathers the unit (waiting for its prefetch), then
issues the non-blocking all-gather of the unit that ran next in the previous step (forward
prefetch), then computes. FULL_SHARD / HYBRID_SHARD child units free their parameters right
after and gather them again in backward (see the note in ``unit.py``); SHARD_GRAD_OP /
NO_SHARD units stay gathered until their gradients are complete. Backward: a unit is complete
when every parameter's gradient of this backward is final (post-accumulate-grad hooks; units
that recompute: when their backward returned); its reduce-scatter is launched at once,
non-blocking, and the unit is freed. When the last unit is complete, every reduction is waited on in launch
order and, with replicas (HYBRID_SHARD, NO_SHARD), all-reduced across them, so
``loss.backward()`` returns with each flat parameter's ``.grad`` holding this rank's chunk of
the gradient averaged over the global batch. Every rank issues the same collectives in the same
order because the order follows the model's (deterministic) execution.
"""
from __future__ import annotations

import enum
import mmap
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ...autograd import Tensor, is_grad_enabled, no_grad
from ...backend import device_of, get_array_module
from ...distributed import get_world
from ...distributed.placement import check_group
from ...nn import Module
from .._flat import FlatParameter
from .._flat import broadcast_flat
from ..grad_sync import GradReducer, no_sync
from .api import CPUOffload, MixedPrecision, ShardingStrategy
from .memory import MemoryForms
from .groups import resolve_groups
from .state import StateForms
from .unit import FSDPUnit
from .wrap import is_fsdp, plan_units, unwrapped_named_modules, unwrapped_state_items

__all__ = ["FullyShardedDataParallel", "FSDP"]


class _Phase(enum.Enum):
    """Where the root FSDP instance is in a step."""

    OUTSIDE = "outside"    # between steps (or after a forward without gradients)
    FORWARD = "forward"    # inside the root's forward: units may gather
    ARMED = "armed"        # forward ran with gradients; waiting for backward to start
    RUNNING = "running"    # backward started: units complete and launch their reductions


class FullyShardedDataParallel(StateForms, MemoryForms, Module):
    """Sharded data parallelism (ZeRO-2/3, PyTorch's FSDP): each rank keeps 1/N of the state.

    Each unit (by default every child block holding parameters; the root unit holds the rest)
    is packed into one :class:`~axonmpi.parallel.FlatParameter` and sharded over the shard
    group by the project's chunk rule. Build the optimizer on ``fsdp.parameters()`` (the flat
    shards): its state is sharded too. After ``loss.backward()``, each flat parameter's
    ``.grad`` is this rank's chunk of the gradient averaged over the global batch, so one
    optimizer step on N ranks equals one serial step on the N-times larger batch.

    FSDP instances inside ``module`` (``FSDP(Sequential(FSDP(block), head))``) are nested: this
    root adopts their units and runs them in its step; each keeps its own strategy, groups and
    CPU offload, and must span the same data ranks with the same ``mixed_precision``. Names
    (state dicts, checkpoints) are the unwrapped model's. Frozen parameters
    (``requires_grad=False`` when wrapping) stay whole on every rank, outside the flat
    parameters: no gradient, no optimizer state, no communication.

    Args:
        module: the model.
        group: the data-parallel group (default: the grid's ``data_group``); for HYBRID_SHARD
            also ``(shard_group, replicate_group)``.
        sharding_strategy: a :class:`ShardingStrategy` (or its name).
        cpu_offload: a :class:`CPUOffload` mode.
        mixed_precision: a :class:`MixedPrecision` (compute in ``param_dtype``, reduce in
            ``reduce_dtype``, fp32 master shards for the optimizer).
        auto_wrap_policy: which submodules are units: ``None`` (each child holding parameters,
            looking through containers), a set of module classes, a minimum parameter count,
            a callable ``(module) -> bool``, or PyTorch's ``(module, recurse, nonwrapped_numel)``
            callables (``functools.partial(size_based_auto_wrap_policy, min_num_params=N)``,
            ``transformer_auto_wrap_policy``, lambdas; see ``[Note: PyTorch policies here]``).
        prefetch: issue the next unit's all-gather, non-blocking, in forward and backward.
        sync_module_states: broadcast parameters and buffers from data rank 0 first.
        hybrid_shard_size: HYBRID_SHARD shard group size (default: the ranks of one node).
        device_id: PyTorch's: the device the module is moved to before sharding (an int is
            ``cuda:<int>``; ``"cpu"``, ``"cuda:1"``); None leaves it where it is.
        use_orig_params: PyTorch's ``False`` (``parameters()`` are the flat shards) is what this
            FSDP's ``parameters()`` give; ``True`` raises.  Its semantics are had from the wrapped model's own
            parameters: they keep their serial names and shapes, and an optimizer built on them (before or after
            wrapping, per-parameter groups included) steps their pieces of the flat chunks ([Note: a parameter
            keeps its identity] in ``nn/parameter.py``).
        record_events: keep ``fsdp.events``: ``(kind, unit)`` for gather / prefetch / free /
            forward_start / forward_end / reduce / backward_end (for overlap tests).

    Example:
        >>> model = FSDP(GPT(cfg), sharding_strategy=ShardingStrategy.FULL_SHARD)
        >>> opt = axonmpi.optim.AdamW(model.parameters(), lr=3e-4)
        >>> loss = model(x, y); loss.backward()
        >>> model.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()
    """

    _is_fsdp = True     # wrap.is_fsdp tells nested instances apart without importing this module

    def __init__(self, module: Module, *, group=None, sharding_strategy=ShardingStrategy.FULL_SHARD,
                 cpu_offload=CPUOffload.NONE, mixed_precision: Optional[MixedPrecision] = None,
                 auto_wrap_policy=None, prefetch: bool = True, sync_module_states: bool = True,
                 hybrid_shard_size: Optional[int] = None, record_events: bool = False,
                 device_id=None, use_orig_params: bool = False):
        super().__init__()
        self._check_args(module, device_id, use_orig_params)
        get_world()   # initialise the World (and its grid) before groups are resolved
        self.sharding_strategy = ShardingStrategy.coerce(sharding_strategy)
        self.cpu_offload = CPUOffload.coerce(cpu_offload)
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise TypeError(f"mixed_precision must be a MixedPrecision or None, got {type(mixed_precision).__name__}")
        self.mixed_precision = mixed_precision
        self.prefetch = bool(prefetch)
        self.module = module
        self._nested_in: Optional["FullyShardedDataParallel"] = None   # the root, once nested in one
        self._nested: List["FullyShardedDataParallel"] = []             # the instances nested directly here
        self._init_groups(module, group, hybrid_shard_size)
        self.events: Optional[List[Tuple[str, str]]] = [] if record_events else None
        plan = plan_units(module, auto_wrap_policy)
        nested, inner_params, params, buffers = self._own_states(module, plan)
        first = params[0][1] if params else next(nested[0][1].module.parameters())
        self._init_states(first, params, buffers, sync_module_states)
        self._build_units(module, plan, params, inner_params)
        self._set_unit_modes(first)
        self._init_step_state()
        self._register_hooks()

    # -- construction ---------------------------------------------------------------------------
    @staticmethod
    def _check_args(module: Module, device_id, use_orig_params: bool) -> None:
        """Refuse what cannot be wrapped; move the module to ``device_id`` (PyTorch's) when given."""
        if not isinstance(module, Module):
            raise TypeError(f"FullyShardedDataParallel wraps an axonmpi.nn.Module, got {type(module).__name__}")
        if use_orig_params:
            raise NotImplementedError(
                f"rank {get_world().rank}: FSDP(use_orig_params=True): this FSDP's parameters() are its flat "
                "shards (PyTorch's use_orig_params=False); leave use_orig_params out and build per-parameter "
                "groups (no-weight-decay biases) from the wrapped model's own parameters (module.named_parameters(): "
                "serial names and shapes), or the optimizer on fsdp.parameters()")
        if device_id is not None:
            if isinstance(device_id, bool) or not isinstance(device_id, (int, str)):
                raise TypeError(f"FSDP: device_id must be an int (a CUDA ordinal), a device string or None, got "
                                f"{device_id!r}")
            module.to(f"cuda:{device_id}" if isinstance(device_id, int) else device_id)
        if is_fsdp(module):
            raise ValueError("FSDP: the module is already an FSDP model; wrap it once (to nest, wrap a plain "
                             "module that holds FSDP instances: FSDP(Sequential(FSDP(block), head)))")

    def _init_groups(self, module: Module, group, hybrid_shard_size: Optional[int]) -> None:
        """The shard and replicate groups (checked against the parameters' placement) and the data
        ranks they span together."""
        self.shard_group, self.replicate_group = resolve_groups(group, self.sharding_strategy, hybrid_shard_size)
        rep = self.replicate_group
        named = list(module.named_parameters())
        for grp in (self.shard_group, rep):
            check_group(named, grp, "FSDP")
        spans = [self.shard_group.ranks] if rep is None else rep.comm.allgather(self.shard_group.ranks)
        self._data_ranks = tuple(sorted({r for rs in spans for r in rs}))      # shard x replicate

    def _own_states(self, module: Module, plan):
        """``(nested, inner_params, params, buffers)``: the FSDP instances nested in the unit plan
        (checked), id -> where of their parameters, and this instance's own parameters and buffers."""
        nested = [(q, m) for q, m, is_nested in plan if is_nested]
        for q, inner in nested:
            self._check_nestable(q, inner)
        inner_mods = {id(x) for _, inner in nested for x in inner.module.modules()}
        inner_params = {id(p): q for q, inner in nested for p in inner.module.parameters()}
        params, buffers = [], []           # this instance's own (outside every nested FSDP), unwrapped names
        seen = set()
        for pre, m in unwrapped_named_modules(module):
            if id(m) in inner_mods:
                continue
            for n, p in m.named_parameters(recurse=False):
                name = f"{pre}.{n}" if pre else n
                if p is not None and id(p) in inner_params:
                    raise ValueError(f"FSDP: parameter {name!r} is shared with the FSDP instance nested at "
                                     f"{inner_params[id(p)]!r}; a parameter must live in one unit (wrap the "
                                     "modules sharing it in the same FSDP instance)")
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    params.append((name, p))
            buffers += [((f"{pre}.{n}" if pre else n), b) for n, b in m.named_buffers(recurse=False)]
        if not params and not nested:
            raise ValueError("FSDP: the module has no parameters")
        return nested, inner_params, params, buffers

    def _init_states(self, first: Tensor, params, buffers, sync_module_states: bool) -> None:
        """The compute device and dtypes; parameters and buffers broadcast (``sync_module_states``);
        floating buffers cast to ``mixed_precision.buffer_dtype``."""
        self.compute_device = device_of(first.data)
        mp = self.mixed_precision
        self.param_dtype = None if mp is None or mp.param_dtype is None else mp.param_dtype
        self.reduce_dtype = None if mp is None else (mp.reduce_dtype or mp.param_dtype)
        if sync_module_states:      # shard group from its rank 0, then the replicas from shard group 0
            with no_grad():
                for g in (self.shard_group, self.replicate_group):
                    if g is not None and g.size > 1 and (params or buffers):
                        broadcast_flat([p for _, p in params] + [b for _, b in buffers], g)
        if mp is not None and mp.buffer_dtype is not None:
            for _, b in buffers:
                if b.data.dtype.kind == "f":
                    b.data = b.data.astype(mp.buffer_dtype)

    def _build_units(self, module: Module, plan, params, inner_params) -> None:
        """The root unit (the parameters outside every child unit, and the hoisted ones), one unit per
        planned child (its forward routed through the unit) and the units of nested instances."""
        self.units: List[FSDPUnit] = []
        self._frozen: List[Tuple[str, Tensor]] = []     # requires_grad=False: replicated, never reduced
        self._frozen_master: Dict[int, Any] = {}        # id(frozen param) -> its full-precision values (MP)
        self._unit_strategy: Dict[int, ShardingStrategy] = {}     # id(unit) -> its FSDP instance's strategy
        self._hooks = []
        owner: Dict[int, str] = {}
        inside = {id(p) for q, m, is_nested in plan if not is_nested for p in m.parameters()}
        self.hoisted = self._hoist_outside_uses(module, plan, inner_params)
        root_named = [(n, p) for n, p in params if id(p) not in inside or id(p) in self.hoisted]
        self.root_unit = self._make_unit("", module, root_named, owner, mode="keep")
        for qname, m, is_nested in plan:
            if is_nested:
                self.units += self._adopt(qname, m, owner)
                continue
            named = [(f"{qname}.{n}", p) for n, p in unwrapped_state_items(m, "params")
                     if id(p) not in inner_params and id(p) not in self.hoisted]
            unit = self._make_unit(qname, m, named, owner, mode="keep")
            unit._orig_forward = m.forward
            object.__setattr__(m, "forward", unit.call)
            self.units.append(unit)

    def _set_unit_modes(self, first: Tensor) -> None:
        """Each child unit's memory mode ([Note: FULL_SHARD unit boundary]): a FULL_SHARD / HYBRID_SHARD
        unit frees its parameters after forward ("remap" under NumPy where ``madvise`` can drop the pages,
        else "recompute"); the other units "keep" theirs gathered until their gradients are complete."""
        remap = (get_array_module(first.data) is np and hasattr(mmap, "MADV_DONTNEED")
                 and hasattr(mmap, "MAP_PRIVATE"))
        names = [u.name for u in self.units]
        for u in self.units:      # a unit holding other units (a nested FSDP's root) cannot recompute them
            strategy = self._unit_strategy[id(u)]
            full_shard = strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
            mode = (("remap" if remap else "recompute") if full_shard else "keep")
            if mode == "recompute" and any(n.startswith(u.name + ".") for n in names):
                mode = "keep"
            u.mode, u.recompute = mode, mode == "recompute"

    def _init_step_state(self) -> None:
        """The per-step state ([Note: FSDP step]): the unit orders, the phase, the launched reductions."""
        self._all_units = [self.root_unit] + self.units
        self._order: List[FSDPUnit] = list(self.units)     # forward order of the last step
        self._seq: List[FSDPUnit] = []                      # forward order of this step
        self._anchor = Tensor(np.zeros(()), requires_grad=True)
        self.enabled = True        # backwards reduce-scatter (False inside no_sync): the switch of grad_reducer
        self.defer_to_end = False  # count parameters ready at the end of the pass ([Note: DDP and activation checkpointing])
        # the no_sync switch, and what runs after the reduce-scatter (grad_sync, [Note: the reducer])
        self.grad_reducer = GradReducer("fsdp", parts=[self])
        self._phase = _Phase.OUTSIDE
        self._post_backward_hooks: List[Callable[[], None]] = []
        self._n_complete = 0
        self._launched: List[FSDPUnit] = []
        self._peak_gathered = 0

    def _register_hooks(self) -> None:
        """A post-accumulate-grad hook on each parameter of a unit that does not recompute (it tells the
        unit the parameter's gradient is final); every unit reset for the first step."""
        for u in self._all_units:
            if u.flat is not None and not u.recompute:
                for p in u.flat.params:
                    self._hooks.append(p.register_post_accumulate_grad_hook(u.on_param_ready))
        for u in self._all_units:
            u.reset()

    def _hoist_outside_uses(self, module: Module, plan, inner_params) -> Dict[int, Tuple[str, str]]:
        """The parameters read outside their unit (``F.linear(h, self.emb.weight)`` in the root's
        forward while ``emb`` is a unit of its own) or held by two units (a head tied to its embedding):
        id -> (name, where it is read).  They go to
        the root unit, gathered from forward to the end of backward, so the step is the serial
        one; one of a nested FSDP instance cannot move and is refused, naming it and both users.
        See :mod:`axonmpi.parallel.fsdp.shared`."""
        from .shared import find_outside_uses
        unit_of: Dict[int, str] = {}
        for q, m, is_nested in plan:
            if not is_nested:
                for p in m.parameters():
                    if id(p) not in inner_params:
                        unit_of.setdefault(id(p), q)
        nested_at = dict(inner_params)

        def owner_of(pid):
            if pid in nested_at:
                return None
            return unit_of.get(pid, "")

        hoisted: Dict[int, Tuple[str, str]] = {}
        for use in find_outside_uses(list(unwrapped_named_modules(module)), owner_of):
            pid = use.pid
            owner_mod = use.param.rsplit(".", 1)[0] if "." in use.param else ""
            reader = repr(use.user) if use.user else "the root module"
            if pid in nested_at:
                raise ValueError(
                    f"FSDP: parameter {use.param!r} (of module {owner_mod!r}, inside the FSDP instance nested at "
                    f"{nested_at[pid]!r}) is read outside that instance by {reader} at {use.where}; it is an "
                    "empty shard there. Fix: do not wrap that module in its own FSDP instance (let the outer "
                    "FSDP place it), or use the weight only inside its module's forward")
            if pid not in hoisted:
                hoisted[pid] = (use.param, f"{reader} at {use.where}")
        names = {id(p): n for n, p in module.named_parameters()}
        units: Dict[int, List[str]] = {}
        for q, m, is_nested in plan:          # a weight two units hold (an embedding tied to its head)
            if not is_nested:
                for pid in {id(x) for x in m.parameters()}:
                    units.setdefault(pid, []).append(q)
        for pid, qs in units.items():
            if len(qs) > 1 and pid not in hoisted and pid not in nested_at:
                hoisted[pid] = (names.get(pid, "?"), f"the units {qs} (one weight)")
        if hoisted:
            from ... import log as _log
            _log.get_logger("axonmpi.fsdp", rank0_only=True).info(
                "FSDP: %s read outside their unit or shared by units (%s): kept in the root unit, gathered for the "
                "whole step",
                ", ".join(repr(n) for n, _ in hoisted.values()),
                "; ".join(f"{n} by {w}" for n, w in hoisted.values()))
        return hoisted

    def _make_unit(self, name: str, module: Module, named, owner: Dict[int, str], *, mode: str) -> FSDPUnit:
        """One unit over ``named`` (unwrapped names): the trainable parameters flattened and sharded,
        the frozen ones (``requires_grad=False``) left in place, replicated, in ``self._frozen``."""
        for n, p in named:
            if not p.requires_grad:
                self._frozen.append((n, p))
                if self.param_dtype is not None and p.data.dtype.kind == "f" and p.data.dtype != self.param_dtype:
                    self._frozen_master[id(p)] = p.data        # compute in param_dtype, keep the master
                    p.data = p.data.astype(self.param_dtype)
        named = [(n, p) for n, p in named if p.requires_grad]
        for n, p in named:
            if id(p) in owner:
                raise ValueError(f"FSDP: parameter {n!r} is shared with {owner[id(p)]!r} in another unit; "
                                 "shared parameters must live in one unit (put the modules sharing it in "
                                 "the same unit, or in the root)")
            owner[id(p)] = n
        flat = None
        if named:
            prefix = f"{name}." if name else ""
            flat = FlatParameter([p for _, p in named], [n[len(prefix):] for n, _ in named])
            flat.shard(self.shard_group)
            if self.cpu_offload is not CPUOffload.NONE:
                flat.move_shard("cpu")
            flat.shard_group = self.shard_group if self.shard_group.size > 1 else None
            flat.fsdp_unit = name
        unit = FSDPUnit(name, module, flat, self, mode=mode)
        self._unit_strategy[id(unit)] = self.sharding_strategy
        return unit

    # -- nesting --------------------------------------------------------------------------------
    def _check_nestable(self, qname: str, inner: "FullyShardedDataParallel") -> None:
        """Raise unless ``inner`` (found at ``qname``) can run inside this root's step.

        Each nested instance keeps its own sharding strategy, groups and CPU offload (as in
        PyTorch); it must shard over the same data-parallel ranks and compute in the same precision.
        """
        rank = get_world().rank
        if inner._nested_in is not None:
            raise ValueError(f"rank {rank}: the FSDP instance at {qname!r} is already nested in another FSDP "
                             "model; an FSDP instance belongs to one root")
        if inner._data_ranks != self._data_ranks:
            raise ValueError(f"rank {rank}: the FSDP instance nested at {qname!r} spans the data-parallel "
                             f"ranks {list(inner._data_ranks)} but its root spans {list(self._data_ranks)}; "
                             "every nested instance must cover the root's data ranks (its own shard / "
                             "replicate split of them is fine)")
        if inner.mixed_precision != self.mixed_precision:
            raise NotImplementedError(
                f"rank {rank}: the FSDP instance nested at {qname!r} has "
                f"mixed_precision={inner.mixed_precision} but its root {self.mixed_precision}; per-instance "
                "precision is not built: pass the same mixed_precision to every FSDP(...) of the model")

    def _adopt(self, qname: str, inner: "FullyShardedDataParallel", owner: Dict[int, str]) -> List[FSDPUnit]:
        """Take over the units of the FSDP instance nested at ``qname``: this root now gathers, frees and
        reduces them in its step (renamed under ``qname``); calling ``inner`` runs its root unit."""
        for h in inner._hooks:            # re-registered by this root (unit modes may change)
            h.remove()
        inner._hooks = []
        units = []
        for u in inner._all_units:
            u.name = f"{qname}.{u.name}" if u.name else qname
            u.rt = self
            self._unit_strategy[id(u)] = inner._unit_strategy[id(u)]
            if u.flat is not None:
                u.flat.fsdp_unit = u.name
                for n, p in zip(self.param_names(u.flat), u.flat.params):
                    owner[id(p)] = n
            units.append(u)
        self._frozen += [(f"{qname}.{n}", p) for n, p in inner._frozen]
        self._frozen_master.update(inner._frozen_master)
        inner.root_unit._orig_forward = inner.module      # the wrapped module's __call__ (its hooks run)
        object.__setattr__(inner, "forward", inner.root_unit.call)
        stack = [inner]           # instances nested deeper were adopted by ``inner``: they now belong here
        while stack:
            f = stack.pop()
            object.__setattr__(f, "_nested_in", self)     # a back reference, not a submodule
            stack += f._nested
        self._nested.append(inner)
        return units

    def _check_root(self, what: str) -> None:
        if self._nested_in is not None:
            raise RuntimeError(f"FSDP.{what}: this FSDP instance is nested in another FSDP model, which runs "
                               f"its units; call {what} on the root (outermost) FSDP model")

    # -- events / memory bookkeeping ------------------------------------------------------------
    def _event(self, kind: str, unit: str) -> None:
        if self.events is not None:
            self.events.append((kind, unit))

    def _gathered_bytes(self) -> int:
        total = 0
        for u in self._all_units:
            f = u.flat
            if f is None:
                continue
            if f.full is not None:
                total += f.gathered_nbytes
            elif f._gather is not None:
                total += f.world_size * f.padded_size * np.dtype(self.param_dtype or f.data.dtype).itemsize
        return total

    def _note_gathered(self) -> None:
        self._peak_gathered = max(self._peak_gathered, self._gathered_bytes())

    # -- the step protocol ------------------------------------------------------------------------
    def _check_active(self, unit: FSDPUnit) -> None:
        if self._phase is not _Phase.FORWARD:
            raise RuntimeError(f"FSDP unit {unit.label} was called outside its FSDP wrapper's forward; "
                               "call the FSDP model, not the wrapped module")

    def _enter_forward(self, unit: FSDPUnit) -> int:
        self._seq.append(unit)
        return len(self._seq) - 1

    def _prefetch_after(self, pos: int) -> None:
        if self.prefetch and pos + 1 < len(self._order):
            self._order[pos + 1].prefetch()

    def _prefetch_before(self, pos: int) -> None:
        if self.prefetch and pos >= 1 and pos - 1 < len(self._seq):
            self._seq[pos - 1].prefetch()

    def _unit_complete(self, unit: FSDPUnit) -> None:
        if unit.complete:
            return
        unit.complete = True
        if self._phase is _Phase.ARMED:
            self._phase = _Phase.RUNNING
        if self.enabled:
            unit.launch_reduce()
            self._launched.append(unit)
            for u in self._launched:        # drive MPI progress of every reduction in flight
                if u.work is not None:
                    u.work.is_completed()
        unit.free()
        if all(u.complete for u in self._all_units):
            self._finish()

    def _finish(self) -> None:
        for u in self._launched:
            u.finish_reduce()
        self._launched = []
        for u in self._all_units:
            u.free()
        self._event("backward_end", "")
        self._phase = _Phase.OUTSIDE
        if self.enabled:
            self.grad_reducer.run()          # its after-backward entries: parallelize's tensor-parallel segments
            for fn in self._post_backward_hooks:
                fn()

    def register_post_backward_hook(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` at the end of every backward whose gradients were reduced (not under
        :meth:`no_sync`), after the sharded gradients are in place and ``grad_reducer`` ran its
        after-backward entries (``parallelize``'s reduction of tensor-parallel segments).

        Example:
            >>> fsdp.register_post_backward_hook(lambda: print("gradients ready"))
        """
        if not callable(fn):
            raise TypeError(f"register_post_backward_hook needs a callable, got {type(fn).__name__}")
        self._post_backward_hooks.append(fn)

    def _start_step(self) -> None:
        if self._phase is _Phase.RUNNING or self._launched:
            missing = [u.label for u in self._all_units if not u.complete]
            for u in self._launched:
                u.work.wait()
            self._launched = []
            for u in self._all_units:
                u.free()
                u.reset()
            self._phase = _Phase.OUTSIDE
            raise RuntimeError(f"FSDP: the previous backward did not finish: units {missing} got no complete "
                               "gradient (every parameter must take part in the loss)")
        for u in self._all_units:
            u.free()
            u.reset()
        if len(self._seq) == len(self.units):
            self._order = list(self._seq)
        self._seq = []

    def forward(self, *args, **kwargs):
        self._start_step()
        if self.param_dtype is not None:
            args = tuple(a.astype(self.param_dtype) if isinstance(a, Tensor) and a.dtype.kind == "f" else a
                         for a in args)
        self.root_unit.gather()
        if self.prefetch and self._order:
            self._order[0].prefetch()
        self._phase = _Phase.FORWARD
        try:
            out = self.module(*args, **kwargs)
        except (ValueError, IndexError, RuntimeError, TypeError) as e:
            self._note_empty_params(e)
            raise
        finally:
            self._phase = _Phase.OUTSIDE
        if is_grad_enabled():
            self._phase = _Phase.ARMED
        else:
            for u in self._all_units:
                u.free()
        return out

    def _note_empty_params(self, e: BaseException) -> None:
        """A shape error in forward while some units are resharded: say which parameters are empty
        shards now (a read the wrap-time scan of the source could not see: through a variable, a
        closure or another object)."""
        msg = str(e)
        if not any(t in msg for t in ("size 0", "(0,", "(0)", "0 is different")) or not hasattr(e, "add_note"):
            return
        empty = [(f"{u.name}.{n}" if u.name else n, u.name) for u in self._all_units if u.flat is not None
                 for n, p in zip(u.flat.names, u.flat.params) if p.data.size == 0]
        if empty:
            shown = ", ".join(f"{n!r} (unit {q!r})" for n, q in empty[:6]) + (" ..." if len(empty) > 6 else "")
            e.add_note(f"[axonmpi FSDP rank {get_world().rank}] parameters that are empty shards at this point "
                       f"(their unit is not gathered): {shown}. A parameter read outside its module's forward "
                       "(a tied head F.linear(h, self.emb.weight)) must be visible to FSDP's wrap-time scan of "
                       "forward (self.<module>.<param>) or live in the root unit / the same unit as its reader")

    # -- parameters ---------------------------------------------------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True):
        """The flat shards, named ``"<unit>._flat_param"`` (``"_flat_param"`` for the root unit)."""
        for u in self._all_units:
            if u.flat is not None:
                n = f"{u.name}._flat_param" if u.name else "_flat_param"
                yield (f"{prefix}.{n}" if prefix else n), u.flat

    def parameters(self, recurse: bool = True):
        """The sharded flat parameters (build the optimizer on these)."""
        for _, p in self.named_parameters():
            yield p

    def named_buffers(self, prefix: str = "", recurse: bool = True):
        """The wrapped model's buffers, under the unwrapped model's names (nested FSDP adds none)."""
        for n, b in unwrapped_state_items(self.module, "buffers"):
            yield (f"{prefix}.{n}" if prefix else n), b

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
        """Clip the gradients by their total norm over all shards (each element once, replicas once).

        Returns:
            The total norm before clipping (a float64 0-d array, the same on every rank).
        """
        self._check_root("clip_grad_norm_")
        from ...optim.clip import clip_grad_norm_
        return clip_grad_norm_(list(self.parameters()), max_norm, norm_type, error_if_nonfinite)

    def no_sync(self):
        """Backwards inside accumulate full gradients locally, without any reduce-scatter.

        The first backward outside reduces the accumulated sum once. The unsharded gradients of
        every unit stay alive meanwhile (as in PyTorch). :func:`axonmpi.parallel.no_sync` of this model.
        """
        self._check_root("no_sync")
        return no_sync(self)

    def extra_repr(self) -> str:
        return (f"sharding_strategy={self.sharding_strategy.name}, shard_group={self.shard_group.name}"
                f"(size={self.shard_group.size}), units={len(self._all_units)}, "
                f"cpu_offload={self.cpu_offload.name}")


FSDP = FullyShardedDataParallel
