"""Expert parallelism (EP x DP, EP x TP) and tensor-parallel experts against the serial MoE model (float64).

Every layout trains a small residual model with two MoE layers for several AdamW steps with
gradient clipping active; the loss (language-model loss + weighted aux and z losses) must equal the
serial model's on the global batch at every step to 1e-10, and the parameters after the steps too.
"""
import os
import tempfile

import numpy as np
import pytest

import axonmpi
import axonmpi.nn as nn
import axonmpi.nn.functional as F
from axonmpi import Tensor
from axonmpi.distributed import all_reduce
from axonmpi.distributed.alltoallv import all_to_all_v, exchange_counts
from axonmpi.distributed.backends.counting import count_traffic
from axonmpi.parallel import full_state_dict, parallelize

RTOL = 1e-10
AUX, ZC = 1e-2, 1e-3


class Net(nn.Module):
    def __init__(self, E, k, hidden=12, capacity_factor=None):
        super().__init__()
        self.inp = nn.Linear(6, 8, dtype=np.float64)
        self.ln1 = nn.LayerNorm(8, dtype=np.float64)
        self.moe1 = nn.MoE(8, E, top_k=k, hidden=hidden, capacity_factor=capacity_factor, dtype=np.float64)
        self.fc = nn.Linear(8, 16, dtype=np.float64)
        self.proj = nn.Linear(16, 8, dtype=np.float64)
        self.ln2 = nn.LayerNorm(8, dtype=np.float64)
        self.moe2 = nn.MoE(8, E, top_k=k, hidden=hidden, gating="sigmoid" if k == 2 else "softmax",
                           capacity_factor=capacity_factor, dtype=np.float64)
        self.out = nn.Linear(8, 4, dtype=np.float64)

    def forward(self, x):
        h = self.inp(x)
        h = h + self.moe1(self.ln1(h))
        h = h + self.proj(F.gelu(self.fc(h)))
        h = h + self.moe2(self.ln2(h))
        return self.out(h)


def _make(E, k, **kw):
    axonmpi.manual_seed(0)
    return Net(E, k, **kw)


def _data(step, rows=24):
    rng = np.random.default_rng(100 + step)
    return rng.standard_normal((rows, 6)), rng.integers(0, 4, rows)


def _loss(model, out, y):
    aux, z = nn.moe_losses(model)
    return F.cross_entropy(out, y), aux, z


def _close(a, b, rtol=RTOL, what=""):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(np.abs(b).max(), 1e-300)
    err = np.abs(a - b).max() / scale
    assert err <= rtol, f"{what}: relative error {err:.3e}"
    return err


def _train(grid, E, k, *, ep=1, tp=None, etp=False, steps=3, rows=24, dp="ddp", zero1=False, **kw):
    """Losses of the parallel run and of the serial run, step by step, and the final states; ``kw``: the
    model's options, and ``sharding_strategy`` / ``hybrid_shard_size`` for ``parallelize``."""
    popts = {k2: kw.pop(k2) for k2 in ("sharding_strategy", "hybrid_shard_size") if k2 in kw}
    serial = _make(E, k, **kw)
    pm = parallelize(_make(E, k, **kw), grid=grid, tensor_parallel=tp, expert_parallel=ep,
                     expert_tensor_parallel=etp, data_parallel=dp, **popts)
    opt_s = axonmpi.optim.AdamW(serial.parameters(), lr=0.05, weight_decay=0.1)
    if zero1:       # ZeRO-1: each parameter's AdamW state split over the ranks holding its elements
        opt_p = axonmpi.optim.ZeroRedundancyOptimizer(pm.parameters(), axonmpi.optim.AdamW, lr=0.05,
                                                      weight_decay=0.1, group=grid.group_for("data_context"))
    else:
        opt_p = axonmpi.optim.AdamW(pm.parameters(), lr=0.05, weight_decay=0.1)
    batch = grid.group_for("world") if etp else grid.data_group
    worst = 0.0
    for step in range(steps):
        x, y = _data(step, rows)
        opt_s.zero_grad()
        lm, aux, z = _loss(serial, serial(Tensor(x)), y)
        want = lm + AUX * aux + ZC * z
        want.backward()
        nrm_s = axonmpi.optim.clip_grad_norm_(serial.parameters(), 0.2)
        opt_s.step()
        opt_p.zero_grad()
        xb, yb = pm.local_batch(x, y)
        lm_p, aux_p, z_p = _loss(pm.inner, pm(Tensor(xb)), yb)
        (lm_p + AUX * aux_p + ZC * z_p).backward()
        nrm_p = axonmpi.optim.clip_grad_norm_(pm.parameters(), 0.2)
        opt_p.step()
        lm_g = float(all_reduce(np.array([float(lm_p.data)]), group=batch)[0]) / batch.size \
            if batch.size > 1 else float(lm_p.data)
        got = lm_g + AUX * float(aux_p.data) + ZC * float(z_p.data)
        worst = max(worst, _close(got, float(want.data), what=f"loss step {step}"))
        worst = max(worst, _close(nrm_p, nrm_s, what=f"clip norm step {step}"))
        assert nrm_s > 0.2           # clipping active
    sd = full_state_dict(pm)
    for name, v in serial.state_dict().items():
        worst = max(worst, _close(sd[name], v, 1e-9, what=name))
    tpname = "megatron" if isinstance(tp, dict) else tp
    print(f"\n[parity] ep={ep} tp={tpname} etp={etp} dp={dp} zero1={zero1} k={k} ranks={grid.world_size}: "
          f"worst rel err {worst:.2e}")
    return worst, pm, serial, opt_p


def _grid(**sizes):
    return axonmpi.ProcessGrid(axonmpi.init(), **sizes)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("k", [1, 2])
def test_expert_parallel_equals_serial(k):
    w = axonmpi.init()
    n = w.world_size
    for ep in sorted({d for d in (n, 2, 1) if n % d == 0}):
        grid = _grid(expert_parallel=ep)
        E = 2 * ep if ep > 1 else 4
        worst, pm, _, _ = _train(grid, E, k, ep=ep)
        if ep > 1:
            p = pm.inner.moe1.experts.fc.weight
            assert p.data.shape[0] == E // ep and p.shape[0] == E      # this rank's experts; the serial shape
        grid.free()


@pytest.mark.mpi(min_size=2)
def test_moe_under_fsdp_equals_serial():
    grid = _grid()                             # experts replicated, flattened into FSDP's shards
    _train(grid, 4, 2, dp="fsdp")
    grid.free()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op", "hybrid_shard"])
def test_fsdp_times_expert_parallel_equals_serial(strategy):
    """FSDP x EP without a pipeline: FSDP shards the dense parameters over data, the experts stay split over
    the expert group (outside FSDP's flat shards) and are averaged over their expert-data group."""
    w = axonmpi.init()
    if w.world_size % 4:
        pytest.skip("EP = 2 with an expert-data group of 2 needs a multiple of 4 ranks")
    grid = _grid(expert_parallel=2)
    pm = parallelize(_make(4, 2), grid=grid, data_parallel="fsdp", sharding_strategy=strategy,
                     **({"hybrid_shard_size": 2} if strategy == "hybrid_shard" else {}))
    ids = {id(p) for p in pm.parameters()}
    experts = axonmpi.parallel.moe.expert_parameters(pm.inner)
    assert experts and all(id(p) in ids for p in experts)           # the optimizer steps the experts too
    assert pm.inner.moe1.experts.fc.weight.data.shape[0] == 2        # 4 experts over 2 expert ranks
    grid.free()
    grid = _grid(expert_parallel=2)
    worst, pm, serial, opt_p = _train(grid, 4, 2, ep=2, dp="fsdp", sharding_strategy=strategy,
                                      **({"hybrid_shard_size": 2} if strategy == "hybrid_shard" else {}))
    fresh = parallelize(_make(4, 2), grid=grid, data_parallel="fsdp", sharding_strategy=strategy,
                        **({"hybrid_shard_size": 2} if strategy == "hybrid_shard" else {}))
    fresh.load_state_dict(serial.state_dict())             # the trained serial state into the layout, and back
    got = full_state_dict(fresh)
    for name, v in serial.state_dict().items():
        _close(got[name], v, 1e-15, what=f"loaded {name}")
    # the optimizer state (the flat shards' and the experts' moments) saved and loaded under the layout
    saved = pm.sharded_state().full_optim_state_dict(opt_p)
    assert {n for n, _ in serial.named_parameters()} == set(saved["state"])      # the experts' names too
    opt_f = axonmpi.optim.AdamW(fresh.parameters(), lr=0.05, weight_decay=0.1)
    fresh.load_optim_state_dict(opt_f, saved)
    back = fresh.sharded_state().full_optim_state_dict(opt_f)
    for name, st in saved["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            _close(back["state"][name][key], st[key], 0.0, what=f"optimizer {name} {key}")
    grid.free()


@pytest.mark.mpi(min_size=2)
def test_zero1_times_expert_parallel_equals_serial():
    """ZeRO-1 x EP: the dense parameters' AdamW state split over data, each expert's over its expert-data
    group (EP = 2: half of an expert-data group's experts' state per rank; EP = all ranks: none split)."""
    w = axonmpi.init()
    n = w.world_size
    for ep in sorted({d for d in (2, n) if n % d == 0 and d > 1}):
        grid = _grid(expert_parallel=ep)
        worst, pm, _, opt = _train(grid, 2 * ep, 2, ep=ep, zero1=True)
        experts = {id(p) for p in axonmpi.parallel.moe.expert_parameters(pm.inner)}
        eb = [b for b in opt.buckets if any(id(p) in experts for p in b.params)]
        assert eb and all(all(id(p) in experts for p in b.params) for b in eb)       # buckets of their own
        edg = grid.group_for("expert_data")
        assert all((b.group is edg if edg.size > 1 else b.group is None) for b in eb)
        assert sum(b.hi - b.lo for b in eb) * edg.size >= sum(p.data.size for b in eb for p in b.params)
        grid.free()


@pytest.mark.mpi(min_size=4)
def test_expert_parallel_times_megatron_tensor_parallel_equals_serial():
    grid = _grid(G_intra_c=2, expert_parallel=2)  # 2 data x 2 tensor; EP = 2 over the data ranks
    plan = {"fc": "column", "proj": "row"}
    worst, pm, _, _ = _train(grid, 4, 2, ep=2, tp=plan)
    grid.free()


@pytest.mark.mpi(min_size=2)
def test_tensor_parallel_experts_equal_serial():
    w = axonmpi.init()
    grid = _grid(G_intra_c=2, G_data=w.world_size // 2) if w.world_size % 2 == 0 else None
    if grid is None:
        pytest.skip("needs an even number of ranks")
    worst, pm, _, _ = _train(grid, 4, 2, tp="axonn", etp=True)
    assert pm.inner.moe1.experts.fc.weight.data.shape == (4, 6, 8)   # hidden 12 over 2 tensor ranks
    grid.free()


@pytest.mark.mpi(min_size=4)
def test_tensor_parallel_experts_times_expert_parallel_equal_serial():
    """EP x tensor-parallel experts: each rank holds E/EP experts, each its hidden slice over the tensor group;
    tokens gathered over the tensor group, dispatched by all-to-all over the expert group."""
    w = axonmpi.init()
    if w.world_size % 4:
        pytest.skip("EP 2 x tensor 2 needs a multiple of 4 ranks")
    grid = _grid(G_intra_c=2, expert_parallel=2)
    worst, pm, _, _ = _train(grid, 4, 2, ep=2, tp="axonn", etp=True)
    fc = pm.inner.moe1.experts.fc
    assert fc.weight.data.shape == (2, 6, 8) and fc.bias.data.shape == (2, 6)   # 4 experts over 2, hidden 12 over 2
    assert fc.weight.shape == (4, 12, 8) and fc.bias.shape == (4, 12)            # the serial shapes
    pl = axonmpi.distributed.placement_of(fc.weight)
    assert pl.shard_groups == (grid.group_for("expert"), grid.col_group) and pl.full_shape == (4, 12, 8)
    from axonmpi.parallel.moe import GatheredAllToAllDispatcher
    assert isinstance(pm.inner.moe1.dispatcher, GatheredAllToAllDispatcher)
    grid.free()


@pytest.mark.mpi(min_size=2)
def test_dropless_conserves_tokens_and_bytes_match_formula():
    w = axonmpi.init()
    ep = w.world_size
    grid = _grid(expert_parallel=ep)
    E, k, rows = 2 * ep, 2, 8 * ep
    pm = parallelize(_make(E, k), grid=grid, expert_parallel=ep)
    x, y = _data(0, rows)
    xb, yb = pm.local_batch(x, y)
    with count_traffic() as c:
        out = pm(Tensor(xb))
        fwd = c.bytes(group="expert_group", method="alltoallv", dtype="float64")
        c.reset()
        F.cross_entropy(out, yb).backward()
        bwd = c.bytes(group="expert_group", method="alltoallv", dtype="float64")
    g = grid.group_for("expert")
    for moe in (pm.inner.moe1, pm.inner.moe2):
        assert int(moe.tokens_per_expert.sum()) == rows * k and moe.dropped_tokens == 0
        # conserved through the dispatcher: the experts of the group ran on every assignment once
        assert int(all_reduce(np.array([moe.dispatcher.last_rows_computed]), group=g)[0]) \
            == rows * k
    sent = sum(m.dispatcher.last_rows_sent_off_rank for m in (pm.inner.moe1, pm.inner.moe2))
    recv = sum(m.dispatcher.last_rows_received_off_rank for m in (pm.inner.moe1, pm.inner.moe2))
    assert fwd == (sent + recv) * 8 * 8 and bwd == fwd          # this rank: dispatch + combine
    tot = all_reduce(np.array([fwd, bwd, sent], np.int64), group=g)
    assert tot[0] == tot[1] == 2 * tot[2] * 8 * 8               # the formula, over the expert group
    assert tot[2] > 0
    grid.free()


@pytest.mark.mpi(min_size=2)
def test_all_to_all_v_closed_form():
    w = axonmpi.init()
    g = w.default_group
    p, r = g.size, g.rank
    send = np.array([(r + j) % 3 for j in range(p)])               # rows rank r sends to rank j
    x = np.concatenate([np.full((send[j], 2), 100 * r + j, np.float64) for j in range(p)])
    with count_traffic() as c:
        got, rc = all_to_all_v(x, send, group=g)
    assert rc.tolist() == [(s + r) % 3 for s in range(p)]
    want = np.concatenate([np.full((rc[s], 2), 100 * s + r, np.float64) for s in range(p)])
    np.testing.assert_array_equal(got, want)
    assert c.bytes(method="alltoallv", dtype="float64") == (send.sum() - send[r]) * 2 * 8
    cm = exchange_counts(np.arange(p * 2).reshape(p, 2) + 10 * r, g)
    np.testing.assert_array_equal(cm, np.array([[10 * s + 2 * r, 10 * s + 2 * r + 1] for s in range(p)]))


@pytest.mark.mpi(min_size=2)
def test_expert_groups_layout_and_placements():
    w = axonmpi.init()
    n = w.world_size
    ep = 2 if n % 2 == 0 else n
    grid = _grid(expert_parallel=ep)                  # the expert groups are built here, at init
    eg, edg = grid.group_for("expert"), grid.group_for("expert_data")
    assert (eg, edg) == grid.expert_groups() == grid.expert_groups(ep) == (grid.expert_group, grid.expert_data_group)
    assert eg.ranks == tuple(range(w.rank // ep * ep, w.rank // ep * ep + ep))
    assert edg.ranks == tuple(range(w.rank % ep, n, ep))
    with pytest.raises(ValueError, match="divides G_data"):
        grid.expert_groups(n + 1)
    other = 1 if ep > 1 else n
    for call in (lambda: grid.expert_groups(other),
                 lambda: parallelize(_make(2 * ep, 1), grid=grid, expert_parallel=other)):
        with pytest.raises(ValueError, match=rf"expert_parallel={other} but the grid's expert groups are built for "
                                             rf"expert_parallel={ep}.*axonmpi.init\(\.\.\., expert_parallel={other}\)"):
            call()
    with pytest.raises(ValueError, match="does not divide"):
        parallelize(_make(ep + 1, 1), grid=grid, expert_parallel=ep)
    pm = parallelize(_make(2 * ep, 1), grid=grid)     # expert_parallel=None: the grid's
    pl = axonmpi.distributed.placement_of(pm.inner.moe1.experts.fc.weight)
    assert pl.shard_groups == (eg,) and pl.full_shape == (2 * ep, 12, 8)
    from axonmpi.parallel.grad_sync import reduction_groups
    assert reduction_groups(pm.inner.moe1.experts.fc.weight, grid.data_group) == \
        ([edg] if edg.size > 1 else [])
    grid.free()
    grid = _grid()                                    # the default EP of 1: no expert split at all
    assert grid.expert_parallel == 1 and grid.group_for("expert").size == 1
    assert grid.group_for("expert_data") is grid.data_group
    grid.free()


def _steps(model, opt, steps, local=None):
    for s in steps:
        x, y = _data(s)
        if local is not None:
            x, y = local(x, y)
        opt.zero_grad()
        out = model(Tensor(x))
        lm, aux, z = _loss(getattr(model, "inner", model), out, y)
        (lm + AUX * aux + ZC * z).backward()
        axonmpi.optim.clip_grad_norm_(model.parameters(), 0.2)
        opt.step()


@pytest.mark.mpi(min_size=2)
def test_checkpoint_saved_at_ep_resumes_at_other_ep_and_loads_serially():
    """training_state after 2 steps at EP = world size; resumed at EP = world size, 2 and 1 for 2 more
    steps: the parameters equal the serial model's after 4 steps. The full arrays load serially."""
    from axonmpi.checkpoint import CheckpointManager, restore_training_state, training_state
    w = axonmpi.init()
    n = w.world_size
    E = 2 * n
    path = axonmpi.distributed.broadcast_object(tempfile.mkdtemp(prefix="moe-ckpt-") if w.rank == 0 else None)
    ref = _make(E, 2)
    ropt = axonmpi.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
    _steps(ref, ropt, range(2))
    at2 = ref.state_dict()
    _steps(ref, ropt, range(2, 4))
    grid = _grid(expert_parallel=n)
    pm = parallelize(_make(E, 2), grid=grid, expert_parallel=n)
    opt = axonmpi.optim.AdamW(pm.parameters(), lr=0.05, weight_decay=0.1)
    _steps(pm, opt, range(2), pm.local_batch)
    state = training_state(pm, opt, step=2)
    assert any(isinstance(v, axonmpi.checkpoint.ShardedArray) for v in state["model"].values())
    CheckpointManager(path).save(2, state)
    grid.free()
    for ep in [d for d in (n, 2, 1) if n % d == 0]:
        grid = _grid(expert_parallel=ep)
        axonmpi.manual_seed(7)
        pm = parallelize(Net(E, 2), grid=grid, expert_parallel=ep)
        opt = axonmpi.optim.AdamW(pm.parameters(), lr=1.0)
        loaded = CheckpointManager(path).load_latest(training_state(pm, opt, step=0))
        assert restore_training_state(loaded, pm, opt)["step"] == 2
        _steps(pm, opt, range(2, 4), pm.local_batch)
        got = full_state_dict(pm)
        for k, v in ref.state_dict().items():
            _close(got[k], v, 1e-9, what=f"resumed at EP={ep}: {k}")
        grid.free()
    serial = Net(E, 2)
    serial.load_state_dict(CheckpointManager(path).load_latest()["model"])
    for k, v in at2.items():
        _close(serial.state_dict()[k], v, 1e-12, what=f"serial load: {k}")


@pytest.mark.mpi(min_size=2)
def test_planner_bytes_equal_the_backend_counts_for_both_options():
    from axonmpi.plan import moe_estimate, moe_options
    w = axonmpi.init()
    n = w.world_size
    rows_per_rank, C, H, E, k = 6, 8, 12, 2 * n, 2
    # expert parallelism over every rank: the planner with this rank's measured off-rank fraction
    grid = _grid(expert_parallel=n)
    pm = parallelize(nn.Sequential(nn.MoE(C, E, top_k=k, hidden=H, dtype=np.float64)), grid=grid,
                     expert_parallel=n)
    x = np.random.default_rng(3).standard_normal((rows_per_rank * n, C))
    xb = pm.local_batch(x)
    wts = np.random.default_rng(4).standard_normal(xb.shape)
    with count_traffic() as c:
        out = pm(Tensor(xb, requires_grad=True))     # else the dispatch's backward has nothing to send
        fwd, cnt = c.bytes(method="alltoallv", dtype="float64"), c.bytes(method="alltoallv", dtype="int64")
        c.reset()
        (out * Tensor(wts)).sum().backward()
        bwd = c.bytes(method="alltoallv", dtype="float64")
    moe = pm.inner[0]
    f = moe.dispatcher.last_rows_sent_off_rank / (rows_per_rank * k)
    est = moe_estimate(rows_per_rank, C, H, E, k, expert_parallel=n, itemsize=8, off_rank_fraction=f)
    assert cnt == est.count_bytes == 8 * E
    tot = all_reduce(np.array([fwd, bwd, est.bytes_forward, est.bytes_backward]), group=w.default_group)
    assert tot[0] == tot[2] and tot[1] == tot[3]
    assert est.expert_params == sum(p.data.size for p in moe.experts.parameters())
    grid.free()
    # tensor-parallel experts over 2 ranks: exact on every rank
    if n % 2:
        return
    grid = _grid(G_intra_c=2, G_data=n // 2)
    pm = parallelize(nn.Sequential(nn.MoE(C, E, top_k=k, hidden=H, dtype=np.float64)), grid=grid,
                     tensor_parallel="axonn", expert_tensor_parallel=True)
    xb = pm.local_batch(x)
    with count_traffic() as c:
        out = pm(Tensor(xb, requires_grad=True))
        fwd = c.bytes(group="col_group", dtype="float64")
        c.reset()
        (out * Tensor(wts[:xb.shape[0]])).sum().backward()
        bwd = c.bytes(group="col_group", dtype="float64")
    est = moe_estimate(xb.shape[0], C, H, E, k, tensor_parallel=2, itemsize=8)
    assert fwd == est.bytes_forward == 2 * 2 * xb.shape[0] * C * 8
    assert bwd == est.bytes_backward
    assert est.expert_params == sum(p.data.size for p in pm.inner[0].experts.parameters())
    assert {o.option for o in moe_options(64, 32, 128, 8, 2, 2)} == {"expert_parallel", "tensor_parallel_experts"}
    grid.free()


@pytest.mark.mpi(min_size=4)
def test_planner_bytes_equal_the_backend_counts_for_ep_x_tensor_parallel_experts():
    """EP 2 x tensor-parallel experts T 2: the gather / reduce-scatter over the tensor group and the all-to-all of
    the gathered rows over the expert group, summed over the ranks, equal moe_estimate with the measured f."""
    from axonmpi.plan import moe_estimate
    w = axonmpi.init()
    if w.world_size % 4:
        pytest.skip("EP 2 x tensor 2 needs a multiple of 4 ranks")
    n, C, H, E, k = w.world_size, 8, 12, 4, 2
    grid = _grid(G_intra_c=2, expert_parallel=2)
    pm = parallelize(nn.Sequential(nn.MoE(C, E, top_k=k, hidden=H, dtype=np.float64)), grid=grid,
                     tensor_parallel="axonn", expert_tensor_parallel=True)
    xb = pm.local_batch(np.random.default_rng(3).standard_normal((6 * n, C)))
    wts = np.random.default_rng(4).standard_normal(xb.shape)
    with count_traffic() as c:
        out = pm(Tensor(xb, requires_grad=True))
        fwd = c.bytes(group="col_group", dtype="float64") + c.bytes(group="expert_group", dtype="float64")
        c.reset()
        (out * Tensor(wts)).sum().backward()
        bwd = c.bytes(group="col_group", dtype="float64") + c.bytes(group="expert_group", dtype="float64")
    moe = pm.inner[0]
    f = moe.dispatcher.last_rows_sent_off_rank / (2 * xb.shape[0] * k)       # of the gathered rows
    est = moe_estimate(xb.shape[0], C, H, E, k, expert_parallel=2, tensor_parallel=2, itemsize=8,
                       off_rank_fraction=f)
    tot = all_reduce(np.array([fwd, bwd, est.bytes_forward, est.bytes_backward]), group=w.default_group)
    assert tot[0] == tot[2] and tot[1] == tot[3] and tot[0] > 0
    assert est.option == "expert_parallel_x_tensor_parallel_experts"
    assert est.expert_params == sum(p.data.size for p in moe.experts.parameters())
    grid.free()


@pytest.mark.mpi(min_size=4)
def test_expert_groups_on_a_tensor_grid_match_the_closed_form():
    w = axonmpi.init()
    if w.world_size != 4:
        pytest.skip("the layout is for 4 ranks")
    grid = _grid(G_intra_c=2, expert_parallel=2)     # data ranks (0, 2) and (1, 3)
    eg, edg = grid.expert_groups(2)
    assert eg.ranks == grid.expert_group_ranks(2)[0] == ((0, 2) if w.rank % 2 == 0 else (1, 3))
    assert edg.size == 1
    assert grid.expert_group_ranks(1, 3) == ((3,), (1, 3))
    grid.free()
