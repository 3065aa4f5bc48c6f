"""N-D layouts through the one composer (``parallelize``) equal the serial run step by step.

Each layout combines three or more axes (data / FSDP, pipeline with its schedule, Megatron or AxoNN
tensor parallel, sequence parallel, context parallel, expert parallel, activation checkpointing) on two
small models built from the library's layers (a transformer of ``nn.TransformerBlock`` -- so
``nn.CausalSelfAttention`` -- and one with an ``nn.MoE`` block), float64.  At every step the loss and the
clip norm (clipping active) equal the serial model's on the global batch, and after the AdamW steps every
parameter does (1e-10 relative).  A checkpoint (the full serial state) of one layout loads under another
and into the plain model.

These run in their own pass of ``make test`` (``-m nd`` at 8 and 16 ranks); the 1-4 rank passes skip them.
"""
from __future__ import annotations

import numpy as np
import pytest

import axonmpi
import axonmpi.nn as nn
import axonmpi.nn.functional as F
from axonmpi import Tensor
from axonmpi.optim import AdamW, ZeroRedundancyOptimizer, clip_grad_norm_
from axonmpi.parallel import ModelPlan, PipelinePlan, full_state_dict, parallelize
from axonmpi.parallel.grad_sync import data_reduction_group, mean_over

pytestmark = pytest.mark.nd

TOL = 1e-10
GB, T, FEAT, C, HEADS, V = 16, 8, 5, 8, 4, 6
MAX_NORM = 0.05
STEPS = 3
F64 = np.float64


class MoEBlock(nn.Module):
    """``x + moe(ln(x))``: a pre-norm mixture-of-experts block."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(C, dtype=F64)
        self.moe = nn.MoE(C, 4, top_k=2, hidden=16, dtype=F64)

    def forward(self, x):
        return x + self.moe(self.ln(x))


def transformer():
    """embed -> 2 transformer blocks (causal attention, MLP) -> LayerNorm -> head, per-token logits."""
    return nn.Sequential(nn.Linear(FEAT, C, dtype=F64), nn.TransformerBlock(C, HEADS, dtype=F64),
                         nn.TransformerBlock(C, HEADS, dtype=F64), nn.LayerNorm(C, dtype=F64),
                         nn.Linear(C, V, dtype=F64))


def moe_model():
    """embed -> transformer block -> MoE block -> LayerNorm -> head."""
    return nn.Sequential(nn.Linear(FEAT, C, dtype=F64), nn.TransformerBlock(C, HEADS, dtype=F64), MoEBlock(),
                         nn.LayerNorm(C, dtype=F64), nn.Linear(C, V, dtype=F64))


MODELS = {"transformer": transformer, "moe": moe_model}
PLAN = {"*.attn": "attention", "*.mlp.fc": "column", "*.mlp.proj": "row"}

# name: (model, grid sizes (G_data: the rest of the world), parallelize options)
LAYOUTS = {
    "dp_pp2_tp2_sp_1f1b": ("transformer", {"G_inter": 2, "G_intra_c": 2},
                           dict(tensor_parallel=PLAN, sequence_parallel=True, pipeline=("1f1b", None))),
    "dp_pp2_tp2_zbh1": ("transformer", {"G_inter": 2, "G_intra_c": 2},
                        dict(tensor_parallel=PLAN, pipeline=("zb-h1", None))),
    "dp_pp2_tp2_zbv": ("transformer", {"G_inter": 2, "G_intra_c": 2},
                       dict(tensor_parallel=PLAN, pipeline=("zbv", None))),
    "dp_pp2_tp2_interleaved_ac": ("transformer", {"G_inter": 2, "G_intra_c": 2},
                                  dict(tensor_parallel=PLAN, activation_checkpointing=True,
                                       pipeline=("interleaved", 2))),
    "dp_pp2_axonn2_gpipe": ("transformer", {"G_inter": 2, "G_intra_r": 2},
                            dict(tensor_parallel="axonn", pipeline=("gpipe", None))),
    "pp2_tp2_sp_cp2_ring": ("transformer", {"G_inter": 2, "G_intra_c": 2, "G_context": 2},
                            dict(tensor_parallel=PLAN, sequence_parallel=True, context_parallel="ring",
                                 pipeline=("1f1b", None))),
    "dp_tp2_cp2_ulysses": ("transformer", {"G_intra_c": 2, "G_context": 2},
                           dict(tensor_parallel=PLAN, context_parallel="ulysses")),
    "fsdp_tp2_sp_cp2_ring": ("transformer", {"G_intra_c": 2, "G_context": 2},
                             dict(tensor_parallel=PLAN, sequence_parallel=True, context_parallel="ring",
                                  data_parallel="fsdp")),
    "fsdp_axonn2_cp2_ac": ("transformer", {"G_intra_r": 2, "G_context": 2},
                           dict(tensor_parallel="axonn", context_parallel="ring", data_parallel="fsdp",
                                activation_checkpointing=["1", "2"])),
    "fsdp_pp2_tp2_sp_cp2_zbh1": ("transformer", {"G_inter": 2, "G_intra_c": 2, "G_context": 2},
                                 dict(tensor_parallel=PLAN, sequence_parallel=True, context_parallel="ring",
                                      data_parallel="fsdp", pipeline=("zb-h1", None))),
    "fsdp_pp2_axonn2_1f1b": ("transformer", {"G_inter": 2, "G_intra_r": 2},
                             dict(tensor_parallel="axonn", data_parallel="fsdp", pipeline=("1f1b", None))),
    "fsdp_pp2_tp2_zbv": ("transformer", {"G_inter": 2, "G_intra_c": 2},
                         dict(tensor_parallel=PLAN, data_parallel="fsdp", pipeline=("zbv", None))),
    "moe_fsdp_pp2_tp2_ep2": ("moe", {"G_inter": 2, "G_intra_c": 2},
                             dict(tensor_parallel=PLAN, expert_parallel=2, data_parallel="fsdp",
                                  pipeline=("1f1b", None))),
    "moe_dp_pp2_tp2_ep2": ("moe", {"G_inter": 2, "G_intra_c": 2},
                           dict(tensor_parallel=PLAN, expert_parallel=2, pipeline=("1f1b", None))),
    "moe_dp_tp2_cp2_ep2_ac": ("moe", {"G_intra_c": 2, "G_context": 2},
                              dict(tensor_parallel=PLAN, context_parallel="ring", expert_parallel=2,
                                   activation_checkpointing=["2"])),
    "moe_axonn2_texperts_pp2_ac": ("moe", {"G_inter": 2, "G_intra_c": 2},
                                   dict(tensor_parallel="axonn", expert_tensor_parallel=True,
                                        activation_checkpointing=True, pipeline=("1f1b", None))),
    "zero1_pp2_tp2_cp2_interleaved": ("transformer", {"G_inter": 2, "G_intra_c": 2, "G_context": 2},
                                      dict(tensor_parallel=PLAN, context_parallel="ring", zero1=True,
                                           pipeline=("interleaved", 2))),
    "fsdp_sgo_tp2_cp2_ulysses": ("transformer", {"G_intra_c": 2, "G_context": 2},
                                 dict(tensor_parallel=PLAN, context_parallel="ulysses", data_parallel="fsdp",
                                      sharding_strategy="shard_grad_op")),
    "dp_zero1_pp2_axonn2_zbv_ac": ("transformer", {"G_inter": 2, "G_intra_r": 2},
                                   dict(tensor_parallel="axonn", zero1=True, activation_checkpointing=True,
                                        pipeline=("zbv", None))),
    "fsdp_sgo_pp2_tp2_sp_cp2u_gpipe_ac": ("transformer", {"G_inter": 2, "G_intra_c": 2, "G_context": 2},
                                          dict(tensor_parallel=PLAN, sequence_parallel=True,
                                               context_parallel="ulysses", data_parallel="fsdp",
                                               sharding_strategy="shard_grad_op", activation_checkpointing=["1"],
                                               pipeline=("gpipe", None))),
    "moe_fsdp_pp2_tp2_sp_ep2_interleaved": ("moe", {"G_inter": 2, "G_intra_c": 2},
                                            dict(tensor_parallel=PLAN, sequence_parallel=True, expert_parallel=2,
                                                 data_parallel="fsdp", pipeline=("interleaved", 2))),
    "moe_dp_pp2_cp2u_ep2_gpipe": ("moe", {"G_inter": 2, "G_context": 2},
                                  dict(context_parallel="ulysses", expert_parallel=2, pipeline=("gpipe", None))),
    "fsdp_hybrid2_axonn2_cp2u": ("transformer", {"G_intra_r": 2, "G_context": 2},
                                 dict(tensor_parallel="axonn", context_parallel="ulysses", data_parallel="fsdp",
                                      sharding_strategy="hybrid_shard", hybrid_shard_size=2)),
    "fsdp_sgo_pp2_axonn2_zbh1": ("transformer", {"G_inter": 2, "G_intra_r": 2},
                                             dict(tensor_parallel="axonn", data_parallel="fsdp",
                                                  sharding_strategy="shard_grad_op", pipeline=("zb-h1", None))),
    "moe_axonn2_texperts_pp2_cp2_zbh1": ("moe", {"G_inter": 2, "G_intra_c": 2, "G_context": 2},
                                         dict(tensor_parallel="axonn", expert_tensor_parallel=True,
                                              context_parallel="ring", pipeline=("zb-h1", None))),
    "moe_fsdp_axonn2_texperts_cp2u": ("moe", {"G_intra_c": 2, "G_context": 2},
                                      dict(tensor_parallel="axonn", expert_tensor_parallel=True,
                                           context_parallel="ulysses", data_parallel="fsdp")),
    "moe_dp_axonn2_ep2": ("moe", {"G_intra_r": 2},
                          dict(tensor_parallel="axonn", expert_parallel=2)),
    "zero1_pp2_tp2_sp_cp2u_1f1b": ("transformer", {"G_inter": 2, "G_intra_c": 2, "G_context": 2},
                                   dict(tensor_parallel=PLAN, sequence_parallel=True, context_parallel="ulysses",
                                        zero1=True, pipeline=("1f1b", None))),
    "fsdp_sgo_pp2_axonn2_cp2_interleaved_ac": ("transformer", {"G_inter": 2, "G_intra_r": 2, "G_context": 2},
                                               dict(tensor_parallel="axonn", context_parallel="ring",
                                                    data_parallel="fsdp", sharding_strategy="shard_grad_op",
                                                    activation_checkpointing=True, pipeline=("interleaved", 2))),
    "fsdp_sgo_pp2_tp2_sp_cp2u_zbv": ("transformer", {"G_inter": 2, "G_intra_c": 2, "G_context": 2},
                                     dict(tensor_parallel=PLAN, sequence_parallel=True, context_parallel="ulysses",
                                          data_parallel="fsdp", sharding_strategy="shard_grad_op",
                                          pipeline=("zbv", None))),
    "moe_dp_pp2_cp2_ep2_zbv_ac": ("moe", {"G_inter": 2, "G_context": 2},
                                  dict(context_parallel="ring", expert_parallel=2, activation_checkpointing=True,
                                       pipeline=("zbv", None))),
    "moe_zero1_axonn2_texperts_pp2_gpipe": ("moe", {"G_inter": 2, "G_intra_c": 2},
                                            dict(tensor_parallel="axonn", expert_tensor_parallel=True, zero1=True,
                                                 pipeline=("gpipe", None))),
    "moe_axonn2_texperts_pp2_zbv": ("moe", {"G_inter": 2, "G_intra_c": 2},
                                    dict(tensor_parallel="axonn", expert_tensor_parallel=True,
                                         pipeline=("zbv", None))),
    "moe_fsdp_sgo_axonn2_texperts_pp2_interleaved": ("moe", {"G_inter": 2, "G_intra_c": 2},
                                                     dict(tensor_parallel="axonn", expert_tensor_parallel=True,
                                                          data_parallel="fsdp", sharding_strategy="shard_grad_op",
                                                          pipeline=("interleaved", 2))),
    "moe_fsdp_hybrid2_axonn2_texperts": ("moe", {"G_intra_c": 2},
                                         dict(tensor_parallel="axonn", expert_tensor_parallel=True,
                                              data_parallel="fsdp", sharding_strategy="hybrid_shard",
                                              hybrid_shard_size=2)),
    "zero1_dp_pp2_tp2_zbh1_ac": ("transformer", {"G_inter": 2, "G_intra_c": 2},
                                 dict(tensor_parallel=PLAN, zero1=True, activation_checkpointing=True,
                                      pipeline=("zb-h1", None))),
    "fsdp_pp2_tp2_cp2_gpipe": ("transformer", {"G_inter": 2, "G_intra_c": 2, "G_context": 2},
                               dict(tensor_parallel=PLAN, context_parallel="ring", data_parallel="fsdp",
                                    pipeline=("gpipe", None))),
    "fsdp_hybrid2_tp2_cp2_ac": ("transformer", {"G_intra_c": 2, "G_context": 2},
                                dict(tensor_parallel=PLAN, context_parallel="ring", data_parallel="fsdp",
                                     sharding_strategy="hybrid_shard", hybrid_shard_size=2,
                                     activation_checkpointing=["1", "2"])),
    "fsdp_sgo_pp2_axonn2_cp2u_1f1b": ("transformer", {"G_inter": 2, "G_intra_r": 2, "G_context": 2},
                                      dict(tensor_parallel="axonn", context_parallel="ulysses", data_parallel="fsdp",
                                           sharding_strategy="shard_grad_op", pipeline=("1f1b", None))),
    "pp2_tp2_cp2u_zbh1": ("transformer", {"G_inter": 2, "G_intra_c": 2, "G_context": 2},
                          dict(tensor_parallel=PLAN, context_parallel="ulysses", pipeline=("zb-h1", None))),
    "pp2_axonn2_cp2u_interleaved": ("transformer", {"G_inter": 2, "G_intra_r": 2, "G_context": 2},
                                    dict(tensor_parallel="axonn", context_parallel="ulysses",
                                         pipeline=("interleaved", 2))),
    "moe_dp_tp2_sp_ep2": ("moe", {"G_intra_c": 2},
                          dict(tensor_parallel=PLAN, sequence_parallel=True, expert_parallel=2)),
    "fsdp_hybrid2_tp2_sp": ("transformer", {"G_intra_c": 2},
                            dict(tensor_parallel=PLAN, sequence_parallel=True, data_parallel="fsdp",
                                 sharding_strategy="hybrid_shard", hybrid_shard_size=2)),
    "moe_pp2_cp2_ep2_zbh1": ("moe", {"G_inter": 2, "G_context": 2},
                             dict(context_parallel="ring", expert_parallel=2, pipeline=("zb-h1", None))),
    "moe_fsdp_sgo_tp2_sp_ep2": ("moe", {"G_intra_c": 2},
                                dict(tensor_parallel=PLAN, sequence_parallel=True, expert_parallel=2,
                                     data_parallel="fsdp", sharding_strategy="shard_grad_op")),
    "moe_fsdp_hybrid2_cp2_ep2": ("moe", {"G_context": 2},
                                 dict(context_parallel="ring", expert_parallel=2, data_parallel="fsdp",
                                      sharding_strategy="hybrid_shard", hybrid_shard_size=2)),
    "moe_zero1_axonn2_ep2": ("moe", {"G_intra_r": 2}, dict(tensor_parallel="axonn", expert_parallel=2, zero1=True)),
    "moe_zero1_cp2u_ep2_ac": ("moe", {"G_context": 2},
                              dict(context_parallel="ulysses", expert_parallel=2, zero1=True,
                                   activation_checkpointing=["2"])),
    "moe_axonn2_texperts_ep2": ("moe", {"G_intra_c": 2},
                                dict(tensor_parallel="axonn", expert_tensor_parallel=True, expert_parallel=2)),
    "moe_fsdp_axonn2_texperts_ep2_pp2": ("moe", {"G_inter": 2, "G_intra_c": 2},
                                         dict(tensor_parallel="axonn", expert_tensor_parallel=True, expert_parallel=2,
                                              data_parallel="fsdp", pipeline=("1f1b", None))),
    "moe_fsdp_axonn2_texperts_ep2": ("moe", {"G_intra_c": 2},
                                     dict(tensor_parallel="axonn", expert_tensor_parallel=True, expert_parallel=2,
                                          data_parallel="fsdp")),
    "fsdp_hybrid2_pp2_zbh1_ac": ("transformer", {"G_inter": 2},
                                 dict(data_parallel="fsdp", sharding_strategy="hybrid_shard", hybrid_shard_size=2,
                                      activation_checkpointing=True, pipeline=("zb-h1", None))),
    "fsdp_hybrid2_pp2_cp2_gpipe": ("transformer", {"G_inter": 2, "G_context": 2},
                                   dict(context_parallel="ring", data_parallel="fsdp", sharding_strategy="hybrid_shard",
                                        hybrid_shard_size=2, pipeline=("gpipe", None))),
    "fsdp_hybrid2_pp2_tp2_sp_interleaved": ("transformer", {"G_inter": 2, "G_intra_c": 2},
                                            dict(tensor_parallel=PLAN, sequence_parallel=True, data_parallel="fsdp",
                                                 sharding_strategy="hybrid_shard", hybrid_shard_size=1,
                                                 pipeline=("interleaved", 2))),
    "fsdp_hybrid2_pp2_axonn2_zbv": ("transformer", {"G_inter": 2, "G_intra_r": 2},
                                    dict(tensor_parallel="axonn", data_parallel="fsdp", sharding_strategy="hybrid_shard",
                                         hybrid_shard_size=1, pipeline=("zbv", None))),
    "fsdp_hybrid2_pp2_tp2_1f1b": ("transformer", {"G_inter": 2, "G_intra_c": 2},
                                  dict(tensor_parallel=PLAN, data_parallel="fsdp", sharding_strategy="hybrid_shard",
                                       hybrid_shard_size=1, pipeline=("1f1b", None))),
}


# the layouts the 16-rank pass runs too (every layout runs at 8 ranks; at 16 the data dimension doubles)
ND16 = {"dp_pp2_tp2_sp_1f1b", "dp_pp2_tp2_zbv", "dp_pp2_axonn2_gpipe", "pp2_tp2_sp_cp2_ring", "dp_tp2_cp2_ulysses",
        "fsdp_tp2_sp_cp2_ring", "fsdp_axonn2_cp2_ac", "fsdp_pp2_tp2_sp_cp2_zbh1", "fsdp_pp2_axonn2_1f1b",
        "moe_fsdp_pp2_tp2_ep2", "moe_dp_tp2_cp2_ep2_ac", "moe_pp2_cp2_ep2_zbh1", "moe_axonn2_texperts_pp2_ac",
        "zero1_pp2_tp2_cp2_interleaved", "fsdp_hybrid2_tp2_cp2_ac"}


def _at_16(world, *layouts):
    if world.world_size >= 16 and not set(layouts) <= ND16:
        pytest.skip(f"{'/'.join(layouts)} runs at 8 ranks (the 16-rank pass runs the layouts of ND16)")


def _close(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-300)
    assert err <= TOL, f"{what}: relative error {err:.3g}"
    return err


def _make(name):
    axonmpi.manual_seed(7)
    return MODELS[name]()


def _batch(step):
    rng = np.random.default_rng(100 + step)
    return rng.standard_normal((GB, T, FEAT)), rng.integers(0, V, (GB, T))


_SERIAL = {}


def _serial_run(name):
    if name not in _SERIAL:
        ref = _make(name)
        opt = AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        losses, norms = [], []
        for s in range(STEPS):
            x, y = _batch(s)
            opt.zero_grad()
            loss = F.cross_entropy(ref(Tensor(x)), y)
            loss.backward()
            norms.append(float(clip_grad_norm_(ref.parameters(), MAX_NORM)))
            opt.step()
            losses.append(float(loss.data))
        assert min(norms) > MAX_NORM          # clipping is active at every step
        _SERIAL[name] = (losses, norms, ref.state_dict())
    return _SERIAL[name]


def _build(world, layout, seed=7):
    name, sizes, opts = LAYOUTS[layout]
    others = int(np.prod(list(sizes.values())))
    if world.world_size % others:
        pytest.skip(f"{layout} needs a multiple of {others} ranks")
    ep = opts.get("expert_parallel", 1)
    if ep > 1 and (world.world_size // others) % ep:
        pytest.skip(f"{layout}: expert_parallel={ep} does not divide G_data={world.world_size // others}")
    grid = axonmpi.ProcessGrid(world, **sizes, expert_parallel=ep)      # the expert groups are built at init
    opts = dict(opts)
    if opts.get("pipeline") is not None:
        schedule, v = opts["pipeline"]
        opts["pipeline"] = PipelinePlan(num_microbatches=2, schedule=schedule, virtual_stages=v)
        opts.setdefault("data_parallel", "ddp")
    zero1 = opts.pop("zero1", False)
    axonmpi.manual_seed(seed)
    pm = parallelize(MODELS[name](), grid=grid, model_plan=ModelPlan(token_local=(MoEBlock,)), **opts)
    pm.zero1 = zero1
    return grid, pm


def _optimizer(pm, grid):
    """AdamW; with ``zero1`` a ZeRO-1 wrapper whose state is split over the replicas (data x context)."""
    if getattr(pm, "zero1", False):
        return ZeroRedundancyOptimizer(pm.parameters(), AdamW, group=data_reduction_group(grid), lr=1e-2,
                                       weight_decay=0.1)
    return AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)


def _check_params(pm, want, what):
    """Every parameter of ``pm`` (its full serial state) equals ``want``'s, the same keys."""
    got = full_state_dict(pm)
    assert sorted(got) == sorted(want), f"{what}: keys {sorted(set(got) ^ set(want))} differ"
    for k, v in want.items():
        _close(got[k], v, f"{what}: {k}")


def _train_step(pm, grid, opt, step, batch=None):
    """One step on this rank's rows (of ``batch(step)``, default :func:`_batch`): the global mean loss and the
    clip norm."""
    x, y = (batch or _batch)(step)
    xb, yb = pm.local_batch(x, y)
    opt.zero_grad()
    if hasattr(pm, "step"):
        loss = pm.step(xb, yb)
    else:
        out = pm(Tensor(xb))
        lb = F.cross_entropy(out, yb)
        lb.backward()
        groups = [data_reduction_group(grid)] + ([grid.intra_group] if pm.tensor_parallel == "axonn" else [])
        loss = mean_over(float(lb.item()), groups)
    norm = float(clip_grad_norm_(pm.parameters(), MAX_NORM))
    opt.step()
    return loss, norm


def _train_checked(pm, grid, want, want_sd, what, batch=None):
    """:func:`_train_step` for each of ``len(want)`` steps: each step's loss and clip norm equal ``want[s]``
    (a (loss, norm) pair), then every parameter equals ``want_sd``'s."""
    opt = _optimizer(pm, grid)
    for s, (loss_s, norm_s) in enumerate(want):
        loss, norm = _train_step(pm, grid, opt, s, batch)
        _close(loss, loss_s, f"{what} step {s} loss")
        _close(norm, norm_s, f"{what} step {s} clip norm")
    _check_params(pm, want_sd, f"{what} after {len(want)} steps")


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_nd_layout_matches_serial(world, layout):
    """Loss and clip norm at each of 3 AdamW steps (clipping on), then every parameter, equal serial."""
    _at_16(world, layout)
    name = LAYOUTS[layout][0]
    want_losses, want_norms, want = _serial_run(name)
    grid, pm = _build(world, layout)
    old, world.grid = world.grid, grid       # the Pipeline and clipping read the current grid
    try:
        _train_checked(pm, grid, list(zip(want_losses, want_norms)), want, layout)
    finally:
        world.grid = old
        grid.free()


CHECKPOINT_PAIRS = [("dp_pp2_tp2_zbv", "fsdp_tp2_sp_cp2_ring"), ("fsdp_tp2_sp_cp2_ring", "dp_pp2_axonn2_gpipe"),
                    ("pp2_tp2_sp_cp2_ring", "dp_tp2_cp2_ulysses"), ("moe_dp_pp2_tp2_ep2", "moe_pp2_cp2_ep2_zbh1"),
                    ("moe_dp_tp2_cp2_ep2_ac", "moe_dp_pp2_tp2_ep2"), ("fsdp_pp2_tp2_sp_cp2_zbh1", "fsdp_pp2_axonn2_1f1b"),
                    ("fsdp_pp2_axonn2_1f1b", "dp_tp2_cp2_ulysses"), ("moe_fsdp_pp2_tp2_ep2", "moe_dp_tp2_cp2_ep2_ac"),
                    ("zero1_pp2_tp2_cp2_interleaved", "fsdp_hybrid2_tp2_sp")]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("saved,loaded", CHECKPOINT_PAIRS, ids=[f"{a}->{b}" for a, b in CHECKPOINT_PAIRS])
def test_nd_checkpoint_loads_under_another_layout_and_the_plain_model(world, saved, loaded, tmp_path_factory):
    """One step under ``saved``; its full serial state written with ``axonmpi.checkpoint.save`` and read
    back under ``loaded`` (built from another seed) and into the plain model: the same serial state, and
    the next step's loss under ``loaded`` equals the serial model's."""
    _at_16(world, saved, loaded)
    name = LAYOUTS[saved][0]
    path = axonmpi.broadcast_object(str(tmp_path_factory.mktemp("nd")) if world.rank == 0 else None) + "/ckpt"
    grid, pm = _build(world, saved)
    old = world.grid
    try:
        world.grid = grid
        _train_step(pm, grid, _optimizer(pm, grid), 0)
        want = full_state_dict(pm)
        axonmpi.checkpoint.save(path, {"model": want})
    finally:
        world.grid = old
        grid.free()
    stored = axonmpi.checkpoint.load(path, None)["model"]
    grid, pm2 = _build(world, loaded, seed=99)
    try:
        world.grid = grid
        pm2.load_state_dict(stored)
        got = full_state_dict(pm2)
        for k in want:
            _close(got[k], want[k], f"saved {saved}, loaded {loaded}: {k}")
        plain = _make(name)
        plain.load_state_dict({k: np.asarray(v) for k, v in stored.items()})
        x, y = _batch(1)
        ref = float(F.cross_entropy(plain(Tensor(x)), y).data)
        loss, _ = _train_step(pm2, grid, _optimizer(pm2, grid), 1)
        _close(loss, ref, f"saved {saved}, loaded {loaded}: next loss")
    finally:
        world.grid = old
        grid.free()


SCALED = ["fsdp_tp2_sp_cp2_ring", "dp_tp2_cp2_ulysses", "fsdp_axonn2_cp2_ac", "fsdp_hybrid2_tp2_cp2_ac",
          "fsdp_sgo_tp2_cp2_ulysses", "moe_dp_tp2_cp2_ep2_ac", "moe_fsdp_hybrid2_axonn2_texperts", "moe_dp_axonn2_ep2",
          "fsdp_hybrid2_tp2_sp", "dp_pp2_axonn2_gpipe", "dp_pp2_tp2_sp_1f1b", "dp_pp2_tp2_interleaved_ac",
          "fsdp_pp2_tp2_sp_cp2_zbh1", "dp_pp2_tp2_zbv", "zero1_pp2_tp2_cp2_interleaved"]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", SCALED)
def test_nd_loss_scaling_matches_serial(world, layout):
    """A :class:`~axonmpi.amp.GradScaler` (loss x 2**12, gradients unscaled before clipping): in float64 the
    scale is exact, so every step still equals the serial one.  With a pipeline ``pm.step(xb, yb, scaler=)``
    scales each micro-batch's loss."""
    from axonmpi.amp import GradScaler
    _at_16(world, layout)
    name = LAYOUTS[layout][0]
    want_losses, want_norms, want = _serial_run(name)
    grid, pm = _build(world, layout)
    old, world.grid = world.grid, grid
    try:
        opt = _optimizer(pm, grid)
        scaler = GradScaler(init_scale=2.0 ** 12)
        for s in range(STEPS):
            x, y = _batch(s)
            xb, yb = pm.local_batch(x, y)
            opt.zero_grad()
            if hasattr(pm, "step"):
                loss = pm.step(xb, yb, scaler=scaler)
            else:
                lb = F.cross_entropy(pm(Tensor(xb)), yb)
                scaler.scale(lb).backward()
                groups = [data_reduction_group(grid)] + ([grid.intra_group] if pm.tensor_parallel == "axonn" else [])
                loss = mean_over(float(lb.item()), groups)
            scaler.unscale_(opt)
            norm = float(clip_grad_norm_(pm.parameters(), MAX_NORM))
            scaler.step(opt)
            scaler.update()
            _close(loss, want_losses[s], f"{layout} step {s} loss")
            _close(norm, want_norms[s], f"{layout} step {s} clip norm")
        _check_params(pm, want, f"{layout} with loss scaling after {STEPS} steps")
    finally:
        world.grid = old
        grid.free()


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("schedule,fsdp,sp,cp", [("zbv", False, False, None), ("1f1b", True, False, None),
                                                 ("1f1b", False, True, None), ("zb-h1", False, True, "ring"),
                                                 ("gpipe", True, False, "ring")],
                         ids=["dp_pp2_tp2_zbv", "fsdp_pp2_tp2_1f1b", "dp_pp2_tp2_sp_1f1b", "pp2_tp2_sp_cp2_zbh1",
                              "fsdp_pp2_tp2_cp2_gpipe"])
def test_nd_gpt_through_parallelize_matches_serial(world, schedule, fsdp, sp, cp):
    """The library's GPT (tokens, learned positions, its own loss head) through ``parallelize(pipeline=...)``:
    data (DDP or FSDP) x pipeline x Megatron tensor parallel (x context parallel: the embedding stage numbers
    this rank's tokens of ``pm.local_batch`` at their positions); losses, clip norms and parameters equal serial."""
    from axonmpi.models import GPT, GPTConfig
    if world.world_size >= 16:
        pytest.skip("runs at 8 ranks")
    cfg = GPTConfig(vocab_size=12, block_size=8, n_layer=2, n_head=2, n_embd=8)
    rng = np.random.default_rng(3)
    batches = [(rng.integers(0, 12, (8, 8)), rng.integers(0, 12, (8, 8))) for _ in range(STEPS)]
    axonmpi.manual_seed(7)
    ref = GPT(cfg, dtype="float64")
    opt = AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    want = []
    for x, y in batches:
        opt.zero_grad()
        _, loss = ref(x, y)
        loss.backward()
        want.append((float(loss.item()), float(clip_grad_norm_(ref.parameters(), MAX_NORM))))
        opt.step()
    grid = axonmpi.ProcessGrid(world, G_inter=2, G_intra_c=2, **({"G_context": 2} if cp else {}))
    old, world.grid = world.grid, grid
    try:
        axonmpi.manual_seed(7)
        pm = parallelize(GPT(cfg, dtype="float64"), grid=grid, data_parallel="fsdp" if fsdp else "ddp",
                         tensor_parallel={"blocks.*.attn": "attention", "blocks.*.mlp.fc": "column",
                                          "blocks.*.mlp.proj": "row", **({"lm_head": "column_gather"} if sp else {})},
                         sequence_parallel=sp, context_parallel=cp,
                         pipeline=PipelinePlan(num_microbatches=2, schedule=schedule))
        _train_checked(pm, grid, want, ref.state_dict(), "GPT", batch=lambda s: batches[s])
    finally:
        world.grid = old
        grid.free()
