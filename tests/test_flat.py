"""FlatParameter: views, shard/unshard/reshard round trips with uneven sizes, gradient reduce-scatter; Work.then."""
import gc
import weakref

import numpy as np
import pytest

import axonmpi
from axonmpi import Tensor
from axonmpi.distributed import Work
from axonmpi.nn import Parameter
from axonmpi.parallel import FlatLayout, FlatParameter

# total element counts 1, 5, 7, 13 with 0-d and 1-element parameters among them
SHAPES = {
    1: [()],
    5: [(1,), (2, 2)],
    7: [(), (2, 3)],
    13: [(3,), (1,), (3, 3)],
}
DTYPES = [np.float32, np.float64]


def _params(shapes, dtype):
    out, start = [], 0
    for s in shapes:
        n = int(np.prod(s, dtype=np.int64))
        out.append(Parameter(np.asarray(np.arange(start, start + n, dtype=dtype).reshape(s) + 0.5, dtype)))
        start += n
    return out


def _expected_chunk(n, k, i):
    """Closed form of the one uneven rule: the first n % k chunks are one larger."""
    q, r = divmod(n, k)
    start = i * q + min(i, r)
    return start, start + q + (1 if i < r else 0)


@pytest.mark.mpi(min_size=1)
def test_layout_views_and_pack():
    lay = FlatLayout([(2, 3), (), (1,)])
    assert lay.offsets == (0, 6, 7) and lay.numel == 8
    buf = np.zeros(8)
    lay.pack([np.ones((2, 3)), np.array(2.0), None], buf)
    np.testing.assert_array_equal(buf, [1, 1, 1, 1, 1, 1, 2, 0])
    w, s, b = lay.views(buf)
    assert w.shape == (2, 3) and s.shape == () and b.shape == (1,)
    w[0, 0] = 9
    assert buf[0] == 9
    segs = lay.segments(5, 8, ["w", "s", "b"])
    assert [(g.name, g.param_start, g.param_stop, g.offset) for g in segs] == [("w", 5, 6, 0), ("s", 0, 1, 1),
                                                                               ("b", 0, 1, 2)]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES)
def test_parameters_become_views_of_the_flat_buffer(dtype):
    ps = _params(SHAPES[13], dtype)
    before = [p.data.copy() for p in ps]
    flat = FlatParameter(ps, ["a", "b", "c"])
    assert flat.data.dtype == dtype and flat.data.shape == (13,)
    for p, v in zip(ps, before):
        np.testing.assert_array_equal(p.data, v)
        assert np.shares_memory(p.data, flat.data)
    ps[2].data[1, 1] = -7.0                      # writing a parameter writes the flat buffer
    assert flat.data[4 + 4] == -7.0
    flat.data[0] = 42.0                          # and the other way round
    assert ps[0].data[0] == 42.0


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", sorted(SHAPES))
def test_shard_unshard_round_trip(world, n, dtype):
    k, r = world.world_size, world.rank
    ps = _params(SHAPES[n], dtype)
    full = np.concatenate([p.data.reshape(-1) for p in ps])
    shapes = [p.data.shape for p in ps]
    flat = FlatParameter(ps).shard()
    lo, hi = _expected_chunk(n, k, r)
    assert flat.shard_range == (lo, hi)
    assert flat.padded_size == -(-n // k)
    np.testing.assert_array_equal(flat.data, full[lo:hi])
    assert flat.data.dtype == dtype
    assert flat.full is None and all(p.data.size == 0 for p in ps)
    # every rank's chunk, gathered by hand, is the whole buffer exactly once
    everyone = axonmpi.all_gather_object(flat.data.tolist())
    np.testing.assert_array_equal(np.concatenate([np.asarray(c, dtype) for c in everyone]), full)
    for _ in range(2):                           # unshard / reshard twice
        flat.unshard()
        assert flat.full.shape == (n,)
        for p, s, (o, c) in zip(ps, shapes, zip(flat.layout.offsets, flat.layout.numels)):
            assert p.data.shape == s and p.data.dtype == dtype
            np.testing.assert_array_equal(p.data.reshape(-1), full[o:o + c])
            assert np.shares_memory(p.data, flat.full)
        flat.reshard()
        assert all(p.data.size == 0 for p in ps)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("n", sorted(SHAPES))
def test_gather_host_gives_each_parameters_full_values(world, n):
    """gather_host of the shard (and of an array shaped like it) gives every parameter's serial values."""
    ps = _params(SHAPES[n], np.float64)
    want = [np.array(p.data, copy=True) for p in ps]
    flat = FlatParameter(ps).shard()
    for got, w in zip(flat.gather_host(flat.data), want):
        assert got.shape == w.shape and got.dtype == w.dtype
        np.testing.assert_array_equal(got, w)
    for got, w in zip(flat.gather_host(2.0 * flat.data), want):     # e.g. an optimizer moment of the shard
        np.testing.assert_array_equal(got, 2.0 * w)
    assert flat.full is None and all(p.data.size == 0 for p in ps)   # the parameters stay sharded


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshard_releases_the_full_buffer(world, dtype):
    ps = _params(SHAPES[13], dtype)
    flat = FlatParameter(ps).shard()
    flat.unshard()
    owner = flat.full.base if flat.full.base is not None else flat.full
    assert owner.nbytes == world.world_size * flat.padded_size * np.dtype(dtype).itemsize
    ref = weakref.ref(owner)
    del owner
    flat.reshard()
    gc.collect()
    assert ref() is None                          # nothing keeps the gathered buffer alive
    assert flat.full is None and sum(p.data.nbytes for p in ps) == 0
    assert flat._shard.nbytes == flat.padded_size * np.dtype(dtype).itemsize


@pytest.mark.mpi(min_size=1)
def test_async_unshard_binds_on_completion(world):
    ps = _params(SHAPES[7], np.float64)
    full = np.concatenate([p.data.reshape(-1) for p in ps])
    flat = FlatParameter(ps).shard()
    work = flat.unshard(async_op=True)
    assert isinstance(work, Work)
    assert flat.unshard(async_op=True) is work or work.is_completed()   # one gather in flight
    res = work.wait()
    np.testing.assert_array_equal(res, full)
    np.testing.assert_array_equal(ps[1].data.reshape(-1), full[1:])
    flat.reshard()
    w2 = flat.unshard(async_op=True)
    flat.reshard()                                # cancel: completes the request, binds nothing
    assert w2.is_completed() and all(p.data.size == 0 for p in ps)


@pytest.mark.mpi(min_size=1)
def test_unshard_in_compute_dtype_keeps_master_shard(world):
    ps = _params(SHAPES[5], np.float64)
    full = np.concatenate([p.data.reshape(-1) for p in ps])
    flat = FlatParameter(ps).shard()
    flat.unshard(dtype=np.float32)
    assert ps[1].data.dtype == np.float32 and flat.data.dtype == np.float64
    np.testing.assert_array_equal(ps[1].data.reshape(-1), full[1:].astype(np.float32))
    flat.unshard()                                # a different dtype regathers
    assert ps[1].data.dtype == np.float64


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_views(world, dtype):
    ps = _params(SHAPES[13], dtype)
    flat = FlatParameter(ps).shard()
    flat.unshard()
    ps[1].grad = Tensor(np.array([3.0], dtype))   # an existing gradient is copied in
    buf = flat.bind_grads()
    assert buf.dtype == dtype
    np.testing.assert_array_equal(buf[:13], [0, 0, 0, 3] + [0] * 9)
    for p in ps:
        assert np.shares_memory(p.grad.data, buf)
    ps[2].grad.data[0, 1] = 5.0                   # param.grad writes the flat buffer
    assert buf[4 + 1] == 5.0
    buf[0] = -1.0                                 # and vice versa
    assert ps[0].grad.data[0] == -1.0
    (Tensor(np.full(3, 2.0, dtype)) * ps[0]).sum().backward()   # backward accumulates in place
    np.testing.assert_array_equal(buf[:3], [1.0, 2.0, 2.0])
    assert flat.bind_grads() is buf               # idempotent while bound


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", sorted(SHAPES))
def test_reduce_grad_closed_form(world, n, dtype):
    k, r = world.world_size, world.rank
    ps = _params(SHAPES[n], dtype)
    flat = FlatParameter(ps).shard()
    flat.unshard()
    flat.bind_grads()[:n] = (r + 1) * np.arange(1, n + 1)      # rank r's gradient of element j: (r+1)(j+1)
    flat.reduce_grad()                                          # MEAN
    lo, hi = _expected_chunk(n, k, r)
    j = np.arange(lo + 1, hi + 1)
    np.testing.assert_allclose(flat.grad.data, j * (k + 1) / 2, rtol=1e-6)
    assert flat.grad.data.dtype == dtype and flat.grad.data.shape == (hi - lo,)
    assert flat.full_grad is None                               # full gradient freed; each p.grad views
    for i, p in enumerate(ps):                                  # its elements of the chunk's (use_orig_params)
        a, b = flat._piece_bounds(i)
        assert p.grad.data.shape == (b - a,) and (a == b or np.shares_memory(p.grad.data, flat.grad.data))
    for p in ps:                                                # a second backward accumulates
        p.grad = Tensor(np.ones(p.data.shape, dtype))
    work = flat.reduce_grad(axonmpi.ReduceOp.SUM, async_op=True, reduce_dtype=np.float64)
    assert work.wait() is flat.grad
    np.testing.assert_allclose(flat.grad.data, j * (k + 1) / 2 + k, rtol=1e-6)
    assert flat.grad.data.dtype == dtype


@pytest.mark.mpi(min_size=2)
def test_sharded_parameter_trains_like_the_full_one(world):
    """An optimizer on the shards (FSDP's use) gives the parameters the serial update."""
    k = world.world_size
    ps = _params(SHAPES[13], np.float64)
    ref = [p.data.copy() for p in ps]
    flat = FlatParameter(ps).shard()
    opt = axonmpi.optim.SGD([flat], lr=0.5)
    flat.unshard()
    for p in ps:
        p.grad = Tensor(np.full(p.data.shape, float(world.rank)))
    flat.reduce_grad()
    flat.reshard()
    opt.step()                                    # steps the shard only
    flat.unshard()
    for p, r0 in zip(ps, ref):
        np.testing.assert_allclose(p.data, r0 - 0.5 * (k - 1) / 2, rtol=1e-14)


@pytest.mark.mpi(min_size=1)
def test_flat_parameter_errors(world):
    with pytest.raises(TypeError, match="share one dtype.*'b' is float32"):
        FlatParameter([Parameter(np.zeros(2)), Parameter(np.zeros(2, np.float32))], ["a", "b"])
    p = Parameter(np.zeros(2))
    with pytest.raises(ValueError, match="'y' and 'x' are the same tensor"):
        FlatParameter([p, p], ["x", "y"])
    with pytest.raises(ValueError, match="at least one"):
        FlatParameter([])
    flat = FlatParameter([Parameter(np.zeros(3))])
    with pytest.raises(RuntimeError, match="needs shard"):
        flat.unshard()
    flat.shard()
    with pytest.raises(RuntimeError, match="already sharded"):
        flat.shard()


# -- Work.then --------------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
def test_work_then_runs_once_on_completion(world):
    k = world.world_size
    x = np.ones(4)
    calls = []

    def double(res):
        calls.append(1)
        return res * 2

    w = axonmpi.all_reduce(x, out=x, async_op=True).then(double)
    assert w.wait()[0] == 2 * k and w.wait()[0] == 2 * k and w.is_completed()
    assert len(calls) == 1
    done = Work(result=5).then(lambda v: v + 1)                   # already complete: runs at once
    assert done.is_completed() and done.wait() == 6
    chained = Work(result=1).then(lambda v: v + 1).then(lambda v: v * 10)
    assert chained.wait() == 20


@pytest.mark.mpi(min_size=1)
def test_work_then_error_is_raised_by_wait(world):
    def bad(_):
        raise ValueError("late")

    w = axonmpi.all_reduce(np.ones(2), async_op=True).then(bad)
    for _ in range(2):
        with pytest.raises(ValueError, match="late"):
            w.wait()
    with pytest.raises(TypeError, match="callable"):
        Work(result=1).then(3)


@pytest.mark.mpi(min_size=1)
def test_mixed_precision_round_trip_keeps_fp32_master(world):
    """Compute copy in float16, gradient reduced in float32 into the float32 master chunk."""
    k, r = world.world_size, world.rank
    ps = _params(SHAPES[13], np.float32)
    flat = FlatParameter(ps).shard().move_shard("cpu")
    flat.unshard(dtype=np.float16, device="cpu")
    assert all(p.data.dtype == np.float16 for p in ps)
    buf = flat.bind_grads()
    assert buf.dtype == np.float16
    buf[:13] = (r + 1) * np.arange(1, 14)
    flat.reduce_grad(reduce_dtype=np.float32)
    lo, hi = flat.shard_range
    assert flat.grad.data.dtype == np.float32
    np.testing.assert_allclose(flat.grad.data, np.arange(lo + 1, hi + 1) * (k + 1) / 2, rtol=1e-3)
