"""AxoNN's 3-D tensor parallelism (easy mode) in the cost model: what one Linear moves, and which rank's
FSDP shard reduces the replicated gradients.

[Note: easy mode]  ``intra_layer.Linear`` with ``G_r x G_c x G_d`` ranks (``recipes.gpt``'s ``tp_style="axonn"``):
every rank of a tensor block reads its own ``n`` rows (``recipes.gpt.batch_shards``).  Forward: rows in
over the column group (all-to-all ``n in``), over the row group (all-gather, ``G_r n in`` gathered),
weight all-gathered over depth (``in out / (G_r G_c)``), output all-reduced over the column group
(``G_c n out``), rows out over the row group (all-to-all ``G_c n out``).  Backward: the mirror images
(all-gather ``G_c n out`` over column, all-to-all ``G_c n out`` over row, all-reduce of dX ``G_r n in``
over row, reduce-scatter of dW over depth, all-to-all ``n in`` over column).  Per Linear and micro-batch:

    col   = 2 n in + 2 G_c n out        (if G_c > 1; G_c n out of it all-reduced)
    row   = 2 G_r n in + 2 G_c n out    (if G_r > 1; G_r n in of it all-reduced)
    depth = 2 in out / (G_r G_c)        (if G_d > 1)

in 5 calls on col and on row (four collectives and the row-count exchange) and 2 on depth.  Each rank
runs the whole ``in x out`` GEMM on its rows (``2 n in out`` flops forward), as a data-parallel rank
would: the split saves memory and moves activations, not flops.  Volumes count what the backend moves
(``bench/hybrid.py`` counts it): all-reduce, reduce-scatter and all-to-all the send buffer, all-gather
the gathered buffer.  A Linear the grid does not divide (``out % G_r``, ``in % G_c``, ``in out / (G_r G_c)
% G_d``: ``auto_parallelize.is_parallelizable_linear``) stays whole and replicated.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from ..distributed.sharding import chunk_bounds

__all__ = ["CALLS", "block_units", "divides", "fsdp_replicated_shard", "linear_volumes"]

#: Collective calls per split Linear and micro-batch, by group.
CALLS = {"col": 5, "row": 5, "depth": 2}


def linear_volumes(in_features: int, out_features: int, tokens: float, G_r: int, G_c: int, G_d: int
                   ) -> Dict[str, Dict[str, float]]:
    """Elements one easy-mode 3-D Linear moves per micro-batch for a rank holding ``tokens`` rows, by group
    and kind (``allreduce`` / ``gather``: all-gather, reduce-scatter, all-to-all); the bias left out.

    Example:
        >>> linear_volumes(8, 16, 4, 2, 2, 2)["col"]
        {'allreduce': 128.0, 'gather': 192.0}
    """
    n, i, o = float(tokens), in_features, out_features
    easy = G_r * G_c > 1
    return {"col": {"allreduce": G_c * n * o, "gather": 2 * n * i + G_c * n * o} if G_c > 1 and easy else {},
            "row": {"allreduce": G_r * n * i, "gather": G_r * n * i + 2 * G_c * n * o} if G_r > 1 else {},
            "depth": {"gather": 2.0 * i * o / (G_r * G_c)} if G_d > 1 else {}}


def divides(i: int, o: int, G_r: int, G_c: int, G_d: int) -> bool:
    """AxoNN's rule (``auto_parallelize.is_parallelizable_linear``)."""
    return o % G_r == 0 and i % G_c == 0 and (i * o // (G_r * G_c)) % G_d == 0


def fsdp_replicated_shard(units: Sequence[Sequence[Tuple[int, Optional[str]]]], k: int) -> Dict[str, float]:
    """FSDP over data x AxoNN TP: the busiest data rank's elements of replicated (``"repl"``) and
    depth-replicated (``"depth"``: the biases when ``G_d > 1``) gradients, reduced on its FSDP shard.

    ``units``: FSDP's units in order (the GPT: ``wte``, ``wpe``, each block, ``ln_f``, ``lm_head``), each a
    list of its TP-local parameters in registration order as ``(elements, tag)`` (tag ``"repl"``,
    ``"depth"`` or ``None``); rank ``r`` owns ``chunk_bounds(n, k, r)`` of each unit's flat parameter, so
    which rank's chunk holds the LayerNorms and embeddings decides the busiest.

    Example:
        >>> fsdp_replicated_shard([[(4, "repl"), (8, None)], [(6, None), (2, "repl")]], 2)
        {'repl': 4.0, 'depth': 0.0}
    """
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


def block_units(linears: List[Tuple[int, int]], norm: int, bias: bool, T: int, G_r: int, G_d: int,
                split) -> List[Tuple[int, Optional[str]]]:
    """One block's TP-local parameters in registration order (``ln_1``, attention, ``ln_2``, the MLP;
    weight then bias), tagged as :func:`fsdp_replicated_shard` reads them; ``split(i, o)``: does the grid
    split this Linear."""
    def linear(i, o):
        if not split(i, o):
            return [(i * o + (o if bias else 0), "repl")]
        return [(i * o // T, None)] + ([(o // G_r, "depth" if G_d > 1 else None)] if bias else [])
    attn, mlp = linears[:2], linears[2:]
    out = [(norm, "repl")]
    for i, o in attn:
        out += linear(i, o)
    out.append((norm, "repl"))
    for i, o in mlp:
        out += linear(i, o)
    return out
