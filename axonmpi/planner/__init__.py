"""The planner: a cost model of every parallel axis checked against published runs (``axonmpi plan``).

One cost model (:mod:`.estimate`), for a datasheet machine (a roofline with efficiencies fitted on
published runs) and for a measured one (``--measure``, ``cpu``: the allocation's measured rates).

Modules: :mod:`.hardware` (machines as data), :mod:`.measure` (measure this allocation), :mod:`.model`
(transformer -- GPT or Llama shape --, batch, layout), :mod:`.compute`, :mod:`.comm`, :mod:`.axonn`
(AxoNN's 3-D Linear), :mod:`.memory`, :mod:`.pipeline` (bubble from ``schedules.simulate``),
:mod:`.estimate` (one layout), :mod:`.search` (every feasible layout, fastest first), :mod:`.traffic`
(bytes per group in the byte counter's convention), :mod:`.moe` (expert parallel against tensor-parallel
experts, per layer), :mod:`.calibration` (the fitted constants) and :mod:`.published` (the runs they are
fitted on and checked against).
"""
from .calibration import FITTED, FITTED_ON, Calibration, kernels_assumed
from .estimate import PlanEstimate, check_layout, estimate_layout, model_flops
from .hardware import HardwareSpec, hardware_names, load_hardware
from .model import ParallelLayout, TrainConfig, TransformerConfig

__all__ = ["Calibration", "FITTED", "FITTED_ON", "kernels_assumed", "PlanEstimate", "check_layout", "estimate_layout", "model_flops",
           "HardwareSpec", "hardware_names", "load_hardware", "ParallelLayout", "TrainConfig", "TransformerConfig"]
