"""Collectives against closed-form values derived from the ranks, on several groups and dtypes."""
import numpy as np
import pytest

import axonmpi
from axonmpi import ReduceOp
from axonmpi.distributed import chunk_bounds, chunk_sizes

DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64, np.uint8, np.complex128]
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 3, 4)]


@pytest.fixture(autouse=True, params=["native-half", "no-half"])
def half_mode(request, monkeypatch):
    """Run the whole suite twice: with the MPI library's float16 type, and with the fallback
    for libraries that have none forced (float16 moved as 16-bit words, reduced in float32)."""
    if request.param == "no-half":
        monkeypatch.setenv("AXONMPI_MPI_FLOAT16", "0")
    else:
        monkeypatch.delenv("AXONMPI_MPI_FLOAT16", raising=False)
    return request.param


def _groups(world):
    """The World's default group, an even/odd split and a reversed new_group of all ranks."""
    n = world.world_size
    split = world.split(world.rank % 2)
    rev = world.new_group(list(range(n))[::-1], name="reversed")
    return [("world", world.default_group), ("split", split), ("reversed", rev)]


def _val(rank, shape, dtype):
    """Deterministic per-rank data: rank + 1 + position (small, exact in float16 sums)."""
    n = int(np.prod(shape)) if shape else 1
    base = (np.arange(n) % 5 + rank + 1).reshape(shape)
    return base.astype(dtype)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_all_reduce_sum_closed_form(world, dtype, shape):
    for _, g in _groups(world):
        x = _val(g.rank, shape, dtype)
        got = axonmpi.all_reduce(x, group=g)
        # sum over r of (pos + r + 1) = size*pos + size*(size+1)/2
        n = int(np.prod(shape)) if shape else 1
        pos = (np.arange(n) % 5).reshape(shape)
        want = (g.size * pos + g.size * (g.size + 1) // 2).astype(dtype)
        assert got.shape == x.shape and got.dtype == x.dtype
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(x, _val(g.rank, shape, dtype))  # input untouched


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op,expect", [
    (ReduceOp.MIN, lambda s: 1), (ReduceOp.MAX, lambda s: s),
    (ReduceOp.PRODUCT, lambda s: float(np.prod(np.arange(1, s + 1)))),
    (ReduceOp.MEAN, lambda s: (s + 1) / 2), ("avg", lambda s: (s + 1) / 2), ("sum", lambda s: s * (s + 1) / 2),
])
def test_all_reduce_ops(world, op, expect):
    for _, g in _groups(world):
        x = np.full((3, 2), g.rank + 1, np.float64)
        np.testing.assert_allclose(axonmpi.all_reduce(x, op, group=g), np.full((3, 2), expect(g.size)), rtol=1e-12)


@pytest.mark.mpi(min_size=1)
def test_all_reduce_convenience_and_ints(world):
    r, n = world.rank, world.world_size
    assert axonmpi.all_reduce_sum(np.array(r)).item() == n * (n - 1) // 2
    assert axonmpi.all_reduce_max(np.array([r], np.int64))[0] == n - 1
    assert axonmpi.all_reduce_min(np.array([r], np.int32))[0] == 0
    assert axonmpi.all_reduce_mean(np.array(float(r))) == pytest.approx((n - 1) / 2)
    assert axonmpi.all_reduce_product(np.array([2], np.int64))[0] == 2 ** n
    b = axonmpi.all_reduce(np.array([r == 0, True]), ReduceOp.SUM)  # bool: logical or
    assert b.tolist() == [True, True]
    b = axonmpi.all_reduce(np.array([r == 0, True]), ReduceOp.MIN)  # bool: logical and
    assert b.tolist() == [n == 1, True]
    assert axonmpi.all_reduce(np.array([1 << r], np.int64), ReduceOp.BOR)[0] == (1 << n) - 1


@pytest.mark.mpi(min_size=1)
def test_all_reduce_in_place_out_and_noncontiguous(world):
    n = world.world_size
    x = np.arange(12.0).reshape(3, 4) + world.rank
    res = axonmpi.all_reduce(x, out=x)
    want = n * np.arange(12.0).reshape(3, 4) + n * (n - 1) / 2
    assert res is x
    np.testing.assert_array_equal(x, want)
    base = np.zeros((4, 6))
    view = base[:, ::2]                        # non-contiguous input and in-place target
    view[...] = world.rank + 1
    axonmpi.all_reduce(view, out=view)
    np.testing.assert_array_equal(base[:, ::2], n * (n + 1) / 2)
    np.testing.assert_array_equal(base[:, 1::2], 0)   # untouched between the strided columns
    out = np.empty((3, 4))
    res = axonmpi.all_reduce(np.ones((3, 4)), out=out)
    assert res is out and np.all(out == n)
    with pytest.raises(ValueError, match="shape"):
        axonmpi.all_reduce(np.ones(3), out=np.empty(4))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN])
def test_async_all_reduce(world, op):
    n = world.world_size
    x = np.full(1000, world.rank + 1.0)
    work = axonmpi.all_reduce(x, op, async_op=True, out=x)
    got = work.wait()
    want = n * (n + 1) / 2 / (n if op is ReduceOp.MEAN else 1)
    assert work.is_completed() and got is x
    np.testing.assert_allclose(x, want)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.float16, np.bool_])
def test_broadcast_every_src(world, dtype):
    for _, g in _groups(world):
        for src in range(g.size):
            x = np.full((2, 3), g.rank * 10 + 1).astype(dtype)
            res = axonmpi.broadcast(x, src=src, group=g)
            assert res is x
            np.testing.assert_array_equal(x, np.full((2, 3), src * 10 + 1).astype(dtype))
    y = np.zeros((3, 4))
    v = y.T                                     # non-contiguous, filled in place
    if world.rank == 0:
        v[...] = np.arange(12.0).reshape(4, 3)
    axonmpi.broadcast(v, src=0)
    np.testing.assert_array_equal(y.T, np.arange(12.0).reshape(4, 3))
    assert axonmpi.broadcast_object({"a": world.rank}, src=0) == {"a": 0}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_all_gather_even(world, axis):
    for _, g in _groups(world):
        x = np.full((2, 3), float(g.rank))
        got = axonmpi.all_gather(x, axis=axis, group=g)
        want = np.concatenate([np.full((2, 3), float(r)) for r in range(g.size)], axis=axis)
        np.testing.assert_array_equal(got, want)
        assert got.flags.c_contiguous
    got = axonmpi.all_gather(np.array(world.rank))  # 0-d → (size,)
    np.testing.assert_array_equal(got, np.arange(world.world_size))
    work = axonmpi.all_gather(np.full(2, world.rank), async_op=True)
    np.testing.assert_array_equal(work.wait(), np.repeat(np.arange(world.world_size), 2))


@pytest.mark.mpi(min_size=1)
def test_all_gather_uneven(world):
    for _, g in _groups(world):
        x = np.full((g.rank + 1, 2), g.rank, np.int32)   # rank r holds r+1 rows
        got = axonmpi.all_gather(x, group=g, uneven=True)
        want = np.concatenate([np.full((r + 1, 2), r, np.int32) for r in range(g.size)])
        np.testing.assert_array_equal(got, want)
        y = np.full((3, g.rank), g.rank, np.float64)     # uneven along axis 1, rank 0 empty
        got = axonmpi.all_gather(y, axis=1, group=g, uneven=True)
        np.testing.assert_array_equal(got, np.concatenate([np.full((3, r), r, np.float64) for r in range(g.size)], 1))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("rows", [1, 4, 5, 7, 12])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN])
def test_reduce_scatter_uneven_rows(world, rows, op):
    for _, g in _groups(world):
        x = np.arange(rows * 3, dtype=np.float64).reshape(rows, 3) * (g.rank + 1)
        got = axonmpi.reduce_scatter(x, op, group=g)
        lo, hi = chunk_bounds(rows, g.size, g.rank)
        factor = g.size * (g.size + 1) / 2 / (g.size if op is ReduceOp.MEAN else 1)
        want = np.arange(rows * 3, dtype=np.float64).reshape(rows, 3)[lo:hi] * factor
        assert got.shape == (chunk_sizes(rows, g.size)[g.rank], 3)
        np.testing.assert_allclose(got, want, rtol=1e-12)
    work = axonmpi.reduce_scatter_sum(np.ones(2 * world.world_size), async_op=True)
    np.testing.assert_array_equal(work.wait(), np.full(2, world.world_size))
    out = np.empty(chunk_sizes(5, world.world_size)[world.rank])
    assert axonmpi.reduce_scatter_mean(np.ones(5), out=out) is out and np.all(out == 1)


@pytest.mark.mpi(min_size=1)
def test_gather_scatter(world):
    n, r = world.world_size, world.rank
    for dst in range(n):
        got = axonmpi.gather(np.arange(r, dtype=np.int64), dst=dst)   # uneven, rank 0 empty
        if r == dst:
            assert [a.tolist() for a in got] == [list(range(k)) for k in range(n)]
        else:
            assert got is None
    data = np.arange(10 * 2).reshape(10, 2) if r == 0 else None
    lo, hi = chunk_bounds(10, n, r)
    np.testing.assert_array_equal(axonmpi.scatter(data, src=0), np.arange(20).reshape(10, 2)[lo:hi])
    src = n - 1
    chunks = [np.full(k + 1, k, np.float32) for k in range(n)] if r == src else None
    np.testing.assert_array_equal(axonmpi.scatter(chunks, src=src), np.full(r + 1, r, np.float32))
    assert axonmpi.gather_object(("x", r), dst=0) == ([("x", k) for k in range(n)] if r == 0 else None)
    assert axonmpi.all_gather_object(r * 2) == [2 * k for k in range(n)]


@pytest.mark.mpi(min_size=1)
def test_reduce_to_dst(world):
    n, r = world.world_size, world.rank
    for dst in range(n):
        got = axonmpi.reduce(np.full(3, r + 1.0), dst=dst)
        if r == dst:
            np.testing.assert_array_equal(got, np.full(3, n * (n + 1) / 2))
        else:
            assert got is None


@pytest.mark.mpi(min_size=1)
def test_all_to_all(world):
    n, r = world.world_size, world.rank
    x = np.array([[r * 100 + j] * 2 for j in range(n)], np.int64)   # block j goes to rank j
    got = axonmpi.all_to_all(x)
    np.testing.assert_array_equal(got, np.array([[j * 100 + r] * 2 for j in range(n)]))
    pieces = [np.full(j + r, r, np.float64) for j in range(n)]      # sizes differ per pair
    got = axonmpi.all_to_all(pieces)
    assert [p.tolist() for p in got] == [[float(j)] * (r + j) for j in range(n)]
    if n > 1:
        with pytest.raises(ValueError, match="divisible"):
            axonmpi.all_to_all(np.ones(n + 1))


@pytest.mark.mpi(min_size=2)
def test_send_recv_ring(world):
    n, r = world.world_size, world.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    buf = np.empty(5)
    w_recv = axonmpi.irecv(buf, src=prv, tag=7)
    w_send = axonmpi.isend(np.full(5, float(r)), dst=nxt, tag=7)
    assert w_recv.wait() is buf
    w_send.wait()
    np.testing.assert_array_equal(buf, float(prv))
    if r % 2 == 0 and r + 1 < n:
        axonmpi.send(np.arange(4, dtype=np.int32), dst=r + 1)
    elif r % 2 == 1:
        got = axonmpi.recv(np.empty((2, 2), np.int32), src=r - 1)
        np.testing.assert_array_equal(got, np.arange(4).reshape(2, 2))


@pytest.mark.mpi(min_size=1)
def test_bad_arguments_are_loud(world):
    n = world.world_size
    with pytest.raises(ValueError, match=rf"src={n}.*size {n}"):
        axonmpi.broadcast(np.ones(2), src=n)
    with pytest.raises(TypeError, match="MEAN needs a floating dtype"):
        axonmpi.all_reduce(np.ones(2, np.int64), "mean")
    with pytest.raises(TypeError, match="BAND needs an integer"):
        axonmpi.all_reduce(np.ones(2), ReduceOp.BAND)
    with pytest.raises(ValueError, match="unknown reduce op"):
        axonmpi.all_reduce(np.ones(2), "median")
    with pytest.raises(TypeError, match="ProcessGroup"):
        axonmpi.all_reduce(np.ones(2), group="world")
    with pytest.raises(ValueError, match="0-d"):
        axonmpi.reduce_scatter(np.array(1.0))
    with pytest.raises(ValueError, match="this rank itself"):
        axonmpi.send(np.ones(1), dst=world.rank)


@pytest.mark.mpi(min_size=1)
def test_chunk_rule():
    assert chunk_sizes(10, 4) == [3, 3, 2, 2]
    assert chunk_sizes(2, 3) == [1, 1, 0]
    for n in range(0, 13):
        for p in range(1, 5):
            sizes = chunk_sizes(n, p)
            assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
            assert [chunk_bounds(n, p, i) for i in range(p)] == [
                (sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(p)]


@pytest.mark.mpi(min_size=1)
def test_half_mode_switch_takes_the_fallback(half_mode):
    from axonmpi.distributed.backends.mpi import _wire, mpi_has_float16

    x = np.ones(3, np.float16)
    if half_mode == "no-half":
        assert not mpi_has_float16() and _wire(x).dtype == np.uint16
    elif mpi_has_float16():
        assert _wire(x) is x


@pytest.mark.mpi(min_size=1)
def test_float16_moves_whole_elements(world):
    """Issue 16: without a half type, counts were elements but buffers bytes ([1,2,96,0,0])."""
    n, r = world.world_size, world.rank
    x = np.full(r + 2, r + 1, np.float16)                     # rank 0 [1,1], rank 1 [2,2,2], ...
    want = np.concatenate([np.full(k + 2, k + 1, np.float16) for k in range(n)])
    got = axonmpi.all_gather(x, uneven=True)
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, want)
    for dst in range(n):
        got = axonmpi.gather(x, dst=dst)
        if r == dst:
            assert [a.tolist() for a in got] == [[k + 1.0] * (k + 2) for k in range(n)]
    chunks = [np.full(k + 1, 0.5 * k, np.float16) for k in range(n)] if r == 0 else None
    np.testing.assert_array_equal(axonmpi.scatter(chunks, src=0), np.full(r + 1, 0.5 * r, np.float16))
    data = np.arange(7 * 2, dtype=np.float16).reshape(7, 2) if r == n - 1 else None
    lo, hi = chunk_bounds(7, n, r)
    np.testing.assert_array_equal(axonmpi.scatter(data, src=n - 1), np.arange(14, dtype=np.float16).reshape(7, 2)[lo:hi])
    pieces = [np.full(j + r + 1, 10 * r + j, np.float16) for j in range(n)]
    assert [p.tolist() for p in axonmpi.all_to_all(pieces)] == [[10.0 * j + r] * (r + j + 1) for j in range(n)]
    blocks = np.array([[r * 10 + j] * 3 for j in range(n)], np.float16)
    np.testing.assert_array_equal(axonmpi.all_to_all(blocks), np.array([[j * 10 + r] * 3 for j in range(n)], np.float16))


@pytest.mark.mpi(min_size=1)
def test_float16_reductions(world):
    """float16 reductions are exact on small integers, natively or in float32 and cast back."""
    n = world.world_size
    x = np.full(6, world.rank + 1, np.float16)
    got = axonmpi.all_reduce(x)
    assert got.dtype == np.float16 and np.all(got == n * (n + 1) / 2)
    axonmpi.all_reduce(x, "max", out=x)
    assert x.dtype == np.float16 and np.all(x == n)
    y = np.full(5, world.rank + 1, np.float16)
    assert axonmpi.all_reduce(y, "mean", async_op=True, out=y).wait() is y and np.all(y == (n + 1) / 2)
    out = np.empty(chunk_sizes(7, n)[world.rank], np.float16)
    work = axonmpi.reduce_scatter(np.ones(7, np.float16), out=out, async_op=True)
    assert work.wait() is out and np.all(out == n)
    got = axonmpi.reduce_scatter_mean(np.full(7, world.rank + 1, np.float16))
    assert got.shape == out.shape and np.all(got == (n + 1) / 2)
    for dst in range(n):
        got = axonmpi.reduce(np.full(3, 2.0, np.float16), dst=dst)
        assert (got is None) == (world.rank != dst)
        if got is not None:
            assert got.dtype == np.float16 and np.all(got == 2 * n)
    b = np.full(3, world.rank, np.float16)
    axonmpi.broadcast(b, src=n - 1)
    assert np.all(b == n - 1)


@pytest.mark.mpi(min_size=1)
def test_float16_mean_reduces_in_float32(world):
    """Issue 21: MEAN was SUM/size in float16, so the mean of 65504 and 65504 was inf."""
    n, big = world.world_size, np.float16(65504.0)
    x = np.full(3, big, np.float16)
    assert axonmpi.all_reduce(x, "mean").tolist() == [65504.0] * 3
    assert axonmpi.all_reduce(x, "mean", async_op=True).wait().tolist() == [65504.0] * 3
    got = axonmpi.reduce_scatter_mean(np.full(2 * n, big, np.float16))
    assert got.dtype == np.float16 and got.tolist() == [65504.0] * 2
    got = axonmpi.reduce(x, dst=0, op="mean")
    if world.rank == 0:
        assert got.tolist() == [65504.0] * 3
    if n > 1:  # a true float16 SUM still overflows, as it does in torch
        with np.errstate(over="ignore"):
            assert np.isinf(axonmpi.all_reduce(x)).all()


@pytest.mark.mpi(min_size=1)
def test_bfloat16_every_collective(world):
    """bfloat16 (ml_dtypes) moves as 16-bit words and reduces in float32, in every collective."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf = np.dtype(ml_dtypes.bfloat16)
    n, r = world.world_size, world.rank
    x = np.array([1.5, -2.0, 256.0], bf) * bf.type(r + 1)
    tri = n * (n + 1) / 2
    got = axonmpi.all_reduce(x)
    assert got.dtype == bf and got.astype(np.float64).tolist() == [1.5 * tri, -2.0 * tri, 256.0 * tri]
    assert axonmpi.all_reduce(x, "max").astype(float).tolist() == [1.5 * n, -2.0, 256.0 * n]
    mean = axonmpi.all_reduce(np.full(2, r + 1, bf), "mean")  # (n+1)/2, reduced in float32
    assert mean.dtype == bf and mean.astype(float).tolist() == [(n + 1) / 2] * 2
    y = x.copy()
    assert axonmpi.all_reduce(y, async_op=True, out=y).wait() is y and y.astype(float)[0] == 1.5 * tri
    rs = axonmpi.reduce_scatter(np.full(2 * n, r + 1, bf))
    assert rs.dtype == bf and rs.astype(float).tolist() == [tri, tri]
    red = axonmpi.reduce(x, dst=n - 1)
    assert (red is None) == (r != n - 1)
    g = axonmpi.all_gather(x)
    assert g.dtype == bf and g.astype(float).tolist() == [v * (k + 1) for k in range(n) for v in (1.5, -2.0, 256.0)]
    u = axonmpi.all_gather(np.full(r + 1, r, bf), uneven=True)
    assert u.astype(float).tolist() == [float(k) for k in range(n) for _ in range(k + 1)]
    b = x.copy()
    axonmpi.broadcast(b, src=0)
    assert b.astype(float).tolist() == [1.5, -2.0, 256.0]
    ga = axonmpi.gather(x, dst=0)
    if r == 0:
        assert [a.astype(float)[0] for a in ga] == [1.5 * (k + 1) for k in range(n)]
    chunks = [np.full(k + 1, k + 0.5, bf) for k in range(n)] if r == 0 else None
    assert axonmpi.scatter(chunks, src=0).astype(float).tolist() == [r + 0.5] * (r + 1)
    pieces = [np.full(2, 10 * r + j, bf) for j in range(n)]
    assert [p.astype(float).tolist() for p in axonmpi.all_to_all(pieces)] == [[10.0 * j + r] * 2 for j in range(n)]
    if n > 1:
        if r == 0:
            axonmpi.send(np.array([0.25, 3.0], bf), dst=1)
        elif r == 1:
            buf = np.zeros(2, bf)
            axonmpi.recv(buf, src=0)
            assert buf.astype(float).tolist() == [0.25, 3.0]
