"""Model parity: an MLP and the GPT trained tensor-parallel (AxoNN auto_parallelize, Megatron layout) equal
the serial model on the global batch: loss at every step and parameters after AdamW steps with clipping."""
import numpy as np
import pytest

import axonmpi
import axonmpi.nn as nn
from axonmpi import Tensor
from axonmpi.distributed import all_reduce
from axonmpi.models import GPT, GPTConfig
from axonmpi.optim import AdamW
from axonmpi.optim import clip_grad_norm_ as serial_clip
from axonmpi.parallel import auto_parallelize, intra_layer
from axonmpi.parallel.auto_parallelize import is_parallelizable_linear
from axonmpi.parallel import parallelize
from axonmpi.parallel.tensor import TensorParallelGroups, full_state_dict, load_full_state_dict
from axonmpi.recipes.gpt import gpt_plan

STEPS = 5
RTOL = 1e-10
CFG = GPTConfig(vocab_size=12, block_size=6, n_layer=2, n_head=4, n_embd=12)


@pytest.fixture
def tp_grid():
    """``tp_grid(G_intra_r=.., G_intra_c=.., G_intra_d=..)``: a ProcessGrid built on the World for this
    test (freed, collectively, when the test ends)."""
    grids = []

    def make(**sizes):
        grids.append(axonmpi.ProcessGrid(axonmpi.init(), **sizes))
        return grids[-1]

    yield make
    for grid in reversed(grids):
        grid.free()


def _tp(grid_factory, shape):
    G_r, G_c, G_d = shape
    return TensorParallelGroups.from_grid(grid_factory(G_intra_r=G_r, G_intra_c=G_c, G_intra_d=G_d))


def _close(a, b, rtol=RTOL, what=""):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    scale = max(np.abs(b).max(), 1e-300)
    assert np.abs(a - b).max() <= rtol * scale, (what, np.abs(a - b).max() / scale)


def _mlp():
    return nn.Sequential(nn.Linear(6, 12, dtype="float64"), nn.Tanh(), nn.Linear(12, 24, dtype="float64"),
                         nn.ReLU(), nn.Linear(24, 5, dtype="float64"))


def _train(model, batches, loss_fn, sync, clip, reduce_loss):
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        sync(model)
        clip(model)
        opt.step()
        losses.append(reduce_loss(float(loss.data)))
    return losses


def _mlp_loss(model, batch):
    x, y = batch
    out = model(Tensor(x))
    return ((out - Tensor(y)) * (out - Tensor(y))).mean()


def _gpt_loss(model, batch):
    return model(batch[0], batch[1])[1]


def _data(kind, n_rows, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "mlp":
        return [(rng.standard_normal((n_rows, 6)), rng.standard_normal((n_rows, 5))) for _ in range(STEPS)]
    return [(rng.integers(0, CFG.vocab_size, (n_rows, CFG.block_size)),
             rng.integers(0, CFG.vocab_size, (n_rows, CFG.block_size))) for _ in range(STEPS)]


def _build(kind):
    axonmpi.random.manual_seed(21)
    return _mlp() if kind == "mlp" else GPT(CFG, dtype="float64")


def _serial(kind, batches):
    model = _build(kind)
    init = model.state_dict()
    losses = _train(model, batches, _mlp_loss if kind == "mlp" else _gpt_loss, lambda m: None,
                    lambda m: serial_clip(m.parameters(), 0.05), lambda v: v)
    return init, losses, model.state_dict()


AUTO_SHAPES = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2), (2, 2, 1), (4, 1, 1), (1, 4, 1), (1, 1, 4),
               (3, 1, 1), (1, 3, 1), (1, 1, 3)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["mlp", "gpt"])
@pytest.mark.parametrize("shape", AUTO_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_auto_parallelize_training_parity(kind, shape, tp_grid):
    world = axonmpi.init()
    if world.world_size % (shape[0] * shape[1] * shape[2]):
        pytest.skip(f"grid {shape} does not fit {world.world_size} ranks")
    g = _tp(tp_grid, shape)
    per_rank = 2
    batches = _data(kind, per_rank * world.world_size)
    init, ref_losses, ref_final = _serial(kind, batches)
    with auto_parallelize(groups=g):
        model = _build(kind)
    start = full_state_dict(model)              # built from the same seed: the serial model's initial values
    assert start.keys() == init.keys()
    for k, v in init.items():
        np.testing.assert_array_equal(start[k], v, err_msg=k)
    serial_linears = [m for m in _build(kind).modules() if type(m) is nn.Linear]
    kinds = [type(m) for m in model.modules() if type(m) in (nn.Linear, intra_layer.Linear)]
    expect = [intra_layer.Linear if is_parallelizable_linear(m.in_features, m.out_features, shape) else nn.Linear
              for m in serial_linears]
    assert kinds == expect and intra_layer.Linear in kinds
    load_full_state_dict(model, init)
    lo, hi = world.rank * per_rank, (world.rank + 1) * per_rank
    local = [(x[lo:hi], y[lo:hi]) for x, y in batches]
    losses = _train(model, local, _mlp_loss if kind == "mlp" else _gpt_loss,
                    lambda m: intra_layer.sync_gradients(m, mean=True, groups=g),
                    lambda m: intra_layer.clip_grad_norm_(m.parameters(), 0.05),
                    lambda v: float(all_reduce(np.array([v]))[0]) / world.world_size)
    _close(losses, ref_losses, what="losses")
    final = full_state_dict(model)
    for k, v in ref_final.items():
        _close(final[k], v, what=k)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("use_ddp", [False, True], ids=["manual-allreduce", "DDP"])
@pytest.mark.parametrize("G_tp", [2, 4])
def test_megatron_gpt_training_parity(G_tp, use_ddp, tp_grid):
    world = axonmpi.init()
    if world.world_size % G_tp:
        pytest.skip(f"G_c={G_tp} does not divide {world.world_size} ranks")
    grid = tp_grid(G_intra_c=G_tp)
    tp, dp = grid.intra_group, grid.data_group
    per_rank = 2
    batches = _data("gpt", per_rank * dp.size, seed=1)
    init, ref_losses, ref_final = _serial("gpt", batches)
    # the recipe's Megatron plan through parallelize; with DDP over the data group (TP params reduced over data only)
    model = parallelize(_build("gpt"), grid=grid, tensor_parallel=gpt_plan(CFG), data_parallel="ddp" if use_ddp else None)
    inner = model.inner
    assert tp.size == G_tp and full_state_dict(inner).keys() == init.keys()
    lo, hi = dp.rank * per_rank, (dp.rank + 1) * per_rank
    local = [(x[lo:hi], y[lo:hi]) for x, y in batches]

    def sync(m):
        if use_ddp:
            return
        for p in m.parameters():
            if p.grad is not None and dp.size > 1:
                all_reduce(p.grad.data, op="mean", group=dp, out=p.grad.data)

    losses = _train(model, local, _gpt_loss, sync, lambda m: intra_layer.clip_grad_norm_(m.parameters(), 0.05),
                    lambda v: float(all_reduce(np.array([v]), op="mean", group=dp)[0]))
    _close(losses, ref_losses, what="losses")
    final = full_state_dict(inner)
    for k, v in ref_final.items():
        _close(final[k], v, what=k)


@pytest.mark.mpi(min_size=1)
def test_auto_parallelize_hook_is_scoped_and_follows_axonn_rule(tp_grid):
    world = axonmpi.init()
    g = _tp(tp_grid, (world.world_size, 1, 1))
    p = world.world_size
    with auto_parallelize(groups=g):
        a = nn.Linear(5, 4 * p)
        b = nn.Linear(5, 4 * p + 1) if p > 1 else None
        with pytest.raises(RuntimeError):
            with auto_parallelize(groups=g):
                raise RuntimeError("inner block fails")
        c = nn.Linear(3, 2 * p)
    assert isinstance(a, intra_layer.Linear) and isinstance(c, intra_layer.Linear)
    if b is not None:
        assert type(b) is nn.Linear
    assert type(nn.Linear(5, 4 * p)) is nn.Linear
    with pytest.raises(ValueError):
        with auto_parallelize(groups=g):
            raise ValueError("boom")
    assert type(nn.Linear(5, 4 * p)) is nn.Linear


@pytest.mark.mpi(min_size=2)
def test_sharded_checkpoint_reshards_tp_to_serial_and_serial_to_3d(tmp_path_factory, tp_grid):
    """Megatron TP over rank pairs (``parallelize`` with the recipe's plan) saves ShardedArray blocks; a serial
    model loads them; then a 3-D auto-parallelized model ((2,1,2) at 4 ranks, (3,1,1) at 3, (2,1,1) at 2) loads
    the serial checkpoint."""
    from axonmpi import checkpoint
    from axonmpi.distributed import broadcast_object
    from axonmpi.parallel.tensor import load_sharded_state_dict, sharded_state_dict
    world = axonmpi.init()
    path = broadcast_object(str(tmp_path_factory.mktemp("tpckpt")) if world.rank == 0 else None)
    serial = _build("gpt")
    for p in serial.parameters():                   # distinct values everywhere (not the N(0, .02) init)
        p.data[...] = np.random.default_rng(p.data.size).standard_normal(p.shape)
    ref = serial.state_dict()
    pairs = tp_grid(G_intra_c=2 if world.world_size % 2 == 0 else 1)   # Megatron over rank pairs (3 ranks: none)
    tp = parallelize(_build("gpt"), grid=pairs, tensor_parallel=gpt_plan(CFG), data_parallel=None).inner
    load_full_state_dict(tp, ref)
    first = pairs.intra_group.ranks if 0 in pairs.intra_group.ranks else None
    sub = world.split(0 if first is not None else None, name="first-pair")   # one TP group saves and reloads
    if first is not None:
        checkpoint.save(path + "/tp", {"model": sharded_state_dict(tp)}, group=sub)
        back = checkpoint.load(path + "/tp", group=sub)["model"]
        for k, v in ref.items():
            _close(back[k], v, what=k)
    checkpoint.save(path + "/serial", {"model": ref})
    g = _tp(tp_grid, {2: (2, 1, 1), 3: (3, 1, 1), 4: (2, 1, 2)}[world.world_size])
    with auto_parallelize(groups=g):
        model = _build("gpt")
    template = sharded_state_dict(model)
    checkpoint.load(path + "/serial", {"model": template})
    load_sharded_state_dict(model, template)
    final = full_state_dict(model)
    for k, v in ref.items():
        _close(final[k], v, what=k)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["mlp", "gpt"])
@pytest.mark.parametrize("flags", [(True, False, False), (True, True, False), (False, True, True), (True, True, True)])
def test_optimize_communication_gives_the_same_gradients(flags, kind, tp_grid):
    world = axonmpi.init()
    shape = {2: (1, 1, 2), 3: (1, 1, 3), 4: (2, 1, 2)}[world.world_size]
    g = _tp(tp_grid, shape)
    with auto_parallelize(groups=g):
        model = _build(kind)
    batch = _data(kind, 2, seed=world.rank)[0]

    def grads(ctx):
        model.zero_grad()
        with ctx:
            loss = (_mlp_loss if kind == "mlp" else _gpt_loss)(model, batch)
            loss.backward()
        intra_layer.sync_gradients(model, groups=g)
        return full_state_dict(model, grads=True), float(loss.data)

    import contextlib
    ref, ref_loss = grads(contextlib.nullcontext())
    ar, rs, ag = flags
    got, loss = grads(intra_layer.optimize_communication(overlap_all_reduce=ar, overlap_reduce_scatter=rs,
                                                         overlap_all_gather=ag, model=model))
    assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss)
    assert got.keys() == ref.keys()
    for k in ref:
        _close(got[k], ref[k], rtol=1e-12, what=k)


@pytest.mark.mpi(min_size=1)
def test_optimize_communication_prefetch_needs_model():
    with pytest.raises(ValueError, match="needs model="):
        with intra_layer.optimize_communication(overlap_all_gather=True):
            pass
