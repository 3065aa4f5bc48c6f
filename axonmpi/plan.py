"""A cost model of the GPT under the five grid sizes: memory, communication per group and step time.

[Note: the model]  A GPT of ``L`` blocks, width ``H``, sequence ``S``, vocabulary ``V``, global
batch ``B`` sequences, on ``N = G_data*G_inter*G_r*G_c*G_d`` ranks, AxoNN's 3-D tensor
parallelism inside a block (rows over data x depth), pipeline over ``G_inter`` with ``m``
micro-batches.  Elements are ``dtype_bytes`` wide.

* Each block has four Linears ``(in, out)``: qkv ``(H, 3H)``, attention proj ``(H, H)``, fc
  ``(H, 4H)``, mlp proj ``(4H, H)``: ``12 H^2`` weights.  The embeddings ``(V + S) H`` and the
  head ``V H`` sit on the first and last stage.
* Tokens one rank's row x column plane processes per step: ``t = B S / (G_data G_d)``.
* Per Linear and step, AxoNN's volumes (elements, the message each rank contributes):
  column group: all-reduce of ``t out / G_r`` (forward); row group: all-reduce of
  ``t in / G_c`` (backward dX); depth group: all-gather of ``in out / (G_r G_c)`` (forward
  weights) plus reduce-scatter of the same (backward dW).
* Data group: all-reduce of the rank's gradient shard, ``P_stage / (G_r G_c G_d)``.
* Pipeline group: each stage boundary sends ``B S H / G_data`` activations forward and as many
  gradients back per step (on the ``(r, c, d)`` planes: ``/ (G_d)`` rows each).
* Time of a collective of ``n`` elements on ``p`` ranks with bandwidth ``bw`` (bytes/s), ring
  algorithms: all-reduce ``2 (p-1)/p n b / bw``; all-gather and reduce-scatter ``(p-1)/p n b / bw``;
  point-to-point ``n b / bw``.  ``bw`` is ``bw_intra`` when the group fits in one node (its
  ranks are contiguous in the grid's order with stride ``s``: ``s * p <= gpus_per_node``),
  else ``bw_inter``.  Grid order (fastest first): col, row, depth, inter, data.
* Compute: ``6 P B S`` flops (``P`` all weights) plus attention ``12 L B S^2 H``, spread over
  ``N`` ranks at ``flops`` per second, stretched by the pipeline bubble ``(m + G_inter - 1) / m``.
* Latency: each collective call costs ``latency`` seconds more (0 by default, measured by
  ``--measure``): per block and micro-batch one column all-reduce, one row all-reduce and two
  depth collectives per Linear; two point-to-point messages per micro-batch on the pipeline; one
  data all-reduce per step.
* Step time = compute + the sum of all communication times (no overlap assumed).
* Memory per rank: weights, gradients and two AdamW moments (``4 x`` the rank's parameters)
  plus activations ``34 t_mb H x L/G_inter x min(m, G_inter)`` bytes-elements per micro-batch
  held (Korthikanti et al.'s per-layer estimate without recomputation, ``t_mb = t / m``),
  plus one gathered weight of the largest Linear (depth all-gather).

Example:
    >>> m = Model(layers=2, width=64, seq=32, vocab=128, global_batch=8)
    >>> est = estimate(m, Layout(G_data=2, G_intra_c=2), Hardware())
    >>> round(est.volumes["col"])            # elements per step through the column group
    24576
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

from .parallel.hybrid import Layout

__all__ = ["Estimate", "Hardware", "Layout", "Model", "candidate_layouts", "estimate", "format_plan", "linear_volumes",
           "measure_bandwidth", "plan"]


@dataclass(frozen=True)
class Model:
    """The GPT's shapes and the batch (see the module's note)."""
    layers: int
    width: int
    seq: int
    global_batch: int
    vocab: int = 50304
    dtype_bytes: int = 4

    def linears(self) -> List[Tuple[int, int]]:
        """``(in, out)`` of one block's four Linears."""
        h = self.width
        return [(h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)]

    @property
    def block_params(self) -> int:
        """Weights of one block (``12 H^2``; biases and LayerNorms left out)."""
        return sum(i * o for i, o in self.linears())

    @property
    def params(self) -> int:
        """All weights: blocks, embeddings (token + position) and the head."""
        return self.layers * self.block_params + (2 * self.vocab + self.seq) * self.width


@dataclass(frozen=True)
class Hardware:
    """Bandwidths in bytes/s, compute in flop/s per rank, ranks per node, seconds per collective call."""
    bw_intra: float = 50e9
    bw_inter: float = 12.5e9
    flops: float = 50e12
    gpus_per_node: int = 8
    latency: float = 0.0


@dataclass
class Estimate:
    """The model's prediction for one layout."""
    layout: Layout
    microbatches: int
    step_time: float
    compute_time: float
    memory_bytes: float
    volumes: Dict[str, float] = field(default_factory=dict)   # elements per step per rank, by group
    comm_times: Dict[str, float] = field(default_factory=dict)


def linear_volumes(in_features: int, out_features: int, tokens: float, G_r: int, G_c: int, G_d: int
                   ) -> Dict[str, float]:
    """AxoNN's per-step volumes (elements) of one Linear: ``col``, ``row``, ``depth`` (gather + scatter).

    Example:
        >>> linear_volumes(8, 16, 4, 2, 2, 2)
        {'col': 32.0, 'row': 16.0, 'depth': 64.0}
    """
    w = in_features * out_features / (G_r * G_c)
    return {"col": tokens * out_features / G_r if G_c > 1 else 0.0,
            "row": tokens * in_features / G_c if G_r > 1 else 0.0,
            "depth": 2.0 * w if G_d > 1 else 0.0}


_STRIDE_ORDER = ("col", "row", "depth", "inter", "data")


def _sizes(layout: Layout) -> Dict[str, int]:
    return {"col": layout.G_intra_c, "row": layout.G_intra_r, "depth": layout.G_intra_d, "inter": layout.G_inter,
            "data": layout.G_data}


def _bandwidth(layout: Layout, group: str, hw: Hardware) -> float:
    sizes = _sizes(layout)
    stride = 1
    for name in _STRIDE_ORDER:
        if name == group:
            break
        stride *= sizes[name]
    return hw.bw_intra if stride * sizes[group] <= hw.gpus_per_node else hw.bw_inter


def _factor(kind: str, p: int) -> float:
    """Ring factor: the fraction of the message each rank sends."""
    if p <= 1:
        return 0.0
    return {"allreduce": 2.0 * (p - 1) / p, "gather_scatter": (p - 1) / p, "p2p": 1.0}[kind]


def estimate(model: Model, layout: Layout, hw: Hardware, microbatches: Optional[int] = None) -> Estimate:
    """Predicted step time, memory per rank and volumes per group of ``model`` under ``layout``.

    Args:
        model: the GPT and the batch.
        layout: the five sizes.
        hw: bandwidths, flop rate and ranks per node.
        microbatches: ``m`` (default: as many as the rows allow, up to ``4 G_inter``; 1 without a pipeline).

    Returns:
        An :class:`Estimate`.
    """
    G_r, G_c, G_d, p = layout.G_intra_r, layout.G_intra_c, layout.G_intra_d, layout.G_inter
    rows = model.global_batch // (layout.G_data * G_d)
    m = microbatches or (1 if p == 1 else max(1, min(4 * p, rows)))
    t = rows * model.seq
    b = model.dtype_bytes
    vol = {"col": 0.0, "row": 0.0, "depth": 0.0, "inter": 0.0, "data": 0.0}
    layers_here = math.ceil(model.layers / p)
    for i, o in model.linears():
        for k, v in linear_volumes(i, o, t, G_r, G_c, G_d).items():
            vol[k] += layers_here * v
    stage_params = layers_here * model.block_params + 2 * model.vocab * model.width / p
    local_params = stage_params / (G_r * G_c * G_d)
    if layout.G_data > 1:
        vol["data"] = local_params
    if p > 1:
        vol["inter"] = 2.0 * t * model.width
    kinds = {"col": "allreduce", "row": "allreduce", "depth": "gather_scatter", "inter": "p2p", "data": "allreduce"}
    sizes = _sizes(layout)
    nlin = layers_here * len(model.linears()) * m
    calls = {"col": nlin, "row": nlin, "depth": 2 * nlin, "inter": 2 * m, "data": 1}
    times = {g: _factor(kinds[g], sizes[g]) * vol[g] * b / _bandwidth(layout, g, hw)
             + (calls[g] * hw.latency if sizes[g] > 1 else 0.0) for g in vol}
    flops = 6.0 * model.params * model.global_batch * model.seq
    flops += 12.0 * model.layers * model.global_batch * model.seq ** 2 * model.width
    compute = flops / (layout.world_size * hw.flops) * (m + p - 1) / m
    acts = 34.0 * (t / m) * model.width * layers_here * min(m, p) * b
    biggest = max(i * o for i, o in model.linears()) / (G_r * G_c)
    memory = 4.0 * local_params * b + acts + (biggest * b if G_d > 1 else 0.0)
    return Estimate(layout, m, compute + sum(times.values()), compute, memory, vol, times)


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(model: Model, world: int) -> Iterator[Layout]:
    """Every ``(G_data, G_inter, G_r, G_c, G_d)`` with product ``world`` that the GPT can run.

    Rules: ``G_inter <= layers``; every Linear divides (``out % G_r``, ``in % G_c``,
    ``in out / (G_r G_c) % G_d``); the batch divides into ``G_data G_d`` row slices.
    """
    for G_data in _divisors(world):
        for G_inter in _divisors(world // G_data):
            rest = world // (G_data * G_inter)
            for G_r in _divisors(rest):
                for G_c in _divisors(rest // G_r):
                    G_d = rest // (G_r * G_c)
                    if G_inter > model.layers or model.global_batch % (G_data * G_d):
                        continue
                    if any(o % G_r or i % G_c or (i * o // (G_r * G_c)) % G_d for i, o in model.linears()):
                        continue
                    yield Layout(G_data, G_inter, G_r, G_c, G_d)


def plan(model: Model, world: int, hw: Hardware, memory_limit: Optional[float] = None) -> List[Estimate]:
    """The layouts that fit, fastest predicted first (those over ``memory_limit`` bytes left out).

    Example:
        >>> best = plan(Model(layers=8, width=512, seq=128, global_batch=32), 4, Hardware())[0]
        >>> best.layout.world_size
        4
    """
    out = [estimate(model, lay, hw) for lay in candidate_layouts(model, world)]
    if memory_limit is not None:
        out = [e for e in out if e.memory_bytes <= memory_limit]
    return sorted(out, key=lambda e: (e.step_time, e.memory_bytes))


def format_plan(estimates: List[Estimate], top: int = 20) -> str:
    """A table: rank, the five sizes, m, predicted ms, memory MiB, and MiB per group per step."""
    head = (f"{'#':>3} {'data':>4} {'inter':>5} {'r':>3} {'c':>3} {'d':>3} {'m':>3} {'step ms':>9} {'mem MiB':>9} "
            f"{'col MiB':>8} {'row MiB':>8} {'depth MiB':>9} {'inter MiB':>9} {'data MiB':>8}")
    lines = [head]
    for k, e in enumerate(estimates[:top], 1):
        L = e.layout
        b = 4.0 / 2 ** 20
        lines.append(f"{k:>3} {L.G_data:>4} {L.G_inter:>5} {L.G_intra_r:>3} {L.G_intra_c:>3} {L.G_intra_d:>3} "
                     f"{e.microbatches:>3} {e.step_time * 1e3:>9.3f} {e.memory_bytes / 2 ** 20:>9.1f} "
                     f"{e.volumes['col'] * b:>8.2f} {e.volumes['row'] * b:>8.2f} {e.volumes['depth'] * b:>9.2f} "
                     f"{e.volumes['inter'] * b:>9.2f} {e.volumes['data'] * b:>8.2f}")
    if not estimates:
        lines.append("(no layout fits)")
    return "\n".join(lines)


def measure_bandwidth(nbytes: int = 1 << 22, repeats: int = 5) -> Dict[str, float]:
    """Time all-reduces on this allocation (collective; call on every rank under mpiexec/srun).

    Returns ``{"intra": bytes/s, "inter": bytes/s, "latency": s}``: the bus bandwidth ``2 (p-1)/p n / t``
    of an all-reduce among the ranks of one node, and among one rank per node (equal to ``intra`` on
    one node; 0.0 where there is nothing to measure), and the time of an 8-byte all-reduce of all ranks.

    Example:
        >>> bw = measure_bandwidth(1 << 16)
        >>> bw["intra"] > 0
        True
    """
    import time

    import numpy as np

    from .distributed import all_reduce, barrier, get_world, init, is_initialized
    world = get_world() if is_initialized() else init()

    def timed(group) -> float:
        if group is None or group.size <= 1:
            return float("inf")
        x = np.ones(max(1, nbytes // 8))
        all_reduce(x, group=group)
        barrier()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            all_reduce(x, group=group)
            best = min(best, time.perf_counter() - t0)
        p = group.size
        return 2.0 * (p - 1) / p * x.nbytes / best

    node = world.split(world.node_index, name="plan-node")
    leaders = world.split(0 if world.local_rank == 0 else None, name="plan-leaders")
    intra = timed(node)
    inter = timed(leaders) if world.local_rank == 0 else 0.0
    from .distributed import all_reduce as _ar
    vals = _ar(np.array([intra if math.isfinite(intra) else 0.0, inter if math.isfinite(inter) else 0.0]),
               op="max")
    intra, inter = float(vals[0]), float(vals[1])
    small = np.zeros(1)
    lat = float("inf")
    if world.world_size > 1:
        for _ in range(max(repeats, 20)):
            t0 = time.perf_counter()
            all_reduce(small)
            lat = min(lat, time.perf_counter() - t0)
    lat = float(_ar(np.array([lat if math.isfinite(lat) else 0.0]), op="max")[0])
    return {"intra": intra, "inter": inter if inter > 0 else intra, "latency": lat}
