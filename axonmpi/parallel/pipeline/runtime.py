"""``Pipeline``: runs a schedule's action lists over MPI, micro-batch by micro-batch, and measures memory."""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ...autograd.grad_mode import no_grad
from ...autograd.tensor import Tensor
from ...backend import get_cupy, is_cupy_array
from ...distributed.collectives import all_reduce, broadcast
from ...distributed.object_collectives import all_gather_object
from ...distributed.group import ProcessGroup
from ...distributed.placement import Shard, ShardKind, add_placement, placement_of
from ...distributed.world import get_grid, resolve_group, role_group
from ...distributed.reduce_op import ReduceOp
from ...nn.module import Module
from .schedules import Action, ActionKind, PipelineSchedule, Schedule, _check_fifo, make_schedule, simulate
# the executor of one step, and the records it fills (re-exported: tests and tools import them from here)
from .executor import (PipelineMemoryStats, PipelineTiming, _Executor, _graph_bytes, _last_backward,  # noqa: F401
                       _microbatch_seed, _raw)
from .stage import PipelineStage
from ..grad_sync import GradReducer, check_group, mean_over, no_sync, reduction_groups, sharded_within
from ..token_mean import FROM_LOSS, check_counted_targets, resolve_ignore_index

__all__ = ["Pipeline", "PipelineMemoryStats", "PipelineTiming"]


def _split_sizes(n: int, m: int) -> List[int]:
    q, extra = divmod(n, m)
    return [q + (1 if i < extra else 0) for i in range(m)]


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

    Data parallel: with ``data_group``, each stage's gradients are averaged over ``data_group`` (the
    ranks holding the same stage for other data), launched as soon as the stage's last backward of the
    step is done and waited for after the schedule ([Note: overlapped stage reductions]; ``overlap = False``
    reduces them all after the schedule instead), and the returned loss is averaged there too, so replicas
    stay identical. Every stage parameter records
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

    Attributes:
        overlap: True (default): each stage's data-parallel reduction is launched when its last backward of the
            step is done; False: every stage's is run after the schedule (a bench's blocking baseline).
        overlap_buckets: True (default, with ``overlap``): during that last backward, each bucket of the stage's
            gradients is launched as soon as it is final ([Note: buckets launched as they fill]); False: the whole
            stage after its last backward (needed where a gradient hook fires before the gradient is final: a
            parameter used in two activation-checkpointed regions; ``parallelize`` sets it under checkpointing).

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
        self.overlap = True
        self.overlap_buckets = True
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
        for red in self._stage_reducers.values():      # a step that raised left its launches: complete them
            red.wait()
        sizes = self._agree_sizes(inputs, targets)
        scale = 1.0 if scaler is None else float(scaler.get_scale())
        loss = self._run(self.schedule_actions(), sizes, inputs, targets, train=True, scale=scale)
        t0 = time.perf_counter()
        self._reduce_data_parallel()
        self._timing = replace(self._timing, reduce_seconds=self._timing.reduce_seconds + time.perf_counter() - t0)
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
        mode), divided by the number of batch shards: the gradient of the mean loss over the batch.  One
        reducer per stage, launched after the stage's last backward ([Note: overlapped stage reductions]);
        the pipeline's reducer completes them (its parts: :func:`no_sync` switches them with it).  FSDP's
        flat shards (``ShardKind.FLAT``) are their owner's."""
        g = self.data_group
        owner = _grad_owner(self.stages, self.schedule_actions())
        self._stage_reducers: Dict[int, GradReducer] = {}
        for sid in sorted(self.stages):
            mod = self.stages[sid].module
            red = self._stage_reducers[sid] = GradReducer(f"pipeline stage {sid}")
            batch = tuple(getattr(mod, "batch_groups", ()))
            n = (g.size if g is not None else 1) * int(np.prod([b.size for b in batch]))
            if n > 1:
                params = [q for q in self.stages[sid].parameters() if owner.get(id(q)) == sid
                          and not any(s.kind is ShardKind.FLAT for s in placement_of(q).shards)]
                red.after_backward(params, lambda q, batch=batch, depth=getattr(mod, "depth_group", None):
                                   reduction_groups(q, g, batch, depth), 1.0 / n)
                red.launch_as_ready(params)
        red = GradReducer("pipeline", parts=list(self._stage_reducers.values()))
        red.before_run(lambda: [self._stage_reducers[sid].run() for sid in sorted(self._stage_reducers)])
        return red

    def _listen(self, sid: int) -> None:
        """The stage's last backward of the step begins: its buckets launch as they fill."""
        if self.overlap_buckets:
            self._stage_reducers[sid].listen()

    def _start_stage_reduction(self, sid: int) -> None:
        """The stage's last backward of the step is done: launch its data-parallel reduction."""
        self._stage_reducers[sid].start()

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
            self._launches = ex.launches      # after which action each stage's reduction was launched
        self._posted = ex.posted              # receives in posting order, and sends in sending order:
        self._sent = ex.sent                  # tests check that each pair's sequences agree ([Note: p2p order])
        return value


def _grad_owner(stages: Dict[int, PipelineStage], acts: Sequence[Action]) -> Dict[int, int]:
    """``id(param) -> stage``: the stage of this rank whose last backward comes last among those holding it."""
    last = _last_backward(acts)
    owner: Dict[int, int] = {}
    for sid in sorted(stages, key=lambda s: last.get(s, -1)):
        for q in stages[sid].parameters():
            owner[id(q)] = sid
    return owner


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

