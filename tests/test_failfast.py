"""Failure is loud, never a hang: an exception on one rank ends the job; debug mode names disagreeing ranks."""
import time

import numpy as np
import pytest

import axonmpi
from axonmpi.testing import run_mpiexec

RAISE_ON_RANK_1 = """
import time, numpy as np, axonmpi
w = axonmpi.init()
if w.rank == 1:
    raise RuntimeError("boom on rank one")
axonmpi.all_reduce(np.ones(3))      # the others block here; the job must still end
time.sleep(60)
"""


@pytest.mark.serial
def test_exception_on_one_rank_ends_the_job():
    t0 = time.monotonic()
    r = run_mpiexec(["-c", RAISE_ON_RANK_1], n=3, timeout=90)
    elapsed = time.monotonic() - t0
    assert r.returncode != 0
    assert "boom on rank one" in r.stderr and "[axonmpi rank 1/3]" in r.stderr
    assert "root cause: rank 1 of 3 raised RuntimeError: boom on rank one" in r.stderr
    assert elapsed < 30, f"job took {elapsed:.1f}s to die"


MISMATCH = """
import numpy as np, axonmpi
from axonmpi.distributed import CollectiveMismatchError
w = axonmpi.init()
shape = (4,) if w.rank != 1 else (5,)
try:
    axonmpi.all_reduce(np.ones(shape))
except CollectiveMismatchError as e:
    msg = str(e).replace(chr(10), " | ")
    print(f"rank {w.rank} caught: {msg}", flush=True)
else:
    raise SystemExit("no error")
"""


@pytest.mark.serial
def test_debug_mode_names_disagreeing_ranks():
    r = run_mpiexec(["-c", MISMATCH], n=3, timeout=60, env={"AXONMPI_DEBUG": "1"})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for k in range(3):                                       # raised on every rank
        assert f"rank {k} caught: rank {k}: ranks of world disagree" in out
    assert out.count("world ranks [0, 2] called all_reduce(dtype=float64, op=SUM, shape=(4,))") == 3
    assert out.count("world ranks [1] called all_reduce(dtype=float64, op=SUM, shape=(5,))") == 3


@pytest.mark.mpi(min_size=2)
def test_debug_mode_in_process(world):
    from axonmpi.distributed import CollectiveMismatchError

    old = world.debug
    world.debug = True
    try:
        ok = axonmpi.all_reduce(np.ones(3))                 # agreeing ranks pass
        assert ok[0] == world.world_size
        op = "max" if world.rank == 0 else "sum"
        with pytest.raises(CollectiveMismatchError, match=r"world ranks \[0\] called all_reduce\(.*op=MAX"):
            axonmpi.all_reduce(np.ones(3), op)
    finally:
        world.debug = old


RAISE_EVERYWHERE = """
import axonmpi
w = axonmpi.init()
raise ValueError(f"the same bad value on every rank")
"""


@pytest.mark.serial
def test_failure_on_every_rank_gives_one_root_cause():
    r = run_mpiexec(["-c", RAISE_EVERYWHERE], n=3, timeout=90)
    assert r.returncode != 0
    # on main: three identical tracebacks; now the lowest failing rank reports, the others are aborted
    assert r.stderr.count("Traceback (most recent call last)") == 1, r.stderr
    assert "[axonmpi] root cause: rank 0 of 3 raised ValueError: the same bad value on every rank" in r.stderr


ARGPARSE_ON_RANKS = """
import argparse, sys
import axonmpi
p = axonmpi.log.rank0_parser(argparse.ArgumentParser(prog="demo"))
p.add_argument("--steps", type=int)
p.parse_args(["--steps", "ten"])
"""


@pytest.mark.serial
def test_bad_option_on_three_ranks_prints_one_usage():
    r = run_mpiexec(["-c", ARGPARSE_ON_RANKS], n=3, timeout=60)
    assert r.returncode != 0
    assert r.stderr.count("usage: demo") == 1 and r.stderr.count("invalid int value: 'ten'") == 1, r.stderr
