"""``Pipeline``: runs a schedule's action lists over MPI, micro-batch by micro-batch, and measures memory."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ... import trace as _trace
from ...autograd.grad_mode import enable_grad, no_grad
from ...autograd.function import backward as run_backward
from ...autograd.split_backward import backward_input
from ...autograd.tensor import Tensor
from ...backend import get_array_module, get_cupy, is_cupy_array
from ...distributed.collectives import all_reduce, broadcast
from ...distributed.object_collectives import all_gather_object
from ...distributed.group import ProcessGroup
from ...distributed.placement import Shard, ShardKind, add_placement, placement_of
from ...distributed.world import get_grid, resolve_group, role_group
from ...distributed.reduce_op import ReduceOp
from ...nn.module import Module
from ...random import fork_rng, initial_seed
from ._comm import HEADER_SIZE, _communicate, decode_header, encode_header, gather_pieces, piece_size, scatter_piece
from .schedules import (Action, ActionKind, PipelineSchedule, Schedule, _check_fifo, _recv_order, make_schedule,
                        simulate)
from .stage import PipelineStage
from ..grad_sync import GradReducer, check_group, mean_over, no_sync, reduction_groups, sharded_within
from ..token_mean import FROM_LOSS, check_counted_targets, global_count, resolve_ignore_index, token_groups_size

__all__ = ["Pipeline", "PipelineMemoryStats", "PipelineTiming"]


@dataclass(frozen=True)
class PipelineTiming:
    """Where this rank's time went in the last :meth:`Pipeline.step` (wall-clock seconds).

    Attributes:
        step_seconds: from the start of the action list to its end (transfers completed).
        forward_seconds / backward_seconds: time inside FORWARD / BACKWARD (or BACKWARD_INPUT) actions.
        forward_count / backward_count: how many of each ran.
        weight_seconds / weight_count: the same for BACKWARD_WEIGHT actions (zero-bubble schedules).
        span_seconds: from the start of the first compute action to the end of the last (the
            zero-bubble paper's bubble is ``span_seconds - busy_seconds``).
    """

    step_seconds: float
    forward_seconds: float
    backward_seconds: float
    forward_count: int
    backward_count: int
    weight_seconds: float = 0.0
    weight_count: int = 0
    span_seconds: float = 0.0

    @property
    def busy_seconds(self) -> float:
        """Compute time (forward + backward + weight gradients)."""
        return self.forward_seconds + self.backward_seconds + self.weight_seconds


@dataclass(frozen=True)
class PipelineMemoryStats:
    """Activation memory of this rank's stages during the last :meth:`Pipeline.step`, measured and predicted.

    Attributes:
        stages: the global stage ids on this rank.
        peak_in_flight: per stage, the most micro-batches whose activations were held at once (measured).
        predicted_in_flight: per stage, the same from :func:`simulate` (GPipe m, 1F1B p - stage, ...).
        peak_rank_in_flight / predicted_rank_in_flight: the same summed over the rank's stages at once.
        microbatch_bytes: per stage, the largest activation bytes one micro-batch held (the stage's
            input plus every array its autograd graph saved, parameters excluded).
        peak_activation_bytes: per stage, the most activation bytes held at once (measured).
        estimated_activation_bytes: per stage, ``predicted_in_flight x microbatch_bytes``.
    """

    stages: Tuple[int, ...]
    peak_in_flight: Dict[int, int]
    predicted_in_flight: Dict[int, int]
    peak_rank_in_flight: int
    predicted_rank_in_flight: int
    microbatch_bytes: Dict[int, int]
    peak_activation_bytes: Dict[int, int]
    estimated_activation_bytes: Dict[int, int]


def _graph_bytes(roots: Sequence[Tensor], exclude: set) -> int:
    """Bytes of the arrays the autograd graph behind ``roots`` keeps for backward (each counted once)."""
    seen_nodes, seen_arrays, total = set(), set(), 0
    stack = [t.grad_fn for t in roots if t is not None and t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if id(fn) in seen_nodes:
            continue
        seen_nodes.add(id(fn))
        saved = getattr(fn, "_saved", None) or ()
        extra = [a for v in getattr(fn, "__dict__", {}).values()     # arrays kept as attributes, or in a tuple
                 for a in (v if isinstance(v, (tuple, list)) else (v,))  # (a kernel's state: ctx.state = (..))
                 if hasattr(a, "nbytes") and hasattr(a, "dtype")]
        for a in list(saved) + extra:
            if a is None or not hasattr(a, "nbytes"):
                continue
            base = a if getattr(a, "base", None) is None else a.base
            if id(base) in seen_arrays or id(base) in exclude:
                continue
            seen_arrays.add(id(base))
            total += int(base.nbytes)
        for e in getattr(fn, "_edges", ()) or ():
            if e is not None and e[1] >= 0:
                stack.append(e[0])
    return total


def _microbatch_seed(base: int, step: int, stage: int, microbatch: int, replica: int = 0) -> int:
    """The seed of the random stream (dropout) of one stage on one micro-batch of one step.

    ``replica``: the rank in the data-parallel group (replica 0 keeps the stream of a run without
    data parallelism; the others draw their own masks for their own samples).
    """
    key = [base, step, stage, microbatch] + ([replica] if replica else [])
    return int(np.random.SeedSequence(key).generate_state(1, np.uint64)[0])


def _split_sizes(n: int, m: int) -> List[int]:
    q, extra = divmod(n, m)
    return [q + (1 if i < extra else 0) for i in range(m)]


def _raw(x):
    return x.data if isinstance(x, Tensor) else x


def _data_group(group: ProcessGroup, data_group: Optional[ProcessGroup]) -> Optional[ProcessGroup]:
    """``data_group`` if given; else the grid's data group when ``group`` is the grid's pipeline group."""
    if data_group is not None:
        return resolve_group(data_group)
    grid = get_grid()
    return grid.group_for("data") if group is grid.group_for("pipeline") else None


# [Note: auxiliary losses in a pipeline]
# A stage's auxiliary loss (a MoE's router losses) never reaches the last stage's loss, so the stage adds it
# to its own backward: micro-batch i's backward of stage s runs from two roots, the stage output (with the
# gradient received from stage s + 1) and ``aux_i / m`` (times the loss scale), in one pass.  The value is
# that of the global micro-batch i (a MoE sums its routing statistics over the ranks that split the batch,
# and its gradient is multiplied by that group's size, which the data-parallel mean divides out), so the
# gradients equal the serial model's for ``LM(batch) + (1/m) sum_i aux(micro-batch i)`` -- Megatron's rule
# (the auxiliary loss of each micro-batch, scaled by 1 / num_microbatches).  With one micro-batch that is
# the serial ``loss + model.moe_auxiliary_loss()``.  The reported loss stays the LM loss.


class Pipeline:
    """Pipeline-parallel training of model chunks over a process group, by a schedule.

    Each rank passes its stages (from :func:`split_module`, or :class:`PipelineStage` objects);
    :meth:`step` cuts the batch into ``num_microbatches`` micro-batches and executes exactly the
    rank's action list from :func:`make_schedule` (checked with :func:`simulate` at
    construction, so a schedule that would deadlock is refused before anything runs). Gradients
    accumulate into the parameters' ``.grad`` scaled so that they equal those of the mean loss
    over the whole batch; zero them and step the optimizer yourself.

    Dropout: each stage's forward on micro-batch ``i`` of step ``t`` draws from its own random
    stream seeded from ``(axonmpi.random.initial_seed(), t, stage, i)`` (and the rank in
    ``data_group`` when it is not 0, so data-parallel replicas draw different masks), so masks do
    not depend on the schedule or on how many pipeline ranks run it, and recomputation
    (activation checkpointing) sees the same masks.

    Data parallel: with ``data_group``, after the last backward each stage's gradients are
    averaged over ``data_group`` (the ranks holding the same stage for other data), and the
    returned loss is averaged there too, so replicas stay identical. Every stage parameter records
    the pipeline group in its placement (a ``STAGE`` shard), so ``clip_grad_norm_(params, max_norm)``
    gives the norm of the whole model on every rank (pass ``group=`` for a pipeline group that is
    not the grid's: every rank of it takes part, with parameters or not).

    Args:
        stages: this rank's chunks: a Module or :class:`PipelineStage`, or a list of ``virtual_stages`` of them
            (chunk k of pipeline rank r is global stage ``r + k p``).
        schedule: a :class:`PipelineSchedule` (or its value string), or a ready :class:`Schedule`.
        num_microbatches: micro-batches ``m`` per step (the batch may not divide evenly: the
            first ``B % m`` micro-batches take one more sample).
        loss_fn: ``loss_fn(output, target) -> scalar Tensor``, the mean over the micro-batch.
        ignore_index: integer targets equal to it are not counted: each micro-batch's mean loss is
            weighted by its number of counted targets (over the data-parallel replicas too), so the
            result is the mean over every counted target of the batch, as the serial model computes
            it.  Default: read from ``loss_fn`` (its one source: ``nn.CrossEntropyLoss(ignore_index=)``,
            ``functools.partial(F.cross_entropy, ignore_index=)``, a function's default); a given value
            that disagrees with the loss function's raises ValueError; a loss function whose value
            cannot be read (a lambda) counts with -100 and refuses negative targets other than it
            (:func:`~axonmpi.parallel.token_mean.resolve_ignore_index`).  ``None``, or float targets:
            weighted by sample counts.
        group: the pipeline group (default: all ranks).
        virtual_stages: chunks per rank ``v`` (interleaved: any; ZBV: 2, the default for it; else 1;
            default: the number of chunks given, when more than one).
            ZBV places its chunks in a V: pipeline rank ``r`` holds stages ``r`` and ``2p - 1 - r``
            (``split_module(model, p, 2, schedule="zbv")``). A chunk from :func:`split_module` carries its
            global stage; chunks that are not the stages the schedule runs on this rank raise
            ``ValueError`` on every rank of the group, naming them and the fix.
        data_group: the data-parallel group of this rank's stages (the ranks holding the same
            stages for other rows of the batch). Default: the grid's data group when ``group`` is
            the grid's pipeline group (``axonmpi.init(G_inter=p)``), else none. A group two of
            whose ranks hold different stages or shards raises ``ValueError``.
        track_memory: measure activation bytes (walks each micro-batch's graph once).
        token_groups: more groups whose ranks read other rows of the batch, reduced outside the
            pipeline by a mean over them (AxoNN's ``sync_gradients(mean=True)`` in the GPT recipe):
            counted targets are summed over them too, and the loss averaged (:meth:`token_groups`).
        scatter_group: a group whose ranks hold the same activation and gradient at every stage boundary
            (a Megatron tensor group; never AxoNN's, whose ranks read other rows): each sends ``1/t`` of them
            and the receiver all-gathers over its own (Megatron's ``scatter_gather_tensors_in_pipeline``).
        aux_loss: ``aux_loss(stage_module) -> Tensor | None``, read after each stage's forward of a
            micro-batch: the stage's auxiliary loss of that micro-batch (a MoE's router losses,
            ``moe_auxiliary_loss``). It joins the stage's backward with weight ``1 / num_microbatches``
            (times a scaler's scale), so the gradients are those of the LM loss plus the mean over the
            micro-batches of their auxiliary losses (Megatron's rule); the returned loss stays the LM loss.
            See [Note: auxiliary losses in a pipeline].

    Example:
        >>> chunks = split_module(model, num_stages=world.world_size)
        >>> pipe = Pipeline(chunks, PipelineSchedule.ONE_F_ONE_B, num_microbatches=4, loss_fn=F.cross_entropy)
        >>> opt.zero_grad(); loss = pipe.step(x, y); opt.step()
    """

    def __init__(self, stages, schedule: Union[PipelineSchedule, str, Schedule] = PipelineSchedule.ONE_F_ONE_B,
                 num_microbatches: Optional[int] = None, loss_fn: Optional[Callable] = None,
                 group: Optional[ProcessGroup] = None, virtual_stages: Optional[int] = None, *,
                 data_group: Optional[ProcessGroup] = None, track_memory: bool = True,
                 ignore_index: Any = FROM_LOSS, token_groups: Sequence[ProcessGroup] = (),
                 scatter_group: Optional[ProcessGroup] = None,
                 aux_loss: Optional[Callable[[Module], Optional[Tensor]]] = None):
        self.group = role_group("pipeline", group)
        # [Note: scatter / gather between stages] in _comm.py: each rank sends 1/t of a boundary's array
        self.scatter_group = scatter_group if scatter_group is not None and scatter_group.size > 1 else None
        p, r = self.group.size, self.group.rank
        if isinstance(schedule, Schedule):
            sched = schedule
            if num_microbatches is not None and num_microbatches != sched.num_microbatches:
                raise ValueError(f"rank {r}: num_microbatches={num_microbatches} disagrees with the given "
                                 f"schedule's {sched.num_microbatches}")
            if virtual_stages not in (None, 1, sched.virtual_stages):
                raise ValueError(f"rank {r}: virtual_stages={virtual_stages} disagrees with the given "
                                 f"schedule's {sched.virtual_stages}")
        else:
            if num_microbatches is None:
                raise ValueError(f"rank {r}: Pipeline needs num_microbatches (a positive int)")
            if virtual_stages is None and isinstance(stages, (list, tuple)) and len(stages) > 1:
                virtual_stages = len(stages)       # the chunks given per rank
            sched = make_schedule(schedule, p, num_microbatches, virtual_stages)
        if sched.num_stages != p:
            raise ValueError(f"rank {r}: the schedule is for {sched.num_stages} pipeline ranks but the group has {p}")
        sim = simulate(sched)    # refuses schedules that deadlock or skip work, on every rank alike
        _check_fifo(sched)
        self.schedule = sched
        v = sched.virtual_stages
        if not isinstance(stages, (list, tuple)):
            stages = [stages]
        if len(stages) != v:
            raise ValueError(f"rank {r}: Pipeline got {len(stages)} stages; virtual_stages={v} needs {v} per rank")
        _check_placement(stages, sched, self.group)
        self.stages: Dict[int, PipelineStage] = {}
        for k, st in enumerate(stages):
            sid = sched.stages_of(r)[k]
            if isinstance(st, Module):
                st = PipelineStage(st, sid, p, self.group, stage_ranks=sched.stage_ranks)
            if not isinstance(st, PipelineStage):
                raise TypeError(f"rank {r}: stages must be Modules or PipelineStages, got {type(st).__name__}")
            if st.stage_id != sid:
                raise ValueError(f"rank {r}: stage {k} of this rank must be global stage {sid} (this rank's stages "
                                 f"are {sched.stages_of(r)}), got stage_id={st.stage_id}")
            if st.group is not self.group and st.group.ranks != self.group.ranks:
                raise ValueError(f"rank {r}: stage {sid} was made for another pipeline group")
            self.stages[sid] = st
        self.loss_fn = loss_fn
        self.aux_loss = aux_loss
        self.ignore_index, self._ignore_checked = resolve_ignore_index(loss_fn, ignore_index, r)
        self.data_group = _data_group(self.group, data_group)
        self._extra_token_groups = tuple(resolve_group(x) for x in token_groups)
        for st in self.stages.values():
            named = [(f"stage {st.stage_id}: {n}", q) for n, q in st.module.named_parameters()]
            for _, q in named:
                add_placement(q, shard=Shard(self.group, ShardKind.STAGE))
            # an expert (split over a subgroup of data_group) is reduced over its own replica groups
            named = [(n, q) for n, q in named if not sharded_within(q, self.data_group)]
            check_group(named, self.data_group, "Pipeline(data_group=...)")
            for _, q in named:
                add_placement(q, replica=self.data_group)
        self.track_memory = bool(track_memory)
        self.num_microbatches = sched.num_microbatches
        self.virtual_stages = v
        self.last_stage = sched.total_stages - 1
        self._step = 0
        self._device_comm = False      # the group's device backend has been reached collectively
        self._meta: Dict[int, Tuple[Tuple[int, ...], np.dtype]] = {}   # stage -> agreed input (trailing shape, dtype)
        self._param_ids = {id(q.data) for st in self.stages.values() for q in st.parameters()}
        self._predicted = {s: sim.peak_activations_per_stage[s] for s in self.stages}
        self._predicted_rank = sim.peak_activations[r]
        self._stats: Optional[PipelineMemoryStats] = None
        self._timing: Optional[PipelineTiming] = None
        self.grad_reducer = self._make_reducer()

    # -- public ----------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the pipeline group."""
        return self.group.rank

    def parameters(self) -> List[Tensor]:
        """The parameters of this rank's stages."""
        return [q for s in sorted(self.stages) for q in self.stages[s].parameters()]

    def reset_shapes(self) -> None:
        """Forget the agreed activation shapes (collective over the pipeline group: call it on every rank).

        The trailing shape and dtype of each stage's input is agreed on the first step through a
        header; call this before a step whose activations have another trailing shape.
        """
        self._meta.clear()

    def token_groups(self) -> List[ProcessGroup]:
        """The groups whose ranks read other rows of the batch: ``data_group``, the ``batch_groups`` the
        stages declare (AxoNN's easy mode under ``parallelize``) and ``token_groups``.  Counted targets
        are summed over them and the loss averaged there (the one loss rule,
        :mod:`axonmpi.parallel.token_mean`)."""
        batch = [b for s in sorted(self.stages) for b in getattr(self.stages[s].module, "batch_groups", ())]
        out, seen = [], set()
        for g in [self.data_group, *batch, *self._extra_token_groups]:
            if g is not None and g.size > 1 and id(g) not in seen:
                seen.add(id(g))
                out.append(g)
        return out

    def timing(self) -> PipelineTiming:
        """Compute and wall time of the last :meth:`step` on this rank (see :class:`PipelineTiming`)."""
        if self._timing is None:
            raise RuntimeError(f"rank {self.rank}: timing() is available after the first step()")
        return self._timing

    def memory_stats(self) -> PipelineMemoryStats:
        """Activation memory of the last :meth:`step` (see :class:`PipelineMemoryStats`)."""
        if self._stats is None:
            raise RuntimeError(f"rank {self.rank}: memory_stats() is available after the first step()")
        return self._stats

    def step(self, inputs, targets, *, scaler=None):
        """Forward and backward over ``num_microbatches`` micro-batches by the schedule; return the loss.

        Args:
            inputs: the batch (array or Tensor, batch on axis 0); needed on the rank of stage 0
                (others may pass it or ``None``).
            targets: the targets; needed on the rank of the last stage.
            scaler: an :class:`axonmpi.amp.GradScaler`: every micro-batch's loss (and auxiliary loss) is
                multiplied by its scale before its backward, so the gradients are scaled; then
                ``scaler.unscale_(opt)`` / ``scaler.step(opt)`` as without a pipeline (the inf check is
                all-reduced over the scaler's group, every rank by default: pipeline, data and tensor
                ranks skip or step together). The returned loss is not scaled.

        Returns:
            The mean loss over the batch as a float, the same on every rank of the pipeline
            (and of ``data_group``).
        """
        if self.loss_fn is None:
            raise ValueError(f"rank {self.rank}: Pipeline.step needs loss_fn")
        if not self._ignore_checked and targets is not None:     # a loss whose ignore_index could not be read
            check_counted_targets(_raw(targets), self.ignore_index, self.rank)
        if not self._device_comm:
            self._reach_device_backend()
        if scaler is not None and not set(self.group.ranks) <= set(scaler.group.ranks):
            raise ValueError(f"rank {self.rank}: the GradScaler's inf check is agreed over {scaler.group.name} "
                             f"{list(scaler.group.ranks)}, which leaves out pipeline ranks of {list(self.group.ranks)}: "
                             "stages would step apart; use GradScaler(group=None) (every rank)")
        sizes = self._agree_sizes(inputs, targets)
        scale = 1.0 if scaler is None else float(scaler.get_scale())
        loss = self._run(self.schedule_actions(), sizes, inputs, targets, train=True, scale=scale)
        self._reduce_data_parallel()
        self._step += 1
        return loss

    def eval_step(self, inputs, targets=None):
        """Forward only (no graph), running the forward actions of the schedule in their order.

        Returns:
            With ``targets`` (and ``loss_fn``): the mean loss, on every rank. Without: the
            last stage's outputs concatenated over the micro-batches on its rank, ``None`` elsewhere.
        """
        if not self._device_comm:
            self._reach_device_backend()
        sizes = self._agree_sizes(inputs, targets if targets is not None else None, need_targets=targets is not None)
        acts = [a for a in self.schedule_actions() if a.kind in (ActionKind.FORWARD, ActionKind.SEND_ACT,
                                                                 ActionKind.RECV_ACT)]
        with no_grad():
            out = self._run(acts, sizes, inputs, targets, train=False)
        return mean_over(out, self.token_groups()) if targets is not None else out

    def schedule_actions(self) -> List[Action]:
        """This rank's action list (what :meth:`step` executes)."""
        return self.schedule.actions(self.rank)

    # -- private ---------------------------------------------------------------------------------
    def _reach_device_backend(self) -> None:
        """Every rank runs one collective on its stages' arrays before the first step's transfers.

        An NCCL group communicator is created collectively at the group's first device operation;
        a middle stage's first one comes only after a shape header (host, MPI) from a stage that
        is already inside that creation, so without this a pipeline of 3+ stages on NCCL hangs.
        On the host it is one tiny all-reduce over MPI, once.
        """
        self._device_comm = True
        if self.group.size == 1:
            return
        data = next((q.data for st in self.stages.values() for q in st.parameters()), None)
        on_gpu = np.array([int(data is not None and is_cupy_array(data))])
        if all_reduce(on_gpu, ReduceOp.MAX, self.group)[0]:      # a rank may hold no parameters
            all_reduce(get_cupy().zeros(1, np.float32), group=self.group)

    def _agree_sizes(self, inputs, targets, need_targets: bool = True) -> List[int]:
        """Micro-batch sizes, decided on pipeline rank 0 (stage 0) and broadcast."""
        m, r = self.num_microbatches, self.rank
        sizes = np.zeros(m, np.int64)
        if r == 0:
            if inputs is None:
                raise ValueError(f"rank {r}: the rank of stage 0 needs the inputs, got None")
            n = len(_raw(inputs))
            if n < m:
                raise ValueError(f"rank {r}: a batch of {n} samples cannot make {m} micro-batches "
                                 f"(needs at least num_microbatches={m})")
            sizes[:] = _split_sizes(n, m)
        if self.group.size > 1:
            broadcast(sizes, 0, self.group)
        sizes = [int(s) for s in sizes]
        if need_targets and self.last_stage in self.stages:
            if targets is None:
                raise ValueError(f"rank {r}: the rank of the last stage needs the targets, got None")
            if len(_raw(targets)) != sum(sizes):
                raise ValueError(f"rank {r}: targets hold {len(_raw(targets))} samples but the inputs "
                                 f"on stage 0 hold {sum(sizes)}")
        return sizes

    def _make_reducer(self) -> GradReducer:
        """Each stage's gradients summed over the groups of the gradient-sync table (its data group, and
        the batch groups of a stage that declares ``batch_groups``, e.g. ``parallelize``'s AxoNN easy
        mode), divided by the number of batch shards: the gradient of the mean loss over the batch.  Run
        after the step's last backward; FSDP's flat shards (``ShardKind.FLAT``) are their owner's."""
        g = self.data_group
        red = GradReducer("pipeline")
        for sid in sorted(self.stages):
            mod = self.stages[sid].module
            batch = tuple(getattr(mod, "batch_groups", ()))
            n = (g.size if g is not None else 1) * int(np.prod([b.size for b in batch]))
            if n > 1:
                params = [q for q in self.stages[sid].parameters()
                          if not any(s.kind is ShardKind.FLAT for s in placement_of(q).shards)]
                red.after_backward(params, lambda q, batch=batch, depth=getattr(mod, "depth_group", None):
                                   reduction_groups(q, g, batch, depth), 1.0 / n)
        return red

    def no_sync(self):
        """Steps inside leave each stage's gradients unreduced (accumulated locally); the first step outside
        reduces their sum once: :func:`axonmpi.parallel.no_sync` of this pipeline."""
        return no_sync(self)

    def _reduce_data_parallel(self) -> None:
        """The reduction after the step's last backward (nothing inside :meth:`no_sync`), then the finalize step of
        each stage that has its own (a ``parallelize``'d stage: its sequence-parallel sums), once per step."""
        self.grad_reducer.run()
        if self.grad_reducer.enabled:
            for sid in sorted(self.stages):
                own = getattr(self.stages[sid].module, "grad_reducer", None)
                if own is not None and own is not self.grad_reducer:
                    own.run()

    def _run(self, acts: List[Action], sizes: List[int], inputs, targets, *, train: bool, scale: float = 1.0):
        ex = _Executor(self, acts, sizes, inputs, targets, train, scale)
        value = ex.run()
        if train or targets is not None:
            if self.group.size > 1:
                src = self.schedule.rank_of(self.last_stage)
                value = float(all_reduce(np.array([value if self.rank == src else 0.0]), ReduceOp.SUM,
                                         self.group)[0])
            if train:
                value = mean_over(value, self.token_groups())
        if train:
            self._stats = ex.memory_stats()
            self._timing = ex.timing
            self._executed = ex.executed      # what ran, in order (tests compare it with the schedule)
        self._posted = ex.posted              # receives in posting order, and sends in sending order:
        self._sent = ex.sent                  # tests check that each pair's sequences agree ([Note: p2p order])
        return value


def _stage_index(m) -> Optional[Tuple[int, int]]:
    """``(stage_index, num_chunks)`` that :func:`split_module` set on a chunk, looked for through the
    wrappers around it (``PipelineStage``, ``parallelize``'s ``ParallelModule``, ``Checkpointed``, DDP,
    FSDP: their ``module`` / ``inner``); ``None`` for a chunk cut by hand."""
    seen = set()
    while m is not None and id(m) not in seen:
        seen.add(id(m))
        if isinstance(getattr(m, "stage_index", None), int):
            return m.stage_index, getattr(m, "num_chunks", None)
        m = getattr(m, "inner", None) or getattr(m, "module", None)
    return None


def _check_placement(stages: Sequence[Any], sched: Schedule, group: ProcessGroup) -> None:
    """Raise on every rank of the pipeline group when a rank's chunks are not the stages the schedule
    places there (:func:`_misplaced`; collective over ``group``)."""
    msg = _misplaced(stages, sched, group.rank)
    msgs = all_gather_object(msg, group=group) if group.size > 1 else [msg]
    if msg is not None:
        raise ValueError(msg)
    bad = [q for q, m in enumerate(msgs) if m is not None]
    if bad:
        raise ValueError(f"rank {group.rank}: pipeline rank(s) {bad} hold chunks that the schedule places "
                         f"elsewhere; pipeline {msgs[bad[0]]}")


def _misplaced(stages: Sequence[Any], sched: Schedule, r: int) -> Optional[str]:
    """[Note: stages know their place]  A chunk from :func:`split_module` carries its global stage index;
    the schedule says which stages run on rank ``r`` (round-robin ``r, r + p``; ZBV's V ``r, 2p - 1 - r``).
    A chunk holding another stage would run a permuted model silently, so it raises, naming the chunks and
    the fix."""
    want = sched.stages_of(r)
    got = [_stage_index(st) for st in stages]
    if all(x is None for x in got):
        return None
    total = sched.total_stages
    bad = [(k, x) for k, x in enumerate(got)
           if x is not None and (x[0] != want[k] or (x[1] is not None and x[1] != total))]
    if not bad:
        return None
    have = [None if x is None else x[0] for x in got]
    cuts = sorted({x[1] for x in got if x is not None and x[1] is not None})
    kind = sched.kind.value if sched.kind is not None else "given"
    of = f" of a {cuts[0]}-chunk cut" if cuts and cuts != [total] else ""
    return (
        f"rank {r}: the {kind} schedule over {sched.num_stages} pipeline ranks runs global stages {want} (of "
        f"{total}) on this rank, but the chunks given are split_module's stages {have}{of}: the model would run "
        f"permuted. Cut it for the schedule: split_module(model, {sched.num_stages}, {sched.virtual_stages}, "
        f"schedule={kind!r}) (or stage_ranks=make_schedule({kind!r}, p, m).stage_ranks)")


def _tag(kind: ActionKind, stage: int) -> int:
    """Message tag of a transfer into ``stage`` (its input activation, or its output gradient)."""
    return 3 * stage + {ActionKind.SEND_ACT: 0, ActionKind.RECV_ACT: 0, ActionKind.SEND_GRAD: 1,
                        ActionKind.RECV_GRAD: 1}[kind]


def _header_tag(stage: int) -> int:
    return 3 * stage + 2


class _Executor:
    """One step: walks the rank's action list, pre-posting each compute's receives one compute ahead."""

    def __init__(self, pipe: Pipeline, acts: List[Action], sizes: List[int], inputs, targets, train: bool,
                 scale: float = 1.0):
        self.pipe, self.acts, self.sizes, self.train, self.scale = pipe, acts, sizes, train, scale
        self.group = pipe.group
        r = pipe.rank
        self.inputs = inputs
        self.targets = targets
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int).tolist()
        self.total = sum(sizes)
        self.weights = self._loss_weights() if pipe.last_stage in pipe.stages else [0.0] * len(sizes)
        self.x: Dict[Tuple[int, int], Tensor] = {}       # (stage, mb) -> stage input
        self.y: Dict[Tuple[int, int], Tensor] = {}       # (stage, mb) -> stage output (or scaled loss)
        self.aux: Dict[Tuple[int, int], Tensor] = {}     # (stage, mb) -> its weighted auxiliary loss
        self.grad_in: Dict[Tuple[int, int], Any] = {}    # (stage, mb) -> gradient of the stage's output
        self.weight_grads: Dict[Tuple[int, int], Any] = {}   # (stage, mb) -> its deferred W (zero-bubble)
        self.recvs: Dict[Action, Tuple[Any, Any, Tuple[int, ...]]] = {}   # posted receive -> (work, buffer, shape)
        self.headers: Dict[int, Tuple[Any, Any]] = {}    # stage -> (work, header buffer)
        # receives are posted in each peer's send order ([Note: p2p order] in schedules.py)
        self.order = _recv_order(pipe.schedule, r, train)
        self.slot = {b: (q, k) for q, bs in self.order.items() for k, b in enumerate(bs)}
        self.next = {q: 0 for q in self.order}           # peer -> index of its first receive not posted
        self.posted: List[Tuple[int, str]] = []          # (peer, receive) in posting order ("3H": a header)
        self.sent: List[Tuple[int, str]] = []            # (peer, the receive it feeds) in sending order
        self.sends: List[Any] = []
        self.loss = 0.0
        self.outputs: List[Any] = []
        self.held = {s: 0 for s in pipe.stages}
        self.held_bytes = {s: 0 for s in pipe.stages}
        self.mb_bytes: Dict[Tuple[int, int], int] = {}
        self.peak = dict(self.held)
        self.peak_bytes = dict(self.held_bytes)
        self.max_mb_bytes = dict(self.held_bytes)
        self.peak_rank = 0
        self.rank = r

    # -- inputs and targets of a micro-batch ------------------------------------------------------
    def _loss_weights(self) -> List[float]:
        """Each micro-batch's share of the batch loss: its counted targets over all (see ``ignore_index``).

        The one loss rule (:mod:`axonmpi.parallel.token_mean`): the total is counted over the
        micro-batches and over :meth:`Pipeline.token_groups` (data, the stages' batch groups, and
        ``token_groups``), and the weights are multiplied by the number of batch shards they make,
        so the shards' MEAN of losses and gradients is the mean over all their counted targets.
        """
        p, t = self.pipe, self.targets
        if t is None or p.loss_fn is None:
            return [0.0] * len(self.sizes)
        t = _raw(t)
        if p.ignore_index is None or getattr(t, "dtype", np.dtype(float)).kind not in "iu":
            counts = [int(s) for s in self.sizes]
        else:
            counts = [int((self._slice(t, i) != p.ignore_index).sum()) for i in range(len(self.sizes))]
        groups = p.token_groups()
        total, scale = global_count(sum(counts), groups), float(token_groups_size(groups))
        self.no_counted_targets = total == 0
        return [c * scale / total if total else 0.0 for c in counts]

    def _slice(self, batch, mb: int):
        a, b = self.offsets[mb], self.offsets[mb + 1]
        return _raw(batch)[a:b]

    # -- transfers -----------------------------------------------------------------------------------
    def _post(self, a: Action, block: bool = False) -> bool:
        """Post the receive of action ``a`` after every receive its peer sends before it
        (``[Note: p2p order]`` in schedules.py). Without ``block`` it stops, returning False, at a
        receive whose buffer cannot be made yet (a stage's shape header not arrived, a gradient
        whose forward has not run); with ``block`` it waits for headers. True when ``a`` is posted."""
        q, k = self.slot[a]
        while self.next[q] <= k:
            if not self._post_one(self.order[q][self.next[q]], q, block):
                return False
            self.next[q] += 1
        return True

    def _post_one(self, a: Action, peer: int, block: bool) -> bool:
        p = self.pipe
        if a.kind is ActionKind.RECV_ACT:
            if a.stage not in p._meta:
                if a.stage not in self.headers:
                    h = np.zeros(HEADER_SIZE, np.int64)
                    self.headers[a.stage] = (_communicate([], [(h, peer, _header_tag(a.stage))], self.group)[0], h)
                    self.posted.append((peer, f"{a.stage}H"))
                if not block:
                    return False
                work, h = self.headers.pop(a.stage)
                work.wait()
                p._meta[a.stage] = decode_header(h)
            trailing, dtype = p._meta[a.stage]
            xp, shape = self._xp(), (self.sizes[a.microbatch],) + trailing
        else:
            out = self.y.get((a.stage, a.microbatch))
            if out is None:
                if block:   # the peer sends it after our forward, which a checked schedule runs first
                    raise RuntimeError(f"rank {self.rank}: {a} must be received before stage {a.stage}'s "
                                       f"forward of micro-batch {a.microbatch} ran; the schedule is inconsistent")
                return False
            xp, shape, dtype = get_array_module(out.data), tuple(out.shape), out.dtype
        buf = xp.empty(shape, dtype) if p.scatter_group is None else \
            xp.empty(piece_size(int(np.prod(shape)), p.scatter_group), dtype)
        self.recvs[a] = (_communicate([], [(buf, peer, _tag(a.kind, a.stage))], self.group)[0], buf, shape)
        self.posted.append((peer, str(a)))
        return True

    def _xp(self):
        for st in self.pipe.stages.values():
            for q in st.parameters():
                return get_array_module(q.data)
        return np

    def _receive(self, a: Action):
        self._post(a, block=True)
        work, buf, shape = self.recvs.pop(a)
        work.wait()
        return gather_pieces(buf, shape, self.pipe.scatter_group)

    def _send(self, a: Action) -> None:
        p = self.pipe
        key = (a.stage, a.microbatch)
        if a.kind is ActionKind.SEND_ACT:
            arr = (self.y[key] if self.train else self.y.pop(key)).data
            peer, into = p.schedule.rank_of(a.stage + 1), a.stage + 1
            trailing, dtype = tuple(arr.shape[1:]), arr.dtype
            if arr.ndim == 0 or arr.shape[0] != self.sizes[a.microbatch]:
                raise ValueError(f"rank {self.rank}: stage {a.stage} output of shape {tuple(arr.shape)} must have "
                                 f"the micro-batch ({self.sizes[a.microbatch]}) on axis 0")
            meta = p._meta.get(("out", a.stage))
            sends = [(arr, peer, _tag(a.kind, into))]
            if meta is None:
                p._meta[("out", a.stage)] = (trailing, dtype)
                sends.insert(0, (encode_header(trailing, dtype), peer, _header_tag(into)))
            elif meta != (trailing, np.dtype(dtype)):
                raise ValueError(f"rank {self.rank}: stage {a.stage} output changed from (trailing shape, dtype) "
                                 f"{meta} to {(trailing, dtype)}; call pipe.reset_shapes() on every rank first")
        else:
            x = self.x.pop(key)
            arr = x.grad.data if x.grad is not None else get_array_module(x.data).zeros_like(x.data)
            peer, into = p.schedule.rank_of(a.stage - 1), a.stage - 1
            sends = [(arr, peer, _tag(a.kind, into))]
        if p.scatter_group is not None:
            sends[-1] = (scatter_piece(sends[-1][0], p.scatter_group),) + sends[-1][1:]
        kind = ActionKind.RECV_ACT if a.kind is ActionKind.SEND_ACT else ActionKind.RECV_GRAD
        recv = Action(kind, a.microbatch, into)
        self.sent.extend([(peer, f"{into}H")] * (len(sends) - 1) + [(peer, str(recv))])
        self.sends.extend(_communicate(sends, [], self.group))

    # -- compute -----------------------------------------------------------------------------------
    def _forward(self, a: Action) -> None:
        p, s, i = self.pipe, a.stage, a.microbatch
        if s == 0:
            x = self._slice(self.inputs, i)
            x = Tensor(x) if not isinstance(x, Tensor) else x
        else:
            if p.schedule.rank_of(s - 1) == self.rank:
                prev = self.y[(s - 1, i)] if self.train else self.y.pop((s - 1, i))
                data = prev.data
            else:
                data = self._received.pop((s, i))
            x = Tensor.wrap(data)
            if self.train and data.dtype.kind == "f":
                x.requires_grad = True
        seed = _microbatch_seed(initial_seed(), p._step, s, i, p.data_group.rank if p.data_group is not None else 0)
        with fork_rng(seed):
            y = p.stages[s](x)
        if self.train and p.aux_loss is not None:       # [Note: auxiliary losses in a pipeline]
            aux = p.aux_loss(p.stages[s].module)
            if aux is not None and not aux.requires_grad:
                raise RuntimeError(f"rank {self.rank}: the auxiliary loss of stage {s} (micro-batch {i}) keeps no "
                                   "graph (computed under no_grad or activation checkpointing), so it cannot join "
                                   "the backward; do not checkpoint the layers that make it")
            if aux is not None:
                self.aux[(s, i)] = aux * (self.scale / len(self.sizes))
        if s == p.last_stage:
            if self.targets is not None and p.loss_fn is not None:
                w = self.weights[i]
                loss = p.loss_fn(y, Tensor.wrap(self._slice(self.targets, i))) * w
                if w:  # a micro-batch of ignored targets only: NaN * 0, zero gradients, not counted
                    self.loss += float(loss.item())
                y = loss * self.scale if self.train and self.scale != 1.0 else loss
            if not self.train:
                if self.targets is None:
                    self.outputs.append(y.data)
                return
        if not self.train:
            self.y[(s, i)] = y
            return
        self.x[(s, i)] = x
        self.y[(s, i)] = y
        self._track(s, i, +1, x, y)

    def _backward(self, a: Action) -> None:
        p, s, i = self.pipe, a.stage, a.microbatch
        y = self.y.pop((s, i))
        if s != p.last_stage and p.schedule.rank_of(s + 1) == self.rank:
            g = self.grad_in_local.pop((s, i))
        elif s != p.last_stage:
            g = self._received.pop((s, i))
        else:
            g = None
        roots, grads = ([y], [g]) if y.requires_grad else ([], [])
        aux = self.aux.pop((s, i), None)
        if aux is not None:     # the stage's auxiliary loss joins its backward ([Note: auxiliary losses in a pipeline])
            roots, grads = roots + [aux], grads + [None]
        if a.kind is ActionKind.BACKWARD_INPUT:
            # the input gradient now, the weight gradients at this micro-batch's W ([Note: B/W split])
            x = self.x.get((s, i))
            inputs = [x] if x is not None and x.requires_grad and x.grad_fn is None else []
            self.weight_grads[(s, i)] = backward_input(roots, grads, inputs=inputs) if roots else None
        elif roots:
            run_backward(roots, grads)
        if s > 0 and p.schedule.rank_of(s - 1) == self.rank:
            x = self.x.pop((s, i))
            self.grad_in_local[(s - 1, i)] = (x.grad.data if x.grad is not None
                                              else get_array_module(x.data).zeros_like(x.data))
        elif s == 0:
            self.x.pop((s, i), None)
        if a.kind is ActionKind.BACKWARD:
            self._track(s, i, -1)

    def _backward_weight(self, a: Action) -> None:
        w = self.weight_grads.pop((a.stage, a.microbatch))
        if w is not None:
            w.run()
        self._track(a.stage, a.microbatch, -1)

    def _track(self, s: int, i: int, delta: int, x: Tensor = None, y: Tensor = None) -> None:
        if delta > 0:
            nbytes = 0
            if self.pipe.track_memory:
                roots = [y] if y is not None else []
                nbytes = _graph_bytes(roots, self.pipe._param_ids)
                xb = x.data if getattr(x.data, "base", None) is None else x.data.base
                nbytes += 0 if s == 0 else int(xb.nbytes)
            self.mb_bytes[(s, i)] = nbytes
            self.max_mb_bytes[s] = max(self.max_mb_bytes[s], nbytes)
        else:
            nbytes = self.mb_bytes.pop((s, i))
        self.held[s] += delta
        self.held_bytes[s] += delta * nbytes
        self.peak[s] = max(self.peak[s], self.held[s])
        self.peak_bytes[s] = max(self.peak_bytes[s], self.held_bytes[s])
        self.peak_rank = max(self.peak_rank, sum(self.held.values()))

    # -- the loop --------------------------------------------------------------------------------------
    def run(self):
        self._received: Dict[Tuple[int, int], Any] = {}
        self.grad_in_local: Dict[Tuple[int, int], Any] = {}
        acts = self.acts
        n = len(acts)
        t_start = time.perf_counter()
        compute = {ActionKind.FORWARD: self._forward, ActionKind.BACKWARD: self._backward,
                   ActionKind.BACKWARD_INPUT: self._backward, ActionKind.BACKWARD_WEIGHT: self._backward_weight}
        spent = {k: 0.0 for k in compute}
        count = {k: 0 for k in compute}
        first = last = None
        computes = [k for k, a in enumerate(acts) if a.kind in compute]
        nxt = {computes[j]: (computes[j + 1] if j + 1 < len(computes) else n) for j in range(len(computes))}
        self.executed: List[Action] = []
        for k, a in enumerate(acts):
            kind = a.kind
            self.executed.append(a)
            if kind in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD):
                self._received[(a.stage, a.microbatch)] = self._receive(a)
            elif kind in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD):
                self._send(a)
            else:
                # post the receives the next compute action needs, so they arrive while this one runs
                for b in acts[k + 1:nxt[k]]:
                    if b.kind in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD):
                        self._post(b)
                self.sends = [w for w in self.sends if not w.is_completed()]
                t0 = time.perf_counter()
                first = t0 if first is None else first
                with enable_grad() if self.train else no_grad():
                    compute[kind](a)
                last = time.perf_counter()
                spent[kind] += last - t0
                if _trace._ACTIVE is not None:
                    _trace._ACTIVE.events.append((f"pipeline {a}", "pipeline", t0, last,
                                                  {"stage": a.stage, "microbatch": a.microbatch}))
                count[kind] += 1
        for w in self.sends:
            w.wait()
        self.sends = []
        B, I, W = ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
        self.timing = PipelineTiming(time.perf_counter() - t_start, spent[ActionKind.FORWARD], spent[B] + spent[I],
                                     count[ActionKind.FORWARD], count[B] + count[I], spent[W], count[W],
                                     0.0 if first is None else last - first)
        if not self.train and self.targets is None:
            if self.pipe.last_stage not in self.pipe.stages:
                return None
            xp = get_array_module(self.outputs[0])
            return xp.concatenate(self.outputs, axis=0)
        if getattr(self, "no_counted_targets", False):
            return float("nan")  # every target ignored: torch's mean is 0/0
        return self.loss

    def memory_stats(self) -> PipelineMemoryStats:
        pipe = self.pipe
        stages = tuple(sorted(pipe.stages))
        return PipelineMemoryStats(
            stages=stages,
            peak_in_flight=dict(self.peak),
            predicted_in_flight=dict(pipe._predicted),
            peak_rank_in_flight=self.peak_rank,
            predicted_rank_in_flight=pipe._predicted_rank,
            microbatch_bytes=dict(self.max_mb_bytes),
            peak_activation_bytes=dict(self.peak_bytes),
            estimated_activation_bytes={s: pipe._predicted[s] * self.max_mb_bytes[s] for s in stages},
        )
