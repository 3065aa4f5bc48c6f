"""A cost model of the GPT under the five grid sizes: memory, bytes per group and step time.

[Note: the model]  A GPT of ``L`` blocks, width ``H``, sequence ``S``, vocabulary ``V``, global
batch ``B`` sequences on ``N = G_data G_inter G_r G_c G_d`` ranks, as ``HybridGPT`` runs it
(``tp_style="axonn"``: AxoNN's easy mode; no tensor split: DDP, FSDP or a pipeline).  ``T = G_r G_c
G_d``; ``b`` bytes per element.  Everything is per optimizer step and per rank; the planner reports
the busiest pipeline stage.

* Rows.  Each rank holds ``n = B S / (G_data T)`` tokens (``B S / G_data`` when ``T = 1``): in easy
  mode every rank of a tensor block reads its own rows (``recipes.gpt.batch_shards``).
* One 3-D Linear ``(in, out)`` (``intra_layer.Linear``, easy mode; a Linear the grid does not divide
  stays replicated).  Forward: rows in over the column group (all-to-all ``n in``), over the row
  group (all-gather, ``G_r n in`` gathered), weight all-gathered over depth (``in out / (G_r G_c)``),
  output all-reduced over the column group (``G_c n out``), rows out over the row group (all-to-all
  ``G_c n out``).  Backward: the mirror images (all-gather ``G_c n out`` over column, all-to-all
  ``G_c n out`` over row, all-reduce of dX ``G_r n in`` over row, reduce-scatter of dW over depth,
  all-to-all ``n in`` over column).  Per Linear:

      col   = 2 n in + 2 G_c n out        (if G_c > 1; G_c n out of it all-reduced)
      row   = 2 G_r n in + 2 G_c n out    (if G_r > 1; G_r n in of it all-reduced)
      depth = 2 in out / (G_r G_c)        (if G_d > 1) + the bias' all-reduce out / G_r

* Gradients.  3-D weights (``in out / T``) and biases (``out / G_r``) all-reduced over data;
  replicated parameters (LayerNorms, embeddings, undivided Linears) all-reduced over the replica
  ranks: group ``repl`` = all ranks without a pipeline, else ``data`` and then the tensor block.
  Without a tensor split: DDP all-reduces every gradient over data; FSDP ``full_shard`` moves
  ``3 P`` (all-gather forward and backward, reduce-scatter), ``shard_grad_op`` ``2 P``. FSDP over
  data x AxoNN TP (``P`` the TP-local parameters): the same over data, and the replicated (and
  depth-replicated) gradients reduced over the tensor block (depth) on the busiest data rank's
  shard only (:func:`_fsdp_tp_reductions`).
* Pipeline.  The layers ``[embedding, blocks..., head]`` are cut where ``split_module`` cuts them
  (balancing the rank's parameter counts); each boundary moves ``n H`` activations forward and as
  many gradients back: ``inter`` counts sent + received, ``2 n H`` per neighbouring stage.
* Volumes count what the backend moves (``bench/hybrid.py`` counts it): all-reduce, reduce-scatter
  and all-to-all the send buffer, all-gather the gathered buffer, point-to-point sent + received.
* Time of ``v`` elements of a kind on ``p`` ranks at bandwidth ``bw`` (bytes/s), ring algorithms:
  all-reduce ``2 (p-1)/p v b / bw``; all-gather, reduce-scatter, all-to-all ``(p-1)/p v b / bw``;
  point-to-point ``v b / bw``.  ``bw`` is ``bw_intra`` when the group fits in one node (grid order,
  fastest first: col, row, depth, inter, data; a group of stride ``s`` and size ``p`` fits when
  ``s p <= gpus_per_node``), else ``bw_inter`` (``--measure``: an all-reduce's bandwidth between
  GEMMs, as a step meets it).  Each call costs ``latency`` more (``--measure``: what
  a small all-reduce adds between GEMMs; where ranks share cores, mostly the wait for the others' turn
  on a core): per Linear and micro-batch 5 calls on col and on row (four collectives and the
  row-count exchange), 2 on depth; one per gradient tensor and group; two per micro-batch and
  neighbour on the pipeline.
* Compute: ``6 n sum(in out)`` over the stage's Linears at ``flops`` per rank, the attention core's
  ``12 n S H`` per block at ``attn_flops``, and the other kernels of our autograd by their measured
  cost per element (``Hardware``; 0 on GPUs): per block and token ``4 H`` GELU, ``2 H`` LayerNorm,
  ``a S`` attention scores (scale, mask, softmax), ``2 H`` residual adds; all of it stretched by the
  pipeline bubble ``(m + G_inter - 1) / m`` and, when more ranks share a node than it has ``cores``,
  by ``ranks per node / cores`` (oversubscribed CPUs: MPI's waiting ranks spin, so every rank keeps
  its share of the cores, computing or waiting).  Once a step: AdamW and the clipping norm over the
  parameters the rank updates (``adam`` each; FSDP: its shard) and two copies of every gradient the
  data (or replica) group all-reduces (into the flat buffer and back), stretched by ``ranks per node /
  mem_cores`` (memory-bound work: the cores share the memory bandwidth), as are the residual adds.
* Step time = compute + all communication (no overlap assumed), of the slowest stage.
* Memory per rank: parameters, gradients and two AdamW moments (``4 b`` per local parameter) plus
  activations ``34 (n/m) H b`` per block and micro-batch held (``min(m, G_inter)``; Korthikanti et
  al., no recomputation) plus the largest depth-gathered weight.

Example:
    >>> m = Model(layers=2, width=64, seq=32, vocab=128, global_batch=8)
    >>> est = estimate(m, Layout(G_data=2, G_intra_c=2), Hardware())
    >>> round(est.volumes["col"])            # elements per step through the column group
    450560
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

from .distributed.sharding import chunk_bounds
from .distributed.grid import Layout
from .parallel.pipeline.split import _balanced   # the cut split_module makes

__all__ = ["Estimate", "Hardware", "Layout", "Model", "candidate_layouts", "estimate", "format_plan", "linear_volumes",
           "measure_bandwidth", "plan", "GROUPS", "MoEEstimate", "moe_estimate", "moe_options"]

GROUPS = ("col", "row", "depth", "inter", "data", "repl")


@dataclass(frozen=True)
class Model:
    """The GPT's shapes and the batch (see the module's note)."""
    layers: int
    width: int
    seq: int
    global_batch: int
    vocab: int = 50304
    dtype_bytes: int = 4
    bias: bool = True
    heads: int = 0                  # attention heads (0: width / 64); the softmax's scores per token

    @property
    def n_heads(self) -> int:
        return self.heads or max(1, self.width // 64)

    def linears(self) -> List[Tuple[int, int]]:
        """``(in, out)`` of one block's four Linears."""
        h = self.width
        return [(h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)]

    @property
    def block_params(self) -> int:
        """Parameters of one block: ``12 H^2`` weights, ``9 H`` biases, two LayerNorms."""
        return sum(i * o + (o if self.bias else 0) for i, o in self.linears()) + 2 * self._ln

    @property
    def _ln(self) -> int:
        return self.width * (2 if self.bias else 1)

    @property
    def params(self) -> int:
        """All parameters: blocks, embeddings (token + position), final LayerNorm, head (no bias)."""
        return (self.layers * self.block_params + (self.vocab + self.seq) * self.width + self._ln
                + self.vocab * self.width)


@dataclass(frozen=True)
class Hardware:
    """Bandwidths in bytes/s, compute in flop/s per rank (a rank alone on its core), ranks per node,
    seconds per collective call, and cores per node (0: one per rank, no sharing).

    The work that is not a Linear's GEMM (``measure_kernels`` times our autograd's own kernels, forward +
    backward, on one rank alone; 0: not modelled, as on GPUs where the planner of ``axonmpi.planner``
    covers it): ``attn_flops`` the attention core's batched matmuls (flop/s; 0: ``flops``), seconds per
    element of ``gelu`` (the MLP's hidden), ``layernorm``, ``softmax`` (per attention score: scale,
    causal mask, softmax), ``add`` (a residual add), seconds per parameter of ``adam`` (AdamW's step and
    the gradient clipping's norm), ``copy`` (seconds per element copied: a gradient into the flat buffer
    the data-parallel all-reduce reduces, and back), and ``mem_cores``: the cores in effect for that
    memory-bound work when all of a node's ranks run it at once (0: ``cores``)."""
    bw_intra: float = 50e9
    bw_inter: float = 12.5e9
    flops: float = 50e12
    gpus_per_node: int = 8
    latency: float = 0.0
    cores: float = 0.0
    attn_flops: float = 0.0
    gelu: float = 0.0
    layernorm: float = 0.0
    softmax: float = 0.0
    add: float = 0.0
    adam: float = 0.0
    copy: float = 0.0
    mem_cores: float = 0.0

    @classmethod
    def from_measured(cls, bw: Dict[str, float], gpus_per_node: int, cores: float = 0.0) -> "Hardware":
        """The hardware ``measure_bandwidth`` measured (its dict, or a hardware file's ``measured``);
        ``cores`` overrides the measured cores when given."""
        kern = {k: float(bw.get(k, 0.0)) for k in _KERNELS}
        return cls(bw_intra=bw["intra"], bw_inter=bw.get("inter") or bw["intra"], flops=bw["flops"],
                   gpus_per_node=gpus_per_node, latency=bw.get("latency", 0.0), cores=cores or bw.get("cores", 0.0),
                   **kern)


#: The kernels ``measure_kernels`` times (``Hardware``'s fields of the same names).
_KERNELS = ("attn_flops", "gelu", "layernorm", "softmax", "add", "adam", "copy", "mem_cores")


@dataclass
class Estimate:
    """The model's prediction for one layout."""
    layout: Layout
    microbatches: int
    step_time: float
    compute_time: float
    memory_bytes: float
    volumes: Dict[str, float] = field(default_factory=dict)   # elements per step, busiest rank, by group
    comm_times: Dict[str, float] = field(default_factory=dict)
    calls: Dict[str, float] = field(default_factory=dict)


def linear_volumes(in_features: int, out_features: int, tokens: float, G_r: int, G_c: int, G_d: int
                   ) -> Dict[str, Dict[str, float]]:
    """Elements one easy-mode 3-D Linear moves per step for a rank holding ``tokens`` rows, by group and
    kind (``allreduce`` / ``gather``: all-gather, reduce-scatter, all-to-all); the bias left out.

    Example:
        >>> linear_volumes(8, 16, 4, 2, 2, 2)["col"]
        {'allreduce': 128.0, 'gather': 192.0}
    """
    n, i, o = float(tokens), in_features, out_features
    easy = G_r * G_c > 1
    return {"col": {"allreduce": G_c * n * o, "gather": 2 * n * i + G_c * n * o} if G_c > 1 and easy else {},
            "row": {"allreduce": G_r * n * i, "gather": G_r * n * i + 2 * G_c * n * o} if G_r > 1 else {},
            "depth": {"gather": 2.0 * i * o / (G_r * G_c)} if G_d > 1 else {}}


_STRIDE_ORDER = ("col", "row", "depth", "inter", "data")


def _sizes(layout: Layout) -> Dict[str, int]:
    T = layout.tensor_size
    return {"col": layout.G_intra_c, "row": layout.G_intra_r, "depth": layout.G_intra_d, "inter": layout.G_inter,
            "data": layout.G_data, "repl": layout.world_size if layout.G_inter == 1 else T}


def _bandwidth(layout: Layout, group: str, hw: Hardware) -> float:
    sizes = _sizes(layout)
    if group == "repl":      # all ranks, or the tensor block: stride 1
        return hw.bw_intra if sizes["repl"] <= hw.gpus_per_node else hw.bw_inter
    stride = 1
    for name in _STRIDE_ORDER:
        if name == group:
            break
        stride *= sizes[name]
    return hw.bw_intra if stride * sizes[group] <= hw.gpus_per_node else hw.bw_inter


def _factor(kind: str, p: int) -> float:
    """Ring factor: the fraction of the counted elements each rank sends."""
    if p <= 1:
        return 0.0
    return {"allreduce": 2.0 * (p - 1) / p, "gather": (p - 1) / p, "p2p": 1.0}[kind]


@dataclass
class _Layer:
    """One pipeline layer: its Linears ``(in, out, split)``, replicated parameters and tensors, blocks."""
    linears: List[Tuple[int, int, bool]]
    replicated: int
    replicated_tensors: int
    blocks: int
    local: int = 0


def _divides(i: int, o: int, layout: Layout) -> bool:
    """AxoNN's rule (``auto_parallelize.is_parallelizable_linear``)."""
    G_r, G_c, G_d = layout.G_intra_r, layout.G_intra_c, layout.G_intra_d
    return o % G_r == 0 and i % G_c == 0 and (i * o // (G_r * G_c)) % G_d == 0


def _layers(model: Model, layout: Layout) -> List[_Layer]:
    """``[embedding, blocks..., head]`` with each layer's parameter count on one rank."""
    split = layout.tensor_size > 1
    lnt = 2 if model.bias else 1
    emb = _Layer([], (model.vocab + model.seq) * model.width, 2, 0)
    blk = _Layer([(i, o, split and _divides(i, o, layout)) for i, o in model.linears()], 2 * model._ln, 2 * lnt, 1)
    head = _Layer([(model.width, model.vocab, split and _divides(model.width, model.vocab, layout))], model._ln, lnt, 0)
    out = [emb] + [_Layer(list(blk.linears), blk.replicated, blk.replicated_tensors, 1) for _ in range(model.layers)]
    out.append(head)
    T, G_r = layout.tensor_size, layout.G_intra_r
    for k, lay in enumerate(out):
        bias = model.bias and k not in (0, len(out) - 1)       # lm_head has no bias
        local = lay.replicated
        for i, o, par in lay.linears:
            if par:
                local += i * o // T + (o // G_r if bias else 0)
            else:
                lay.replicated += i * o + (o if bias else 0)
                lay.replicated_tensors += 2 if bias else 1
                local += i * o + (o if bias else 0)
        lay.local = local
    return out


def _fsdp_tp_reductions(model: Model, layout: Layout) -> Dict[str, float]:
    """FSDP over data x AxoNN TP: the busiest data rank's elements of replicated (``"repl"``) and
    depth-replicated (``"depth"``: the biases when ``G_d > 1``) gradients, reduced on its FSDP shard.

    FSDP's units are the GPT's children in order (``wte``, ``wpe``, each block, ``ln_f``, ``lm_head``);
    each unit's TP-local parameters are flattened in registration order (a block: ``ln_1``, ``qkv``,
    ``proj``, ``ln_2``, ``fc``, ``proj``; weight then bias) and rank ``r`` owns ``chunk_bounds(n,
    G_data, r)`` of them. Which rank's chunk holds the LayerNorms and embeddings decides the busiest.
    """
    T, G_r, G_d, k = layout.tensor_size, layout.G_intra_r, layout.G_intra_d, layout.G_data

    def linear(i, o, bias):
        if not (T > 1 and _divides(i, o, layout)):
            return [(i * o + (o if bias else 0), "repl")]
        return [(i * o // T, None)] + ([(o // G_r, "depth" if G_d > 1 else None)] if bias else [])

    ln = [(model._ln, "repl")]
    qkv, proj, fc, out = (linear(i, o, model.bias) for i, o in model.linears())
    block = ln + qkv + proj + ln + fc + out
    units = [[(model.vocab * model.width, "repl")], [(model.seq * model.width, "repl")]]
    units += [block] * model.layers + [ln, linear(model.width, model.vocab, False)]
    per = [{"repl": 0, "depth": 0} for _ in range(k)]
    for segs in units:
        n = sum(size for size, _ in segs)
        for r in range(k):
            a, b = chunk_bounds(n, k, r)
            off = 0
            for size, tag in segs:
                if tag is not None:
                    per[r][tag] += max(0, min(b, off + size) - max(a, off))
                off += size
    return {tag: float(max(p[tag] for p in per)) for tag in ("repl", "depth")}


def estimate(model: Model, layout: Layout, hw: Hardware, microbatches: Optional[int] = None,
             fsdp: Optional[str] = None) -> Estimate:
    """Predicted step time, memory per rank and volumes per group of ``model`` under ``layout``.

    Args:
        model: the GPT and the batch.
        layout: the five sizes.
        hw: bandwidths, flop rate, ranks and cores per node, latency.
        microbatches: ``m`` (default: as many as the rows allow, up to ``4 G_inter``; 1 without a pipeline).
        fsdp: ``None``, ``"full_shard"`` or ``"shard_grad_op"`` over ``data_group`` (pure data parallel,
            or data x AxoNN tensor parallel without a pipeline: the TP-local parameters sharded over data,
            the replicated ones then reduced over the tensor block on the shards).

    Returns:
        An :class:`Estimate` (volumes in elements, per group: the busiest stage's).
    """
    G_r, G_c, G_d, p, G_data = layout.G_intra_r, layout.G_intra_c, layout.G_intra_d, layout.G_inter, layout.G_data
    T = layout.tensor_size
    if fsdp not in (None, "none", "full_shard", "shard_grad_op"):
        raise NotImplementedError(f"estimate: fsdp={fsdp!r} is not modelled (None, 'full_shard', 'shard_grad_op')")
    fsdp = None if fsdp == "none" else fsdp
    if fsdp is not None and p > 1:
        raise ValueError(f"estimate: fsdp={fsdp!r} is not built with a pipeline (G_inter={p}), got {layout}")
    rows = model.global_batch // (G_data * T)
    m = microbatches or (1 if p == 1 else max(1, min(4 * p, rows)))
    n = rows * model.seq
    b = model.dtype_bytes
    H = model.width
    layers = _layers(model, layout)
    starts = _balanced([lay.local for lay in layers], p) + [len(layers)] if p > 1 else [0, len(layers)]
    sizes = _sizes(layout)
    if fsdp is not None and T > 1:       # FSDP x TP: replicated gradients reduced over the tensor block
        sizes["repl"] = T
    ranks_node = min(layout.world_size, hw.gpus_per_node)
    stretch = max(1.0, ranks_node / hw.cores) if hw.cores else 1.0
    mem_cores = hw.mem_cores or hw.cores
    mem_stretch = max(1.0, ranks_node / mem_cores) if mem_cores else 1.0
    worst = None
    vol_max = {g: 0.0 for g in GROUPS}
    for s in range(p):
        stage = layers[starts[s]:starts[s + 1]]
        vol = {g: {"allreduce": 0.0, "gather": 0.0, "p2p": 0.0} for g in GROUPS}
        calls = {g: 0.0 for g in GROUPS}
        flops = attn = kernels = 0.0          # GEMM flops, attention-core flops, seconds of the other kernels
        repl = sum(lay.replicated for lay in stage)
        repl_t = sum(lay.replicated_tensors for lay in stage)
        local = sum(lay.local for lay in stage)
        for lay in stage:
            has_bias = model.bias and lay is not layers[-1]        # lm_head has no bias
            attn += 12.0 * n * model.seq * H * lay.blocks
            kernels += n * lay.blocks * (4 * H * hw.gelu + 2 * H * hw.layernorm
                                         + model.n_heads * model.seq * hw.softmax)
            kernels += n * H * hw.layernorm if lay is layers[-1] else 0.0       # the final LayerNorm
            for i, o, par in lay.linears:
                flops += 6.0 * n * i * o
                if not par:
                    continue
                for g, kinds in linear_volumes(i, o, n, G_r, G_c, G_d).items():
                    for kind, v in kinds.items():
                        vol[g][kind] += v * (m if g == "depth" else 1)    # the weight: every micro-batch
                calls["col"] += 5 * m if G_c > 1 else 0
                calls["row"] += 5 * m if G_r > 1 else 0
                calls["depth"] += 2 * m if G_d > 1 else 0
                if G_data > 1 and fsdp is None:
                    vol["data"]["allreduce"] += i * o / T + (o / G_r if has_bias else 0)
                    calls["data"] += 2 if has_bias else 1
                if G_d > 1 and has_bias:
                    vol["depth"]["allreduce"] += o / G_r if fsdp is None else 0.0   # FSDP: on the shards, below
                    calls["depth"] += 1
        if T > 1:            # sync_gradients: replicated parameters over all ranks, or data and then the block
            if fsdp is None:
                vol["repl"]["allreduce"] += repl
            else:                           # on this rank's FSDP shard only
                shards = _fsdp_tp_reductions(model, layout)
                vol["repl"]["allreduce"] += shards["repl"]
                vol["depth"]["allreduce"] += shards["depth"]
            calls["repl"] += repl_t
            if p > 1 and G_data > 1:
                vol["data"]["allreduce"] += repl
                calls["data"] += repl_t
        if G_data > 1 and (T == 1 or fsdp is not None):
            if fsdp == "full_shard":
                vol["data"]["gather"] += 3.0 * local
            elif fsdp == "shard_grad_op":
                vol["data"]["gather"] += 2.0 * local
            else:
                vol["data"]["allreduce"] += local
            calls["data"] += 1 + local * b // (25 * 2 ** 20)
        if p > 1:
            neighbours = (s > 0) + (s < p - 1)
            vol["inter"]["p2p"] += 2.0 * neighbours * n * H
            calls["inter"] += 2 * neighbours * m
        totals = {g: sum(vol[g].values()) for g in GROUPS}
        times = {g: sum(_factor(kind, sizes[g]) * v for kind, v in vol[g].items()) * b / _bandwidth(layout, g, hw)
                 + (calls[g] * hw.latency if sizes[g] > 1 else 0.0) for g in GROUPS}
        blocks = sum(lay.blocks for lay in stage)
        adds = 2.0 * n * H * blocks * hw.add                   # the residual adds
        copies = 2.0 * (vol["data"]["allreduce"] + vol["repl"]["allreduce"]) * hw.copy   # into the flat buffer and back
        updated = local / G_data if fsdp is not None else local
        compute = ((flops / hw.flops + attn / (hw.attn_flops or hw.flops) + kernels) * stretch
                   + adds * mem_stretch) * (m + p - 1) / m + (updated * hw.adam + copies) * mem_stretch
        acts = 34.0 * (n / m) * H * blocks * min(m, p) * b
        biggest = max([i * o for lay in stage for i, o, par in lay.linears if par] or [0]) / (G_r * G_c)
        memory = 4.0 * local * b + acts + (biggest * b if G_d > 1 else 0.0)
        if fsdp is not None:
            memory = 4.0 * local * b / G_data + acts + max(lay.local for lay in stage) * b
        est = Estimate(layout, m, compute + sum(times.values()), compute, memory, totals, times,
                       {g: calls[g] if sizes[g] > 1 else 0.0 for g in GROUPS})
        for g in GROUPS:
            vol_max[g] = max(vol_max[g], totals[g])
        if worst is None or est.step_time > worst.step_time:
            worst = est
    worst.volumes = vol_max
    return worst


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(model: Model, world: int) -> Iterator[Layout]:
    """Every ``(G_data, G_inter, G_r, G_c, G_d)`` with product ``world`` that ``HybridGPT`` runs the GPT under.

    Rules (``recipes.gpt.check_layout``): ``G_inter <= layers + 2`` (embedding, blocks, head); the batch
    divides into ``G_data T`` row slices (``G_data`` when ``T = 1``); and, so that the tensor split
    splits something, the grid divides every Linear of a block (``out % G_r``, ``in % G_c``,
    ``in out / (G_r G_c) % G_d``; the head may stay replicated).
    """
    for G_data in _divisors(world):
        for G_inter in _divisors(world // G_data):
            rest = world // (G_data * G_inter)
            for G_r in _divisors(rest):
                for G_c in _divisors(rest // G_r):
                    lay = Layout(G_data, G_inter, G_r, G_c, rest // (G_r * G_c))
                    if G_inter > model.layers + 2 or model.global_batch % (G_data * lay.tensor_size):
                        continue
                    if any(not _divides(i, o, lay) for i, o in model.linears()):
                        continue
                    yield lay


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


def format_plan(estimates: List[Estimate], top: int = 20, dtype_bytes: int = 4) -> str:
    """A table: rank, the five sizes, m, predicted ms, memory MiB, and MiB per group per step."""
    head = (f"{'#':>3} {'data':>4} {'inter':>5} {'r':>3} {'c':>3} {'d':>3} {'m':>3} {'step ms':>9} {'mem MiB':>9} "
            + " ".join(f"{g + ' MiB':>9}" for g in GROUPS))
    lines = [head]
    b = dtype_bytes / 2 ** 20
    for k, e in enumerate(estimates[:top], 1):
        L = e.layout
        lines.append(f"{k:>3} {L.G_data:>4} {L.G_inter:>5} {L.G_intra_r:>3} {L.G_intra_c:>3} {L.G_intra_d:>3} "
                     f"{e.microbatches:>3} {e.step_time * 1e3:>9.3f} {e.memory_bytes / 2 ** 20:>9.1f} "
                     + " ".join(f"{e.volumes[g] * b:>9.2f}" for g in GROUPS))
    if not estimates:
        lines.append("(no layout fits)")
    return "\n".join(lines)


def _seconds(fn, repeats: int) -> float:
    """The median wall seconds of ``repeats`` calls of ``fn`` after one to warm up."""
    import statistics
    import time
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def measure_kernels(width: int = 512, seq: int = 128, heads: int = 8, rows: int = 256, dtype: str = "float32",
                    repeats: int = 5) -> Dict[str, float]:
    """Time our autograd's kernels other than the Linears' GEMMs, forward + backward, on this rank
    (no MPI): what a step spends besides the GEMMs, per unit of work (``Hardware``'s fields).

    Returns seconds per element of ``gelu`` (``rows x 4 width``; tanh, as ``nn.MLP``), ``layernorm``
    (``rows x width``, with weight and bias), ``softmax`` (per attention score of ``rows / seq``
    sequences: the scale, the causal mask and the softmax), ``add`` (a residual add), ``copy`` (a copy
    of ``2^22`` elements), seconds per parameter of ``adam`` (``AdamW.step`` and the gradient
    clipping's norm, over ``2^22`` parameters), and ``attn_flops``: the flop rate of the attention
    core's two batched matmuls ``q k^T`` and ``a v`` (forward + backward, 3x the forward's flops).
    The median of ``repeats``.

    Example:
        >>> k = measure_kernels(64, 16, 2, rows=32, repeats=1)
        >>> k["gelu"] > 0 and k["attn_flops"] > 0
        True
    """
    import numpy as np

    from .autograd import Tensor, ops, ops_nn
    from .optim import AdamW
    from .optim.clip import clip_grad_norm_
    rng = np.random.default_rng(0)
    dt = np.dtype(dtype)
    seqs = max(1, rows // seq)
    hd = max(1, width // heads)

    def leaf(*shape):
        return Tensor(rng.standard_normal(shape).astype(dt), requires_grad=True)

    def seconds(fn) -> float:
        return _seconds(fn, repeats)

    def fwd_bwd(make):
        def run():
            y = make()
            y.backward(np.ones(y.shape, dt))
        return run

    h4, x = leaf(rows, 4 * width), leaf(rows, width)
    w, b, r = leaf(width), leaf(width), leaf(rows, width)
    q, k, v = leaf(seqs, heads, seq, hd), leaf(seqs, heads, hd, seq), leaf(seqs, heads, seq, hd)
    sc = leaf(seqs, heads, seq, seq)
    future = np.triu(np.ones((seq, seq), dtype=bool), k=1)
    out = {"gelu": seconds(fwd_bwd(lambda: ops_nn.gelu(h4, approximate="tanh"))) / h4.data.size,   # nn.MLP's
           "layernorm": seconds(fwd_bwd(lambda: ops_nn.layer_norm(x, width, w, b))) / x.data.size,
           "softmax": seconds(fwd_bwd(lambda: ops_nn.softmax(ops_nn.masked_fill(sc * 0.125, future, -np.inf), -1)))
           / sc.data.size,
           "add": seconds(fwd_bwd(lambda: x + r)) / x.data.size}
    flops = 3.0 * 2 * (2.0 * seqs * heads * seq * seq * hd)
    out["attn_flops"] = flops / seconds(fwd_bwd(lambda: ops.matmul(ops.matmul(q, k), v)))
    p = leaf(1 << 22)                      # beyond the caches, as a model's parameters are
    p.grad = Tensor(rng.standard_normal(p.shape).astype(dt))
    opt = AdamW([p], lr=1e-3, weight_decay=0.01)

    def step():
        clip_grad_norm_([p], 1.0)
        opt.step()
    out["adam"] = seconds(step) / p.data.size
    big = np.ones(1 << 22, dt)                     # beyond the caches, as a model's gradients are
    into = np.empty_like(big)
    out["copy"] = seconds(lambda: np.copyto(into, big)) / big.size
    return out


def measure_bandwidth(nbytes: int = 1 << 22, repeats: int = 7, gemm: int = 512, *, width: int = 512,
                      seq: int = 128, heads: int = 8, dtype: str = "float32") -> Dict[str, float]:
    """Time all-reduces and a GEMM on this allocation (collective; call on every rank under mpiexec/srun).

    Returns ``{"intra", "intra_alone", "inter", "latency", "flops", "cores"}`` and the kernels':

    * ``intra``: bus bandwidth ``2 (p-1)/p n / t`` (bytes/s) of an all-reduce of ``nbytes`` among the
      ranks of one node *between GEMMs* (``t``: what it adds to a loop of GEMMs run on every rank at
      once, less ``latency``; what a step meets: where ranks share cores, a transfer moves only while
      both ends hold a core); ``intra_alone``: the same back to back, the *median* of ``repeats``
      (for information; ``intra`` when a node has one rank); ``inter``: the back-to-back one among
      one rank per node (``intra`` on one node);
    * ``latency``: what an 8-byte all-reduce of all ranks adds to a loop of GEMMs (one between each):
      a collective's cost when ranks compute between collectives, as in a step (where ranks share
      cores, mostly the wait for the others' turn on a core; on dedicated cores, the latency);
    * ``flops``: a float32 ``gemm``-cube GEMM's rate on one rank while the node's other ranks sleep;
    * ``cores``: the cores the node's ranks get in effect: the sum over the node's ranks of their GEMM
      rate over a loop they all run at once, / ``flops``, at most the cores the process may use;
    * ``measure_kernels``' numbers (the other kernels, timed on one rank while the others sleep; at
      the model's ``width``, ``seq``, ``heads`` and ``dtype``) and ``mem_cores``: the cores in effect,
      as ``cores``, of a memory-bound loop (AdamW's streams over ``2^22`` elements).

    Example:
        >>> bw = measure_bandwidth(1 << 16)          # under mpiexec -n 4 on one node
        >>> bw["intra"] > 0 and bw["flops"] > 0 and 0 < bw["cores"] <= os.cpu_count()
        True
    """
    import os
    import time

    import numpy as np

    from .distributed import all_reduce, barrier, get_world, init, is_initialized
    world = get_world() if is_initialized() else init()

    def timed(group) -> float:
        if group is None or group.size <= 1:
            return 0.0
        x = np.ones(max(1, nbytes // 8))
        all_reduce(x, group=group)
        barrier()
        p = group.size
        return 2.0 * (p - 1) / p * x.nbytes / _seconds(lambda: all_reduce(x, group=group), repeats)

    node = world.split(world.node_index, name="plan-node")
    leaders = world.split(0 if world.local_rank == 0 else None, name="plan-leaders")
    intra = timed(node)
    inter = timed(leaders) if world.local_rank == 0 else 0.0
    vals = all_reduce(np.array([intra, inter]), op="max")
    intra, inter = float(vals[0]), float(vals[1])
    a = np.ones((gemm, gemm), np.float32)
    avail = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

    def on_first_rank(fn):
        """``fn()`` on each node's first rank while the others sleep (a rank waiting in a blocking MPI call
        would spin on a core): they poll a non-blocking all-reduce that the first rank joins when done."""
        out = fn() if world.local_rank == 0 else None
        done = all_reduce(np.zeros(1), async_op=True)
        while not done.is_completed():
            time.sleep(0.002)
        return out

    def alone_and_cores(fn) -> Tuple[float, float]:
        """Calls of ``fn`` a second on local rank 0 while the others sleep, and the cores the node's ranks
        get in effect: their rates running it all at once, summed, over that."""
        fn()
        barrier()
        alone = on_first_rank(lambda: 1.0 / _seconds(fn, repeats)) or 0.0
        barrier()
        t0 = time.perf_counter()               # all ranks at once: each rank's rate over the whole loop, so
        for _ in range(3 * repeats):           # the scheduler's time slices average out (one call's timing
            fn()                               # catches a rank that waited a whole slice, or none)
        shared = 3 * repeats / (time.perf_counter() - t0)
        alone = float(all_reduce(np.array([alone]), op="max")[0])
        shared = float(all_reduce(np.array([shared]), op="sum", group=node)[0])    # the node's ranks together
        return alone, (min(float(avail), shared / alone) if alone > 0 else float(avail))

    alone, cores = alone_and_cores(lambda: a @ a)
    alone *= 2.0 * gemm ** 3
    small = np.zeros(1)

    def loop(sync: bool) -> float:
        barrier()
        t0 = time.perf_counter()
        for _ in range(3 * repeats):
            a @ a
            if sync:
                all_reduce(small)
        return time.perf_counter() - t0

    lat = 0.0
    if world.world_size > 1:
        plain = min(loop(False), loop(False))
        lat = max(0.0, min(loop(True), loop(True)) - plain) / (3 * repeats)     # the better of two, as plain
    med = float(all_reduce(np.array([lat]), op="max")[0])
    between = _between_gemms(a, node, nbytes, repeats, med) if node.size > 1 else 0.0
    # the other kernels, alone (the others sleep), and the memory-bound loop (AdamW) on all ranks at once
    barrier()
    kern = on_first_rank(lambda: measure_kernels(width, seq, heads, dtype=dtype, repeats=repeats)) or {}
    kern = {k: float(all_reduce(np.array([kern.get(k, 0.0)]), op="max")[0]) for k in _KERNELS if k != "mem_cores"}
    p = np.ones(1 << 22, np.float32)       # beyond the caches
    m1, m2 = np.zeros_like(p), np.zeros_like(p)

    def adam_like():                   # AdamW's streams: two moments, the update, the parameter
        m1.__imul__(0.9).__iadd__(p)
        m2.__imul__(0.95).__iadd__(p * p)
        p.__isub__(1e-9 * m1 / (np.sqrt(m2) + 1.0))

    kern["mem_cores"] = alone_and_cores(adam_like)[1]
    if between > 0:                    # what a step meets; the plain all-reduce's kept for information
        intra, inter = between, (inter if inter > 0 else between)
    return {"intra": intra, "inter": inter if inter > 0 else intra, "latency": med, "flops": alone,
            "cores": cores, "intra_alone": float(vals[0]), **kern}


def _between_gemms(a, group, nbytes: int, repeats: int, latency: float) -> float:
    """Bus bandwidth ``2 (p-1)/p n / t`` of an all-reduce of ``nbytes`` over ``group`` (a node's ranks) where
    ranks compute between collectives, as in a step: ``t`` is what one such all-reduce adds to a loop of
    GEMMs (``a @ a``) on every rank at once, less ``latency`` (what an 8-byte one adds).  Where ranks
    share cores the transfer only runs while both ends hold a core, so this is several times below the
    bandwidth of back-to-back all-reduces (2026-11-27, 4 ranks on 2 cores: 0.6-0.8 against 1.9 GB/s).
    The smallest over the group's ranks (the collective waits for the slowest); 0.0 if unmeasurable."""
    import time

    import numpy as np

    from .distributed import all_reduce, barrier
    x = np.zeros(max(1, nbytes // 8))
    n = 3 * repeats

    def loop(sync: bool) -> float:
        barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            a @ a
            if sync:
                all_reduce(x, group=group)
        return time.perf_counter() - t0

    loop(True)                                              # warm-up: the transport's buffers
    extra = (min(loop(True), loop(True)) - min(loop(False), loop(False))) / n - latency
    p = group.size
    bw = 2.0 * (p - 1) / p * x.nbytes / extra if extra > 0 else 0.0
    return float(all_reduce(np.array([bw]), op="min", group=group)[0])


# -- mixture of experts: expert parallelism vs tensor-parallel experts ----------------------------
@dataclass(frozen=True)
class MoEEstimate:
    """Per rank, one MoE layer, one training step (forward + backward); bytes as the backend counts them.

    Attributes:
        option: ``"expert_parallel"`` (all-to-all dispatcher over the expert group),
            ``"tensor_parallel_experts"`` (tokens all-gathered and outputs reduce-scattered over the
            tensor group) or ``"expert_parallel_x_tensor_parallel_experts"`` (both: the gathered
            tokens go by all-to-all).
        group_size: EP, T, or EP * T.
        bytes_forward / bytes_backward: the token traffic of the dispatcher (each direction).
        count_bytes: the per-expert counts exchanged before each all-to-all (EP only).
        expert_params: expert parameters held by the rank.
        expert_flops: expert GEMM flops of the rank (forward + backward, balanced routing).
    """
    option: str
    group_size: int
    bytes_forward: float
    bytes_backward: float
    count_bytes: float
    expert_params: int
    expert_flops: float

    @property
    def bytes_total(self) -> float:
        """Forward + backward token bytes + count exchanges."""
        return self.bytes_forward + self.bytes_backward + self.count_bytes


def moe_estimate(tokens: int, width: int, hidden: int, num_experts: int, top_k: int, *,
                 expert_parallel: int = 1, tensor_parallel: int = 1, itemsize: int = 4,
                 off_rank_fraction: Optional[float] = None, bias: bool = True) -> MoEEstimate:
    """Bytes, expert parameters and flops of one ``nn.MoE`` layer per rank (see ``docs/moe.md``).

    Expert parallelism (``expert_parallel = EP > 1``): each rank routes ``tokens`` tokens into
    ``r = tokens * top_k`` rows; a fraction ``f`` of them leave the rank (default ``(EP-1)/EP``:
    uniform routing); the rank sends ``f r`` rows at dispatch and, balanced, ``f r`` at combine:
    ``2 f r width itemsize`` bytes forward and as many backward (the formula the tests check with
    the measured ``f``), plus ``E * 8`` bytes of counts per exchange (one forward).

    Tensor-parallel experts (``tensor_parallel = T > 1``): the ``tokens`` are all-gathered over the
    tensor group (counted as the gathered buffer, ``T tokens width itemsize``) and the outputs
    reduce-scattered (the send buffer, as much): ``2 T tokens width itemsize`` each direction,
    independent of routing and of ``top_k``; each rank holds ``1/T`` of every expert.

    Both (``EP > 1`` and ``T > 1``): the gather's bytes, plus the all-to-all's on the gathered
    ``T tokens top_k`` rows (``2 f T r width itemsize`` each direction); each rank holds ``1/T`` of
    ``E / EP`` experts.

    Example:
        >>> ep = moe_estimate(4096, 1024, 4096, 8, 2, expert_parallel=8)
        >>> tp = moe_estimate(4096, 1024, 4096, 8, 2, tensor_parallel=8)
        >>> ep.bytes_forward < tp.bytes_forward
        True
    """
    per_expert = 2 * width * hidden + ((hidden + width) if bias else 0)
    rows = tokens * top_k
    flops = 6.0 * rows * 2 * width * hidden          # every row through fc and proj, forward + backward
    ep, t = max(1, int(expert_parallel)), max(1, int(tensor_parallel))
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} does not divide by expert_parallel={ep}")
    f = (ep - 1) / ep if off_rank_fraction is None else float(off_rank_fraction)
    v = 2.0 * t * tokens * width * itemsize if t > 1 else 0.0          # the gather and the reduce-scatter
    v += 2.0 * f * t * rows * width * itemsize if ep > 1 else 0.0     # the all-to-all of the (gathered) rows
    counts = 8.0 * num_experts if ep > 1 else 0.0
    local = num_experts // ep
    params = local * per_expert if t == 1 else \
        local * (2 * width * hidden + (hidden if bias else 0)) // t + (local * width if bias else 0)
    option = "expert_parallel" if t == 1 else "tensor_parallel_experts" if ep == 1 else \
        "expert_parallel_x_tensor_parallel_experts"
    return MoEEstimate(option, ep * t if ep > 1 and t > 1 else max(ep, t), v, v, counts, int(params), flops)


def moe_options(tokens: int, width: int, hidden: int, num_experts: int, top_k: int, group_size: int,
                itemsize: int = 4) -> List[MoEEstimate]:
    """Both options over ``group_size`` ranks (expert parallelism when ``num_experts`` divides), fewest bytes first."""
    out = [moe_estimate(tokens, width, hidden, num_experts, top_k, tensor_parallel=group_size,
                        itemsize=itemsize)]
    if num_experts % group_size == 0:
        out.append(moe_estimate(tokens, width, hidden, num_experts, top_k, expert_parallel=group_size,
                                itemsize=itemsize))
    return sorted(out, key=lambda e: e.bytes_total)
