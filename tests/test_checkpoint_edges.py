"""Nothing lost at the edges (issue 39 items 1-3, issue 38 item 1): checkpoints that survive every fault.

* disk space is agreed, not raced: a save that fits a small tmpfs always succeeds; one that does not is
  one ``OSError(ENOSPC)`` on every rank naming the bytes needed and free (a real tmpfs where this process
  may mount one, else a fake ``statvfs``), and the previous checkpoint stays intact;
* a folder left without ``index.h5`` is moved aside (named, kept) so that the same step saves again;
* ``ckpt consolidate`` / ``export`` never destroy their input, ``export`` never overwrites silently;
* replicas of a ShardedArray block that differ are refused, naming the entry and the ranks.
"""
import errno
import os
import re
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

import axonmpi
from axonmpi import checkpoint as ckpt
from axonmpi.checkpoint import CheckpointError, CheckpointManager, ShardedArray
from axonmpi.checkpoint import cli as ckpt_cli
from axonmpi.checkpoint import write as _write
from axonmpi.testing import mpiexec_env


@pytest.fixture
def shared(world):
    d = tempfile.mkdtemp(prefix="axonmpi-edges-") if world.rank == 0 else None
    d = axonmpi.broadcast_object(d)
    yield d
    axonmpi.barrier()
    if world.rank == 0:
        shutil.rmtree(d, ignore_errors=True)


def _mount(size):
    d = tempfile.mkdtemp(prefix="axonmpi-tmpfs-")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", d], capture_output=True,
                       env=mpiexec_env())
    if r.returncode != 0:
        os.rmdir(d)
        return None
    return d


@pytest.fixture
def tmpfs(world, request):
    """A fresh tmpfs of ``request.param`` bytes every rank sees; skipped where mounting is not allowed."""
    d = _mount(request.param) if world.rank == 0 else None
    d = axonmpi.broadcast_object(d)
    if d is None:
        pytest.skip("mounting a tmpfs is not allowed here (needs root); the fake-statvfs tests cover the check")
    yield d
    axonmpi.barrier()
    if world.rank == 0:
        if subprocess.run(["umount", d], capture_output=True, env=mpiexec_env()).returncode:
            subprocess.run(["umount", "-l", d], capture_output=True, env=mpiexec_env())
        shutil.rmtree(d, ignore_errors=True)


def _ddp_state(step):
    """The issue's checkpoint: 1 MiB of replicated float64 weights (+ bias), 1.0 MiB on disk."""
    rng = np.random.default_rng(step)
    return {"model": {"weight": rng.standard_normal((512, 256)), "bias": rng.standard_normal(512)}, "step": step}


def _check_enospc(e, needed_min=0):
    assert isinstance(e, OSError) and e.errno == errno.ENOSPC, repr(e)
    text = str(e)
    m = re.search(r"needs (\d+) bytes .* (\d+) bytes \([0-9.]+ \w+\) are free", text)
    assert m and "\n" not in text, text
    assert int(m.group(1)) > int(m.group(2)) and int(m.group(1)) >= needed_min, text
    return int(m.group(1)), int(m.group(2))


# -- 1. space is agreed, not raced -------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("tmpfs", [2 << 20], indirect=True)
def test_a_save_that_fits_a_small_tmpfs_always_succeeds(world, tmpfs):
    """2 MiB tmpfs, 1.0 MiB checkpoint: on main 9 of 16 runs at 4 ranks failed (each rank compared the free
    space after another had reserved its shard). Every save here succeeds, and loads back."""
    for i in range(6):
        path = os.path.join(tmpfs, "ck")
        ckpt.save(path, _ddp_state(i))
        out = ckpt.load(path)
        np.testing.assert_array_equal(out["model"]["weight"], _ddp_state(i)["model"]["weight"])
        axonmpi.barrier()
        if world.rank == 0:
            shutil.rmtree(path)
        axonmpi.barrier()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("tmpfs", [1536 << 10], indirect=True)
def test_a_save_that_does_not_fit_a_tmpfs_is_one_enospc_everywhere_and_the_previous_survives(world, tmpfs):
    mgr = CheckpointManager(os.path.join(tmpfs, "run"), keep_last=1)
    mgr.save(1, _ddp_state(1))                    # fits; the next one does not fit beside it
    with pytest.raises(OSError) as e:
        mgr.save(2, _ddp_state(2))
    _check_enospc(e.value, 1 << 20)
    assert f"rank {world.rank}:" in str(e.value) and os.path.join(tmpfs, "run") in str(e.value)
    axonmpi.barrier()
    assert mgr.steps() == [1] and not [n for n in os.listdir(mgr.directory) if ".tmp-" in n]
    np.testing.assert_array_equal(ckpt.load(mgr.path_for(1))["model"]["bias"], _ddp_state(1)["model"]["bias"])
    mgr.release()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("fits", [True, False])
def test_fake_statvfs_free_space_is_measured_once_and_every_rank_agrees(world, shared, monkeypatch, fits):
    calls = []

    def free(path):
        calls.append(path)
        return (8 << 20) if fits else (512 << 10)

    monkeypatch.setattr(_write, "_free_bytes", free)
    path = os.path.join(shared, "ck")
    if fits:
        assert ckpt.save(path, _ddp_state(3)) == path
    else:
        with pytest.raises(OSError) as e:
            ckpt.save(path, _ddp_state(3))
        needed, have = _check_enospc(e.value, 1 << 20)
        assert have == 512 << 10 and "nothing was written; the previous checkpoint is intact" in str(e.value)
        assert not os.path.exists(path)
    assert len(calls) == (1 if world.rank == 0 else 0)       # measured once, by group rank 0, before any write
    outcome = axonmpi.all_gather_object(fits or str(e.value).split(":", 2)[2])
    assert len(set(map(str, outcome))) == 1                  # the same verdict (and numbers) on every rank
    axonmpi.barrier()


# -- 2. an interrupted save never blocks the next ---------------------------------------------------------
@pytest.mark.mpi(min_size=1)
def test_a_folder_without_index_is_moved_aside_and_the_same_step_saves_again(world, shared):
    mgr = CheckpointManager(os.path.join(shared, "run"), keep_last=3)
    mgr.save(1, _ddp_state(1))
    for rerun in range(2):                       # running the same job twice never fails the same way twice
        mgr.save(2, _ddp_state(2))
        axonmpi.barrier()
        if world.rank == 0:
            os.remove(os.path.join(mgr.path_for(2), "index.h5"))   # the save of step 2 was interrupted
        axonmpi.barrier()
        assert mgr.steps() == [1]                                   # skipped as unfinished (load_latest: step 1)
        assert ckpt.load(mgr.latest())["step"] == 1
        mgr.save(2, _ddp_state(2))                                  # on main: FileExistsError, exit 1
        assert mgr.steps() == [1, 2] and ckpt.load(mgr.path_for(2))["step"] == 2
        kept = mgr.unfinished()
        assert [os.path.basename(p) for p in kept] == ["step-00000002.unfinished",
                                                       "step-00000002.unfinished-1"][:rerun + 1]
        assert any(f.startswith("shard-") for f in os.listdir(kept[-1]))   # kept for inspection, as it was
    rows = {os.path.basename(r["path"]): r["status"] for r in ckpt.manager.run_folder_rows(mgr.directory)}
    assert rows["step-00000002.unfinished"].startswith("set aside by a later save: an interrupted save")
    mgr.release()


# -- 3. tools never destroy their input --------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path):
    path = str(tmp_path / "ck")
    ckpt.save(path, {"model": {"w": np.arange(12.0).reshape(3, 4)}, "step": 7}, group=_self_group())
    return path


def _self_group():
    w = axonmpi.get_world()
    return w.split(w.rank, name="self")


def _intact(path):
    assert ckpt_cli.verify(path, out=open(os.devnull, "w")) == 0
    np.testing.assert_array_equal(ckpt.load(path, group=_self_group())["model"]["w"], np.arange(12.0).reshape(3, 4))


@pytest.mark.serial
@pytest.mark.parametrize("inside", ["index.h5", "shard-00000.h5", "", "sub/x.h5"])
def test_consolidate_refuses_an_output_inside_the_checkpoint(saved, capsys, inside):
    out = os.path.join(saved, inside)
    assert ckpt_cli.main(["consolidate", saved, out, "--force"]) == 1      # on main: exit 0, checkpoint destroyed
    err = capsys.readouterr().err
    assert "is inside the checkpoint" in err and "would destroy the checkpoint" in err, err
    _intact(saved)


@pytest.mark.serial
def test_export_refuses_inside_the_checkpoint_a_missing_folder_and_overwriting(saved, tmp_path, capsys):
    assert ckpt_cli.main(["export", saved, os.path.join(saved, "hf"), "--force"]) == 1
    assert "is inside the checkpoint" in capsys.readouterr().err
    assert ckpt_cli.main(["export", saved, os.path.join(saved, "model.safetensors")]) == 1
    assert "is inside the checkpoint" in capsys.readouterr().err
    missing = str(tmp_path / "no" / "such" / "hf")
    assert ckpt_cli.main(["export", saved, missing]) == 1                 # on main: made the folders
    err = capsys.readouterr().err
    assert f"does not exist ({tmp_path / 'no' / 'such'})" in err and not os.path.exists(tmp_path / "no"), err
    assert ckpt_cli.main(["consolidate", saved, str(tmp_path / "no" / "full.h5")]) == 1
    assert "does not exist" in capsys.readouterr().err
    out = str(tmp_path / "hf")
    assert ckpt_cli.main(["export", saved, out]) == 0                     # OUT itself is made
    first = os.path.getmtime(os.path.join(out, "model.safetensors"))
    capsys.readouterr()
    assert ckpt_cli.main(["export", saved, out]) == 1                     # on main: overwritten silently
    err = capsys.readouterr().err
    assert "already holds model.safetensors" in err and "--force" in err, err
    assert os.path.getmtime(os.path.join(out, "model.safetensors")) == first
    assert ckpt_cli.main(["export", saved, out, "--force"]) == 0
    single = str(tmp_path / "one.safetensors")
    assert ckpt_cli.main(["export", saved, single]) == 0
    assert ckpt_cli.main(["export", saved, single]) == 1 and "exists (pass --force" in capsys.readouterr().err
    _intact(saved)


# -- issue 38 item 1: replicas of a ShardedArray block -------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_replicas_of_a_block_that_differ_are_refused_naming_the_entry_and_the_ranks(world, shared):
    """Every rank holds the whole (4,) array as its block (replicated over the group): identical copies
    save; a copy that differs on the last rank fails the save on every rank (on main: rank 0's kept)."""
    path = os.path.join(shared, "ck")
    same = ShardedArray(np.arange(4.0), (4,), (0,))
    ckpt.save(path, {"w": same, "step": 1})
    assert ckpt.load(path)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    last = world.world_size - 1
    mine = np.arange(4.0) + (0.5 if world.rank == last else 0.0)
    with pytest.raises(CheckpointError) as e:
        ckpt.save(path, {"w": ShardedArray(mine, (4,), (0,)), "step": 2})
    text = str(e.value)
    assert f"entry 'w': ranks 0 and {last} hold different data for its block at offsets (0,)" in text, text
    assert ckpt.load(path)["step"] == 1                                  # the previous checkpoint is intact
    axonmpi.barrier()
    assert not [n for n in os.listdir(shared) if ".tmp-" in n]


TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--corpus-bytes", "60000",
        "--eval-batches", "1", "--no-progress", "--sample-chars", "0", "--warmup", "2", "--global-batch", "4"]


@pytest.mark.serial
def test_train_gpt_auto_resume_over_an_interrupted_save_saves_that_step_again(tmp_path):
    """The issue's row: step 4's folder lost its index.h5; --auto-resume resumed from step 2 (right), then the
    save of step 4 refused to replace the folder (FileExistsError, exit 1), on every rerun. Now it saves."""
    import sys
    from axonmpi.testing import mpiexec_path
    d = str(tmp_path / "ck")
    gpt = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train_gpt.py")
    cmd = [mpiexec_path(), "-n", "2", sys.executable, gpt, *TINY, "--checkpoint-dir", d, "--save-every", "2",
           "--steps", "4", "--auto-resume"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=mpiexec_env(), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    for rerun in range(2):
        os.remove(os.path.join(d, "step-00000004", "index.h5"))
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=mpiexec_env(), cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"resumed from {d}/step-00000002 at step 2" in r.stderr, r.stderr[-3000:]
        assert "moved it to" in r.stderr and "step-00000004.unfinished" in r.stderr, r.stderr[-3000:]
        assert CheckpointManager(d).steps() == [2, 4]
