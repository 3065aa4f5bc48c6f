"""torch.distributed's surface at axonmpi.distributed (distributed/torch_api.py): the process-group calls,
the collectives on Tensors in place with torch's argument names (global src/dst, async_op, group), and
the same names on arrays keeping axonmpi's out-of-place form. Expected values in closed form from the ranks."""
import warnings

import numpy as np
import pytest

import axonmpi
import axonmpi.distributed as dist
from axonmpi import Tensor


def _t(*vals, dtype=np.float64):
    return Tensor(np.array(vals, dtype=dtype))


@pytest.mark.mpi(min_size=1)
def test_process_group_calls(world):
    dist.init_process_group("gloo")                          # a World exists: taken as is
    assert dist.is_initialized() and dist.is_available() and dist.is_gloo_available()
    assert dist.get_rank() == world.rank and dist.get_world_size() == world.world_size
    assert dist.get_backend() in ("mpi", "nccl") and dist.group.WORLD is None and dist.GroupMember.WORLD is None
    with pytest.raises(ValueError, match=f"world_size={world.world_size + 1}.*launcher started {world.world_size}"):
        dist.init_process_group(world_size=world.world_size + 1)
    with pytest.raises(ValueError, match="rank=.*leave rank= out"):
        dist.init_process_group(rank=world.rank + 1)
    with pytest.raises(ValueError, match="expected None, 'nccl', 'gloo', 'mpi'"):
        dist.init_process_group("tcp")
    evens = dist.new_group(list(range(0, world.world_size, 2)))
    if world.rank % 2 == 0:
        assert dist.get_rank(evens) == world.rank // 2 and dist.get_world_size(evens) == evens.size
        assert dist.get_process_group_ranks(evens) == list(range(0, world.world_size, 2))
        assert dist.get_global_rank(evens, 0) == 0 and dist.get_group_rank(evens, world.rank) == world.rank // 2
    else:
        assert dist.get_rank(evens) == -1 and dist.get_world_size(evens) == -1
    assert dist.barrier() is None and dist.barrier(async_op=True).wait() is None
    dist.monitored_barrier()


def test_backend_names_map():
    from axonmpi.distributed.torch_api import _map_backend
    assert _map_backend(None) == "auto" and _map_backend("gloo") == "auto" and _map_backend("mpi") == "mpi"
    assert _map_backend("cpu:gloo,cuda:nccl") in ("auto", "nccl")
    from axonmpi.distributed.backends.nccl import nccl_available
    if not nccl_available():
        with pytest.warns(UserWarning, match="'nccl' asked for but .* host arrays move over MPI"):
            assert _map_backend("nccl") == "auto"


@pytest.mark.mpi(min_size=1)
def test_all_reduce_in_place_on_tensors_and_out_of_place_on_arrays(world):
    r, n = world.rank, world.world_size
    t = _t(r, 1.0)
    assert dist.all_reduce(t) is None and t.tolist() == [n * (n - 1) / 2, n]
    t = _t(r + 1.0)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    assert t.tolist() == [n]
    t = _t(2.0)
    work = dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True)
    work.wait()
    assert t.tolist() == [2.0]
    loss = (Tensor([1.0, 2.0]) * (r + 1)).sum()              # a 0-d result: made writable, then reduced in place
    dist.all_reduce(loss)
    assert loss.item() == pytest.approx(3.0 * n * (n + 1) / 2)
    a = np.array([r], dtype=np.int64)
    out = dist.all_reduce(a)                                  # arrays: axonmpi's form, a new array
    assert out.tolist() == [n * (n - 1) // 2] and a.tolist() == [r]


@pytest.mark.mpi(min_size=2)
def test_broadcast_reduce_with_global_src_dst_on_a_subgroup(world):
    r, n = world.rank, world.world_size
    odds = dist.new_group(list(range(1, n, 2)))
    t = _t(r * 10.0)
    dist.broadcast(t, src=0)
    assert t.tolist() == [0.0]
    if r % 2 == 1:
        t = _t(r * 10.0)
        dist.broadcast(t, src=1, group=odds)                   # src is a global rank, as in torch
        assert t.tolist() == [10.0]
        with pytest.raises(ValueError, match="src=0 is a global rank .* not in"):
            dist.broadcast(t, src=0, group=odds)
        t = _t(1.0)
        dist.broadcast(t, group=odds, group_src=0)
        t = _t(float(r))
        dist.reduce(t, dst=1, group=odds)
        if r == 1:
            assert t.tolist() == [float(sum(range(1, n, 2)))]
        else:
            assert t.tolist() == [float(r)]
    assert dist.broadcast(np.full(2, float(r)), 0).tolist() == [0.0, 0.0]   # arrays: group rank, returned


@pytest.mark.mpi(min_size=1)
def test_gather_family_on_tensors(world):
    r, n = world.rank, world.world_size
    outs = [Tensor(np.zeros(2)) for _ in range(n)]
    assert dist.all_gather(outs, _t(r, -r)) is None
    assert [o.tolist() for o in outs] == [[k, -k] for k in range(n)]
    big = Tensor(np.zeros(2 * n))
    dist.all_gather_into_tensor(big, _t(r, r))
    assert big.tolist() == [float(k) for k in range(n) for _ in range(2)]
    out = Tensor(np.zeros(1))
    dist.reduce_scatter(out, [_t(float(k + r)) for k in range(n)])
    assert out.tolist() == [float(n * r + n * (n - 1) / 2)]
    out = Tensor(np.zeros(2))
    dist.reduce_scatter_tensor(out, Tensor(np.arange(2.0 * n)))
    assert out.tolist() == [2.0 * r * n, (2.0 * r + 1) * n]
    lst = [Tensor(np.zeros(1)) for _ in range(n)] if r == 0 else None
    dist.gather(_t(r + 0.5), lst, dst=0)
    if r == 0:
        assert [x.item() for x in lst] == [k + 0.5 for k in range(n)]
    got = Tensor(np.zeros(1))
    dist.scatter(got, [_t(10.0 * k) for k in range(n)] if r == 0 else None, src=0)
    assert got.tolist() == [10.0 * r]
    outs = [Tensor(np.zeros(1)) for _ in range(n)]
    dist.all_to_all(outs, [_t(100.0 * r + k) for k in range(n)])
    assert [o.item() for o in outs] == [100.0 * k + r for k in range(n)]
    out = Tensor(np.zeros(n))
    dist.all_to_all_single(out, Tensor(100.0 * r + np.arange(float(n))))
    assert out.tolist() == [100.0 * k + r for k in range(n)]


@pytest.mark.mpi(min_size=2)
def test_send_recv_and_objects(world):
    r, n = world.rank, world.world_size
    if r == 0:
        dist.send(_t(7.0, 8.0), dst=1)
        w = dist.isend(_t(9.0), dst=1)
        w.wait()
    elif r == 1:
        t = Tensor(np.zeros(2))
        assert dist.recv(t, src=0) == 0 and t.tolist() == [7.0, 8.0]
        t = Tensor(np.zeros(1))
        dist.irecv(t, src=0).wait()
        assert t.tolist() == [9.0]
        with pytest.raises(ValueError, match="recv\\(src=None\\)"):
            dist.recv(t)
    objs = [{"a": r}, "x"] if r == 0 else [None, None]
    dist.broadcast_object_list(objs, src=0)
    assert objs == [{"a": 0}, "x"]
    got = [None] * n
    assert dist.all_gather_object(got, {"rank": r}) is None and got == [{"rank": k} for k in range(n)]
    assert dist.all_gather_object(r) == list(range(n))        # axonmpi's form still returns the list
    lst = [None] * n if r == 0 else None
    dist.gather_object(r * 2, lst, dst=0)
    if r == 0:
        assert lst == [2 * k for k in range(n)]
    mine = [None]
    dist.scatter_object_list(mine, [f"o{k}" for k in range(n)] if r == 0 else None, src=0)
    assert mine == [f"o{r}"]
    ops = [dist.P2POp(dist.isend, _t(float(r)), (r + 1) % n), dist.P2POp(dist.irecv, t2 := Tensor(np.zeros(1)), (r - 1) % n)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert t2.tolist() == [float((r - 1) % n)]


def test_init_process_group_then_ax_init_lays_the_grid():
    """torch.distributed.init_process_group() then AxoNN's ax.init(G_...): one World, AxoNN's grid (one process)."""
    import subprocess
    import sys
    from axonmpi.testing import mpiexec_env
    code = ("import axonmpi, axonmpi.distributed as dist\n"
            "dist.init_process_group('gloo')\n"
            "w = axonmpi.init(G_intra_r=1, G_data=1)\n"
            "assert w is axonmpi.get_world() and w.grid.G_data == 1\n"
            "try:\n    dist.init_process_group()\nexcept RuntimeError as e:\n    print('twice:', e)\n"
            "dist.destroy_process_group()\nassert not dist.is_initialized()\nprint('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=mpiexec_env(), timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout and "twice: " in r.stdout, r.stderr
