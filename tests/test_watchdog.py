"""Watchdog, flight recorder, timelines and exits (issue 22 items 1-4): hangs and early exits end the job loudly."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import axonmpi
from axonmpi.testing import mpiexec_env, mpiexec_path, run_mpiexec

FAST = {"AXONMPI_TIMEOUT": "3"}

SKIP_IN_LOOP = """
import numpy as np, axonmpi
w = axonmpi.init()
for step in range(6):
    if w.rank == 1 and step == 2:
        continue
    axonmpi.all_reduce(np.array([10.0 * step]))
"""

STUCK_RANK = """
import time, numpy as np, axonmpi
w = axonmpi.init()
axonmpi.all_reduce(np.ones(2))
if w.rank == {late}:
    time.sleep(60)                      # stuck in user code
axonmpi.all_reduce(np.ones(2))
"""

SUBGROUP = """
import time, numpy as np, axonmpi
w = axonmpi.init()
g = w.new_group([0, 1])
if w.rank == 0:
    axonmpi.all_reduce(np.ones(2), group=g)        # rank 1 never joins
elif w.rank == 1:
    time.sleep(60)
"""

P2P = """
import time, numpy as np, axonmpi
w = axonmpi.init()
if w.rank == 0:
    axonmpi.recv(np.empty(4), src=1)               # rank 1 never sends
elif w.rank == 1:
    time.sleep(60)
"""


def _run(code, n, env=None, timeout=60):
    t0 = time.monotonic()
    r = run_mpiexec(["-c", code], n=n, timeout=timeout, env={**FAST, **(env or {})})
    return r, time.monotonic() - t0


@pytest.mark.serial
@pytest.mark.parametrize("n", [2, 3, 4])
def test_skipped_call_is_named_at_every_rank_count(n, tmp_path, capsys):
    r, took = _run(SKIP_IN_LOOP, n, {"AXONMPI_FLIGHT_DIR": str(tmp_path)})
    assert r.returncode != 0
    assert "[axonmpi] watchdog:" in r.stderr
    assert "Behind: rank 1: its last completed call on world was all_reduce #4" in r.stderr
    assert "<string>:7" in r.stderr and "has exited" in r.stderr
    assert took < 20
    from axonmpi.cli import main
    assert main(["trace", "analyze", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "first divergence at call #5" in out and "ranks [1]: never made it" in out


@pytest.mark.serial
def test_debug_mode_skip_in_a_loop_ends_at_the_watchdog_deadline():
    """Debug mode's signature exchange polls, so the watchdog's monitor does not see it: it must
    obey AXONMPI_TIMEOUT too (it waited AXONMPI_DEBUG_TIMEOUT, 300 s, with no word)."""
    r, took = _run(SKIP_IN_LOOP, 3, {"AXONMPI_DEBUG": "1", "AXONMPI_DEBUG_TIMEOUT": "300"})
    assert r.returncode != 0
    assert "waited 3 s in all_reduce" in r.stderr and "world ranks [1] never called it" in r.stderr, r.stderr
    assert took < 25


@pytest.mark.serial
@pytest.mark.parametrize("n", [2, 3, 4])
def test_hang_in_user_code_is_reported_after_the_timeout(n, tmp_path):
    late = n - 1
    r, took = _run(STUCK_RANK.format(late=late), n, {"AXONMPI_FLIGHT_DIR": str(tmp_path)})
    assert r.returncode != 0
    assert f"Behind: rank {late}: its last completed call on world was all_reduce #0 on world at <string>:4" \
        in r.stderr
    assert "it is in no axonmpi call (computing, or stuck in user code; a computation that is this long by design: " \
        "raise the deadline with AXONMPI_TIMEOUT=<seconds> or axonmpi.init(timeout=<seconds>))" in r.stderr
    assert len(set(re.findall(r"\[axonmpi\] watchdog: rank (\d+)", r.stderr))) == 1   # one rank reports
    assert 3 <= took < 25
    for k in range(n):                                           # every rank that can run wrote its record
        rec = json.loads((tmp_path / f"flight_rank{k}.json").read_text())
        assert rec["rank"] == k and rec["calls"][0]["op"] == "all_reduce"


@pytest.mark.serial
def test_subgroup_and_point_to_point_hangs_are_reported():
    r, _ = _run(SUBGROUP, 3)
    assert r.returncode != 0
    assert re.search(r"in all_reduce #0 on group\d+ at <string>:6 \(group ranks \[0, 1\]\)", r.stderr), r.stderr
    assert re.search(r"Behind: rank 1: it has completed no call on group\d+", r.stderr)
    r, _ = _run(P2P, 2)
    assert r.returncode != 0
    assert "in recv #0 on world with group rank 1" in r.stderr and "Behind: rank 1" in r.stderr


EXIT_CODE = """
import os, sys, numpy as np, axonmpi
w = axonmpi.init()
axonmpi.all_reduce(np.ones(2))
if w.rank == 1:
    {how}
axonmpi.all_reduce(np.ones(2))
"""


@pytest.mark.serial
@pytest.mark.parametrize("how", ["sys.exit(3)", "os._exit(0)", "sys.exit(0)"])
def test_one_rank_exiting_early_ends_the_job_non_zero(how):
    r, took = _run(EXIT_CODE.format(how=how), 3, timeout=60)
    assert r.returncode != 0, r.stderr
    assert took < 25


@pytest.mark.serial
def test_sys_exit_zero_everywhere_ends_cleanly():
    r, _ = _run("import sys, numpy as np, axonmpi\naxonmpi.init()\naxonmpi.all_reduce(np.ones(2))\nsys.exit(0)\n", 3)
    assert r.returncode == 0, r.stderr


@pytest.mark.serial
def test_ctrl_c_exits_130_with_one_line():
    code = ("import time, numpy as np, axonmpi\nw = axonmpi.init()\naxonmpi.all_reduce(np.ones(2))\n"
            "if w.rank == 0:\n    print('ready', flush=True)\ntime.sleep(60)\n")
    p = subprocess.Popen([mpiexec_path(), "-n", "3", sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=mpiexec_env(FAST))
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    assert err.count("interrupted (Ctrl-C)") == 1 and "Traceback" not in err


@pytest.mark.serial
def test_error_inside_init_prints_once():
    r, _ = _run("import axonmpi\naxonmpi.init(G_intra_c=5)\n", 3)
    assert r.returncode != 0
    assert r.stderr.count("Traceback") == 1, r.stderr


IGNORED = """
import sys, errno, numpy as np, axonmpi
w = axonmpi.init()
def cleanup():     # what h5py's cleanup does on a full disk: report an error, then go on
    sys.excepthook(OSError, OSError(errno.ENOSPC, "No space left on device"), None)
cleanup()
print(f"rank {w.rank} still alive {axonmpi.all_reduce(np.ones(1))[0]}", flush=True)   # the text in one write: ranks cannot split it
"""


@pytest.mark.serial
def test_an_error_reported_and_ignored_does_not_abort():
    r, _ = _run(IGNORED, 2)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("still alive 2.0") == 2


ENOSPC = """
import errno, os, sys, numpy as np, axonmpi
from axonmpi.checkpoint import write
from axonmpi.distributed.sharding import ShardedArray
w = axonmpi.init()
real = write._write_shard
def full_disk(fname, jobs, rank, fsync, *more):
    if rank == 1:
        sys.excepthook(OSError, OSError(errno.ENOSPC, "No space left on device"), None)   # h5py cleanup
        raise OSError(errno.ENOSPC, "No space left on device", fname)
    return real(fname, jobs, rank, fsync, *more)
write._write_shard = full_disk
state = {{"w": ShardedArray.from_chunks(np.full((2, 3), float(w.rank)), (2 * w.world_size, 3), axis=0)}}
try:
    axonmpi.checkpoint.save({path!r}, state)
except OSError as e:
    sys.stdout.write(f"rank {{w.rank}} raised OSError errno {{e.errno}}\\n")    # one write: lines of ranks don't interleave
    sys.stdout.flush()
"""


@pytest.mark.serial
def test_checkpoint_save_under_enospc_raises_on_every_rank_and_cleans_up(tmp_path):
    path = str(tmp_path / "ckpt")
    r, _ = _run(ENOSPC.format(path=path), 3)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("raised OSError errno 28") == 3, r.stdout + r.stderr
    assert os.listdir(tmp_path) == []                     # no .tmp-* left behind


@pytest.mark.serial
def test_timeline_is_valid_json_and_events_nest(tmp_path):
    code = (f"import numpy as np, axonmpi\nw = axonmpi.init()\nm = axonmpi.nn.Linear(3, 2)\n"
            f"with axonmpi.profile({str(tmp_path)!r}):\n"
            "    loss = m(axonmpi.tensor(np.ones((4, 3), np.float32))).sum()\n"
            "    loss.backward()\n    axonmpi.all_reduce(np.ones(3))\n")
    r, _ = _run(code, 2)
    assert r.returncode == 0, r.stderr
    merged = axonmpi.trace.merge(tmp_path)
    events = [e for e in json.load(open(merged))["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1}
    cats = {e["cat"] for e in events}
    assert {"forward", "backward", "collective"} <= cats
    for pid in (0, 1):                                     # spans on one row never overlap partially
        row = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["pid"] == pid and e["tid"] == 0)
        for (a0, a1), (b0, b1) in zip(row, row[1:]):
            assert b0 >= a1 - 1e-3 or b1 <= a1 + 1e-3


@pytest.mark.mpi(min_size=2)
def test_flight_recorder_records_calls_with_numbers_and_call_sites(world):
    wd = world.watchdog
    if wd is None:
        pytest.skip("watchdog off (AXONMPI_WATCHDOG=0)")
    before = wd.pos
    axonmpi.all_reduce(np.ones(3))
    axonmpi.broadcast(np.ones(2), src=0)
    calls = wd.entries()[-2:]
    assert wd.pos == before + 2
    assert [c[1] for c in calls] == ["all_reduce", "broadcast"]
    assert calls[1][0] == calls[0][0] + 1                  # per-group sequence numbers
    assert all(os.path.basename(c[10]) == "test_watchdog.py" and c[9] is not None for c in calls)
    assert calls[0][6] == 24 and calls[0][2] == "world"


@pytest.mark.mpi(min_size=2)
def test_debug_mode_catches_a_skipped_call_at_the_next_one(world):
    from axonmpi.distributed import CollectiveMismatchError
    old = world.debug
    axonmpi.init(debug=True)                                   # after init: applied, not ignored
    assert world.debug
    try:
        with pytest.raises(CollectiveMismatchError, match="test_watchdog.py"):
            if world.rank != 1:
                axonmpi.all_reduce(np.ones(3))                 # rank 1 skips this one
            else:
                axonmpi.all_reduce(np.ones(3))                 # ... and calls this one instead
    finally:
        world.debug = old


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout=-1 must be a number of seconds > 0"):
        axonmpi.init(timeout=-1)


LATE_MESSAGE = """
import pickle, numpy as np, axonmpi
from axonmpi.distributed import watchdog as W
w = axonmpi.init()
wd = axonmpi.distributed.world.get_world().watchdog
if w.rank == 1:                          # rank 1's monitor has taken its last look
    wd._stop.set(); wd._thread.join()
w.barrier()
if w.rank == 0:                          # ... when rank 0's answer (large: sent by rendezvous) leaves
    wd._post(pickle.dumps((1, {"pad": np.zeros(1 << 18)})), 1, W._PEEKED)
print(w.rank, "ends", flush=True)
"""


@pytest.mark.serial
def test_a_watchdog_message_sent_after_the_peers_last_look_does_not_block_the_exit():
    """A question or answer that reaches a rank after its monitor stopped used to stay unreceived: its
    sender waited in ``Waitall`` for ever while the others sat in ``MPI_Finalize`` (seen once at 16 ranks
    at the end of a test pass). At exit the ranks now count their watchdog messages and receive the rest."""
    r, took = _run(LATE_MESSAGE, 2, env={"AXONMPI_TIMEOUT": "60"}, timeout=60)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "0 ends" in r.stdout and "1 ends" in r.stdout
    assert took < 30, took


@pytest.mark.mpi(min_size=2)
def test_the_exit_notice_counts_calls_the_flight_ring_has_forgotten(world):
    """At the end of the 8-rank N-D pass (all tests passed) a rank waiting in its last collective check on a
    tied "embedding" group was told the exited partner had "completed no call" on it, and the job ended with
    exit 1: the exit notice was read from the flight ring, which had forgotten that group's calls (and keyed
    every group of one name and ranks as one). It is now read from each group's own call counter."""
    from types import SimpleNamespace

    from axonmpi.distributed.watchdog.record import _FINAL, _GROUP, _OP, _RANKS, _SEQ
    wd = world.watchdog
    if wd is None:
        pytest.skip("no watchdog (AXONMPI_TIMEOUT=0)")
    ranks = list(range(world.world_size))
    groups = [world.new_group(ranks, name="tied-twice") for _ in range(2)]
    try:
        for k, g in enumerate(groups):               # 3 calls on the first, 4 on the second
            for _ in range(3 + k):
                axonmpi.all_reduce(np.ones(1), group=g)
        for _ in range(wd.capacity):                  # the ring forgets them
            axonmpi.all_reduce(np.ones(1))
        assert not any(e[_GROUP] == "tied-twice" for e in wd.entries())
        notice = wd._exit_notice()
        key = ("tied-twice", tuple(ranks))
        assert notice[key] == 3, notice.get(key)      # the largest of the two groups' last call numbers
        peer = (world.rank + 1) % world.world_size
        exited = SimpleNamespace(exited={peer: notice})

        def waiting(op, seq):
            e = [None] * 17
            e[_SEQ], e[_OP], e[_GROUP], e[_RANKS] = seq, op, "tied-twice", tuple(ranks)
            return e
        blocked = type(wd)._blocked_by_exit
        assert not blocked(exited, waiting(_FINAL, 4))       # the second group's last exchange: it makes it too
        assert not blocked(exited, waiting(_FINAL, 3))       # the first group's
        assert blocked(exited, waiting("all_reduce", 4))     # a fifth call it never made: found within 1 s
        assert blocked(SimpleNamespace(exited={peer: {}}), waiting(_FINAL, 3))   # a group it never used
    finally:
        for g in groups:
            g.free()
