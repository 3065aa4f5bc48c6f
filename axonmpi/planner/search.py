"""Every feasible layout of a run, fastest predicted first.

Candidates: the tensor split (Megatron ``tp`` up to a node, with and without sequence parallelism,
dividing the heads; or AxoNN ``row x col x depth`` up to a node, dividing every Linear), pipeline
sizes dividing the layers, each schedule (1F1B, interleaved with ``vp`` chunks dividing a stage's
layers, ZB-H1, ZBV), context sizes ``cp`` (ring and Ulysses) when ``max_cp > 1``, expert sizes ``ep``
dividing the experts and the data ranks (MoE models: expert parallelism and tensor-parallel experts,
``ep = 1``, in one ranking), and DDP / ZeRO-1 / FSDP shard_grad_op / FSDP full shard over the data
ranks, and hybrid shard (FSDP over each node's data ranks, replicated across nodes) when the data ranks
span nodes.  Layouts that ``check_layout``
refuses or whose memory exceeds the limit are left out.
"""
from __future__ import annotations

from typing import Iterator, List, Optional

from .calibration import FITTED, Calibration
from .estimate import PlanEstimate, estimate_layout
from .hardware import HardwareSpec
from .model import ParallelLayout, TrainConfig, TransformerConfig

__all__ = ["candidates", "search"]


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tensor_options(cfg: TransformerConfig, world: int, gpn: int, axonn: bool):
    for t in _divisors(world):
        if t > gpn or cfg.heads % t or cfg.n_kv % t:
            continue
        yield {"tp": t, "sp": 0}
        if t > 1:
            yield {"tp": t, "sp": 1}
    if not axonn:
        return
    for T in _divisors(world):
        if T < 2 or T > gpn:
            continue
        for r in _divisors(T):
            for c in _divisors(T // r):
                d = T // (r * c)
                ok = all(o % r == 0 and i % c == 0 and (i * o // (r * c)) % d == 0 for i, o in cfg.linears())
                if ok:
                    yield {"row": r, "col": c, "depth": d}


def candidates(cfg: TransformerConfig, train: TrainConfig, world: int, hw: HardwareSpec, max_cp: int = 1,
               axonn: bool = True, overlap: int = 1) -> Iterator[ParallelLayout]:
    """Every layout of ``world`` ranks the model allows (see the module's note)."""
    for tens in _tensor_options(cfg, world, hw.gpus_per_node, axonn):
        T = tens.get("tp", 1) * tens.get("row", 1) * tens.get("col", 1) * tens.get("depth", 1)
        for cp in _divisors(world // T):
            if cp > max_cp or cfg.seq % cp:
                continue
            kinds = ("ring",) if cp == 1 else ("ring", "ulysses")
            for pp in _divisors(world // (T * cp)):
                if cfg.layers % pp:
                    continue
                dp = world // (T * cp * pp)
                scheds = [("1f1b", 1)]
                if pp > 1:
                    scheds += [("interleaved", v) for v in range(2, 5) if (cfg.layers // pp) % v == 0]
                    scheds += [("zb-h1", 1)]
                    if cfg.layers % (2 * pp) == 0:
                        scheds += [("zbv", 1)]
                eps = [e for e in _divisors(dp) if cfg.experts and cfg.experts % e == 0] or [1]
                shards = [(0, 0)]
                if dp > 1:
                    shards = [(z, 0) for z in (0, 1, 2, 3)]
                    per_node = max(1, hw.gpus_per_node // (T * cp * pp))      # data ranks on one node
                    if 1 < per_node < dp and dp % per_node == 0:
                        shards += [(3, per_node)]
                for kind in kinds:
                    for sched, vp in scheds:
                        for ep in eps:
                            for zero, shard in shards:
                                yield ParallelLayout(pp=pp, dp=dp, vp=vp, cp=cp, ep=ep, zero=zero, shard=shard,
                                                     schedule=sched if pp > 1 else "", cp_kind=kind,
                                                     overlap=overlap, **tens)


def search(cfg: TransformerConfig, train: TrainConfig, world: int, hw: HardwareSpec,
           memory_limit: Optional[float] = None, cal: Calibration = FITTED, max_cp: int = 1, axonn: bool = True,
           overlap: int = 1) -> List[PlanEstimate]:
    """The feasible layouts, fastest first (memory within ``memory_limit`` bytes; default: the GPU's memory)."""
    limit = hw.memory_bytes if memory_limit is None else memory_limit
    out = []
    for lay in candidates(cfg, train, world, hw, max_cp, axonn, overlap):
        try:
            e = estimate_layout(cfg, train, lay, hw, cal, world)
        except ValueError:
            continue
        if e.memory_bytes <= limit:
            out.append(e)
    return sorted(out, key=lambda e: (e.step_time, e.memory_bytes))
