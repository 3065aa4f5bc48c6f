"""Checkpoints across jobs: a rank killed mid-save leaves the previous checkpoint; 4-rank saves load at 1."""
import os
import shutil
import tempfile

import numpy as np
import pytest

from axonmpi.checkpoint import CheckpointReader, ShardedArray, load
from axonmpi.testing import run_mpiexec

pytestmark = pytest.mark.serial

SAVE_A_THEN_B = """
import os, sys, numpy as np, axonmpi
from axonmpi.checkpoint import ShardedArray, save
w = axonmpi.init()
path, fault = sys.argv[1], sys.argv[2]
full = np.arange(40.0).reshape(10, 4)
def state(v):
    return {"w": ShardedArray.from_global(full * v, axis=0), "b": np.full(5, v), "v": v}
save(path, state(1.0))
axonmpi.barrier()
os.environ["AXONMPI_CKPT_FAULT"] = fault
save(path, state(2.0))
print("second save finished", flush=True)
"""

SAVE_AT_4 = """
import sys, numpy as np, axonmpi
from axonmpi.checkpoint import ShardedArray, save
w = axonmpi.init()
a = np.arange(13 * 7, dtype=np.float32).reshape(13, 7)
b = np.arange(5 * 11, dtype=np.float64).reshape(5, 11) - 3
save(sys.argv[1], {"a": ShardedArray.from_global(a, axis=0), "b": ShardedArray.from_global(b, axis=1),
                   "rep": np.arange(6), "step": 42})
"""


@pytest.fixture
def tmpd():
    d = tempfile.mkdtemp(prefix="axonmpi-ckpt-crash-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("fault", [
    "mid_shard:1",      # rank 1 dies with its shard half written
    "after_shard:1",    # rank 1 dies after its shard, before the index
    "after_index:0",    # rank 0 dies with the new checkpoint complete but not renamed
    "after_aside:0",    # non-atomic replace: rank 0 dies between its two renames
])
def test_rank_killed_mid_save_leaves_previous_checkpoint(tmpd, fault):
    path = os.path.join(tmpd, "ck")
    r = run_mpiexec(["-c", SAVE_A_THEN_B, path, fault], n=2, timeout=60)
    assert r.returncode != 0 and "second save finished" not in r.stdout, (r.stdout, r.stderr)
    out = load(path)  # the previous checkpoint, complete and verified
    assert out["v"] == 1.0
    np.testing.assert_array_equal(out["w"], np.arange(40.0).reshape(10, 4))
    np.testing.assert_array_equal(out["b"], np.full(5, 1.0))


def test_killed_after_swap_leaves_the_new_checkpoint(tmpd):
    path = os.path.join(tmpd, "ck")
    r = run_mpiexec(["-c", SAVE_A_THEN_B, path, "before_cleanup:0"], n=2, timeout=60)
    assert r.returncode != 0
    assert load(path)["v"] == 2.0


def test_save_at_4_ranks_load_at_1(tmpd):
    path = os.path.join(tmpd, "ck")
    r = run_mpiexec(["-c", SAVE_AT_4, path], n=4, timeout=60)
    assert r.returncode == 0, r.stderr
    a = np.arange(13 * 7, dtype=np.float32).reshape(13, 7)
    b = np.arange(5 * 11, dtype=np.float64).reshape(5, 11) - 3
    with CheckpointReader(path) as rd:
        assert rd.attrs["world_size"] == 4 and len(rd.entry("a").pieces) == 4
        assert [p.shape for p in rd.entry("b").pieces] == [(5, 3), (5, 3), (5, 3), (5, 2)]
        np.testing.assert_array_equal(rd.read("a", (slice(2, 9),)), a[2:9])  # a slice across 3 pieces
    out = load(path)
    np.testing.assert_array_equal(out["a"], a)
    np.testing.assert_array_equal(out["b"], b)
    assert out["step"] == 42
    t = {"a": ShardedArray.zeros((13, 7), np.float32, axis=1, rank=1, parts=3),
         "b": ShardedArray.zeros((5, 11), np.float64, axis=0, rank=2, parts=3), "rep": None, "step": 0}
    load(path, t)
    np.testing.assert_array_equal(t["a"].local, a[:, 3:5])
    np.testing.assert_array_equal(t["b"].local, b[4:5])
