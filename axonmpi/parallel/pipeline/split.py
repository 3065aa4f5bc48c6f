"""Cutting a ``Sequential`` (or a model exposing ``pipeline_layers()``, the GPT) into balanced pipeline chunks that share the model's parameters."""
from __future__ import annotations

import enum
from typing import List, Optional, Sequence, Union

from ...distributed.group import ProcessGroup
from ...distributed.world import role_group
from ...nn.module import Module, Sequential
from ...enums import coerce_enum

__all__ = ["SplitBy", "split_module", "split_points"]


class SplitBy(enum.Enum):
    """How :func:`split_module` balances the chunks."""

    PARAMS = "params"   # minimise the largest chunk's parameter count
    LAYERS = "layers"   # equal numbers of modules (the first chunks take one more when uneven)


def _layers(model: Module) -> List[Module]:
    """The model as an ordered list of modules, each fed the previous one's output: a ``Sequential``'s
    children, or what a model with ``pipeline_layers()`` gives (the GPT: embedding, blocks, head)."""
    layers = getattr(model, "pipeline_layers", None)
    if callable(layers):
        out = list(layers())
        bad = [f"{i}: {type(m).__name__}" for i, m in enumerate(out) if not isinstance(m, Module)]
        if bad or not out:
            raise TypeError(f"{_qual(model)}.pipeline_layers() must return a non-empty list of axonmpi.nn.Module "
                            f"(each fed the previous one's output), got {bad or 'an empty list'} "
                            "(docs/parallelize.md, 'The pipeline_layers() protocol')")
        return out
    if isinstance(model, Sequential):
        return list(model)
    raise TypeError(
        f"a pipeline cuts an axonmpi.nn.Sequential or a model with a pipeline_layers() method; got a {_qual(model)}, "
        "which is neither. Add to it `def pipeline_layers(self): return [...]`: the model as an ordered list of its "
        "own submodules (or small wrappers holding them), each called on the previous one's output, the first on "
        "the model's input and the last giving what loss_fn(output, target) takes, so that every parameter belongs "
        "to exactly one of them (docs/parallelize.md, 'The pipeline_layers() protocol', has an example); or pass "
        "an nn.Sequential")


def _qual(model) -> str:
    """``package.module.Class``: two classes of one name are told apart."""
    return f"{type(model).__module__}.{type(model).__qualname__}"


def _param_count(m: Module) -> int:
    return sum(int(p.data.size) for p in m.parameters())


def _balanced(weights: Sequence[int], k: int) -> List[int]:
    """Start indices of ``k`` contiguous non-empty parts minimising the largest part's weight
    (ties: the smallest largest module count, then the earliest cuts)."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    worst = (float("inf"), float("inf"))
    # best[j][i]: smallest (max weight, max count) splitting the first i items into j parts
    best = [[worst] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = (0, 0)
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for h in range(j - 1, i):
                c = max(best[j - 1][h], (prefix[i] - prefix[h], i - h))
                if c < best[j][i]:
                    best[j][i], cut[j][i] = c, h
    starts, i = [], n
    for j in range(k, 0, -1):
        i = cut[j][i]
        starts.append(i)
    return starts[::-1]


def split_points(model: Module, num_stages: int, virtual_stages: int = 1,
                 by: Union[SplitBy, str] = SplitBy.PARAMS, boundaries: Optional[Sequence[int]] = None) -> List[int]:
    """Start index (into the model's layer list) of each of the ``num_stages * virtual_stages`` chunks.

    Same arguments as :func:`split_module`; needs no MPI. The layer list of a ``Sequential`` is
    its children; of a GPT it is ``[embedding, block 0, ..., block n-1, head]``.
    """
    layers = _layers(model)
    for name, v in (("num_stages", num_stages), ("virtual_stages", virtual_stages)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"split_module: {name} must be a positive int, got {v!r}")
    k, n = num_stages * virtual_stages, len(layers)
    if n < k:
        raise ValueError(f"split_module: {n} layers cannot fill {k} chunks (num_stages={num_stages} x "
                         f"virtual_stages={virtual_stages}); every chunk needs at least one module")
    if boundaries is not None:
        b = [int(x) for x in boundaries]
        if len(b) != k - 1 or any(not 0 < x < n for x in b) or any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError(f"split_module: boundaries must be {k - 1} strictly increasing start indices in "
                             f"(0, {n}) for {k} chunks of {n} layers, got {list(boundaries)}")
        return [0] + b
    by = coerce_enum(SplitBy, by, "split_module by (by must be 'params' or 'layers')")
    if by is SplitBy.LAYERS:
        q, extra = divmod(n, k)
        starts, at = [], 0
        for c in range(k):
            starts.append(at)
            at += q + (1 if c < extra else 0)
        return starts
    return _balanced([_param_count(m) for m in layers], k)


def _check_untied(chunks: List[Sequential]) -> None:
    owner = {}
    for c, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            first = owner.setdefault(id(p), (c, name))
            if first[0] != c:
                raise ValueError(
                    f"split_module: parameter {first[1]!r} of chunk {first[0]} is also {name!r} of chunk {c}; "
                    "a plain Pipeline would train the two stages' copies apart — use parallelize(..., "
                    "pipeline=PipelinePlan(...)) (it all-reduces the tied gradient between the stages), untie them, "
                    "or choose boundaries that keep both uses in one chunk")


def _placement(schedule, num_stages: int, virtual_stages: int):
    """``(virtual_stages, stage_ranks)`` of ``schedule`` over ``num_stages`` ranks (``stage_ranks`` round-robin
    when the schedule does not say otherwise)."""
    from .schedules import PipelineSchedule, Schedule, make_schedule
    if isinstance(schedule, Schedule):
        sched = schedule
    else:
        kind = coerce_enum(PipelineSchedule, schedule, "split_module schedule")
        v = None if kind is PipelineSchedule.ZBV and virtual_stages == 1 else virtual_stages
        sched = make_schedule(kind, num_stages, max(num_stages, 1), v)
    if sched.num_stages != num_stages:
        raise ValueError(f"split_module: the schedule is for {sched.num_stages} pipeline ranks, num_stages={num_stages}")
    if virtual_stages not in (1, sched.virtual_stages):
        raise ValueError(f"split_module: virtual_stages={virtual_stages} disagrees with the schedule's "
                         f"{sched.virtual_stages}")
    return sched.virtual_stages, tuple(sched.rank_of(s) for s in range(sched.total_stages))


def split_module(model: Module, num_stages: int, virtual_stages: int = 1, by: Union[SplitBy, str] = "params",
                 boundaries: Optional[Sequence[int]] = None, *, group: Optional[ProcessGroup] = None,
                 rank: Optional[int] = None, stage_ranks: Optional[Sequence[int]] = None,
                 schedule=None, tied: bool = False) -> List[Sequential]:
    """Cut ``model`` into ``num_stages * virtual_stages`` chunks; return this rank's.

    Chunk ``s`` lives on pipeline rank ``s % num_stages`` (or where ``schedule`` / ``stage_ranks``
    place it); the result is ``[chunk r, chunk r + p, ...]`` for pipeline rank ``r``. Each chunk
    carries its place: ``chunk.stage_index`` (its global stage ``s``) and ``chunk.num_chunks``
    (``num_stages * virtual_stages``); a :class:`~axonmpi.parallel.Pipeline` whose schedule places
    other stages on this rank raises instead of running a permuted model. Every chunk is a ``Sequential`` of at
    least one of the model's own modules (parameters are shared, never copied, so
    ``model.state_dict()`` on a rank shows its stages' trained values); chunks without
    parameters are allowed. A parameter used by two chunks (tied weights) is refused with a
    ``ValueError`` unless ``tied=True`` (then the caller keeps the copies equal, as
    :func:`~axonmpi.parallel.parallelize` does: their gradients summed over the ranks holding them).

    Args:
        model: an ``axonmpi.nn.Sequential``, or an ``axonmpi.models.GPT`` (cut as
            ``[embedding, blocks..., head]``; pair it with ``loss_fn=cross_entropy``).
        num_stages: the number of pipeline ranks ``p``.
        virtual_stages: chunks per rank ``v`` (for the interleaved schedule).
        by: ``"params"`` (balance parameter counts) or ``"layers"`` (balance module counts).
        boundaries: explicit start indices of chunks 1 .. p v - 1 (overrides ``by``).
        group: the pipeline group whose rank picks the chunks (default: all ranks).
        rank: pick the chunks of this pipeline rank instead (no MPI needed).
        stage_ranks: the pipeline rank of each chunk when not round-robin (ZBV's V:
            ``make_schedule("zbv", p, m).stage_ranks``); the result lists this rank's chunks in
            increasing order.
        schedule: cut for this schedule's placement: a :class:`PipelineSchedule` (or its name,
            e.g. ``"zbv"``, whose V places stages ``r`` and ``2p - 1 - r`` on rank ``r``; its
            ``virtual_stages`` is then 2 unless given) or a ready :class:`Schedule`.
        tied: allow a parameter used by two chunks (see above).

    Returns:
        This rank's chunks, a list of ``v`` ``Sequential`` modules.

    Example:
        >>> model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
        >>> [len(c) for c in split_module(model, num_stages=2, rank=0)]
        [2]
    """
    if schedule is not None:
        virtual_stages, placed = _placement(schedule, num_stages, virtual_stages)
        if stage_ranks is not None and tuple(int(x) for x in stage_ranks) != placed:
            raise ValueError(f"split_module: stage_ranks={tuple(stage_ranks)} disagrees with schedule "
                             f"{schedule!r}'s placement {placed}; pass one of them")
        stage_ranks = placed
    starts = split_points(model, num_stages, virtual_stages, by, boundaries)
    layers = _layers(model)
    ends = starts[1:] + [len(layers)]
    chunks = [Sequential(*layers[a:b]) for a, b in zip(starts, ends)]
    if not tied:
        _check_untied(chunks)
    for s, chunk in enumerate(chunks):
        chunk.stage_index, chunk.num_chunks = s, len(chunks)
    if rank is None:
        g = role_group("pipeline", group)
        if g.size != num_stages:
            raise ValueError(f"rank {g.rank}: split_module num_stages={num_stages} must equal the pipeline "
                             f"group's size {g.size}")
        rank = g.rank
    if not 0 <= rank < num_stages:
        raise ValueError(f"split_module: rank {rank} out of range [0, {num_stages})")
    if stage_ranks is None:
        return chunks[rank::num_stages]
    if len(stage_ranks) != len(chunks):
        raise ValueError(f"split_module: stage_ranks has {len(stage_ranks)} entries for {len(chunks)} chunks "
                         f"(num_stages * virtual_stages)")
    return [c for c, r in zip(chunks, stage_ranks) if r == rank]
