"""In-memory checkpoints replicated to a buddy node; restart from memory, bitwise; HDF5 when a node and its
buddy are lost together (issue 53 items 1, 2 and 4). "Nodes" are rank groups (AXONMPI_MEMORY_NODE_SIZE)."""
import os
import shutil

import numpy as np
import pytest

import axonmpi
from axonmpi import nn, optim
from axonmpi.autograd import Tensor
from axonmpi.checkpoint import CheckpointManager, ShardedArray, restore_training_state, training_state
from axonmpi.checkpoint.memory import MemoryCheckpointer, node_layout, resume, run_key
import axonmpi.nn.functional as F


def _model(seed, kind="ddp"):
    axonmpi.manual_seed(seed)
    net = nn.Sequential(nn.Linear(6, 8, dtype="float64"), nn.Tanh(), nn.Linear(8, 2, dtype="float64"))
    if kind == "fsdp":
        from axonmpi.parallel import FSDP
        m = FSDP(net)                            # sharded: each rank's blob holds its own ShardedArray blocks
    else:
        m = axonmpi.DDP(net)
    return m, optim.Adam(m.parameters(), lr=0.05)


def _step(world, m, opt, step):
    x = np.random.default_rng(100 * step + world.rank).standard_normal((4, 6))
    opt.zero_grad()
    loss = F.mse_loss(m(Tensor(x)), Tensor(np.ones((4, 2))))
    loss.backward()
    opt.step()
    return float(loss.item())


def _params(m):
    return [np.array(p.data, copy=True) for p in m.parameters()]


@pytest.fixture
def nodes(world, monkeypatch):
    if world.world_size < 2:
        pytest.skip("buddies need two nodes (two ranks at least)")
    monkeypatch.setenv("AXONMPI_MEMORY_NODE_SIZE", str(world.world_size // 2 if world.world_size % 2 == 0 else 1))


def _lose(world, mem, node):
    """Node ``node`` dies: its memory folder goes (its first rank deletes it)."""
    axonmpi.barrier()
    if mem.nodes[world.rank] == node and world.rank == mem.nodes.index(node):
        shutil.rmtree(mem.folder, ignore_errors=True)
    axonmpi.barrier()


def _node_folder(mem, node):
    return os.path.join(mem.root, f"node{node}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_lost_node_resumes_from_its_buddies_bitwise_and_two_lost_buddies_fall_back_to_hdf5(
        world, nodes, tmp_path_factory, kind):
    d = axonmpi.broadcast_object(str(tmp_path_factory.mktemp("memck")) if world.rank == 0 else None)
    mgr = CheckpointManager(os.path.join(d, "ckpt"))
    key = run_key(mgr.directory)
    shm = os.path.join(d, "shm")
    mem = MemoryCheckpointer(key, root=shm)
    assert mem.buddy is not None and node_layout(world)[mem.buddy] != node_layout(world)[world.rank]
    m, opt = _model(0, kind)
    for step in range(1, 4):
        _step(world, m, opt, step)
        if step == 2:
            mgr.save(step, training_state(m, opt, step=step))          # the durable copy
        mem.save(step, training_state(m, opt, step=step, rng=False))
    mem.wait()
    losses = [_step(world, m, opt, s) for s in (4, 5)]                # the uninterrupted run
    want = _params(m)
    mem.close(remove=False)

    _lose(world, mem, node=1)                                         # node 1 and its memory are gone
    m2, opt2 = _model(7, kind)                                        # a new job: other weights
    mem2 = MemoryCheckpointer(key, root=shm)
    out, source = resume(mgr, mem2, training_state(m2, opt2))
    assert source == "memory step 3", source
    meta = restore_training_state(out, m2, opt2)
    assert meta["step"] == 3
    assert [_step(world, m2, opt2, s) for s in (4, 5)] == losses     # bitwise
    for a, b in zip(_params(m2), want):
        np.testing.assert_array_equal(a, b)
    mem2.close(remove=False)

    for n in sorted(set(mem2.nodes)):                                 # a node and its buddy lost together
        _lose(world, mem2, node=n)
    m3, opt3 = _model(9, kind)
    mem3 = MemoryCheckpointer(key, root=shm)
    said = []
    log = type("Log", (), {"info": lambda self, m, *a: said.append(m % a),
                           "warning": lambda self, m, *a: said.append(m % a)})()
    out, source = resume(mgr, mem3, training_state(m3, opt3), log=log)
    assert source == "hdf5 step 2", source
    assert any("no step is complete in node memory" in x and "falling back to the HDF5" in x for x in said), said
    assert "resumed from HDF5: step 2" in said[-1], said
    assert restore_training_state(out, m3, opt3)["step"] == 2
    m4, opt4 = _model(11, kind)                                       # the manager's own entry: the same choice
    assert mgr.load_latest(training_state(m4, opt4), memory=mem3)["meta"]["step"] == 2
    mem3.close()
    assert not os.path.exists(mem3.root) or not os.listdir(mem3.root)
    mgr.release()


@pytest.mark.mpi(min_size=2)
def test_another_runs_copies_are_never_used_and_a_fresh_run_clears_its_own(world, nodes, tmp_path_factory):
    d = axonmpi.broadcast_object(str(tmp_path_factory.mktemp("memrun")) if world.rank == 0 else None)
    mem = MemoryCheckpointer("run-a", root=d)
    m, opt = _model(0)
    _step(world, m, opt, 1)
    mem.save(1, training_state(m, opt, step=1, rng=False))
    mem.close(remove=False)
    other = MemoryCheckpointer("run-b", root=d)
    assert other.find() is None
    again = MemoryCheckpointer("run-a", root=d)
    got = again.restore(training_state(m, opt))
    assert got is not None and got[0] == 1
    again.close(remove=False)
    fresh = MemoryCheckpointer("run-a", root=d, fresh=True)          # --overwrite: the old copies go
    assert fresh.find() is None
    for x in (other, fresh):
        x.close()


@pytest.mark.mpi(min_size=2)
def test_a_memory_copy_loads_into_another_layout(world, nodes, tmp_path_factory):
    """Saved as row blocks (one per rank) and a replicated array; loaded as column blocks on every rank, whole, and
    with a step's pieces on other nodes: the same values (resharding, pieces over MPI)."""
    d = axonmpi.broadcast_object(str(tmp_path_factory.mktemp("memlay")) if world.rank == 0 else None)
    n = world.world_size
    full = np.arange(6 * n * 5, dtype=np.float64).reshape(6 * n, 5)
    rows = ShardedArray.from_chunks(full[6 * world.rank: 6 * world.rank + 6].copy(), full.shape, axis=0)
    mem = MemoryCheckpointer("lay", root=d)
    mem.save(4, {"w": rows, "b": np.full(3, 2.5), "meta": {"step": 4}})
    mem.close(remove=False)
    mem = MemoryCheckpointer("lay", root=d)
    c0, c1 = [int(v) for v in np.array_split(np.arange(5), n)[world.rank][[0, -1]]]
    cols = ShardedArray(np.zeros((6 * n, c1 - c0 + 1)), full.shape, (0, c0))
    step, out = mem.restore({"w": cols, "b": np.zeros(3), "meta": {"step": None}})
    assert step == 4 and out["meta"]["step"] == 4 and out["w"] is cols
    np.testing.assert_array_equal(cols.local, full[:, c0:c1 + 1])
    np.testing.assert_array_equal(out["b"], np.full(3, 2.5))
    copy = mem.find()
    everything = copy.load(None)                                      # no template: whole arrays
    np.testing.assert_array_equal(everything["w"], full)
    copy.close()
    mem.close()
