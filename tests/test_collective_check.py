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


def _job(code, env=None, n=2, args=()):
    r = run_mpiexec(["-c", code, *args], n=n, timeout=120, env={**FAST, **(env or {})})
    return r.returncode, r.stdout, r.stderr


@pytest.mark.serial
def test_same_size_dtype_mismatch_fails_the_job_naming_both():
    """Batched (the default): the all-reduce completes (the bytes fit) and hands back garbage; the exchange
    at exit names both calls and the job fails (never exit 0)."""
    rc, out, err = _job(DTYPE)
    assert rc != 0, (out, err)
    assert "ranks of world disagree on collective calls #0" in err, err
    assert "world ranks [0] called all_reduce(shape=(4,), dtype=int32, op=SUM) call #0 at <string>:5" in err, err
    assert "world ranks [1] called all_reduce(shape=(4,), dtype=float32, op=SUM) call #0 at <string>:5" in err, err


@pytest.mark.serial
def test_check_every_call_raises_before_the_garbage_is_handed_back():
    rc, out, err = _job(DTYPE, {"AXONMPI_CHECK_EVERY": "1"})
    assert rc != 0 and "CollectiveMismatchError" in err, (out, err)
    assert "world ranks [0] called all_reduce(shape=(4,), dtype=int32, op=SUM) call #0 at <string>:5" in err, err
    assert "[3" not in out and "1077936128" not in out      # no garbage result handed back


@pytest.mark.serial
def test_check_off_is_the_old_silent_garbage():
    rc, out, err = _job(DTYPE, {"AXONMPI_CHECK_COLLECTIVES": "0"})
    assert rc == 0 and "disagree" not in err, err


@pytest.mark.serial
@pytest.mark.parametrize("after", ["axonmpi.barrier()", ""])
def test_broadcast_with_a_different_src_per_rank(after):
    """Both ranks are roots, so the broadcast returns at once; the window is compared at the barrier (an
    exchange point) or at exit. Either way every rank hears of it and the job fails."""
    rc, out, err = _job(SRC.format(after=after))
    assert rc != 0, (out, err)
    assert "world ranks [0] called broadcast(shape=(4,), dtype=float64, root=0) call #0 at <string>:5" in err, err
    assert "world ranks [1] called broadcast(shape=(4,), dtype=float64, root=1) call #0 at <string>:5" in err, err
    if after:
        assert "CollectiveMismatchError" in err, err          # raised by the barrier, not at exit


@pytest.mark.serial
def test_element_count_mismatch_names_the_op():
    """MPICH makes truncation inside a blocking all-reduce fatal whatever the error handler (exit 142):
    the job still fails, and axonmpi names the call the rank died in."""
    rc, out, err = _job(COUNT)
    assert rc != 0, (out, err)
    assert re.search(r"\[axonmpi\] rank \d: the MPI library ended this process inside all_reduce #0 on world "
                     r"\(this rank passed count=[45], dtype=float64\) at <string>:4", err) \
        or "called all_reduce(shape=(5,), dtype=float64, op=SUM)" in err, err


@pytest.mark.serial
def test_element_count_mismatch_non_blocking_names_both_counts():
    rc, out, err = _job(COUNT_ASYNC)
    assert rc != 0, (out, err)
    assert "called all_reduce(shape=(5,), dtype=float64, op=SUM) call #0 at <string>:4" in err, err
    assert "called all_reduce(shape=(4,), dtype=float64, op=SUM) call #0 at <string>:4" in err, err


@pytest.mark.serial
def test_reduce_op_mismatch_on_a_sub_group():
    rc, out, err = _job(SUBGROUP_OP, n=3)
    assert rc != 0, (out, err)
    assert re.search(r"ranks of group\d disagree on collective calls #0", err), err
    assert "world ranks [1] called all_reduce(shape=(3,), dtype=float64, op=MAX)" in err, err
    assert "world ranks [2] called all_reduce(shape=(3,), dtype=float64, op=SUM)" in err, err


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
    before, exchanges = ck.calls, ck.started
    axonmpi.all_reduce(np.ones(3))
    axonmpi.broadcast(np.ones(2), src=world.world_size - 1)
    axonmpi.all_gather(np.ones(2))
    axonmpi.reduce_scatter(np.ones(2 * world.world_size))
    axonmpi.all_gather(np.ones(world.rank + 1), uneven=True)
    axonmpi.gather(np.ones(world.rank + 1), dst=0)
    axonmpi.all_gather_object(world.rank)
    axonmpi.all_reduce(np.ones(3), async_op=True).wait()
    axonmpi.barrier()                      # an exchange point: everything above is compared here
    assert ck.calls - before >= 9 and ck.started > exchanges
    assert not ck.pending and not ck.win


@pytest.mark.mpi(min_size=2)
def test_mismatch_raises_on_every_rank_in_session(world):
    """Same-size dtypes, sub-group of two: all_reduce completes on both, the check raises on both
    (at the next exchange: the barrier), and the group's communicators stay usable."""
    g = world.new_group([0, 1])
    if g.is_member:
        x = np.ones(2, np.float64 if world.rank == 0 else np.int64)
        with pytest.raises(CollectiveMismatchError) as e:
            axonmpi.all_reduce(x, group=g)
            axonmpi.barrier(group=g)
        text = str(e.value)
        assert "world ranks [0] called all_reduce(shape=(2,), dtype=float64, op=SUM)" in text
        assert "world ranks [1] called all_reduce(shape=(2,), dtype=int64, op=SUM)" in text
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
    raise; after a second the watchdog asks the other rank what it is doing and reports at once."""
    import time
    t0 = time.monotonic()
    rc, out, err = _job(OP_MISMATCH, {"AXONMPI_TIMEOUT": "120"})
    assert rc != 0 and time.monotonic() - t0 < 60, (rc, err)
    assert "Cause: ranks of world called different collectives as call #0: " in err, err
    assert ("world ranks [0] all_reduce(shape=(4,), dtype=float64, op=SUM) call #0 at <string>:6; "
            "world ranks [1] broadcast(shape=(4,), dtype=float64, root=0) call #0 at <string>:8") in err, err


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


# -- issue 39: shapes, roots, groups, tags, a skipped save, all-to-all counts; debug mode off ----------------
SHAPES = """
import numpy as np, axonmpi
w = axonmpi.init()
x = np.ones((4, 2)) if w.rank == 0 else np.ones((2, 4))
print(w.rank, axonmpi.{op}(x).shape, flush=True)
"""


@pytest.mark.serial
@pytest.mark.parametrize("op", ["all_reduce", "all_gather"])
def test_same_count_different_shapes_are_named(op):
    """(4, 2) on one rank, (2, 4) on the other: on main silent, exit 0 (caught only with debug on)."""
    rc, out, err = _job(SHAPES.format(op=op))
    assert rc != 0, (out, err)
    kw = "op=SUM" if op == "all_reduce" else ""
    for r, shape in ((0, "(4, 2)"), (1, "(2, 4)")):
        assert f"world ranks [{r}] called {op}(shape={shape}, dtype=float64{', ' + kw if kw else ''}) call #0 at " \
               "<string>:5" in err, err


@pytest.mark.serial
def test_reduce_scatter_with_different_shapes_is_named_not_a_hang():
    """At 4 ranks (4, 2) on rank 0 and (2, 4) elsewhere split into different counts: MPI never returns (on
    main it hung to the deadline, unexplained). The watchdog asks the others after a second and names it."""
    import time
    t0 = time.monotonic()
    rc, out, err = _job(SHAPES.format(op="reduce_scatter"), {"AXONMPI_TIMEOUT": "120"}, n=4)
    assert rc != 0 and time.monotonic() - t0 < 60, (rc, err)
    assert "reduce_scatter(shape=(4, 2), dtype=float64, op=SUM)" in err, err
    assert "reduce_scatter(shape=(2, 4), dtype=float64, op=SUM)" in err, err
    assert "different shapes" in err or "disagree on collective calls #0" in err, err


ROOTS = """
import numpy as np, axonmpi
w = axonmpi.init()
axonmpi.{op}(np.ones(3), dst=w.rank)
"""


@pytest.mark.serial
@pytest.mark.parametrize("op", ["reduce", "gather"])
def test_rooted_collectives_with_different_roots_are_named(op):
    import time
    t0 = time.monotonic()
    rc, out, err = _job(ROOTS.format(op=op), {"AXONMPI_TIMEOUT": "120"})
    assert rc != 0 and time.monotonic() - t0 < 60, (rc, err)
    assert "the same collective with different roots as call #0" in err, err
    assert "root=0) call #0 at <string>:4" in err and "root=1) call #0 at <string>:4" in err, err


GROUPS = """
import numpy as np, axonmpi
w = axonmpi.init()
a, b = w.new_group([0, 1], name="left"), w.new_group([0, 1], name="right")
axonmpi.all_reduce(np.ones(3), group=a if w.rank == 0 else b)
"""


@pytest.mark.serial
def test_two_groups_with_the_same_members_are_named():
    rc, out, err = _job(GROUPS, {"AXONMPI_TIMEOUT": "120"})
    assert rc != 0, (out, err)
    assert re.search(r"(right is a different group with the same members \[0, 1\] as left|"
                     r"left is a different group with the same members \[0, 1\] as right)", err), err


TAGS = """
import time, numpy as np, axonmpi
w = axonmpi.init()
if w.rank == 0:
    axonmpi.recv(np.empty(4), src=1, tag=5)
else:
    axonmpi.send(np.ones(4), dst=0, tag=6)
    time.sleep(60)
"""


@pytest.mark.serial
def test_a_receive_with_a_tag_nobody_sends_is_named():
    # a peer in no call gets IDLE_QUIET_S (30 s) before the verdict; 3 s here (the verdict is the same)
    rc, out, err = _job(TAGS, {"AXONMPI_TIMEOUT": "120", "AXONMPI_WATCHDOG_IDLE_QUIET_S": "3"})
    assert rc != 0, (out, err)
    assert ("world rank 1 sent 1 message(s) to this rank on world with tag(s) [6] (the last at <string>:7) and "
            "none with tag 5, which this rank waits for at <string>:5: a tag nobody sends") in err, err


SKIPPED_SAVE = """
import sys, numpy as np, axonmpi
from axonmpi.checkpoint import CheckpointManager
w = axonmpi.init()
mgr = CheckpointManager(sys.argv[1])
if w.rank != 1:
    mgr.save(1, {{"w": np.ones(2)}})
axonmpi.all_reduce(np.ones(2))
"""


@pytest.mark.serial
def test_a_rank_that_skipped_save_is_named(tmp_path):
    rc, out, err = _job(SKIPPED_SAVE.format(), {"AXONMPI_TIMEOUT": "120"}, n=3, args=[str(tmp_path / "ck")])
    assert rc != 0, (out, err)
    assert "in CheckpointManager.save" in err and "World ranks [1] are not in CheckpointManager.save" in err, err


A2A = """
import numpy as np, axonmpi
from axonmpi.distributed.alltoallv import all_to_all_v
w = axonmpi.init()
p = w.world_size
rc = [1] * p
if w.rank == 1:
    rc[0] = 2                       # rank 1 expects 2 rows from rank 0, which sends 1
out, _ = all_to_all_v(np.full((p, 3), float(w.rank)), [1] * p, rc)
print(w.rank, out.shape, flush=True)
"""


@pytest.mark.serial
@pytest.mark.parametrize("n", [2, 3])
def test_all_to_all_v_receive_counts_that_disagree_with_the_senders_are_named(n):
    """On main a row was dropped silently, exit 0, even with AXONMPI_DEBUG=1. Debug mode off here."""
    rc, out, err = _job(A2A, n=n)
    assert rc != 0, (out, err)
    assert ("the receive counts do not match what the senders send: world rank 1 expects 6 element(s) from "
            "world rank 0, which sends 3") in err, err


BATCHED = """
import numpy as np, axonmpi
w = axonmpi.init()
x = np.ones(2, np.float64 if w.rank == 0 else np.int64)
done = 0
try:
    axonmpi.all_reduce(x)
    for i in range(1000):
        axonmpi.all_reduce(np.ones(2))
        done += 1
except axonmpi.distributed.CollectiveMismatchError as e:
    print(f"rank {{w.rank}} raised after {{done}} more calls", flush=True)
    raise
"""


@pytest.mark.serial
@pytest.mark.parametrize("every", ["8", "64"])
def test_a_batched_mismatch_is_raised_within_two_windows(every):
    """What batching delays: a mismatch at call #0 is raised at the exchange after the next one at the
    latest (2 x AXONMPI_CHECK_EVERY calls), on every rank, naming call #0."""
    rc, out, err = _job(BATCHED.format(), {"AXONMPI_CHECK_EVERY": every})
    assert rc != 0, (out, err)
    done = [int(m) for m in re.findall(r"raised after (\d+) more calls", out)]
    assert len(done) == 2 and max(done) < 2 * int(every), out
    assert "world ranks [1] called all_reduce(shape=(2,), dtype=int64, op=SUM) call #0" in err, err


NOT_A_HANG = """
import time, numpy as np, axonmpi
w = axonmpi.init()
a, b = w.new_group([0, 1], name="a"), w.new_group([0, 1], name="b")
if w.rank == 0:
    axonmpi.all_reduce(np.ones(3), group=a)            # blocked 4 s while rank 1 computes
    axonmpi.all_reduce(np.ones(3), group=b, async_op=True).wait()
else:
    work = axonmpi.all_reduce(np.ones(3), group=b, async_op=True)   # posted on b, not waited for yet
    time.sleep(4)
    axonmpi.all_reduce(np.ones(3), group=a)
    work.wait()
print(f"{w.rank} ok\\n", end="", flush=True)   # one write per rank: two prints may interleave
"""


@pytest.mark.serial
def test_a_long_legitimate_wait_is_not_reported():
    """Rank 0 waits 4 s in a call on group a while rank 1 computes with a call on group b (same members)
    posted: the watchdog's questions see rank 1 blocked in nothing, so no cause is claimed."""
    rc, out, err = _job(NOT_A_HANG, {"AXONMPI_TIMEOUT": "120"})
    assert rc == 0 and "0 ok" in out and "1 ok" in out, (out, err)
    assert "watchdog" not in err, err
