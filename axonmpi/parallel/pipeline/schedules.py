"""Pipeline schedules as data: per-rank action lists, a printer and a dry-run simulator (no MPI).

Stages are numbered globally ``0 .. num_stages * virtual_stages - 1``; stage ``s`` lives on
pipeline rank ``s % num_stages`` (round-robin, Megatron's interleaving). Every rank's list holds
its compute actions (``FORWARD``/``BACKWARD``) and the transfers around them: a ``RECV_ACT``
right before each forward whose input comes from another rank, a ``SEND_ACT`` right after each
forward whose output goes to another rank, and ``RECV_GRAD``/``SEND_GRAD`` likewise around each
backward. Sends never block; a receive blocks until its matching send has run. The runtime
(:mod:`axonmpi.parallel.pipeline.runtime`) executes these lists unchanged, and :func:`simulate`
runs them under the same rule, so a schedule that finishes in the simulator cannot deadlock in
the runtime.

[Note: zero-bubble] A zero-bubble schedule (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR
2024) splits ``BACKWARD`` into ``BACKWARD_INPUT`` (``I``: the input gradient, which the previous
stage waits for) and ``BACKWARD_WEIGHT`` (``W``: the weight gradients, which nobody waits for, so
they fill what would be bubble). A stage runs either ``B`` or ``I`` then ``W`` on each micro-batch.
``SEND_GRAD`` follows the action that made the input gradient (``B`` or ``I``); a micro-batch's
activations are held from its ``F`` to its ``B`` or ``W``. ZB-H1 keeps 1F1B's order and memory and
delays each rank's first ``W`` by its rank, so that ``I`` runs as soon as its gradient arrives.
ZBV puts two chunks on each rank in a V (rank ``r`` holds stages ``r`` and ``2p - 1 - r``, so the
first and last stage share rank 0) and follows PyTorch's ``ScheduleZBVZeroBubble`` order.

Example:
    >>> from axonmpi.parallel.pipeline import make_schedule, PipelineSchedule, simulate
    >>> s = make_schedule(PipelineSchedule.ONE_F_ONE_B, num_stages=2, num_microbatches=4)
    >>> [str(a) for a in s.actions(1)][:4]
    ['1RECV_F0', '1F0', '1B0', '1SEND_B0']
    >>> simulate(s).idle_fraction
    [0.2, 0.2]
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from fractions import Fraction
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union
from ...enums import coerce_enum

__all__ = [
    "Action", "ActionKind", "PipelineSchedule", "Schedule", "ScheduleDeadlockError", "SimulationResult",
    "format_schedule", "make_schedule", "simulate",
]


class PipelineSchedule(enum.Enum):
    """Which pipeline schedule to build (see :func:`make_schedule`)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_ONE_F_ONE_B = "interleaved"
    ZB_H1 = "zb-h1"
    ZBV = "zbv"

    @classmethod
    def parse(cls, value: Union["PipelineSchedule", str]) -> "PipelineSchedule":
        """The member for ``value`` (a member, its value such as ``"1f1b"``, or its name)."""
        return coerce_enum(cls, value, "pipeline schedule")


class ActionKind(enum.Enum):
    """What one entry of a rank's action list does."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_ACT = "SEND_F"
    RECV_ACT = "RECV_F"
    SEND_GRAD = "SEND_B"
    RECV_GRAD = "RECV_B"


_COMPUTE = (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)
_GRAD_MAKERS = (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT)     # actions that produce the input gradient
_FREES = (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT)          # actions after which activations are freed


class Action(NamedTuple):
    """One step of a rank's schedule: ``kind`` on micro-batch ``microbatch`` of global stage ``stage``.

    ``str(Action(ActionKind.FORWARD, 0, 2)) == "2F0"`` (PyTorch's notation); transfers print as
    ``"2SEND_F0"``, ``"3RECV_F0"``, ``"3SEND_B0"``, ``"2RECV_B0"``. For a transfer, ``stage`` is
    the stage on this rank that sends or receives.
    """

    kind: ActionKind
    microbatch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"


class ScheduleDeadlockError(RuntimeError):
    """The simulator found ranks blocked forever (or an action whose inputs can never exist)."""


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists of one pipeline schedule.

    Args:
        num_stages: pipeline ranks ``p``.
        num_microbatches: micro-batches ``m`` per step.
        virtual_stages: model chunks per rank ``v`` (stage ``s`` on rank ``s % p``).
        rank_actions: one tuple of :class:`Action` per rank.
        kind: the :class:`PipelineSchedule` it was made by (``None`` for hand-made lists).
        stage_ranks: the pipeline rank of each global stage; ``None`` is round-robin
            (``s % p``); ZBV's V is ``(0, 1, .., p-1, p-1, .., 1, 0)``.
    """

    num_stages: int
    num_microbatches: int
    virtual_stages: int
    rank_actions: Tuple[Tuple[Action, ...], ...]
    kind: Optional[PipelineSchedule] = None
    stage_ranks: Optional[Tuple[int, ...]] = None

    def __post_init__(self):
        if len(self.rank_actions) != self.num_stages:
            raise ValueError(f"Schedule needs one action list per rank ({self.num_stages}), "
                             f"got {len(self.rank_actions)}")
        object.__setattr__(self, "rank_actions", tuple(tuple(Action(*a) for a in acts)
                                                        for acts in self.rank_actions))
        if self.stage_ranks is not None:
            sr = tuple(int(x) for x in self.stage_ranks)
            counts = [sr.count(r) for r in range(self.num_stages)]
            if len(sr) != self.total_stages or counts != [self.virtual_stages] * self.num_stages:
                raise ValueError(f"Schedule stage_ranks={sr} must give each of the {self.num_stages} ranks "
                                 f"exactly virtual_stages={self.virtual_stages} of the {self.total_stages} stages")
            object.__setattr__(self, "stage_ranks", sr)

    @property
    def total_stages(self) -> int:
        """``num_stages * virtual_stages``: the number of model chunks."""
        return self.num_stages * self.virtual_stages

    def rank_of(self, stage: int) -> int:
        """The pipeline rank that holds global stage ``stage``."""
        if self.stage_ranks is not None and 0 <= stage < self.total_stages:
            return self.stage_ranks[stage]
        return stage % self.num_stages

    def stages_of(self, rank: int) -> List[int]:
        """The global stages held by ``rank`` in increasing order (round-robin: ``[rank, rank + p, ...]``)."""
        if self.stage_ranks is not None:
            return [s for s, r in enumerate(self.stage_ranks) if r == rank]
        return [rank + k * self.num_stages for k in range(self.virtual_stages)]

    def actions(self, rank: int) -> List[Action]:
        """The ordered action list of pipeline rank ``rank``."""
        if not 0 <= rank < self.num_stages:
            raise ValueError(f"rank {rank} out of range [0, {self.num_stages})")
        return list(self.rank_actions[rank])

    def __str__(self) -> str:
        return format_schedule(self)


# -- builders -------------------------------------------------------------------------------------
def _check_positive(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


class _Builder:
    """Appends compute actions with their surrounding transfers to one rank's list."""

    def __init__(self, p: int, total: int, stage_ranks: Optional[Sequence[int]] = None):
        self.p, self.total, self.acts = p, total, []
        self.rank = (lambda s: s % p) if stage_ranks is None else (lambda s: stage_ranks[s])

    def forward(self, stage: int, mb: int) -> None:
        remote_in = stage > 0 and self.rank(stage - 1) != self.rank(stage)
        remote_out = stage < self.total - 1 and self.rank(stage + 1) != self.rank(stage)
        if remote_in:
            self.acts.append(Action(ActionKind.RECV_ACT, mb, stage))
        self.acts.append(Action(ActionKind.FORWARD, mb, stage))
        if remote_out:
            self.acts.append(Action(ActionKind.SEND_ACT, mb, stage))

    def backward(self, stage: int, mb: int, kind: ActionKind = ActionKind.BACKWARD) -> None:
        remote_in = stage < self.total - 1 and self.rank(stage + 1) != self.rank(stage)
        remote_out = stage > 0 and self.rank(stage - 1) != self.rank(stage)
        if remote_in:
            self.acts.append(Action(ActionKind.RECV_GRAD, mb, stage))
        self.acts.append(Action(kind, mb, stage))
        if remote_out:
            self.acts.append(Action(ActionKind.SEND_GRAD, mb, stage))

    def backward_input(self, stage: int, mb: int) -> None:
        self.backward(stage, mb, ActionKind.BACKWARD_INPUT)

    def backward_weight(self, stage: int, mb: int) -> None:
        self.acts.append(Action(ActionKind.BACKWARD_WEIGHT, mb, stage))


def _gpipe(p: int, m: int, r: int) -> List[Action]:
    b = _Builder(p, p)
    for i in range(m):
        b.forward(r, i)
    for i in range(m):
        b.backward(r, i)
    return b.acts


def _one_f_one_b(p: int, m: int, r: int) -> List[Action]:
    b = _Builder(p, p)
    warmup = min(p - r - 1, m)
    for i in range(warmup):
        b.forward(r, i)
    for k in range(m - warmup):
        b.forward(r, warmup + k)
        b.backward(r, k)
    for k in range(m - warmup, m):
        b.backward(r, k)
    return b.acts


def _interleaved(p: int, m: int, v: int, r: int) -> List[Action]:
    # Megatron-LM's order: the k-th forward of a rank runs chunk (k // p) % v on micro-batch
    # (k // (p v)) p + k % p; backwards walk the chunks in reverse. Warm-up is long enough
    # that the first backward's gradient has arrived when it is needed.
    b = _Builder(p, p * v)
    total = m * v

    def unit(k: int, forward: bool) -> Tuple[int, int]:
        chunk = (k % (p * v)) // p
        if not forward:
            chunk = v - 1 - chunk
        return chunk * p + r, (k // (p * v)) * p + k % p

    warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
    for k in range(warmup):
        b.forward(*unit(k, True))
    for k in range(total - warmup):
        b.forward(*unit(k + warmup, True))
        b.backward(*unit(k, False))
    for k in range(total - warmup, total):
        b.backward(*unit(k, False))
    return b.acts


def _zb_h1(p: int, m: int, r: int) -> List[Action]:
    # 1F1B's order with each backward split into I and W; rank r runs its first r steady-state
    # iterations without a W, so every rank holds at most p micro-batches (1F1B's rank 0) and its
    # I runs as soon as the gradient arrives; the held-back Ws fill the cool-down's waits.
    b = _Builder(p, p)
    warmup = min(p - r - 1, m)
    for i in range(warmup):
        b.forward(r, i)
    w = 0
    for k in range(m - warmup):
        b.forward(r, warmup + k)
        b.backward_input(r, k)
        if k >= r:
            b.backward_weight(r, w)
            w += 1
    for k in range(m - warmup, m):
        b.backward_input(r, k)
        b.backward_weight(r, w)
        w += 1
    while w < m:
        b.backward_weight(r, w)
        w += 1
    return b.acts


def _v_ranks(p: int) -> Tuple[int, ...]:
    """ZBV's placement: stage s on rank s for s < p, else on rank 2p - 1 - s."""
    return tuple(list(range(p)) + list(range(p - 1, -1, -1)))


def _zbv(p: int, m: int, r: int) -> List[Action]:
    # PyTorch's ScheduleZBVZeroBubble order (torch/distributed/pipelining/schedules.py), built for
    # max(m, 2p - 1) micro-batches; the actions of micro-batches >= m are then dropped.
    b = _Builder(p, 2 * p, _v_ranks(p))
    c0, c1 = r, 2 * p - 1 - r
    n = max(m, 2 * p - 1)
    ops: List[Tuple[str, int, int]] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (p - r) - 1):
        ops.append(("F", c0, f0)); f0 += 1
    for _ in range(r):
        ops.append(("F", c1, f1)); f1 += 1
        ops.append(("F", c0, f0)); f0 += 1
    for _ in range(p - r):
        ops.append(("F", c1, f1)); f1 += 1
        ops += [("I", c1, b1), ("W", c1, b1)]; b1 += 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            ops.append(("F", c0, f0)); f0 += 1
        ops += [("I", c0, b0), ("W", c0, b0)]; b0 += 1
        ops.append(("F", c1, f1)); f1 += 1
        ops += [("I", c1, b1), ("W", c1, b1)]; b1 += 1
    w0, w1 = b0, b1
    for _ in range(r):
        ops.append(("I", c0, b0)); b0 += 1
        ops.append(("I", c1, b1)); b1 += 1
    for _ in range(p - r):
        ops.append(("I", c0, b0)); b0 += 1
        ops.append(("W", c0, w0)); w0 += 1
    while w1 < b1:
        ops.append(("W", c1, w1)); w1 += 1
    while w0 < b0:
        ops.append(("W", c0, w0)); w0 += 1
    emit = {"F": b.forward, "I": b.backward_input, "W": b.backward_weight}
    for kind, stage, mb in ops:
        if mb < m:
            emit[kind](stage, mb)
    return b.acts


def make_schedule(kind: Union[PipelineSchedule, str], num_stages: int, num_microbatches: int,
                  virtual_stages: Optional[int] = None) -> Schedule:
    """Build the per-rank action lists of a pipeline schedule.

    Args:
        kind: :class:`PipelineSchedule` (or ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zb-h1"``, ``"zbv"``).
        num_stages: the number of pipeline ranks ``p``.
        num_microbatches: micro-batches ``m`` per step.
        virtual_stages: model chunks per rank ``v`` (interleaved: any; ZBV: 2; the others: 1).
            ``None`` means 2 for ZBV and 1 otherwise.

    Returns:
        A :class:`Schedule`; ``schedule.actions(rank)`` is rank ``rank``'s ordered list.

    Raises:
        ValueError: interleaved with ``m`` not a multiple of ``p``, or ``v > 1`` for GPipe/1F1B.

    Example:
        >>> s = make_schedule("interleaved", num_stages=2, num_microbatches=4, virtual_stages=2)
        >>> print(format_schedule(s))
    """
    kind = PipelineSchedule.parse(kind)
    p = _check_positive("num_stages", num_stages)
    m = _check_positive("num_microbatches", num_microbatches)
    if virtual_stages is None:
        virtual_stages = 2 if kind is PipelineSchedule.ZBV else 1
    v = _check_positive("virtual_stages", virtual_stages)
    if kind is PipelineSchedule.ZBV:
        if v != 2:
            raise ValueError(f"ZBV places exactly two model chunks per rank in a V; got virtual_stages={v} "
                             "(pass virtual_stages=2 or leave it out)")
        return Schedule(p, m, 2, tuple(tuple(_zbv(p, m, r)) for r in range(p)), kind, _v_ranks(p))
    if kind is PipelineSchedule.INTERLEAVED_ONE_F_ONE_B:
        if m % p:
            raise ValueError(f"the interleaved 1F1B schedule needs num_microbatches to be a multiple of "
                             f"num_stages; got num_microbatches={m}, num_stages={p}")
        lists = [_interleaved(p, m, v, r) for r in range(p)]
    elif v != 1:
        raise ValueError(f"{kind.name} runs one model chunk per rank; got virtual_stages={v} "
                         "(use PipelineSchedule.INTERLEAVED_ONE_F_ONE_B for virtual stages)")
    elif kind is PipelineSchedule.GPIPE:
        lists = [_gpipe(p, m, r) for r in range(p)]
    elif kind is PipelineSchedule.ZB_H1:
        lists = [_zb_h1(p, m, r) for r in range(p)]
    else:
        lists = [_one_f_one_b(p, m, r) for r in range(p)]
    return Schedule(p, m, v, tuple(tuple(a) for a in lists), kind)


# -- simulator --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SimulationResult:
    """What :func:`simulate` measured.

    Attributes:
        makespan: time from the first action to the last one finishing.
        busy: compute time per rank.
        idle_fraction: ``1 - busy / makespan`` per rank.
        bubble: per rank, the idle time between its first action's start and its last action's end
            (the zero-bubble paper's measure: each rank starts its next step as soon as it is done);
            ``max(bubble)`` is the schedule's bubble, ``(p - 1)(F + B + W)`` for 1F1B.
        peak_activations: per rank, the most (stage, micro-batch) pairs forwarded and not yet
            backwarded at once (activations held).
        peak_activations_per_stage: the same per global stage.
        timeline: per rank, ``(start, end, action)`` of every compute action.
    """

    makespan: Union[int, float, Fraction]
    busy: List[Union[int, float, Fraction]]
    idle_fraction: List[float]
    peak_activations: List[int]
    peak_activations_per_stage: List[int]
    timeline: List[List[Tuple[object, object, Action]]]
    bubble: List[Union[int, float, Fraction]] = ()


_MATCH = {ActionKind.RECV_ACT: ActionKind.SEND_ACT, ActionKind.RECV_GRAD: ActionKind.SEND_GRAD}


def _peer_stage(a: Action) -> int:
    """The stage whose send a receive waits for."""
    return a.stage - 1 if a.kind is ActionKind.RECV_ACT else a.stage + 1


def simulate(schedule: Schedule, forward_time=1, backward_time=2, comm_time=0, weight_time=0) -> SimulationResult:
    """Execute a schedule's action lists without MPI and time them.

    Time model: every ``FORWARD`` action (one model chunk on one micro-batch) takes
    ``forward_time``, every ``BACKWARD_INPUT`` ``backward_time``, every ``BACKWARD_WEIGHT``
    ``weight_time`` and every unsplit ``BACKWARD`` ``backward_time + weight_time``, whatever the
    chunk (so with ``weight_time=0`` the times of 1F1B are as before, and with F, B, W given a
    split and an unsplit schedule are timed alike); a send costs
    nothing to its rank and its data is available to the receiver ``comm_time`` later; a rank
    runs its list in order, waiting at a receive until the data is there. With integer times the
    results are exact (``makespan`` and ``busy`` are ints).

    Args:
        schedule: a :class:`Schedule` (from :func:`make_schedule` or hand-made).
        forward_time, backward_time, comm_time, weight_time: durations (non-negative numbers).

    Returns:
        A :class:`SimulationResult`.

    Raises:
        ScheduleDeadlockError: some ranks wait forever; the message names each blocked rank and
            the action it waits on. Also raised for an action whose input is never produced on
            its rank (a forward before its receive, a backward before its forward, ...).

    Example:
        >>> r = simulate(make_schedule("gpipe", 4, 8))
        >>> r.makespan, r.idle_fraction[0]      # 3 (m + p - 1) and (p - 1) / (m + p - 1)
        (33, 0.2727272727272727)
    """
    for name, t in (("forward_time", forward_time), ("backward_time", backward_time), ("comm_time", comm_time),
                    ("weight_time", weight_time)):
        if not t >= 0:
            raise ValueError(f"simulate: {name} must be >= 0, got {t!r}")
    duration = {ActionKind.FORWARD: forward_time, ActionKind.BACKWARD: backward_time + weight_time,
                ActionKind.BACKWARD_INPUT: backward_time, ActionKind.BACKWARD_WEIGHT: weight_time}
    sim = _Simulation(schedule, duration, comm_time)
    sim.run()
    sim.check_blocked()
    sim.check_complete()
    return sim.result()


class _Simulation:
    """The state of one :func:`simulate` run: each rank's position in its list, clock and busy
    time, the sends and completions so far, and the activations held per rank and per stage."""

    def __init__(self, schedule: Schedule, duration: Dict[ActionKind, object], comm_time):
        p, S = schedule.num_stages, schedule.total_stages
        self.schedule, self.duration, self.comm_time = schedule, duration, comm_time
        self.p, self.S, self.m = p, S, schedule.num_microbatches
        self.lists = [schedule.actions(r) for r in range(p)]
        self.pos = [0] * p
        self.clock = [0] * p
        self.busy = [0] * p
        self.sent: Dict[Tuple[ActionKind, int, int], object] = {}     # (send kind, mb, stage) -> time sent
        self.done: Dict[Tuple[ActionKind, int, int], object] = {}     # compute/recv completions per rank-local key
        self.held = [0] * p
        self.peak = [0] * p
        self.held_stage = [0] * S
        self.peak_stage = [0] * S
        self.timeline: List[List[Tuple[object, object, Action]]] = [[] for _ in range(p)]

    # -- the event loop ----------------------------------------------------------------------------
    def run(self) -> None:
        """Run every rank's list in turns until no rank can move (all done, or blocked at a receive)."""
        progress = True
        while progress:
            progress = False
            for r in range(self.p):
                while self.pos[r] < len(self.lists[r]):
                    a = self.lists[r][self.pos[r]]
                    self.check(r, a)
                    if a.kind in _COMPUTE:
                        self.compute(r, a)
                    elif a.kind in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD):
                        self.send(r, a)
                    elif not self.receive(r, a):
                        break  # blocked: the matching send has not run yet
                    self.pos[r] += 1
                    progress = True

    def fail(self, r: int, a: Action, why: str):
        raise ScheduleDeadlockError(f"rank {r}: action {a} (position {self.pos[r]}) {why}")

    def check(self, r: int, a: Action) -> None:
        S, m = self.S, self.m
        if not 0 <= a.stage < S or self.schedule.rank_of(a.stage) != r:
            self.fail(r, a, f"names stage {a.stage}, which is not on rank {r} (stages {self.schedule.stages_of(r)})")
        if not 0 <= a.microbatch < m:
            self.fail(r, a, f"names micro-batch {a.microbatch}, outside [0, {m})")

    def compute(self, r: int, a: Action) -> None:
        start = self.ready_time(r, a)
        end = start + self.duration[a.kind]
        self.clock[r] = end
        self.busy[r] += self.duration[a.kind]
        self.done[(a.kind, a.microbatch, a.stage)] = end
        self.timeline[r].append((start, end, a))
        if a.kind is not ActionKind.BACKWARD_INPUT:
            self.hold(r, a)

    def send(self, r: int, a: Action) -> None:
        srcs = (ActionKind.FORWARD,) if a.kind is ActionKind.SEND_ACT else _GRAD_MAKERS
        if not any((src, a.microbatch, a.stage) in self.done for src in srcs):
            self.fail(r, a, f"sends before {Action(srcs[0], a.microbatch, a.stage)} has run")
        if (a.kind, a.microbatch, a.stage) in self.sent:
            self.fail(r, a, "sends a second time")
        self.sent[(a.kind, a.microbatch, a.stage)] = self.clock[r]

    def receive(self, r: int, a: Action) -> bool:
        """Complete receive ``a``; False (and nothing done) while its matching send has not run."""
        key = (_MATCH[a.kind], a.microbatch, _peer_stage(a))
        if key not in self.sent:
            return False
        self.done[(a.kind, a.microbatch, a.stage)] = max(self.clock[r], self.sent[key] + self.comm_time)
        return True

    def ready_time(self, r: int, a: Action):
        """When the inputs of compute action ``a`` are there, or raise if they never will be."""
        t, done, fail, S = self.clock[r], self.done, self.fail, self.S
        if a.kind is ActionKind.FORWARD:
            if (ActionKind.FORWARD, a.microbatch, a.stage) in done:
                fail(r, a, "runs a second time")
            if a.stage > 0:
                local = self.schedule.rank_of(a.stage - 1) == r
                key = (ActionKind.FORWARD if local else ActionKind.RECV_ACT, a.microbatch, a.stage - 1 if local else a.stage)
                if key not in done:
                    fail(r, a, "has no input: " + ("the previous stage's forward has not run on this rank"
                                                   if local else "no RECV_ACT before it"))
                t = max(t, done[key])
        elif a.kind is ActionKind.BACKWARD_WEIGHT:
            if (ActionKind.BACKWARD_INPUT, a.microbatch, a.stage) not in done:
                fail(r, a, f"runs before {Action(ActionKind.BACKWARD_INPUT, a.microbatch, a.stage)} "
                           "(a weight gradient needs its input-gradient pass first)")
            if (a.kind, a.microbatch, a.stage) in done:
                fail(r, a, "runs a second time")
        else:
            if (ActionKind.FORWARD, a.microbatch, a.stage) not in done:
                fail(r, a, "runs before the forward of the same stage and micro-batch")
            if any((k, a.microbatch, a.stage) in done for k in _GRAD_MAKERS):
                fail(r, a, "runs a second time (a stage runs either B or I and W on a micro-batch)")
            if a.stage < S - 1:
                local = self.schedule.rank_of(a.stage + 1) == r
                if local:
                    key = next(((k, a.microbatch, a.stage + 1) for k in _GRAD_MAKERS
                                if (k, a.microbatch, a.stage + 1) in done), None)
                else:
                    key = (ActionKind.RECV_GRAD, a.microbatch, a.stage)
                if key not in done:
                    fail(r, a, "has no output gradient: " + ("the next stage's backward has not run on this rank"
                                                             if local else "no RECV_GRAD before it"))
                t = max(t, done[key])
        return t

    # -- memory accounting -------------------------------------------------------------------------
    def hold(self, r: int, a: Action) -> None:
        """A forward keeps one micro-batch's activations on its rank and stage; a B or W frees them
        (an I keeps them: its W still needs them)."""
        delta = 1 if a.kind is ActionKind.FORWARD else -1
        self.held[r] += delta
        self.held_stage[a.stage] += delta
        self.peak[r] = max(self.peak[r], self.held[r])
        self.peak_stage[a.stage] = max(self.peak_stage[a.stage], self.held_stage[a.stage])

    # -- the deadlock report -----------------------------------------------------------------------
    def check_blocked(self) -> None:
        """Raise naming every rank left waiting at a receive, and the send it waits for."""
        blocked = [r for r in range(self.p) if self.pos[r] < len(self.lists[r])]
        if blocked:
            lines = []
            for r in blocked:
                a = self.lists[r][self.pos[r]]
                peer = _peer_stage(a)
                lines.append(f"rank {r} waits at {a} (position {self.pos[r]}) for "
                             f"{Action(_MATCH[a.kind], a.microbatch, peer)} from rank "
                             f"{self.schedule.rank_of(peer) if 0 <= peer < self.S else '?'}")
            raise ScheduleDeadlockError("pipeline schedule deadlocks: ranks " + str(blocked) + " are blocked:\n  "
                                        + "\n  ".join(lines))

    def check_complete(self) -> None:
        """Raise if some micro-batch misses a stage's forward or backward, or an I has no W."""
        done = self.done
        for r in range(self.p):
            for s in self.schedule.stages_of(r):
                for i in range(self.m):
                    split = (ActionKind.BACKWARD_INPUT, i, s) in done
                    if split and (ActionKind.BACKWARD_WEIGHT, i, s) not in done:
                        raise ScheduleDeadlockError(
                            f"rank {r}: the schedule runs {Action(ActionKind.BACKWARD_INPUT, i, s)} but never "
                            f"{Action(ActionKind.BACKWARD_WEIGHT, i, s)}; every I needs its W")
                    for kind in (ActionKind.FORWARD, ActionKind.BACKWARD_INPUT if split else ActionKind.BACKWARD):
                        if (kind, i, s) not in done:
                            raise ScheduleDeadlockError(
                                f"rank {r}: the schedule never runs {Action(kind, i, s)}; every micro-batch must pass "
                                "every stage forward and backward once")

    # -- the bubble accounting ---------------------------------------------------------------------
    def result(self) -> SimulationResult:
        busy, clock = self.busy, self.clock
        makespan = max(clock) if clock else 0
        idle = [0.0 if makespan == 0 else float(1 - Fraction(b) / Fraction(makespan)) if _exact(b, makespan)
                else 1.0 - b / makespan for b in busy]
        bubble = [(ev[-1][1] - ev[0][0] - b) if ev else 0 for ev, b in zip(self.timeline, busy)]
        return SimulationResult(makespan, busy, idle, self.peak, self.peak_stage, self.timeline, bubble)


def _exact(*xs) -> bool:
    return all(isinstance(x, (int, Fraction)) for x in xs)


# -- printer -----------------------------------------------------------------------------------------
def format_schedule(schedule: Schedule, forward_time=1, backward_time=1, comm_time=0, weight_time=None) -> str:
    """The rank x time grid of a schedule: one row per rank, one column per time unit.

    Compute actions are placed where :func:`simulate` runs them (default: every action one time
    unit, so each column is one step); a cell reads ``"2F0"`` (stage 2, forward, micro-batch 0)
    or ``"1B3"`` (``"1I3"``/``"1W3"``: input- and weight-gradient halves of a split backward);
    a blank cell is bubble. An action longer than one unit fills its columns. By default every
    action takes one unit (``weight_time=None``: 1 where the schedule has ``W`` actions, else 0).

    Args:
        schedule: a :class:`Schedule`.
        forward_time, backward_time, comm_time, weight_time: durations passed to :func:`simulate`
            (integers).

    Returns:
        The grid as a string.

    Example:
        >>> print(format_schedule(make_schedule("1f1b", 2, 3)))
    """
    if weight_time is None:
        weight_time = int(any(a.kind is ActionKind.BACKWARD_WEIGHT for acts in schedule.rank_actions for a in acts))
    res = simulate(schedule, forward_time, backward_time, comm_time, weight_time)
    T = int(res.makespan)
    cells = [[""] * T for _ in range(schedule.num_stages)]
    for r, events in enumerate(res.timeline):
        for start, end, a in events:
            for t in range(int(start), int(end)):
                cells[r][t] = str(a)
    width = max([len(c) for row in cells for c in row] + [len(str(T - 1)), 3])
    head = "time    " + " ".join(f"{t:>{width}}" for t in range(T))
    rows = [(f"rank {r:<3}" + " ".join(f"{c:>{width}}" for c in row)).rstrip() for r, row in enumerate(cells)]
    return "\n".join([head] + rows)


def _compute_order(schedule: Schedule, rank: int) -> List[Action]:
    """Rank ``rank``'s compute actions in order."""
    return [a for a in schedule.actions(rank) if a.kind in _COMPUTE]


def _recv_order(schedule: Schedule, rank: int, train: bool = True) -> Dict[int, List[Action]]:
    """``rank``'s receives from each peer, in the order that peer sends them (``[Note: p2p order]``).

    Every send of ``schedule.actions(q)`` to ``rank`` (``SEND_F`` of stage ``s`` into stage ``s + 1``,
    ``SEND_B`` of stage ``s`` into ``s - 1``) becomes the receive action of ``rank`` it feeds; with
    ``train=False`` (eval: forwards only) gradient sends are left out. Peers that send nothing are absent.

    Example:
        >>> [str(a) for a in _recv_order(make_schedule("zbv", 2, 4), 1)[0][:4]]
        ['1RECV_F0', '1RECV_F1', '1RECV_F2', '2RECV_B0']
    """
    order: Dict[int, List[Action]] = {}
    for q in range(schedule.num_stages):
        if q == rank:
            continue
        for a in schedule.actions(q):
            if a.kind is ActionKind.SEND_ACT:
                b = Action(ActionKind.RECV_ACT, a.microbatch, a.stage + 1)
            elif a.kind is ActionKind.SEND_GRAD and train:
                b = Action(ActionKind.RECV_GRAD, a.microbatch, a.stage - 1)
            else:
                continue
            if schedule.rank_of(b.stage) == rank:
                order.setdefault(q, []).append(b)
    return order


# [Note: p2p order]
# NCCL has no tags: between two ranks, the n-th receive one posts from the other takes the n-th
# send the other posts to it (per direction, in posting order). A rank's action list need not receive
# in the order its peer sends: in ZBV on 2 ranks, rank 0 sends stage 0's activation of micro-batch 2
# before stage 3's gradient of micro-batch 0, while rank 1 needs that gradient (2RECV_B0) before that
# activation (1RECV_F2). So the runtime posts every receive from a peer in that peer's send order
# (:func:`_recv_order`): to post one, it first posts the ones the peer sends before it, which always
# can be allocated by then (an activation's shape is known from its stage's header; a gradient's
# from the forward output that the peer's send depends on). Sends go out in action-list order.
def _check_fifo(schedule: Schedule) -> None:
    """The runtime's message matching holds for ``schedule`` (``[Note: p2p order]``).

    Each stage's forwards and backwards run in micro-batch order, and the receives of every rank
    are exactly the sends its peers address to it (each one once), so posting them in each peer's
    send order matches every message on MPI (tags) and on NCCL (order alone).
    """
    for r in range(schedule.num_stages):
        last: Dict[Tuple[ActionKind, int], int] = {}
        for a in schedule.actions(r):
            key = (a.kind, a.stage)
            if key in last and a.microbatch < last[key]:
                raise ValueError(f"rank {r}: {a} comes after micro-batch {last[key]} of the same stage and kind; "
                                 "the runtime needs each stage's transfers in micro-batch order")
            last[key] = a.microbatch
        for train in (True, False):
            sent = sorted((b for q, bs in _recv_order(schedule, r, train).items() for b in bs), key=str)
            kinds = (ActionKind.RECV_ACT, ActionKind.RECV_GRAD) if train else (ActionKind.RECV_ACT,)
            got = sorted((a for a in schedule.actions(r) if a.kind in kinds), key=str)
            if sent != got:
                missing = sorted(set(map(str, got)) - set(map(str, sent)))
                extra = sorted(set(map(str, sent)) - set(map(str, got)))
                raise ValueError(f"rank {r}: its receives and its peers' sends to it differ (receives nobody "
                                 f"sends: {missing}; sends nobody receives: {extra}, or a transfer twice)")
