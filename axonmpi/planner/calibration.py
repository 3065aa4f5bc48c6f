"""The planner's fitted constants: each named, with the published rows it was fitted on.

Everything else the planner uses is a datasheet number (``hardware/*.json``) or a count of flops and
bytes.  The constants below were fitted by :func:`axonmpi.planner.published.fit` (a coarse grid search
minimising the mean relative step-time error) on the ten rows of Megatron 2021 Table 1 only
(``published.TABLE1``); Korthikanti et al. 2022 (``published.KORTHIKANTI``) and Megatron 2021's Table 2
(``published.TABLE2``: ZeRO-3 against tensor x pipeline x data) are held out: never fitted, only
checked.  The same constants are used for every GPU machine (an assumption for dgx-h100, perlmutter and
frontier: nobody fitted them there).  A measured machine (``cpu``, ``--measure``) uses none of them: its
rates are measured.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["Calibration", "FITTED", "FITTED_ON", "kernels_assumed"]

#: The rows the constants were fitted on (published.TABLE1's labels).
FITTED_ON = ("1.7B", "3.6B", "7.5B", "18.4B", "39.1B", "76.1B", "145.6B", "310.1B", "529.6B", "1008B")


@dataclass(frozen=True)
class Calibration:
    """Efficiencies (fractions of the datasheet rates).

    Attributes:
        gemm_max: the fraction of peak matrix flop/s a large GEMM reaches.
        gemm_half_gflop: the GEMM size (GFLOP) at which it reaches half of ``gemm_max``
            (``eff(f) = gemm_max f / (f + gemm_half_gflop)``).
        memory: the fraction of the memory bandwidth element-wise kernels reach.
        link: the fraction of the intra-node link's bandwidth (NVLink) a large collective reaches.
        network: the fraction of the per-GPU network bandwidth (InfiniBand, Slingshot) a large collective
            or transfer across nodes reaches.
    """
    gemm_max: float = 0.70
    gemm_half_gflop: float = 2.0
    memory: float = 0.90
    link: float = 0.70
    network: float = 0.90

    def with_(self, **kw) -> "Calibration":
        return replace(self, **kw)


#: The fitted values: ``published.fit()`` over ``published.GRID`` on Table 1 (mean 2.5%, worst 5.1% there),
#: refitted (issue 43) after a group across nodes got the network bandwidth per GPU (its own card) instead of
#: ``k`` cards for its ``k`` ranks on a node, and DDP's gradient copies were counted.  ``gemm_half_gflop``
#: ended at the edge of the grid (2 GFLOP).  Held out: Korthikanti 2022 and Megatron 2021 Table 2.
FITTED = Calibration()


def kernels_assumed(hw, cal: Calibration = FITTED) -> str:
    """One line for ``axonmpi plan``: the kernels a datasheet machine's prediction assumes (a measured machine's:
    the rates measured there).  The fitted efficiencies are Megatron-LM's on its published runs (cuBLAS GEMMs,
    fused element-wise kernels, overlapped NCCL collectives), so a datasheet prediction is what a runtime of that
    class reaches, not axonmpi's own GPU step (host-bound: docs/gpu.md, docs/performance.md)."""
    if hw.is_measured:
        return (f"kernels assumed: the rates measured on {hw.name} (axonmpi's own GEMM, attention core and "
                "element-wise kernels, timed by `axonmpi plan --measure`)")
    return (f"kernels assumed: Megatron-LM's (cuBLAS GEMMs reaching up to {cal.gemm_max:.0%} of the datasheet peak, "
            f"fused element-wise kernels at {cal.memory:.0%} of memory bandwidth, overlapped NCCL collectives at "
            f"{cal.link:.0%} of the link), fitted on its published runs (planner/calibration.py); axonmpi's own GPU "
            "step is host-bound (2.7-11% MFU on an H200, docs/gpu.md): for axonmpi's speed pass --tflops with its "
            "measured rate, or plan a CPU allocation with --measure")
