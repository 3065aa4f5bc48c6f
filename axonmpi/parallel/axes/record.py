"""The composition record: ``parallelize``'s options, checked once, and what each transform leaves for the next."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..plan import ModelPlan, PipelinePlan

__all__ = ["Composition"]


@dataclass
class Composition:
    """One ``parallelize`` call: the grid, the axes' options, and what the transforms found.

    The options are read by every transform; the lists after them are filled in order (tensor, context,
    experts) and read by the later ones (data, pipeline) and by the model's finalize step.
    """

    grid: Any
    tensor: Any = None                                   # None | "axonn" | {pattern: style}
    sequence_parallel: bool = False
    sequence_dim: int = 1
    context: Optional[str] = None
    expert_parallel: int = 1
    expert_tensor_parallel: bool = False
    data: Optional[str] = "ddp"
    sharding_strategy: Any = None
    strategy_options: Dict[str, Any] = field(default_factory=dict)
    checkpointing: Any = None
    pipeline: Optional[PipelinePlan] = None
    model_plan: ModelPlan = field(default_factory=ModelPlan)
    # -- filled by the transforms ------------------------------------------------------------------------
    partial: List[Any] = field(default_factory=list)     # gradients partial over the tensor group (sequence parallel)
    experts: List[Any] = field(default_factory=list)     # split over the expert group (their own replica groups)
    attention: List[Any] = field(default_factory=list)   # the context-parallel attention layers
    enter: Any = None                                     # the declared sequence region's modules, resolved
    leave: Any = None

    @property
    def rank(self) -> int:
        return self.grid.rank

    @property
    def axonn(self) -> bool:
        return self.tensor == "axonn"

    @property
    def megatron(self) -> bool:
        return isinstance(self.tensor, dict)

    @property
    def sp(self) -> bool:
        """Sequence parallelism over a tensor group of more than one rank."""
        return bool(self.sequence_parallel) and self.grid.intra_group.size > 1

    @property
    def cp(self) -> bool:
        return getattr(self.grid, "G_context", 1) > 1

    @property
    def region_declared(self) -> bool:
        return self.sp and self.model_plan.sequence_region is not None
