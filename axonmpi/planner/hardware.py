"""Machine descriptions for the planner: datasheet numbers from one small JSON file per machine.

A file (``axonmpi/planner/hardware/<name>.json``) holds what a datasheet (or, for ``cpu``, a
measurement of this allocation) says: ranks per node, peak matrix TFLOP/s per precision, vector
TFLOP/s, memory bandwidth and size, the per-direction bandwidth of a GPU's link inside a node, the
per-GPU network bandwidth between nodes, and latencies.  Machines whose group bandwidths were
measured per group shape (AxoNN's tables for Perlmutter and Frontier) add ``group_gbs``.

No efficiency constant lives here: what was fitted to published runs lives in
:mod:`axonmpi.planner.calibration`, named, with the rows it was fitted on.

A measured machine (``cpu.json``, or what ``axonmpi plan --measure`` measures: :mod:`.measure`) carries
``measured``: the rates the same cost model then uses in place of the roofline and the fitted
efficiencies -- the GEMM's flop rate, the attention core's, our autograd's other kernels per element,
the bandwidth a collective gets between computation, the latency of a call, and the cores the ranks
get in effect (:attr:`HardwareSpec.kernels`).

Example:
    >>> hw = load_hardware("dgx-a100")
    >>> hw.gpus_per_node, hw.peak_flops("fp16") / 1e12
    (8, 312.0)
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional

__all__ = ["HardwareSpec", "load_hardware", "hardware_names", "HARDWARE_DIR"]

HARDWARE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hardware")


@dataclass(frozen=True)
class HardwareSpec:
    """One machine.  Bandwidths in bytes/s (one direction), compute in flop/s per rank, latency in s."""
    name: str
    gpus_per_node: int
    matrix_flops: Dict[str, float]
    vector_flops: float
    memory_bw: float
    memory_bytes: float
    intra_bw: float
    intra_latency: float
    nic_bw: float
    inter_latency: float
    group_gbs: Optional[Dict[str, Dict[str, float]]] = None
    description: str = ""
    source: str = ""
    cores: float = 0.0                  # cpu: cores per node the ranks get (0: one per rank)
    measured: Dict[str, float] = field(default_factory=dict)
    overlap: Optional[bool] = None      # collectives progress under compute (default: not on a measured CPU)

    @property
    def is_measured(self) -> bool:
        """The rates are measured ones (``measured``): no roofline, no fitted efficiency."""
        return bool(self.measured)

    @property
    def overlaps(self) -> bool:
        """Whether a non-blocking collective progresses while the rank computes.  On a measured CPU
        allocation it does not: MPI progresses a request only inside MPI calls (no progress thread),
        and the library tests its requests at unit boundaries only, so the model counts every
        collective as exposed there."""
        return (not self.is_measured) if self.overlap is None else bool(self.overlap)

    def kernel(self, name: str) -> float:
        """A measured rate or cost (``measured[name]``; 0.0 when not measured)."""
        return float(self.measured.get(name, 0.0) or 0.0)

    def mem_cores(self) -> float:
        """The cores in effect for memory-bound work (measured; else ``cores``)."""
        return self.kernel("mem_cores") or self.cores

    def peak_flops(self, precision: str) -> float:
        """Peak matrix flop/s per rank in ``precision`` (fp16, bf16, fp32, fp64 where listed)."""
        try:
            return self.matrix_flops[precision]
        except KeyError:
            raise ValueError(f"hardware {self.name!r} lists no matrix rate for precision {precision!r}; "
                             f"it has {sorted(self.matrix_flops)} (add it to {self.name}.json)") from None

    def table_bw(self, ip: int, size: int) -> Optional[float]:
        """AxoNN's measured bandwidth (bytes/s) of a group of ``size`` ranks with ``ip`` ranks of inner
        groups between neighbours, or ``None`` when this machine has no such table."""
        if not self.group_gbs:
            return None
        keys = sorted(int(k) for k in self.group_gbs if k.isdigit())
        row_key = max([k for k in keys if k <= ip] or keys[:1])
        row = self.group_gbs[str(row_key)]
        if str(size) in row:
            return float(row[str(size)]) * 1e9
        return float(row["0"]) * 1e9

    def as_dict(self) -> Dict[str, object]:
        """The JSON form (what :func:`load_hardware` reads)."""
        d = {"name": self.name, "description": self.description, "source": self.source,
             "gpus_per_node": self.gpus_per_node,
             "matrix_tflops": {k: v / 1e12 for k, v in self.matrix_flops.items()},
             "vector_tflops": self.vector_flops / 1e12, "memory_gbs": self.memory_bw / 1e9,
             "memory_gib": self.memory_bytes / 2 ** 30, "intra_gbs": self.intra_bw / 1e9,
             "intra_latency_us": self.intra_latency * 1e6, "nic_gbs": self.nic_bw / 1e9,
             "inter_latency_us": self.inter_latency * 1e6}
        if self.group_gbs:
            d["group_gbs"] = self.group_gbs
        if self.cores:
            d["cores"] = self.cores
        if self.measured:
            d["measured"] = self.measured
        if self.overlap is not None:
            d["overlap"] = self.overlap
        return d

    def with_(self, **kw) -> "HardwareSpec":
        return replace(self, **kw)


def hardware_names() -> List[str]:
    """The machines shipped with axonmpi."""
    return sorted(f[:-5] for f in os.listdir(HARDWARE_DIR) if f.endswith(".json"))


def _from_dict(d: Dict[str, object], where: str) -> HardwareSpec:
    need = ("name", "gpus_per_node", "matrix_tflops", "vector_tflops", "memory_gbs", "memory_gib", "intra_gbs",
            "nic_gbs")
    missing = [k for k in need if k not in d]
    if missing:
        raise ValueError(f"hardware file {where} lacks {missing} (see axonmpi/planner/hardware/dgx-a100.json)")
    return HardwareSpec(
        name=str(d["name"]), gpus_per_node=int(d["gpus_per_node"]),
        matrix_flops={k: float(v) * 1e12 for k, v in dict(d["matrix_tflops"]).items()},
        vector_flops=float(d["vector_tflops"]) * 1e12, memory_bw=float(d["memory_gbs"]) * 1e9,
        memory_bytes=float(d["memory_gib"]) * 2 ** 30, intra_bw=float(d["intra_gbs"]) * 1e9,
        intra_latency=float(d.get("intra_latency_us", 0.0)) * 1e-6, nic_bw=float(d["nic_gbs"]) * 1e9,
        inter_latency=float(d.get("inter_latency_us", 0.0)) * 1e-6,
        group_gbs={k: v for k, v in dict(d["group_gbs"]).items() if k != "comment"} if d.get("group_gbs") else None,
        description=str(d.get("description", "")), source=str(d.get("source", "")),
        cores=float(d.get("cores", 0.0)), measured=dict(d.get("measured", {})),
        overlap=None if d.get("overlap") is None else bool(d["overlap"]))


def load_hardware(name_or_path: str) -> HardwareSpec:
    """The machine ``name_or_path``: a shipped name (``dgx-a100``, ``dgx-h100``, ``perlmutter``, ``frontier``,
    ``cpu``) or the path of a JSON file of the same form."""
    path = name_or_path if name_or_path.endswith(".json") else os.path.join(HARDWARE_DIR, f"{name_or_path}.json")
    if not os.path.isfile(path):
        raise ValueError(f"unknown hardware {name_or_path!r}: pick one of {hardware_names()} or pass the path of "
                         f"a JSON file like {os.path.join(HARDWARE_DIR, 'dgx-a100.json')}")
    with open(path) as f:
        return _from_dict(json.load(f), path)
