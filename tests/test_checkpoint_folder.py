"""A checkpoint folder over a run's life: one job per folder, dead saves cleaned, damaged latest skipped, async save."""
import os
import subprocess
import sys
import warnings

import h5py
import numpy as np
import pytest

import axonmpi
from axonmpi import checkpoint as ckpt
from axonmpi.checkpoint import CheckpointManager, CheckpointReader, FolderInUseError, ShardedArray
from axonmpi.testing import mpiexec_env, run_mpiexec

V1 = os.path.join(os.path.dirname(__file__), "data", "checkpoint-v1")


def _shared_dir(world, tmp_path_factory, name):
    return axonmpi.broadcast_object(str(tmp_path_factory.mktemp(name)) if world.rank == 0 else None)


def _state(world, v, n=6):
    rows = np.full((2, 3), float(v) + world.rank)
    return {"w": ShardedArray(rows, (2 * world.world_size, 3), (2 * world.rank, 0)), "b": np.full(n, float(v)),
            "step": int(v), "tags": ["a", v]}


def _flip_a_byte(path, entry="b"):
    with CheckpointReader(path) as r:
        p = r.entry(entry).pieces[0]
    full = os.path.join(path, p.file)
    with h5py.File(full, "r") as f:
        off = f[p.dset].id.get_offset()
    with open(full, "r+b") as fh:
        fh.seek(off)
        b = fh.read(1)
        fh.seek(off)
        fh.write(bytes([b[0] ^ 0x10]))


# -- one job per folder ----------------------------------------------------------------------------
_HOLD = """
import sys, time
from axonmpi.checkpoint.runlock import RunLock
lock = RunLock(sys.argv[1]); lock.acquire()
print("locked", lock.run_id, flush=True)
sys.stdin.read()
"""


@pytest.mark.serial
def test_a_second_job_is_refused_naming_the_first_and_a_dead_holder_frees_the_folder(tmp_path):
    d = str(tmp_path / "ck")
    other = subprocess.Popen([sys.executable, "-c", _HOLD, d], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=mpiexec_env({"SLURM_JOB_ID": "777"}))
    run_id = other.stdout.readline().split()[1]
    mgr = CheckpointManager(d)
    with pytest.raises(FolderInUseError) as e:
        mgr.save(1, {"w": np.zeros(2)})
    msg = str(e.value)
    assert f"Slurm job 777, pid {other.pid}" in msg and run_id in msg and "--checkpoint-dir" in msg
    assert mgr.steps() == [] and not [n for n in os.listdir(d) if ".tmp-" in n]   # nothing written
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import train_gpt
    with pytest.raises(SystemExit) as ex:
        train_gpt.main(["--steps", "1", "--checkpoint-dir", d, "--n-layer", "1", "--n-embd", "16", "--n-head", "2",
                        "--block-size", "16", "--corpus-bytes", "60000", "--global-batch", "2", "--no-progress"])
    assert ex.value.code == 2
    other.stdin.close()                          # the first job ends (however it ends, the OS drops the lock)
    other.wait(timeout=30)
    mgr.save(1, {"w": np.zeros(2)})              # a requeued / later job gets the folder
    assert mgr.steps() == [1]
    again = CheckpointManager(d)                 # another manager of the same process shares the lock
    again.save(2, {"w": np.ones(2)})
    assert again.run_id == mgr.run_id and again.steps() == [1, 2]
    mgr.release()


@pytest.mark.serial
def test_a_deleted_run_folder_is_locked_again_at_the_next_save_or_the_save_raises(tmp_path, capfd):
    """Issue 53 fault 3: deleting the folder dropped the lock; the next save recreated the folder unlocked and
    a second job was admitted. Now each save checks the held lock against the path: retaken, or refused."""
    import shutil
    d = str(tmp_path / "ck")
    mgr = CheckpointManager(d)
    mgr.save(1, {"w": np.zeros(2)})
    shutil.rmtree(d)                                        # someone deletes the run folder
    mgr.save(2, {"w": np.ones(2)})                          # the lock is taken again on the new folder
    logged = capfd.readouterr().err
    assert "lock file was deleted" in logged and d in logged
    other = subprocess.Popen([sys.executable, "-c", _HOLD, d], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=mpiexec_env())
    out, err = other.communicate(timeout=60)
    assert other.returncode != 0 and "FolderInUseError" in err and "locked" not in out   # the second job is refused
    shutil.rmtree(d)
    other = subprocess.Popen([sys.executable, "-c", _HOLD, d], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=mpiexec_env({"SLURM_JOB_ID": "778"}))
    assert other.stdout.readline().startswith("locked")    # a second job took the folder meanwhile
    try:
        with pytest.raises(FolderInUseError) as e:
            mgr.save(3, {"w": np.ones(2)})
        msg = str(e.value)
        assert d in msg and "lock file was deleted" in msg and "Slurm job 778" in msg, msg
        assert not [n for n in os.listdir(d) if n.startswith("step")]        # nothing written
    finally:
        other.stdin.close()
        other.wait(timeout=30)
    mgr.release()


@pytest.mark.mpi(min_size=1)
def test_tmp_folders_of_dead_saves_go_at_the_next_save_but_an_only_copy_old_stays(world, tmp_path_factory):
    d = _shared_dir(world, tmp_path_factory, "tmp")
    mgr = CheckpointManager(d, keep_last=5)
    mgr.save(1, _state(world, 1))
    if world.rank == 0:   # a save killed mid-write (other step), and one killed between the two renames
        os.makedirs(os.path.join(d, "step-00000007.tmp-0123456789ab"))
        os.rename(mgr.path_for(1), mgr.path_for(1) + ".old-deadbeef")
    axonmpi.barrier()
    mgr.save(2, _state(world, 2))
    axonmpi.barrier()                      # group rank 0 prunes after the save returns on the others
    left = sorted(os.listdir(d))
    assert "step-00000007.tmp-0123456789ab" not in left                 # on main: survived every later save
    assert "step-00000001.old-deadbeef" in left                         # the only copy of step 1: kept
    np.testing.assert_array_equal(ckpt.load(os.path.join(d, "step-00000001.old-deadbeef"))["b"], np.full(6, 1.0))
    mgr.release()


# -- damaged latest ---------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
def test_load_latest_falls_back_past_a_bit_flipped_latest_and_keeps_it_aside(world, tmp_path_factory):
    d = _shared_dir(world, tmp_path_factory, "flip")
    mgr = CheckpointManager(d, keep_last=3)
    for s in (1, 2, 3):
        mgr.save(s, _state(world, s))
    if world.rank == 0:
        _flip_a_byte(mgr.path_for(3))
        _flip_a_byte(mgr.path_for(2))
    axonmpi.barrier()
    tmpl = {"w": ShardedArray(np.zeros((2, 3)), (2 * world.world_size, 3), (2 * world.rank, 0)), "b": np.zeros(6),
            "step": 0, "tags": None}
    out = mgr.load_latest(tmpl)
    assert out["step"] == 1 and out["tags"] == ["a", 1]
    np.testing.assert_array_equal(out["w"].local, np.full((2, 3), 1.0 + world.rank))
    assert mgr.steps() == [1]
    assert os.path.isdir(mgr.path_for(3) + ".damaged") and os.path.isdir(mgr.path_for(2) + ".damaged")
    with pytest.raises(ckpt.CheckpointError, match="checksum mismatch"):
        ckpt.load(mgr.path_for(3) + ".damaged")                        # kept as it was, for inspection
    mgr.release()


@pytest.mark.serial
def test_format_1_loads_warn_once():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        warnings.filterwarnings("once", category=ckpt.LegacyChecksumWarning)
        for _ in range(3):
            assert ckpt.load(V1)["step"] == 42
    legacy = [w for w in seen if issubclass(w.category, ckpt.LegacyChecksumWarning)]
    assert len(legacy) == 1 and "swap of two 8-byte words" in str(legacy[0].message)


# -- async save -------------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
def test_async_save_writes_what_was_passed_reuses_its_buffers_and_waits(world, tmp_path_factory):
    d = _shared_dir(world, tmp_path_factory, "async")
    mgr = CheckpointManager(d, keep_last=2)
    st = _state(world, 1)
    path = mgr.save(1, st, async_save=True)
    st["w"].local[...] = -7.0          # training goes on and changes the arrays at once
    st["b"][...] = -7.0
    st["tags"].append("changed")
    bufs = {k: id(v) for k, v in mgr._buffers.items()}
    assert mgr.wait() == path == mgr.path_for(1)
    out = ckpt.load(path)
    np.testing.assert_array_equal(out["b"], np.full(6, 1.0))
    np.testing.assert_array_equal(out["w"][2 * world.rank:2 * world.rank + 2], np.full((2, 3), 1.0 + world.rank))
    assert out["tags"] == ["a", 1]
    mgr.save(2, _state(world, 2), async_save=True)
    mgr.save(3, _state(world, 3), async_save=True)           # waits for step 2 first
    assert {k: id(v) for k, v in mgr._buffers.items()} == bufs   # the host copies are reused
    assert mgr.wait() == mgr.path_for(3) and mgr.wait() is None
    axonmpi.barrier()                      # group rank 0 prunes after the save returns on the others
    assert mgr.steps() == [2, 3]
    mgr.release()


@pytest.mark.mpi(min_size=1)
def test_async_save_error_is_raised_by_wait_on_every_rank(world, tmp_path_factory):
    d = _shared_dir(world, tmp_path_factory, "asyncerr")
    mgr = CheckpointManager(d)
    if world.rank == 0:
        os.makedirs(mgr.path_for(4))
        open(os.path.join(mgr.path_for(4), "precious.txt"), "w").write("not a checkpoint")
    axonmpi.barrier()
    mgr.save(4, _state(world, 4), async_save=True)
    with pytest.raises(FileExistsError, match="not an axonmpi checkpoint"):
        mgr.wait()
    assert os.path.exists(os.path.join(mgr.path_for(4), "precious.txt"))
    mgr.release()


_ASYNC_CRASH = """
import sys, numpy as np, axonmpi
from axonmpi.checkpoint import CheckpointManager
axonmpi.init()
mgr = CheckpointManager(sys.argv[1])
mgr.save(1, {"w": np.full(1000, 1.0)})
import os; os.environ["AXONMPI_CKPT_FAULT"] = "before_shard:1"
mgr.save(2, {"w": np.full(1000, 2.0), "v": np.full(1000, 2.0)}, async_save=True)
mgr.wait()
"""


@pytest.mark.serial
def test_a_kill_during_the_background_write_keeps_the_previous_checkpoint(tmp_path):
    d = str(tmp_path / "ck")
    r = run_mpiexec(["-c", _ASYNC_CRASH, d], n=2, timeout=60)
    assert r.returncode != 0
    mgr = CheckpointManager(d)
    assert mgr.steps() == [1]
    np.testing.assert_array_equal(ckpt.load(mgr.latest())["w"], np.full(1000, 1.0))
