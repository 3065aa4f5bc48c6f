"""Save plans as data (no MPI): who writes which block, the checks across ranks; and debug mode on save/load."""
import os
import shutil
import tempfile

import numpy as np
import pytest

from axonmpi.checkpoint import CheckpointError, load, save
from axonmpi.checkpoint.plan import Block, EntryPlan, WritePlan, assign, check_plans, plan_state
from axonmpi.distributed import barrier, broadcast_object
from axonmpi.distributed.sharding import ShardedArray


def _plans(states):
    return [plan_state(s, r)[0] for r, s in enumerate(states)]


def test_plan_is_named_data():
    plans, arrays = plan_state({"w": ShardedArray(np.ones((2, 3)), (5, 3), (3, 0)), "b": np.ones(3), "step": 7}, 1)
    w, b, step = plans
    assert isinstance(w, EntryPlan) and w.block == Block((3, 0), (2, 3)) and w.pytype == "sharded"
    assert w.signature == ("array", "sharded", "<f8", (5, 3))
    assert b.block is None and b.kind == "array" and step.kind == "value" and step.value == 7
    assert set(arrays) == {"w", "b"}


def test_assign_sharded_replicated_and_hybrid_blocks():
    """3 ranks: w (7 rows) in chunks 3,2,2; hybrid h: two chunks replicated on ranks (0,2) and (1);
    plain arrays balanced by bytes, largest first."""
    states = []
    for r in range(3):
        lo, hi = [(0, 3), (3, 5), (5, 7)][r]
        hlo, hhi = [(0, 2), (2, 4), (0, 2)][r]
        states.append({"w": ShardedArray(np.zeros((hi - lo, 2)), (7, 2), (lo, 0)),
                       "h": ShardedArray(np.zeros(hhi - hlo), (4,), (hlo,)),
                       "big": np.zeros(100), "mid": np.zeros(50), "small": np.zeros(10), "lr": 0.1})
    plan = assign(_plans(states))
    assert isinstance(plan, WritePlan) and plan.writers == [0, 1, 2]
    got = {(p.dset, p.offsets): r for r in plan.writers for p in plan.by_writer[r]}
    assert got[("w", (0, 0))] == 0 and got[("w", (3, 0))] == 1 and got[("w", (5, 0))] == 2
    assert got[("h", (0,))] == 0 and got[("h", (2,))] == 1  # the replica on rank 2 is not written again
    assert sum(1 for k in got if k[0] == "h") == 2
    # bytes before the plain arrays: 48+16, 32+16, 32 -> big to rank 2, then mid to rank 1, then small to rank 0
    assert got[("big", (0,))] == 2 and got[("mid", (0,))] == 1 and got[("small", (0,))] == 0
    assert "rank 1 -> shard-00001.h5:w offsets (3, 0) shape (2, 2)" in str(plan)
    assert [p.file for p in plan.pieces() if p.dset == "w"] == ["shard-00000.h5", "shard-00001.h5", "shard-00002.h5"]


def test_assign_and_check_name_what_is_wrong():
    gap = [{"w": ShardedArray(np.zeros(2), (5,), (0,))}, {"w": ShardedArray(np.zeros(2), (5,), (3,))}]
    with pytest.raises(CheckpointError, match=r"'w'.*cover 4 of the 5 elements"):
        assign(_plans(gap))
    overlap = [{"w": ShardedArray(np.zeros(3), (5,), (0,))}, {"w": ShardedArray(np.zeros(3), (5,), (2,))}]
    with pytest.raises(CheckpointError, match="overlap without being equal"):
        assign(_plans(overlap))
    with pytest.raises(CheckpointError, match=r"entry 'w': rank 0 has ndarray <f8 \(3,\), rank 1 has ndarray <f4 \(3,\)"):
        check_plans(_plans([{"w": np.zeros(3)}, {"w": np.zeros(3, np.float32)}]))
    with pytest.raises(CheckpointError, match=r"rank 1 has entries \['x'\] that rank 0 lacks"):
        check_plans(_plans([{"w": np.zeros(3)}, {"w": np.zeros(3), "x": 1}]))


@pytest.mark.mpi(min_size=1)
def test_save_and_load_under_debug_mode(world, monkeypatch):
    """Every exchange of save/load is an axonmpi collective: debug mode checks them and passes."""
    d = broadcast_object(tempfile.mkdtemp(prefix="axonmpi-ckpt-dbg-") if world.rank == 0 else None)
    monkeypatch.setattr(world, "debug", True)
    try:
        path = os.path.join(d, "ck")
        full = np.arange(26.0).reshape(13, 2)
        save(path, {"w": ShardedArray.from_global(full, axis=0), "b": np.ones(3), "step": 4})
        t = {"w": ShardedArray.zeros((13, 2), np.float64, axis=1), "b": np.zeros(3), "step": 0}
        out = load(path, t)
        np.testing.assert_array_equal(t["w"].local, full[t["w"].slices])
        assert out["step"] == 4
        with pytest.raises(CheckpointError, match="no checkpoint at"):
            load(os.path.join(d, "nope"))
    finally:
        monkeypatch.setattr(world, "debug", False)
        barrier()
        if world.rank == 0:
            shutil.rmtree(d, ignore_errors=True)
