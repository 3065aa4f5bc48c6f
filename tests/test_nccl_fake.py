"""The NCCL backend on the CPU stand-in (axonmpi.testing.fake_nccl): every collective vs closed form, bootstrap, DDP, FSDP, pipelines."""
import numpy as np
import pytest

import axonmpi
from axonmpi.distributed import chunk_sizes
from axonmpi.distributed.backends import BackendKind, NcclBackend, NcclBackendError
from axonmpi.testing import fake_nccl, run_mpiexec

DTYPES = [np.float64, np.float32, np.float16, np.int32, np.int64, np.uint8, np.complex128]


@pytest.fixture
def nworld(world):
    with fake_nccl.active(world):
        yield world


def _groups(world):
    n = world.world_size
    return [world.default_group, world.split(world.rank % 2, name="parity"),
            world.new_group(list(range(n))[::-1], name="reversed")]


def _val(rank, n, dtype):
    return ((np.arange(n) % 5) + rank + 1).astype(dtype)


def _used_nccl(g):
    be = g._host
    assert isinstance(be, NcclBackend), type(be)
    assert be._comm is not None and be._comm.rank_id() == g.rank and be._comm.size() == g.size
    return be


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_every_op_closed_form(nworld, dtype):
    for g in _groups(nworld):
        p, r = g.size, g.rank
        ops = ["sum", "max", "min", "product"] + (["mean"] if np.dtype(dtype).kind in "fc" else [])
        if np.dtype(dtype).kind == "c":
            ops = ["sum", "mean"]
        for op in ops:
            x = _val(r, 7, dtype)
            got = axonmpi.all_reduce(x, op=op, group=g)
            allv = np.stack([_val(k, 7, np.float64 if np.dtype(dtype).kind != "c" else dtype) for k in range(p)])
            want = {"sum": allv.sum(0), "max": allv.max(0), "min": allv.min(0), "product": allv.prod(0),
                    "mean": allv.mean(0)}[op]
            if np.dtype(dtype).kind in "iu":
                want = want.astype(dtype)   # wraps like the device would (uint8 products)
            tol = 1e-2 if dtype == np.float16 else 1e-6
            np.testing.assert_allclose(got, want.astype(dtype) if dtype != np.float16 else want,
                                       rtol=tol, err_msg=f"{g.name} {op}")
            inplace = _val(r, 5, dtype)
            axonmpi.all_reduce(inplace, op="sum", group=g, out=inplace)
            np.testing.assert_allclose(inplace, allv[:, :5].sum(0).astype(dtype), rtol=tol)
        if p > 1:
            _used_nccl(g)


@pytest.mark.mpi(min_size=1)
def test_bitwise_ops_fall_back_to_mpi(nworld):
    g = nworld.default_group
    x = np.array([1 << nworld.rank, 3], np.int64)
    got = axonmpi.all_reduce(x, op="bor")
    assert got[0] == (1 << nworld.world_size) - 1 and got[1] == 3


@pytest.mark.mpi(min_size=1)
def test_mean_without_ncclavg_sums_then_scales(nworld, monkeypatch):
    monkeypatch.setattr(fake_nccl, "get_version", lambda: 20900)
    g = nworld.split(0, name="fresh")      # a new group: a new backend asks the version again
    x = np.array([nworld.rank + 1.0, 2.0])
    got = axonmpi.all_reduce(x, op="mean", group=g)
    n = nworld.world_size
    np.testing.assert_allclose(got, [(n + 1) / 2, 2.0], rtol=1e-15)
    if n > 1:
        assert _used_nccl(g)._has_avg() is False
    w = axonmpi.all_reduce(x, op="mean", group=g, async_op=True)
    np.testing.assert_allclose(w.wait(), [(n + 1) / 2, 2.0], rtol=1e-15)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.float16, np.complex128])
def test_broadcast_reduce_allgather_uneven(nworld, dtype):
    for g in _groups(nworld):
        p, r = g.size, g.rank
        for root in range(p):
            b = _val(r, 6, dtype)
            axonmpi.broadcast(b, src=root, group=g)
            np.testing.assert_array_equal(b, _val(root, 6, dtype))
            red = axonmpi.reduce(_val(r, 4, dtype), dst=root, group=g)
            if r == root:
                np.testing.assert_allclose(red, sum(_val(k, 4, np.float64) for k in range(p)).astype(dtype))
        # uneven all_gather: rank k has k+1 rows of 3 (gathered as allgatherv = grouped broadcasts)
        rows = np.full((r + 1, 3), r, dtype)
        got = axonmpi.all_gather(rows, group=g, uneven=True)
        want = np.concatenate([np.full((k + 1, 3), k, dtype) for k in range(p)])
        np.testing.assert_array_equal(got, want)
        even = axonmpi.all_gather(_val(r, 3, dtype), group=g)
        np.testing.assert_array_equal(even, np.concatenate([_val(k, 3, dtype) for k in range(p)]))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("n", [7, 8, 1])
def test_reduce_scatter_even_and_uneven(nworld, n):
    for g in _groups(nworld):
        p, r = g.size, g.rank
        x = np.arange(n * 2, dtype=np.float64).reshape(n, 2) * (r + 1)
        got = axonmpi.reduce_scatter(x, group=g)
        total = np.arange(n * 2, dtype=np.float64).reshape(n, 2) * sum(k + 1 for k in range(p))
        lo = sum(chunk_sizes(n, p)[:r])
        np.testing.assert_allclose(got, total[lo:lo + chunk_sizes(n, p)[r]])
        mean = axonmpi.reduce_scatter(x, op="mean", group=g)
        np.testing.assert_allclose(mean, total[lo:lo + chunk_sizes(n, p)[r]] / p)
        w = axonmpi.reduce_scatter(x, group=g, async_op=True)
        np.testing.assert_allclose(w.wait(), total[lo:lo + chunk_sizes(n, p)[r]])


@pytest.mark.mpi(min_size=1)
def test_gather_scatter_all_to_all_uneven(nworld):
    for g in _groups(nworld):
        p, r = g.size, g.rank
        for root in range(p):
            got = axonmpi.gather(np.full(r + 2, r, np.float32), dst=root, group=g)
            if r == root:
                for k in range(p):
                    np.testing.assert_array_equal(got[k], np.full(k + 2, k, np.float32))
            chunks = [np.full((k + 1, 2), 10 * k + root, np.int64) for k in range(p)] if r == root else None
            mine = axonmpi.scatter(chunks, src=root, group=g)
            np.testing.assert_array_equal(mine, np.full((r + 1, 2), 10 * r + root, np.int64))
        # piece for rank j has j + r + 1 rows (uneven both ways), value 100*r + j
        pieces = [np.full((j + r + 1, 2), 100 * r + j, np.float64) for j in range(p)]
        got = axonmpi.all_to_all(pieces, group=g)
        for j in range(p):
            np.testing.assert_array_equal(got[j], np.full((r + j + 1, 2), 100 * j + r, np.float64))


@pytest.mark.mpi(min_size=1)
def test_point_to_point_is_grouped(nworld):
    for g in _groups(nworld):
        p, r = g.size, g.rank
        nxt, prv = (r + 1) % p, (r - 1) % p
        big = 50_000   # larger than MPI's eager limit: a blocking send-first order would deadlock
        send = np.full(big, r, np.float64)
        recv = np.empty(big)
        ops = [axonmpi.P2POp(axonmpi.isend, send, nxt, group=g),
               axonmpi.P2POp(axonmpi.irecv, recv, prv, group=g)]
        for w in axonmpi.batch_isend_irecv(ops):
            w.wait()
        np.testing.assert_array_equal(recv, np.full(big, prv, np.float64))
        if p == 1:
            continue
        # single isend/irecv pairs posted in the same order on both sides
        a = np.empty(3, np.int32)
        ws = axonmpi.isend(np.arange(3, dtype=np.int32) + r, nxt, group=g)
        wr = axonmpi.irecv(a, prv, group=g)
        wr.wait(), ws.wait()
        np.testing.assert_array_equal(a, np.arange(3) + prv)
        if r % 2 == 0:   # blocking pairs: even ranks send first
            axonmpi.send(np.array([r], np.int64), nxt, group=g)
            b = axonmpi.recv(np.empty(1, np.int64), prv, group=g)
        else:
            b = axonmpi.recv(np.empty(1, np.int64), prv, group=g)
            axonmpi.send(np.array([r], np.int64), nxt, group=g)
        assert b[0] == prv
        _used_nccl(g)


@pytest.mark.mpi(min_size=1)
def test_stand_in_rejects_ungrouped_point_to_point(nworld):
    be = NcclBackend(nworld.split(0, name="raw"))
    comm, s = be._begin()
    with pytest.raises(fake_nccl.NcclError, match="outside groupStart"):
        comm.send(np.zeros(1).ctypes.data, 8, fake_nccl.NCCL_UINT8, 0, s)
    be.close()


@pytest.mark.mpi(min_size=1)
def test_unique_id_made_once_per_group_on_its_rank0_and_shared(nworld, monkeypatch):
    calls = []
    real = fake_nccl.get_unique_id
    monkeypatch.setattr(fake_nccl, "get_unique_id", lambda: calls.append(1) or real())
    grid = nworld.grid
    groups = [nworld.default_group, nworld.split(nworld.rank % 2, name="parity"), grid.data_group,
              nworld.new_group(list(range(nworld.world_size))[::-1], name="reversed")]
    made = []
    for g in groups:
        g._backends.clear(); g._host = None
        be = NcclBackend(g)
        assert be.uid is None and be._comm is None      # lazy: nothing before the first collective
        before = len(calls)
        x = np.array([1.0])
        be.allreduce(x, x, axonmpi.ReduceOp.SUM)
        assert x[0] == g.size
        assert len(calls) - before == (1 if g.rank == 0 else 0), (g.name, g.rank)
        be.allreduce(x, x, axonmpi.ReduceOp.SUM)          # no second id
        assert len(calls) - before == (1 if g.rank == 0 else 0)
        uids = axonmpi.all_gather_object(be.uid, group=g)
        assert all(u == uids[0] for u in uids)
        assert fake_nccl.uid_root(be.uid) == g.ranks[0]   # made on the group's rank 0 (a world rank)
        assert be._comm.world_ranks == g.ranks and be._comm.rank_id() == g.rank
        made.append(be)
    # distinct groups get distinct ids (and so distinct communicators)
    assert len({be.uid for be in made}) == len(made)
    for be in made:
        be.close()


@pytest.mark.mpi(min_size=1)
def test_nccl_errors_name_rank_and_group(nworld, monkeypatch):
    g = nworld.split(0, name="errgroup")
    be = NcclBackend(g)
    be.communicator()

    def bad(*a):
        raise fake_nccl.NcclError(4, "boom")
    monkeypatch.setattr(type(be._comm), "allReduce", bad)
    with pytest.raises(NcclBackendError, match=rf"rank {nworld.rank}: NCCL allReduce\(SUM, float64\) failed on "
                                               rf"errgroup \(group rank {g.rank} of {g.size}.*invalid argument"):
        be.allreduce(np.ones(2), np.ones(2), axonmpi.ReduceOp.SUM)
    be.close()


@pytest.mark.mpi(min_size=2)
def test_ddp_parity_on_the_nccl_backend(nworld):
    import test_ddp as T
    from axonmpi.optim import Adam
    from axonmpi.parallel import GradSyncStrategy
    for gs in (GradSyncStrategy.OVERLAP, GradSyncStrategy.AFTER_BACKWARD):
        ref, ref_losses = T._serial_run(nworld, np.float64, T.STEPS, Adam, lr=1e-2)
        model, losses = T._ddp_run(nworld, np.float64, T.STEPS, grad_sync=gs, bucket_size_mb=1e-4)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-10)
        T._assert_params_equal(model, ref, 1e-10)
    _used_nccl(nworld.default_group)



@pytest.mark.mpi(min_size=2)
def test_fsdp_parity_on_the_nccl_backend(nworld, monkeypatch):
    """FSDP's all-gathers and reduce-scatters (uneven shards) through NcclBackend on the stand-in."""
    import test_fsdp as TF
    from axonmpi.parallel import FSDP, ShardingStrategy
    calls = {}
    for name in ("_allgather", "allgatherv", "_reduce_scatter", "_allreduce"):
        real = getattr(NcclBackend, name)

        def counted(self, *a, _real=real, _name=name):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(self, *a)
        monkeypatch.setattr(NcclBackend, name, counted)
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
        TF._check_parity(nworld, lambda m: FSDP(m, sharding_strategy=strategy))
    assert calls.get("_allgather", 0) + calls.get("allgatherv", 0) > 0, calls   # parameters gathered by NCCL
    assert calls.get("_reduce_scatter", 0) > 0, calls                            # gradients reduce-scattered
    _used_nccl(nworld.default_group)


@pytest.mark.mpi(min_size=2)
def test_point_to_point_is_deferred_and_ring_orders_do_not_deadlock(nworld, monkeypatch):
    """isend/irecv are recorded and posted together when needed (a GPU stream runs a receive
    before anything queued after it; the stand-in blocks likewise), so MPI-style ring orders work."""
    posted = []
    real_send, real_recv = fake_nccl.NcclCommunicator.send, fake_nccl.NcclCommunicator.recv
    monkeypatch.setattr(fake_nccl.NcclCommunicator, "send", lambda self, *a: posted.append("send") or real_send(self, *a))
    monkeypatch.setattr(fake_nccl.NcclCommunicator, "recv", lambda self, *a: posted.append("recv") or real_recv(self, *a))
    for g in _groups(nworld):
        p, r = g.size, g.rank
        if p == 1:
            continue
        nxt, prv = (r + 1) % p, (r - 1) % p
        big = 50_000
        got = np.empty(big)
        posted.clear()
        wr = axonmpi.irecv(got, prv, group=g)                    # a receive first on every rank ...
        assert posted == []                                      # ... only recorded
        axonmpi.send(np.full(big, r, np.float64), nxt, group=g)  # ... then a blocking send: posted together
        assert sorted(posted) == ["recv", "send"]
        wr.wait()
        np.testing.assert_array_equal(got, prv)
        ws = axonmpi.isend(np.full(big, 10.0 * r), nxt, group=g)
        wr = axonmpi.irecv(got, prv, group=g)
        ws.wait()                                                # the send's wait first: posts both
        wr.wait()
        np.testing.assert_array_equal(got, 10.0 * prv)
        # a receive posted ahead stays pending while a later send goes out
        ahead = np.empty(3)
        wa = axonmpi.irecv(ahead, prv, group=g)
        posted.clear()
        wb = axonmpi.isend(np.full(3, 7.0 * r), nxt, group=g)
        wb.is_completed()
        assert posted == ["send"]
        mid = axonmpi.all_reduce(np.array([1.0]), group=g)       # a collective posts what is pending first
        assert mid[0] == p and posted == ["send", "recv"]
        wa.wait(), wb.wait()
        np.testing.assert_array_equal(ahead, 7.0 * prv)
        _used_nccl(g)


@pytest.mark.mpi(min_size=2)
def test_pipeline_parity_every_schedule_on_the_nccl_backend(nworld):
    """The pipeline posts receives ahead of need and sends while they are pending: on NCCL's
    in-order streams that order must not hang (the stand-in enforces stream order)."""
    import test_pipeline_parity as PP
    from axonmpi.parallel.pipeline import PipelineSchedule
    p = nworld.world_size
    for kind in PipelineSchedule:
        v = PP._chunks_per_rank(kind)
        m = 2 * p if v > 1 else 4
        ref, ref_losses = PP._serial(PP._mlp, PP._mlp_data, p, v, m, microbatched=False)
        got, losses, names, _ = PP._pipelined(PP._mlp, PP._mlp_data, kind, v, m, nworld.default_group)
        PP._compare(nworld, ref, ref_losses, got, losses, names)
    _used_nccl(nworld.default_group)

MISSING = """
import time, numpy as np, axonmpi
import axonmpi.testing.fake_nccl  # registers the stand-in that AXONMPI_FAKE_NCCL=1 selects
from axonmpi.distributed import CollectiveTimeoutError
from axonmpi.distributed.backends import NcclBackend
w = axonmpi.init(backend="nccl")
be = NcclBackend(w.default_group)
if w.rank != 1:
    try:
        be.communicator()
    except CollectiveTimeoutError as e:
        print(f"rank {w.rank} caught: {e}", flush=True)
    else:
        raise SystemExit("no timeout")
else:
    time.sleep(3)
print(f"rank {w.rank} done", flush=True)
"""


@pytest.mark.serial
def test_member_that_never_creates_the_communicator_is_named_in_debug_mode():
    r = run_mpiexec(["-c", MISSING], n=3, timeout=90,
                    env={"AXONMPI_DEBUG": "1", "AXONMPI_DEBUG_TIMEOUT": "1.5", "AXONMPI_FAKE_NCCL": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    for k in (0, 2):
        line = next(l for l in r.stdout.splitlines() if l.startswith(f"rank {k} caught:"))
        assert "nccl_communicator_init" in line and "world ranks [1] never called it" in line, line
    for k in range(3):
        assert f"rank {k} done" in r.stdout


@pytest.mark.serial
def test_backend_nccl_without_nccl_is_a_clear_error():
    r = run_mpiexec(["-c", "import axonmpi; axonmpi.init(backend='nccl')"], n=1, timeout=60,
                    env={"AXONMPI_FAKE_NCCL": "0", "AXONMPI_DISABLE_CUPY": "1"})
    assert r.returncode != 0
    assert "rank 0: backend='nccl' needs CuPy with NCCL and a GPU" in r.stderr


@pytest.mark.serial
def test_backend_and_device_choices_are_validated():
    from axonmpi.distributed.world import _bind_device
    with pytest.raises(ValueError, match="unknown backend 'gloo'"):
        BackendKind.coerce("gloo")
    with pytest.raises(ValueError, match="device='tpu' is not a device choice"):
        _bind_device("tpu", 0, 0)
    assert str(_bind_device("cpu", 3, 0)) == "cpu"


@pytest.mark.serial
def test_cuda_aware_override_and_alias(monkeypatch):
    from axonmpi.distributed.backends import cuda_aware_mpi, query_cuda_support
    monkeypatch.delenv("AXONMPI_CUDA_AWARE", raising=False)
    monkeypatch.setenv("AXONMPI_CUDA_AWARE_MPI", "1")
    assert cuda_aware_mpi() is True
    monkeypatch.setenv("AXONMPI_CUDA_AWARE", "0")
    assert cuda_aware_mpi() is False            # the new name wins over the alias
    monkeypatch.setenv("AXONMPI_CUDA_AWARE", "1")
    assert cuda_aware_mpi() is True
    monkeypatch.setenv("AXONMPI_CUDA_AWARE", "auto")
    monkeypatch.delenv("AXONMPI_CUDA_AWARE_MPI")
    assert cuda_aware_mpi() is bool(query_cuda_support())
    assert query_cuda_support() in (True, False, None)


@pytest.mark.mpi(min_size=1)
def test_unique_id_failure_on_rank0_is_raised_on_every_member(nworld, monkeypatch):
    def broken():
        raise fake_nccl.NcclError(3, "no network")
    monkeypatch.setattr(fake_nccl, "get_unique_id", broken)
    g = nworld.split(0, name="noid")
    with pytest.raises(NcclBackendError, match=rf"rank {nworld.rank}: NCCL get_unique_id \(on group rank 0, "
                                               rf"world rank {g.ranks[0]}\) failed on noid.*no network"):
        NcclBackend(g).communicator()


@pytest.mark.serial
def test_cli_info_json_reports_versions_and_gpus():
    import json
    import subprocess
    import sys
    from axonmpi.testing import mpiexec_env
    r = subprocess.run([sys.executable, "-m", "axonmpi", "info", "--json"], capture_output=True, text=True,
                       timeout=60, env=mpiexec_env({"AXONMPI_CUDA_AWARE": "1"}))
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["axonmpi"] == axonmpi.__version__ and d["numpy"] == np.__version__
    assert d["mpi"]["thread_level"] in ("single", "funneled", "serialized", "multiple")
    assert d["mpi"]["cuda_aware"] == "yes (declared)" and d["mpi"]["library"]
    assert d["ranks"][0]["rank"] == 0 and isinstance(d["ranks"][0]["gpus_visible"], int)
    assert set(d) >= {"python", "mpi4py", "cupy", "cuda", "nccl", "backend"}
