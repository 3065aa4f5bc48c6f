"""Collectives on CuPy arrays over MPI (staged through pinned host memory unless the MPI is CUDA-aware); skipped without a GPU."""
import numpy as np
import pytest

import axonmpi
from axonmpi import backend
from axonmpi.distributed import chunk_bounds

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not backend.cupy_available(), reason="needs CuPy and a CUDA GPU")]


@pytest.fixture
def world(world):
    """The session World with CuPy arrays over MPI (backend="mpi"): NCCL, the default where CuPy has
    it, is tested in test_gpu_nccl.py. Collective: every rank switches and restores together."""
    from axonmpi.distributed.backends import BackendKind
    from axonmpi.testing.fake_nccl import _reset_backends
    old = world.backend
    _reset_backends(world)
    world.backend = BackendKind.MPI
    try:
        yield world
    finally:
        _reset_backends(world)
        world.backend = old


@pytest.mark.mpi(min_size=1)
def test_cupy_collectives_closed_form(world):
    cp = backend.get_cupy()
    n, r = world.world_size, world.rank
    x = cp.full((5, 3), r + 1.0, dtype=cp.float32)
    s = axonmpi.all_reduce(x)
    assert backend.is_cupy_array(s)
    np.testing.assert_allclose(s.get(), n * (n + 1) / 2)
    axonmpi.all_reduce(x, "mean", out=x)
    np.testing.assert_allclose(x.get(), (n + 1) / 2)
    g = axonmpi.all_gather(cp.full(2, r, dtype=cp.int64))
    np.testing.assert_array_equal(g.get(), np.repeat(np.arange(n), 2))
    b = cp.full(4, float(r))
    axonmpi.broadcast(b, src=n - 1)
    np.testing.assert_array_equal(b.get(), float(n - 1))
    rs = axonmpi.reduce_scatter(cp.arange(7 * 2, dtype=cp.float64).reshape(7, 2))
    lo, hi = chunk_bounds(7, n, r)
    np.testing.assert_allclose(rs.get(), n * np.arange(14.0).reshape(7, 2)[lo:hi])


def _aware():
    from axonmpi.distributed.backends.mpi import cuda_aware_mpi
    return cuda_aware_mpi()


@pytest.mark.mpi(min_size=1)
def test_cupy_scatter_gather_all_to_all(world):
    """scatter hands a freshly concatenated device buffer to MPI: the stream must be synced first."""
    cp = backend.get_cupy()
    n, r = world.world_size, world.rank
    chunks = [cp.arange(k + 2, dtype=cp.float32) * (k + 1) for k in range(n)] if r == 0 else None
    got = axonmpi.scatter(chunks, src=0)
    assert backend.is_cupy_array(got)
    np.testing.assert_array_equal(got.get(), np.arange(r + 2, dtype=np.float32) * (r + 1))
    big = cp.arange(7 * 3, dtype=cp.float64).reshape(7, 3) if r == n - 1 else None
    lo, hi = chunk_bounds(7, n, r)
    np.testing.assert_array_equal(axonmpi.scatter(big, src=n - 1).get(), np.arange(21.0).reshape(7, 3)[lo:hi])
    pieces = axonmpi.gather(cp.full(r + 1, r, dtype=cp.int32), dst=0)
    if r == 0:
        assert [p.get().tolist() for p in pieces] == [[k] * (k + 1) for k in range(n)]
    out = axonmpi.all_to_all([cp.full(j + 1, 10 * r + j, dtype=cp.float16) for j in range(n)])
    assert [p.get().tolist() for p in out] == [[10.0 * j + r] * (r + 1) for j in range(n)]


@pytest.mark.mpi(min_size=1)
def test_cupy_point_to_point_into_non_contiguous_arrays(world):
    """irecv/recv into strided CuPy arrays (CuPy refuses x[...] = numpy_array), with the values
    written by kernels queued just before the call (the stream is synced before MPI reads)."""
    cp = backend.get_cupy()
    n, r = world.world_size, world.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    base = cp.zeros((4, 6), dtype=cp.float64)
    target = base[:, ::2]                                     # non-contiguous device target
    src = cp.arange(12, dtype=cp.float64).reshape(4, 3) * 0 + r   # produced by a kernel right now
    works = axonmpi.batch_isend_irecv([axonmpi.P2POp(axonmpi.isend, src, nxt),
                                       axonmpi.P2POp(axonmpi.irecv, target, prv)])
    assert works[1].wait() is target
    works[0].wait()
    np.testing.assert_array_equal(target.get(), float(prv))
    np.testing.assert_array_equal(base[:, 1::2].get(), 0)
    if n > 1:
        t2 = cp.zeros((3, 4), dtype=cp.int64).T               # non-contiguous
        w = axonmpi.irecv(t2, src=prv, tag=3)
        axonmpi.send(cp.arange(12, dtype=cp.int64).reshape(4, 3) + r, dst=nxt, tag=3)
        assert w.wait() is t2
        np.testing.assert_array_equal(t2.get(), np.arange(12).reshape(4, 3) + prv)
        c = cp.empty(5, dtype=cp.float32)
        req = axonmpi.isend(cp.full(5, r, dtype=cp.float32), dst=nxt, tag=4)
        assert axonmpi.recv(c, src=prv, tag=4) is c
        req.wait()
        np.testing.assert_array_equal(c.get(), float(prv))


@pytest.mark.mpi(min_size=2)
def test_async_op_on_cupy_without_cuda_aware_mpi_says_it_blocks(world, capfd, caplog):
    import logging
    from axonmpi.distributed import collectives

    cp = backend.get_cupy()
    collectives._note_blocking_async.cache_clear()
    with caplog.at_level(logging.INFO):
        work = axonmpi.all_reduce(cp.ones(3), async_op=True)
        np.testing.assert_array_equal(work.wait().get(), world.world_size)
    # the note is a log record (the handler may hold the stream it was given before capfd's)
    err = capfd.readouterr().err + caplog.text
    if world.rank == 0 and not _aware():
        assert "async_op=True on CuPy arrays completes before returning" in err
    else:
        assert "completes before returning" not in err
