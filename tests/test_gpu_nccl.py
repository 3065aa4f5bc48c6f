"""GPU: every collective on CuPy arrays over NCCL vs closed form, no host round trip, autograd and DDP on CuPy.

Run with ``make test-gpu`` (1..number-of-GPUs ranks); skipped cleanly without CuPy, a GPU or NCCL.
"""
import sys
import types

import numpy as np
import pytest

import axonmpi
from axonmpi import backend
from axonmpi.distributed import chunk_sizes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not backend.cupy_available(), reason="needs CuPy and a CUDA GPU")]


def _nccl_or_skip():
    from axonmpi.distributed.backends import nccl_available
    if not nccl_available():
        pytest.skip("CuPy has no NCCL here (pip install 'axonmpi[cuda12]')")


@pytest.fixture
def gworld(world):
    _nccl_or_skip()
    from axonmpi.distributed.backends import BackendKind
    if world.backend is BackendKind.MPI:
        why = (f"ranks {world.gpu_sharers} share a GPU (NCCL needs one GPU per rank)" if world.gpu_sharers
               else "the session World was made with backend='mpi'")
        pytest.skip(f"CuPy arrays go over MPI: {why}")
    return world


def _nccl_backend(g):
    from axonmpi.distributed.backends import NcclBackend
    be = g._backends.get("device")
    assert isinstance(be, NcclBackend), f"CuPy arrays on {g.name} went to {type(be).__name__}, not NCCL"
    return be


def _groups(world):
    n = world.world_size
    return [world.default_group, world.split(world.rank % 2, name="parity"),
            world.new_group(list(range(n))[::-1], name="reversed")]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "int32", "complex128"])
def test_every_collective_on_cupy_closed_form(gworld, dtype):
    cp = backend.get_cupy()
    for g in _groups(gworld):
        p, r = g.size, g.rank
        tol = 1e-2 if dtype == "float16" else 1e-6
        x = cp.arange(7, dtype=dtype) + r + 1
        s = axonmpi.all_reduce(x, group=g)
        assert backend.is_cupy_array(s)
        want = sum(np.arange(7.0) + k + 1 for k in range(p))
        np.testing.assert_allclose(s.get(), want, rtol=tol)
        if dtype != "complex128":
            np.testing.assert_allclose(axonmpi.all_reduce(x, "max", group=g).get(), np.arange(7.0) + p, rtol=tol)
            np.testing.assert_allclose(axonmpi.all_reduce(x, "min", group=g).get(), np.arange(7.0) + 1, rtol=tol)
        if dtype in ("float64", "float32", "complex128"):
            np.testing.assert_allclose(axonmpi.all_reduce(x, "mean", group=g).get(), want / p, rtol=tol)
            w = axonmpi.all_reduce(x, "mean", group=g, async_op=True)
            np.testing.assert_allclose(w.wait().get(), want / p, rtol=tol)
        for root in range(p):
            b = cp.full(5, r, dtype=dtype)
            axonmpi.broadcast(b, src=root, group=g)
            np.testing.assert_array_equal(b.get(), np.full(5, root, dtype=dtype))
            red = axonmpi.reduce(x, dst=root, group=g)
            if r == root:
                np.testing.assert_allclose(red.get(), want, rtol=tol)
            got = axonmpi.gather(cp.full(r + 1, r, dtype=dtype), dst=root, group=g)
            if r == root:
                for k in range(p):
                    np.testing.assert_array_equal(got[k].get(), np.full(k + 1, k, dtype=dtype))
        uneven = axonmpi.all_gather(cp.full((r + 1, 2), r, dtype=dtype), group=g, uneven=True)
        np.testing.assert_array_equal(uneven.get(), np.concatenate([np.full((k + 1, 2), k, dtype=dtype)
                                                                    for k in range(p)]))
        rs = axonmpi.reduce_scatter(cp.arange(14, dtype=dtype).reshape(7, 2) * (r + 1), group=g)
        lo = sum(chunk_sizes(7, p)[:r])
        tot = np.arange(14.0).reshape(7, 2) * sum(k + 1 for k in range(p))
        np.testing.assert_allclose(rs.get(), tot[lo:lo + chunk_sizes(7, p)[r]], rtol=tol)
        pieces = [cp.full((j + r + 1,), 10 * r + j, dtype=dtype) for j in range(p)]
        got = axonmpi.all_to_all(pieces, group=g)
        for j in range(p):
            np.testing.assert_array_equal(got[j].get(), np.full(r + j + 1, 10 * j + r, dtype=dtype))
        nxt, prv = (r + 1) % p, (r - 1) % p
        recv = cp.empty(1000, dtype=dtype)
        ops = [axonmpi.P2POp(axonmpi.isend, cp.full(1000, r, dtype=dtype), nxt, group=g),
               axonmpi.P2POp(axonmpi.irecv, recv, prv, group=g)]
        for w in axonmpi.batch_isend_irecv(ops):
            w.wait()
        np.testing.assert_array_equal(recv.get(), np.full(1000, prv, dtype=dtype))
        if p > 1:
            _nccl_backend(g)


_TO_HOST = {"get", "item", "tolist", "asnumpy", "__array__", "memcpy", "memcpyAsync", "empty_pinned",
            "to_host", "to_host_pinned"}


class _HostTransfers:
    """Every device-to-host call made from Python while active: ``ndarray.get/item/tolist``,
    ``cupy.asnumpy``, runtime ``memcpy*``, pinned buffers and axonmpi's own staging helpers
    (seen with :func:`sys.setprofile`, which reports calls into C/Cython methods too)."""

    def __init__(self):
        self.calls = []
        self.ndarray = backend.get_cupy().ndarray

    def _hook(self, frame, event, arg):
        if event == "c_call":
            name = getattr(arg, "__name__", "")
            if name in _TO_HOST:
                owner = getattr(arg, "__self__", None)   # the array of a method, the module of a function
                if isinstance(owner, self.ndarray) or (isinstance(owner, types.ModuleType)
                                                       and owner.__name__.startswith(("cupy", "cupyx"))):
                    self.calls.append(f"{type(owner).__name__}.{name}")
        elif event == "call":
            code = frame.f_code
            if code.co_name in _TO_HOST and ("cupy" in code.co_filename or "axonmpi" in code.co_filename):
                self.calls.append(f"{code.co_filename}:{code.co_name}")

    def __enter__(self):
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)


@pytest.mark.mpi(min_size=1)
def test_device_all_reduce_never_touches_the_host(gworld, monkeypatch):
    cp = backend.get_cupy()
    x = cp.ones(1 << 20, dtype=cp.float32)
    axonmpi.all_reduce(x, out=x)   # creates the communicator (its uid travels over MPI, on the host)
    cp.cuda.get_current_stream().synchronize()
    pinned = cp.get_default_pinned_memory_pool()
    pinned.free_all_blocks()

    def no_host(*a, **k):
        raise AssertionError("a device all-reduce staged through host memory")
    for name in ("to_host", "to_host_pinned", "empty_pinned"):
        monkeypatch.setattr(backend, name, no_host)
    y = cp.ones(1 << 20, dtype=cp.float32)
    z = cp.arange(1000, dtype=cp.float64)
    with _HostTransfers() as seen:
        axonmpi.all_reduce(y, out=y)
        w = axonmpi.all_reduce(y, out=y, async_op=True)
        w.wait()
        s = axonmpi.all_reduce(z, "mean")                       # a new device result
        rs = axonmpi.reduce_scatter(cp.ones(4 * gworld.world_size, dtype=cp.float32))
        ag = axonmpi.all_gather(cp.ones(3, dtype=cp.float32))
    assert not seen.calls, f"host transfers during device collectives: {seen.calls}"
    assert pinned.n_free_blocks() == 0, "pinned host buffers were allocated (host staging)"
    assert all(backend.is_cupy_array(a) for a in (y, s, rs, ag))
    cp.cuda.get_current_stream().synchronize()
    n = gworld.world_size
    assert float(y[0].item()) == n * n
    np.testing.assert_allclose(s.get(), np.arange(1000.0))
    assert float(rs.sum().item()) == 4 * n and float(ag.sum().item()) == 3 * n
    if n > 1:
        _nccl_backend(gworld.default_group)


@pytest.mark.mpi(min_size=1)
def test_autograd_and_optimizer_on_cupy_match_numpy(gworld):
    import axonmpi.nn as nn
    import axonmpi.nn.functional as F
    from axonmpi import Tensor
    from axonmpi.optim import Adam
    rng = np.random.default_rng(0)
    X, Y = rng.standard_normal((8, 5)), rng.integers(0, 3, 8)
    results = []
    for dev in ("cpu", gworld.device):
        axonmpi.random.manual_seed(3)
        m = nn.Sequential(nn.Linear(5, 7, dtype=np.float64), nn.Tanh(), nn.Linear(7, 3, dtype=np.float64)).to(dev)
        opt = Adam(m.parameters(), lr=1e-2)
        for _ in range(3):
            opt.zero_grad()
            loss = F.cross_entropy(m(Tensor(X).to(dev)), Tensor(Y).to(dev))
            loss.backward()
            opt.step()
        results.append({k: np.asarray(backend.to_host(v)) for k, v in m.state_dict().items()})
    for k in results[0]:
        np.testing.assert_allclose(results[1][k], results[0][k], rtol=1e-10, atol=1e-12, err_msg=k)


@pytest.mark.mpi(min_size=2)
def test_ddp_on_cupy_over_nccl_matches_serial(gworld):
    import axonmpi.nn as nn
    import axonmpi.nn.functional as F
    from axonmpi import Tensor
    from axonmpi.optim import Adam
    from axonmpi.parallel import DDP
    n, r, B, steps = gworld.world_size, gworld.rank, 3, 4
    rng = np.random.default_rng(7)
    X, Y = rng.standard_normal((n * B * steps, 5)), rng.integers(0, 3, n * B * steps)

    def mlp():
        axonmpi.random.manual_seed(1234)
        return nn.Sequential(nn.Linear(5, 7, dtype=np.float64), nn.Tanh(), nn.Linear(7, 3, dtype=np.float64))
    ref = mlp()
    ropt = Adam(ref.parameters(), lr=1e-2)
    model = DDP(mlp().to(gworld.device))
    opt = Adam(model.parameters(), lr=1e-2)
    for s in range(steps):
        lo = s * n * B
        ropt.zero_grad()
        F.cross_entropy(ref(Tensor(X[lo:lo + n * B])), Tensor(Y[lo:lo + n * B])).backward()
        ropt.step()
        a = lo + r * B
        opt.zero_grad()
        F.cross_entropy(model(Tensor(X[a:a + B]).to(gworld.device)), Tensor(Y[a:a + B]).to(gworld.device)).backward()
        opt.step()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        np.testing.assert_allclose(backend.to_host(p.data), q.data, rtol=1e-10, atol=1e-12, err_msg=name)
    _nccl_backend(gworld.default_group)
