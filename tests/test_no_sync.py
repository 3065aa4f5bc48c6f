"""One gradient reducer, one no-sync switch: gradient accumulation over K micro-steps under
``axonmpi.parallel.no_sync(pm)`` (``pm.no_sync()``), then one reduction, equals the serial model's K
accumulated backwards, for every kind of layout at 4 ranks (float64): DDP, FSDP, Megatron TP + sequence
parallel (under DDP and FSDP), AxoNN 3-D (under DDP and FSDP), expert parallel, and pipelines (plain,
FSDP, AxoNN, Megatron TP + SP); and at 8 ranks (marked ``nd``) three-axis layouts where the reducer's
parts nest: FSDP x pipeline x Megatron TP + SP, DDP x pipeline x AxoNN, FSDP x AxoNN 2 x 2.  Each
optimizer step compares the clip norm (clipping active) and the loss of every micro-step; the parameters
after the steps are compared at the end (1e-10).  A switch that some path
ignored shows: a sum-type reduction (sequence-parallel, AxoNN, expert, pipeline segments) run inside and
again on the accumulated sum counts the first micro-steps twice; and inside ``no_sync`` the data replicas'
gradients must still differ (nothing reduced), which catches an ignored mean-type reduction (DDP, FSDP, the
pipeline's data group) that parity alone would not.
"""
import contextlib

import numpy as np
import pytest

import axonmpi
import axonmpi.nn as nn
import axonmpi.nn.functional as F
from axonmpi import Tensor
from axonmpi.distributed import all_gather_object
from axonmpi.optim import AdamW
from axonmpi.optim.clip import clip_grad_norm_
from axonmpi.parallel import ModelPlan, PipelinePlan, full_state_dict, no_sync, parallelize
from axonmpi.parallel.grad_sync import data_reduction_group

F64 = np.float64
TOL = 1e-10
K = 3             # micro-steps per optimizer step
STEPS = 2
GB = 8            # rows of one micro-step's global batch
MAX_NORM = 0.05
PLAN = {"*.fc1": "column", "*.fc2": "row"}


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln = nn.LayerNorm(d, dtype=F64)
        self.fc1 = nn.Linear(d, h, dtype=F64)
        self.fc2 = nn.Linear(h, d, dtype=F64)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class MoENet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8, dtype=F64)
        self.ln = nn.LayerNorm(8, dtype=F64)
        self.moe = nn.MoE(8, 4, top_k=2, hidden=12, dtype=F64)
        self.out = nn.Linear(8, 4, dtype=F64)

    def forward(self, x):
        h = self.inp(x)
        return self.out(h + self.moe(self.ln(h)))


def _mlp():
    return nn.Sequential(nn.Linear(6, 8, dtype=F64), Block(8, 16), Block(8, 16), nn.Linear(8, 4, dtype=F64))


LAYOUTS = {      # name: (model, grid sizes, parallelize options)
    "ddp": (_mlp, {}, {}),
    "fsdp": (_mlp, {}, {"data_parallel": "fsdp"}),
    "megatron_sp": (_mlp, {"G_intra_c": 2}, {"tensor_parallel": PLAN, "sequence_parallel": True,
                                              "sequence_dim": 0}),
    "fsdp_megatron_sp": (_mlp, {"G_intra_c": 2}, {"tensor_parallel": PLAN, "sequence_parallel": True,
                                                   "sequence_dim": 0, "data_parallel": "fsdp"}),
    "axonn": (_mlp, {"G_intra_r": 2}, {"tensor_parallel": "axonn"}),
    "fsdp_axonn": (_mlp, {"G_intra_r": 2}, {"tensor_parallel": "axonn", "data_parallel": "fsdp"}),
    "expert": (MoENet, {}, {"expert_parallel": 2}),
    "pipeline": (_mlp, {"G_inter": 2}, {"pipeline": PipelinePlan(2, "1f1b")}),
    "pipeline_fsdp": (_mlp, {"G_inter": 2}, {"pipeline": PipelinePlan(2, "1f1b"), "data_parallel": "fsdp"}),
    "pipeline_axonn": (_mlp, {"G_inter": 2, "G_intra_r": 2}, {"pipeline": PipelinePlan(2, "1f1b"),
                                                              "tensor_parallel": "axonn"}),
    "pipeline_megatron_sp": (_mlp, {"G_inter": 2, "G_intra_c": 2},
                             {"pipeline": PipelinePlan(2, "gpipe"), "tensor_parallel": PLAN,
                              "sequence_parallel": True, "sequence_dim": 0}),
}


def _data(step, j):
    rng = np.random.default_rng(1000 + 10 * step + j)
    return rng.standard_normal((GB, 6)), rng.integers(0, 4, GB)


def _rel(got, want):
    got, want = np.asarray(got, F64), np.asarray(want, F64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-300))


def _local_checksum(pm):
    """This rank's gradients (those it holds), summed: equal over the data replicas once reduced."""
    return float(sum(float(np.sum(p.grad.data * (1.0 + np.arange(p.grad.data.size).reshape(p.grad.data.shape))))
                     for p in pm.inner.parameters() if p.grad is not None and p.grad.data.size))


LAYOUTS8 = {     # three axes at 8 ranks: the reducer's parts nested (pipeline, FSDP flats, segments, hooks)
    "fsdp_pp2_tp2_sp": (_mlp, {"G_inter": 2, "G_intra_c": 2},
                        {"pipeline": PipelinePlan(2, "1f1b"), "data_parallel": "fsdp", "tensor_parallel": PLAN,
                         "sequence_parallel": True, "sequence_dim": 0}),
    "dp_pp2_axonn2": (_mlp, {"G_inter": 2, "G_intra_r": 2},
                      {"pipeline": PipelinePlan(2, "gpipe"), "tensor_parallel": "axonn"}),
    "fsdp_axonn2x2": (_mlp, {"G_intra_r": 2, "G_intra_c": 2}, {"tensor_parallel": "axonn", "data_parallel": "fsdp"}),
}


CASES = [pytest.param(4, name, id=name) for name in sorted(LAYOUTS)] + \
        [pytest.param(8, name, id=name, marks=pytest.mark.nd) for name in sorted(LAYOUTS8)]


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("ranks,layout", CASES)
def test_accumulation_under_no_sync_equals_serial(world, ranks, layout):
    if world.world_size != ranks:
        pytest.skip(f"{layout} runs at {ranks} ranks")
    _accumulate(world, layout, *(LAYOUTS if ranks == 4 else LAYOUTS8)[layout])


def _accumulate(world, layout, make, sizes, opts):
    grid = axonmpi.ProcessGrid(world, **sizes, expert_parallel=opts.get("expert_parallel") or 1)   # EP groups at init
    try:
        axonmpi.manual_seed(5)
        serial = make()
        axonmpi.manual_seed(5)
        pm = parallelize(make(), grid=grid, model_plan=ModelPlan(token_local=(Block, MoENet)), **opts)
        piped = "pipeline" in opts
        data = data_reduction_group(grid)
        opt_s = AdamW(serial.parameters(), lr=1e-2, weight_decay=0.1)
        opt_p = AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
        worst = 0.0
        for step in range(STEPS):
            opt_s.zero_grad()
            opt_p.zero_grad()
            for j in range(K):
                x, y = _data(step, j)
                want = F.cross_entropy(serial(Tensor(x)), y)
                want.backward()
                xb, yb = pm.local_batch(x, y)
                last = j == K - 1
                with (contextlib.nullcontext() if last else (no_sync(pm) if j == 0 else pm.no_sync())):
                    if piped:
                        got = pm.step(xb, yb)
                    else:
                        loss = F.cross_entropy(pm(Tensor(xb)), yb)
                        loss.backward()
                        got = float(axonmpi.all_reduce(np.array([float(loss.data)]))[0]) / world.world_size
                worst = max(worst, _rel(got, float(want.data)))
                if not last and data.size > 1:      # nothing was reduced: the replicas' gradients differ
                    sums = all_gather_object(round(_local_checksum(pm), 12), group=data)
                    assert len(set(sums)) == data.size, \
                        f"{layout}: gradients equal over the data group inside no_sync (reduced): {sums}"
            norms = [float(clip_grad_norm_(m.parameters(), MAX_NORM)) for m in (serial, pm)]
            assert norms[0] > MAX_NORM
            worst = max(worst, _rel(norms[1], norms[0]))
            opt_s.step()
            opt_p.step()
        sd = full_state_dict(pm)
        for k, v in serial.state_dict().items():
            worst = max(worst, _rel(sd[k], v))
        assert worst <= TOL, f"{layout}: worst relative error {worst:.3e}"
        if world.rank == 0:
            import sys
            sys.stdout.write(f"\nno_sync {layout}: worst relative error {worst:.2e}\n")
    finally:
        grid.free()


def test_no_sync_refuses_a_module_without_a_reducer():
    with pytest.raises(TypeError, match="has no grad_reducer"):
        no_sync(nn.Linear(2, 2))


# -- the reducer itself: closed forms over all ranks --------------------------------------------------------
class _Part:
    enabled = True


@pytest.mark.mpi(min_size=2)
def test_reducer_entries_closed_form_and_switch(world):
    """Rank r's gradient is (r + 1) x ones: the armed entry gives the sum n (n + 1) / 2 x scale as backward
    returns (run at the end of the pass), the after-backward entries (two parameters, one flat bucket) the mean
    (n + 1) / 2 at ``run``; inside ``no_sync`` neither runs and the part is off, and the switch is restored after
    an exception."""
    from axonmpi.distributed import resolve_group
    from axonmpi.parallel.grad_sync import GradReducer
    group, n, r = resolve_group(None), world.world_size, world.rank
    hooked = nn.Parameter(np.zeros(3))
    late = [nn.Parameter(np.zeros(2)), nn.Parameter(np.zeros((2, 2)))]
    part = _Part()
    red = GradReducer("test", parts=[part])
    armed = red.add_part(GradReducer("armed"))
    armed.after_backward([hooked], lambda p: (group,), 0.5)
    armed.arm([hooked])
    red.after_backward(late, lambda p: (group,), 1.0 / n)
    for inside in (True, False):
        for p in [hooked, *late]:
            p.grad = None
        with (red.no_sync() if inside else contextlib.nullcontext()):
            assert part.enabled is not inside and armed.enabled is not inside
            ((hooked * (r + 1.0)).sum() + sum((p * (r + 1.0)).sum() for p in late)).backward()
            red.run()
        want_hooked = (r + 1.0) if inside else 0.5 * n * (n + 1) / 2
        want_late = (r + 1.0) if inside else (n + 1) / 2
        assert np.allclose(hooked.grad.data, want_hooked, rtol=0, atol=1e-12), (inside, hooked.grad.data)
        for p in late:
            assert np.allclose(p.grad.data, want_late, rtol=0, atol=1e-12), (inside, p.grad.data)
    with pytest.raises(RuntimeError, match="boom"):
        with red.no_sync():
            raise RuntimeError("boom")
    assert red.enabled and part.enabled
    with pytest.raises(TypeError, match="needs an 'enabled' switch"):
        red.add_part(object())


@pytest.mark.mpi(min_size=2)
def test_armed_buckets_launch_during_backward_in_one_order(world):
    """[Note: buckets launched as they fill]: with 16-byte buckets, a chain's later parameters' buckets are
    launched inside the backward, before its first parameter's gradient exists (the hooks fire last layer first),
    and the result is the closed-form mean of the ranks' gradients; a second backward is a new round."""
    from axonmpi.distributed import resolve_group
    from axonmpi.parallel.grad_sync import GradReducer
    group, n, r = resolve_group(None), world.world_size, world.rank
    params = [nn.Parameter(np.full(2, 1.0 + k)) for k in range(4)]
    red = GradReducer("test")
    red.bucket_bytes = 16
    red.after_backward(params, lambda p: (group,), 1.0 / n)
    seen = []      # registered first: runs before the reducer's hook on params[0]
    params[0].register_post_accumulate_grad_hook(lambda p: seen.append(len(red._round.launched)))
    red.arm(params)
    for _ in range(2):
        for p in params:
            p.grad = None
        x = Tensor(np.full(2, r + 1.0))
        for p in params:                      # x * p0 * p1 * p2 * p3: backward reaches p3 first
            x = x * p
        x.sum().backward()
        assert seen.pop() == 3, "the three later buckets launch before the first parameter's gradient is final"
        for k, p in enumerate(params):
            others = np.prod([1.0 + j for j in range(4) if j != k])
            assert np.allclose(p.grad.data, others * (n + 1) / 2, rtol=1e-12), (k, p.grad.data)
    assert red._round is None and red._pending is None
