"""CPU-side checks of what the first GPU run (an H200, docs/gpu.md) fixed, where they can be seen without a GPU."""
import numpy as np
import pytest

from axonmpi import backend
from axonmpi.distributed.array_collectives import _same_memory


def test_backend_matmul_is_numpy_matmul_on_the_host():
    """``backend.matmul`` (every autograd product goes through it) is ``@`` on NumPy, batched, broadcast and on
    transposed views; its cuBLAS route is only for CuPy bf16/fp16 batches."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 4, 5)), rng.standard_normal((3, 5, 2))
    np.testing.assert_array_equal(backend.matmul(a, b), a @ b)
    np.testing.assert_array_equal(backend.matmul(a, b[0]), a @ b[0])
    at = rng.standard_normal((3, 5, 4)).swapaxes(-1, -2)
    np.testing.assert_array_equal(backend.matmul(at, b), at @ b)
    ml = pytest.importorskip("ml_dtypes")
    h, hb = a.astype(ml.bfloat16), b.astype(ml.bfloat16)
    got, want = backend.matmul(h, hb), h @ hb                            # NumPy's own bf16 product, unchanged
    assert got.dtype == want.dtype and np.array_equal(got, want)


def test_same_memory_is_a_pointer_comparison():
    """A collective skips its copy into ``out`` only when the result is ``out`` itself (same start, shape and
    strides): not a view of another part, not a same-size neighbour."""
    x = np.arange(12.0)
    assert _same_memory(x, x) and _same_memory(x[:], x)
    assert not _same_memory(x[:6], x) and not _same_memory(x[6:], x[:6])
    assert not _same_memory(x.reshape(3, 4), x) and not _same_memory(x[::2], x[:6])
    assert not _same_memory(np.arange(12.0), x)
