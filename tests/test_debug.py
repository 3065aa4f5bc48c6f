"""Debug mode: a rank that never arrives is named on every rank that did, and nothing is left in flight."""
import re

import numpy as np
import pytest

import axonmpi
from axonmpi.testing import run_mpiexec

# Rank `late` skips the first checked all_reduce; the others must name it, then everyone goes
# on (a plain all_reduce without debug) and the job ends cleanly. With the old all-gather check
# the ranks that arrived raised with the non-blocking collective still pending, and no rank
# could say who was missing.
MISSING = """
import sys, time, numpy as np, axonmpi
from axonmpi.distributed import CollectiveTimeoutError
late = int(sys.argv[1])
from mpi4py import MPI
w = axonmpi.init()
MPI.COMM_WORLD.Barrier()     # every rank is up before the timed check (a loaded machine starts them late)
if w.rank != late:
    try:
        axonmpi.all_reduce(np.ones(4))
    except CollectiveTimeoutError as e:
        print(f"rank {w.rank} caught: {e}", flush=True)
    else:
        raise SystemExit("no timeout")
else:
    time.sleep(6)
w.debug = False
total = axonmpi.all_reduce(np.array([w.rank + 1.0]))[0]
print(f"rank {w.rank} total {total:g}", flush=True)
"""


@pytest.mark.serial
@pytest.mark.parametrize("late", [2, 0])
def test_timeout_names_the_missing_rank_on_every_rank_that_came(late):
    r = run_mpiexec(["-c", MISSING, str(late)], n=3, timeout=90,
                    env={"AXONMPI_DEBUG": "1", "AXONMPI_DEBUG_TIMEOUT": "1.5"})
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    came = [k for k in range(3) if k != late]
    for k in came:
        # ranks' lines can arrive interleaved through the launcher: cut each report at the next one
        found = re.search(rf"rank {k} caught: (.*?)(?=rank \d (?:caught|total)|\n|$)", out)
        assert found, out
        line = found.group(0)
        assert re.search(rf"rank {k}: waited \d+ s in all_reduce\(dtype=float64, op=SUM, shape=\(4,\)\) on world",
                         line), line
        if late == 0:   # the collector itself is missing: the others name it
            assert "world rank 0 (group rank 0, which collects the debug checks) never called it" in line
        else:
            assert f"world ranks [{late}] never called it" in line and f"world ranks {came} did" in line
    for k in range(3):
        assert f"rank {k} total 6" in out


@pytest.mark.mpi(min_size=2)
def test_in_process_checks_agree_and_disagree(world):
    from axonmpi.distributed import CollectiveMismatchError

    old = world.debug
    world.debug = True
    try:
        g = world.split(world.rank % 2)
        for _ in range(3):                                     # many checks in a row, two groups
            assert axonmpi.all_reduce(np.ones(2), group=g)[0] == g.size
            assert axonmpi.all_gather(np.ones(1))[0] == 1
        shape = (3,) if world.rank == world.world_size - 1 else (2,)
        with pytest.raises(CollectiveMismatchError, match=rf"world ranks \[{world.world_size - 1}\] called "
                                                         r"all_reduce\(dtype=float64, op=SUM, shape=\(3,\)\)"):
            axonmpi.all_reduce(np.ones(shape))
        assert not world.default_group._debug_pending
        assert axonmpi.all_reduce(np.ones(1))[0] == world.world_size   # still in step afterwards
    finally:
        world.debug = old


@pytest.mark.serial
def test_rank_lists_are_compact_for_many_ranks():
    from axonmpi.distributed.debug import _rank_list

    assert _rank_list([2, 0]) == "[0, 2]"
    assert _rank_list(list(range(256)) + list(range(257, 512))) == "[0-255, 257-511] (511 ranks)"
