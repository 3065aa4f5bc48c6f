"""Megatron sequence parallelism in the layers: float64 parity with the serial model (forward, backward,
training with clipping), the sequence mappings in closed form, and the activation bytes outside the matmuls."""
import numpy as np
import pytest

import axonmpi
from axonmpi import Tensor, nn
from axonmpi.models import GPT, GPTConfig
from axonmpi.optim import AdamW, clip_grad_norm_
from axonmpi.parallel import full_state_dict as pm_full_state_dict
from axonmpi.parallel.tensor import (
    ColumnParallelLinear, RowParallelLinear, SequenceParallelDropout, SequenceParallelLayerNorm, full_state_dict,
    gather_from_sequence_parallel_region, load_full_state_dict,
    reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
)

TOL = 1e-10


def _rel(got, want):
    got, want = np.asarray(got), np.asarray(want)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-300))


def _shard(x, g, dim=1):
    n = x.shape[dim] // g.size
    return np.take(x, np.arange(g.rank * n, (g.rank + 1) * n), axis=dim)


@pytest.mark.mpi(min_size=1)
def test_sequence_mappings_closed_form(world):
    g = world.default_group
    p, r = g.size, g.rank
    x = np.arange(2 * 2 * p * 3, dtype=np.float64).reshape(2, 2 * p, 3) * (r + 1)
    got = reduce_scatter_to_sequence_parallel_region(Tensor(x), g, dim=1).data
    assert np.array_equal(got, _shard(x / (r + 1) * sum(range(1, p + 1)), g))
    full = gather_from_sequence_parallel_region(Tensor(_shard(x, g)), g, dim=1).data
    want = np.concatenate([_shard(x / (r + 1) * (k + 1), type("G", (), {"size": p, "rank": k})) for k in range(p)], 1)
    assert np.array_equal(full, want)
    t = Tensor(x.copy(), requires_grad=True)
    y = scatter_to_sequence_parallel_region(t, g, dim=1)
    assert np.array_equal(y.data, _shard(x, g))
    y.sum().backward()                                       # all-gather of ones: the whole sequence
    assert np.array_equal(t.grad.data, np.ones_like(x))
    if p > 1:
        with pytest.raises(ValueError, match=rf"rank {world.rank}: sequence parallelism splits dimension 1 .*length "
                                             rf"{2 * p + 1}.*multiple of {p}"):
            scatter_to_sequence_parallel_region(Tensor(np.zeros((1, 2 * p + 1, 2))), g, dim=1)


class _Block(nn.Module):
    """LayerNorm -> column -> GELU -> row -> residual: the sequence-parallel region of one MLP block."""

    def __init__(self, C, H, group=None, sp=False):
        super().__init__()
        if group is None:
            self.ln, self.fc, self.proj = (nn.LayerNorm(C, dtype=np.float64), nn.Linear(C, H, dtype=np.float64),
                                           nn.Linear(H, C, dtype=np.float64))
        else:
            self.ln = SequenceParallelLayerNorm(C, group=group, dtype=np.float64) if sp else nn.LayerNorm(
                C, dtype=np.float64)
            self.fc = ColumnParallelLinear(C, H, group=group, dtype=np.float64, sequence_parallel=sp)
            self.proj = RowParallelLinear(H, C, group=group, dtype=np.float64, sequence_parallel=sp)
        self.act = nn.GELU()

    def forward(self, x):
        return x + self.proj(self.act(self.fc(self.ln(x))))


@pytest.mark.mpi(min_size=1)
def test_column_row_layernorm_parity_forward_backward(world):
    g = world.default_group
    p = g.size
    B, T, C, H = 2, 4 * p, 6, 4 * p
    axonmpi.manual_seed(7)
    serial = _Block(C, H)
    sp = _Block(C, H, g, sp=True)
    load_full_state_dict(sp, serial.state_dict())
    x = np.random.default_rng(1).standard_normal((B, T, C))
    gy = np.random.default_rng(2).standard_normal((B, T, C))
    xs = Tensor(x.copy(), requires_grad=True)
    (serial(xs) * Tensor(gy)).sum().backward()
    xl = Tensor(_shard(x, g), requires_grad=True)
    yl = sp(xl)
    assert yl.shape == (B, T // p, C)                      # outside the matmuls: the shard only
    (yl * Tensor(_shard(gy, g))).sum().backward()
    errs = {"out": _rel(yl.data, _shard(serial(Tensor(x)).data, g)), "dx": _rel(xl.grad.data, _shard(xs.grad.data, g))}
    ref = dict(serial.named_parameters())
    for name, prm in sp.named_parameters():
        grad = prm.grad.data
        if name.startswith(("fc.", "proj.weight")):        # split over the group: gather the shards
            axis = 1 if name == "proj.weight" else 0
            grad = axonmpi.all_gather(grad, axis=axis, group=g)
        else:                                              # sequence-parallel replicated: already the full sum
            assert getattr(prm, "sequence_parallel", False), name
        errs[name] = _rel(grad, ref[name].grad.data)
    assert max(errs.values()) <= TOL, errs


CFG = GPTConfig(vocab_size=24, block_size=12, n_layer=2, n_head=12, n_embd=24)


@pytest.fixture
def megatron_gpt(world):
    """``megatron_gpt(cfg, sp)``: a GPT through ``parallelize`` with the recipe's Megatron plan over every rank
    (heads, MLP and vocabulary split; the GPT's own sequence region with ``sp``); its grids are freed after."""
    from axonmpi.parallel import parallelize
    from axonmpi.recipes.gpt import gpt_model_plan, gpt_plan
    grids = []

    def make(cfg, sp=False):
        grids.append(axonmpi.ProcessGrid(world, G_intra_c=world.world_size))
        return parallelize(GPT(cfg, dtype="float64"), grid=grids[-1], tensor_parallel=gpt_plan(cfg, sp),
                           sequence_parallel=sp, model_plan=gpt_model_plan(cfg), data_parallel=None)

    yield make
    for grid in reversed(grids):
        grid.free()


@pytest.mark.mpi(min_size=1)
def test_gpt_sequence_parallel_through_parallelize_trains_as_serial(world, megatron_gpt):
    g = world.default_group
    if CFG.block_size % g.size or CFG.n_head % g.size:
        pytest.skip("sizes do not divide")
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 24, (3, 12)), rng.integers(0, 24, (3, 12))) for _ in range(3)]
    axonmpi.manual_seed(21)
    serial = GPT(CFG, dtype="float64")
    axonmpi.manual_seed(21)
    model = megatron_gpt(CFG, sp=True)                      # the serial values, each rank its shard
    assert model.inner.blocks[0].mlp.fc.sequence_parallel
    assert isinstance(model.inner.drop, SequenceParallelDropout) or g.size == 1   # one rank: no region to enter
    worst = 0.0
    opts = [AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (serial, model)]
    for x, y in batches:
        out = []
        for m, opt in zip((serial, model), opts):
            opt.zero_grad()
            logits, loss = m(x, y)
            loss.backward()
            norm = clip_grad_norm_(m.parameters(), 0.05)
            opt.step()
            out.append((float(loss.data), float(norm), logits.shape))
        assert out[0][2] == out[1][2]                       # lm_head all-gathers the sequence
        assert out[0][1] > 0.05                             # clipping is active
        worst = max(worst, _rel(out[1][0], out[0][0]), _rel(out[1][1], out[0][1]))
    final = pm_full_state_dict(model)
    for k, v in serial.state_dict().items():
        worst = max(worst, _rel(final[k], v))
    assert worst <= TOL, worst


@pytest.mark.mpi(min_size=2)
def test_activation_bytes_outside_the_matmuls_drop_by_the_tensor_size(world, megatron_gpt):
    """Measured: the bytes of every LayerNorm input and of every block's output (the residual stream)."""
    g = world.default_group
    cfg = GPTConfig(vocab_size=24, block_size=4 * g.size, n_layer=2, n_head=2 * g.size, n_embd=8 * g.size)
    seen = {}

    def measure(model, key):
        hooks = []
        for name, m in model.named_modules():
            if isinstance(m, nn.LayerNorm) or name.startswith("blocks.") and name.count(".") == 1:
                hooks.append(m.register_forward_hook(
                    lambda mod, inp, out, n=name: seen.setdefault(key, {}).__setitem__(n, inp[0].data.nbytes)))
        x = np.random.default_rng(0).integers(0, 24, (2, cfg.block_size))
        model(x, x)
        for h in hooks:
            h.remove()

    axonmpi.manual_seed(1)
    measure(GPT(cfg, dtype="float64"), "serial")
    axonmpi.manual_seed(1)
    measure(megatron_gpt(cfg).inner, "tp")
    axonmpi.manual_seed(1)
    measure(megatron_gpt(cfg, sp=True).inner, "sp")
    assert seen["serial"].keys() == seen["sp"].keys() and len(seen["sp"]) == 3 * cfg.n_layer + 1
    for k, b in seen["serial"].items():
        assert seen["tp"][k] == b                          # tensor parallel alone: whole activations
        assert seen["sp"][k] * g.size == b, (k, seen["sp"][k], b)


@pytest.mark.mpi(min_size=2)
def test_sequence_parallel_needs_divisible_lengths(world, megatron_gpt):
    g = world.default_group
    cfg = GPTConfig(vocab_size=24, block_size=4 * g.size + 1, n_layer=1, n_head=g.size, n_embd=4 * g.size)
    model = megatron_gpt(cfg, sp=True)
    with pytest.raises(ValueError, match=rf"rank {world.rank}: sequence parallelism splits dimension -2 \(the sequence, "
                                         rf"length {4 * g.size + 1}\)"):
        model(np.zeros((1, 4 * g.size + 1), dtype=np.int64))


# -- parallelize(..., sequence_parallel=True) on any model ------------------------------------------
class _ResMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8, dtype=np.float64)
        self.blocks = nn.ModuleList(_Block(8, 24) for _ in range(2))
        self.head = nn.Linear(8, 4, dtype=np.float64)

    def forward(self, x, positions=None):      # numbers no positions (sequence parallelism asks)
        for b in self.blocks:
            x = b(self.inp(x) if b is self.blocks[0] else x)
        return self.head(x)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("seq_dim", [0, 1])
def test_parallelize_sequence_parallel_equals_serial(world, seq_dim):
    """2-D token rows (sequence_dim 0) or (batch, seq, features) (sequence_dim 1); replicated layers outside
    the plan (``inp``, ``head``) and the LayerNorms sum their gradients over the tensor group."""
    import axonmpi.nn.functional as F
    from axonmpi.parallel import ModelPlan, full_state_dict as pm_full, parallelize
    tp = 2 if world.world_size % 2 == 0 else world.world_size
    grid = axonmpi.ProcessGrid(world, G_intra_c=tp)
    try:
        rng = np.random.default_rng(3)
        shape = (4 * grid.G_data * tp, 6) if seq_dim == 0 else (2 * grid.G_data, 2 * tp, 6)
        xs = [rng.standard_normal(shape) for _ in range(3)]
        ys = [rng.integers(0, 4, shape[:-1]) for _ in range(3)]
        axonmpi.manual_seed(4)
        serial = _ResMLP()
        axonmpi.manual_seed(4)
        pm = parallelize(_ResMLP(), grid=grid, tensor_parallel={"blocks.*.fc": "column", "blocks.*.proj": "row"},
                         sequence_parallel=True, sequence_dim=seq_dim,
                         model_plan=ModelPlan(token_local=(_ResMLP, _Block)))
        from axonmpi.distributed.placement import placement_of as _pl
        assert _pl(pm.inner.blocks[0].ln.weight).partial_groups == (grid.intra_group,)   # summed by the finalize step
        from axonmpi.distributed.placement import placement_of
        # summed over the tensor group by the finalize step (its placement's partial group), bucketed
        assert placement_of(pm.inner.inp.weight).partial_groups == (grid.intra_group,)
        assert placement_of(pm.inner.blocks[1].proj.bias).partial_groups == (grid.intra_group,)
        opts = [AdamW(m.parameters(), lr=1e-2) for m in (serial, pm)]
        worst = 0.0
        for x, y in zip(xs, ys):
            vals = []
            for m, opt in zip((serial, pm), opts):
                xb, yb = (x, y) if m is serial else pm.local_batch(x, y)
                opt.zero_grad()
                out = m(Tensor(xb))
                loss = F.cross_entropy(out.reshape(-1, 4), yb.reshape(-1))
                loss.backward()
                vals.append(float(clip_grad_norm_(m.parameters(), 0.1)))
                opt.step()
            assert vals[0] > 0.1
            worst = max(worst, _rel(vals[1], vals[0]))
        sd = pm_full(pm)
        for k, v in serial.state_dict().items():
            worst = max(worst, _rel(sd[k], v))
        assert worst <= TOL, worst
    finally:
        grid.free()
