"""AxoNN 3-D intra-layer Linear: float64 parity with the serial nn.Linear over every grid shape that fits."""
import math

import numpy as np
import pytest

import axonmpi
import axonmpi.nn as nn
from axonmpi import Tensor
from axonmpi.distributed import chunk_bounds
from axonmpi.parallel import intra_layer
from axonmpi.parallel.tensor import TensorParallelGroups, full_state_dict

SHAPES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2), (4, 1, 1), (1, 4, 1),
          (1, 1, 4), (3, 1, 1), (1, 3, 1), (1, 1, 3)]
RTOL = 1e-12


def _fits(shape):
    n = axonmpi.init().world_size
    return n % (shape[0] * shape[1] * shape[2]) == 0


@pytest.fixture
def tp_groups():
    """``tp_groups((G_r, G_c, G_d))``: the TensorParallelGroups of a ProcessGrid built on the World for
    this test (freed, collectively, when the test ends)."""
    grids = []

    def make(shape):
        G_r, G_c, G_d = shape
        grids.append(axonmpi.ProcessGrid(axonmpi.init(), G_intra_r=G_r, G_intra_c=G_c, G_intra_d=G_d))
        return TensorParallelGroups.from_grid(grids[-1])

    yield make
    for grid in reversed(grids):
        grid.free()


def _close(a, b, rtol=RTOL):
    a, b = np.asarray(getattr(a, "data", a)), np.asarray(getattr(b, "data", b))
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = max(np.abs(b).max(), 1e-300)
    assert np.abs(a - b).max() <= rtol * scale, np.abs(a - b).max() / scale


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("expert", [False, True])
def test_linear_parity(shape, transpose, bias, expert, tp_groups):
    if not _fits(shape):
        pytest.skip(f"grid {shape} does not fit {axonmpi.init().world_size} ranks")
    world = axonmpi.init()
    g = tp_groups(shape)
    G_r, G_c, G_d = shape
    g_in, g_out = (G_r, G_c) if transpose else (G_c, G_r)
    IN, OUT = 6 * g_in, 4 * g_out * G_d
    axonmpi.random.manual_seed(9)
    ref = nn.Linear(IN, OUT, bias=bias, dtype="float64")
    layer = intra_layer.Linear(IN, OUT, bias=bias, transpose=transpose, expert_mode=expert, dtype="float64",
                               groups=g)
    layer.load_state_dict(ref.state_dict())
    # the stored block is AxoNN's: W[r-block, c-block] flattened, depth chunk d
    inner, outer = layer.inner, layer.outer
    lo, li = OUT // g_out, IN // g_in
    blk = ref.weight.data[outer.rank * lo:(outer.rank + 1) * lo, inner.rank * li:(inner.rank + 1) * li].reshape(-1)
    k = blk.size // G_d
    _close(layer.weight, blk[g.depth.rank * k:(g.depth.rank + 1) * k])

    rng = np.random.default_rng(3)
    B = 2 * world.world_size + 1                      # rows do not divide evenly
    X, GY = rng.standard_normal((B, IN)), rng.standard_normal((B, OUT))
    xs = Tensor(X, requires_grad=True)
    ys = ref(xs)
    ys.backward(Tensor(GY))
    if expert:            # rows split over data x depth, features over inner
        n_rep = g.data.size * G_d
        a, b = chunk_bounds(B, n_rep, g.data.rank * G_d + g.depth.rank)
        xin = np.ascontiguousarray(X[a:b, inner.rank * li:(inner.rank + 1) * li])
        gy = np.ascontiguousarray(GY[a:b, outer.rank * lo:(outer.rank + 1) * lo])
        y_exp = ys.data[a:b, outer.rank * lo:(outer.rank + 1) * lo]
        dx_exp = xs.grad.data[a:b, inner.rank * li:(inner.rank + 1) * li]
    else:                 # every rank its own rows, all features
        a, b = chunk_bounds(B, world.world_size, world.rank)
        xin, gy = X[a:b].copy(), GY[a:b].copy()
        y_exp, dx_exp = ys.data[a:b], xs.grad.data[a:b]
    xt = Tensor(xin, requires_grad=True)
    yt = layer(xt)
    _close(yt, y_exp)
    yt.backward(Tensor(gy))
    _close(xt.grad, dx_exp)
    intra_layer.sync_gradients(layer, groups=g)
    grads = full_state_dict(layer, grads=True)
    _close(grads["weight"], ref.weight.grad)
    if bias:
        _close(grads["bias"], ref.bias.grad)
    full = layer.state_dict(full=True)
    _close(full["weight"], ref.weight)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("expert", [False, True])
def test_skip_bias_add_returns_bias_with_right_gradient(expert, tp_groups):
    world = axonmpi.init()
    shape = (2, 2, 1) if world.world_size == 4 else (world.world_size, 1, 1)
    g = tp_groups(shape)
    axonmpi.random.manual_seed(2)
    ref = nn.Linear(6, 12, dtype="float64")
    layer = intra_layer.Linear(6, 12, skip_bias_add=True, expert_mode=expert, dtype="float64", groups=g)
    layer.load_state_dict(ref.state_dict())
    rng = np.random.default_rng(0)
    X = rng.standard_normal((world.world_size * 2, 6))
    GY = rng.standard_normal((world.world_size * 2, 12))
    ys = ref(Tensor(X))
    ys.backward(Tensor(GY))
    if expert:
        lo, li = 12 // shape[0], 6 // shape[1]
        r, c = layer.outer.rank, layer.inner.rank
        a, b = chunk_bounds(len(X), g.data.size * shape[2], g.data.rank * shape[2] + g.depth.rank)
        y, bb = layer(Tensor(np.ascontiguousarray(X[a:b, c * li:(c + 1) * li])))
        out = y + bb
        _close(out, ys.data[a:b, r * lo:(r + 1) * lo])
        out.backward(Tensor(np.ascontiguousarray(GY[a:b, r * lo:(r + 1) * lo])))
    else:
        a, b = chunk_bounds(len(X), world.world_size, world.rank)
        y, bb = layer(Tensor(X[a:b].copy()))
        out = y + bb
        _close(out, ys.data[a:b])
        out.backward(Tensor(GY[a:b].copy()))
    intra_layer.sync_gradients(layer, groups=g)
    _close(full_state_dict(layer, grads=True)["bias"], ref.bias.grad)


@pytest.mark.mpi(min_size=2)
def test_indivisible_sizes_raise_naming_size_and_group(tp_groups):
    world = axonmpi.init()
    g = tp_groups((world.world_size if world.world_size < 4 else 2, 1, 1))
    n = g.row.size
    with pytest.raises(ValueError, match=f"rank {world.rank}: out_features={n + 1} is not divisible by "
                                         f"the size {n} of the row_group group"):
        intra_layer.Linear(4, n + 1, groups=g)


@pytest.mark.mpi(min_size=1)
def test_no_grad_sync_and_clip_grad_norm(tp_groups):
    world = axonmpi.init()
    shape = (2, 1, 2) if world.world_size == 4 else (1, 1, world.world_size)
    g = tp_groups(shape)
    axonmpi.random.manual_seed(4)
    ref = nn.Linear(6, 8, dtype="float64")
    layer = intra_layer.Linear(6, 8, dtype="float64", groups=g)
    layer.load_state_dict(ref.state_dict())
    rng = np.random.default_rng(1)
    X = rng.standard_normal((world.world_size, 6))
    ys = ref(Tensor(X))
    (ys * ys).sum().backward()
    a, b = chunk_bounds(len(X), world.world_size, world.rank)
    yt = layer(Tensor(X[a:b].copy()))
    (yt * yt).sum().backward()
    before = [p.grad.data.copy() for p in layer.parameters()]
    with intra_layer.no_grad_sync():
        intra_layer.sync_gradients(layer, groups=g)
    for p, q in zip(layer.parameters(), before):
        np.testing.assert_array_equal(p.grad.data, q)
    intra_layer.sync_gradients(layer, groups=g)
    expect = np.sqrt(sum(float((p.grad.data ** 2).sum()) for p in ref.parameters()))
    expect_inf = max(float(np.abs(p.grad.data).max()) for p in ref.parameters())
    assert abs(intra_layer.clip_grad_norm_(layer.parameters(), 1e30, norm_type=math.inf) - expect_inf) <= 1e-12 * expect_inf
    total = intra_layer.clip_grad_norm_(layer.parameters(), 0.5 * expect)
    assert abs(total - expect) <= 1e-12 * expect
    axonmpi.optim.clip_grad_norm_(ref.parameters(), 0.5 * expect)
    grads = full_state_dict(layer, grads=True)
    _close(grads["weight"], ref.weight.grad)
    _close(grads["bias"], ref.bias.grad)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 1, 1), (1, 1, 2), (2, 1, 2), (4, 1, 1), (1, 1, 4), (3, 1, 1),
                                   (1, 1, 3)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("expert", [False, True])
def test_embedding_parity(shape, expert, tp_groups):
    if not _fits(shape):
        pytest.skip(f"grid {shape} does not fit")
    world = axonmpi.init()
    g = tp_groups(shape)
    V, D = 6 * shape[2], 4 * shape[0]
    axonmpi.random.manual_seed(8)
    ref = nn.Embedding(V, D, dtype="float64")
    emb = intra_layer.Embedding(V, D, expert_mode=expert, dtype="float64", groups=g)
    emb.load_state_dict(ref.state_dict())
    rng = np.random.default_rng(2)
    ids = rng.integers(0, V, (2 * world.world_size + 1, 3))
    GY = rng.standard_normal(ids.shape + (D,))
    hs = ref(ids)
    hs.backward(Tensor(GY))
    k = D // shape[0]
    r = g.row.rank
    if expert:
        a, b = chunk_bounds(len(ids), g.data.size * shape[2], g.data.rank * shape[2] + g.depth.rank)
        h = emb(ids[a:b])
        _close(h, hs.data[a:b, :, r * k:(r + 1) * k])
        h.backward(Tensor(np.ascontiguousarray(GY[a:b, :, r * k:(r + 1) * k])))
    else:
        a, b = chunk_bounds(len(ids), world.world_size, world.rank)
        h = emb(ids[a:b])
        _close(h, hs.data[a:b])
        h.backward(Tensor(GY[a:b].copy()))
    intra_layer.sync_gradients(emb, groups=g)
    _close(full_state_dict(emb, grads=True)["weight"], ref.weight.grad)
    _close(emb.state_dict(full=True)["weight"], ref.weight)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("shape", [(2, 2, 1), (2, 1, 2), (1, 2, 2)], ids=lambda s: "x".join(map(str, s)))
def test_communication_volume_matches_axonn_closed_forms(shape, monkeypatch, tp_groups):
    """Expert mode, one forward + backward: bytes per group equal AxoNN's model — column group:
    all-reduce of t*out/G_r; row group: all-reduce of t*in/G_c; depth: all-gather and reduce-scatter
    of in*out/(G_r*G_c) (sizes of the full buffers)."""
    import axonmpi.parallel.tensor.mappings as mp
    if axonmpi.init().world_size != 4:
        pytest.skip("the closed forms are checked on a 4-rank grid")
    g = tp_groups(shape)
    counts = {}

    def counted(fn, kind, out_sized):
        def wrapper(x, *a, **kw):
            group = kw.get("group")
            y = fn(x, *a, **kw)
            key = (group.name, kind)
            counts[key] = counts.get(key, 0) + (y.nbytes if out_sized else x.nbytes)
            return y
        return wrapper

    monkeypatch.setattr(mp, "all_reduce", counted(mp.all_reduce, "all_reduce", False))
    monkeypatch.setattr(mp, "all_gather", counted(mp.all_gather, "all_gather", True))
    monkeypatch.setattr(mp, "reduce_scatter", counted(mp.reduce_scatter, "reduce_scatter", False))
    G_r, G_c, G_d = shape
    IN, OUT, t = 8, 12, 5
    layer = intra_layer.Linear(IN, OUT, bias=False, expert_mode=True, dtype="float64", groups=g)
    x = Tensor(np.ones((t, IN // G_c)), requires_grad=True)
    layer(x).backward(Tensor(np.ones((t, OUT // G_r))))
    expect = {}
    if G_c > 1:
        expect[(g.col.name, "all_reduce")] = 8 * t * OUT // G_r
    if G_r > 1:
        expect[(g.row.name, "all_reduce")] = 8 * t * IN // G_c
    if G_d > 1:
        expect[(g.depth.name, "all_gather")] = 8 * IN * OUT // (G_r * G_c)
        expect[(g.depth.name, "reduce_scatter")] = 8 * IN * OUT // (G_r * G_c)
    assert counts == expect


@pytest.mark.mpi(min_size=1)
def test_cast_and_loud_input_errors(tp_groups):
    world = axonmpi.init()
    g = tp_groups((1, world.world_size, 1))
    layer = intra_layer.Linear(4 * world.world_size, 6, expert_mode=True, groups=g)
    assert layer.weight.dtype == np.float32
    layer.double()
    assert layer.weight.dtype == np.float64 and layer.bias.dtype == np.float64
    layer.to(dtype=np.float32)
    assert layer.weight.dtype == np.float32
    bad = 4 * world.world_size + 1
    with pytest.raises(ValueError, match=f"rank {world.rank}: input has {bad} features; expected 4 "):
        layer(Tensor(np.ones((2, bad), np.float32)))
    if world.world_size > 1:
        g = tp_groups((1, 1, world.world_size))
        with pytest.raises(ValueError, match=f"1x1 = 1 elements is not divisible by G_intra_d={world.world_size}"):
            intra_layer.Linear(1, 1, groups=g)


@pytest.mark.mpi(min_size=1)
def test_default_groups_are_the_world_grids_and_trivial_grid_is_serial():
    """With no groups, every TP layer uses the current grid: on ``axonmpi.init()``'s trivial grid each
    tensor-parallel group has one rank (a 1-D layer keeps the full weight), replicas span all ranks."""
    from axonmpi.parallel.tensor import ColumnParallelLinear, default_groups, one_d_group
    world = axonmpi.init()
    grid = axonmpi.get_grid()
    g = default_groups()
    assert (g.row, g.col, g.depth, g.intra, g.data) == (grid.row_group, grid.col_group, grid.depth_group,
                                                        grid.intra_group, grid.data_group)
    assert g.sizes == (1, 1, 1) and g.replica_size == world.world_size
    assert one_d_group(None) is grid.intra_group and one_d_group(None).size == 1
    fc = ColumnParallelLinear(3, 4, dtype="float64")
    assert fc.group is grid.intra_group and fc.weight.shape == (4, 3)


@pytest.mark.mpi(min_size=4)
def test_from_grid_follows_axonn_row_col_convention(tp_groups):
    """col varies fastest and splits in_features; row splits out_features (AxoNN's inner / outer)."""
    world = axonmpi.init()
    if world.world_size != 4:
        pytest.skip("checked on a 4-rank (2, 2, 1) grid")
    g = tp_groups((2, 2, 1))
    r = world.rank
    assert g.col.ranks == (r - r % 2, r - r % 2 + 1) and g.row.ranks == (r % 2, r % 2 + 2)
    layer = intra_layer.Linear(6, 8, groups=g)
    assert layer.inner is g.col and layer.outer is g.row
    assert (layer.local_in_features, layer.local_out_features) == (3, 4)


GRID_DEFAULTS = """
import numpy as np, axonmpi, axonmpi.nn as nn
from axonmpi import Tensor
from axonmpi.distributed import chunk_bounds
from axonmpi.parallel import auto_parallelize, intra_layer
from axonmpi.parallel.tensor import ColumnParallelLinear, RowParallelLinear, default_groups, full_state_dict
world = axonmpi.init(G_intra_c=2)
grid = axonmpi.get_grid()
g = default_groups()
assert (g.col, g.row, g.intra, g.data) == (grid.col_group, grid.row_group, grid.intra_group, grid.data_group)
assert g.sizes == (1, 2, 1) and g.col.size == 2
axonmpi.random.manual_seed(0)
ref = nn.Linear(5, 8, dtype="float64")
ref2 = nn.Linear(8, 3, dtype="float64")
fc = ColumnParallelLinear(5, 8, dtype="float64")                # no group: the grid's intra group
proj = RowParallelLinear(8, 3, dtype="float64")
assert fc.group is grid.intra_group and fc.weight.data.shape == (4, 5) and proj.weight.data.shape == (3, 4)
assert fc.weight.shape == (8, 5) and proj.weight.shape == (3, 8)      # the serial shapes
fc.load_state_dict(ref.state_dict()); proj.load_state_dict(ref2.state_dict())
X = np.random.default_rng(1).standard_normal((3, 5))
y = proj(fc(Tensor(X))).data
want = ref2(ref(Tensor(X))).data
assert np.abs(y - want).max() <= 1e-12 * np.abs(want).max(), (y, want)
with auto_parallelize():                                        # no groups: the grid's
    lin = nn.Linear(6, 4, dtype="float64")
assert isinstance(lin, intra_layer.Linear) and lin.inner is grid.col_group and lin.weight.data.shape == (12,) and lin.weight.shape == (4, 6)
ref3 = nn.Linear(6, 4, dtype="float64")
lin.load_state_dict(ref3.state_dict())
X = np.random.default_rng(2).standard_normal((5, 6))
xs = Tensor(X, requires_grad=True)
(ref3(xs) ** 2).sum().backward()
a, b = chunk_bounds(5, world.world_size, world.rank)
(lin(Tensor(X[a:b].copy())) ** 2).sum().backward()
intra_layer.sync_gradients(lin)                                 # no groups: the grid's
gw = full_state_dict(lin, grads=True)["weight"]
assert np.abs(gw - ref3.weight.grad.data).max() <= 1e-12 * np.abs(ref3.weight.grad.data).max()
print(f"rank {world.rank} ok: col group {g.col.ranks}")
"""


@pytest.mark.serial
def test_layers_without_groups_use_the_grid_of_axonmpi_init():
    """``axonmpi.init(G_intra_c=2)`` at 2 ranks: ColumnParallelLinear/RowParallelLinear with no group shard
    over 2 ranks and match serial; auto_parallelize and sync_gradients with no groups use the grid."""
    from axonmpi.testing import run_mpiexec
    r = run_mpiexec(["-c", GRID_DEFAULTS], n=2, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank 0 ok: col group (0, 1)" in r.stdout and "rank 1 ok: col group (0, 1)" in r.stdout


@pytest.mark.mpi(min_size=4)
def test_sync_gradients_with_a_pipeline_grid_reduces_replicas_within_the_stage(tp_groups):
    """G_inter = 2, G_intra_c = 2 at 4 ranks: a replicated parameter's gradient is summed over the
    data x intra ranks of this pipeline stage only (ranks {0, 1} and {2, 3}), a 3-D weight over data."""
    world = axonmpi.init()
    if world.world_size != 4:
        pytest.skip("checked on 4 ranks")
    grid = axonmpi.ProcessGrid(world, G_inter=2, G_intra_c=2)
    try:
        g = TensorParallelGroups.from_grid(grid)
        assert g.replica == (grid.data_group, grid.intra_group) and g.replica_size == 2
        model = nn.Sequential(nn.Linear(2, 3, dtype="float64"), intra_layer.Linear(4, 2, bias=False, groups=g))
        for p in model.parameters():
            p.grad = Tensor(np.full(p.data.shape, float(world.rank + 1), p.dtype))
        intra_layer.sync_gradients(model, mean=True, groups=g)
        stage = world.rank // 2                                  # inter coordinate: ranks {0,1} and {2,3}
        expect = (2 * stage + 1 + 2 * stage + 2) / 2
        np.testing.assert_array_equal(model[0].weight.grad.data, np.full((3, 2), expect))
        np.testing.assert_array_equal(model[1].weight.grad.data, np.full(4, (world.rank + 1) / 2))
    finally:
        grid.free()
