"""Moved: the planner is :mod:`axonmpi.planner` (one cost model; ``docs/plan.md``).

This module keeps the names that moved unchanged importable from their old place:
``moe_estimate``, ``moe_options``, ``MoEEstimate`` (:mod:`axonmpi.planner.moe`), ``measure_bandwidth``,
``measure_kernels`` (:mod:`axonmpi.planner.measure`) and ``linear_volumes`` (:mod:`axonmpi.planner.axonn`).
The second cost model that lived here (``Model``, ``Hardware``, ``Layout``, ``estimate``, ``plan``,
``candidate_layouts``, ``format_plan``) is gone: asking for one of those names raises an ``AttributeError``
naming its replacement in :mod:`axonmpi.planner`.

Example:
    >>> from axonmpi.plan import moe_estimate
    >>> moe_estimate(4096, 1024, 4096, 8, 2, expert_parallel=8).option
    'expert_parallel'
"""
from __future__ import annotations

from .planner.axonn import linear_volumes
from .planner.measure import measure_bandwidth, measure_kernels
from .planner.moe import MoEEstimate, moe_estimate, moe_options

__all__ = ["MoEEstimate", "linear_volumes", "measure_bandwidth", "measure_kernels", "moe_estimate", "moe_options"]

_MOVED = {
    "Model": "axonmpi.planner.TransformerConfig (the model) and TrainConfig (the batch)",
    "Hardware": "axonmpi.planner.load_hardware('cpu' or a datasheet machine) or planner.measure.hardware_from_measured",
    "Layout": "axonmpi.planner.ParallelLayout (dp, pp, row, col, depth, zero, ...)",
    "Estimate": "axonmpi.planner.PlanEstimate",
    "estimate": "axonmpi.planner.estimate_layout(cfg, train, layout, hardware)",
    "plan": "axonmpi.planner.search.search(cfg, train, world, hardware)",
    "candidate_layouts": "axonmpi.planner.search.candidates",
    "format_plan": "axonmpi.planner.report.format_table",
    "GROUPS": "axonmpi.planner.estimate.VOLUME_GROUPS",
}


def __getattr__(name: str):
    if name in _MOVED:
        raise AttributeError(f"axonmpi.plan.{name} is gone: the planner has one cost model now, in axonmpi.planner; "
                             f"use {_MOVED[name]} (docs/plan.md)")
    raise AttributeError(f"module 'axonmpi.plan' has no attribute {name!r}")
