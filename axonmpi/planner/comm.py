"""Time of one collective over one group, given where the group's ranks sit on the nodes.

[Note: placement]  Ranks are numbered fastest axis first -- tensor (Megatron's ``tp``, or AxoNN's
column, row, depth), pipeline, context, data (``axonmpi.distributed.grid``'s order) -- and fill the
nodes in order.  A group of ``g`` ranks whose neighbours are ``ip`` ranks apart (``ip`` = the product of
the sizes of the axes placed inside it) lies in one node when ``ip g <= gpus per node``; else it has
``k = max(1, gpus_per_node // ip)`` ranks on each node and crosses the network.

Ring algorithms (NCCL's for large messages): all-reduce ``2 (g-1)/g V``, all-gather / reduce-scatter
``(g-1)/g V`` bytes through each rank's link (``V`` the full buffer), all-to-all ``(g-1)/g V``,
point-to-point ``V``.  The link's bandwidth: inside a node the GPU's link (NVLink), scaled by the fitted
``link`` efficiency; across nodes **the network bandwidth per GPU** -- each rank's share of the
collective leaves through its own card, at ``nic_gbs`` x the fitted ``network`` efficiency, however many
ranks of the group share the node (an all-to-all sends its on-node part over the links and its
off-node part ``(g-k)/g V`` through the card).  This is what the published sharded-data-parallel runs
show (Megatron 2021 Table 2: ZeRO-3 over 384 to 2240 A100s moves its 3 x 2 bytes a parameter at
16-17.5 GB/s per GPU, the per-GPU HDR card's 25 GB/s at the same 0.7 the fit found on Table 1),
and it leaves Table 1's data-parallel groups of one GPU per node as they were.  A ring that spreads a
node's ranks over all of the node's cards can do up to ``k`` times better for a group with ``k``
ranks per node (AxoNN's measured Perlmutter table shows it at 4 GPUs a node); the model does not assume
it.  Machines with a measured table (AxoNN's, Perlmutter and Frontier) take the bandwidth from it by
``ip`` and ``g``.  Latency per call: inside a node the link's latency (one NVSwitch round); across nodes
the network's latency times ``2 log2 g`` (all-reduce: NCCL's tree), ``g - 1`` (all-gather,
reduce-scatter: rings) or 1 (all-to-all, point-to-point).

A measured machine (``--measure``, ``cpu.json``) has no efficiency to scale by: its bandwidth is the one
a collective got between computation there, its latency what one call added, per call.
"""
from __future__ import annotations

import math

from .calibration import Calibration
from .hardware import HardwareSpec

__all__ = ["collective_time", "group_bandwidth", "latency", "transfer_time", "FACTORS"]

FACTORS = {"allreduce": lambda g: 2.0 * (g - 1) / g, "allgather": lambda g: (g - 1) / g,
           "reducescatter": lambda g: (g - 1) / g, "alltoall": lambda g: (g - 1) / g, "p2p": lambda g: 1.0}


def _inside(ip: int, g: int, hw: HardwareSpec) -> bool:
    return ip * g <= hw.gpus_per_node


def group_bandwidth(g: int, ip: int, hw: HardwareSpec, cal: Calibration, kind: str = "allreduce") -> float:
    """Bytes/s through each rank's link for a collective of ``kind`` over ``g`` ranks ``ip`` apart."""
    inside = _inside(ip, g, hw)
    link, network = (1.0, 1.0) if hw.is_measured else (cal.link, cal.network)
    table = hw.table_bw(ip, g)
    if table is not None:
        return table * (link if inside else network)
    if inside:
        return hw.intra_bw * link
    k = max(1, hw.gpus_per_node // ip)
    if kind == "alltoall":
        # the off-node part through the rank's own card, the on-node part over the node's links
        off = (g - k) / max(g - 1, 1)
        return 1.0 / (off / (hw.nic_bw * network) + (1 - off) / (hw.intra_bw * link))
    return min(hw.intra_bw * link, hw.nic_bw * network)


def latency(kind: str, g: int, ip: int, hw: HardwareSpec) -> float:
    """Seconds one call of ``kind`` over ``g`` ranks ``ip`` apart costs beyond its bytes."""
    if g <= 1:
        return 0.0
    if hw.is_measured:       # what one call added between computation there, whatever its kind
        return hw.intra_latency if _inside(ip, g, hw) else hw.inter_latency
    return hw.intra_latency if _inside(ip, g, hw) else hw.inter_latency * _STEPS[kind](g)


def collective_time(kind: str, nbytes: float, g: int, ip: int, hw: HardwareSpec, cal: Calibration,
                    calls: float = 1.0) -> float:
    """Seconds for ``calls`` collectives of ``kind`` on buffers of ``nbytes`` over ``g`` ranks ``ip`` apart."""
    if g <= 1 or calls <= 0:
        return 0.0
    return calls * (FACTORS[kind](g) * max(nbytes, 0.0) / group_bandwidth(g, ip, hw, cal, kind)
                    + latency(kind, g, ip, hw))


def _log2(g: int) -> float:
    return max(1.0, math.ceil(math.log2(g)))


# latency terms per call across nodes: NCCL's tree for an all-reduce (2 log2 g hops), rings for gathers and
# scatters (g - 1 steps), one round for all-to-all and point-to-point
_STEPS = {"allreduce": lambda g: 2 * _log2(g), "allgather": lambda g: g - 1.0, "reducescatter": lambda g: g - 1.0,
          "alltoall": lambda g: 1.0, "p2p": lambda g: 1.0}


def transfer_time(kind: str, total_bytes: float, g: int, ip: int, hw: HardwareSpec, cal: Calibration,
                  calls: float = 1.0) -> float:
    """Seconds for ``calls`` collectives of ``kind`` moving ``total_bytes`` in all (counted as the byte
    counter counts them: the send buffer, the gathered buffer for an all-gather) over ``g`` ranks ``ip`` apart."""
    if g <= 1 or calls <= 0:
        return 0.0
    per = total_bytes / calls
    return collective_time(kind, per, g, ip, hw, cal, calls)
