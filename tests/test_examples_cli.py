"""The demo job, its resume path and the axonmpi command line, end to end at small sizes."""
import os
import subprocess
import sys

import numpy as np
import pytest

import axonmpi

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--corpus-bytes", "60000",
        "--eval-batches", "1", "--no-progress"]


@pytest.mark.mpi(min_size=1)
def test_train_gpt_trains_saves_and_resumes(world, tmp_path_factory, capsys):
    import train_gpt

    d = axonmpi.broadcast_object(str(tmp_path_factory.mktemp("gpt")) if world.rank == 0 else None)
    gb = 2 * world.world_size
    train_gpt.main(TINY + ["--steps", "4", "--global-batch", str(gb), "--checkpoint-dir", d, "--sample-chars", "5"])
    from axonmpi import checkpoint as ckpt

    mgr = ckpt.CheckpointManager(d)
    assert mgr.latest_step() == 4
    first = ckpt.load(mgr.latest())
    train_gpt.main(TINY + ["--steps", "6", "--global-batch", str(gb), "--checkpoint-dir", d, "--resume",
                           "--sample-chars", "0"])
    assert mgr.latest_step() == 6
    second = ckpt.load(mgr.latest())
    moved = [k for k in first["model"] if not np.array_equal(first["model"][k], second["model"][k])]
    assert moved, "resumed training did not change the weights"
    assert second["meta"]["step"] == 6
    if world.rank == 0:
        out = capsys.readouterr().out
        assert "---- sample ----" in out


@pytest.mark.serial
def test_train_gpt_help_and_bad_batch():
    from axonmpi.testing import mpiexec_env

    script = os.path.join(ROOT, "examples", "train_gpt.py")
    r = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=60,
                       env=mpiexec_env())
    assert r.returncode == 0 and "--global-batch" in r.stdout and "--resume" in r.stdout
    from axonmpi.testing import run_mpiexec

    r = run_mpiexec([script, "--global-batch", "7", "--no-save"], n=2, timeout=60)
    assert r.returncode != 0 and "--global-batch 7 must divide by the 2 ranks" in r.stderr


@pytest.mark.serial
def test_cli_info_and_help():
    from axonmpi.testing import mpiexec_env

    r = subprocess.run([sys.executable, "-m", "axonmpi.cli", "info"], capture_output=True, text=True, timeout=60,
                       env=mpiexec_env())
    assert r.returncode == 0, r.stderr
    assert f"axonmpi      {axonmpi.__version__}" in r.stdout and "world        1 rank(s) on 1 node(s)" in r.stdout
    r = subprocess.run([sys.executable, "-m", "axonmpi.cli", "--help"], capture_output=True, text=True, timeout=60,
                       env=mpiexec_env())
    assert r.returncode == 0 and "info" in r.stdout and "run" in r.stdout
