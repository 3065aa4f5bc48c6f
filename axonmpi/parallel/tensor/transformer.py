"""The sequence-parallel region's entry at a transformer's embedding dropout (``parallelize``'s tensor axis swaps
it in where a model's plan enters the region)."""
from __future__ import annotations

from ...distributed import ProcessGroup
from ...nn import Dropout
from .mappings import scatter_to_sequence_parallel_region

__all__ = ["SequenceParallelDropout"]


class SequenceParallelDropout(Dropout):
    """Enter the sequence-parallel region: keep this rank's block of the sequence (dimension -2; backward:
    all-gather), then dropout on it.  Replaces a GPT's embedding dropout (``drop``)."""

    def __init__(self, p: float, group: ProcessGroup):
        super().__init__(p)
        self.group = group

    def forward(self, x):
        return super().forward(scatter_to_sequence_parallel_region(x, self.group, dim=-2))
