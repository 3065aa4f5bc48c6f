"""Time of one collective over one group, given where the group's ranks sit on the nodes.

[Note: placement]  Ranks are numbered fastest axis first -- tensor (Megatron's ``tp``, or AxoNN's
column, row, depth), pipeline, context, data (``axonmpi.distributed.grid``'s order) -- and fill the
nodes in order.  A group of ``g`` ranks whose neighbours are ``ip`` ranks apart (``ip`` = the product of
the sizes of the axes placed inside it) lies in one node when ``ip g <= gpus per node``; else it has
``k = max(1, gpus_per_node // ip)`` ranks on each node and crosses the network.

Ring algorithms (NCCL's for large messages): all-reduce ``2 (g-1)/g V``, all-gather / reduce-scatter
``(g-1)/g V`` bytes through each rank's link (``V`` the full buffer), all-to-all ``(g-1)/g V``,
point-to-point ``V``.  The link's bandwidth: inside a node the GPU's link (NVLink); across nodes the
``k`` ranks of the group on a node share ``k`` network cards (NCCL runs one ring per card), so the
bus bandwidth is ``min(intra, k nic)``; an all-to-all sends its off-node part ``(g-k)/g V`` through
the rank's own card.  Machines with a measured table (AxoNN's, Perlmutter and Frontier) take the
bandwidth from it by ``ip`` and ``g``.  Latency per call: inside a node the link's latency (one
NVSwitch round); across nodes the network's latency times ``2 log2 g`` (all-reduce: NCCL's tree), ``g - 1``
(all-gather, reduce-scatter: rings) or 1 (all-to-all, point-to-point).  Bandwidths are scaled by the fitted efficiencies (``link`` inside a
node, ``network`` across nodes); each
call adds the link's latency.
"""
from __future__ import annotations

import math

from .calibration import Calibration
from .hardware import HardwareSpec

__all__ = ["collective_time", "group_bandwidth", "FACTORS"]

FACTORS = {"allreduce": lambda g: 2.0 * (g - 1) / g, "allgather": lambda g: (g - 1) / g,
           "reducescatter": lambda g: (g - 1) / g, "alltoall": lambda g: (g - 1) / g, "p2p": lambda g: 1.0}


def _inside(ip: int, g: int, hw: HardwareSpec) -> bool:
    return ip * g <= hw.gpus_per_node


def group_bandwidth(g: int, ip: int, hw: HardwareSpec, cal: Calibration, kind: str = "allreduce") -> float:
    """Bytes/s through each rank's link for a collective of ``kind`` over ``g`` ranks ``ip`` apart."""
    table = hw.table_bw(ip, g)
    inside = _inside(ip, g, hw)
    if table is not None:
        return table * (cal.link if inside else cal.network)
    if inside:
        return hw.intra_bw * cal.link
    k = max(1, hw.gpus_per_node // ip)
    if kind == "alltoall":
        # the off-node part through the rank's own card, the on-node part over the node's links
        off = (g - k) / max(g - 1, 1)
        return 1.0 / (off / (hw.nic_bw * cal.network) + (1 - off) / (hw.intra_bw * cal.link))
    if kind == "p2p":                    # g = 2: the two neighbours
        return hw.nic_bw * cal.network
    return min(hw.intra_bw * cal.link, k * hw.nic_bw * cal.network)


def collective_time(kind: str, nbytes: float, g: int, ip: int, hw: HardwareSpec, cal: Calibration,
                    calls: float = 1.0) -> float:
    """Seconds for ``calls`` collectives of ``kind`` on buffers of ``nbytes`` over ``g`` ranks ``ip`` apart."""
    if g <= 1 or nbytes <= 0:
        return 0.0
    lat = hw.intra_latency if _inside(ip, g, hw) else hw.inter_latency * _STEPS[kind](g)
    return calls * (FACTORS[kind](g) * nbytes / group_bandwidth(g, ip, hw, cal, kind) + lat)


def _log2(g: int) -> float:
    return max(1.0, math.ceil(math.log2(g)))


# latency terms per call across nodes: NCCL's tree for an all-reduce (2 log2 g hops), rings for gathers and
# scatters (g - 1 steps), one round for all-to-all and point-to-point
_STEPS = {"allreduce": lambda g: 2 * _log2(g), "allgather": lambda g: g - 1.0, "reducescatter": lambda g: g - 1.0,
          "alltoall": lambda g: 1.0, "p2p": lambda g: 1.0}
