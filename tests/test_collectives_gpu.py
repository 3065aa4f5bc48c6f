"""Collectives on CuPy arrays (staged through the host unless AXONMPI_CUDA_AWARE_MPI=1); skipped without a GPU."""
import numpy as np
import pytest

import axonmpi
from axonmpi import backend
from axonmpi.distributed import chunk_bounds

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not backend.cupy_available(), reason="needs CuPy and a CUDA GPU")]


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
