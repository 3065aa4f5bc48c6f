"""The ``cpu`` machine: HybridGPT's model (``axonmpi.plan``) with this allocation's measured numbers.

On CPUs the runs ``examples/train_gpt.py`` makes are the GPT under AxoNN's easy mode, DDP, FSDP or a
plain pipeline, and what decides their step time is a measured GEMM rate, the measured cost of our
autograd's other kernels (GELU, LayerNorm, the attention core, AdamW, gradient copies), the cores the
ranks really get (for compute and for memory-bound work), the wait of every blocking collective for
the other ranks' turn on a core and the bandwidth a collective gets between computation (on shared
cores several times below back-to-back all-reduces') -- which ``axonmpi.plan.estimate`` models with
its call counts and volumes and ``measure_bandwidth`` measures.  So ``--hardware cpu`` plans with that model; ``hardware/cpu.json`` holds one measurement of the development
allocation (``axonmpi plan --hardware cpu --measure --save-hardware PATH`` writes a new one), and
``--measure`` replaces it with the current allocation's.
"""
from __future__ import annotations

import json
import os
import time
from typing import Dict, Optional, Tuple

__all__ = ["hardware_from_spec", "save_measured", "legacy_layout", "legacy_json"]


def hardware_from_spec(name: str = "cpu", gpus_per_node: Optional[int] = None):
    """``axonmpi.plan.Hardware`` from a hardware file's numbers (fp32 GEMM rate, bandwidths, latency, cores)."""
    from ..plan import Hardware
    from .hardware import load_hardware
    spec = load_hardware(name)
    ranks = gpus_per_node or spec.gpus_per_node
    if spec.measured:              # everything --measure measured, the kernels included
        return Hardware.from_measured(spec.measured, ranks)
    return Hardware(bw_intra=spec.intra_bw, bw_inter=spec.nic_bw, flops=spec.peak_flops("fp32"),
                    gpus_per_node=ranks, latency=spec.intra_latency, cores=spec.cores)


def save_measured(path: str, bw: Dict[str, float], ranks: int) -> None:
    """Write ``measure_bandwidth``'s numbers as a hardware file (``--save-hardware``)."""
    copy = 2 * 4 / bw["copy"] if bw.get("copy") else 0.0        # bytes read + written per second (float32)
    d = {"name": "cpu", "description": f"this allocation, measured by `axonmpi plan --measure` on {ranks} ranks "
                                       f"at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
         "source": "axonmpi.plan.measure_bandwidth and measure_kernels (medians; see docs/plan.md)",
         "gpus_per_node": ranks, "matrix_tflops": {"fp32": bw["flops"] / 1e12, "fp64": bw["flops"] / 2e12},
         "vector_tflops": bw["flops"] / 8e12, "memory_gbs": copy / 1e9,
         "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30 / ranks,
         "intra_gbs": bw["intra"] / 1e9, "intra_latency_us": bw["latency"] * 1e6, "nic_gbs": bw["inter"] / 1e9,
         "inter_latency_us": bw["latency"] * 1e6, "cores": bw["cores"], "measured": bw}
    with open(path, "w") as f:
        json.dump(d, f, indent=2)
        f.write("\n")


def legacy_layout(text: str, world: int) -> Tuple[object, Optional[str], Optional[int]]:
    """``--layout`` for ``--hardware cpu``: ``dp``, ``pp``, ``row``, ``col``, ``depth``, ``zero=3`` (FSDP full shard),
    ``m=`` micro-batches -> (``plan.Layout``, fsdp, m)."""
    from ..plan import Layout
    kw = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        k, _, v = part.partition("=")
        kw[k.strip()] = v.strip()
    allowed = {"dp", "pp", "row", "col", "depth", "zero", "m", "schedule"}
    bad = set(kw) - allowed
    if bad:
        raise ValueError(f"--hardware cpu plans HybridGPT's AxoNN layouts: {sorted(bad)} not modelled there; use "
                         f"{sorted(allowed)} (or a GPU --hardware for tp/sp/cp/ep/vp)")
    n = {k: int(v) for k, v in kw.items() if k != "schedule"}
    lay = Layout(G_data=n.get("dp", 1), G_inter=n.get("pp", 1), G_intra_r=n.get("row", 1),
                 G_intra_c=n.get("col", 1), G_intra_d=n.get("depth", 1))
    if lay.world_size != world:
        raise ValueError(f"--layout {text} uses {lay.world_size} ranks, not --world {world}")
    zero = n.get("zero", 0)
    if zero not in (0, 3):
        raise ValueError(f"--hardware cpu: zero={zero} is not modelled there (0: DDP, 3: FSDP full_shard)")
    return lay, ("full_shard" if zero == 3 else None), n.get("m")


def legacy_json(e, model) -> Dict[str, object]:
    """One ``axonmpi.plan.Estimate`` in ``axonmpi plan --json``'s form."""
    L = e.layout
    flops = 6.0 * model.global_batch * model.seq * (model.layers * 12 * model.width ** 2 + model.vocab * model.width)
    return {"layout": {"dp": L.G_data, "pp": L.G_inter, "row": L.G_intra_r, "col": L.G_intra_c, "depth": L.G_intra_d,
                       "tp": 1, "cp": 1, "ep": 1, "vp": 1, "sp": 0, "zero": 0, "schedule": "1f1b"},
            "micro_batches": e.microbatches, "step_time_s": e.step_time, "memory_gib": e.memory_bytes / 2 ** 30,
            "tflops_per_gpu": flops / (L.world_size * e.step_time) / 1e12,
            "breakdown": {"compute_s": e.compute_time, **{f"{g}_comm_s": t for g, t in e.comm_times.items()},
                          **{f"{g}_calls": c for g, c in e.calls.items()}}}
