"""``PipelineStage``: one model chunk placed on one rank of the pipeline group."""
from __future__ import annotations

from typing import Iterator, Optional, Sequence

from ...distributed.group import ProcessGroup
from ...distributed.world import role_group
from ...nn.module import Module

__all__ = ["PipelineStage"]


class PipelineStage:
    """Model chunk ``stage_id`` of a pipeline over ``num_stages`` ranks.

    Stages are numbered globally; with ``v`` virtual stages per rank there are
    ``num_stages * v`` of them and stage ``s`` lives on pipeline rank ``s % num_stages`` (so a
    rank holds stages ``r, r + p, ...``). ``num_stages`` is the number of pipeline ranks, as in
    :func:`~axonmpi.parallel.pipeline.make_schedule` and
    :func:`~axonmpi.parallel.pipeline.split_module`.

    Args:
        module: the chunk (its parameters are used as they are, not copied).
        stage_id: global stage index (``>= 0``, ``stage_id % num_stages`` must be this rank).
        num_stages: number of pipeline ranks ``p`` (the size of ``group``).
        group: the pipeline process group (default: all ranks of the World).
        stage_ranks: the pipeline rank of every global stage when they are not round-robin
            (ZBV's V: ``make_schedule("zbv", p, m).stage_ranks``); ``None``: ``s % num_stages``.

    Example:
        >>> chunks = split_module(model, num_stages=2)            # this rank's chunk
        >>> stage = PipelineStage(chunks[0], stage_id=world.rank, num_stages=2)
    """

    def __init__(self, module: Module, stage_id: int, num_stages: int, group: Optional[ProcessGroup] = None, *,
                 stage_ranks: Optional[Sequence[int]] = None):
        if not isinstance(module, Module):
            raise TypeError(f"PipelineStage expects an axonmpi.nn.Module, got {type(module).__name__}")
        self.group = role_group("pipeline", group)
        r = self.group.rank
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages != self.group.size:
            raise ValueError(f"rank {r}: PipelineStage num_stages={num_stages!r} must equal the pipeline "
                             f"group's size {self.group.size}")
        if isinstance(stage_id, bool) or not isinstance(stage_id, int) or stage_id < 0:
            raise ValueError(f"rank {r}: stage_id must be a non-negative int, got {stage_id!r}")
        self.module = module
        self.stage_id = stage_id
        self.num_stages = num_stages
        self.stage_ranks = None if stage_ranks is None else tuple(int(x) for x in stage_ranks)
        if self.stage_ranks is not None and not stage_id < len(self.stage_ranks):
            raise ValueError(f"rank {r}: stage_id {stage_id} is outside stage_ranks (of {len(self.stage_ranks)} stages)")
        if self._rank_of(stage_id) != r:
            raise ValueError(f"rank {r}: stage {stage_id} lives on pipeline rank {self._rank_of(stage_id)} "
                             f"({'stage_ranks' if self.stage_ranks else 'stage_id % num_stages'}), not on this rank {r}")

    @property
    def rank(self) -> int:
        """This process's rank in the pipeline group."""
        return self.group.rank

    @property
    def prev_rank(self) -> int:
        """Pipeline rank of stage ``stage_id - 1``."""
        return self._rank_of(self.stage_id - 1)

    @property
    def next_rank(self) -> int:
        """Pipeline rank of stage ``stage_id + 1``."""
        return self._rank_of(self.stage_id + 1)

    def _rank_of(self, stage: int) -> int:
        if self.stage_ranks is not None and 0 <= stage < len(self.stage_ranks):
            return self.stage_ranks[stage]
        return stage % self.num_stages

    def __call__(self, x):
        return self.module(x)

    def parameters(self) -> Iterator:
        """The chunk's parameters."""
        return self.module.parameters()

    def named_parameters(self):
        """The chunk's ``(name, parameter)`` pairs."""
        return self.module.named_parameters()

    def train(self, mode: bool = True) -> "PipelineStage":
        self.module.train(mode)
        return self

    def eval(self) -> "PipelineStage":
        self.module.eval()
        return self

    def __repr__(self) -> str:
        return f"PipelineStage(stage_id={self.stage_id}, num_stages={self.num_stages}, rank={self.rank})"
