"""``parallelize``: the one composer -- tensor, sequence, context and expert parallel, activation checkpointing, DDP / FSDP and the pipeline -- on any model built from the library's layers.

The layers are swapped in place of the model's ``nn.Linear`` (and ``nn.Embedding``) with the
serial weights cut into shards; every parameter carries its :class:`~axonmpi.distributed.Placement`,
so gradient sync (:mod:`axonmpi.parallel.grad_sync`), clipping, state dicts and checkpoints need
no per-model rule.  See ``docs/parallelize.md``.
"""
from __future__ import annotations

import contextlib
import fnmatch
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np

from ..autograd.tensor import Tensor
from ..distributed import ReduceOp, all_reduce, get_grid
from ..distributed.grid import ProcessGrid
from ..nn import layers as nn_layers
from ..nn.module import Module
from ..nn.transformer import CausalSelfAttention
from .grad_sync import GradReducer, no_sync as _no_sync, reduce_gradient, reduction_groups
from .state import ShardedState
from .swap import module_slots as _children

__all__ = ["ParallelModule", "PipelinePlan", "PipelinedModule", "parallelize", "full_state_dict"]

_STYLES = ("column", "column_gather", "row", "vocab", "attention")
_DATA = ("ddp", "fsdp", None)


def _raw(a):
    return a.data if isinstance(a, Tensor) else a


def _swap(parent: Module, name: str, new: Module) -> None:
    setattr(parent, name, new)


def _copy_serial(new: Module, old: Module) -> None:
    """Load the serial layer's weights into its tensor-parallel replacement (each rank keeps its shard); a
    :class:`~axonmpi.parallel.pipeline.LayerBuilder`'s stand-in (another pipeline rank's layer) stays one."""
    from .pipeline.staged import is_stand_in, stand_in
    from .tensor.state import load_full_state_dict
    if any(is_stand_in(p) for p in old.parameters()):
        stand_in(new)
        return
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


def _megatron(module: Module, grid: ProcessGrid, plan: Dict[str, str], sp: Optional[int] = None,
              in_forward: bool = False) -> int:
    """The modules ``plan`` names -> Megatron column / row / vocab-parallel layers over the grid's tensor group
    (``sp``: the sequence dimension under sequence parallelism, else ``None``); ``"column_gather"``: a column
    layer whose output is all-gathered (the serial width; under sequence parallelism cut back to this rank's
    sequence shard). A ``"column"`` layer whose output reaches the model's output unpaired raises at the first
    forward ([Note: the output keeps the serial shape] in ``split_output.py``).  ``in_forward`` (a GPT): the model
    enters the sequence-parallel region itself (after its embedding) and a ``"column_gather"`` layer leaves it
    (the whole sequence out), so a ``"vocab"`` embedding stays outside it."""
    from .split_output import refuse_split_outputs
    from .tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, \
        scatter_to_sequence_parallel_region
    for pattern, style in plan.items():
        if style not in _STYLES:
            raise ValueError(f"rank {grid.rank}: tensor_parallel[{pattern!r}] = {style!r}; expected one of {_STYLES}")
    group = grid.intra_group
    n = 0
    columns, rows = {}, []
    for parent, name, child, qname in _children(module):
        style = next((s for pat, s in plan.items() if fnmatch.fnmatchcase(qname, pat)), None)
        if style is None:
            continue
        if style in ("column", "column_gather", "row") and type(child) is not nn_layers.Linear:
            raise TypeError(f"rank {grid.rank}: {qname!r} matches a {style!r} pattern but is a "
                            f"{type(child).__name__}, not an nn.Linear")
        if style == "attention" and type(child) is not CausalSelfAttention:
            raise TypeError(f"rank {grid.rank}: {qname!r} matches an 'attention' pattern but is a "
                            f"{type(child).__name__}, not an nn.CausalSelfAttention")
        if style == "vocab" and type(child) is not nn_layers.Embedding:
            raise TypeError(f"rank {grid.rank}: {qname!r} matches a 'vocab' pattern but is a "
                            f"{type(child).__name__}, not an nn.Embedding")
        seq = {} if sp is None else {"sequence_parallel": True, "sequence_dim": sp}
        if style == "attention":
            from .tensor import TensorParallelAttention
            new = TensorParallelAttention(child.n_embd, child.n_head, group=group, causal=True,
                                          dropout=child.attn_dropout.p, bias=child.qkv.bias is not None,
                                          dtype=child.qkv.weight.dtype, sequence_parallel=sp is not None)
        elif style in ("column", "column_gather"):
            new = ColumnParallelLinear(child.in_features, child.out_features, bias=child.bias is not None,
                                       gather_output=style == "column_gather", group=group,
                                       dtype=child.weight.dtype, **seq)
            if style == "column":
                columns[qname] = new
            elif sp is not None and not in_forward:    # gathered over features: back to this rank's sequence shard
                new.register_forward_hook(lambda m, a, y, d=sp: scatter_to_sequence_parallel_region(y, group, dim=d))
        elif style == "row":
            new = RowParallelLinear(child.in_features, child.out_features, bias=child.bias is not None,
                                    input_is_parallel=True, group=group, dtype=child.weight.dtype, **seq)
        else:
            new = VocabParallelEmbedding(child.num_embeddings, child.embedding_dim, group=group,
                                         dtype=child.weight.dtype, **({} if in_forward else seq))
        if style in ("row", "vocab", "attention"):      # outputs whole over the tensor group
            rows.append(new)
        _copy_serial(new, child)
        _swap(parent, name, new)
        n += 1
    refuse_split_outputs(module, columns, rows, group)
    return n


def _tied_slots(module: Module) -> List[List[Tuple[str, str]]]:
    """The parameters held by more than one module of ``module`` (a head tied to its embedding), each as
    its ``[(module name, attribute), ...]``."""
    slots: Dict[int, List[Tuple[str, str]]] = {}
    for q, m in module.named_modules():
        for name, p in m._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((q, name))
    return [v for v in slots.values() if len(v) > 1]


def _retie(module: Module, tied, r: int) -> None:
    """After step 1: a weight the plan's layers hold twice (``"vocab"`` ``wte`` and ``"column_gather"`` ``lm_head``,
    both this rank's vocabulary rows) is one Parameter again (Megatron's tied embedding); a tie between a split and
    a replicated use raises, naming both."""
    mods = dict(module.named_modules())
    for slots in tied:
        params = [getattr(mods[q], name) for q, name in slots]
        first = params[0]
        if all(p is first for p in params):
            continue
        from ..distributed.placement import placement_of
        shards = [tuple((s.kind, getattr(s, "dim", None)) for s in placement_of(p).shards) for p in params]
        if any(tuple(p.shape) != tuple(first.shape) or sh != shards[0] for p, sh in zip(params, shards)):
            names = [f"{q}.{name}" if q else name for q, name in slots]
            raise ValueError(f"rank {r}: {names} are one tied weight but the tensor-parallel plan lays them out "
                             f"differently (local shapes {[tuple(p.shape) for p in params]}): split both the same "
                             "way (an embedding 'vocab' and its head 'column_gather') or neither")
        for (q, name), p in zip(slots[1:], params[1:]):
            setattr(mods[q], name, first)


def _sequence_parallel(module: Module, grid: ProcessGrid, outside=()) -> List[Any]:
    """Sequence parallelism outside the plan's layers: every ``nn.LayerNorm`` -> a
    :class:`~axonmpi.parallel.tensor.SequenceParallelLayerNorm`; every other replicated parameter (used on
    sequence shards too) is tagged ``sequence_parallel`` and returned, for a hook that sums its gradient
    over the tensor group. ``outside``: modules run on whole sequences before the region (a GPT's embeddings): left as they are."""
    from ..distributed.placement import add_placement, placement_of
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
    skip = {id(q) for m in outside for q in m.parameters()}
    for p in module.parameters():      # replicated, or split over another group (experts over the expert group)
        if id(p) in skip:
            continue
        pl = placement_of(p)
        if not any(s.group is g or getattr(s.group, "ranks", None) == g.ranks for s in pl.shards) \
                and not getattr(p, "sequence_parallel", False):
            if pl.is_replicated:
                _tag_sequence_parallel(p, g)
            else:
                add_placement(p, replica=g)
                p.sequence_parallel = True
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
                 inner: Module, reducer: Optional[GradReducer] = None):
        super().__init__()
        # [Note: the reducer] (grad_sync): every reduction of this model, DDP's / FSDP's own as parts
        self.grad_reducer = GradReducer("parallelize") if reducer is None else reducer
        if wrapped is not inner and isinstance(getattr(wrapped, "grad_reducer", None), GradReducer):
            self.grad_reducer.add_part(wrapped.grad_reducer)
        self.module = wrapped
        self._inner = [inner]            # the unwrapped model (not a submodule: no duplicate names)
        self.grid = grid
        self.tensor_parallel = tensor_parallel
        self.data_parallel = data_parallel
        axonn = tensor_parallel == "axonn"
        n = grid.G_data * (grid.G_intra if axonn else 1)
        k = grid.coords.data * (grid.G_intra if axonn else 1) + (grid.intra_group.rank if axonn else 0)
        self.batch_shards = (n, k)
        # what a Pipeline over this stage reads to reduce it (the grad_sync table's batch groups)
        self.batch_groups = (grid.intra_group,) if axonn else ()
        self.depth_group = grid.depth_group
        self.context = None            # (group, CPAlgo) when local_batch splits the sequences (context parallel)
        if axonn and data_parallel != "fsdp" and grid.G_inter == 1:
            self._hook_axonn(data_parallel is not None)
        self.sequence_dim: Optional[int] = None     # set by parallelize(sequence_parallel=True)

    def _context(self, on: bool, algo) -> None:
        """Context parallel: ``local_batch`` keeps this rank's tokens of each sequence (a GPT keeps them itself)."""
        if not on or getattr(self.inner, "context_parallel", None) is not None:
            return
        from .context import ContextParallelAttention
        a = next(m for m in self.inner.modules() if isinstance(m, ContextParallelAttention))
        self.context = (a.group, a.algo)

    @property
    def inner(self) -> Module:
        """The model with its tensor-parallel layers (not wrapped by DDP/FSDP)."""
        return self._inner[0]

    def _hook_axonn(self, over_data: bool) -> None:
        """AxoNN easy mode: after each parameter's gradient of a backward is complete, sum it over the
        groups of the table (:func:`~axonmpi.parallel.grad_sync.reduction_groups`) and divide by the
        number of batch shards (every rank's loss is the mean over its own rows)."""
        from .grad_sync import data_reduction_group
        g = self.grid
        data = data_reduction_group(g) if over_data else None
        self.grad_reducer.hook(self.inner.parameters(),
                               lambda p: reduction_groups(p, data, (g.intra_group,), g.depth_group),
                               1.0 / (self.batch_shards[0] * getattr(g, "G_context", 1)))

    def _hook_experts(self, params) -> None:
        """Expert parameters (DDP leaves them out): reduced over their expert-data group (the grad-sync table),
        divided by the batch shards (x context)."""
        from .grad_sync import data_reduction_group
        data = data_reduction_group(self.grid)
        self.grad_reducer.hook(params, lambda p: reduction_groups(p, data, self.batch_groups),
                               1.0 / (self.batch_shards[0] * getattr(self.grid, "G_context", 1)))

    def no_sync(self):
        """Inside, no path reduces a gradient of this model (DDP, FSDP, the tensor / depth / expert /
        sequence-parallel reductions, the pipeline); the first backward (``step``) outside reduces the
        accumulated sum once: :func:`axonmpi.parallel.no_sync` of this model.

        Example:
            >>> with pm.no_sync():
            ...     F.cross_entropy(pm(x0), y0).backward()       # accumulated locally
            >>> F.cross_entropy(pm(x1), y1).backward()           # reduced once: the serial sum of both
        """
        return _no_sync(self)

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
            out.append(self.local_tokens(Tensor(_raw(a)[k * b:(k + 1) * b]) if isinstance(a, Tensor)
                                         else _raw(a)[k * b:(k + 1) * b]))
        return out[0] if len(out) == 1 else tuple(out)

    def local_tokens(self, *arrays):
        """This rank's tokens of each sequence of ``arrays`` (this rank's rows) under context parallelism
        (ring: its zig-zag chunks); the arrays themselves otherwise."""
        out = []
        for a in arrays:
            piece = _raw(a)
            d = 1 if self.sequence_dim is None else self.sequence_dim
            if self.context is not None and np.ndim(piece) > d:
                from .context.layout import ContextLayout
                cg, algo = self.context
                piece = ContextLayout(int(np.shape(piece)[d]), cg.size, algo).split(piece, cg.rank, axis=d)
            out.append(Tensor(piece) if isinstance(a, Tensor) else piece)
        return out[0] if len(out) == 1 else tuple(out)

    def token_groups(self) -> List[Any]:
        """The groups whose ranks read different targets of the global batch, as the gradient reducer
        averages over them: data (x context) when there is a data-parallel wrapper, and the tensor block
        in AxoNN's easy mode (never a Megatron tensor group: its ranks read the same rows)."""
        from .grad_sync import data_reduction_group
        groups = [data_reduction_group(self.grid)] if self.data_parallel is not None else []
        if self.tensor_parallel == "axonn":
            groups.append(self.grid.intra_group)
        return groups

    def token_mean(self, loss_sum: Tensor, num_tokens: int) -> Tensor:
        """The serial mean over the global batch's counted targets (``docs/parallelize.md``, one loss rule).

        Args:
            loss_sum: this rank's loss summed over its counted targets (``reduction="sum"``).
            num_tokens: this rank's counted targets (``int((yb != -100).sum())``).

        Returns:
            A scalar Tensor, the global token mean on every rank; ``backward()`` gives every
            parameter the serial gradient of that mean (collective over :meth:`token_groups`).

        Example:
            >>> lsum = F.cross_entropy(pm(xb), yb, ignore_index=-100, reduction="sum")
            >>> loss = pm.token_mean(lsum, num_tokens=int((yb != -100).sum())); loss.backward()
        """
        from .token_mean import token_mean
        groups = self.token_groups()
        shards = None
        if self.tensor_parallel == "axonn" and self.data_parallel is None:
            # the AxoNN hooks divide by every batch shard (x context)
            shards = self.batch_shards[0] * getattr(self.grid, "G_context", 1)
        return token_mean(loss_sum, num_tokens, groups, shards=shards)

    def named_parameters(self, prefix: str = "", recurse: bool = True):
        return self.module.named_parameters(prefix, recurse)

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def sharded_state(self) -> ShardedState:
        """This rank's model and optimizer state by placements (:class:`~axonmpi.parallel.state.ShardedState`);
        under FSDP each piece is read from (and written to) FSDP's flat chunks."""
        if self.data_parallel != "fsdp":
            return ShardedState(self.inner, rank=self.grid.rank)
        from ._flat import FlatParameter
        ps = list(self.parameters())          # FSDP's flat chunks, and what it leaves out (FSDP x EP's experts)
        return ShardedState(self.inner, params=[p for p in ps if not isinstance(p, FlatParameter)],
                            flats=[p for p in ps if isinstance(p, FlatParameter)], rank=self.grid.rank)

    def state_dict(self):
        """The full serial state dict (collective): serial names, full shapes, on every rank."""
        return full_state_dict(self)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load a full serial state dict (any layout's: FSDP's flattened arrays are reshaped to the serial
        shape) or a :meth:`sharded_state_dict` filled by ``checkpoint.load``; each rank keeps its pieces."""
        return self.sharded_state().load_state_dict(state_dict, strict)

    def sharded_state_dict(self) -> "OrderedDict[str, Any]":
        """Serial names; sharded parameters as ``ShardedArray`` blocks of the full arrays (by placement)."""
        return self.sharded_state().sharded_state_dict()

    def optim_state_dict(self, optimizer) -> Dict[str, Any]:
        """The optimizer's state under serial parameter names, each moment as its parameter's
        ``ShardedArray`` block of the full array (by its placement).

        ``{"state": {name: {"step": int, "exp_avg": ..., ...}}, "param_groups": [{options..., "params":
        [names]}]}``: saved by ``training_state(pm, opt)`` and loadable under any layout, or (read as full
        arrays) into the plain model's optimizer with ``ShardedState(model).load_optim_state_dict``.
        """
        return self.sharded_state().optim_state_dict(optimizer)

    def load_optim_state_dict(self, optimizer, state_dict: Dict[str, Any]) -> None:
        """Load an :meth:`optim_state_dict` saved under any layout (blocks, full arrays or FSDP's
        flattened arrays) into ``optimizer`` (built on ``pm.parameters()``)."""
        self.sharded_state().load_optim_state_dict(optimizer, state_dict)

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
    """FSDP over a model with nothing cut: FSDP's own sharded form (each rank's 1-D blocks of the flattened
    serial arrays, nothing gathered) for the model and the optimizer (``training_state`` reads these)."""

    def sharded_state_dict(self):
        """FSDP's blocks of the flattened serial arrays (see ``FSDP.sharded_state_dict``)."""
        return self.module.sharded_state_dict()

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load FSDP's blocks, or any layout's full arrays (reshaped to the serial shapes FSDP flattens)."""
        from ..distributed.sharding import ShardedArray
        if not any(isinstance(v, ShardedArray) for v in state_dict.values()):
            from ..distributed.placement import placement_of
            shapes = {n: placement_of(p).full_shape for n, p in self.inner.named_parameters()}
            state_dict = OrderedDict((k, _serial(v, shapes.get(k))) for k, v in state_dict.items())
        return self.module.load_state_dict(state_dict, strict)

    def optim_state_dict(self, optimizer) -> Dict[str, Any]:
        """FSDP's named, sharded optimizer state (see ``FSDP.optim_state_dict``)."""
        return self.module.optim_state_dict(optimizer)

    def load_optim_state_dict(self, optimizer, state_dict) -> None:
        """Load what :meth:`optim_state_dict` gave (any world size)."""
        self.module.load_optim_state_dict(optimizer, state_dict)


class _FSDPExpertModule(ParallelModule):
    """[Note: FSDP with expert parallelism]  FSDP shards every parameter but the experts over data x context;
    the experts (split over the expert group) stay outside its flat shards, as under a pipeline's FSDP, and
    are reduced over their expert-data group (x context) as each gradient completes (``_hook_experts``).
    ``parameters()`` are FSDP's flat shards and this rank's experts; state dicts gather both to serial."""

    def named_parameters(self, prefix: str = "", recurse: bool = True):
        yield from self.module.named_parameters(prefix, recurse)
        from .moe import expert_parameters
        ids = {id(p) for p in expert_parameters(self.inner)}
        for n, p in self.inner.named_parameters(prefix):
            if id(p) in ids:
                yield n, p

    def parameters(self, recurse: bool = True):
        for _, p in self.named_parameters(recurse=recurse):
            yield p


@dataclass(frozen=True)
class PipelinePlan:
    """The pipeline axis of :func:`parallelize`: how the model is cut and run.

    ``parallelize(model, ..., pipeline=PipelinePlan(num_microbatches=4, schedule="zbv"))`` cuts the model
    (an ``nn.Sequential`` or a GPT, by :func:`~axonmpi.parallel.pipeline.split_module`; given as a
    :class:`~axonmpi.parallel.pipeline.LayerBuilder`, each rank builds only its stages' layers) into the schedule's
    stages, placing each chunk on the pipeline rank the schedule runs it on (ZBV's V included), after the
    model went through tensor, sequence, context and expert parallelism and activation checkpointing;
    the :class:`~axonmpi.parallel.Pipeline` then reduces every stage over its replica group.

    Args:
        num_microbatches: micro-batches per step.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zb-h1"``, ``"zbv"`` (or a :class:`PipelineSchedule`).
        virtual_stages: chunks per pipeline rank (interleaved: any; ZBV: 2, the default for it; else 1).
        loss_fn: ``loss_fn(output, target)`` the mean over a micro-batch (default ``F.cross_entropy``).
        boundaries: explicit start indices of chunks 1 .. p v - 1 (else balanced ``split_by``).
        split_by: ``"params"`` or ``"layers"``.
        ignore_index: targets not counted (the loss is the mean over the counted targets of the global batch).
        aux_loss: ``aux_loss(chunk) -> Tensor | None``, a chunk's auxiliary loss of its last forward, added to
            its backward per micro-batch (weight ``1 / num_microbatches``; :class:`~axonmpi.parallel.Pipeline`).
            Default for a MoE GPT: its router losses (``moe_aux_loss_coeff * aux + moe_z_loss_coeff * z``).

    Example:
        >>> pm = parallelize(model, tensor_parallel=plan, pipeline=PipelinePlan(4, "1f1b"))
        >>> xb, yb = pm.local_batch(x, y); loss = pm.step(xb, yb)
    """

    num_microbatches: int
    schedule: Any = "1f1b"
    virtual_stages: Optional[int] = None
    loss_fn: Optional[Callable] = None
    boundaries: Optional[Tuple[int, ...]] = None
    split_by: str = "params"
    ignore_index: Optional[int] = -100
    aux_loss: Optional[Callable] = None


class _Stage(Module):
    """One pipeline chunk as the composer runs it: sequence-parallel scatter / gather at its ends (the
    activations between stages are whole sequences), recomputation in backward, and the groups the
    Pipeline reads to reduce it (AxoNN's batch groups and depth group)."""

    def __init__(self, chunk: Module, grid: ProcessGrid, *, axonn: bool, sequence_dim: Optional[int],
                 checkpointed: bool, shard_group=None, shared=frozenset()):
        super().__init__()
        self._grid = [grid]
        self.sequence_dim, self.checkpointed = sequence_dim, bool(checkpointed)
        self.batch_groups = (grid.intra_group,) if axonn else ()
        self.depth_group = grid.depth_group
        self.enters_itself = self.leaves_itself = False
        self.flat = None
        self.whole_first = False        # set by _pipeline: see [Note: the first layer runs on the whole sequence]
        if shard_group is None:
            self.chunk = chunk
            return
        self._chunk = [chunk]        # FSDP: the Pipeline sees the flat shard (and the experts), not the chunk
        self._fsdp(chunk, shard_group, shared)

    def _fsdp(self, chunk: Module, group, shared) -> None:
        """[Note: FSDP in a pipeline]  The chunk's parameters (experts aside: their own groups reduce them; a
        weight ``shared`` with another chunk aside: whole, averaged over data by the Pipeline, summed between the
        stages by [Note: a weight tied across stages])
        become one :class:`~axonmpi.parallel.FlatParameter` sharded over ``group`` (data x context): the
        optimizer holds this rank's chunk of them.  A step all-gathers them once before the first
        micro-batch and reduce-scatters the accumulated gradient once after the last (FSDP2's behaviour
        under a pipeline schedule, ``reshard_after_forward=False``), then frees the full copy."""
        from ..distributed.placement import set_placement
        from ._flat import FlatParameter
        from .grad_sync import sharded_within
        named = [(n, p) for n, p in chunk.named_parameters() if p.requires_grad]
        flat = [(n, p) for n, p in named if not sharded_within(p, group) and id(p) not in shared]
        if flat:
            self.flat = FlatParameter([p for _, p in flat], [n for n, _ in flat]).shard(group)
            set_placement(self.flat, self.flat.placement)     # its own (a flat chunk over ``group``), with the tags
        for i, (_, p) in enumerate(x for x in named if sharded_within(x[1], group)):
            self.register_parameter(f"expert_{i}", p)
        for i, (_, p) in enumerate(x for x in named if id(x[1]) in shared):
            self.register_parameter(f"tied_{i}", p)

    @property
    def body(self) -> Module:
        """The chunk this stage runs (FSDP: held aside, its parameters in the flat shard)."""
        return self._chunk[0] if "_chunk" in self.__dict__ else self.chunk

    def _run(self, x):
        return self.body(x)

    def _scatter(self, x):
        from .tensor import scatter_to_sequence_parallel_region
        return scatter_to_sequence_parallel_region(x if isinstance(x, Tensor) else Tensor(x),
                                                   self._grid[0].intra_group, dim=self.sequence_dim)

    def _run_whole_first(self, x):
        """[Note: the first layer runs on the whole sequence]  The model's input enters the sequence-parallel
        region after the first stage's first layer when that layer holds nothing split over the tensor group
        (a GPT's embedding numbers positions from its input's columns: scattered token ids would give every
        rank's tokens positions from 0).  That layer's gradients are then whole on every tensor rank and are
        not summed over the group (``parallelize`` leaves them out of the sequence-parallel parameters)."""
        layers = list(self.body)
        y = self._scatter(layers[0](x))
        for layer in layers[1:]:
            y = layer(y)
        return y

    def forward(self, x):
        from ..nn.checkpointing import checkpoint
        g = self._grid[0].intra_group
        sp = self.sequence_dim is not None and g.size > 1
        run = self._run_whole_first if sp and self.whole_first else self._run
        if sp and not (self.enters_itself or self.whole_first):
            x = self._scatter(x)
        y = checkpoint(run, x) if self.checkpointed else run(x)
        if sp and not self.leaves_itself:
            from .tensor import gather_from_sequence_parallel_region
            y = gather_from_sequence_parallel_region(y, g, tensor_parallel_output_grad=False, dim=self.sequence_dim)
        return y


class PipelinedModule(ParallelModule):
    """A model under :func:`parallelize` with ``pipeline=``: this rank's stages in a :class:`Pipeline`.

    ``pm.step(xb, yb)`` runs one training step's forward and backward over the micro-batches (``xb, yb``
    from :meth:`local_batch`; every rank passes them) and returns the serial mean loss of the global batch
    on every rank; ``pm.parameters()`` are this rank's stage parameters; ``pm.state_dict()`` is the whole
    serial state dict (collective over the grid); ``pm.sharded_state_dict()`` / ``pm.optim_state_dict(opt)``
    give this rank's stages' blocks (:meth:`sharded_state`) and ``load_state_dict`` /
    ``load_optim_state_dict`` take either form saved under any layout.
    """

    def __init__(self, module: Module, grid: ProcessGrid, tensor_parallel, data_parallel, pipe, stages):
        super().__init__(module, grid, tensor_parallel, data_parallel, module, module)
        self.pipeline = pipe
        self._stages = list(stages)
        self._tied: List[Tuple[Any, Any]] = []     # (parameter, embedding group): [Note: a weight tied across stages]
        self._replicate = None          # hybrid shard: the group the stages' flat shards are averaged over
        self._mixed_precision = None    # FSDP's MixedPrecision: stages gathered in param_dtype, reduced in reduce_dtype
        self.grad_reducer.add_part(pipe.grad_reducer)     # each stage over data x context, after the last backward

    def forward(self, *args, **kwargs):
        raise TypeError(f"rank {self.grid.rank}: a pipelined model runs by micro-batches: call pm.step(xb, yb) "
                        "(training) or pm.eval_step(xb, yb), not pm(x)")

    def step(self, inputs, targets, *, scaler=None) -> float:
        """Forward and backward of this rank's rows (:meth:`local_batch`); returns the global batch's mean loss.
        ``scaler`` (an :class:`axonmpi.amp.GradScaler`): each micro-batch's loss is scaled (:meth:`Pipeline.step`);
        then ``scaler.unscale_(opt)``, clip, ``scaler.step(opt)``, ``scaler.update()``."""
        flats = self._flats()
        mp = self._mixed_precision
        for f in flats:                          # [Note: FSDP in a pipeline]
            f.unshard(dtype=None if mp is None else mp.param_dtype)
            f.bind_grads()
        loss = self.pipeline.step(inputs, targets, scaler=scaler)     # its reducer: each stage over data x context
        if self.grad_reducer.enabled:            # under no_sync the full gradients stay bound and accumulate
            for p, tg in self._tied:             # [Note: a weight tied across stages]
                if p.grad is None:               # every rank of the group takes part
                    p.grad = Tensor(p.data * 0)
                reduce_gradient(p.grad.data, [tg])
            for f in flats:
                f.reduce_grad(reduce_dtype=None if mp is None else (mp.reduce_dtype or mp.param_dtype))
                # ^ reduce-scatter: the mean over data x context (its shard group), in the shard's dtype
                if self._replicate is not None and self._replicate.size > 1:    # hybrid shard: and the replicas
                    all_reduce(f.grad.data, ReduceOp.MEAN, self._replicate, out=f.grad.data)
        self.grad_reducer.run()                  # FSDP segments (AxoNN table), sequence-parallel sums
        for f in flats:
            f.reshard()
        return loss

    def _flats(self) -> List[Any]:
        return [st.flat for st in self._stages if st.flat is not None]

    @contextlib.contextmanager
    def _gathered(self, dtype=None):
        """Every FSDP stage's full parameters bound while inside (evaluation; ``dtype``: a compute copy in that
        dtype, mixed precision); freed on the way out."""
        flats = self._flats()
        for f in flats:
            f.unshard(dtype=dtype)
        try:
            yield
        finally:
            for f in flats:
                f.reshard()

    def eval_step(self, inputs, targets) -> float:
        """The global batch's mean loss without gradients (mixed precision: computed in its ``param_dtype``)."""
        mp = self._mixed_precision
        with self._gathered(None if mp is None else mp.param_dtype):
            return self.pipeline.eval_step(inputs, targets)

    def named_parameters(self, prefix: str = "", recurse: bool = True):
        """This rank's stages' parameters under serial names (FSDP: their flat shards, ``stage<k>.flat``)."""
        mine = {id(p) for p in self.pipeline.parameters()}
        for n, p in self.inner.named_parameters(prefix, recurse):
            if id(p) in mine:
                yield n, p
        for k, st in enumerate(self._stages):
            if st.flat is not None:
                yield f"{prefix}stage{k}.flat", st.flat

    def parameters(self, recurse: bool = True):
        """This rank's stages' parameters, each once (a weight tied between two chunks of this rank: ZBV's V)."""
        return list({id(p): p for p in self.pipeline.parameters()}.values())

    def sharded_state(self) -> ShardedState:
        """This rank's stages' state (their FSDP flat chunks included), joined with the other stages' over
        the pipeline group."""
        return ShardedState(self.inner, params=self.pipeline.parameters(), flats=self._flats(),
                            stage_group=self.grid.inter_group, rank=self.grid.rank)


def _swap_attention_for_context(module: Module, grid: ProcessGrid, algo) -> List[Any]:
    """Step 2: every attention (``nn.CausalSelfAttention``, or the head-split ``TensorParallelAttention`` of
    step 1) -> a :class:`~axonmpi.parallel.context.ContextParallelAttention` over the grid's context group
    holding the same ``qkv`` / ``proj`` layers (so names, values, shards and placements are kept)."""
    from .context import ContextParallelAttention
    from .context.layout import CPAlgo
    from .tensor import TensorParallelAttention
    g, algo, r = grid.context_group, CPAlgo.coerce(algo), grid.rank
    layers = []
    for parent, name, child, qname in _children(module):
        if type(child) is CausalSelfAttention:
            n_embd, n_head, local, drop = child.n_embd, child.n_head, child.n_head, child.attn_dropout.p
        elif type(child) is TensorParallelAttention:
            n_embd, n_head, local, drop = child.embed_dim, child.num_heads, child.local_heads, child.attn_dropout.p
        else:
            continue
        if drop:
            raise NotImplementedError(f"rank {r}: {qname!r} has attention dropout {drop}; context parallelism "
                                      "computes attention blockwise and draws no attention-weight mask: use 0")
        if algo is CPAlgo.ULYSSES and local % g.size:
            raise ValueError(f"rank {r}: Ulysses splits {qname!r}'s {local} heads on this rank (of {n_head}) "
                             f"over the {g.size} context ranks; {local} is not divisible by {g.size} (use ring, "
                             "or heads that divide by tensor x context)")
        new = ContextParallelAttention(n_embd, n_head, group=g, algo=algo, dropout=child.resid_dropout.p,
                                       bias=child.qkv.bias is not None)
        new.qkv, new.proj = child.qkv, child.proj
        _swap(parent, name, new)
        layers.append(new)
    if not layers:
        raise ValueError(f"rank {r}: context_parallel={algo.value!r} found no nn.CausalSelfAttention in the model")
    return layers


def _record_full_shapes(module: Module) -> None:
    """Every parameter's placement carries its serial shape: a parameter no transform cut is whole here (the
    sharded state, the checkpoints and the planner read the placement, never the layer)."""
    from dataclasses import replace
    from ..distributed.placement import placement_of
    for p in module.parameters():
        pl = placement_of(p)
        if pl.full_shape is None:
            p.placement = replace(pl, full_shape=tuple(p.shape))


def _checkpoint_modules(module: Module, spec, r: int) -> int:
    """Step 4: the modules ``spec`` names (``True``: every child of the model) recompute their forward in
    backward (:func:`axonmpi.nn.checkpoint`); their names and parameters are unchanged."""
    from ..nn.checkpointing import checkpoint
    if spec is True:
        targets = [m for _, m in module.named_children()]
    else:
        pats = [spec] if isinstance(spec, str) else list(spec)
        targets = [m for q, m in module.named_modules() if q and any(fnmatch.fnmatchcase(q, p) for p in pats)]
        if not targets:
            raise ValueError(f"rank {r}: activation_checkpointing={spec!r} matches no module of the model")
    for m in targets:
        fwd = m.forward
        object.__setattr__(m, "forward", lambda *a, _f=fwd: checkpoint(_f, *a))
    return len(targets)


def _reduce_fsdp_segments(reducer: GradReducer, flats, grid: ProcessGrid, axonn: bool, sp_params=()) -> None:
    """FSDP over a tensor-parallel model, after FSDP averaged each flat chunk over its data group: AxoNN's
    table on each segment (3-D biases over depth, replicated parameters over the tensor block, all divided
    by the block's size: each of its ranks read its own rows); a Megatron plan's parameters used on sequence
    shards summed over the tensor group (``sp_params``: those whose layer does not sum them itself).  The
    ranks of a tensor block hold chunks over the same elements (same data rank, same local shapes)."""
    g = grid.intra_group
    if axonn:
        reducer.after_backward_segments(flats, lambda q: reduction_groups(q, None, (g,), grid.depth_group),
                                        1.0 / grid.G_intra)
        return
    ids = {id(p) for p in sp_params}
    if ids:
        reducer.after_backward_segments(flats, lambda q: (g,) if id(q) in ids else ())


def parallelize(module: Module, *, grid: Optional[ProcessGrid] = None,
                tensor_parallel: Union[None, str, Dict[str, str]] = None,
                data_parallel: Optional[str] = "ddp", sharding_strategy=None, sequence_parallel: bool = False,
                sequence_dim: int = 1, context_parallel: Optional[str] = None, expert_parallel: Optional[int] = None,
                expert_tensor_parallel: bool = False, activation_checkpointing=None,
                pipeline: Optional[PipelinePlan] = None, **strategy_options) -> ParallelModule:
    """Lay ``module`` out over every axis of the grid: the one composer.

    [Note: the composer's order]  The axes are applied in a fixed order, each a transform that swaps
    modules and sets placements (torchtitan's ``parallelize_llama`` over one device mesh):

      1. tensor parallel (a Megatron plan or AxoNN 3-D) and sequence parallel;
      2. context parallel (attention swapped; every parameter replicated over the context group);
      3. expert parallel (``nn.MoE`` experts over the expert group carved from data);
      4. activation checkpointing;
      5. DDP / FSDP over each parameter's replica group (data x context), FSDP chunking the TP shards;
      6. the pipeline (``pipeline=PipelinePlan(...)``) over stages that went through 1-4; its runtime is
         then the data-parallel reducer of each stage (step 5 is its ``data_group``).

    Args:
        module: any ``nn.Module`` built from the library's layers (changed in place; build it the same
            way on every rank). With ``pipeline`` an ``nn.Sequential`` (or a GPT) that ``split_module`` cuts,
            or a :class:`~axonmpi.parallel.pipeline.LayerBuilder`: each pipeline rank then builds only its
            stages' layers (the serial model's values; the others hold no memory).
        grid: the :class:`ProcessGrid` (default: the current World's, ``axonmpi.init(...)``).
        tensor_parallel: ``None``; ``"axonn"``: every ``nn.Linear`` becomes a 3-D
            ``intra_layer.Linear`` over the grid's row x column x depth, in easy mode (each rank
            of the tensor block reads its own rows; a Linear whose sizes do not divide over the
            grid stays replicated, AxoNN's ``auto_parallelize`` rule); or ``{"<fnmatch pattern on
            named_modules()>": "column" | "column_gather" | "row" | "vocab" | "attention"}``: Megatron 1-D
            over the grid's tensor group (every rank of it reads the same rows; ``"attention"``: an
            ``nn.CausalSelfAttention`` with its heads split); modules matching no pattern stay replicated.
            ``"column_gather"`` all-gathers the layer's output (PyTorch's
            ``ColwiseParallel(output_layouts=Replicate())``: an output layer keeps the serial width);
            a ``"column"`` layer whose output reaches the model's output with no ``"row"`` layer after
            it raises ``ValueError`` at the first forward, naming it.
        data_parallel: ``"ddp"`` (default), ``"fsdp"``, or ``None`` (no data-parallel reduction).  With a
            pipeline, ``"ddp"`` and ``None`` mean the Pipeline reduces each stage over data x context.
        sharding_strategy: FSDP's :class:`~axonmpi.parallel.ShardingStrategy` (FSDP only).
        sequence_parallel: Megatron's sequence parallelism (with a Megatron plan): ``pm(x)`` keeps
            this rank's ``1/p`` of ``x`` along ``sequence_dim``, the plan's column / row layers
            all-gather / reduce-scatter it, every ``nn.LayerNorm`` becomes a ``SequenceParallelLayerNorm``,
            every other parameter not split over the tensor group has its gradient summed over it,
            and the output is all-gathered back.  With a pipeline, each stage enters and leaves the region.
        sequence_dim: the sequence dimension of the model's input and output (default 1).
        context_parallel: ``"ring"`` or ``"ulysses"`` on a grid with ``G_context > 1``: every attention
            becomes a :class:`~axonmpi.parallel.context.ContextParallelAttention`; ``local_batch`` gives
            this rank's tokens of each sequence (a GPT takes whole sequences and keeps its tokens itself),
            and gradients are reduced over data x context (``grid.data_context_group``).
        expert_parallel: EP for the model's ``nn.MoE`` layers: the grid's, fixed at init
            (``axonmpi.init(..., expert_parallel=EP)``; see :func:`axonmpi.parallel.moe.expert_parallel`).
            ``None``: the grid's. Another value raises ``ValueError`` naming the fix.
        expert_tensor_parallel: split the experts' hidden width over the tensor group instead
            (AxoNN style; needs ``tensor_parallel="axonn"``, whose batch split it shares).
        activation_checkpointing: ``None``; ``True`` (every child of the model, or every pipeline chunk);
            or fnmatch patterns on ``named_modules()``: those modules recompute their forward in backward.
        pipeline: a :class:`PipelinePlan` on a grid with ``G_inter > 1``: returns a :class:`PipelinedModule`.
        **strategy_options: keyword options of DDP or FSDP (``bucket_size_mb``, ``mixed_precision``, ...).

    Returns:
        A :class:`ParallelModule` ``pm``; ``pm.local_batch(x, y)`` gives this rank's rows (and tokens),
        and after ``loss.backward()`` (``loss`` the mean over those rows) every gradient is that of
        the mean loss over the global batch. With ``pipeline``: ``pm.step(xb, yb)``.

    Raises:
        ValueError / TypeError: an unknown option, a grid whose sizes do not fit the options.
        NotImplementedError: the refusals listed in ``docs/parallelize.md`` (each with its reason).

    Example:
        >>> axonmpi.init(G_intra_c=2, G_inter=2, G_context=2)              # 16 ranks: 2 data x ...
        >>> pm = parallelize(model, tensor_parallel={"*.attn": "attention", "*.mlp.fc": "column",
        ...                  "*.mlp.proj": "row"}, sequence_parallel=True, context_parallel="ring",
        ...                  pipeline=PipelinePlan(num_microbatches=2, schedule="zb-h1"))
        >>> xb, yb = pm.local_batch(x, y); loss = pm.step(xb, yb)
    """
    from .pipeline.staged import LayerBuilder
    grid = get_grid() if grid is None else grid
    r = grid.rank
    if isinstance(module, LayerBuilder):
        module, pipeline = _build_stages(module, grid, pipeline)
    if not isinstance(module, Module):
        raise TypeError(f"parallelize needs an axonmpi.nn.Module or a LayerBuilder, got {type(module).__name__}")
    if data_parallel not in _DATA:
        raise ValueError(f"rank {r}: data_parallel={data_parallel!r}; expected 'ddp', 'fsdp' or None")
    if not (tensor_parallel is None or tensor_parallel == "axonn" or isinstance(tensor_parallel, dict)):
        raise ValueError(f"rank {r}: tensor_parallel={tensor_parallel!r}; expected None, 'axonn' or a dict "
                         "{pattern: 'column' | 'column_gather' | 'row' | 'vocab' | 'attention'}")
    if sharding_strategy is not None and data_parallel != "fsdp":
        raise ValueError(f"rank {r}: sharding_strategy={sharding_strategy!r} needs data_parallel='fsdp'")
    if tensor_parallel is None and grid.G_intra > 1:
        raise ValueError(f"rank {r}: the grid has a tensor block of {grid.G_intra} ranks but tensor_parallel "
                         "is None; pass 'axonn' or a Megatron plan")
    if isinstance(tensor_parallel, dict) and (grid.G_intra_r > 1 or grid.G_intra_d > 1):
        raise ValueError(f"rank {r}: a Megatron plan is 1-D over the grid's tensor group; the grid has "
                         f"G_intra_r={grid.G_intra_r}, G_intra_d={grid.G_intra_d} (use G_intra_c or 'axonn')")
    if pipeline is not None:
        if not isinstance(pipeline, PipelinePlan):
            raise TypeError(f"rank {r}: pipeline={pipeline!r}; expected a PipelinePlan(num_microbatches, schedule)")
        if grid.G_inter == 1:
            raise ValueError(f"rank {r}: pipeline={pipeline} needs a grid with G_inter > 1 (axonmpi.init(G_inter=p))")
        hybrid = False
        if data_parallel == "fsdp" and sharding_strategy is not None:
            from .fsdp import ShardingStrategy
            hybrid = ShardingStrategy.coerce(sharding_strategy) is ShardingStrategy.HYBRID_SHARD
            if ShardingStrategy.coerce(sharding_strategy) is ShardingStrategy.NO_SHARD:
                raise ValueError(f"rank {r}: sharding_strategy={sharding_strategy!r} with pipeline=: no_shard is "
                                 "DDP (data_parallel='ddp')")
        allowed = ({"hybrid_shard_size"} if hybrid else set()) | ({"mixed_precision"} if data_parallel == "fsdp" else set())
        if set(strategy_options) - allowed:
            raise ValueError(f"rank {r}: options {sorted(strategy_options)} are DDP's / FSDP's; with pipeline= the "
                             "Pipeline reduces each stage (no options but FSDP's mixed_precision and hybrid_shard's "
                             "hybrid_shard_size)")
    elif grid.G_inter > 1 and data_parallel is not None:
        raise ValueError(f"rank {r}: on a pipeline grid (G_inter={grid.G_inter}) pass pipeline=PipelinePlan(...), "
                         "or parallelize each stage with data_parallel=None for a Pipeline you build")
    if strategy_options and data_parallel is None:
        raise ValueError(f"rank {r}: options {sorted(strategy_options)} need data_parallel='ddp' or 'fsdp'")
    if sequence_parallel and not isinstance(tensor_parallel, dict):
        raise ValueError(f"rank {r}: sequence_parallel=True needs a Megatron plan (tensor_parallel={{pattern: "
                         f"'column' | 'row'}}), got tensor_parallel={tensor_parallel!r}")
    cp_size = getattr(grid, "G_context", 1)
    if context_parallel is not None and cp_size == 1:
        raise ValueError(f"rank {r}: context_parallel={context_parallel!r} needs a grid with G_context > 1 "
                         "(axonmpi.init(G_context=N))")
    if cp_size > 1 and context_parallel is None:
        raise ValueError(f"rank {r}: the grid has G_context={cp_size}; pass context_parallel='ring' | 'ulysses'")
    if expert_tensor_parallel and tensor_parallel != "axonn":
        raise ValueError(f"rank {r}: expert_tensor_parallel=True splits the batch over the tensor block as "
                         f"AxoNN's easy mode does; pass tensor_parallel='axonn' (got {tensor_parallel!r})")
    from ..models.gpt import GPT
    from ..nn.moe import MoE
    from .grad_sync import data_reduction_group
    from .moe import expert_parallel as _ep, expert_parameters
    has_moe = any(isinstance(m, MoE) for m in module.modules())
    if (expert_parallel or 1) > 1 and not has_moe:
        raise ValueError(f"rank {r}: expert_parallel={expert_parallel} but the model has no nn.MoE layer")
    expert_parallel = grid.check_expert_parallel(grid.expert_parallel if expert_parallel is None
                                                 else expert_parallel) if has_moe else 1
    dgroup = data_reduction_group(grid)
    # [Note: a GPT's sequence parallelism] is entered inside its forward (after the embeddings, which number the
    # tokens) and left at a "column_gather" head: pm(x) takes and gives whole sequences
    gpt_sp = bool(sequence_parallel) and isinstance(module, GPT) and grid.intra_group.size > 1
    axonn = tensor_parallel == "axonn"
    # 1 tensor parallel + sequence parallel
    if axonn:
        _axonn(module, grid)
    elif isinstance(tensor_parallel, dict):
        sp = int(sequence_dim) if sequence_parallel else None
        tied = _tied_slots(module)
        if _megatron(module, grid, tensor_parallel, sp, in_forward=gpt_sp) == 0:
            raise ValueError(f"rank {r}: no module of the model matches the plan {tensor_parallel}; names: "
                             f"{[n for n, _ in module.named_modules() if n][:20]}")
        _retie(module, tied, r)
        if gpt_sp:     # a GPT enters the region at its embedding dropout (its input is token ids)
            from .tensor import ColumnParallelLinear, SequenceParallelDropout
            if not (type(module.lm_head) is ColumnParallelLinear and module.lm_head.gather_output):
                raise ValueError(f"rank {r}: a GPT under sequence_parallel leaves the sequence-parallel region at "
                                 f"lm_head: make it 'column_gather' in the plan (a tied head with wte 'vocab': one "
                                 f"replicated Parameter and would give this rank's tokens only)")
            module.drop = SequenceParallelDropout(module.drop.p, grid.intra_group)
    # 2 context parallel
    cp_layers = _swap_attention_for_context(module, grid, context_parallel) if cp_size > 1 else []
    # 3 expert parallel
    if has_moe:
        _ep(module, expert_parallel, grid=grid, expert_tensor_parallel=expert_tensor_parallel,
            stats_group=dgroup if cp_size > 1 and not expert_tensor_parallel else None)
    if has_moe and grid.intra_group.size > 1 and (sequence_parallel or (axonn and not expert_tensor_parallel)):
        _moe_statistics_groups(module, grid, dgroup if cp_size > 1 else grid.group_for("data"), axonn)
    experts = expert_parameters(module)
    _record_full_shapes(module)
    sp_params = _sequence_parallel(module, grid, (module.wte, module.wpe) if gpt_sp else ()) \
        if sequence_parallel and grid.intra_group.size > 1 else []
    if cp_size > 1:
        from ..distributed.placement import add_placement
        for p in module.parameters():
            add_placement(p, replica=grid.context_group)
        if isinstance(module, GPT) and pipeline is None:   # a GPT takes whole sequences and keeps its tokens itself
            from .context.gpt import ContextParallelism, _context_parallel_class
            from .context.layout import CPAlgo
            module.context_parallel = ContextParallelism(grid.context_group, CPAlgo.coerce(context_parallel),
                                                         cp_layers)
            module.__class__ = _context_parallel_class(type(module))   # the model knows nothing of CP
    # 4 activation checkpointing (with a pipeline: True checkpoints each chunk)
    if activation_checkpointing not in (None, False) and not (pipeline is not None and activation_checkpointing is True):
        _checkpoint_modules(module, activation_checkpointing, r)
    # 6 the pipeline, over the stages of steps 1-4 (its runtime is step 5's reducer)
    if pipeline is not None:
        fsdp_groups = None
        if hybrid:        # [Note: FSDP in a pipeline]: shard over the shard group, all-reduce over the replicas
            from .fsdp import ShardingStrategy
            from .fsdp.runtime import _resolve_groups
            if experts:
                raise NotImplementedError(
                    f"rank {r}: hybrid shard with expert_parallel={expert_parallel} in a pipeline is not built: an "
                    "expert's replicas (its expert-data group) are not those of the hybrid shard groups; use "
                    "full_shard or shard_grad_op")
            fsdp_groups = _resolve_groups(dgroup, ShardingStrategy.HYBRID_SHARD, strategy_options.get("hybrid_shard_size"))
        return _pipeline(module, grid, pipeline, tensor_parallel, data_parallel, sp_params,
                         int(sequence_dim) if sequence_parallel else None, activation_checkpointing is True,
                         cp_size > 1, fsdp_groups=fsdp_groups, mixed_precision=strategy_options.get("mixed_precision"))
    # 5 data parallel over each parameter's replica group
    reducer = GradReducer("parallelize")
    hooked = [p for p in sp_params if data_parallel != "fsdp" or any(p is q for q in experts)]   # FSDP: outside its flats
    if hooked:
        # hooked before DDP's (and the experts') hooks: each gradient is summed over the tensor group first
        reducer.hook(hooked, lambda p: (grid.intra_group,))
    wrapped = module
    cls = ParallelModule
    if data_parallel == "ddp" and not axonn:
        from .ddp import DistributedDataParallel
        if experts:
            strategy_options = dict(strategy_options, ignored_parameters=experts)
        wrapped = DistributedDataParallel(module, group=dgroup, **strategy_options)
    elif data_parallel == "ddp" and strategy_options:
        raise ValueError(f"rank {r}: AxoNN layouts reduce through the gradient-sync table; DDP options "
                         f"{sorted(strategy_options)} do not apply")
    elif data_parallel == "fsdp":
        from .fsdp import FSDP
        opts = dict(strategy_options)
        if sharding_strategy is not None:
            opts["sharding_strategy"] = sharding_strategy
        with _hidden(module, experts):     # [Note: FSDP with expert parallelism]
            wrapped = FSDP(module, group=dgroup, **opts)
        # FSDP alone keeps FSDP's own state form; over cut parameters the placements' (ParallelModule's)
        cls = _FSDPExpertModule if experts else _FSDPParallelModule if tensor_parallel is None else ParallelModule
        if tensor_parallel is not None:
            # run by FSDP's reducer (a part of the model's) after its reduce-scatter
            _reduce_fsdp_segments(wrapped.grad_reducer, list(wrapped.parameters()), grid, axonn, sp_params)
    pm = cls(module, grid, tensor_parallel, data_parallel, wrapped, module, reducer)
    pm._context(cp_size > 1, context_parallel)
    if sequence_parallel and not gpt_sp:
        pm.sequence_dim = int(sequence_dim)
    if experts and (data_parallel == "fsdp" or (data_parallel == "ddp" and not axonn)):
        pm._hook_experts(experts)
    return pm


@contextlib.contextmanager
def _hidden(module: Module, params):
    """``params`` left out of ``module``'s parameters while inside (their slots hold ``None``), put back after."""
    ids = {id(p) for p in params}
    slots = [(m, n, p) for m in module.modules() for n, p in m._parameters.items() if p is not None and id(p) in ids]
    for m, n, _ in slots:
        m._parameters[n] = None
    try:
        yield
    finally:
        for m, n, p in slots:
            m._parameters[n] = p
def _moe_statistics_groups(module: Module, grid: ProcessGrid, data, axonn: bool) -> None:
    """Every MoE's routing statistics (router losses) over the global tokens when the tensor group holds
    other tokens: summed over it too -- under sequence parallelism (its tokens of the sequences: the
    gradient passed back as is) and in AxoNN's easy mode (its rows of the batch: one more batch group)."""
    from ..nn.moe import MoE
    how = "AxoNN's easy mode (rows over data x tensor)" if axonn else "sequence_parallel"
    for name, m in module.named_modules():
        if isinstance(m, MoE):
            if m.capacity_factor is not None:
                raise NotImplementedError(
                    f"rank {grid.rank}: {name!r} has capacity_factor={m.capacity_factor} under {how}: its global "
                    "queue orders the tokens over one group of consecutive batch slices; use a dropless MoE "
                    "(capacity_factor=None), or a Megatron plan without sequence parallelism")
            if axonn:
                m.stats_group = (data, grid.intra_group)
            else:
                m.sequence_group = grid.intra_group


def _whole_first_layer(chunks, grid: ProcessGrid, sp_dim: Optional[int]) -> Optional[Module]:
    """The first layer of the pipeline's first stage when it is on this rank, the model runs sequence parallel,
    and the layer holds nothing split over the tensor group: it then runs on the whole sequence."""
    from ..distributed.placement import placement_of
    g = grid.intra_group
    if sp_dim is None or g.size == 1:
        return None
    for c in chunks:
        if getattr(c, "stage_index", None) == 0 and len(c) > 0:
            first = c[0]
            split = any(s.group is g or getattr(s.group, "ranks", None) == g.ranks
                        for p in first.parameters() for s in placement_of(p).shards)
            return None if split else first
    return None


def _boundaries_whole(chunks, grid: ProcessGrid) -> bool:
    """Whether every stage boundary carries an activation each Megatron tensor rank holds whole, so that each
    may send ``1/t`` of it ([Note: scatter / gather between stages]): no cut between a column-parallel layer
    (its output split over the tensor group) and the row-parallel layer that reads it.  Each rank tells its
    chunks' effect (opens / closes such a region, or neither); every rank decides on the same list."""
    from ..distributed.object_collectives import all_gather_object
    from .tensor.layers import ColumnParallelLinear, RowParallelLinear
    mine = []
    for c in chunks:
        last = None
        for m in c.modules():
            if isinstance(m, ColumnParallelLinear):
                last = "closes" if m.gather_output else "opens"
            elif isinstance(m, RowParallelLinear):
                last = "closes"
        mine.append((c.stage_index, last))
    effects = dict(e for got in all_gather_object(mine, group=grid.inter_group) for e in got)
    split = False
    for s in sorted(effects)[:-1]:
        split = {"opens": True, "closes": False}.get(effects[s], split)
        if split:
            return False
    return True


def _pipeline(module, grid, plan: PipelinePlan, tensor_parallel, data_parallel, sp_params, sp_dim,
              checkpoint_chunks: bool, cp: bool, *, fsdp_groups=None, mixed_precision=None) -> "PipelinedModule":
    """Step 6: cut the (already laid-out) model into the schedule's stages, each chunk on the rank the
    schedule runs it on (``schedule.stage_ranks``: ZBV's V, never a permuted model), and run them in a
    :class:`Pipeline` that reduces each stage over data x context (the grad-sync table)."""
    from ..nn import functional as F
    from .grad_sync import data_reduction_group
    from .pipeline import Pipeline, make_schedule, split_module
    sched = make_schedule(plan.schedule, grid.G_inter, plan.num_microbatches, plan.virtual_stages)
    chunks = split_module(module, grid.G_inter, sched.virtual_stages, by=plan.split_by, boundaries=plan.boundaries,
                          group=grid.inter_group, stage_ranks=sched.stage_ranks, tied=True)
    tied, shared = _tied_weights(module, grid, sched, plan)
    from ..models.gpt import GPT, GPTEmbedding, GPTHead
    axonn = tensor_parallel == "axonn"
    shard, replicate = fsdp_groups or (data_reduction_group(grid) if data_parallel == "fsdp" else None, None)
    gpt = isinstance(module, GPT) or any(isinstance(m, GPTEmbedding) for c in chunks for m in c.modules())
    whole = None if gpt else _whole_first_layer(chunks, grid, sp_dim)
    if whole is not None:       # [Note: the first layer runs on the whole sequence]
        skip = {id(p) for p in whole.parameters()}
        for p in whole.parameters():
            p.sequence_parallel = False
        sp_params = [p for p in sp_params if id(p) not in skip]
    if cp and gpt:      # its embedding stage numbers this rank's tokens (pm.local_batch) at their positions
        from .context.gpt import context_parallel_embedding
        for m in (m for c in chunks for m in c.modules() if isinstance(m, GPTEmbedding)):
            context_parallel_embedding(m, module)
    stages = [_Stage(c, grid, axonn=axonn, sequence_dim=sp_dim, checkpointed=checkpoint_chunks, shard_group=shard,
                     shared=shared)
              for c in chunks]
    for st, c in zip(stages, chunks):     # [Note: a GPT's sequence parallelism]: its ends enter / leave themselves
        st.enters_itself = any(isinstance(m, GPTEmbedding) for m in c.modules())
        st.leaves_itself = any(isinstance(m, GPTHead) for m in c.modules())
        st.whole_first = whole is not None and len(c) > 0 and c[0] is whole
    aux = plan.aux_loss
    if aux is None and isinstance(module, GPT) and module.config.moe_experts and (
            module.config.moe_aux_loss_coeff or module.config.moe_z_loss_coeff):
        from ..nn.moe import moe_loss
        c = module.config
        aux = lambda chunk: moe_loss(chunk, c.moe_aux_loss_coeff, c.moe_z_loss_coeff)  # noqa: E731
    if aux is not None and checkpoint_chunks:
        raise NotImplementedError(
            f"rank {grid.rank}: auxiliary (router) losses with activation_checkpointing=True in a pipeline are not "
            "built: a recomputed chunk's forward keeps no graph, so its router losses could not join the backward; "
            "checkpoint the blocks without MoE layers (patterns), or set the router losses' coefficients to 0")
    # a Megatron tensor group holds the same boundary activations: each rank sends 1/t ([Note: scatter / gather
    # between stages]); AxoNN's tensor block reads other rows, so its ranks send their own whole
    pipe = Pipeline(stages, sched, loss_fn=plan.loss_fn or F.cross_entropy, group=grid.inter_group,
                    data_group=data_reduction_group(grid), track_memory=False, ignore_index=plan.ignore_index,
                    scatter_group=None if axonn or not _boundaries_whole(chunks, grid) else grid.intra_group,
                    aux_loss=None if aux is None else lambda st: aux(st.body))
    pm = PipelinedModule(module, grid, tensor_parallel, data_parallel, pipe, stages)
    pm._replicate, pm._mixed_precision = replicate, mixed_precision
    pm._tied = tied
    flats = pm._flats()
    in_flat = {id(q) for f in flats for q in f.params}
    _reduce_fsdp_segments(pm.grad_reducer, flats, grid, axonn, [p for p in sp_params if id(p) in in_flat])
    if grid.intra_group.size > 1:        # used on sequence shards: the whole step's gradient summed once
        mine = {id(p) for p in pipe.parameters()}
        pm.grad_reducer.after_backward([p for p in sp_params if id(p) in mine and id(p) not in in_flat],
                                       lambda p: (grid.intra_group,))
    pm._context(cp, None)
    return pm


def _build_stages(builder, grid: ProcessGrid, plan: Optional[PipelinePlan]):
    """A :class:`~axonmpi.parallel.pipeline.LayerBuilder` -> the model as this rank holds it (its stages'
    layers only) and the plan with the cut it was built for (step 6 cuts there); no pipeline: the whole model."""
    from dataclasses import replace
    from .pipeline import make_schedule
    if grid.G_inter == 1 or not isinstance(plan, PipelinePlan):
        return builder.build(), plan
    sched = make_schedule(plan.schedule, grid.G_inter, plan.num_microbatches, plan.virtual_stages)
    model, starts = builder.build_stage(grid.G_inter, sched.virtual_stages, grid.inter_group.rank,
                                        stage_ranks=sched.stage_ranks, by=plan.split_by, boundaries=plan.boundaries)
    return model, replace(plan, boundaries=tuple(starts[1:]))


def _tied_weights(module: Module, grid: ProcessGrid, sched, plan: PipelinePlan):
    """[Note: a weight tied across stages]  A parameter used by chunks on two pipeline ranks (a GPT's head
    tied to its embedding, GPT-2's) is held by both, as Megatron holds the word embeddings on the first and
    last stage: after each step's backward its gradient is summed over the ranks holding it (their
    "embedding group", made here over the pipeline group), so both copies see the serial gradient and stay
    equal under the same optimizer.  The copies on the later stages are marked ``tied_copy``: clipping
    counts the weight once, on the earliest stage; state dicts name it under its serial names.  Under FSDP
    such a weight stays whole, out of the stages' flat shards.
    Returns ``[(parameter, group)]`` for this rank's tied parameters and the ids of those used by two chunks."""
    from .pipeline import split_module
    p = grid.G_inter
    holders: Dict[int, Tuple[Any, Dict[int, int]]] = {}       # id -> (param, {pipeline rank: first stage})
    uses: Dict[int, int] = {}
    for q in range(p):
        for c in split_module(module, p, sched.virtual_stages, by=plan.split_by, boundaries=plan.boundaries,
                              rank=q, stage_ranks=sched.stage_ranks, tied=True):
            for prm in c.parameters():
                ranks = holders.setdefault(id(prm), (prm, {}))[1]
                ranks[q] = min(ranks.get(q, c.stage_index), c.stage_index)
                uses[id(prm)] = uses.get(id(prm), 0) + 1
    out = []
    me = grid.inter_group.rank
    for prm, ranks in holders.values():
        if len(ranks) < 2:
            continue
        order = sorted(ranks, key=ranks.get)           # the earliest stage's rank first
        g = grid.world.new_group([grid.inter_group.ranks[q] for q in order], parent=grid.inter_group,
                                 name="embedding")
        if me in ranks:
            prm.tied_copy = me != order[0]
            out.append((prm, g))
    return out, frozenset(k for k, n in uses.items() if n > 1)


def full_state_dict(pm: Module) -> "OrderedDict[str, np.ndarray]":
    """The serial state dict of a parallelized model (collective): serial names, full shapes, every rank.

    Works on a :class:`ParallelModule`, an FSDP model, a model holding tensor-parallel layers, or a
    plain module.

    Example:
        >>> sd = axonmpi.parallel.full_state_dict(pm)
        >>> serial.load_state_dict(sd)
    """
    from .fsdp import FSDP
    if isinstance(pm, ParallelModule):
        return pm.module.state_dict() if type(pm) is _FSDPParallelModule else pm.sharded_state().full_state_dict()
    if isinstance(pm, FSDP):
        return pm.state_dict()
    return ShardedState(pm).full_state_dict()
