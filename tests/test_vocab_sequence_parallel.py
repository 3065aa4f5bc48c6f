"""A ``"vocab"`` layer of a Megatron plan under sequence parallelism equals the serial model step by step.

The token ids arrive as this rank's sequence shard; ``VocabParallelEmbedding(sequence_parallel=True)``
all-gathers them, looks up its vocabulary rows for the whole sequences and reduce-scatters the partial rows
back to the shard (Megatron's).  Checked through ``parallelize`` without and with a pipeline (float64: loss,
clip norm with clipping active, every parameter after AdamW), and the layer alone against the serial
embedding with its gradient.
"""
from __future__ import annotations

import numpy as np
import pytest

import axonmpi
import axonmpi.nn as nn
import axonmpi.nn.functional as F
from axonmpi import Tensor
from axonmpi.optim import AdamW, clip_grad_norm_
from axonmpi.parallel import PipelinePlan, parallelize
from test_nd_layouts import MAX_NORM, STEPS, _close, _train_checked   # one harness

GB, T, V, C, HEADS = 8, 8, 12, 8, 2
PLAN = {"0": "vocab", "*.attn": "attention", "*.mlp.fc": "column", "*.mlp.proj": "row"}


def _model():
    axonmpi.manual_seed(5)
    return nn.Sequential(nn.Embedding(V, C, dtype=np.float64), nn.TransformerBlock(C, HEADS, dtype=np.float64),
                         nn.TransformerBlock(C, HEADS, dtype=np.float64), nn.LayerNorm(C, dtype=np.float64),
                         nn.Linear(C, V, dtype=np.float64))


def _batch(step):
    rng = np.random.default_rng(40 + step)
    return rng.integers(0, V, (GB, T)), rng.integers(0, V, (GB, T))


def _serial():
    ref = _model()
    opt = AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for s in range(STEPS):
        x, y = _batch(s)
        opt.zero_grad()
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        out.append((float(loss.item()), float(clip_grad_norm_(ref.parameters(), MAX_NORM))))
        opt.step()
    assert min(n for _, n in out) > MAX_NORM
    return out, ref.state_dict()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pipeline", [None, "1f1b", "zbv"])
def test_vocab_layer_under_sequence_parallel_matches_serial(world, pipeline):
    """data x Megatron tensor (vocab-parallel embedding, heads, MLP) with sequence parallelism, without and
    with a pipeline: every step's loss and clip norm, then every parameter, equal serial."""
    n = 4 if pipeline else 2
    if world.world_size % n:
        pytest.skip(f"needs a multiple of {n} ranks")
    want, want_sd = _serial()
    grid = axonmpi.ProcessGrid(world, G_intra_c=2, **({"G_inter": 2} if pipeline else {}))
    old, world.grid = world.grid, grid
    try:
        pm = parallelize(_model(), grid=grid, tensor_parallel=PLAN, sequence_parallel=True, data_parallel="ddp",
                         pipeline=PipelinePlan(2, pipeline) if pipeline else None)
        _train_checked(pm, grid, want, want_sd, "vocab under SP", batch=_batch)
    finally:
        world.grid = old
        grid.free()


@pytest.mark.mpi(min_size=2)
def test_vocab_parallel_embedding_sequence_parallel_forward_and_gradient(world):
    """The layer alone: this rank's shard of the serial lookup, and the serial weight gradient (its rows)
    for a loss on the whole output."""
    from axonmpi.parallel.tensor import VocabParallelEmbedding
    from axonmpi.parallel.tensor.mappings import gather_from_sequence_parallel_region
    p = 2 if world.world_size % 2 == 0 else 1
    if p == 1:
        pytest.skip("needs an even number of ranks")
    grid = axonmpi.ProcessGrid(world, G_intra_c=2)
    try:
        g = grid.intra_group
        rng = np.random.default_rng(3)
        ids = rng.integers(0, V, (3, T))
        w = rng.standard_normal((V, C))
        up = rng.standard_normal((3, T, C))
        emb = VocabParallelEmbedding(V, C, group=g, dtype=np.float64, sequence_parallel=True, sequence_dim=1)
        emb.weight.data[...] = w[emb.vocab_start:emb.vocab_end]
        b = T // g.size
        out = emb(ids[:, g.rank * b:(g.rank + 1) * b])
        _close(out.data, w[ids][:, g.rank * b:(g.rank + 1) * b], "forward: this rank's shard of the lookup")
        full = gather_from_sequence_parallel_region(out, g, tensor_parallel_output_grad=False, dim=1)
        (full * Tensor(up)).sum().backward()
        want = np.zeros_like(w)
        np.add.at(want, ids.reshape(-1), up.reshape(-1, C))
        _close(emb.weight.grad.data, want[emb.vocab_start:emb.vocab_end], "weight gradient: this rank's rows")
    finally:
        grid.free()
