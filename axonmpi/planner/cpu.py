"""The ``cpu`` machine: this allocation's measured rates in a hardware file (``hardware/cpu.json``).

On CPUs what decides a step of ``examples/train_gpt.py`` is a measured GEMM rate, the measured cost of our
autograd's other kernels (GELU, LayerNorm, the attention core, AdamW, gradient copies), the cores the ranks
really get (for compute and for memory-bound work), the wait of every blocking collective for the other
ranks' turn on a core and the bandwidth a collective gets between computation (on shared cores several
times below back-to-back all-reduces').  :func:`~axonmpi.planner.measure.measure_bandwidth` measures them;
the planner's one cost model (:mod:`.estimate`) plans with them in place of a datasheet's roofline.
``hardware/cpu.json`` holds one measurement of the development allocation (``axonmpi plan --measure
--save-hardware PATH`` writes a new one); ``--measure`` replaces it with the current allocation's.
"""
from __future__ import annotations

import json
import time
from typing import Dict, Optional

from .measure import hardware_from_measured

__all__ = ["save_measured"]


def save_measured(path: str, bw: Dict[str, float], ranks: int, load: Optional[float] = None,
                  cores: Optional[int] = None) -> None:
    """Write ``measure_bandwidth``'s numbers as a hardware file (``--save-hardware``), with the load
    average the machine had when the measurement started."""
    when = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())
    where = f", load average {load:.2f} on {cores} cores" if load is not None else ""
    hw = hardware_from_measured(bw, ranks, name="cpu",
                                description=f"this allocation, measured by `axonmpi plan --measure` on {ranks} "
                                            f"ranks at {when}{where}")
    d = hw.as_dict()
    d["source"] = "axonmpi.planner.measure.measure_bandwidth and measure_kernels (medians; see docs/plan.md)"
    if load is not None:
        d["load_average"] = round(load, 2)
    with open(path, "w") as f:
        json.dump(d, f, indent=2)
        f.write("\n")
