"""One step of a :class:`~axonmpi.parallel.pipeline.Pipeline`: the executor that walks a rank's action list
(transfers, forward, backward, weight gradients), launches each stage's data-parallel reduction after its last
backward, and measures time and activation memory."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Sequence, Tuple

import numpy as np

from ... import trace as _trace
from ...autograd.function import backward as run_backward
from ...autograd.grad_mode import enable_grad, no_grad
from ...autograd.split_backward import backward_input
from ...autograd.tensor import Tensor
from ...backend import get_array_module
from ...random import fork_rng, initial_seed
from ..token_mean import global_count, token_groups_size
from ._comm import HEADER_SIZE, _communicate, decode_header, encode_header, gather_pieces, piece_size, scatter_piece
from .schedules import Action, ActionKind, _recv_order

if TYPE_CHECKING:
    from .runtime import Pipeline

__all__ = ["PipelineMemoryStats", "PipelineTiming"]

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
        reduce_seconds: the data-parallel reduction's time this rank spent outside the schedule's compute: its
            launches during the schedule and its wait after it ([Note: overlapped stage reductions]); with
            ``Pipeline.overlap = False`` the whole blocking reduction after the schedule.
    """

    step_seconds: float
    forward_seconds: float
    backward_seconds: float
    forward_count: int
    backward_count: int
    weight_seconds: float = 0.0
    weight_count: int = 0
    span_seconds: float = 0.0
    reduce_seconds: float = 0.0

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


def _raw(x):
    return x.data if isinstance(x, Tensor) else x


# [Note: overlapped stage reductions]
# A stage's gradients are final once its last backward action of the step has run (BACKWARD, or the last
# BACKWARD_WEIGHT of a zero-bubble schedule), while the schedule still runs other stages' micro-batches (the
# earlier stages' backwards on other ranks, this rank's other chunks): the executor launches that stage's
# data-parallel reduction right then, non-blocking (Megatron's overlap of the DP reduction with the last
# micro-batch's backward), and the step waits for every stage's after the schedule.  Every rank of a data group
# runs the same action list, so they launch the same reductions in the same order.  A parameter two chunks of
# one rank share (a weight tied across ZBV's V) belongs to the chunk whose last backward runs later
# (:func:`_grad_owner`): its gradient is final only then.  The transfers of the schedule and MPI's progress
# inside them move the reductions along; ``timing().reduce_seconds`` is what stays exposed.  During that last
# backward the stage's buckets already launch as they fill (``GradReducer.listen``, [Note: buckets launched as they
# fill] in grad_sync.py): the reduction overlaps the last micro-batch's backward, as Megatron's DDP does.
def _last_backward(acts: Sequence[Action]) -> Dict[int, int]:
    """Per stage, the index in ``acts`` of its last action that adds to its parameters' gradients."""
    grads = (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)
    return {a.stage: k for k, a in enumerate(acts) if a.kind in grads}


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
        last_grad = _last_backward(acts) if self.train else {}
        launched = 0.0
        self.launches: List[Tuple[int, int]] = []      # (action index, stage) of each stage reduction's launch
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
                if self.pipe.overlap and last_grad.get(a.stage) == k:
                    self.pipe._listen(a.stage)
                with enable_grad() if self.train else no_grad():
                    compute[kind](a)
                last = time.perf_counter()
                spent[kind] += last - t0
                if _trace._ACTIVE is not None:
                    _trace._ACTIVE.events.append((f"pipeline {a}", "pipeline", t0, last,
                                                  {"stage": a.stage, "microbatch": a.microbatch}))
                count[kind] += 1
                if self.pipe.overlap and last_grad.get(a.stage) == k:   # [Note: overlapped stage reductions]
                    self.pipe._start_stage_reduction(a.stage)
                    self.launches.append((k, a.stage))
                    launched += time.perf_counter() - last
        for w in self.sends:
            w.wait()
        self.sends = []
        B, I, W = ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
        self.timing = PipelineTiming(time.perf_counter() - t_start, spent[ActionKind.FORWARD], spent[B] + spent[I],
                                     count[ActionKind.FORWARD], count[B] + count[I], spent[W], count[W],
                                     0.0 if first is None else last - first, launched)
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
