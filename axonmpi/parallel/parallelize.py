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

__all__ = ["ParallelModule", "parallelize", "full_state_dict"]

_STYLES = ("column", "row", "vocab")
_DATA = ("ddp", "fsdp", None)


def _raw(a):
    return a.data if isinstance(a, Tensor) else a


def _children(module: Module) -> List[Tuple[Module, str, Module, str]]:
    """``(parent, attribute name, child, qualified name)`` for every submodule, in ``named_modules`` order."""
    out = []
    for qname, m in module.named_modules():
        for name, child in list(m.named_children()):
            if child is not None:
                out.append((m, name, child, f"{qname}.{name}" if qname else name))
    return out


def _swap(parent: Module, name: str, new: Module) -> None:
    setattr(parent, name, new)


def _copy_serial(new: Module, old: Module) -> None:
    """Load the serial layer's weights into its tensor-parallel replacement (each rank keeps its shard)."""
    from .tensor.state import load_full_state_dict
    load_full_state_dict(new, {k: np.asarray(v) for k, v in old.state_dict().items()})


def _axonn(module: Module, grid: ProcessGrid) -> int:
    """Every ``nn.Linear`` whose sizes divide over the grid (AxoNN's rule, ``is_parallelizable_linear``)
    -> a 3-D ``intra_layer.Linear`` over the grid (easy mode); the others stay replicated. Returns how many."""
    from .auto_parallelize import is_parallelizable_linear
    from .intra_layer import Linear as Linear3D
    from .tensor.groups import TensorParallelGroups
    groups = TensorParallelGroups.from_grid(grid)
    n = 0
    for parent, name, child, _ in _children(module):
        if type(child) is nn_layers.Linear and is_parallelizable_linear(child.in_features, child.out_features,
                                                                         groups.sizes):
            new = Linear3D(child.in_features, child.out_features, bias=child.bias is not None,
                           dtype=child.weight.dtype, groups=groups)
            _copy_serial(new, child)
            _swap(parent, name, new)
            n += 1
    return n


def _megatron(module: Module, grid: ProcessGrid, plan: Dict[str, str]) -> int:
    """The modules ``plan`` names -> Megatron column / row / vocab-parallel layers over the grid's tensor group."""
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
        if style == "column":
            new = ColumnParallelLinear(child.in_features, child.out_features, bias=child.bias is not None,
                                       gather_output=False, group=group, dtype=child.weight.dtype)
        elif style == "row":
            new = RowParallelLinear(child.in_features, child.out_features, bias=child.bias is not None,
                                    input_is_parallel=True, group=group, dtype=child.weight.dtype)
        else:
            new = VocabParallelEmbedding(child.num_embeddings, child.embedding_dim, group=group,
                                         dtype=child.weight.dtype)
        _copy_serial(new, child)
        _swap(parent, name, new)
        n += 1
    return n


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

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

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
                data_parallel: Optional[str] = "ddp", sharding_strategy=None, **strategy_options) -> ParallelModule:
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
    shapes = {k: tuple(np.shape(v)) for k, v in module.state_dict().items()}
    if tensor_parallel == "axonn":
        _axonn(module, grid)
    elif isinstance(tensor_parallel, dict):
        if _megatron(module, grid, tensor_parallel) == 0:
            raise ValueError(f"rank {r}: no module of the model matches the plan {tensor_parallel}; names: "
                             f"{[n for n, _ in module.named_modules() if n][:20]}")
    wrapped = module
    cls = ParallelModule
    if data_parallel == "ddp" and tensor_parallel != "axonn":
        from .ddp import DistributedDataParallel
        wrapped = DistributedDataParallel(module, group=grid.data_group, **strategy_options)
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
