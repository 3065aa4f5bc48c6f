"""Issue 30 item 5: stages know their place.

``split_module`` marks every chunk with its global stage index; a ``Pipeline`` whose schedule places
other stages on a rank (ZBV's V: stages ``r`` and ``2p - 1 - r`` on rank ``r``, where ``split_module``'s
default round-robin gives ``r`` and ``r + p``) raises on every rank, naming the chunks and the fix,
instead of running a permuted model (before: 1.8433 against 1.8571 serial on 4 x Linear(6, 6) at 2
ranks, no warning).  ``split_module(..., schedule=...)`` cuts for the schedule, and then every schedule
equals the serial model (float64, 1e-10).
"""
import numpy as np
import pytest

import axonmpi
import axonmpi.nn as nn
import axonmpi.nn.functional as F
from axonmpi import Tensor
from axonmpi.parallel import Pipeline, PipelineSchedule, make_schedule, split_module

KINDS = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2)]


def _model(n_layers):
    axonmpi.manual_seed(3)
    return nn.Sequential(*[nn.Linear(6, 6, dtype=np.float64) for _ in range(n_layers)])


def _data(batch):
    rng = np.random.default_rng(5)
    return rng.standard_normal((batch, 6)), rng.integers(0, 6, batch)


def _serial(n_layers, x, y):
    ref = _model(n_layers)
    loss = F.cross_entropy(ref(Tensor(x)), y)
    loss.backward()
    return float(loss.item()), {n: p.grad.data.copy() for n, p in ref.named_parameters()}


def _setup(world, v):
    """Pipeline ranks ``p`` (all), ``2p`` micro-batches, their data, the serial loss and gradients, the model."""
    p = world.world_size
    n_layers = max(4, p * v)
    x, y = _data(4 * p)
    return (p, 2 * p, x, y, *_serial(n_layers, x, y), _model(n_layers))


def _check(pipe, model, x, y, want_loss, want_grads):
    loss = pipe.step(x, y)
    assert abs(loss - want_loss) <= 1e-10 * abs(want_loss), (loss, want_loss)
    mine = {id(q) for q in pipe.parameters()}
    for n, q in model.named_parameters():
        if id(q) in mine:
            np.testing.assert_allclose(q.grad.data, want_grads[n], rtol=1e-10, atol=1e-14, err_msg=n)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind,v", KINDS, ids=[k for k, _ in KINDS])
def test_default_cut_runs_as_serial_or_raises_naming_the_fix(world, kind, v):
    """``Pipeline(split_module(model, p, virtual_stages=v), schedule=kind)``: equal to serial where the
    schedule places chunks round-robin; ZBV raises on every rank, naming the chunks and the fix."""
    p, m, x, y, want_loss, want_grads, model = _setup(world, v)
    chunks = split_module(model, p, virtual_stages=v, group=world.default_group)
    assert [c.stage_index for c in chunks] == list(range(world.rank, p * v, p))
    if kind == "zbv":
        with pytest.raises(ValueError) as e:
            Pipeline(chunks, kind, num_microbatches=m, loss_fn=F.cross_entropy, group=world.default_group)
        msg = str(e.value)
        assert f"rank {world.rank}:" in msg and "permuted" in msg and "schedule='zbv'" in msg, msg
        V = make_schedule("zbv", p, m).stages_of(world.rank)
        if V != [world.rank, world.rank + p]:        # this rank's own chunks are the wrong ones
            assert f"runs global stages {V}" in msg and f"stages {[world.rank, world.rank + p]}" in msg, msg
        return
    pipe = Pipeline(chunks, kind, num_microbatches=m, loss_fn=F.cross_entropy, group=world.default_group)
    _check(pipe, model, x, y, want_loss, want_grads)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind,v", KINDS, ids=[k for k, _ in KINDS])
def test_cut_for_the_schedule_equals_serial(world, kind, v):
    """``split_module(model, p, v, schedule=kind)`` places the chunks where ``kind`` runs them: every schedule,
    ZBV's V included, equals the serial model's loss and gradients; the chunks wrapped (activation
    checkpointing) keep their place."""
    p, m, x, y, want_loss, want_grads, model = _setup(world, v)
    chunks = split_module(model, p, v, schedule=kind, group=world.default_group)
    sched = make_schedule(kind, p, m, v)
    assert [c.stage_index for c in chunks] == sched.stages_of(world.rank)
    assert all(c.num_chunks == p * v for c in chunks)
    pipe = Pipeline([nn.Checkpointed(c) for c in chunks], kind, num_microbatches=m, loss_fn=F.cross_entropy,
                    group=world.default_group)
    _check(pipe, model, x, y, want_loss, want_grads)


@pytest.mark.mpi(min_size=4)
def test_zbv_with_data_parallel_2x2(world):
    """2 pipeline x 2 data ranks on the issue's 4 x Linear(6, 6): the default cut raises, the schedule's cut
    equals serial."""
    if world.world_size != 4:
        pytest.skip("the 2 x 2 layout needs exactly 4 ranks")
    grid = axonmpi.ProcessGrid(world, G_inter=2)
    old, world.grid = world.grid, grid
    try:
        x, y = _data(16)
        want_loss, want_grads = _serial(4, x, y)
        d = grid.coords.data
        xb, yb = x[d * 8:(d + 1) * 8], y[d * 8:(d + 1) * 8]
        model = _model(4)
        with pytest.raises(ValueError, match="permuted"):
            Pipeline(split_module(model, 2, virtual_stages=2, group=grid.inter_group), "zbv", num_microbatches=2,
                     loss_fn=F.cross_entropy, group=grid.inter_group)
        pipe = Pipeline(split_module(model, 2, schedule="zbv", group=grid.inter_group), "zbv", num_microbatches=2,
                        loss_fn=F.cross_entropy, group=grid.inter_group)
        _check(pipe, model, xb, yb, want_loss, want_grads)
    finally:
        world.grid = old
        grid.free()


def test_split_module_schedule_argument():
    """``schedule=`` gives the schedule's placement (no MPI: ``rank=``); a disagreeing ``stage_ranks`` or
    ``virtual_stages`` raises; a chunk's place survives ``parallelize``-style wrappers."""
    model = _model(4)
    assert [c.stage_index for c in split_module(model, 2, rank=0, schedule="zbv")] == [0, 3]
    assert [c.stage_index for c in split_module(model, 2, rank=1, schedule="zbv")] == [1, 2]
    assert [c.stage_index for c in split_module(model, 2, 2, rank=1, schedule="interleaved")] == [1, 3]
    assert [c.stage_index for c in split_module(model, 2, 2, rank=1)] == [1, 3]
    with pytest.raises(ValueError, match="disagrees"):
        split_module(model, 2, rank=0, schedule="zbv", stage_ranks=(0, 1, 0, 1))
    with pytest.raises(ValueError, match="virtual_stages"):
        split_module(model, 2, 3, rank=0, schedule=PipelineSchedule.ZBV)


def test_staged_build_follows_the_schedule_placement():
    """``LayerBuilder.build_stage(..., stage_ranks=)``: a pipeline rank builds the layers of the chunks its
    schedule places there (ZBV: chunks 0 and 3 on rank 0 of 2), with the serial values; the others are stand-ins."""
    from axonmpi.parallel.pipeline import LayerBuilder

    def construct(i):
        return nn.Linear(6, 6, dtype=np.float64)

    V = make_schedule("zbv", 2, 2).stage_ranks
    axonmpi.manual_seed(3)
    serial = [construct(i) for i in range(4)]
    for r, mine in ((0, {0, 3}), (1, {1, 2})):
        axonmpi.manual_seed(3)
        layers, starts = LayerBuilder(4, construct).build_stage(2, 2, r, stage_ranks=V)
        assert starts == [0, 1, 2, 3]
        for i, layer in enumerate(layers):
            built = layer.weight.data.strides != (0, 0)
            assert built == (i in mine), (r, i)
            if built:
                np.testing.assert_array_equal(layer.weight.data, serial[i].weight.data)
