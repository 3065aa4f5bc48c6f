"""``parallelize``: data parallel, tensor parallel (Megatron 1-D or AxoNN 3-D) and FSDP on any model built from the library's layers.

The layers are swapped in place of the model's ``nn.Linear`` (and ``nn.Embedding``) with the
serial weights cut into shards; every parameter carries its :class:`~axonmpi.distributed.Placement`,
so gradient sync (:mod:`axonmpi.parallel.grad_sync`), clipping, state dicts and checkpoints need
no per-model rule.  See ``docs/parallelize.md``.
"""
from __future__ import annotations

import fnmatch
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from ..autograd.tensor import Tensor
from ..distributed import get_grid
from ..distributed.grid import ProcessGrid
from ..nn import layers as nn_layers
from ..nn.module import Module
from .grad_sync import finish_axonn_fsdp, reduce_gradient, reduction_groups
from .swap import module_slots as _children

__all__ = ["ParallelModule", "parallelize", "full_state_dict"]

_STYLES = ("column", "row", "vocab")
_DATA = ("ddp", "fsdp", None)


def _raw(a):
    return a.data if isinstance(a, Tensor) else a


def _swap(parent: Module, name: str, new: Module) -> None:
    setattr(parent, name, new)


def _copy_serial(new: Module, old: Module) -> None:
    """Load the serial layer's weights into its tensor-parallel replacement (each rank keeps its shard)."""
    from .tensor.state import load_full_state_dict
    load_full_state_dict(new, {k: np.asarray(v) for k, v in old.state_dict().items()})


def _axonn(module: Module, grid: ProcessGrid) -> int:
    """Every ``nn.Linear`` whose sizes divide over the grid (AxoNN's rule, ``is_parallelizable_linear``)
    -> a 3-D ``intra_layer.Linear`` over the grid (easy mode); the others stay replicated, and so does a
    Linear whose weight another module shares (a head tied to the embedding: one Parameter, so its
    gradient keeps both uses). Returns how many."""
    from .auto_parallelize import is_parallelizable_linear
    from .intra_layer import Linear as Linear3D
    from .tensor.groups import TensorParallelGroups
    groups = TensorParallelGroups.from_grid(grid)
    users: Dict[int, int] = {}       # parameter -> modules holding it: a tied weight (GPT-2's head) stays whole
    for m in module.modules():
        for q in m._parameters.values():
            if q is not None:
                users[id(q)] = users.get(id(q), 0) + 1
    n = 0
    for parent, name, child, _ in _children(module):
        if (type(child) is nn_layers.Linear and users.get(id(child.weight), 0) == 1
                and is_parallelizable_linear(child.in_features, child.out_features, groups.sizes)):
            new = Linear3D(child.in_features, child.out_features, bias=child.bias is not None,
                           dtype=child.weight.dtype, groups=groups)
            _copy_serial(new, child)
            _swap(parent, name, new)
            n += 1
    return n


def _megatron(module: Module, grid: ProcessGrid, plan: Dict[str, str], sp: Optional[int] = None) -> int:
    """The modules ``plan`` names -> Megatron column / row / vocab-parallel layers over the grid's tensor group
    (``sp``: the sequence dimension under sequence parallelism, else ``None``)."""
    from .tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    for pattern, style in plan.items():
        if style not in _STYLES:
            raise ValueError(f"rank {grid.rank}: tensor_parallel[{pattern!r}] = {style!r}; expected one of {_STYLES}")
    group = grid.intra_group
    n = 0
    for parent, name, child, qname in _children(module):
        style = next((s for pat, s in plan.items() if fnmatch.fnmatchcase(qname, pat)), None)
        if style is None:
            continue
        if style in ("column", "row") and type(child) is not nn_layers.Linear:
            raise TypeError(f"rank {grid.rank}: {qname!r} matches a {style!r} pattern but is a "
                            f"{type(child).__name__}, not an nn.Linear")
        if style == "vocab" and type(child) is not nn_layers.Embedding:
            raise TypeError(f"rank {grid.rank}: {qname!r} matches a 'vocab' pattern but is a "
                            f"{type(child).__name__}, not an nn.Embedding")
        seq = {} if sp is None else {"sequence_parallel": True, "sequence_dim": sp}
        if style == "vocab" and sp is not None:
            raise NotImplementedError(f"rank {grid.rank}: a 'vocab' layer under sequence_parallel is not built yet")
        if style == "column":
            new = ColumnParallelLinear(child.in_features, child.out_features, bias=child.bias is not None,
                                       gather_output=False, group=group, dtype=child.weight.dtype, **seq)
        elif style == "row":
            new = RowParallelLinear(child.in_features, child.out_features, bias=child.bias is not None,
                                    input_is_parallel=True, group=group, dtype=child.weight.dtype, **seq)
        else:
            new = VocabParallelEmbedding(child.num_embeddings, child.embedding_dim, group=group,
                                         dtype=child.weight.dtype)
        _copy_serial(new, child)
        _swap(parent, name, new)
        n += 1
    return n


def _sequence_parallel(module: Module, grid: ProcessGrid) -> List[Any]:
    """Sequence parallelism outside the plan's layers: every ``nn.LayerNorm`` -> a
    :class:`~axonmpi.parallel.tensor.SequenceParallelLayerNorm`; every other replicated parameter (used on
    sequence shards too) is tagged ``sequence_parallel`` and returned, for a hook that sums its gradient
    over the tensor group."""
    from ..distributed.placement import placement_of
    from .tensor import SequenceParallelLayerNorm
    from .tensor.layers import _tag_sequence_parallel
    g = grid.intra_group
    for parent, name, child, _ in _children(module):
        if type(child) is nn_layers.LayerNorm:
            new = SequenceParallelLayerNorm(child.normalized_shape, child.eps, child.elementwise_affine,
                                            bias=child.bias is not None, group=g,
                                            dtype=None if child.weight is None else child.weight.dtype)
            _copy_serial(new, child)
            _swap(parent, name, new)
    rest = []
    for p in module.parameters():
        if placement_of(p).is_replicated and not getattr(p, "sequence_parallel", False):
            _tag_sequence_parallel(p, g)
            rest.append(p)
    return rest


class ParallelModule(Module):
    """A model under :func:`parallelize`: forward as the serial model on this rank's rows.

    Attributes:
        module: the model with its tensor-parallel layers (wrapped in DDP or FSDP when asked).
        grid: the :class:`~axonmpi.distributed.ProcessGrid` it is laid out on.
        batch_shards: ``(number of batch shards, this rank's shard)``: the data replicas, times
            the tensor block's ranks in AxoNN's easy mode.
    """

    def __init__(self, module: Module, grid: ProcessGrid, tensor_parallel, data_parallel, wrapped: Module,
                 inner: Module):
        super().__init__()
        self.module = wrapped
        self._inner = [inner]            # the unwrapped model (not a submodule: no duplicate names)
        self.grid = grid
        self.tensor_parallel = tensor_parallel
        self.data_parallel = data_parallel
        axonn = tensor_parallel == "axonn"
        n = grid.G_data * (grid.G_intra if axonn else 1)
        k = grid.coords.data * (grid.G_intra if axonn else 1) + (grid.intra_group.rank if axonn else 0)
        self.batch_shards = (n, k)
        self._serial_shapes: Dict[str, Tuple[int, ...]] = {}
        self._hooks = []
        # what a Pipeline over this stage reads to reduce it (the grad_sync table's batch groups)
        self.batch_groups = (grid.intra_group,) if axonn else ()
        self.depth_group = grid.depth_group
        if axonn and data_parallel != "fsdp" and grid.G_inter == 1:
            self._hook_axonn(data_parallel is not None)
        self.sequence_dim: Optional[int] = None     # set by parallelize(sequence_parallel=True)

    @property
    def inner(self) -> Module:
        """The model with its tensor-parallel layers (not wrapped by DDP/FSDP)."""
        return self._inner[0]

    def _hook_axonn(self, over_data: bool) -> None:
        """AxoNN easy mode: after each parameter's gradient of a backward is complete, sum it over the
        groups of the table (:func:`~axonmpi.parallel.grad_sync.reduction_groups`) and divide by the
        number of batch shards (every rank's loss is the mean over its own rows)."""
        g = self.grid
        data = g.data_group if over_data else None
        scale = 1.0 / self.batch_shards[0]

        def reduce(p):
            reduce_gradient(p.grad.data, reduction_groups(p, data, (g.intra_group,), g.depth_group), scale)

        for p in self.inner.parameters():
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(reduce))

    def _hook_experts(self, params) -> None:
        """Expert parameters: reduced over their expert-data group (the grad-sync table), divided by ``G_data``."""
        from .moe import hook_expert_gradients
        self._hooks.extend(hook_expert_gradients(params, self.grid.data_group, self.batch_shards[0]))

    def forward(self, *args, **kwargs):
        if self.sequence_dim is None or not args:
            return self.module(*args, **kwargs)
        from .tensor import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region
        g, d = self.grid.intra_group, self.sequence_dim
        x = args[0] if isinstance(args[0], Tensor) else Tensor(args[0])
        y = self.module(scatter_to_sequence_parallel_region(x, g, dim=d), *args[1:], **kwargs)
        return gather_from_sequence_parallel_region(y, g, tensor_parallel_output_grad=False, dim=d)

    def local_batch(self, *arrays):
        """This rank's rows of the global batch: equal contiguous slices over the batch shards.

        Example:
            >>> xb, yb = pm.local_batch(x, y)
        """
        n, k = self.batch_shards
        out = []
        for a in arrays:
            rows = len(_raw(a))
            if rows % n:
                raise ValueError(f"rank {self.grid.rank}: a global batch of {rows} rows does not split into "
                                 f"{n} equal batch shards (data replicas"
                                 f"{' x tensor block' if self.tensor_parallel == 'axonn' else ''}); "
                                 f"use a multiple of {n}")
            b = rows // n
            piece = _raw(a)[k * b:(k + 1) * b]
            out.append(Tensor(piece) if isinstance(a, Tensor) else piece)
        return out[0] if len(out) == 1 else tuple(out)

    def named_parameters(self, prefix: str = "", recurse: bool = True):
        return self.module.named_parameters(prefix, recurse)

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def state_dict(self):
        """The full serial state dict (collective): serial names, full shapes, on every rank."""
        return full_state_dict(self)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load a full serial state dict or a :meth:`sharded_state_dict` filled by ``checkpoint.load``.

        Full arrays saved under any other layout load here: entries with the serial number of
        elements but another shape (FSDP's flattened arrays) are reshaped to the serial shape.
        """
        from ..distributed.sharding import ShardedArray
        if not any(isinstance(v, ShardedArray) for v in state_dict.values()):
            state_dict = OrderedDict((k, _serial(v, self._serial_shapes.get(k))) for k, v in state_dict.items())
        if self.data_parallel == "fsdp":
            return self.module.load_state_dict(state_dict, strict)
        from .tensor.state import load_full_state_dict, load_sharded_state_dict
        if any(isinstance(v, ShardedArray) for v in state_dict.values()):
            return load_sharded_state_dict(self.inner, state_dict, strict)
        return load_full_state_dict(self.inner, state_dict, strict)

    def sharded_state_dict(self) -> "OrderedDict[str, Any]":
        """Serial names; sharded parameters as ``ShardedArray`` blocks of the full arrays (nothing gathered)."""
        if self.data_parallel == "fsdp":
            return self.module.sharded_state_dict()
        from .tensor.state import sharded_state_dict
        return sharded_state_dict(self.inner)

    def optim_state_dict(self, optimizer) -> Dict[str, Any]:
        """The optimizer's state under serial parameter names; a tensor-parallel parameter's arrays as
        ``ShardedArray`` blocks of the full arrays (its placement), the others as host arrays.

        ``{"state": {name: {"step": int, "exp_avg": ..., ...}}, "param_groups": [{options..., "params":
        [names]}]}``: saved by ``training_state(pm, opt)`` and loadable under any layout.
        """
        from ..backend import to_host
        from .tensor.state import tp_entries
        names = {id(p): n for n, p in self.inner.named_parameters()}
        tp = {key: (m, name) for key, m, name, _ in tp_entries(self.inner)}
        state: Dict[str, Dict[str, Any]] = {}
        groups = []
        for g in optimizer.param_groups:
            gnames = []
            for p in g["params"]:
                n = names.get(id(p))
                if n is None:
                    raise ValueError(f"rank {self.grid.rank}: the optimizer holds a parameter of shape "
                                     f"{tuple(p.shape)} that is not one of this model's; build it on pm.parameters()")
                gnames.append(n)
                for k, v in optimizer.state.get(p, {}).items():
                    if hasattr(v, "shape") and tuple(v.shape) == tuple(p.shape) and getattr(v, "ndim", 0) > 0:
                        v = tp[n][0].tp_block(tp[n][1], v) if n in tp else np.array(to_host(v), copy=True)
                    state.setdefault(n, {})[k] = v
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": gnames})
        return {"state": state, "param_groups": groups}

    def load_optim_state_dict(self, optimizer, state_dict: Dict[str, Any]) -> None:
        """Load an :meth:`optim_state_dict` saved under any layout (blocks, full arrays or FSDP's
        flattened arrays) into ``optimizer`` (built on ``pm.parameters()``)."""
        from ..distributed.sharding import ShardedArray
        from .tensor.state import tp_entries
        names = {id(p): n for n, p in self.inner.named_parameters()}
        tp = {key: (m, name) for key, m, name, _ in tp_entries(self.inner)}
        saved = state_dict["state"]
        index_state, groups, i = {}, [], 0
        for g, sg in zip(optimizer.param_groups, state_dict["param_groups"]):
            ids = []
            for p in g["params"]:
                n = names[id(p)]
                ids.append(i)
                st = {}
                for k, v in saved.get(n, {}).items():
                    if isinstance(v, ShardedArray) and v.local_shape != v.shape:
                        v = tp[n][0].tp_unblock(tp[n][1], np.asarray(v.local)) if n in tp else v.local
                    elif isinstance(v, ShardedArray):
                        v = v.local
                    if hasattr(v, "shape") and getattr(v, "ndim", 0) > 0 and tuple(v.shape) != tuple(p.shape):
                        v = _serial(v, self._serial_shapes.get(n))
                        if n in tp and tuple(v.shape) != tuple(p.shape):
                            v = tp[n][0].tp_shard(tp[n][1], v)
                    st[k] = v
                if st:
                    index_state[i] = st
                i += 1
            groups.append({**{k: v for k, v in sg.items() if k != "params"}, "params": ids})
        optimizer.load_state_dict({"state": index_state, "param_groups": groups})

    def extra_repr(self) -> str:
        return (f"tensor_parallel={self.tensor_parallel!r}, data_parallel={self.data_parallel!r}, "
                f"batch_shards={self.batch_shards[0]}")


def _serial(v, shape):
    """``v`` as a host array of ``shape`` when it holds that many elements in another shape."""
    a = np.asarray(_raw(v))
    if shape is not None and a.shape != tuple(shape) and a.size == int(np.prod(shape)):
        a = a.reshape(shape)
    return a


class _FSDPParallelModule(ParallelModule):
    """FSDP layouts: the optimizer state is sharded too (``training_state`` reads these)."""

    def optim_state_dict(self, optimizer) -> Dict[str, Any]:
        """FSDP's named, sharded optimizer state (see ``FSDP.optim_state_dict``)."""
        return self.module.optim_state_dict(optimizer)

    def load_optim_state_dict(self, optimizer, state_dict) -> None:
        """Load what :meth:`optim_state_dict` gave (any world size)."""
        self.module.load_optim_state_dict(optimizer, state_dict)


class _FSDPTensorParallelModule(ParallelModule):
    """FSDP over the data group of a model with AxoNN 3-D layers: FSDP shards the tensor-parallel shards."""

    def _local_full(self) -> "OrderedDict[str, Any]":
        from .tensor.state import tp_entries
        sd = self.module.state_dict()            # the tensor-parallel local arrays, gathered over data
        for key, m, name, _ in tp_entries(self.inner):
            sd[key] = np.asarray(m.tp_gather(name, sd[key]))
        return sd

    def state_dict(self):
        """The full serial state dict (collective over data and the tensor block)."""
        return self._local_full()

    def sharded_state_dict(self):
        """FSDP x tensor parallel gives the full serial arrays (replicated on every rank): a sharded
        form of FSDP's chunks of tensor-parallel shards is not built yet."""
        return self._local_full()

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load a full serial state dict (any layout's, FSDP's flattened arrays included)."""
        from ..distributed.sharding import ShardedArray
        from .tensor.state import tp_entries
        sd = OrderedDict((k, _serial(v.local if isinstance(v, ShardedArray) and v.local_shape == v.shape else v,
                                     self._serial_shapes.get(k))) for k, v in state_dict.items())
        for key, m, name, _ in tp_entries(self.inner):
            if key in sd:
                sd[key] = m.tp_shard(name, sd[key])
        return self.module.load_state_dict(sd, strict)

    def load_optim_state_dict(self, optimizer, state_dict) -> None:
        self.optim_state_dict(optimizer)

    def optim_state_dict(self, optimizer):
        raise NotImplementedError(f"rank {self.grid.rank}: the optimizer state of FSDP x tensor parallel "
                                  "cannot be checkpointed yet (FSDP's chunks of tensor-parallel shards have no "
                                  "serial-named block form); checkpoint the model with pm.state_dict()")


def parallelize(module: Module, *, grid: Optional[ProcessGrid] = None,
                tensor_parallel: Union[None, str, Dict[str, str]] = None,
                data_parallel: Optional[str] = "ddp", sharding_strategy=None, sequence_parallel: bool = False,
                sequence_dim: int = 1, context_parallel: Optional[str] = None, expert_parallel: Optional[int] = None,
                expert_tensor_parallel: bool = False, **strategy_options) -> ParallelModule:
    """Lay ``module`` out over the grid: tensor parallel, then data parallel (DDP or FSDP).

    Args:
        module: any ``nn.Module`` built from the library's layers (changed in place: its
            ``nn.Linear`` / ``nn.Embedding`` children are replaced by tensor-parallel ones
            holding their shards of the serial weights; build it the same way on every rank).
        grid: the :class:`ProcessGrid` (default: the current World's, ``axonmpi.init(...)``).
        tensor_parallel: ``None``; ``"axonn"``: every ``nn.Linear`` becomes a 3-D
            ``intra_layer.Linear`` over the grid's row x column x depth, in easy mode (each rank
            of the tensor block reads its own rows; a Linear whose sizes do not divide over the
            grid stays replicated, AxoNN's ``auto_parallelize`` rule); or ``{"<fnmatch pattern on
            named_modules()>": "column" | "row" | "vocab"}``: Megatron 1-D over the grid's tensor
            group (every rank of it reads the same rows); modules matching no pattern stay
            replicated.
        data_parallel: ``"ddp"`` (default), ``"fsdp"``, or ``None`` (no data-parallel reduction:
            the grid has one data replica, or a :class:`~axonmpi.parallel.Pipeline` over
            parallelized stages reduces over its ``data_group``).
        sharding_strategy: FSDP's :class:`~axonmpi.parallel.ShardingStrategy` (FSDP only).
        sequence_parallel: Megatron's sequence parallelism (with a Megatron plan): ``pm(x)`` keeps
            this rank's ``1/p`` of ``x`` along ``sequence_dim`` (split over the tensor group), the plan's
            column / row layers all-gather / reduce-scatter it instead of all-reducing, every
            ``nn.LayerNorm`` becomes a ``SequenceParallelLayerNorm``, every other replicated
            parameter's gradient is summed over the tensor group as it completes, and the output is
            all-gathered back: the same results with ``1/p`` of the activation bytes outside the
            matmuls.  The length along ``sequence_dim`` must divide by the tensor size.
        sequence_dim: the sequence dimension of the model's input and output (default 1:
            ``(batch, seq, ...)``; 0 for token rows ``(tokens, features)``).
        context_parallel: ``"ring"`` or ``"ulysses"`` on a grid with ``G_context > 1``: every
            ``nn.CausalSelfAttention`` becomes a :class:`~axonmpi.parallel.context.ContextParallelAttention`
            (:func:`~axonmpi.parallel.context.context_parallel_gpt`; a GPT then keeps its tokens of each
            sequence), and gradients are reduced over data x context (``grid.data_context_group``).
        expert_parallel: EP for the model's ``nn.MoE`` layers (divides ``G_data``; see
            :func:`axonmpi.parallel.moe.expert_parallel`): experts split over the expert group,
            reduced over the expert-data group. ``None``: 1 when the model has MoE layers (their
            routing statistics are still summed over the data group).
        expert_tensor_parallel: split the experts' hidden width over the tensor group instead
            (AxoNN style; needs ``tensor_parallel="axonn"``, whose batch split it shares).
        **strategy_options: keyword options of DDP or FSDP (``bucket_size_mb``, ``mixed_precision``, ...).

    Returns:
        A :class:`ParallelModule` ``pm``; ``pm.local_batch(x, y)`` gives this rank's rows, and
        after ``loss.backward()`` (``loss`` the mean over those rows) every gradient is that of
        the mean loss over the global batch.

    Raises:
        ValueError: a grid with tensor dimensions and no ``tensor_parallel``, a pipeline grid with
            a data-parallel wrapper, an unknown option.
        NotImplementedError: FSDP combined with a Megatron plan; AxoNN stages in a pipeline (not built yet).

    Example:
        >>> axonmpi.init(G_intra_c=2)                                  # 4 ranks: 2 data x 2 tensor
        >>> pm = parallelize(model, tensor_parallel={"*.fc1": "column", "*.fc2": "row"})
        >>> xb, yb = pm.local_batch(x, y)
        >>> F.cross_entropy(pm(xb), yb).backward()
        >>> axonmpi.optim.clip_grad_norm_(pm.parameters(), 1.0); opt.step()
    """
    if not isinstance(module, Module):
        raise TypeError(f"parallelize needs an axonmpi.nn.Module, got {type(module).__name__}")
    grid = get_grid() if grid is None else grid
    r = grid.rank
    if data_parallel not in _DATA:
        raise ValueError(f"rank {r}: data_parallel={data_parallel!r}; expected 'ddp', 'fsdp' or None")
    if not (tensor_parallel is None or tensor_parallel == "axonn" or isinstance(tensor_parallel, dict)):
        raise ValueError(f"rank {r}: tensor_parallel={tensor_parallel!r}; expected None, 'axonn' or a dict "
                         "{pattern: 'column' | 'row' | 'vocab'}")
    if sharding_strategy is not None and data_parallel != "fsdp":
        raise ValueError(f"rank {r}: sharding_strategy={sharding_strategy!r} needs data_parallel='fsdp'")
    if tensor_parallel is None and grid.G_intra > 1:
        raise ValueError(f"rank {r}: the grid has a tensor block of {grid.G_intra} ranks but tensor_parallel "
                         "is None; pass 'axonn' or a Megatron plan")
    if isinstance(tensor_parallel, dict) and (grid.G_intra_r > 1 or grid.G_intra_d > 1):
        raise ValueError(f"rank {r}: a Megatron plan is 1-D over the grid's tensor group; the grid has "
                         f"G_intra_r={grid.G_intra_r}, G_intra_d={grid.G_intra_d} (use G_intra_c or 'axonn')")
    if grid.G_inter > 1 and data_parallel is not None:
        raise ValueError(f"rank {r}: on a pipeline grid (G_inter={grid.G_inter}) parallelize each stage with "
                         "data_parallel=None; the Pipeline reduces over the grid's data group")
    if data_parallel == "fsdp" and isinstance(tensor_parallel, dict):
        raise NotImplementedError(f"rank {r}: parallelize with FSDP x a Megatron plan is not built yet "
                                  "(FSDP x 'axonn' is); use DDP with a Megatron plan")
    if strategy_options and data_parallel is None:
        raise ValueError(f"rank {r}: options {sorted(strategy_options)} need data_parallel='ddp' or 'fsdp'")
    if sequence_parallel and not isinstance(tensor_parallel, dict):
        raise ValueError(f"rank {r}: sequence_parallel=True needs a Megatron plan (tensor_parallel={{pattern: "
                         f"'column' | 'row'}}), got tensor_parallel={tensor_parallel!r}")
    cp_size = getattr(grid, "G_context", 1)
    if context_parallel is not None and cp_size == 1:
        raise ValueError(f"rank {r}: context_parallel={context_parallel!r} needs a grid with G_context > 1 "
                         "(axonmpi.init(G_context=N))")
    if cp_size > 1 and (context_parallel is None or tensor_parallel is not None or data_parallel == "fsdp"):
        raise NotImplementedError(
            f"rank {r}: on a grid with G_context={cp_size} parallelize builds context parallelism with DDP and "
            f"no tensor parallelism (context_parallel='ring' | 'ulysses'); got context_parallel={context_parallel!r}, "
            f"tensor_parallel={tensor_parallel!r}, data_parallel={data_parallel!r}")
    shapes = {k: tuple(np.shape(v)) for k, v in module.state_dict().items()}
    from ..nn.moe import MoE
    from .moe import expert_parallel as _ep, expert_parameters
    has_moe = any(isinstance(m, MoE) for m in module.modules())
    if expert_tensor_parallel and tensor_parallel != "axonn":
        raise ValueError(f"rank {r}: expert_tensor_parallel=True splits the batch over the tensor block as "
                         f"AxoNN's easy mode does; pass tensor_parallel='axonn' (got {tensor_parallel!r})")
    if has_moe and cp_size > 1:
        raise NotImplementedError(f"rank {r}: nn.MoE with context parallelism (G_context={cp_size}) is not built yet")
    if has_moe or (expert_parallel or 1) > 1:
        if data_parallel == "fsdp" and (expert_parallel or 1) > 1:
            raise NotImplementedError(f"rank {r}: FSDP with expert_parallel > 1 is not built yet; use DDP")
        if not has_moe:
            raise ValueError(f"rank {r}: expert_parallel={expert_parallel} but the model has no nn.MoE layer")
        _ep(module, expert_parallel or 1, grid=grid, expert_tensor_parallel=expert_tensor_parallel)
    experts = expert_parameters(module)
    if experts and data_parallel == "ddp" and tensor_parallel != "axonn":
        strategy_options = dict(strategy_options, ignored_parameters=experts)
    if tensor_parallel == "axonn":
        _axonn(module, grid)
    elif isinstance(tensor_parallel, dict):
        sp = int(sequence_dim) if sequence_parallel else None
        if _megatron(module, grid, tensor_parallel, sp) == 0:
            raise ValueError(f"rank {r}: no module of the model matches the plan {tensor_parallel}; names: "
                             f"{[n for n, _ in module.named_modules() if n][:20]}")
    sp_hooks = []
    if sequence_parallel and grid.intra_group.size > 1:
        # registered before DDP's hooks: each gradient is summed over the tensor group before DDP reads it
        def reduce_tp(p, g=grid.intra_group):
            reduce_gradient(p.grad.data, [g])
        sp_hooks = [p.register_post_accumulate_grad_hook(reduce_tp) for p in _sequence_parallel(module, grid)]
    if context_parallel is not None:
        from .context import context_parallel_gpt
        context_parallel_gpt(module, grid.context_group, context_parallel)
    wrapped = module
    cls = ParallelModule
    if data_parallel == "ddp" and tensor_parallel != "axonn":
        from .ddp import DistributedDataParallel
        from .grad_sync import data_reduction_group
        wrapped = DistributedDataParallel(module, group=data_reduction_group(grid), **strategy_options)
    elif data_parallel == "ddp" and strategy_options:
        raise ValueError(f"rank {r}: AxoNN layouts reduce through the gradient-sync table; DDP options "
                         f"{sorted(strategy_options)} do not apply")
    elif data_parallel == "fsdp":
        from .fsdp import FSDP
        opts = dict(strategy_options)
        if sharding_strategy is not None:
            opts["sharding_strategy"] = sharding_strategy
        wrapped = FSDP(module, group=grid.data_group, **opts)
        cls = _FSDPParallelModule
        if tensor_parallel == "axonn":
            wrapped.register_post_backward_hook(lambda: finish_axonn_fsdp(wrapped, grid))
            cls = _FSDPTensorParallelModule
    pm = cls(module, grid, tensor_parallel, data_parallel, wrapped, module)
    pm._serial_shapes = shapes
    pm._hooks.extend(sp_hooks)
    if sequence_parallel:
        pm.sequence_dim = int(sequence_dim)
    if experts and data_parallel == "ddp" and tensor_parallel != "axonn":
        pm._hook_experts(experts)
    return pm


def full_state_dict(pm: Module) -> "OrderedDict[str, np.ndarray]":
    """The serial state dict of a parallelized model (collective): serial names, full shapes, every rank.

    Works on a :class:`ParallelModule`, an FSDP model, a model holding tensor-parallel layers, or a
    plain module.

    Example:
        >>> sd = axonmpi.parallel.full_state_dict(pm)
        >>> serial.load_state_dict(sd)
    """
    from .fsdp import FSDP
    from .tensor.state import full_state_dict as tp_full
    if isinstance(pm, ParallelModule):
        if isinstance(pm, _FSDPTensorParallelModule):
            return pm.state_dict()
        if pm.data_parallel == "fsdp":
            return pm.module.state_dict()
        return tp_full(pm.inner)
    if isinstance(pm, FSDP):
        return pm.state_dict()
    return tp_full(pm)
