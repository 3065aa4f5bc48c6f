"""Losses in a pipeline and under sequence parallelism equal the serial run step by step (float64).

- Loss scaling in a pipeline: ``pm.step(xb, yb, scaler=)`` / ``HybridGPT.forward_backward(scaler=)`` scale each
  micro-batch's loss; ``unscale_`` sees every stage's gradients and an overflow on one rank makes every rank
  (pipeline, data, tensor) skip the step together.
- MoE router losses in a pipeline: each stage adds its router losses of each micro-batch to its backward
  (weight 1 / num_microbatches: the serial reference accumulates the same global micro-batches).
- MoE router losses under sequence parallelism: the routing statistics are the global tokens'.
"""
from __future__ import annotations

import numpy as np
import pytest

import axonmpi
import axonmpi.nn.functional as F
from axonmpi import Tensor
from axonmpi.amp import GradScaler
from axonmpi.models import GPT, GPTConfig
from axonmpi.recipes import HybridGPT
from test_recipe_layouts import GB, T, V, _grid, serial_run, train_checked   # one harness

STEPS = 3
DENSE = GPTConfig(vocab_size=V, block_size=T, n_layer=2, n_head=2, n_embd=8)
# router losses weighted 100x Megatron's defaults, so a missing or mis-scaled share fails the 1e-10 check
MOE = GPTConfig(vocab_size=V, block_size=T, n_layer=2, n_head=2, n_embd=8, moe_experts=4, moe_top_k=2,
                moe_aux_loss_coeff=1.0, moe_z_loss_coeff=0.1)


def _batches():
    rng = np.random.default_rng(11)
    out = [(rng.integers(0, V, (GB, T)), rng.integers(0, V, (GB, T))) for _ in range(STEPS)]
    for s, (_, y) in enumerate(out):        # ignored targets spread unevenly over the rows
        y[: 2 + s, : 4 - s] = -100
    return out


def _serial(cfg, microbatches):
    return serial_run(cfg, _batches(), microbatches)


def _global_microbatches_of(rows: int, shards: int, m: int):
    """Rows of the global micro-batches: micro-batch i takes the i-th of m slices of every batch shard."""
    b = rows // shards
    return [np.concatenate([np.arange(k * b + i * b // m, k * b + (i + 1) * b // m) for k in range(shards)])
            for i in range(m)]


def _global_microbatches(shards: int, m: int):
    return _global_microbatches_of(GB, shards, m)


def _run(world, cfg, sizes, opts, want, want_sd, scaler=None):
    grid = _grid(world, sizes, opts)
    old, world.grid = world.grid, grid
    try:
        axonmpi.manual_seed(7)
        hyb = HybridGPT(cfg, grid, dtype="float64", global_batch=GB, **opts)
        return hyb, train_checked(hyb, want, want_sd, "", scaler, _batches()), grid
    except BaseException:
        grid.free()
        raise
    finally:
        world.grid = old


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("sizes,opts", [
    ({"G_inter": 2, "G_intra_c": 2}, dict(tp_style="megatron", schedule="1f1b", num_microbatches=2)),
    ({"G_inter": 2}, dict(fsdp="full_shard", schedule="zb-h1", num_microbatches=2)),
], ids=["dp_pp2_tp2_1f1b", "fsdp_pp2_zbh1"])
def test_pipeline_loss_scaling_matches_serial_and_skips_together(world, sizes, opts):
    """A GradScaler (2**12) through ``HybridGPT.forward_backward(scaler=)`` with a pipeline (the recipe's own
    Pipeline, and the composer's FSDP stages): every step equals serial.  Then one rank's gradient overflows:
    every rank of the pipeline, data and tensor groups skips the step (parameters unchanged) and halves the scale."""
    if world.world_size % 4:
        pytest.skip("needs a multiple of 4 ranks")
    want, want_sd = _serial(DENSE, [np.arange(GB)])
    scaler = GradScaler(init_scale=2.0 ** 12)
    hyb, opt, grid = _run(world, DENSE, sizes, opts, want, want_sd, scaler)
    old, world.grid = world.grid, grid
    try:
        before = hyb.full_state_dict()
        x, y = _batches()[0]
        opt.zero_grad()
        hyb.forward_backward(hyb.local_batch(x), hyb.local_batch(y), scaler=scaler)
        if world.rank == world.world_size - 1:           # one rank of the last stage overflows
            next(p for p in hyb.parameters() if p.grad is not None and p.grad.data.size).grad.data[...] = np.inf
        scaler.unscale_(opt)
        assert scaler.step(opt) is None, f"rank {world.rank} stepped past an overflow on another rank"
        scaler.update()
        assert scaler.get_scale() == 2.0 ** 11, scaler.get_scale()
        after = hyb.full_state_dict()
        for k, v in before.items():
            assert np.array_equal(after[k], v), f"rank {world.rank}: {k} changed in a skipped step"
    finally:
        world.grid = old
        grid.free()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("sizes,opts,shards", [
    ({"G_inter": 2}, dict(expert_parallel=2, schedule="1f1b", num_microbatches=2), 2),
    ({"G_inter": 2, "G_intra_c": 2}, dict(tp_style="megatron", sequence_parallel=True, schedule="gpipe",
                                          num_microbatches=2), 1),
    ({"G_inter": 2}, dict(fsdp="full_shard", schedule="zb-h1", num_microbatches=2), 2),
    ({"G_inter": 2}, dict(schedule="zbv", num_microbatches=2), 2),
    ({"G_inter": 2, "G_intra_c": 2}, dict(tp_style="axonn", schedule="interleaved", num_microbatches=2), 2),
], ids=["dp2_pp2_ep2_1f1b", "pp2_tp2_sp_gpipe", "fsdp2_pp2_zbh1", "dp2_pp2_zbv", "pp2_axonn2_interleaved"])
def test_pipeline_moe_router_losses_match_serial(world, sizes, opts, shards):
    """A MoE GPT with router losses (aux and z) in a pipeline: each stage's router losses of each micro-batch
    join its backward; loss (the LM loss), clip norm and parameters equal the serial GPT accumulating the same
    global micro-batches with ``moe_auxiliary_loss() / m`` each."""
    if world.world_size != 4:
        pytest.skip("runs at 4 ranks (the global micro-batches follow the data shards)")
    want, want_sd = _serial(MOE, _global_microbatches(shards, 2))
    _, _, grid = _run(world, MOE, sizes, opts, want, want_sd)
    grid.free()


@pytest.mark.mpi(min_size=4)
def test_sequence_parallel_moe_router_losses_match_serial(world):
    """A MoE GPT with router losses under data x Megatron tensor with sequence parallelism (x expert parallel):
    the routing statistics are summed over the tensor group too, so the loss with ``moe_auxiliary_loss()``,
    the clip norm and the parameters equal the serial GPT on the global batch."""
    if world.world_size % 4:
        pytest.skip("needs a multiple of 4 ranks")
    want, want_sd = _serial(MOE, [np.arange(GB)])
    _, _, grid = _run(world, MOE, {"G_intra_c": 2}, dict(tp_style="megatron", sequence_parallel=True,
                                                        expert_parallel=2), want, want_sd)
    grid.free()


@pytest.mark.mpi(min_size=2)
def test_router_losses_with_checkpointed_pipeline_chunks_are_refused(world):
    """Checkpointed chunks keep no graph of their forward, so their router losses could not join the backward:
    refused at construction, naming the fix."""
    from axonmpi.parallel import PipelinePlan, parallelize
    from axonmpi.recipes.gpt import gpt_model_plan
    if world.world_size % 2:
        pytest.skip("needs an even number of ranks")
    grid = axonmpi.ProcessGrid(world, G_inter=2)
    old, world.grid = world.grid, grid
    try:
        with pytest.raises(NotImplementedError, match=f"rank {world.rank}: auxiliary .router. losses with "
                                                      "activation_checkpointing=True in a pipeline"):
            parallelize(GPT(MOE, dtype="float64"), grid=grid, pipeline=PipelinePlan(2), activation_checkpointing=True,
                        model_plan=gpt_model_plan(MOE))
    finally:
        world.grid = old
        grid.free()


@pytest.mark.mpi(min_size=2)
def test_pipeline_refuses_a_scaler_whose_inf_check_leaves_out_stages(world):
    """A GradScaler agreeing over a group without every pipeline rank would let stages step apart: refused,
    naming the group and the fix."""
    from axonmpi.parallel import PipelinePlan, parallelize
    if world.world_size % 2:
        pytest.skip("needs an even number of ranks")
    grid = axonmpi.ProcessGrid(world, G_inter=2)
    old, world.grid = world.grid, grid
    try:
        axonmpi.manual_seed(7)
        pm = parallelize(GPT(DENSE, dtype="float64"), grid=grid, pipeline=PipelinePlan(2))
        x, y = _batches()[0]
        with pytest.raises(ValueError, match=f"rank {grid.inter_group.rank}: the GradScaler's inf check .* leaves out "
                                             "pipeline ranks"):
            pm.step(*pm.local_batch(x, y), scaler=GradScaler(group=grid.data_group))
    finally:
        world.grid = old
        grid.free()


@pytest.mark.mpi(min_size=4)
def test_pipeline_plan_aux_loss_of_a_model_not_a_gpt_matches_serial(world):
    """``PipelinePlan(aux_loss=)`` on a model of ``nn.MoE`` blocks (not the GPT): each chunk's router losses of
    each micro-batch join its backward; loss, clip norm and parameters equal the serial model accumulating the
    same global micro-batches with ``moe_loss / m`` each."""
    from axonmpi.nn.moe import moe_loss
    from axonmpi.optim import AdamW, clip_grad_norm_
    from axonmpi.parallel import PipelinePlan, parallelize
    from test_nd_layouts import MAX_NORM, STEPS as ND_STEPS, _batch, _make, _train_checked
    if world.world_size != 4:
        pytest.skip("runs at 4 ranks (the global micro-batches follow the data shards)")
    weigh = lambda m: moe_loss(m, 1.0, 0.1)  # noqa: E731
    ref = _make("moe")
    opt = AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    want = []
    for s in range(ND_STEPS):
        x, y = _batch(s)
        opt.zero_grad()
        parts = _global_microbatches_of(len(x), 2, 2)
        loss = 0.0
        for rows in parts:
            lm = F.cross_entropy(ref(Tensor(x[rows])), y[rows], reduction="sum") * (1.0 / y.size)
            (lm + weigh(ref) * (1.0 / len(parts))).backward()
            loss += float(lm.item())
        want.append((loss, float(clip_grad_norm_(ref.parameters(), MAX_NORM))))
        opt.step()
    grid = axonmpi.ProcessGrid(world, G_inter=2, expert_parallel=2)
    old, world.grid = world.grid, grid
    try:
        pm = parallelize(_make("moe"), grid=grid, expert_parallel=2,
                         pipeline=PipelinePlan(2, "1f1b", aux_loss=weigh))
        _train_checked(pm, grid, want, ref.state_dict(), "PipelinePlan(aux_loss=)")
    finally:
        world.grid = old
        grid.free()
