"""Pipeline parallelism: schedules as data (GPipe, 1F1B, interleaved 1F1B), model splitting and the runtime."""
from .schedules import (Action, ActionKind, PipelineSchedule, Schedule, ScheduleDeadlockError, SimulationResult,
                        format_schedule, make_schedule, simulate)

__all__ = [
    "Action", "ActionKind", "PipelineSchedule", "Schedule", "ScheduleDeadlockError", "SimulationResult",
    "format_schedule", "make_schedule", "simulate",
]
