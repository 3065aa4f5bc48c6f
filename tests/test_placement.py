"""Issue 20's cases: strategies composed on a user's own model under a grid, checked against the serial model.

* DDP under tensor parallelism defaults to the grid's data group (it used to average the shards);
* ``Pipeline`` defaults its ``data_group`` to the grid's data group (the replicas used to drift);
* a group that would average differently placed shards raises ValueError naming parameter,
  placement and group;
* FSDP + AdamW through ``training_state(model, opt)``: sharded blocks under serial names, reloaded;
* ``clip_grad_norm_`` over pipeline x tensor parallel with stages holding no parameters, only
  tensor-parallel layers, or LayerNorm + tensor-parallel layers: the serial norm everywhere, no hang.
"""
import contextlib

import numpy as np
import pytest

import axonmpi
import axonmpi.nn as nn
import axonmpi.nn.functional as F
from axonmpi import Tensor
from axonmpi.distributed import Placement, Shard, ShardKind, placement_of
from axonmpi.optim import SGD, AdamW
from axonmpi.optim.clip import clip_grad_norm_
from axonmpi.parallel import FSDP
from axonmpi.parallel.pipeline import Pipeline, PipelineSchedule
from axonmpi.parallel.tensor import ColumnParallelLinear, RowParallelLinear, full_state_dict, load_full_state_dict

GB = 12     # global batch: divides 1, 2, 3, 4 and every data-parallel size used here
TOL = 1e-10


@contextlib.contextmanager
def grid_of(world, **sizes):
    """Make ``sizes`` the current grid (what ``axonmpi.init(**sizes)`` gives) for the block."""
    grid = axonmpi.ProcessGrid(world, **sizes)
    old, world.grid = world.grid, grid
    try:
        yield grid
    finally:
        world.grid = old
        grid.free()


def _close(got, want, what):
    err = np.max(np.abs(np.asarray(got) - np.asarray(want))) / max(np.max(np.abs(np.asarray(want))), 1e-300)
    assert err <= TOL, f"{what}: relative error {err:.3g}"


def _data(step, n=GB, d=6, classes=4):
    rng = np.random.default_rng(50 + step)
    return rng.standard_normal((n, d)), rng.integers(0, classes, n)


class _SerialMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 8, dtype=np.float64)
        self.proj = nn.Linear(8, 4, dtype=np.float64)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class _TPMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = ColumnParallelLinear(6, 8, dtype=np.float64)
        self.proj = RowParallelLinear(8, 4, dtype=np.float64)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


def _serial_mlp():
    axonmpi.manual_seed(3)
    return _SerialMLP()


# -- DDP under tensor parallelism -----------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_ddp_under_tensor_parallel_defaults_to_the_grid_data_group(world):
    """``axonmpi.init(G_intra_c=2)``: DDP(model) with no group averages over the data replicas only."""
    n = world.world_size
    if n % 2:
        pytest.skip("G_intra_c=2 needs an even world")
    with grid_of(world, G_intra_c=2) as grid:
        ref = _serial_mlp()
        tp = _TPMLP()
        load_full_state_dict(tp, ref.state_dict())
        model = axonmpi.DDP(tp)
        assert model.group.ranks == grid.data_group.ranks
        opt, ropt = SGD(model.parameters(), lr=0.5), SGD(ref.parameters(), lr=0.5)
        b = GB // grid.G_data
        lo = grid.coords.data * b
        for step in range(3):
            x, y = _data(step)
            for m, o, xs, ys in ((model, opt, x[lo:lo + b], y[lo:lo + b]), (ref, ropt, x, y)):
                o.zero_grad()
                F.cross_entropy(m(Tensor(xs)), ys).backward()
                o.step()
        got = full_state_dict(tp)
        for k, v in ref.state_dict().items():
            _close(got[k], v, f"rank {world.rank}: {k}")


@pytest.mark.mpi(min_size=2)
def test_a_group_mixing_shards_raises_naming_parameter_placement_and_group(world):
    if world.world_size % 2:
        pytest.skip("G_intra_c=2 needs an even world")
    with grid_of(world, G_intra_c=2):
        tp = _TPMLP()
        with pytest.raises(ValueError) as e:
            axonmpi.DDP(tp, group=world.default_group)
        msg = str(e.value)
        assert "'fc.weight'" in msg and "dim shard over intra_group" in msg and str(list(world.default_group.ranks)) in msg
    with grid_of(world, G_inter=2) as grid:
        stage = nn.Linear(4, 4, dtype=np.float64)
        with pytest.raises(ValueError) as e:
            Pipeline(stage, PipelineSchedule.GPIPE, num_microbatches=2, loss_fn=F.mse_loss,
                     data_group=world.default_group)
        assert "'stage " in str(e.value) and "stage shard over inter_group" in str(e.value)
        assert placement_of(stage.weight).shard_groups == (grid.inter_group,)


# -- Pipeline with the grid's data group --------------------------------------------------------------
def _chain():
    axonmpi.manual_seed(7)
    return nn.Sequential(nn.Linear(6, 8, dtype=np.float64), nn.Tanh(), nn.Linear(8, 8, dtype=np.float64),
                         nn.Tanh(), nn.Linear(8, 4, dtype=np.float64))


@pytest.mark.mpi(min_size=2)
def test_pipeline_defaults_to_the_grid_data_group(world):
    """``axonmpi.init(G_inter=2)``: a 2-stage Pipeline with no data_group reduces over the data replicas."""
    if world.world_size % 2:
        pytest.skip("G_inter=2 needs an even world")
    with grid_of(world, G_inter=2) as grid:
        ref = _chain()
        full = _chain()
        stage = nn.Sequential(*list(full)[:2]) if grid.coords.inter == 0 else nn.Sequential(*list(full)[2:])
        pipe = Pipeline(stage, PipelineSchedule.ONE_F_ONE_B, num_microbatches=2, loss_fn=F.cross_entropy)
        assert pipe.data_group is grid.data_group
        opt, ropt = AdamW(stage.parameters(), lr=1e-2), AdamW(ref.parameters(), lr=1e-2)
        b = GB // grid.G_data
        lo = grid.coords.data * b
        for step in range(3):
            x, y = _data(step)
            opt.zero_grad()
            loss = pipe.step(x[lo:lo + b], y[lo:lo + b])
            ropt.zero_grad()
            rl = F.cross_entropy(ref(Tensor(x)), y)
            rl.backward()
            ropt.step()
            opt.step()
            assert abs(loss - float(rl.data)) <= TOL * abs(float(rl.data)), (loss, float(rl.data))
        want = list(ref)[:2] if grid.coords.inter == 0 else list(ref)[2:]
        for mine, theirs in zip(stage, want):
            for (k, v), (_, w) in zip(mine.state_dict().items(), theirs.state_dict().items()):
                _close(v, w, f"rank {world.rank}: {k}")


# -- FSDP + AdamW through training_state -----------------------------------------------------------
class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(5, 7, dtype=np.float64)
        self.l2 = nn.Linear(7, 3, dtype=np.float64)

    def forward(self, x):
        return self.l2(self.l1(x).tanh())


def _fsdp_steps(model, opt, steps, rank, size):
    rng = np.random.default_rng(9)
    X, Y = rng.standard_normal((8, GB, 5)), rng.standard_normal((8, GB, 3))
    b = GB // size
    for s in steps:
        opt.zero_grad()
        ((model(Tensor(X[s][rank * b:(rank + 1) * b])) - Tensor(Y[s][rank * b:(rank + 1) * b])) ** 2).mean().backward()
        model.clip_grad_norm_(0.5)
        opt.step()


def _fsdp():
    axonmpi.manual_seed(0)
    return FSDP(_Net())


@pytest.mark.mpi(min_size=2)
def test_fsdp_adamw_training_state_saves_sharded_blocks_and_resumes(world, tmp_path_factory):
    r, n = world.rank, world.world_size
    path = axonmpi.broadcast_object(str(tmp_path_factory.mktemp("ts")) if r == 0 else None)
    mgr = axonmpi.checkpoint.CheckpointManager(path)
    model = _fsdp()
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _fsdp_steps(model, opt, range(3), r, n)
    state = axonmpi.checkpoint.training_state(model, opt, step=3)
    moments = state["optimizer"]["state"]["l1.weight"]["exp_avg"]
    assert isinstance(moments, axonmpi.checkpoint.ShardedArray) and moments.shape == (35,)
    mgr.save(3, state)
    _fsdp_steps(model, opt, range(3, 6), r, n)
    want = model.state_dict()

    model2 = _fsdp()
    opt2 = AdamW(model2.parameters(), lr=1.0)
    loaded = mgr.load_latest(axonmpi.checkpoint.training_state(model2, opt2, step=0))
    meta = axonmpi.checkpoint.restore_training_state(loaded, model2, opt2)
    assert meta["step"] == 3 and opt2.param_groups[0]["lr"] == 1e-2
    _fsdp_steps(model2, opt2, range(3, 6), r, n)
    for k, v in model2.state_dict().items():
        _close(v, want[k], f"rank {r}: {k}")


# -- clipping over pipeline x tensor parallel -------------------------------------------------------
def _grads(module, seed):
    rng = np.random.default_rng(seed)
    for p in module.parameters():
        p.grad = Tensor(rng.standard_normal(p.data.shape))


def _serial_norm(parts):
    return float(np.sqrt(sum(float((np.asarray(a) ** 2).sum()) for a in parts)))


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("stage0", ["empty", "tp_only", "layernorm_and_tp"])
@pytest.mark.parametrize("with_group", [True, False])
def test_clip_over_pipeline_x_tensor_parallel_gives_the_serial_norm(world, stage0, with_group):
    """G_inter=2 x G_intra_c=2 (x data): stage 1 holds LayerNorm + TP layers; stage 0 holds nothing,
    only TP layers, or LayerNorm + TP layers.  Without a Pipeline object and ``group=inter_group``,
    or through a Pipeline and no group: the serial norm on every rank, and nobody hangs."""
    if world.world_size % 4:
        pytest.skip("needs 4k ranks")
    with grid_of(world, G_inter=2, G_intra_c=2) as grid:
        def build(kind, seed):
            axonmpi.manual_seed(seed)
            mods = []
            if kind == "layernorm_and_tp":
                mods.append(nn.LayerNorm(6, dtype=np.float64))
            if kind != "empty":
                mods += [ColumnParallelLinear(6, 8, dtype=np.float64), RowParallelLinear(8, 6, dtype=np.float64)]
            return nn.Sequential(*mods)
        kinds = [stage0, "layernorm_and_tp"]
        stages = [build(k, 10 + s) for s, k in enumerate(kinds)]   # every rank builds both (collective init)
        for s, st in enumerate(stages):
            _grads(st, 100 + s)          # the same gradients on every rank of a tensor block (serial values)
        # serial: the full gradients of both stages
        parts = []
        for st in stages:
            sd = full_state_dict(st, grads=True)
            parts += list(sd.values())
        want = _serial_norm(parts)
        # but each rank keeps only its stage, with its tensor shard of the gradients
        mine = stages[grid.coords.inter]
        if with_group:
            total = clip_grad_norm_(list(mine.parameters()), 1e9, group=grid.inter_group)
        else:
            Pipeline(mine, PipelineSchedule.GPIPE, num_microbatches=1, loss_fn=F.mse_loss)
            total = clip_grad_norm_(list(mine.parameters()), 1e9)
        assert abs(total - want) <= TOL * want, (world.rank, stage0, total, want)


@pytest.mark.mpi(min_size=2)
def test_fsdp_and_zero_refuse_a_group_mixing_tensor_shards(world):
    if world.world_size % 2:
        pytest.skip("G_intra_c=2 needs an even world")
    with grid_of(world, G_intra_c=2):
        with pytest.raises(ValueError, match=r"FSDP would average parameter 'fc.weight'"):
            FSDP(_TPMLP(), group=world.default_group)
        with pytest.raises(ValueError, match=r"ZeroRedundancyOptimizer would average parameter '#0 \(shape"):
            axonmpi.optim.ZeroRedundancyOptimizer(_TPMLP().parameters(), AdamW, group=world.default_group, lr=1.0)
        FSDP(_TPMLP())            # the default, the grid's data group, is fine
