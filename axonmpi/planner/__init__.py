"""The planner: a cost model of every parallel axis checked against published runs (``axonmpi plan``).

Modules: :mod:`.hardware` (machines as data), :mod:`.model` (transformer, batch, layout),
:mod:`.compute`, :mod:`.comm`, :mod:`.memory`, :mod:`.pipeline` (bubble from ``schedules.simulate``),
:mod:`.estimate` (one layout), :mod:`.search` (every feasible layout, fastest first),
:mod:`.calibration` (the fitted constants) and :mod:`.published` (the runs they are checked against).
"""
from .calibration import FITTED, FITTED_ON, Calibration
from .estimate import PlanEstimate, check_layout, estimate_layout, model_flops
from .hardware import HardwareSpec, hardware_names, load_hardware
from .model import ParallelLayout, TrainConfig, TransformerConfig

__all__ = ["Calibration", "FITTED", "FITTED_ON", "PlanEstimate", "check_layout", "estimate_layout", "model_flops",
           "HardwareSpec", "hardware_names", "load_hardware", "ParallelLayout", "TrainConfig", "TransformerConfig"]
