"""Ranks that share one GPU: NCCL refuses them, so the World sends CuPy arrays over MPI (host logic, no GPU)."""
import pytest
from mpi4py import MPI

from axonmpi.distributed import world as world_mod
from axonmpi.distributed.backends import BackendKind


def test_gpu_sharers_groups_ranks_by_node_and_bus_id():
    keys = [(0, "0000:1B:00.0"), (0, "0000:1B:00.0"), (0, "0000:3D:00.0"), (1, "0000:1B:00.0"),
            (1, "0000:1B:00.0"), None, (0, "0000:1B:00.0")]
    assert world_mod.gpu_sharers(keys) == [(0, 1, 6), (3, 4)]
    assert world_mod.gpu_sharers([(0, "a"), (0, "b"), None, None]) == []   # CPU ranks never share
    assert world_mod.gpu_sharers([]) == []


@pytest.mark.mpi(min_size=1)
def test_cpu_world_has_no_gpu_sharers(world):
    assert world.gpu_sharers == []
    assert world_mod._ranks_sharing_a_gpu(world.default_group.comm, world.device, world.node_rank) == []


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("asked", ["auto", "nccl", "mpi"])
def test_shared_gpu_falls_back_to_mpi_or_refuses_nccl(monkeypatch, asked):
    comm = MPI.COMM_WORLD
    shared = [tuple(range(comm.Get_size()))]
    monkeypatch.setattr(world_mod, "_ranks_sharing_a_gpu", lambda *a: shared)
    if asked == "nccl":
        with pytest.raises(RuntimeError, match=r"share one GPU.*gpus-per-task=1"):
            world_mod.World(comm, abort_on_exception=False, backend="nccl")
        return
    w = world_mod.World(comm, abort_on_exception=False, backend=asked)
    try:
        assert w.gpu_sharers == shared
        assert w.backend is BackendKind.MPI        # CuPy arrays over MPI: NCCL would fail with duplicate GPUs
    finally:
        w.destroy()
