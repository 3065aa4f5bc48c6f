"""``ParallelModule`` (a model under ``parallelize``) and ``PipelinedModule`` (one with a pipeline), and the
sequence region both run their units in."""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Dict, List, Optional

import numpy as np

from ..autograd.tensor import Tensor
from ..nn.module import Module
from .grad_sync import GradReducer, no_sync as _no_sync
from .state import ShardedState

__all__ = ["ParallelModule", "PipelinedModule", "Stage", "in_region"]


def _raw(a):
    return a.data if isinstance(a, Tensor) else a


def in_region(run, x, c, *, enters: bool, leaves: bool):
    """Run ``run(x)`` (a model or a pipeline stage) in the sequence-parallel region: ``x`` scattered along the
    sequence over the tensor group unless the unit ``enters`` the region itself (it holds the declared
    :class:`~axonmpi.parallel.plan.SequenceRegion`'s ``enter``), the output gathered unless it ``leaves``."""
    if not c.sp:
        return run(x)
    from .tensor import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region
    g, d = c.grid.intra_group, int(c.sequence_dim)
    if not enters:
        x = scatter_to_sequence_parallel_region(x if isinstance(x, Tensor) else Tensor(x), g, dim=d)
    y = run(x)
    if leaves:
        return y
    if isinstance(y, tuple):          # a model that returns (logits, loss): each output gathered, None kept
        return tuple(o if o is None else gather_from_sequence_parallel_region(o, g, tensor_parallel_output_grad=False,
                                                                             dim=d) for o in y)
    return gather_from_sequence_parallel_region(y, g, tensor_parallel_output_grad=False, dim=d)


class ParallelModule(Module):
    """A model under :func:`parallelize`: forward as the serial model on this rank's rows (and tokens).

    Attributes:
        module: the model with its tensor-parallel layers (wrapped in DDP or FSDP when asked).
        grid: the :class:`~axonmpi.distributed.ProcessGrid` it is laid out on.
        batch_shards: ``(number of batch shards, this rank's shard)``: the data replicas, times the tensor
            block's ranks in AxoNN's easy mode.
        grad_reducer: the model's finalize step ([Note: the finalize step]); DDP's / FSDP's reducers are its parts.
    """

    def __init__(self, module: Module, c, wrapped: Module, reducer: Optional[GradReducer] = None):
        super().__init__()
        self.grad_reducer = GradReducer("parallelize") if reducer is None else reducer
        if wrapped is not module and isinstance(getattr(wrapped, "grad_reducer", None), GradReducer):
            self.grad_reducer.add_part(wrapped.grad_reducer)
        self.module = wrapped
        self._inner = [module]           # the unwrapped model (not a submodule: no duplicate names)
        self._c = [c]
        g = self.grid = c.grid
        self.tensor_parallel, self.data_parallel = c.tensor, c.data
        n = g.G_data * (g.G_intra if c.axonn else 1)
        k = g.coords.data * (g.G_intra if c.axonn else 1) + (g.intra_group.rank if c.axonn else 0)
        self.batch_shards = (n, k)
        self.batch_groups = (g.intra_group,) if c.axonn else ()
        self.depth_group = g.depth_group
        self.context = (g.context_group, c.context) if c.cp else None
        self.sequence_dim: Optional[int] = int(c.sequence_dim) if c.sp else None

    @property
    def inner(self) -> Module:
        """The model with its tensor-parallel layers (not wrapped by DDP/FSDP)."""
        return self._inner[0]

    @property
    def composition(self):
        """The :class:`~axonmpi.parallel.axes.Composition` record of the ``parallelize`` call."""
        return self._c[0]

    def no_sync(self):
        """Inside, no path reduces a gradient of this model (DDP, FSDP, the finalize step, the pipeline); the
        first backward (``step``) outside reduces the accumulated sum once (:func:`axonmpi.parallel.no_sync`).

        Example:
            >>> with pm.no_sync():
            ...     F.cross_entropy(pm(x0), y0).backward()       # accumulated locally
            >>> F.cross_entropy(pm(x1), y1).backward()           # reduced once: the serial sum of both
        """
        return _no_sync(self)

    @contextlib.contextmanager
    def whole_sequences(self):
        """Inside, context-parallel attention runs whole sequences on this rank alone (sampling on one rank)."""
        from .axes.context import whole_sequences
        with whole_sequences(self.composition.attention):
            yield

    def forward(self, *args, **kwargs):
        c = self.composition
        if not (c.sp and args):
            return self.module(*args, **kwargs)
        return in_region(lambda x: self.module(x, *args[1:], **kwargs), args[0], c,
                         enters=c.enter is not None, leaves=c.leave is not None)

    def local_batch(self, *arrays):
        """This rank's rows of the global batch (equal contiguous slices over the batch shards), and under
        context parallelism its tokens of each sequence.

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
            out.append(self.local_tokens(Tensor(piece) if isinstance(a, Tensor) else piece))
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
                whole = int(np.shape(piece)[d])
                for a in self.composition.attention:      # the whole length, for an uneven split
                    a.seq_len = whole
                piece = ContextLayout(whole, cg.size, algo).split(piece, cg.rank, axis=d)
            out.append(Tensor(piece) if isinstance(a, Tensor) else piece)
        return out[0] if len(out) == 1 else tuple(out)

    def token_groups(self) -> List[Any]:
        """The groups whose ranks read different targets of the global batch: data (x context) with a data axis,
        and the tensor block in AxoNN's easy mode (never a Megatron tensor group: its ranks read the same rows)."""
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
            A scalar Tensor, the global token mean on every rank; ``backward()`` gives every parameter the
            serial gradient of that mean (collective over :meth:`token_groups`).

        Example:
            >>> lsum = F.cross_entropy(pm(xb), yb, ignore_index=-100, reduction="sum")
            >>> loss = pm.token_mean(lsum, num_tokens=int((yb != -100).sum())); loss.backward()
        """
        from .token_mean import token_mean
        shards = None
        if self.tensor_parallel == "axonn" and self.data_parallel is None:
            # the finalize step divides by every batch shard (x context)
            shards = self.batch_shards[0] * getattr(self.grid, "G_context", 1)
        return token_mean(loss_sum, num_tokens, self.token_groups(), shards=shards)

    def named_parameters(self, prefix: str = "", recurse: bool = True):
        """The model's own parameters under their serial names and shapes, as ``model.named_parameters()`` gives
        them, in every layout (under FSDP the originals, each stepping its piece of the flat chunk: FSDP1's
        ``use_orig_params=True``; [Note: a parameter keeps its identity]).  The flat chunks themselves are
        :meth:`flat_parameters`."""
        yield from self.inner.named_parameters(prefix, recurse)

    def parameters(self, recurse: bool = True):
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def flat_parameters(self) -> List[Any]:
        """FSDP's flat chunks (``FlatParameter``; empty without FSDP): what FSDP's own ``optim_state_dict``
        reads, for an optimizer that steps whole chunks."""
        return self._flats()

    def named_modules(self, memo=None, prefix: str = ""):
        """This module (as ``prefix``), then the model's modules under their serial names, as the model's own
        ``named_modules()`` gives them (the DDP / FSDP wrapper left out; [Note: a parameter keeps its identity])."""
        memo = set() if memo is None else memo
        if id(self) in memo:
            return
        memo.add(id(self))
        yield prefix, self
        for n, m in self.inner.named_modules(memo, prefix):
            if m is not self.inner:
                yield n, m

    def train(self, mode: bool = True) -> Module:
        """Training mode on every module of the tree: the model's, the wrapper's and this one."""
        for _, m in Module.named_modules(self):
            m.__dict__["training"] = bool(mode)
        for m in self.inner.modules():
            m.__dict__["training"] = bool(mode)
        return self

    # -- state: one form, by placements (parallel/state.py) -------------------------------------------
    def _flats(self) -> List[Any]:
        from ._flat import FlatParameter
        return [p for p in self.module.parameters() if isinstance(p, FlatParameter)]

    def sharded_state(self) -> ShardedState:
        """This rank's model and optimizer state by placements (:class:`~axonmpi.parallel.state.ShardedState`);
        under FSDP each piece is read from (and written to) FSDP's flat chunks."""
        return ShardedState(self.inner, flats=self._flats(), rank=self.grid.rank)

    def state_dict(self):
        """The full serial state dict (collective): serial names, full shapes, frozen parameters and buffers, on
        every rank."""
        return self.sharded_state().full_state_dict()

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load a full serial state dict (any layout's) or a :meth:`sharded_state_dict` filled by
        ``checkpoint.load``; each rank keeps its pieces.  ``strict``: a missing or unexpected key raises."""
        return self.sharded_state().load_state_dict(state_dict, strict)

    def sharded_state_dict(self) -> "OrderedDict[str, Any]":
        """Serial names; each parameter as this rank's ``ShardedArray`` block of the full array (by placement)."""
        return self.sharded_state().sharded_state_dict()

    def optim_state_dict(self, optimizer) -> Dict[str, Any]:
        """The optimizer's state (AdamW's, or a ZeRO-1 wrapper's) under serial parameter names, each moment as
        its parameter's ``ShardedArray`` block of the full array: saved by ``training_state(pm, opt)``, loadable
        under any layout, or (read as full arrays) into the plain model's optimizer."""
        return self.sharded_state().optim_state_dict(optimizer)

    def load_optim_state_dict(self, optimizer, state_dict: Dict[str, Any]) -> None:
        """Load an :meth:`optim_state_dict` saved under any layout into ``optimizer`` (built on ``pm.parameters()``)."""
        self.sharded_state().load_optim_state_dict(optimizer, state_dict)

    def extra_repr(self) -> str:
        return (f"tensor_parallel={self.tensor_parallel!r}, data_parallel={self.data_parallel!r}, "
                f"batch_shards={self.batch_shards[0]}")


class Stage(Module):
    """One pipeline chunk as the composer runs it: in the sequence region at its ends (the activations between
    stages are whole sequences), checkpointed as one unit when asked, its FSDP flat shard, and the groups the
    Pipeline reads to reduce it (AxoNN's batch groups and depth group)."""

    def __init__(self, chunk: Module, c, *, flat=None, extra=()):
        super().__init__()
        self._c = [c]
        self.batch_groups = (c.grid.intra_group,) if c.axonn else ()
        self.depth_group = c.grid.depth_group
        self.enters = c.enter is not None and any(m is c.enter for m in chunk.modules())
        self.leaves = c.leave is not None and any(m is c.leave for m in chunk.modules())
        self.flat = flat
        if flat is None:
            self.chunk = chunk
            return
        self._chunk = [chunk]        # FSDP: the Pipeline sees the flat shard (and what stays whole), not the chunk
        for i, p in enumerate(extra):
            self.register_parameter(f"whole_{i}", p)

    @property
    def body(self) -> Module:
        """The chunk this stage runs (FSDP: held aside, its parameters in the flat shard)."""
        return self._chunk[0] if "_chunk" in self.__dict__ else self.chunk

    def forward(self, x):
        return in_region(self.body, x, self._c[0], enters=self.enters, leaves=self.leaves)


class PipelinedModule(ParallelModule):
    """A model under :func:`parallelize` with ``pipeline=``: this rank's stages in a :class:`Pipeline`.

    ``pm.step(xb, yb)`` runs one training step's forward and backward over the micro-batches (``xb, yb`` from
    :meth:`local_batch`; every rank passes them), then the finalize step, and returns the serial mean loss of the
    global batch on every rank; ``pm.parameters()`` are this rank's stage parameters; ``pm.state_dict()`` is the
    whole serial state dict (collective over the grid); ``pm.sharded_state_dict()`` / ``pm.optim_state_dict(opt)``
    give this rank's stages' blocks and ``load_state_dict`` / ``load_optim_state_dict`` take either form saved
    under any layout.
    """

    def __init__(self, module: Module, c, pipe, stages):
        super().__init__(module, c, module)
        self.pipeline = pipe
        self._stages = list(stages)
        self._mixed_precision = c.strategy_options.get("mixed_precision") if c.data == "fsdp" else None
        self.grad_reducer.add_part(pipe.grad_reducer)     # each stage over data x context, after its last backward

    def forward(self, *args, **kwargs):
        raise TypeError(f"rank {self.grid.rank}: a pipelined model runs by micro-batches: call pm.step(xb, yb) "
                        "(training) or pm.eval_step(xb, yb), not pm(x)")

    def step(self, inputs, targets, *, scaler=None) -> float:
        """Forward and backward of this rank's rows (:meth:`local_batch`), then the finalize step; returns the
        global batch's mean loss.  ``scaler`` (an :class:`axonmpi.amp.GradScaler`): each micro-batch's loss is
        scaled (:meth:`Pipeline.step`); then ``scaler.unscale_(opt)``, clip, ``scaler.step(opt)``, ``scaler.update()``."""
        from .finalize import finalize_grads
        flats = self._flats()
        mp = self._mixed_precision
        for f in flats:                          # [Note: FSDP in a pipeline]
            f.unshard(dtype=None if mp is None else mp.param_dtype)
            f.bind_grads()
        loss = self.pipeline.step(inputs, targets, scaler=scaler)     # its part: each stage over data x context
        finalize_grads(self)                     # flats' reduce-scatter, tied copies, partial sums, segments
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
        """This rank's stages' parameters under their serial names and shapes (under FSDP the originals, each
        stepping its piece of its stage's flat chunk), each once."""
        mine = {id(p) for p in self.pipeline.parameters()}
        mine |= {id(q) for f in self._flats() for q in f.params}
        for n, p in self.inner.named_parameters(prefix, recurse):
            if id(p) in mine:
                yield n, p

    def parameters(self, recurse: bool = True):
        """This rank's stages' parameters, each once (a weight tied between two chunks of this rank: ZBV's V)."""
        return [p for _, p in self.named_parameters(recurse=recurse)]

    def sharded_state(self) -> ShardedState:
        """This rank's stages' state (their FSDP flat chunks included), joined with the other stages' over the
        pipeline group."""
        return ShardedState(self.inner, modules=[st.body for st in self._stages], flats=self._flats(),
                            stage_group=self.grid.inter_group, rank=self.grid.rank)
