"""The always-on collective check and point-to-point accounting (issue 31 item 6), debug mode off.

Each fault runs as its own ``mpiexec -n 2`` job (a mismatched collective leaves the communicator
unusable, so not in the test session's World); the in-session tests show the check passes quietly
in ordinary use and on sub-groups, and is verified for non-blocking collectives too.
"""
import re

import numpy as np
import pytest

import axonmpi
from axonmpi.distributed.debug import CollectiveMismatchError
from axonmpi.testing import run_mpiexec

FAST = {"AXONMPI_TIMEOUT": "10", "AXONMPI_DEBUG": "0"}

DTYPE = """
import numpy as np, axonmpi
w = axonmpi.init()
x = np.full(4, 1.5, np.float32) if w.rank else np.full(4, 1, np.int32)
print(w.rank, axonmpi.all_reduce(x), flush=True)
"""
SRC = """
import numpy as np, axonmpi
w = axonmpi.init()
x = np.full(4, w.rank + 1.0)
print(w.rank, axonmpi.broadcast(x, src=w.rank), flush=True)
{after}
"""
COUNT = """
import numpy as np, axonmpi
w = axonmpi.init()
print(w.rank, axonmpi.all_reduce(np.ones(5 if w.rank == 0 else 4)), flush=True)
"""
COUNT_ASYNC = """
import numpy as np, axonmpi
w = axonmpi.init()
print(w.rank, axonmpi.all_reduce(np.ones(5 if w.rank == 0 else 4), async_op=True).wait(), flush=True)
"""
UNRECEIVED = """
import sys, numpy as np, axonmpi
w = axonmpi.init()
if w.rank == 0:
    axonmpi.send(np.ones(4), dst=1)          # 32 bytes nobody receives
sys.stdout.write(f"{{w.rank}} done\\n"); sys.stdout.flush()   # one write: ranks share the pipe
{after}
"""
UNSENT = """
import sys, numpy as np, axonmpi
w = axonmpi.init()
if w.rank == 0:
    axonmpi.recv(np.empty(4), src=1)         # rank 1 never sends
sys.stdout.write(f"{w.rank} done\\n"); sys.stdout.flush()   # one write: ranks share the pipe
"""
SUBGROUP_OP = """
import numpy as np, axonmpi
w = axonmpi.init()
g = w.new_group([1, 2])
if g.is_member:
    if w.rank == 1:
        axonmpi.all_reduce(np.ones(3), group=g, op="max")
    else:
        axonmpi.all_reduce(np.ones(3), group=g, op="sum")
axonmpi.barrier()
"""


def _job(code, env=None, n=2):
    r = run_mpiexec(["-c", code], n=n, timeout=120, env={**FAST, **(env or {})})
    return r.returncode, r.stdout, r.stderr


@pytest.mark.serial
def test_same_size_dtype_mismatch_raises_on_every_rank_naming_both():
    rc, out, err = _job(DTYPE)
    assert rc != 0, (out, err)
    assert "CollectiveMismatchError" in err, err
    assert re.search(r"world ranks \[0\] called all_reduce\(count=4, dtype=int32, op=SUM\) call #0 at <string>:5", err), err
    assert re.search(r"world ranks \[1\] called all_reduce\(count=4, dtype=float32, op=SUM\) call #0 at <string>:5", err), err
    assert "[3" not in out and "1077936128" not in out      # no garbage result handed back


@pytest.mark.serial
def test_check_off_is_the_old_silent_garbage():
    rc, out, err = _job(DTYPE, {"AXONMPI_CHECK_COLLECTIVES": "0"})
    assert rc == 0 and "CollectiveMismatchError" not in err, err


@pytest.mark.serial
@pytest.mark.parametrize("after", ["axonmpi.barrier()", ""])
def test_broadcast_with_a_different_src_per_rank(after):
    """Both ranks are roots, so the broadcast returns at once; the check is verified at the next call
    (the barrier) or at exit. Either way every rank hears of it and the job fails."""
    rc, out, err = _job(SRC.format(after=after))
    assert rc != 0, (out, err)
    assert re.search(r"world ranks \[0\] called broadcast\(count=4, dtype=float64, root=0\) call #0 at <string>:5", err), err
    assert re.search(r"world ranks \[1\] called broadcast\(count=4, dtype=float64, root=1\) call #0 at <string>:5", err), err


@pytest.mark.serial
def test_element_count_mismatch_names_the_op():
    """MPICH makes truncation inside a blocking all-reduce fatal whatever the error handler (exit 142):
    the job still fails, and axonmpi names the call the rank died in."""
    rc, out, err = _job(COUNT)
    assert rc != 0, (out, err)
    assert re.search(r"\[axonmpi\] rank \d: the MPI library ended this process inside all_reduce #0 on world "
                     r"\(this rank passed count=[45], dtype=float64\) at <string>:4", err) \
        or "called all_reduce(count=5, dtype=float64, op=SUM)" in err, err


@pytest.mark.serial
def test_element_count_mismatch_non_blocking_names_both_counts():
    rc, out, err = _job(COUNT_ASYNC)
    assert rc != 0, (out, err)
    assert "called all_reduce(count=5, dtype=float64, op=SUM) call #0 at <string>:4" in err, err
    assert "called all_reduce(count=4, dtype=float64, op=SUM) call #0 at <string>:4" in err, err


@pytest.mark.serial
def test_reduce_op_mismatch_on_a_sub_group():
    rc, out, err = _job(SUBGROUP_OP, n=3)
    assert rc != 0, (out, err)
    assert re.search(r"ranks of group\d disagree on collective call #0", err), err
    assert "world ranks [1] called all_reduce(count=3, dtype=float64, op=MAX)" in err, err
    assert "world ranks [2] called all_reduce(count=3, dtype=float64, op=SUM)" in err, err


@pytest.mark.serial
def test_a_send_nobody_receives_fails_the_job_at_exit():
    rc, out, err = _job(UNRECEIVED.format(after=""))
    assert rc != 0, (out, err)
    assert "0 done" in out and "1 done" in out
    assert ("rank 0: 1 send(s) to rank 1 were never received: rank 0 sent 1 message(s) to rank 1 (on world, "
            "the last from <string>:5), rank 1 posted 0 receive(s) from rank 0") in err, err


@pytest.mark.serial
def test_a_send_nobody_receives_raises_from_destroy():
    rc, out, err = _job(UNRECEIVED.format(after="axonmpi.distributed.destroy()"))
    assert rc != 0, (out, err)
    assert "RuntimeError: rank 0: 1 send(s) to rank 1 were never received" in err, err


@pytest.mark.serial
def test_a_receive_nobody_sends_is_named_by_the_watchdog():
    rc, out, err = _job(UNSENT)
    assert rc != 0, (out, err)
    assert "in recv #0 on world with group rank 1 at <string>:5" in err, err
    assert "rank 1: it has completed no call on world; it has exited" in err, err


# -- in the test session: the check is quiet in ordinary use ---------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_ordinary_collectives_pass_the_check(world):
    g = world.default_group
    axonmpi.barrier()                      # the group's watched communicator exists from its first call
    ck = g._watched.ck if g._watched is not None else None
    if ck is None:
        pytest.skip("the check is off (AXONMPI_CHECK_COLLECTIVES=0, or the watchdog and recorder are off)")
    before = ck.started
    axonmpi.all_reduce(np.ones(3))
    axonmpi.broadcast(np.ones(2), src=world.world_size - 1)
    axonmpi.all_gather(np.ones(2))
    axonmpi.reduce_scatter(np.ones(2 * world.world_size))
    axonmpi.all_gather(np.ones(world.rank + 1), uneven=True)
    axonmpi.gather(np.ones(world.rank + 1), dst=0)
    axonmpi.all_gather_object(world.rank)
    axonmpi.all_reduce(np.ones(3), async_op=True).wait()
    axonmpi.barrier()
    assert ck.started - before >= 9
    assert ck.started - ck.done <= 1


@pytest.mark.mpi(min_size=2)
def test_mismatch_raises_on_every_rank_in_session(world):
    """Same-size dtypes, sub-group of two: all_reduce completes on both, the check raises on both
    (at the call or at the next one), and the group's communicators stay usable."""
    g = world.new_group([0, 1])
    if g.is_member:
        x = np.ones(2, np.float64 if world.rank == 0 else np.int64)
        with pytest.raises(CollectiveMismatchError) as e:
            axonmpi.all_reduce(x, group=g)
            axonmpi.barrier(group=g)
        text = str(e.value)
        assert "world ranks [0] called all_reduce(count=2, dtype=float64, op=SUM)" in text
        assert "world ranks [1] called all_reduce(count=2, dtype=int64, op=SUM)" in text
        assert axonmpi.all_reduce(np.ones(2), group=g).tolist() == [2.0, 2.0]
    axonmpi.barrier()


OP_MISMATCH = """
import numpy as np, axonmpi
w = axonmpi.init()
x = np.ones(4)
if w.rank == 0:
    axonmpi.all_reduce(x)
else:
    axonmpi.broadcast(x, src=0)
"""


@pytest.mark.serial
def test_different_collectives_that_never_return_are_named_within_seconds():
    """all_reduce on one rank, broadcast on the other: both block in MPI for ever, so nothing can
    raise; the watchdog's monitor sees the completed check and reports at once, not at the deadline."""
    import time
    t0 = time.monotonic()
    rc, out, err = _job(OP_MISMATCH, {"AXONMPI_TIMEOUT": "120"})
    assert rc != 0 and time.monotonic() - t0 < 60, (rc, err)
    assert "They called different collectives (the always-on check found the mismatch" in err, err
    assert "ranks [0] all_reduce(4 x float64) at <string>:6; ranks [1] broadcast(4 x float64) at <string>:8" in err, err


P2P_TRUNCATED = """
import numpy as np, axonmpi
w = axonmpi.init()
if w.rank == 0:
    axonmpi.send(np.ones(5), dst=1)
else:
    axonmpi.recv(np.empty(4), src=0)
"""


@pytest.mark.serial
def test_an_mpi_error_becomes_an_axonmpi_error_naming_the_op():
    rc, out, err = _job(P2P_TRUNCATED)
    assert rc != 0, (out, err)
    assert ("CollectiveMPIError: rank 1: recv #0 on world with group rank 0 (group ranks [0, 1]) at <string>:7 "
            "failed in MPI: Message truncated") in err, err
