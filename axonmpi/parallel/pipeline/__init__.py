"""Pipeline parallelism: schedules as data (GPipe, 1F1B, interleaved 1F1B), model splitting and the runtime."""
from .runtime import Pipeline, PipelineMemoryStats, PipelineTiming
from .schedules import (Action, ActionKind, PipelineSchedule, Schedule, ScheduleDeadlockError, SimulationResult,
                        format_schedule, make_schedule, simulate)
from .split import SplitBy, split_module, split_points
from .stage import PipelineStage
from .staged import LayerBuilder

__all__ = [
    "Action", "ActionKind", "LayerBuilder", "Pipeline", "PipelineMemoryStats", "PipelineSchedule", "PipelineStage", "PipelineTiming", "Schedule",
    "ScheduleDeadlockError", "SimulationResult", "SplitBy", "format_schedule", "make_schedule", "simulate",
    "split_module", "split_points",
]
