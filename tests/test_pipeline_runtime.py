"""Pipeline runtime: measured in-flight micro-batches equal the schedule's, eval, shapes, one rank, errors."""
import numpy as np
import pytest

import axonmpi
import axonmpi.nn as nn
import axonmpi.nn.functional as F
from axonmpi import Tensor
from axonmpi.parallel.pipeline import Pipeline, PipelineSchedule, PipelineStage, make_schedule, simulate, split_module


def _model(widths, seed=0):
    axonmpi.random.manual_seed(seed)
    mods = []
    for a, b in zip(widths, widths[1:]):
        mods += [nn.Linear(a, b, dtype=np.float64), nn.Tanh()]
    return nn.Sequential(*mods)


def _check_pairs_agree(world, pipe):
    """Between every two ranks, the receives one posted come in the order the other sent
    (headers included): what NCCL, which has no tags, needs ([Note: p2p order])."""
    posted = axonmpi.distributed.all_gather_object(pipe._posted, world.default_group)
    sent = axonmpi.distributed.all_gather_object(pipe._sent, world.default_group)
    for q in range(world.world_size):
        for r in range(world.world_size):
            got = [x for peer, x in posted[r] if peer == q]
            assert got == [x for peer, x in sent[q] if peer == r], (q, r)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", list(PipelineSchedule))
def test_measured_in_flight_matches_the_schedule(kind):
    world = axonmpi.init()
    p, r = world.world_size, world.rank
    v = 2 if kind in (PipelineSchedule.INTERLEAVED_ONE_F_ONE_B, PipelineSchedule.ZBV) else 1
    m = 2 * p
    model = _model([4] + [6] * (2 * p * v), seed=1)
    chunks = split_module(model, p, v, by="layers", group=world.default_group,
                          stage_ranks=make_schedule(kind, p, m, v).stage_ranks)
    pipe = Pipeline(chunks, kind, num_microbatches=m, loss_fn=F.mse_loss,
                    virtual_stages=v, group=world.default_group)
    x = np.random.default_rng(0).standard_normal((3 * m, 4))
    pipe.step(x, np.zeros((3 * m, 6)))
    assert pipe._executed == make_schedule(kind, p, m, v).actions(r)     # exactly the schedule's list
    _check_pairs_agree(world, pipe)
    pipe.eval_step(x)                   # forwards only: the gradient sends drop out of both sides
    _check_pairs_agree(world, pipe)
    st = pipe.memory_stats()
    sim = simulate(make_schedule(kind, p, m, v))
    assert st.peak_in_flight == {s: sim.peak_activations_per_stage[s] for s in st.stages}
    assert st.peak_rank_in_flight == sim.peak_activations[r] == st.predicted_rank_in_flight
    if kind is PipelineSchedule.GPIPE:
        assert st.peak_rank_in_flight == m
    if kind is PipelineSchedule.ONE_F_ONE_B:
        assert st.peak_rank_in_flight == min(m, p - r)
    for s in st.stages:   # equal micro-batches: the measured peak is in-flight x one micro-batch's bytes
        assert st.microbatch_bytes[s] > 0
        assert st.peak_activation_bytes[s] == st.estimated_activation_bytes[s]


@pytest.mark.mpi(min_size=2)
def test_stages_with_different_activation_shapes_and_eval():
    """Stage outputs of several widths and a 3-D activation; eval_step returns the outputs on the last rank."""
    world = axonmpi.init()
    p = world.world_size
    axonmpi.random.manual_seed(2)
    mods = [nn.Linear(3, 5, dtype=np.float64), nn.Tanh()]
    for k in range(p):
        mods += [nn.Linear(5 + k, 6 + k, dtype=np.float64), nn.GELU()]
    model = nn.Sequential(*mods)
    x = np.random.default_rng(1).standard_normal((7, 2, 3))      # (batch, time, features)
    bounds = [2 + 2 * k for k in range(1, p)]
    pipe = Pipeline(split_module(model, p, boundaries=bounds, group=world.default_group), "1f1b", num_microbatches=3,
                    loss_fn=lambda out, t: (out * out).mean(), group=world.default_group)
    out = pipe.eval_step(x)
    with axonmpi.no_grad():
        ref = model(Tensor(x)).numpy()
    if world.rank == p - 1:
        np.testing.assert_allclose(out, ref, rtol=1e-14)
    else:
        assert out is None
    loss = pipe.eval_step(x, np.zeros(7))
    np.testing.assert_allclose(loss, (ref * ref).mean(), rtol=1e-12)
    loss2 = pipe.step(x, np.zeros(7))
    np.testing.assert_allclose(loss2, loss, rtol=1e-12)


@pytest.mark.mpi(min_size=1)
def test_one_rank_interleaved_runs_chunks_locally():
    world = axonmpi.init()
    solo = world.split(world.rank)
    model = _model([3, 4, 4, 2], seed=3)
    ref = _model([3, 4, 4, 2], seed=3)
    x, y = np.random.default_rng(2).standard_normal((5, 3)), np.random.default_rng(3).standard_normal((5, 2))
    pipe = Pipeline(split_module(model, 1, 3, by="layers", group=solo), "interleaved", num_microbatches=2,
                    loss_fn=F.mse_loss, group=solo, virtual_stages=3)
    loss = pipe.step(x, y)
    l_ref = F.mse_loss(ref(Tensor(x)), Tensor(y))
    l_ref.backward()
    np.testing.assert_allclose(loss, l_ref.item(), rtol=1e-12)
    for a, b in zip(model.parameters(), ref.parameters()):
        np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-10, atol=1e-15)


@pytest.mark.mpi(min_size=2)
def test_errors_name_rank_and_expectation():
    world = axonmpi.init()
    p, r = world.world_size, world.rank
    model = _model([3] + [3] * p)
    g = world.default_group
    chunks = split_module(model, p, by="layers", group=g)
    with pytest.raises(ValueError, match=f"rank {r}: stage {(r + 1) % p} lives on pipeline rank {(r + 1) % p}"):
        PipelineStage(chunks[0], (r + 1) % p, p, group=g)
    with pytest.raises(ValueError, match=f"rank {r}: PipelineStage num_stages={p + 1}"):
        PipelineStage(chunks[0], r, p + 1, group=g)
    with pytest.raises(ValueError, match=f"rank {r}: Pipeline got 1 stages; virtual_stages=2 needs 2"):
        Pipeline(chunks, "interleaved", num_microbatches=p, loss_fn=F.mse_loss, virtual_stages=2, group=g)
    with pytest.raises(ValueError, match="num_microbatches"):
        Pipeline(chunks, "1f1b", loss_fn=F.mse_loss, group=g)
    pipe = Pipeline(chunks, "1f1b", num_microbatches=4, loss_fn=F.mse_loss, group=g)
    if r == 0:   # the failure is raised where the data is; other ranks are not involved yet
        with pytest.raises(ValueError, match="rank 0: a batch of 3 samples cannot make 4 micro-batches"):
            pipe._agree_sizes(np.ones((3, 3)), None, need_targets=False)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["interleaved", "zbv"])
def test_a_stage_reduction_starts_after_its_last_backward(kind):
    """[Note: overlapped stage reductions]: each chunk's data-parallel reduction is launched right after its last
    backward action (the later chunk's while the earlier one's backward still runs), and the gradients equal those
    of the blocking reduction after the schedule (``overlap = False``) and the serial model's."""
    from axonmpi.parallel.pipeline.runtime import _last_backward
    world = axonmpi.init()
    solo = world.split(world.rank)
    n = world.world_size
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((4 * n, 3)), rng.standard_normal((4 * n, 2))
    mine = slice(4 * world.rank, 4 * world.rank + 4)
    grads = []
    for overlap in (True, False):
        model = _model([3, 4, 4, 2], seed=3)
        pipe = Pipeline(split_module(model, 1, 2, by="layers", group=solo, schedule=kind), kind,
                        num_microbatches=2, loss_fn=F.mse_loss, group=solo, data_group=world.default_group)
        pipe.overlap = overlap
        pipe.step(x[mine], y[mine])
        last = _last_backward(pipe.schedule_actions())
        want = sorted((k, s) for s, k in last.items()) if overlap else []
        assert pipe._launches == want, (pipe._launches, last)
        assert not overlap or pipe._launches[0][1] == 1   # the later chunk's travels during the first's backward
        assert pipe.timing().reduce_seconds > 0
        grads.append([q.grad.numpy().copy() for q in model.parameters()])
    ref = _model([3, 4, 4, 2], seed=3)
    F.mse_loss(ref(Tensor(x)), Tensor(y)).backward()
    for a, b, r in zip(*grads, ref.parameters()):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, r.grad.numpy(), rtol=1e-10, atol=1e-15)
