"""Any array in the collectives: DLPack producers, the buffer protocol, PyTorch tensors, and the CUDA path.

Expected values in closed form from the ranks: rank r contributes r + 1, so a sum over n ranks is
n (n + 1) / 2. In-place calls must write the caller's memory (same data pointer) and return the
caller's own object; new results come back in the caller's type.
"""
import array

import numpy as np
import pytest

import axonmpi
from axonmpi import backend
from axonmpi.distributed import P2POp
from axonmpi.distributed.interop import is_foreign, to_array


class DLPackOnly:
    """A producer that exposes nothing but ``__dlpack__``/``__dlpack_device__`` over a NumPy array."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


class DLPackBuildable(DLPackOnly):
    """The same with a ``from_dlpack`` classmethod, so new results can be made of its type."""

    @classmethod
    def from_dlpack(cls, x):
        return cls(np.from_dlpack(x))


def _ptr(a):
    return a.__array_interface__["data"][0]


@pytest.mark.mpi(min_size=1)
def test_dlpack_only_object_in_place_and_new_results(world):
    n, r = world.world_size, world.rank
    base = np.full(4, r + 1.0)
    d = DLPackOnly(base)
    p0 = _ptr(base)
    assert axonmpi.all_reduce(d, out=d) is d                     # in place: the caller's object...
    assert _ptr(base) == p0 and d._a is base                      # ...and its memory
    np.testing.assert_array_equal(base, n * (n + 1) / 2)
    assert axonmpi.broadcast(DLPackOnly(base), src=0) is not None
    s = axonmpi.all_reduce(DLPackOnly(np.full(3, r + 1.0)))      # no way to build the type: NumPy
    assert type(s) is np.ndarray and (s == n * (n + 1) / 2).all()
    b = axonmpi.all_reduce(DLPackBuildable(np.full(3, r + 1.0)))
    assert type(b) is DLPackBuildable
    np.testing.assert_array_equal(b._a, n * (n + 1) / 2)
    g = axonmpi.all_gather(DLPackBuildable(np.full(2, float(r))))
    assert type(g) is DLPackBuildable
    np.testing.assert_array_equal(g._a, np.repeat(np.arange(n), 2))


@pytest.mark.mpi(min_size=1)
def test_buffer_protocol_objects(world):
    n, r = world.world_size, world.rank
    total = n * (n + 1) // 2
    ba = bytearray([r + 1] * 5)
    assert axonmpi.all_reduce(ba, out=ba) is ba and list(ba) == [total] * 5
    fresh = axonmpi.all_reduce(bytearray([r + 1] * 2))
    assert type(fresh) is bytearray and list(fresh) == [total] * 2
    aa = array.array("d", [r + 1.0] * 3)
    got = axonmpi.all_reduce(aa)
    assert type(got) is array.array and got.typecode == "d" and list(got) == [float(total)] * 3
    assert axonmpi.all_reduce(aa, "max", out=aa) is aa and list(aa) == [float(n)] * 3
    host = np.arange(6.0) * (r + 1)
    mv = memoryview(host)
    res = axonmpi.all_reduce(mv, out=mv)
    assert res is mv and _ptr(host) == _ptr(np.asarray(mv))
    np.testing.assert_array_equal(host, np.arange(6.0) * total)
    gathered = axonmpi.all_gather(array.array("q", [r, r]))
    assert type(gathered) is array.array and list(gathered) == [k for k in range(n) for _ in (0, 1)]
    chunk = axonmpi.reduce_scatter(array.array("d", [1.0] * (2 * n)))
    assert type(chunk) is array.array and list(chunk) == [float(n)] * 2
    b = bytearray(b"axonmpi" if r == 0 else bytes(7))
    assert axonmpi.broadcast(b, src=0) is b and bytes(b) == b"axonmpi"
    work = axonmpi.all_reduce(ba, out=ba, async_op=True)
    assert work.wait() is ba
    assert not is_foreign(np.ones(2)) and not is_foreign([1, 2]) and not is_foreign(3.0)
    assert is_foreign(ba) and is_foreign(mv) and is_foreign(DLPackOnly(host))


@pytest.mark.mpi(min_size=1)
def test_lists_gather_scatter_all_to_all(world):
    n, r = world.world_size, world.rank
    parts = axonmpi.gather(array.array("i", [r] * (r + 1)), dst=0)
    if r == 0:
        assert [type(p) for p in parts] == [array.array] * n
        assert [list(p) for p in parts] == [[k] * (k + 1) for k in range(n)]
    else:
        assert parts is None
    chunks = [bytearray([k + 1] * 2) for k in range(n)] if r == 0 else None
    mine = axonmpi.scatter(chunks, src=0)
    assert list(mine) == [r + 1] * 2
    assert type(mine) is (bytearray if r == 0 else np.ndarray)     # the type of what this rank passed
    pieces = axonmpi.all_to_all([array.array("d", [10.0 * r + j]) for j in range(n)])
    assert [type(p) for p in pieces] == [array.array] * n
    assert [p[0] for p in pieces] == [10.0 * j + r for j in range(n)]


@pytest.mark.mpi(min_size=1)
def test_point_to_point_into_foreign_buffers(world):
    n, r = world.world_size, world.rank
    got = bytearray(3)
    base = np.zeros(2)
    into = DLPackOnly(base)
    works = axonmpi.batch_isend_irecv([
        P2POp(axonmpi.irecv, got, (r - 1) % n), P2POp(axonmpi.isend, bytearray([r] * 3), (r + 1) % n),
        P2POp(axonmpi.irecv, into, (r + 1) % n, tag=1),
        P2POp(axonmpi.isend, array.array("d", [r, r]), (r - 1) % n, tag=1)])
    results = [w.wait() for w in works]
    assert results[0] is got and list(got) == [(r - 1) % n] * 3
    assert results[2] is into and (base == (r + 1) % n).all()
    if n > 1 and r < 2:
        other = 1 - r
        if r == 0:
            axonmpi.send(array.array("d", [1.5, 2.5]), other)
            buf = memoryview(np.zeros(2))
            assert axonmpi.irecv(buf, other).wait() is buf and buf.tolist() == [3.5, 4.5]
        else:
            buf = bytearray(16)
            assert axonmpi.recv(buf, other) is buf
            assert np.frombuffer(buf).tolist() == [1.5, 2.5]
            axonmpi.isend(DLPackOnly(np.array([3.5, 4.5])), other).wait()


@pytest.mark.mpi(min_size=1)
def test_torch_cpu_tensors_keep_their_storage(world):
    torch = pytest.importorskip("torch")
    n, r = world.world_size, world.rank
    t = torch.full((3, 2), r + 1.0, dtype=torch.float64)
    p0 = t.data_ptr()
    assert axonmpi.all_reduce(t, out=t) is t and t.data_ptr() == p0
    assert torch.equal(t, torch.full((3, 2), n * (n + 1) / 2, dtype=torch.float64))
    view = torch.zeros(4, 3, dtype=torch.float32)[:, 1]            # non-contiguous: filled through a copy
    if r == 0:
        view += 7
    assert axonmpi.broadcast(view, src=0) is view and torch.equal(view, torch.full((4,), 7.0))
    s = axonmpi.all_reduce(torch.ones(2, dtype=torch.int64))
    assert isinstance(s, torch.Tensor) and s.dtype == torch.int64 and s.tolist() == [n, n]
    g = axonmpi.all_gather(torch.full((1, 2), float(r)))
    assert isinstance(g, torch.Tensor) and g.shape == (n, 2) and g[:, 0].tolist() == list(map(float, range(n)))
    got = torch.empty(2)
    ptr = got.data_ptr()
    works = axonmpi.batch_isend_irecv([P2POp(axonmpi.irecv, got, (r - 1) % n),
                                       P2POp(axonmpi.isend, torch.full((2,), float(r)), (r + 1) % n)])
    assert works[0].wait() is got and got.data_ptr() == ptr and got.tolist() == [float((r - 1) % n)] * 2
    with pytest.raises((BufferError, RuntimeError), match="detach"):   # torch refuses to export autograd leaves
        axonmpi.all_reduce(torch.ones(2, requires_grad=True))


@pytest.mark.gpu
@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(not backend.cupy_available(), reason="needs CuPy and a CUDA GPU")
def test_cuda_arrays_through_dlpack_and_the_cuda_array_interface(world):
    """CUDA producers are viewed by CuPy without a copy: ``__cuda_array_interface__`` (CuPy's
    ``asarray``) and DLPack (``cupy.from_dlpack``); a torch CUDA tensor keeps its storage."""
    cp = backend.get_cupy()
    n, r = world.world_size, world.rank

    class CAIOnly:
        def __init__(self, a):
            self._a = a
            self.__cuda_array_interface__ = a.__cuda_array_interface__

    dev = cp.full(5, r + 1.0)
    wrapped = CAIOnly(dev)
    assert backend.is_cupy_array(to_array(wrapped))
    assert axonmpi.all_reduce(wrapped, out=wrapped) is wrapped
    np.testing.assert_array_equal(dev.get(), n * (n + 1) / 2)
    dl = DLPackOnly(cp.full(3, float(r)))
    assert axonmpi.all_reduce(dl, out=dl) is dl
    np.testing.assert_array_equal(dl._a.get(), n * (n - 1) / 2)
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        t = torch.full((4,), r + 1.0, device="cuda")
        p0 = t.data_ptr()
        assert axonmpi.all_reduce(t, out=t) is t and t.data_ptr() == p0
        assert t.cpu().tolist() == [n * (n + 1) / 2] * 4
        g = axonmpi.all_gather(t)
        assert isinstance(g, torch.Tensor) and g.is_cuda and g.numel() == 4 * n
